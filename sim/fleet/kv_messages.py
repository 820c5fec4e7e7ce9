"""The KV messages of a simulated disaggregated fleet (`DisaggFleetSimulator`, sim/fleet/disagg.py,
whose docstring gives the hand-off's rules and its host loops' share): one message's way from the
decode side's `Reserved` answer reaching the prefill side's loop, through its turn on the prefill
replica's link, to its requests joining the decode replica (`_transfer`), and what it costs the
engines beside the link.

What a message costs the engines beside the link (`receive`, a `KVReceivePrice`:
`cluster.kv_receive_profile`, sim/latency/kv_receive.py; None: nothing): the decode replica's next
step after a receive waits for its scatter (`scatter_s` of the message's bytes, device time ahead
of that step on the compute stream); a decode step costs `busy_factor(share)` times its price,
`share` the part of the step (its price and the scatter it waits for) during which the link's
bytes into its replica are on the wire (the simulated link's own transfer intervals, from a
message's turn on the link, after its gather's wait if any, to its last byte; a receive posted and
not yet sent does not count).
A prefill replica's step costs `send_busy_factor(share)` times its price by the same rule, `share`
the part of it its outgoing link carries bytes (the gather and NCCL's send kernel beside its
forward), where the profile has a `send_busy_share_curve` (none: its steps at their price); the
other way round, a message whose turn on the link comes during a step of its prefill replica is
`send_beside_s` of its bytes later (its gather waits for room beside the forward; the link is held
meanwhile, its bytes not yet on the wire). A step is priced as it starts, from the transfers on
the wire or done by then; a transfer that starts on the wire during the step is only known later,
so the next step pays the difference between the step's price at its whole share and what it was
charged (sim/fleet/busy_link.py, both sides). A prefill replica that schedules synchronously pays
`send_host_s` of each message it posts before its next step, as it pays the hand-offs' host time.
"""
from __future__ import annotations

from policies.disagg import KVHandoff


class KVMessages:
    """Mixed into `DisaggFleetSimulator`: every method reads and writes the fleet's state (its
    replicas, both sides of each hand-off, the links and what the messages on them owe)."""

    def _receive_surcharge(self, decode: int, step_s: float) -> float:
        """A decode replica's step of price `step_s` starting now: the scatters it waits for, its
        busy-link price from the wire known now, and what the last step owes for transfers that
        reached the wire during it (module docstring)."""
        scatter = self._scatter_due.pop(decode, 0.0)
        if decode not in self._receive_wire:
            return scatter
        return max(0.0, scatter + self._receive_wire[decode].surcharge(self.env.now, step_s, scatter))

    def _transfer(self, batch: list[KVHandoff]):
        """One KV message: the hand-offs of `batch` (one prefill replica, one decode replica)."""
        prefill, decode = batch[0].prefill_replica, batch[0].decode_replica
        link, resource = self.links[prefill]
        after_gap = False
        if self.host.hop_s or self.host.step_boundaries:  # `Reserved` reaches the prefill side's loop
            yield self.env.timeout(self.host.hop_s)
            if not self.host.sends_mid_step:
                yield self._step_boundary(prefill)
            elif self.host.step_boundaries and self.env.now < self.replicas[prefill].host_gap_end:
                # The loop reads the decode side's answers while it waits for a step: one that
                # arrives during its host work between steps waits for the next step's launch.
                yield self.env.timeout(self.replicas[prefill].host_gap_end - self.env.now)
                after_gap = True
        if self.host.has_launch_window:
            if after_gap:
                yield self.env.timeout(0)  # the step the gap's end starts, if any, starts first
            replica = self.replicas[prefill]
            if self.env.now < replica.step_end:  # taken once the running step's launch is done
                window = self.host.launch_window_s(replica.step_out.num_prefill_seqs)
                ready = min(replica.step_start + window, replica.step_end)
                if ready > self.env.now:
                    yield self.env.timeout(ready - self.env.now)
        # Posted during a step, its host time is spent while the host waits for the step anyway.
        host_free = self.host.sends_mid_step and (after_gap or self.env.now < self.replicas[prefill].step_end)
        with resource.request() as turn:
            yield turn
            for handoff in batch:
                handoff.transfer_start_time = self.env.now
            nbytes = sum(h.num_bytes for h in batch)
            # A gather that shares the GPU with a running step starts the bytes that much later.
            gather_s = self.receive.send_beside_s(nbytes) \
                if self.receive is not None and self.replicas[prefill].device_busy(self.env.now) else 0.0
            wire_s = gather_s + link.transfer_time(nbytes)
            post_s = self.host.kv_message_s
            if post_s is None:
                post_s = 0.0 if self.receive is None else self.receive.send_host_s(nbytes)
            if not host_free:
                due = self._send_host_due
                due[prefill] = due.get(prefill, 0.0) + post_s + self.host.sent_message_s
            if self.receive is not None:
                for charges, replica in ((self._receive_wire, decode), (self._send_wire, prefill)):
                    if replica in charges:
                        charges[replica].add(self.env.now + gather_s, self.env.now + wire_s)
            yield self.env.timeout(wire_s)
        if self.host.step_boundaries:  # the decode side's loop notices the KV after its running step
            yield self._step_boundary(decode)
        now, joined = self.env.now, False
        for handoff in batch:
            received = self.decode_sides[decode].receive(handoff, now)
            self.prefill_sides[prefill].finish_transfer(handoff, now)
            if received is None:
                self.replicas[decode].num_left += 1
            else:
                self.replicas[prefill].num_left += 1
                joined = True
        self.replicas[prefill].wake()  # their blocks are free again
        if self.receive is not None:  # the message is scattered into its blocks before the next step
            due = self._scatter_due
            due[decode] = due.get(decode, 0.0) + self.receive.scatter_s(nbytes)
        if joined:
            self.replicas[decode].wake()
        self._settled(len(batch))
