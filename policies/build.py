"""Typed config -> Scheduler: the one place a scheduler is composed from its policy, block manager
and budgets. The experiments (a Hydra config, experiments/lib/factory.py) and the engine
(`EngineArgs`, `LLM(policy="srpt", policy_config={...})`) both describe a scheduler as a
`SchedulingConfig` and build it here, so a policy's or block manager's own knobs reach both alike.

Errors name the config path (`policy.aging=-1.0 is invalid: ...`, `blocks.kind='ring' is unknown`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.blocks import BLOCK_MANAGERS, BlockManager, BlockManagerConfig
from policies.blocks.base import own_knobs
from policies.policy.base import POLICIES, Policy, PolicyConfig
from policies.registry import knobs
from policies.scheduler import Scheduler
from policies.scheduler_config import SchedulerConfig
from policies.trace import TraceRecorder


@dataclass(slots=True)
class SchedulingConfig:
    """What a scheduler is made of, typed: budgets, the policy's config and the block manager's."""

    scheduler: SchedulerConfig
    policy: PolicyConfig
    blocks: BlockManagerConfig


def policy_config(name: str, values: Mapping[str, Any] | None = None, where: str = "policy") -> PolicyConfig:
    """The typed config of policy `name` from a mapping of its knobs (a conf/policy yaml)."""
    return POLICIES.config(name, values, where)


def block_manager_config(kind: str, values: Mapping[str, Any] | None = None,
                         where: str = "blocks") -> BlockManagerConfig:
    """The typed config of block manager `kind` from a mapping of its knobs (a conf/blocks yaml)."""
    return BLOCK_MANAGERS.config(kind, values, where)


def _at(where: str, message: object) -> str:
    """`message` ("<knob>=<value> is invalid: ...") under the config path `where` ("" for none)."""
    return f"{where}.{message}" if where else str(message)


def build_policy(config: PolicyConfig, where: str = "policy") -> Policy:
    cls = POLICIES.get(config.name, where or None)
    try:
        return cls(**knobs(config, exclude=frozenset({"name"})))
    except ValueError as e:
        raise ValueError(_at(where, e)) from None
    except TypeError as e:  # a predictor named that needs more than its name (the oracle's lengths)
        raise ValueError(f"{where or 'policy'}: {e}") from None


def build_block_manager(config: BlockManagerConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                        max_model_len: int | None, where: str = "blocks") -> BlockManager:
    """The block manager of `config` over pools of the given sizes (counted by the caller: the
    simulator from the config and hardware, the engine from the memory it allocated)."""
    cls = BLOCK_MANAGERS.get(config.kind, where or None)
    watermark = config.watermark
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise ValueError(_at(where, f"watermark={watermark!r} is invalid: must be in [0, 1)"))
    try:
        return cls(config.block_size, num_gpu_blocks, num_cpu_blocks, float(watermark), max_model_len,
                   **own_knobs(config))
    except ValueError as e:
        raise ValueError(_at(where, e)) from None


def build_scheduler(config: SchedulingConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                    recorder: TraceRecorder | None = None) -> Scheduler:
    policy = build_policy(config.policy)
    blocks = build_block_manager(config.blocks, num_gpu_blocks, num_cpu_blocks, config.scheduler.max_model_len)
    return Scheduler(config.scheduler, policy, blocks, recorder)


def check_scheduling_config(config: SchedulingConfig, policy_where: str = "policy", blocks_where: str = "blocks") -> None:
    """The ValueError building `config` would raise for a policy's or block manager's knob, before
    the pool sizes are known (the engine checks this before it loads the model); `*_where` name the
    settings in the message."""
    build_policy(config.policy, policy_where)
    build_block_manager(config.blocks, 1, 0, None, blocks_where)


def scheduler_config(values: Mapping[str, Any], where: str = "scheduler") -> SchedulerConfig:
    """`SchedulerConfig` from a mapping, its errors naming `where`."""
    try:
        return SchedulerConfig(**values)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}.{e}") from None
