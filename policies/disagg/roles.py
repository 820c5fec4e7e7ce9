"""Replica roles of a disaggregated fleet: `prefill` replicas run prompts and sample each request's
first token, `decode` replicas receive the prompt's KV blocks and generate the rest, `mixed`
replicas serve whole requests (the co-located default).

A fleet is all mixed, or has prefill replicas and decode replicas (and may keep mixed ones beside
them: the first router then picks among prefill and mixed replicas). `parse_roles` checks a
per-replica list and names the key (`cluster.roles` by default) in every error.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence


class ReplicaRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @property
    def takes_arrivals(self) -> bool:
        """Whether the first router may send a new request here (prefill and mixed replicas)."""
        return self is not ReplicaRole.DECODE


ROLE_NAMES = tuple(role.value for role in ReplicaRole)


def parse_roles(roles: Sequence[str] | None, num_replicas: int, key: str = "cluster.roles") -> tuple[ReplicaRole, ...]:
    """One role per replica (None: all mixed). ValueError naming the key: a role not in
    ROLE_NAMES, a count other than `num_replicas`, prefill replicas without a decode one (or the
    reverse)."""
    if roles is None:
        return (ReplicaRole.MIXED,) * num_replicas
    if isinstance(roles, str) or not isinstance(roles, Sequence):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
            f"{key}={roles!r} is invalid: give one of {list(ROLE_NAMES)} per replica, or null")
    if len(roles) != num_replicas:
        raise ValueError(f"{key}={list(roles)!r} has {len(roles)} roles for {num_replicas} replicas: "
                         "give one role per replica")
    out = []
    for i, role in enumerate(roles):
        if role not in ROLE_NAMES:
            raise ValueError(f"{key}[{i}]={role!r} is not a role: choose one of {list(ROLE_NAMES)}")
        out.append(ReplicaRole(role))
    num_prefill, num_decode = out.count(ReplicaRole.PREFILL), out.count(ReplicaRole.DECODE)
    if num_prefill and not num_decode:
        raise ValueError(f"{key}={list(roles)!r} has {num_prefill} prefill replica(s) and 0 decode replicas: "
                         "a prefill replica hands every request to a decode replica")
    if num_decode and not num_prefill:
        raise ValueError(f"{key}={list(roles)!r} has {num_decode} decode replica(s) and 0 prefill replicas: "
                         "a decode replica receives requests only from a prefill replica")
    return tuple(out)


def is_disaggregated(roles: Sequence[ReplicaRole]) -> bool:
    return ReplicaRole.PREFILL in roles
