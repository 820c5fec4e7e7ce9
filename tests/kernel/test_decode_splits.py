"""The split-count rule of the split-KV decode kernels (kernels/decode_splits.py)."""
import pytest

from kernels.decode_splits import ORDERED_SINGLE_SPLIT_WAVES, splits_for

SLOTS = 528  # an H200's 132 SMs x 4 programs


def test_fill_rule_splits_a_part_full_last_wave() -> None:
    # 176 sequences x 8 KV heads: 2.67 waves at one split (last wave 2/3 full); four splits fill 97%
    assert splits_for(176 * 8, 4096, SLOTS, 256, ordered=False) == 4


def test_longest_first_with_two_waves_takes_one_split() -> None:
    assert splits_for(176 * 8, 4096, SLOTS, 256, ordered=True) == 1
    assert splits_for(ORDERED_SINGLE_SPLIT_WAVES * SLOTS, 4096, SLOTS, 256, ordered=True) == 1


@pytest.mark.parametrize("programs", [64, 100 * 8, ORDERED_SINGLE_SPLIT_WAVES * SLOTS - 1])
def test_below_two_waves_the_order_changes_nothing(programs: int) -> None:
    assert splits_for(programs, 4096, SLOTS, 256, ordered=True) == splits_for(programs, 4096, SLOTS, 256, ordered=False)


def test_small_batches_split_but_never_finer_than_the_minimum() -> None:
    assert splits_for(8, 4096, SLOTS, 256, ordered=True) == 16  # 4096 / 256 chunks at most
    assert splits_for(8, 512, SLOTS, 256, ordered=True) == 2
    assert splits_for(8, 200, SLOTS, 256, ordered=True) == 1
