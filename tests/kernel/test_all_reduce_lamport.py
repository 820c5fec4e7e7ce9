"""The barrier-free one-shot all-reduce (kernels/all_reduce_lamport.py) in the CPU interpreter: one
process plays one rank, its peers' areas are separate tensors whose addresses go in the slot
table, and their pushes are played by writing into this rank's area before the call (as if the
peers had pushed). Checked: the sum in rank order (float32, rounded once) and engine/models/ops.py's
add_rms_norm on the summed rows; this rank's values in each peer's slot of the round; the slots it
read all sentinel afterwards; -0.0 sent as +0.0. On two GPUs: tests/device/test_triton_all_reduce_gpu.py."""
from __future__ import annotations

import pytest
import torch

from engine.models.ops import add_rms_norm
from kernels.all_reduce_lamport import (
    ROUNDS,
    SENTINEL,
    LamportSlots,
    fill_sentinel,
    lamport_all_reduce,
    lamport_all_reduce_add_rms_norm,
)

SLOT = 4096  # bytes
PROGRAMS = 3  # fewer programs than blocks: the grid-stride loops run
DTYPE = torch.float16  # the interpreter mis-rounds bf16; the sentinel is the same bits in both


class FakeAreas:
    """`world` ranks' Lamport areas in this process, all sentinel."""

    def __init__(self, world: int) -> None:
        self.areas = [torch.zeros(LamportSlots.area_bytes(world, SLOT), dtype=torch.uint8) for _ in range(world)]
        for area in self.areas:
            fill_sentinel(area)

    def slots(self, rank: int) -> LamportSlots:
        return LamportSlots(tuple(a.data_ptr() for a in self.areas), rank, SLOT)

    def slot(self, owner: int, round_: int, sender: int) -> torch.Tensor:
        """Slot `sender` of round `round_` in rank `owner`'s area, as 16-bit elements."""
        world = len(self.areas)
        start = (round_ * world + sender) * SLOT
        return self.areas[owner][start:start + SLOT].view(torch.int16)

    def push_as_peers(self, rank: int, round_: int, parts: list[torch.Tensor]) -> None:
        """What the peers' pushes of a call in `round_` leave in rank `rank`'s area."""
        for r, part in enumerate(parts):
            if r != rank:
                self.slot(rank, round_, r)[:part.numel()].copy_(part.reshape(-1).view(torch.int16))


def _parts(world: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(DTYPE) for _ in range(world)]


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(DTYPE)


def _check_exchange(fake: FakeAreas, rank: int, round_: int, parts: list[torch.Tensor]) -> None:
    world = len(fake.areas)
    sent = parts[rank].reshape(-1).view(torch.int16)
    for peer in range(world):
        if peer != rank:
            landed = fake.slot(peer, round_, rank)
            assert torch.equal(landed[:sent.numel()], sent), f"rank {rank}'s values in peer {peer}'s slot"
            assert (landed[sent.numel():] == SENTINEL).all(), "pushed beyond the message"
    own = fake.areas[rank].view(torch.int16)
    assert (own == SENTINEL).all(), "the slots read were not all cleared to the sentinel"


@pytest.mark.parametrize(("world", "rank", "rows", "hidden"), [(2, 0, 1, 32), (2, 0, 7, 64), (2, 1, 5, 48),
                                                               (3, 1, 4, 16)])
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_fused_sums_pushes_and_clears(world, rank, rows, hidden, round_):
    parts = _parts(world, (rows, hidden), seed=rows * hidden + round_)
    residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(DTYPE)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(8)) + 0.5).to(DTYPE)
    fake = FakeAreas(world)
    fake.push_as_peers(rank, round_, parts)
    out, new_residual = lamport_all_reduce_add_rms_norm(fake.slots(rank), round_, PROGRAMS, parts[rank], residual,
                                                        weight, 1e-6)
    want_out, want_residual = add_rms_norm(_sum(parts), residual, weight, 1e-6)
    assert torch.equal(new_residual, want_residual), "the new residual differs"
    torch.testing.assert_close(out, want_out, rtol=1e-3, atol=1e-3)
    _check_exchange(fake, rank, round_, parts)


@pytest.mark.parametrize(("world", "rank", "numel"), [(2, 0, 8), (2, 1, 1000), (3, 2, 2040)])
def test_plain_sums_pushes_and_clears(world, rank, numel):
    parts = _parts(world, (numel,), seed=numel)
    fake = FakeAreas(world)
    fake.push_as_peers(rank, 1, parts)
    out = lamport_all_reduce(fake.slots(rank), 1, PROGRAMS, parts[rank])
    assert torch.equal(out, _sum(parts))
    _check_exchange(fake, rank, 1, parts)


def test_negative_zero_is_sent_as_positive_zero():
    parts = _parts(2, (64,), seed=3)
    parts[0][::3] = -0.0
    fake = FakeAreas(2)
    fake.push_as_peers(0, 2, parts)
    out = lamport_all_reduce(fake.slots(0), 2, PROGRAMS, parts[0])
    landed = fake.slot(1, 2, 0)[:64]
    assert (landed[::3] == 0).all() and not (landed == SENTINEL).any()
    assert torch.equal(out, _sum(parts))
    assert torch.equal(parts[0].view(torch.int16)[::3], torch.full((22,), SENTINEL, dtype=torch.int16))  # input kept


def test_messages_and_tables_it_does_not_take_are_refused():
    fake = FakeAreas(2)
    with pytest.raises(ValueError, match="takes contiguous"):
        lamport_all_reduce(fake.slots(0), 0, PROGRAMS, torch.zeros(8))  # float32
    with pytest.raises(ValueError, match="takes contiguous"):
        lamport_all_reduce(fake.slots(0), 0, PROGRAMS, torch.zeros(SLOT, dtype=DTYPE))  # larger than a slot
    with pytest.raises(ValueError, match=r"round=3 is invalid"):
        fake.slots(0).push(3)
    with pytest.raises(ValueError, match="slot_bytes=24 is invalid"):
        LamportSlots((16, 32), 0, 24)
    with pytest.raises(ValueError, match="16-byte aligned"):
        LamportSlots((16, 40), 0, 32)
    with pytest.raises(ValueError, match="inconsistent"):
        LamportSlots((16, 32), 2, 32)
