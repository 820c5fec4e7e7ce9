"""Prefill/decode disaggregation, the rules both backends share (docs/disaggregation.md): replica
roles (roles.py), the hand-off object, its transfer size and which hand-offs share one KV message
(handoff.py), and the two sides of a
hand-off on a `policies.Scheduler`: `PrefillSide` (hands requests off after their first token,
frees their blocks once the transfer is done) and `DecodeSide` (allocates blocks before the send,
queues hand-offs that do not fit yet, joins received requests to the running batch).
"""
from policies.disagg.decode_side import DecodeSide, check_max_queue
from policies.disagg.handoff import HANDOFF_COLUMNS, KVHandoff, kv_block_bytes, transfer_batches
from policies.disagg.prefill_side import PrefillSide
from policies.disagg.roles import ROLE_NAMES, ReplicaRole, is_disaggregated, parse_roles

__all__ = ["HANDOFF_COLUMNS", "ROLE_NAMES", "DecodeSide", "KVHandoff", "PrefillSide", "ReplicaRole",
           "check_max_queue", "is_disaggregated", "kv_block_bytes", "parse_roles", "transfer_batches"]
