"""The all-reduce's path choice and its fallbacks, on the CPU: which sizes go one-shot, two-shot or
NCCL; the settings' errors; every reason the symmetric-memory paths stay off (with the log line);
the dispatch through a stand-in for torch's `symm_mem` ops (the GPU kernels themselves are
checked against NCCL in tests/device/test_custom_all_reduce_gpu.py)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import engine.distributed.custom_all_reduce as car
from engine.distributed.all_reduce_path import NCCL, ONE_SHOT, TWO_SHOT, choose_path
from engine.distributed.custom_all_reduce import open_symmetric_all_reduce, unavailable_reason
from engine.distributed.parallel_state import TPGroup, init_group, open_store
from engine.distributed.symmetric_all_reduce import SymmetricAllReduce
from engine.engine_args import EngineArgs
from engine.models.parallel_layers import RowParallelLinear
from engine.parallel_config import ParallelConfig
from tests.symmetric_memory_helpers import FakeSymmOps, counting_events

KiB, MiB = 2**10, 2**20
GPU1 = torch.device("cuda", 1)  # a device object only: nothing here touches a GPU


@pytest.mark.parametrize(("nbytes", "dtype", "contiguous", "path"), [
    (16, torch.bfloat16, True, ONE_SHOT),
    (64 * KiB, torch.bfloat16, True, ONE_SHOT),  # the one-shot bound is inclusive
    (64 * KiB + 16, torch.bfloat16, True, TWO_SHOT),
    (MiB, torch.float32, True, TWO_SHOT),  # the two-shot bound is inclusive
    (MiB + 16, torch.bfloat16, True, NCCL),
    (1024, torch.float16, True, NCCL),  # the kernels implement bf16 and float32 only
    (1024, torch.bfloat16, False, NCCL),
    (6, torch.bfloat16, True, NCCL),  # not a whole number of 4-byte vectors
    (0, torch.bfloat16, True, NCCL),
])
def test_the_path_by_size_dtype_and_layout(nbytes, dtype, contiguous, path):
    assert choose_path(nbytes, dtype, contiguous, one_shot_max=64 * KiB, two_shot_max=MiB) == path


def test_one_shot_bound_defaults_by_world_size():
    cfg = ParallelConfig()
    assert cfg.one_shot_max_bytes(2) == 2**20  # measured: two-shot wins from 2 MiB on 2 GPUs
    assert cfg.one_shot_max_bytes(4) == 512 * KiB
    assert cfg.one_shot_max_bytes(8) == 256 * KiB
    assert ParallelConfig(custom_all_reduce_one_shot_max_bytes=4096).one_shot_max_bytes(2) == 4096
    assert ParallelConfig(custom_all_reduce_max_bytes=128 * KiB).one_shot_max_bytes(4) == 128 * KiB


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"custom_all_reduce_max_bytes": -16}, "custom_all_reduce_max_bytes=-16"),
    ({"custom_all_reduce_max_bytes": "8MB"}, "custom_all_reduce_max_bytes='8MB'"),
    ({"custom_all_reduce_max_bytes": True}, "custom_all_reduce_max_bytes=True"),
    ({"custom_all_reduce_max_bytes": 2**31}, "custom_all_reduce_max_bytes=2147483648"),
    ({"custom_all_reduce_one_shot_max_bytes": 1000}, "custom_all_reduce_one_shot_max_bytes=1000"),
    ({"custom_all_reduce_one_shot_max_bytes": 16 * MiB}, "custom_all_reduce_one_shot_max_bytes=16777216"),
    ({"disable_custom_all_reduce": "yes"}, "disable_custom_all_reduce='yes'"),
])
def test_a_bad_setting_is_refused_naming_its_key(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=named):  # EngineArgs checks them when built
        EngineArgs(**kwargs)


@pytest.mark.parametrize(("parallel", "device", "size", "said"), [
    (ParallelConfig(disable_custom_all_reduce=True), GPU1, 2, "disable_custom_all_reduce is set"),
    (ParallelConfig(disable_custom_all_reduce=False), GPU1, 1, "one rank"),
    (ParallelConfig(disable_custom_all_reduce=False), torch.device("cpu"), 2, "gloo"),  # never on CPUs
    (ParallelConfig(disable_custom_all_reduce=False), GPU1, 3, "world size 3"),
    (ParallelConfig(custom_all_reduce_max_bytes=0, disable_custom_all_reduce=False), GPU1, 2, "custom_all_reduce_max_bytes=0"),
])
def test_why_the_symmetric_paths_stay_off(parallel, device, size, said):
    assert said in unavailable_reason(parallel, device, 1, size)


# Where the flag is set: a run config (Hydra) and the server's command line, besides EngineArgs.
CONFIG = ["backend=engine", "model=tiny-qwen3", "blocks.num_gpu_blocks=64", "backend.device=cpu", "scheduler.max_model_len=1024"]


def _from_config(*overrides: str) -> bool:
    from experiments.lib.engine_backend import engine_args
    from experiments.lib.fidelity_spec import compose_cfg

    return engine_args(compose_cfg([*CONFIG, *overrides])).disable_custom_all_reduce


def _from_server_cli(*argv: str) -> bool:
    from engine.serve import engine_args_from, parse_args

    return engine_args_from(parse_args(["--model", "tiny-qwen3", *argv])).disable_custom_all_reduce


def _peers_present(monkeypatch):
    """A torch with the ops and GPUs with peer access, as on an NVLink board."""
    monkeypatch.setattr(car, "symmetric_memory", lambda: object())
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)


def test_the_symmetric_paths_are_on_by_default_everywhere(monkeypatch):
    """One default (engine/config.py's DISABLE_CUSTOM_ALL_REDUCE, False as in vLLM) wherever the flag
    is set: the engine, its arguments, a run config (conf/config.yaml leaves it null: the engine's)
    and the server's command line; with it, two GPUs that can take the paths do."""
    from omegaconf import OmegaConf

    from experiments.lib.config_groups import Parallel
    from experiments.lib.paths import REPO_ROOT

    assert ParallelConfig().disable_custom_all_reduce is False
    assert EngineArgs().disable_custom_all_reduce is False
    assert EngineArgs().parallel_config().disable_custom_all_reduce is False
    assert Parallel().disable_custom_all_reduce is None
    assert OmegaConf.load(REPO_ROOT / "conf" / "config.yaml").parallel.disable_custom_all_reduce is None
    assert _from_config() is False
    assert _from_server_cli() is False
    _peers_present(monkeypatch)
    assert unavailable_reason(ParallelConfig(2), GPU1, 1, 2) is None
    assert unavailable_reason(EngineArgs(tensor_parallel_size=2).parallel_config(), GPU1, 1, 2) is None


@pytest.mark.parametrize("where", ["EngineArgs", "run config", "server flag", "server override"])
def test_each_off_switch_sends_every_all_reduce_through_nccl(where, monkeypatch):
    disabled = {"EngineArgs": lambda: EngineArgs(disable_custom_all_reduce=True).disable_custom_all_reduce,
                "run config": lambda: _from_config("parallel.disable_custom_all_reduce=true"),
                "server flag": lambda: _from_server_cli("--disable-custom-all-reduce"),
                "server override": lambda: _from_server_cli("disable_custom_all_reduce=true")}[where]()
    assert disabled is True
    _peers_present(monkeypatch)
    assert unavailable_reason(ParallelConfig(2, disable_custom_all_reduce=disabled), GPU1, 1, 2) == \
        "disable_custom_all_reduce is set"


def test_a_torch_without_symmetric_memory_ops_stays_on_nccl(monkeypatch):
    monkeypatch.setattr(car, "symmetric_memory", lambda: None)
    assert "no torch.distributed._symmetric_memory" in unavailable_reason(ParallelConfig(disable_custom_all_reduce=False), GPU1, 1, 2)


def test_this_torch_has_the_ops_used():
    assert car.symmetric_memory() is not None, "torch.ops.symm_mem lacks " + ", ".join(car.REQUIRED_OPS)


def test_gloo_ranks_stay_on_gloo_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="servelab.engine"):
        custom, path = open_symmetric_all_reduce(ParallelConfig(2, disable_custom_all_reduce=False, all_reduce_kernel="torch"),
                                                 torch.device("cpu"), 0, 2, "g", lambda v: v)
    assert custom is None
    assert "custom all-reduce off: device cpu is not a GPU (gloo carries the all-reduces)" in caplog.text
    assert path.record() == {"path": NCCL, "world_size": 2, "reason": "device cpu is not a GPU (gloo carries the all-reduces)"}


def test_one_rank_that_cannot_keeps_every_rank_on_nccl(monkeypatch, caplog):
    monkeypatch.setattr(car, "unavailable_reason", lambda *a: None)  # this rank could
    with caplog.at_level(logging.INFO, logger="servelab.engine"):
        custom, path = open_symmetric_all_reduce(ParallelConfig(2, disable_custom_all_reduce=False, all_reduce_kernel="torch"), GPU1, 0, 2, "g",
                                                 lambda v: 0)  # another rank cannot
    assert custom is None and path.off_reason == "another rank cannot use symmetric memory"
    assert "another rank cannot use symmetric memory" in caplog.text


def test_a_failed_buffer_set_up_falls_back_on_every_rank(monkeypatch, caplog):
    agreed = []

    def agree(v):
        agreed.append(v)
        return v

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA driver error: invalid argument")

    monkeypatch.setattr(car, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(car, "_allocate", refuse)
    with caplog.at_level(logging.INFO, logger="servelab.engine"):
        custom, path = open_symmetric_all_reduce(ParallelConfig(2, disable_custom_all_reduce=False, all_reduce_kernel="torch"), GPU1, 0, 2, "g", agree)
    assert custom is None and path.off_reason.startswith("the symmetric buffer could not be set up")
    assert agreed == [1, 0]  # the ranks agree before allocating and after
    assert "could not be set up: RuntimeError: CUDA driver error: invalid argument" in caplog.text


class FakeSymmetricMemory:
    """torch's symmetric-memory module as `_allocate` uses it."""

    def empty(self, size, dtype, device):
        return torch.zeros(size, dtype=dtype)

    def rendezvous(self, buffer, group_name):
        return ("handle", group_name)


def test_a_second_engine_in_a_process_stays_on_nccl_with_the_reason(monkeypatch, caplog):
    """torch's rendezvous keeps per-process state that a new engine's fresh workers do not share:
    a second set-up in the user's process would wait for good, so it is not tried."""
    monkeypatch.setattr(car, "symmetric_memory", lambda: FakeSymmetricMemory())
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda *a: True)
    monkeypatch.setattr(car, "_rendezvous_joined", False)
    parallel = ParallelConfig(2, disable_custom_all_reduce=False, all_reduce_kernel="torch")
    first, path = open_symmetric_all_reduce(parallel, GPU1, 0, 2, "0", lambda v: v)
    assert first is not None and first.handle == ("handle", "0")
    assert path.record() == {"path": "symmetric", "world_size": 2, "one_shot_max_bytes": parallel.one_shot_max_bytes(2),
                             "two_shot_max_bytes": parallel.custom_all_reduce_max_bytes}
    assert "earlier engine" in unavailable_reason(parallel, GPU1, 0, 2)
    with caplog.at_level(logging.INFO, logger="servelab.engine"):
        assert open_symmetric_all_reduce(parallel, GPU1, 0, 2, "0", lambda v: v)[0] is None
    assert "custom all-reduce off: this process set up symmetric memory for an earlier engine" in caplog.text


def test_a_cpu_group_has_no_symmetric_paths():
    group = init_group(open_store(1, 10), 0, 1, torch.device("cpu"), 10)
    try:
        assert group.custom is None and group.reduce_input((4, 8), torch.float32) is None
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _custom(one_shot_max=1 * KiB, two_shot_max=4 * KiB) -> SymmetricAllReduce:
    return SymmetricAllReduce(torch.zeros(two_shot_max, dtype=torch.uint8), "g", one_shot_max, two_shot_max,
                              ops=FakeSymmOps())


@pytest.mark.parametrize(("rows", "path"), [(8, ONE_SHOT), (16, TWO_SHOT), (64, NCCL)])
def test_messages_go_by_size_through_the_buffer(rows, path):
    custom = _custom()
    x = torch.randn(rows, 32)  # float32: 128 bytes a row
    out = custom.all_reduce(x)
    if path == NCCL:
        assert out is None and custom.ops.calls == []
        return
    assert custom.ops.calls == [(path, custom.buffer.data_ptr())]  # copied into the symmetric buffer
    torch.testing.assert_close(out, 2 * x)
    assert out.data_ptr() != custom.buffer.data_ptr()  # the sum outlives the buffer's next use


def test_a_row_parallel_gemm_writes_into_the_buffer_and_sums_without_a_copy(monkeypatch):
    custom = _custom()
    layer = RowParallelLinear(16, 24, False, TPGroup(0, 2, None, None, custom))
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(4, 16)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, *a: copies.append(t.data_ptr()) or real_copy(t, src, *a))
    with torch.no_grad():  # as the engine runs it
        y = layer(x)
    torch.testing.assert_close(y, 2 * F.linear(x, layer.weight))
    assert custom.ops.calls == [(ONE_SHOT, custom.buffer.data_ptr())]
    assert custom.buffer.data_ptr() not in copies  # nothing copied in: the GEMM wrote there


def test_a_message_too_large_for_the_buffer_takes_nccl():
    custom = _custom(one_shot_max=1 * KiB, two_shot_max=4 * KiB)
    assert custom.input_buffer((64, 32), torch.float32) is None  # 8 KiB
    assert custom.input_buffer((8, 32), torch.float32).data_ptr() == custom.buffer.data_ptr()


def test_the_benchmark_picks_thresholds_from_graph_timings():
    from experiments.bench_allreduce import thresholds

    def row(nbytes, nccl, one, two, mode="graph"):
        return {"bytes": nbytes, "mode": mode, "nccl_us": nccl, "one-shot_us": one, "two-shot_us": two}

    rows = [row(1024, 20, 5, 8), row(2048, 20, 6, 8), row(4096, 20, 9, 8), row(8192, 20, 7, 8),  # two-shot won once
            row(16384, 20, 25, 19), row(32768, 20, 30, 24), row(65536, 10, 5, 5),  # past the first NCCL win
            row(1024, 1, 50, 50, mode="eager")]  # eager rows do not count
    assert thresholds(rows) == (2048, 16384)
    assert thresholds([row(1024, 5, 6, 7)]) == (0, 0)  # NCCL faster from the start: symmetric paths off


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "capturing"])
def test_rank0_paces_eager_launches_behind_the_kernels_before(capturing, monkeypatch):
    """Outside a graph capture each symmetric-memory kernel first waits (through `pace`, bounded by
    rank 0's step wait) for the one PACE_LAG kernels back, so a step launched behind a kernel that
    spins for good never fills the launch queue; a capture records no event and waits for none."""
    from engine.distributed.symmetric_all_reduce import PACE_LAG

    event = counting_events(monkeypatch, capturing)
    custom = _custom()
    waited = []
    custom.pace = lambda event: waited.append(event.n)
    for _ in range(5):
        custom.all_reduce(torch.randn(8, 32))
    lag = PACE_LAG
    assert len(custom.ops.calls) == 5
    assert waited == ([] if capturing else list(range(1, 5 - lag + 1)))
    assert event.made == (0 if capturing else 5)
