"""A simulated disaggregated fleet: prefill replicas hand each request, after its first token, to a
decode replica chosen by a second router; its KV blocks move over a priced link.

Built on `FleetSimulator` (fleet.py): the first router routes each arrival among the replicas that
take arrivals (`front`: prefill and mixed; decode replicas never get one). The rules of the hand-off are
policies/disagg/ (`PrefillSide`, `DecodeSide`), run unchanged here as in the engine:

1. A prefill replica's update hands off the requests whose first token it sampled (each replica's
   `after_step` hook picks them up at once, on the same clock).
2. The decode router (any registered router; exact snapshots of the decode replicas) picks a
   decode replica; the hand-off waits in that replica's bounded queue (`handoff_queue`; full:
   abort:handoff_queue_full; older than `handoff_timeout_s`: abort:handoff_timeout) until its
   blocks are allocated there, before any byte moves. Queued hand-offs are retried after each of
   that replica's steps.
3. The transfer queues at the sending replica's link: one SimPy `Resource` of capacity 1 per prefill
   replica (its outgoing link; every tensor-parallel rank sends its shard over its own GPU's link at
   once, so a transfer takes `link.latency_s + bytes per rank / bandwidth`). Transfers from one
   prefill replica go one after another, in the order their blocks were reserved; different prefill
   replicas send in parallel (a receiver's incoming link is not modelled as a bottleneck).
4. At the transfer's end the request joins the decode replica's running batch and the prefill
   replica frees its blocks.

Decode replicas step one by one (no fast-forwarded decode runs: a received request joins at the
time its transfer ends, which a run decided earlier could not know). Decode replicas end once every
front replica (prefill, mixed) has ended and no hand-off is left. Nothing is random outside the
routers' seeded generators: repeated runs give byte-identical traces.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import simpy

from policies.disagg import DecodeSide, KVHandoff, PrefillSide, ReplicaRole
from policies.request import Request
from policies.routing import Router, observe
from sim.fleet.fleet import FleetResult, FleetSimulator, ReplicaSpec
from sim.latency.shapes import Link
from sim.simulator import run_without_gc


class DisaggFleetSimulator(FleetSimulator):
    def __init__(self, replicas: Sequence[ReplicaSpec], roles: Sequence[ReplicaRole], router: Router,
                 decode_router: Router, requests: Iterable[Request], links: Sequence[Link | None],
                 block_bytes: Sequence[int], handoff_queue: int = 64, handoff_timeout_s: float = 60.0,
                 refresh_s: float = 0.0, stop_lens: Mapping[str, int] | None = None,
                 on_done: Callable[[int], None] | None = None, fast_forward: bool = True) -> None:
        """`links[i]` / `block_bytes[i]`: prefill replica i's outgoing link and KV block bytes per
        tensor-parallel rank (None / unused for other roles)."""
        if len(roles) != len(replicas):
            raise ValueError(f"roles={list(roles)!r} has {len(roles)} roles for {len(replicas)} replicas")
        super().__init__(replicas, router, requests, refresh_s, stop_lens, on_done, fast_forward)
        self.roles = tuple(roles)
        self.decode_router = decode_router
        self.front = [r for r, role in zip(self.replicas, roles) if role.takes_arrivals]
        self.decode_ids = [i for i, role in enumerate(roles) if role is ReplicaRole.DECODE]
        self.prefill_sides: dict[int, PrefillSide] = {}
        self.decode_sides: dict[int, DecodeSide] = {}
        self.links: dict[int, tuple[Link, simpy.Resource]] = {}
        self.handoffs: list[KVHandoff] = []  # every hand-off, in the order they were made
        self._pending = 0  # hand-offs not yet received or dropped
        self._front_done = False
        for i, (replica, role) in enumerate(zip(self.replicas, roles)):
            if role is ReplicaRole.PREFILL:
                if links[i] is None:
                    raise ValueError(f"links[{i}] is None: prefill replica {i} needs the link its KV leaves by")
                self.prefill_sides[i] = PrefillSide(replica.scheduler, block_bytes[i], i)
                self.links[i] = (links[i], simpy.Resource(self.env, capacity=1))
                replica.after_step = lambda i=i: self._handed_off(i)
            elif role is ReplicaRole.DECODE:
                self.decode_sides[i] = DecodeSide(replica.scheduler, handoff_queue, handoff_timeout_s, i)
                replica.fast_forward = False
                replica.after_step = lambda i=i: self._admit(i)

    def run(self) -> FleetResult:
        self.env.process(self._arrivals())
        front = [replica.process() for replica in self.front]
        back = [self.replicas[i].process() for i in self.decode_ids]
        self.env.process(self._close_after(front))
        run_without_gc(self.env, self.env.all_of(front + back))
        steps = [replica.num_steps for replica in self.replicas]
        return FleetResult(len(self.requests), sum(steps), self.env.now,
                           [replica.num_routed for replica in self.replicas], steps)

    # ---- hand-offs ---------------------------------------------------------------------------------
    def _handed_off(self, prefill: int) -> None:
        """After a prefill replica's step: route its new hand-offs to decode replicas."""
        now = self.env.now
        for handoff in self.prefill_sides[prefill].take_handoffs():
            self.handoffs.append(handoff)
            self._pending += 1
            snapshots = [observe(i, self.replicas[i].scheduler, self.replicas[i].num_outstanding, now, False)
                         for i in self.decode_ids]
            target = self.decode_router.route(handoff.request, snapshots)
            self.replicas[target].num_routed += 1
            side = self.decode_sides[target]
            if not side.enqueue(handoff, now):
                self._drop(handoff, "handoff_queue_full")
                continue
            self.env.timeout(side.timeout_s).callbacks.append(lambda _, d=target: self._expire(d))
            self._admit(target)

    def _admit(self, decode: int) -> None:
        """Reserve blocks on a decode replica for the queued hand-offs that fit; start their transfers."""
        reserved, never = self.decode_sides[decode].reserve_ready(self.env.now)
        for handoff in never:
            self._drop(handoff, "too_long")
        for handoff in reserved:
            self.env.process(self._transfer(handoff))

    def _expire(self, decode: int) -> None:
        for handoff in self.decode_sides[decode].expire(self.env.now):
            self._drop(handoff, "handoff_timeout")

    def _drop(self, handoff: KVHandoff, reason: str) -> None:
        """A hand-off that never reaches its decode replica: aborted, its row written by the prefill replica."""
        side, now = self.prefill_sides[handoff.prefill_replica], self.env.now
        side.abort(handoff.request_id, reason, now)
        side.finish_transfer(handoff, now)
        self.replicas[handoff.prefill_replica].wake()  # its blocks are free again
        self.replicas[handoff.decode_replica].num_left += 1
        self._settled()

    def _transfer(self, handoff: KVHandoff):
        link, resource = self.links[handoff.prefill_replica]
        with resource.request() as turn:
            yield turn
            handoff.transfer_start_time = self.env.now
            yield self.env.timeout(link.transfer_time(handoff.num_bytes))
        now, decode = self.env.now, handoff.decode_replica
        received = self.decode_sides[decode].receive(handoff, now)
        self.prefill_sides[handoff.prefill_replica].finish_transfer(handoff, now)
        self.replicas[handoff.prefill_replica].wake()  # its blocks are free again
        if received is None:
            self.replicas[decode].num_left += 1
        else:
            self.replicas[handoff.prefill_replica].num_left += 1
            self.replicas[decode].wake()
        self._settled()

    # ---- ending ------------------------------------------------------------------------------------
    def _close_after(self, front: list[simpy.Process]):
        yield self.env.all_of(front)
        self._front_done = True
        self._settled(0)

    def _settled(self, num: int = 1) -> None:
        """`num` hand-offs are received or dropped; with the front done and none left, the decode
        replicas can end."""
        self._pending -= num
        if self._front_done and not self._pending:
            for i in self.decode_ids:
                self.replicas[i].close()
