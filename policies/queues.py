"""The scheduler's three queues, each kept in policy order (`policy.key`, smallest first).

Insertions use bisect (a new arrival or admission usually lands at the tail in O(1)); nothing is
re-sorted, except the queues a policy with keys that change over time names in `Policy.reorders`,
which the scheduler re-sorts (`reorder`) when their order may have changed. The running queue also carries two running totals the scheduler needs every step
without looping over sequences: `running_cost` (sequence slots held against `max_num_seqs`; a
parallel-sampling request holds `n` from admission, before its prompt forks) and `kv_tokens`
(sum of `num_computed_tokens` over running sequences).
"""
from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Callable, Collection
from itertools import islice
from operator import gt
from typing import NamedTuple

from policies.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


def seq_cost(seq: Sequence) -> int:
    """Sequence slots a running sequence holds: n for a parallel-sampling prompt not yet forked."""
    if seq.sample_index == 0 and len(seq.token_ids) == seq.num_prompt_tokens:
        return seq.request.sampling_params.n
    return 1


def _insert(queue: deque[Sequence] | list[Sequence], seq: Sequence, key: Callable[[Sequence], tuple]) -> None:
    if not queue or key(queue[-1]) <= key(seq):
        queue.append(seq)
    else:
        insort(queue, seq, key=key)


class QueueSizes(NamedTuple):
    """The queues' lengths and `kv_tokens` at one moment (a step's trace row)."""

    running: int
    waiting: int
    swapped: int
    kv_tokens: int


class SchedulerQueues:
    def __init__(self, key: Callable[[Sequence], tuple], reorders: Collection[str] = ()) -> None:
        """`reorders`: the queues whose keys may change while sequences sit in them (`check` then
        leaves their order to `reorder`)."""
        self.key = key
        self.reorders = frozenset(reorders)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.running_cost = 0
        self.kv_tokens = 0
        self.running_version = 0  # bumped whenever the running queue changes

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        _insert(self.waiting, seq, self.key)

    def add_swapped(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.SWAPPED
        _insert(self.swapped, seq, self.key)

    def add_running(self, seq: Sequence, cost: int | None = None) -> None:
        """`cost` overrides `seq_cost` (a forked child: its parent already holds its slot)."""
        seq.status = RUNNING
        _insert(self.running, seq, self.key)
        self.running_version += 1
        self.running_cost += seq_cost(seq) if cost is None else cost
        self.kv_tokens += seq.num_computed_tokens

    def remove(self, seq: Sequence) -> None:
        """Take seq out of whichever queue its status says it is in."""
        status = seq.status
        if status is RUNNING:
            self.running.remove(seq)
            self.running_version += 1
            self.running_cost -= seq_cost(seq)
            self.kv_tokens -= seq.num_computed_tokens
        elif status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        else:
            raise ValueError(f"seq {seq.seq_id} has status {status.name}: it is in no queue")

    def reorder(self, names: Collection[str]) -> None:
        """Re-sort the named queues by the keys as they are now (stable: equal keys keep their order).
        The keys are computed once per sequence; an already ordered queue is left as it is."""
        for name in names:
            queue = getattr(self, name)
            if len(queue) < 2:
                continue
            keys = list(map(self.key, queue))
            if not any(map(gt, keys, islice(keys, 1, None))):
                continue
            order = sorted(range(len(queue)), key=keys.__getitem__)
            seqs = [queue[i] for i in order]
            queue.clear()
            queue.extend(seqs)
            if name == "running":
                self.running_version += 1

    def out_of_order(self, names: Collection[str] = ("waiting", "running", "swapped")) -> list[str]:
        """The named queues that are not in key order now."""
        bad = []
        for name in names:
            keys = list(map(self.key, getattr(self, name)))
            if any(map(gt, keys, islice(keys, 1, None))):
                bad.append(name)
        return bad

    def sizes(self) -> QueueSizes:
        return QueueSizes(len(self.running), len(self.waiting), len(self.swapped), self.kv_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def check(self) -> None:
        """Assert the queues are ordered (those not in `reorders`: the others are re-sorted when a
        step begins), disjoint, statuses match, and the totals are exact."""
        bad = self.out_of_order([name for name in ("waiting", "running", "swapped") if name not in self.reorders])
        assert not bad, f"{bad[0]} queue is out of policy order (a key that changes must be in Policy.reorders)"
        for name, queue, status in (("waiting", self.waiting, SequenceStatus.WAITING),
                                    ("running", self.running, RUNNING),
                                    ("swapped", self.swapped, SequenceStatus.SWAPPED)):
            assert all(s.status is status for s in queue), f"{name} queue holds a sequence of another status"
        ids = [id(s) for q in (self.waiting, self.running, self.swapped) for s in q]
        assert len(ids) == len(set(ids)), "a sequence is in two queues (or twice in one)"
        assert self.kv_tokens == sum(s.num_computed_tokens for s in self.running), "kv_tokens drifted"
        assert self.running_cost == sum(seq_cost(s) for s in self.running), "running_cost drifted"
