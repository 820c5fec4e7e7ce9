"""Property tests: random programs of block-manager calls, in the order a scheduler makes them
(swap-outs and recompute preemptions, then swap-ins, admissions, appends; then the step runs;
then update: mark_computed, fork at the end of the prompt, finish and free), against a model of
the KV memory itself. Every block copy, swap and forward write is applied to fake GPU/CPU slots,
and every forward checks that the positions it attends to hold that sequence's own KV (so sharing,
copy-on-write, prefix hits, swap mirrors and contiguous fork copies are checked for content, not
only for accounting). `check_invariants` runs after every step; at the end everything is free.
"""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_settings import examples

from policies.blocks import BLOCK_MANAGERS, AllocStatus, make_block_manager
from policies.request import Request, SamplingParams
from policies.sequence import Sequence

BASES = [[7, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]


def kv(tokens: list[int], position: int) -> int:
    """What the forward writes at `position`: depends on the whole prefix, like real KV."""
    return hash(tuple(tokens[:position + 1]))


class Harness:
    def __init__(self, kind: str, rng: random.Random) -> None:
        self.rng = rng
        self.bs = rng.choice([1, 2, 4])
        self.max_model_len = rng.choice([None, 24, 40])
        self.mgr = make_block_manager(kind, self.bs, rng.randint(4, 40), rng.randint(0, 16),
                                      watermark=rng.choice([0.0, 0.1]), max_model_len=self.max_model_len)
        self.gpu = [[None] * self.bs for _ in range(self.mgr.num_gpu_blocks)]
        self.cpu = [[None] * self.bs for _ in range(self.mgr.num_cpu_blocks)]
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.next_id = 0

    def live(self) -> list[Sequence]:
        return self.waiting + self.running + self.swapped

    def add_request(self) -> None:
        rng = self.rng
        prompt = rng.choice(BASES)[:rng.randint(0, 12)] + [rng.randrange(4) for _ in range(rng.randint(0, 8))]
        request = Request(f"r{self.next_id}", prompt or [0],
                          SamplingParams(max_tokens=rng.randint(1, 12), n=rng.choice([1, 1, 2, 3])))
        self.waiting.append(Sequence.from_request(self.next_id, request))
        self.next_id += 1

    def abort_one(self) -> None:
        queues = [q for q in (self.waiting, self.running, self.swapped) if q]
        if queues:
            queue = self.rng.choice(queues)
            self.mgr.free(queue.pop(self.rng.randrange(len(queue))))

    def step(self) -> None:
        rng, mgr = self.rng, self.mgr
        swap_out: dict[int, int] = {}
        swap_in: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        # 1. preemption (before anything is appended this step)
        for seq in list(self.running):
            if rng.random() < 0.3:
                self.running.remove(seq)
                if rng.random() < 0.6 and mgr.can_swap_out(seq):
                    mapping = mgr.swap_out(seq)
                    assert not swap_out.keys() & mapping.keys()
                    swap_out.update(mapping)
                    self.swapped.append(seq)
                else:
                    mgr.free(seq)
                    seq.num_computed_tokens = 0
                    self.waiting.append(seq)
        # 2. swap in and 3. admission, either before appending for the running sequences or (as
        # vLLM v0 does) after it, appending for the newcomers right away
        scheduled: list[tuple[Sequence, int]] = []
        newcomers_first = rng.random() < 0.5
        if newcomers_first:
            self.admit(swap_in)
        copies += self.append_all(self.running, scheduled)
        if not newcomers_first:
            copies += self.append_all(self.admit(swap_in), scheduled)
        self.execute(swap_out, swap_in, copies, scheduled)
        self.update(scheduled)
        mgr.check_invariants(self.live())

    def admit(self, swap_in: dict[int, int]) -> list[Sequence]:
        rng, mgr = self.rng, self.mgr
        admitted = []
        for seq in list(self.swapped):
            if rng.random() < 0.5 and mgr.can_swap_in(seq) is AllocStatus.OK:
                mapping = mgr.swap_in(seq)
                assert not swap_in.keys() & mapping.keys(), "one CPU block swapped in twice"
                swap_in.update(mapping)
                self.swapped.remove(seq)
                admitted.append(seq)
        for seq in list(self.waiting):
            status = mgr.can_allocate(seq)
            if status is AllocStatus.NEVER:
                self.waiting.remove(seq)  # aborted as too_long
            elif status is AllocStatus.OK and rng.random() < 0.7:
                mgr.allocate(seq)
                assert seq.num_uncomputed_tokens >= 1
                self.waiting.remove(seq)
                admitted.append(seq)
        self.running += admitted
        return admitted

    def append_all(self, seqs: list[Sequence], scheduled: list[tuple[Sequence, int]]) -> list[tuple[int, int]]:
        """Slots for this step's chunks: decodes as one batch (sometimes), the rest one by one."""
        rng, mgr = self.rng, self.mgr
        copies: list[tuple[int, int]] = []
        done = {id(seq) for seq, _ in scheduled}
        decodes = [s for s in seqs if s.num_uncomputed_tokens == 1 and id(s) not in done]
        batch = mgr.append_decode_slots(decodes) if decodes and rng.random() < 0.5 else None
        if batch is not None:
            copies += batch
            scheduled += [(s, 1) for s in decodes]
            done |= {id(s) for s in decodes}
        for seq in seqs:
            if id(seq) in done or rng.random() < 0.2:
                continue
            chunk = min(seq.num_uncomputed_tokens, rng.randint(1, 8))
            if mgr.can_append_slots(seq, chunk):
                copies += mgr.append_slots(seq, chunk)
                scheduled.append((seq, chunk))
        return copies

    def execute(self, swap_out, swap_in, copies, scheduled) -> None:
        """The backend's order: swap out, swap in, copy (each as one parallel batch), forward."""
        for src_mem, dst_mem, pairs in ((self.gpu, self.cpu, swap_out.items()),
                                        (self.cpu, self.gpu, swap_in.items()), (self.gpu, self.gpu, copies)):
            data = [(dst, list(src_mem[src])) for src, dst in pairs]
            assert len({dst for dst, _ in data}) == len(data), "two copies into one block"
            for dst, values in data:
                dst_mem[dst] = values
        written: set[int] = set()
        for seq, chunk in scheduled:
            table, bs, start = seq.block_table, self.bs, seq.num_computed_tokens
            for p in range(start):
                got = self.gpu[table[p // bs]][p % bs]
                assert got == kv(seq.token_ids, p), f"seq {seq.seq_id} reads wrong KV at position {p}"
            for p in range(start, start + chunk):
                slot = table[p // bs] * bs + p % bs
                assert slot not in written, f"two sequences write slot {slot} in one step"
                written.add(slot)
                self.gpu[table[p // bs]][p % bs] = kv(seq.token_ids, p)

    def update(self, scheduled: list[tuple[Sequence, int]]) -> None:
        rng, mgr = self.rng, self.mgr
        for seq, chunk in scheduled:
            seq.num_computed_tokens += chunk
            mark_first = rng.random() < 0.5
            if mark_first:
                mgr.mark_computed(seq)
            if seq.num_uncomputed_tokens == 0:
                samples = [seq]
                n = seq.request.sampling_params.n
                if seq.num_output_tokens == 0 and seq.sample_index == 0 and n > 1:
                    for i in range(1, n):
                        child = seq.fork(self.next_id, sample_index=i)
                        self.next_id += 1
                        mgr.fork(seq, child)
                        self.running.append(child)
                        samples.append(child)
                for s in samples:
                    s.token_ids.append(rng.randrange(4))
            if not mark_first:
                mgr.mark_computed(seq)
        for seq in list(self.running):
            full = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
            if seq.num_output_tokens >= seq.request.sampling_params.max_tokens or full:
                self.running.remove(seq)
                mgr.free(seq)

    def drain(self) -> None:
        for seq in self.live():
            self.mgr.free(seq)
        self.waiting, self.running, self.swapped = [], [], []
        usage = self.mgr.usage()
        assert usage.gpu_used == 0 and usage.cpu_used == 0, f"leak: {usage}"
        self.mgr.check_invariants([])


@pytest.mark.parametrize("kind", BLOCK_MANAGERS.names())
@settings(max_examples=examples(120), deadline=None)
@given(rng=st.randoms(use_true_random=False), num_steps=st.integers(5, 40))
def test_random_programs_keep_invariants_and_kv_contents(kind, rng, num_steps):
    harness = Harness(kind, rng)
    for _ in range(num_steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            harness.add_request()
        if rng.random() < 0.1:
            harness.abort_one()
        harness.step()
    harness.drain()
