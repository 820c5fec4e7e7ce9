"""A simulated disaggregated fleet: prefill replicas hand each request, after its first token, to a
decode replica chosen by a second router; its KV blocks move over a priced link.

Built on `FleetSimulator` (fleet.py): the first router routes each arrival among the replicas that
take arrivals (`front`: prefill and mixed; decode replicas never get one). The rules of the hand-off are
policies/disagg/ (`PrefillSide`, `DecodeSide`), run unchanged here as in the engine:

1. A prefill replica's update hands off the requests whose first token it sampled (each replica's
   `after_step` hook picks them up at once, on the same clock); they reach the decode side together.
2. The decode router (any registered router; exact snapshots of the decode replicas) picks a
   decode replica; the hand-off waits in that replica's queue, its KV held by the prefill replica
   (backpressure; `handoff_queue`, where set, bounds it: full, abort:handoff_queue_full; older than
   `handoff_timeout_s`: abort:handoff_timeout) until a sequence slot and its blocks are allocated
   there, before any byte moves. Queued hand-offs are retried after each of that replica's steps.
3. The hand-offs a decode replica reserves at once move as one message per prefill replica, up to
   `batch_blocks` blocks (`transfer_batches`, the engine pair's rule). A message queues at the sending
   replica's link: one SimPy `Resource` of capacity 1 per prefill replica (its outgoing link; every
   tensor-parallel rank sends its shard over its own GPU's link at once, so a message takes
   `link.latency_s + link.overhead_s + bytes per rank / bandwidth`). Messages from one prefill
   replica go one after another, in the order their blocks were reserved; different prefill
   replicas send in parallel (a receiver's incoming link is not modelled as a bottleneck).
4. At the message's end its requests join the decode replica's running batch and the prefill
   replica frees their blocks.

The host's share of a hand-off (`HandoffHost`, sim/fleet/front_host.py; `cluster.handoff_hop_s` and
`cluster.handoff_step_boundaries`): the engine pair runs each side in its own process, one host
loop each, that acts between its engine's steps and talks to the other over a pipe. So a hand-off
reaches the decode side `hop_s` after the prefill side's message leaves (after its host work on
the step's hand-offs: `per_handoff_s` each and `sent_message_s`, from the prefill step's end) and
is admitted there when the decode replica's running step ends (`decode_wait`); its `Reserved`
answer reaches the prefill side `hop_s` later and the send is posted then, during the prefill
replica's running step, its host time spent while the host waits for the step
(`sends_mid_step`, the engine pair's default; an answer that arrives during the host work between
two steps waits for the next step's launch, when the loop waits for the device again: with a
profile's launch units, until `launch_s` + `launch_prompt_s` per prompt after that step starts, and
so does one that arrives in a step before then), or when that step ends (`link_wait`);
the decode side notices the received KV when its running step ends (`link_time`). With
`step_boundaries=False` and `hop_s=0` each side acts at once (the transfer is the link's alone).
With `admits_between_steps` a synchronous prefill replica also pays the latency model's `admission_s`
for each request routed to it during a step before its next step: the front's loop admits arrivals
between its steps (the requests themselves reach its scheduler after their admission either way).

What a message costs the engines beside the link (`receive`, a `KVReceivePrice`:
`cluster.kv_receive_profile`, sim/latency/kv_receive.py; None: nothing), and what a synchronous
prefill replica's loop pays to post it (`send_host_s`): sim/fleet/kv_messages.py. A front host
profile (`HandoffHost.from_profile`, sim/fleet/front_host.py) prices a prefill replica's loop unit
by unit as measured on the engine pair's front: per step, per request admitted, per hand-off, per
KV message posted (instead of `send_host_s`), per message to the decode side, per decode-step
message read back.

Decode replicas step one by one (no fast-forwarded decode runs: a received request joins at the
time its transfer ends, which a run decided earlier could not know). Scheduling ahead, it joins
the step after the one running, still scheduled ahead (`scheduler.join_ahead`: the scheduler's
rule, policies/lookahead.py, as on the engine pair's decode engine). Decode replicas end once every
front replica (prefill, mixed) has ended and no hand-off is left. Nothing is random outside the
routers' seeded generators: repeated runs give byte-identical traces.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import simpy

from policies.disagg import DecodeSide, KVHandoff, PrefillSide, ReplicaRole, transfer_batches
from policies.request import Request
from policies.routing import Router, observe
from sim.fleet.busy_link import BusyLinkCharge
from sim.fleet.fleet import FleetResult, FleetSimulator, ReplicaSpec
from sim.fleet.front_host import HandoffHost
from sim.fleet.front_reads import FrontReadPrice, FrontReads, output_request_ids
from sim.fleet.kv_messages import KVMessages
from sim.latency.kv_receive import KVReceivePrice
from sim.latency.shapes import Link
from sim.simulator import run_without_gc


class DisaggFleetSimulator(KVMessages, FleetSimulator):
    def __init__(self, replicas: Sequence[ReplicaSpec], roles: Sequence[ReplicaRole], router: Router,
                 decode_router: Router, requests: Iterable[Request], links: Sequence[Link | None],
                 block_bytes: Sequence[int], handoff_queue: int | None = None, handoff_timeout_s: float = 60.0,
                 refresh_s: float = 0.0, stop_lens: Mapping[str, int] | None = None,
                 on_done: Callable[[int], None] | None = None, fast_forward: bool = True,
                 host: HandoffHost | None = None, batch_blocks: int = 512,
                 receive: KVReceivePrice | None = None, front_reads: FrontReadPrice | None = None,
                 final_outputs_only: bool = False) -> None:
        """`links[i]` / `block_bytes[i]`: prefill replica i's outgoing link and KV block bytes per
        tensor-parallel rank (None / unused for other roles); `host`: the host loops' share of a
        hand-off (default `HandoffHost()`); `batch_blocks`: blocks of one KV message, at most;
        `receive`: what a message costs the engines beside the link (None: nothing); `front_reads`:
        what reading the decode outputs costs a prefill replica's loop (sim/fleet/front_reads.py);
        `final_outputs_only`: every request's outputs are read only at its end, whatever its
        `output_kind` (as the fidelity harness's engine runs read them)."""
        if len(roles) != len(replicas):
            raise ValueError(f"roles={list(roles)!r} has {len(roles)} roles for {len(replicas)} replicas")
        super().__init__(replicas, router, requests, refresh_s, stop_lens, on_done, fast_forward)
        self.roles = tuple(roles)
        self.host = HandoffHost() if host is None else host
        transfer_batches([], batch_blocks)  # checks it
        self.batch_blocks = batch_blocks
        self.decode_router = decode_router
        self.front = [r for r, role in zip(self.replicas, roles) if role.takes_arrivals]
        self.decode_ids = [i for i, role in enumerate(roles) if role is ReplicaRole.DECODE]
        self.prefill_sides: dict[int, PrefillSide] = {}
        self.decode_sides: dict[int, DecodeSide] = {}
        self.links: dict[int, tuple[Link, simpy.Resource]] = {}
        self.handoffs: list[KVHandoff] = []  # every hand-off, in the order they were made
        self._pending = 0  # hand-offs not yet received or dropped
        self._front_done = False
        self.receive = receive
        # decode replica -> its incoming messages' wire, priced by `busy_factor` (sim/fleet/busy_link.py)
        self._receive_wire: dict[int, BusyLinkCharge] = {}
        # prefill replica -> its outgoing messages' wire, priced by `send_busy_factor`
        self._send_wire: dict[int, BusyLinkCharge] = {}
        self._scatter_due: dict[int, float] = {}  # decode replica -> scatters its next step waits for
        self._send_host_due: dict[int, float] = {}  # prefill replica -> host time of sends it posted
        self._admitted: dict[int, int] = {}  # prefill replica -> requests routed there by its last step's end
        self._reads = FrontReads(front_reads) if front_reads is not None and front_reads.on else None
        self._final_outputs_only = final_outputs_only
        for i, (replica, role) in enumerate(zip(self.replicas, roles)):
            if role is ReplicaRole.PREFILL:
                if links[i] is None:
                    raise ValueError(f"links[{i}] is None: prefill replica {i} needs the link its KV leaves by")
                self.prefill_sides[i] = PrefillSide(replica.scheduler, block_bytes[i], i)
                self.links[i] = (links[i], simpy.Resource(self.env, capacity=1))
                replica.after_step = lambda i=i: self._handed_off(i)
                if receive is not None and receive.prices_send_busy_link:
                    self._send_wire[i] = charge = BusyLinkCharge(receive.send_busy_factor)
                    replica.extra_step_s = lambda step_s, c=charge: max(0.0, c.surcharge(self.env.now, step_s))
            elif role is ReplicaRole.DECODE:
                self.decode_sides[i] = DecodeSide(replica.scheduler, handoff_queue, handoff_timeout_s, i)
                replica.fast_forward = False
                replica.after_step = lambda i=i: self._decode_stepped(i)
                if receive is not None:
                    if receive.prices_busy_link:
                        self._receive_wire[i] = BusyLinkCharge(receive.busy_factor)
                    replica.extra_step_s = lambda step_s, i=i: self._receive_surcharge(i, step_s)

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
    def _handed_off(self, prefill: int) -> float:
        """After a prefill replica's step: route its new hand-offs to decode replicas; returns the
        host time they cost that replica's loop (`HandoffHost.per_handoff_s` each)."""
        now = self.env.now
        routed: dict[int, list[KVHandoff]] = {}
        handoffs = self.prefill_sides[prefill].take_handoffs()
        for handoff in handoffs:
            self.handoffs.append(handoff)
            if self._reads is not None:
                self._reads.handed_off(handoff.request_id, prefill)
            self._pending += 1
            snapshots = [observe(i, self.replicas[i].scheduler, self.replicas[i].num_outstanding, now, False)
                         for i in self.decode_ids]
            target = self.decode_router.route(handoff.request, snapshots)
            self.replicas[target].num_routed += 1
            routed.setdefault(target, []).append(handoff)
        host = self.host
        # The front's message leaves after its host work on the step's hand-offs (ending each at its
        # first token, pickling the message), then crosses the pipe.
        leaves_s = len(handoffs) * host.per_handoff_s + host.sent_message_s if handoffs else 0.0
        for target, batch in routed.items():  # a step's hand-offs arrive together, as the engine's do
            if host.hop_s or leaves_s:
                self.env.timeout(leaves_s + host.hop_s).callbacks.append(
                    lambda _, h=batch, d=target: self._arrive(h, d))
            else:
                self._arrive(batch, target)
        host_s = host.per_step_s + leaves_s + self._send_host_due.pop(prefill, 0.0)
        if self._reads is not None:
            host_s += self._reads.take(prefill)
        if host.admits_between_steps:  # the requests routed here during the step, admitted now
            replica = self.replicas[prefill]
            admission_s = replica.latency.admission_s if host.admission_s is None else host.admission_s
            host_s += (replica.num_routed - self._admitted.get(prefill, 0)) * admission_s
            self._admitted[prefill] = replica.num_routed
        return host_s

    def _arrive(self, handoffs: list[KVHandoff], decode: int) -> None:
        """Hand-offs reach the decode side: queued, then admitted now if that replica is between
        steps (else after its running step, `after_step`)."""
        side = self.decode_sides[decode]
        for handoff in handoffs:
            if not side.enqueue(handoff, self.env.now):
                self._drop(handoff, "handoff_queue_full")
                continue
            self.env.timeout(side.timeout_s).callbacks.append(lambda _, d=decode: self._expire(d))
        if not self._mid_step(decode):
            self._admit(decode)

    def _decode_stepped(self, decode: int) -> None:
        """After a decode replica's step: its outputs go to the fronts, then queued hand-offs are admitted."""
        if self._reads is not None:
            self._reads.decode_step(output_request_ids(self.replicas[decode].last_scheduled, self._final_outputs_only),
                                    lambda p: self.env.now < self.replicas[p].step_end)
        self._admit(decode)

    def _mid_step(self, replica: int) -> bool:
        """Whether the replica's host loop is inside a step (it acts when the step ends)."""
        return self.host.step_boundaries and self.env.now < self.replicas[replica].step_end

    def _step_boundary(self, replica: int):
        """A wait until the replica's running step ends (none between steps)."""
        return self.env.timeout(self.replicas[replica].step_end - self.env.now if self._mid_step(replica) else 0.0)

    def _admit(self, decode: int) -> None:
        """Reserve blocks on a decode replica for the queued hand-offs that fit; start their transfers."""
        reserved, never = self.decode_sides[decode].reserve_ready(self.env.now)
        for handoff in never:
            self._drop(handoff, "too_long")
        for batch in transfer_batches(reserved, self.batch_blocks):
            self.env.process(self._transfer(batch))

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
