"""The Triton all-reduce choice (`ParallelConfig.all_reduce_kernel`) on the CPU: the setting's
errors and where it is set; the dispatch of `SymmetricAllReduce` to the Triton kernels (run by the
interpreter over a mirrored stand-in peer table: two ranks holding the same message), their
pacing; the fused layer boundary's fallbacks; and a tensor-parallel shard of tiny-qwen3 whose
hidden states are the same with the fused boundary as without it. On two GPUs:
tests/device/test_triton_all_reduce_gpu.py."""
from __future__ import annotations

import pytest
import torch

from engine.distributed.parallel_state import TPGroup
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from engine.engine_args import EngineArgs
from engine.models.ops import add_rms_norm
from engine.parallel_config import ALL_REDUCE_KERNELS, ParallelConfig
from tests.symmetric_memory_helpers import FakeSymmOps, counting_events, mirrored_lamport, mirrored_peers

KiB = 2**10


@pytest.mark.parametrize("make", [lambda v: ParallelConfig(all_reduce_kernel=v),
                                  lambda v: EngineArgs(all_reduce_kernel=v)], ids=["ParallelConfig", "EngineArgs"])
@pytest.mark.parametrize("value", ["nccl", "Triton", None, 1])
def test_an_unknown_kernel_is_refused_naming_the_field(make, value):
    with pytest.raises(ValueError, match=rf"all_reduce_kernel={value!r} is invalid: one of \('auto', 'torch', 'triton', "):
        make(value)


def test_auto_is_the_lamport_boundary_at_two_ranks_and_torchs_kernels_elsewhere():
    assert ParallelConfig().all_reduce_kernel == EngineArgs().all_reduce_kernel == "auto"
    assert [ParallelConfig().kernel_for(n) for n in (1, 2, 4, 8)] == ["torch", "triton_lamport", "torch", "torch"]
    for kernel in ("torch", "triton", "triton_fused", "triton_lamport"):  # a named kernel is taken at every size
        assert {ParallelConfig(all_reduce_kernel=kernel).kernel_for(n) for n in (2, 4)} == {kernel}


def test_the_default_is_auto_and_each_kernel_reaches_the_engine():
    from experiments.lib.engine_backend import engine_args
    from experiments.lib.fidelity_spec import compose_cfg

    config = ["backend=engine", "model=tiny-qwen3", "blocks.num_gpu_blocks=64", "backend.device=cpu", "scheduler.max_model_len=1024"]
    assert engine_args(compose_cfg(config)).parallel_config().all_reduce_kernel == "auto"
    from engine.serve import engine_args_from, parse_args

    for kernel in ALL_REDUCE_KERNELS:
        args = engine_args(compose_cfg([*config, f"parallel.all_reduce_kernel={kernel}"]))
        assert args.parallel_config().all_reduce_kernel == kernel
        server = engine_args_from(parse_args(["--model", "tiny-qwen3", f"all_reduce_kernel={kernel}"]))
        assert server.parallel_config().all_reduce_kernel == kernel


def _custom(kernel: str, nbytes: int = 16 * KiB, regions: int = 1) -> tuple[SymmetricAllReduce, object]:
    buffer = torch.zeros(regions * nbytes, dtype=torch.uint8)
    if kernel == "triton_lamport":
        return mirrored_lamport(buffer, nbytes)
    peers, pads = (None, None) if kernel == "torch" else mirrored_peers(buffer)
    custom = SymmetricAllReduce(buffer, "g", nbytes, nbytes, ops=FakeSymmOps(), peers=peers,
                                fused=kernel == "triton_fused", regions=regions)
    return custom, pads


def test_the_triton_kernels_sum_instead_of_torchs():
    custom, _pads = _custom("triton")
    x = torch.randn(8, 64)
    torch.testing.assert_close(custom.all_reduce(x), 2 * x)
    assert custom.ops.calls == []  # torch's ops were not called


def test_the_fused_kernel_needs_the_triton_peers():
    with pytest.raises(ValueError, match="peer buffers"):
        SymmetricAllReduce(torch.zeros(64, dtype=torch.uint8), "g", 64, 64, fused=True)


@pytest.mark.parametrize("kernel", ["triton", "triton_fused", "triton_lamport"])
def test_triton_launches_are_paced_as_torchs(kernel, monkeypatch):
    """Rank 0's bound on eager launches holds for the Triton kernels, fused and Lamport ones included."""
    from engine.distributed.symmetric_all_reduce import PACE_LAG

    counting_events(monkeypatch)
    custom, _pads = _custom(kernel)
    waited = []
    custom.pace = lambda event: waited.append(event.n)
    dtype = torch.bfloat16 if kernel == "triton_lamport" else torch.float32  # the Lamport kernel's messages
    x, residual, weight = (torch.randn(4, 32, dtype=dtype), torch.randn(4, 32, dtype=dtype),
                           torch.ones(32, dtype=dtype))
    for _ in range(5):
        if kernel != "triton":
            assert custom.all_reduce_add_rms_norm(x, residual, weight, 1e-6) is not None
        else:
            custom.all_reduce(x)
    assert waited == list(range(1, 5 - PACE_LAG + 1))


@pytest.mark.parametrize(("kernel", "shape", "fused"), [
    ("triton_fused", (4, 32), True),
    ("triton", (4, 32), False),  # the option off
    ("triton_fused", (4, 32 * KiB // 4), False),  # NCCL's size: larger than the buffer
    ("triton_fused", (2, 2, 32), False),  # not rows of the hidden size
])
def test_the_group_fuses_where_it_can_and_else_reduces_then_norms(kernel, shape, fused, monkeypatch):
    import torch.distributed as dist

    custom, _pads = _custom(kernel)
    group = TPGroup(0, 2, None, None, custom)
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: x.mul_(2))  # NCCL's sum of 2 equal ranks
    x = torch.randn(shape)
    residual, weight = torch.randn(shape), torch.rand(shape[-1]) + 0.5
    taken = custom.all_reduce_add_rms_norm(x.clone(), residual, weight, 1e-6) is not None
    assert taken == fused
    out, new_residual = group.all_reduce_add_rms_norm(x.clone(), residual, weight, 1e-6,
                                                      lambda h, r, w: add_rms_norm(h, r, w, 1e-6))
    want_out, want_residual = add_rms_norm(2 * x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, want_residual)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def _shard_hidden(kernel: str, regions: int = 1, forwards: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank 0's shard of tiny-qwen3 (of 2) over a stand-in group of 2 ranks holding the same
    partial sums: its final hidden states for one 11-token prefill (run `forwards` times), the
    model in `dtype`."""
    from engine.device.attention import attention_ops
    from engine.device.input_batch import build_model_input
    from engine.device.weights import init_dummy
    from engine.distributed.sharding import TPShard
    from engine.model_loader import load_model_config
    from engine.models.llama import ShardedLlamaForCausalLM
    from engine.models.parallel_layers import TPContext
    from policies.outputs import ScheduledSeq
    from policies.request import SamplingParams
    from tests.engine_model_helpers import BlockAllocator, make_seqs, random_prompts

    cfg = load_model_config("tiny-qwen3")
    custom, _pads = _custom(kernel, nbytes=64 * KiB, regions=regions)  # the pads live until the forward is done
    model = ShardedLlamaForCausalLM(cfg, attention_ops("reference", torch.device("cpu")),
                                    tp=TPContext(TPShard.of(cfg, 0, 2), TPGroup(0, 2, None, None, custom)))
    init_dummy(model, seed=1)
    model.to(dtype)
    local = model.layers[0].self_attn
    shape = (64, 4, local.num_kv_heads, local.head_dim)
    model.bind_kv_cache([torch.zeros(shape, dtype=dtype) for _ in model.layers],
                        [torch.zeros(shape, dtype=dtype) for _ in model.layers])
    seqs = make_seqs(random_prompts([11], cfg.vocab_size, seed=2), SamplingParams())
    alloc = BlockAllocator(4, 64)
    alloc.ensure(seqs[0], 11)
    batch = build_model_input([ScheduledSeq(seqs[0], 11, 0)], 4, torch.device("cpu"))
    with torch.no_grad():
        for _ in range(forwards - 1):
            model(batch.input_ids, batch.positions, batch.meta)
        return model(batch.input_ids, batch.positions, batch.meta)


def test_a_shard_with_the_fused_boundary_computes_the_same_hidden_states(monkeypatch):
    import kernels.all_reduce as triton_all_reduce

    calls = []
    for name in ("one_shot_all_reduce", "one_shot_all_reduce_add_rms_norm"):
        real = getattr(triton_all_reduce, name)
        monkeypatch.setattr(triton_all_reduce, name,
                            lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    unfused = _shard_hidden("triton")
    unfused_calls = calls[:]
    calls.clear()
    fused = _shard_hidden("triton_fused")
    fused_calls = calls
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
    layers = 2  # tiny-qwen3: every o_proj and down_proj sum goes into the next norm
    assert unfused_calls.count("one_shot_all_reduce") == 1 + 2 * layers  # the embedding's, then each layer's two
    assert fused_calls.count("one_shot_all_reduce") == 1  # the embedding's only
    assert fused_calls.count("one_shot_all_reduce_add_rms_norm") == 2 * layers  # the final norm's included


def test_with_regions_no_two_consecutive_calls_share_one_and_none_closes(monkeypatch):
    """Each forward's first call (the embedding's) stages into region 0, the rest alternate 1, 2;
    the kernels leave out their closing barrier; the hidden states are those of one region."""
    import kernels.all_reduce as triton_all_reduce
    from engine.distributed.symmetric_all_reduce import REGIONS

    seen = []
    for name in ("one_shot_all_reduce", "one_shot_all_reduce_add_rms_norm"):
        real = getattr(triton_all_reduce, name)

        def spy(peers, staged, *a, _f=real, close=True, **kw):
            seen.append(((staged.data_ptr() - peers.buffers[peers.rank]) // (64 * KiB), close))
            return _f(peers, staged, *a, close=close, **kw)

        monkeypatch.setattr(triton_all_reduce, name, spy)
    one = _shard_hidden("triton_fused")
    assert seen == [(0, True)] * 5
    seen.clear()
    regioned = _shard_hidden("triton_fused", regions=REGIONS, forwards=2)
    torch.testing.assert_close(regioned, one, rtol=0, atol=0)
    assert seen == [(r, False) for r in (0, 1, 2, 1, 2)] * 2  # the same sequence in every forward
    with pytest.raises(ValueError, match=r"regions=2 is invalid: 1, or 3 with the Triton"):
        SymmetricAllReduce(torch.zeros(64, dtype=torch.uint8), "g", 64, 64, regions=2)
    with pytest.raises(ValueError, match=r"regions=3 is invalid"):
        SymmetricAllReduce(torch.zeros(64, dtype=torch.uint8), "g", 64, 64, regions=3)


def _spy_lamport(monkeypatch) -> list[tuple[str, int]]:
    """(which Lamport kernel, its round) of every call, in order."""
    import engine.distributed.lamport_all_reduce as lamport

    seen = []
    for name in ("lamport_all_reduce", "lamport_all_reduce_add_rms_norm"):
        real = getattr(lamport, name)
        monkeypatch.setattr(lamport, name, lambda slots, round_, *a, _f=real, _n=name:
                            seen.append((_n, round_)) or _f(slots, round_, *a))
    return seen


def test_a_shard_with_the_lamport_kernel_computes_what_the_fused_one_does(monkeypatch):
    """bf16 (the Lamport kernel's dtype): each forward's rounds go 0, 1, 2, 1, 2 (the embedding's
    plain sum first, then the layer boundaries fused), and the hidden states are the fused
    kernel's (both kernels in the interpreter, the same arithmetic)."""
    seen = _spy_lamport(monkeypatch)
    fused = _shard_hidden("triton_fused", dtype=torch.bfloat16)
    assert seen == []
    lamport = _shard_hidden("triton_lamport", forwards=2, dtype=torch.bfloat16)
    torch.testing.assert_close(lamport, fused, rtol=0, atol=0)
    plain, norm = "lamport_all_reduce", "lamport_all_reduce_add_rms_norm"
    assert seen == [(plain, 0), (norm, 1), (norm, 2), (norm, 1), (norm, 2)] * 2


def test_the_lamport_kernel_takes_bf16_and_leaves_the_rest_to_the_other_paths(monkeypatch):
    import torch.distributed as dist

    from engine.distributed.all_reduce_path import ONE_SHOT

    seen = _spy_lamport(monkeypatch)
    custom, _keep = _custom("triton_lamport", nbytes=1 * KiB)
    area = custom.area.view(torch.int16)
    assert (area == -32768).all()  # filled with the sentinel
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert custom.input_buffer((4, 32), torch.bfloat16) is None  # the GEMM writes anywhere
    torch.testing.assert_close(custom.all_reduce(x), 2 * x, rtol=0, atol=0)
    assert (area == -32768).all()  # the slot it read is clean again
    staged = custom.input_buffer((4, 32), torch.float32)  # float32: the barrier kernels, in the region
    assert staged is not None and staged.data_ptr() == custom.buffer.data_ptr()
    f32 = torch.randn(4, 32)
    torch.testing.assert_close(custom.all_reduce(f32), 2 * f32)
    assert custom.path_for(f32) == ONE_SHOT and custom.closes
    assert custom.all_reduce(torch.randn(4, 32, dtype=torch.float16)) is None  # NCCL's, as choose_path says
    assert custom.all_reduce(torch.randn(2 * KiB, dtype=torch.bfloat16)) is None  # beyond a slot: NCCL's
    wide = torch.randn(1, 16 * KiB + 16, dtype=torch.bfloat16)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: t)
    assert custom.all_reduce_add_rms_norm(x, x.clone(), torch.ones(32, dtype=torch.bfloat16), 1e-6) is not None
    assert custom.all_reduce_add_rms_norm(wide, wide.clone(), torch.ones(wide.shape[1]), 1e-6) is None
    assert [r for _, r in seen] == [0, 1]
    custom.begin_forward()
    assert custom.round() == 0  # a forward of two calls ended on round 1
    custom.all_reduce(x)
    custom.begin_forward()  # one call since: its round 0 must not be the next one's
    assert custom.round() == 1
    assert custom.kernel == "triton_lamport"


def test_the_lamport_kernel_needs_the_triton_peers_and_room_for_its_rounds():
    from engine.distributed.lamport_all_reduce import LamportAllReduce
    from kernels.all_reduce_lamport import LamportSlots

    slots = LamportSlots((16, 32), 0, 64)
    area = torch.zeros(LamportSlots.area_bytes(2, 64) - 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="peer buffers"):
        LamportAllReduce(torch.zeros(64, dtype=torch.uint8), area, slots, "g", 64, 64)
    buffer = torch.zeros(64, dtype=torch.uint8)
    peers, _pads = mirrored_peers(buffer)
    with pytest.raises(ValueError, match=r"the Lamport area has 368 bytes: 3 rounds x 2 ranks x 64 bytes need 384"):
        LamportAllReduce(buffer, area, slots, "g", 64, 64, peers=peers)


def test_a_model_without_tensor_parallelism_keeps_plain_norms():
    import kernels.reference as ref
    from engine.device.weights import build_model
    from engine.model_loader import load_model_config
    from engine.models.llama import RMSNorm

    model = build_model(load_model_config("tiny-qwen3"), ref, "cpu", torch.float32)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is RMSNorm for m in norms)
    assert all(type(layer.self_attn.o_proj) is torch.nn.Linear for layer in model.layers)


def test_a_run_records_whose_kernels_summed_unless_torchs():
    from engine.distributed.all_reduce_path import AllReducePath

    assert "kernel" not in AllReducePath(2, 1024, 4096).record()  # the records of earlier runs, unchanged
    assert AllReducePath(2, 1024, 4096, kernel="triton_fused").record()["kernel"] == "triton_fused"
    assert "triton kernels" in AllReducePath(2, 1024, 4096, kernel="triton").describe()
