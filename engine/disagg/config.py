"""`DisaggregationConfig`: how a disaggregated engine pair is laid out and bounded.

The flag's form follows SGLang's and vLLM's disaggregated serving: `prefill=1,decode=1` (one
prefill engine and one decode engine; the replica counts a fleet of several would name).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from engine.config import check_device
from policies.disagg import check_max_queue


@dataclass(slots=True, frozen=True)
class DisaggregationConfig:
    prefill: int = 1  # prefill engines (this engine pair: 1)
    decode: int = 1  # decode engines (this engine pair: 1)
    # The decode engine's device; None: the GPU after the prefill engine's (cuda:i+1), or the CPU.
    decode_device: str | None = None
    # A KV transfer (or the decode engine's answer) making no progress this long fails the link.
    transfer_timeout_s: float = 30.0
    # Transfers posted at once (each holds a staging buffer of its blocks on both GPUs).
    max_transfers_in_flight: int = 8
    # One transfer moves every hand-off the decode engine reserved in one turn, up to this many
    # blocks (a larger request goes alone): its staging buffers' bound.
    max_blocks_per_transfer: int = 512
    # Hand-offs the decode engine queues while it has no sequence slot or KV blocks for them, at most
    # (more: refused, abort:handoff_queue_full); None: unbounded, the prefill engine holding their KV
    # (backpressure). How long one may wait there (longer: refused, abort:handoff_timeout).
    max_queue: int | None = None
    queue_timeout_s: float = 60.0
    # EngineArgs fields the decode engine sets otherwise (e.g. {"num_gpu_blocks": 64, "max_num_seqs": 128}).
    decode_args: dict | None = None
    # The decode engine's start-up (building, loading, compiling, capturing) may take this long.
    startup_timeout_s: float = 900.0
    # The prefill engine schedules its next step while the last one runs (async scheduling,
    # policies/lookahead.py) instead of after its outputs are processed; a sequence whose prefill
    # ends in a step is never scheduled past its first token (docs/disaggregation-engine.md).
    prefill_async_scheduling: bool = False
    # While a prefill step runs, the front takes the decode engine's answers and posts their KV sends
    # beside it (ModelRunner.while_waiting), instead of after the step; false: after it.
    sends_mid_step: bool = True

    def __post_init__(self) -> None:
        check_max_queue(self.max_queue, "disaggregation.max_queue")
        for name in ("prefill", "decode", "max_transfers_in_flight", "max_blocks_per_transfer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"disaggregation.{name}={value!r} is invalid: must be an integer >= 1")
        if (self.prefill, self.decode) != (1, 1):
            raise ValueError(f"disaggregation=prefill={self.prefill},decode={self.decode} is not supported: the engine "
                             "pairs one prefill engine with one decode engine (prefill=1,decode=1); larger P:D "
                             "ratios run in the simulator (docs/disaggregation.md)")
        for name in ("transfer_timeout_s", "queue_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"disaggregation.{name}={value!r} is invalid: must be a number of seconds > 0")
        for name in ("prefill_async_scheduling", "sends_mid_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                    f"disaggregation.{name}={getattr(self, name)!r} is invalid: must be true or false")
        if self.decode_args is not None and not isinstance(self.decode_args, dict):
            raise ValueError(f"disaggregation.decode_args={self.decode_args!r} is invalid: a dict of EngineArgs fields")
        check_device(self.decode_device, "disaggregation.decode_device")

    @classmethod
    def parse(cls, spec: str | dict | DisaggregationConfig) -> DisaggregationConfig:
        """`"prefill=1,decode=1"` (any field as `key=value`), a dict of fields, or a config."""
        if isinstance(spec, DisaggregationConfig):
            return spec
        if isinstance(spec, dict):
            items = dict(spec)
        elif isinstance(spec, str):
            items = {}
            for part in filter(None, (p.strip() for p in spec.split(","))):
                key, eq, value = part.partition("=")
                if not eq or not key.strip():
                    raise ValueError(f"disaggregation={spec!r} is invalid: comma-separated key=value pairs, "
                                     "e.g. prefill=1,decode=1")
                items[key.strip()] = value.strip()
        else:
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout servelab)
                f"disaggregation={spec!r} is invalid: a string such as 'prefill=1,decode=1' or a dict")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(items) - set(known))
        if unknown:
            raise ValueError(f"disaggregation keys {unknown} are unknown: allowed are {sorted(known)}")
        return cls(**{k: _convert(k, v, known[k].type) for k, v in items.items()})


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _convert(key: str, value: object, kind: str) -> object:
    if not isinstance(value, str):
        return value
    try:
        if kind == "int | None":
            return None if value.strip().lower() in ("none", "null") else int(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            return _BOOLS[value.strip().lower()]
    except KeyError:
        raise ValueError(f"disaggregation.{key}={value!r} is invalid: must be true or false") from None
    except ValueError:
        raise ValueError(f"disaggregation.{key}={value!r} is invalid: must be a number") from None
    return None if value in ("", "none", "None") else value
