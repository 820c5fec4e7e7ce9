"""The Triton all-reduce kernels (kernels/all_reduce.py) in the CPU interpreter, one process playing
one rank over stand-in peer buffers (CPU tensors whose addresses go in the peer table), their
barriers compiled out (`barrier=False`: one process cannot play two ranks); with one rank the
barrier runs for real and must leave the result and the signal pads as without it. Checked
against torch: the sum in rank order (float32, rounded once), and engine/models/ops.py's
add_rms_norm on the summed rows. On two GPUs: tests/device/test_triton_all_reduce_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch

from engine.models.ops import add_rms_norm
from kernels.all_reduce import (
    PeerBuffers,
    one_shot_all_reduce,
    one_shot_all_reduce_add_rms_norm,
    two_shot_all_reduce,
)

# The interpreter mis-rounds bf16 (tests/kernel/test_kernels_qk_rope.py): float32 and float16 here.
DTYPES = [torch.float32, torch.float16]
MAX_PROGRAMS = 3  # fewer programs than blocks: the grid-stride loops run


def _ranks(world: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]


class FakeGroup:
    """`world` ranks' symmetric buffers (each holding its rank's message at byte `offset`) and zeroed
    signal pads, in this process."""

    def __init__(self, parts: list[torch.Tensor], offset: int = 0, programs: int = MAX_PROGRAMS) -> None:
        nbytes = parts[0].numel() * parts[0].element_size()
        self.buffers = [torch.zeros(offset + nbytes + 64, dtype=torch.uint8) for _ in parts]
        self.staged = [b[offset:offset + nbytes].view(p.dtype).view(p.shape) for b, p in zip(self.buffers, parts)]
        for s, p in zip(self.staged, parts):
            s.copy_(p)
        self.pads = [torch.zeros(len(parts) * programs, dtype=torch.int32) for _ in parts]
        self.programs = programs

    def peers(self, rank: int, barrier: bool = False) -> PeerBuffers:
        return PeerBuffers(tuple(b.data_ptr() for b in self.buffers), tuple(p.data_ptr() for p in self.pads), rank,
                           self.buffers[0].numel(), self.programs, barrier)


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(parts[0].shape, dtype=torch.float32)
    for p in parts:
        total += p.float()
    return total.to(parts[0].dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("world", "numel", "offset"), [(2, 8, 0), (2, 1000, 0), (3, 4100, 32), (4, 96, 16)])
def test_one_shot_sums_every_rank_in_rank_order(world, numel, offset, dtype):
    parts = _ranks(world, (numel,), dtype, seed=numel)
    group = FakeGroup(parts, offset)
    want = _sum(parts)
    for rank in range(world):
        out = one_shot_all_reduce(group.peers(rank), group.staged[rank], torch.empty_like(parts[0]))
        assert torch.equal(out, want), f"rank {rank}: max error {(out.float() - want.float()).abs().max():.3g}"
    for s, p in zip(group.staged, parts):
        assert torch.equal(s, p)  # one-shot leaves the buffers as they were


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("world", "numel"), [(2, 8), (2, 1000), (3, 4100), (4, 64)])
def test_two_shot_sums_each_slice_then_gathers_them(world, numel, dtype):
    """Ranks run one after another here, so rank q finds the slices of ranks < q already summed
    (as a barrier would have it) and the last rank's output is the whole sum; each rank's own
    slice of its buffer holds that slice's sum."""
    parts = _ranks(world, (numel,), dtype, seed=numel + 1)
    group = FakeGroup(parts)
    want = _sum(parts)
    for rank in range(world):
        out = two_shot_all_reduce(group.peers(rank), group.staged[rank], torch.empty_like(parts[0]))
    assert torch.equal(out, want), f"max error {(out.float() - want.float()).abs().max():.3g}"
    part = math.ceil(math.ceil(numel / world) / 16) * 16
    for rank in range(world):
        own = slice(rank * part, min((rank + 1) * part, numel))
        assert torch.equal(group.staged[rank][own], want[own]), f"rank {rank}'s slice"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("world", "rows", "hidden"), [(2, 1, 32), (2, 7, 64), (3, 5, 48), (4, 4, 16)])
def test_fused_add_rms_norm_equals_all_reduce_then_add_rms_norm(world, rows, hidden, dtype):
    parts = _ranks(world, (rows, hidden), dtype, seed=rows * hidden)
    residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(8)) + 0.5).to(dtype)
    group = FakeGroup(parts)
    want_out, want_res = add_rms_norm(_sum(parts), residual, weight, 1e-6)
    for rank in range(world):
        out, res = one_shot_all_reduce_add_rms_norm(group.peers(rank), group.staged[rank], residual, weight, 1e-6)
        assert torch.equal(res, want_res), f"rank {rank}: the new residual differs"
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        err = (out.float() - want_out.float()).abs().max().item()
        assert torch.allclose(out, want_out, rtol=tol, atol=tol), f"rank {rank}: max error {err:.3g}"


def _run_each(kernel: str, group: FakeGroup, barrier: bool):
    staged, peers = group.staged[0].clone(), group.peers(0, barrier)
    group.staged[0].copy_(staged)
    if kernel == "fused":
        ones = torch.ones(staged.shape[-1])
        return one_shot_all_reduce_add_rms_norm(peers, group.staged[0], torch.ones_like(staged), ones, 1e-6)
    fn = one_shot_all_reduce if kernel == "one-shot" else two_shot_all_reduce
    return (fn(peers, group.staged[0].view(-1), torch.empty(staged.numel())),)


@pytest.mark.parametrize("kernel", ["one-shot", "two-shot", "fused"])
def test_the_barrier_flag_gates_the_barrier_only(kernel):
    """One rank meets only itself: its barriers run through the signal pad and must leave it zero
    and the result as with them compiled out."""
    parts = _ranks(1, (9, 32), torch.float32, seed=3)
    group = FakeGroup(parts)
    without = _run_each(kernel, group, barrier=False)
    group.staged[0].copy_(parts[0])
    with_barrier = _run_each(kernel, group, barrier=True)
    for a, b in zip(without, with_barrier):
        assert torch.equal(a, b)
    assert not group.pads[0].any(), "the barriers left signals in the pad"


def test_a_tensor_outside_the_buffer_is_refused():
    parts = _ranks(2, (16,), torch.float32, seed=5)
    group = FakeGroup(parts)
    with pytest.raises(ValueError, match="byte offset"):
        one_shot_all_reduce(group.peers(0), parts[0], torch.empty(16))
    with pytest.raises(ValueError, match="inconsistent"):
        PeerBuffers((16, 32), (3,), 0, 64, 4)
    with pytest.raises(ValueError, match="16-byte aligned"):
        PeerBuffers((16, 40), (3, 4), 0, 64, 4)
