"""What a disaggregated pair's host loops pay beyond the link (`HandoffHost`), and the front's host
profile that sets the prefill side's share of it from a measurement (`FrontHostProfile`).

`HandoffHost` (sim/fleet/disagg.py's module docstring says where each applies): the hop between the
two sides' processes, whether each acts between its steps, and what a synchronous prefill replica's
loop pays between two steps: per hand-off, per request admitted, per step, per message to the
decode process and, when set, per KV message posted (None: the receive profile's `send_host_s`).

The front's host profile: what each unit of the front's loop costs, timed by part
in a real run of the engine pair (`python -m experiments.lab.front_parts --profile-out FILE`).

The engine pair's front (engine/disagg/pd_engine.py) is one host loop around its prefill engine. A
prefill replica that schedules synchronously pays, between two of its steps:

- `step_s` once a step: the loop's own turns (the front's bookkeeping between its parts, its checks
  of the decode process and of ended transfers) and its caller's (the loop that feeds it requests);
- `admission_s` per request admitted (`add_request`, the arrivals of the step before);
- `handoff_s` per request handed off (ending it at its first token, its `KVHandoff`, freeing its
  blocks once sent);
- `kv_message_s` per KV message posted (the gather's launch, the send, their bookkeeping);
- `sent_message_s` per message to the decode process (pickled and queued for the pipe's sender:
  one with each step's hand-offs, one per KV message posted);
- `read_message_s` per decode-step message read back (unpickled, turned into outputs) that arrived
  while it was busy: one per decode step with an output to give (sim/fleet/front_reads.py), the
  front's reads of its other messages (the decode side's answers) spread over them;
- `launch_s` and `launch_prompt_s` (optional): a prefill step's host work before the front waits
  for the device (scheduling, input preparation, the launches: `launch_s` + `launch_prompt_s` per
  prompt in the step), during which the pipe's reader thread waits for the interpreter lock and the
  front takes no answer from the decode side: an answer that comes meanwhile, or during the host
  work between steps, is taken once the step's launch is done (`experiments.lab.prefill_launch`);
- `hop_s` (optional): one message between the two sides' loops, measured as the mean time from the
  decode side's reservation of a hand-off's blocks to the front's send for the answers that reached
  the front while it waited for a prefill step (the answer over the pipe, the front picking it
  up; and the decode side posting its receive, in a run whose decode side posted it first); it
  replaces `cluster.handoff_hop_s` in both directions.

The file: `# key: value` provenance lines (model, device, date, command, the scenario it was timed
in), then `key,seconds` rows, one per unit above. The simulator takes it as `cluster.front_host_profile`
(experiments/lib/disagg_backend.py): it replaces `cluster.handoff_host_s`, the latency model's
`admission_s` between steps, the receive profile's `send_host_s`, `cluster.front_message_host_s`
and, where the profile has `hop_s`, `cluster.handoff_hop_s` with the profile's figures, and adds
`step_s` and `sent_message_s`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from sim.latency.file_meta import read_meta, text_lines

UNITS = ("step_s", "admission_s", "handoff_s", "kv_message_s", "sent_message_s", "read_message_s")
# A profile may give these: hop_s from front_parts' run traces, the launch units from
# experiments.lab.prefill_launch.
OPTIONAL_UNITS = ("hop_s", "launch_s", "launch_prompt_s")


def check_seconds(key: str, value, allow_none: bool = False) -> None:
    """A ValueError naming `key` unless `value` is a finite number of seconds >= 0 (or None, allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{key}={value!r} is invalid: must be a number of seconds >= 0"
                         + (" or null" if allow_none else ""))


@dataclass(slots=True, frozen=True)
class FrontHostProfile:
    """Host seconds per unit of the front's loop (module docstring); `meta`: the provenance lines."""

    step_s: float
    admission_s: float
    handoff_s: float
    kv_message_s: float
    sent_message_s: float
    read_message_s: float
    meta: tuple[tuple[str, str], ...] = ()
    hop_s: float | None = None
    launch_s: float | None = None
    launch_prompt_s: float | None = None

    def __post_init__(self) -> None:
        for name in UNITS:
            check_seconds(f"front host profile: {name}", getattr(self, name))
        for name in OPTIONAL_UNITS:
            check_seconds(f"front host profile: {name}", getattr(self, name), allow_none=True)

    @property
    def model(self) -> str | None:
        return dict(self.meta).get("model")

    def write(self, path: str | Path) -> None:
        lines = [f"# {key}: {value}" for key, value in self.meta]
        names = [*UNITS, *(name for name in OPTIONAL_UNITS if getattr(self, name) is not None)]
        lines += ["unit,seconds", *(f"{name},{getattr(self, name):.6e}" for name in names)]
        Path(path).write_text("\n".join(lines) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> FrontHostProfile:
        """The profile at `path`; a ValueError naming the file and what is wrong with it."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"cluster.front_host_profile={str(path)!r} is not a file: measure one with "
                             "`python -m experiments.lab.front_parts --profile-out FILE` on two GPUs")
        lines = list(text_lines(p))
        meta, start = read_meta(lines)
        values = {}
        for n, line in enumerate(lines[start:], start + 1):
            line = line.strip()
            if not line or line == "unit,seconds":
                continue
            name, _, value = line.partition(",")
            if name not in UNITS and name not in OPTIONAL_UNITS:
                raise ValueError(f"{path}:{n}: unit {name!r} is unknown: the units are {list(UNITS)} "
                                 f"and, optionally, {list(OPTIONAL_UNITS)}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"{path}:{n}: {name}={value!r} is invalid: must be seconds") from None
        missing = [u for u in UNITS if u not in values]
        if missing:
            raise ValueError(f"{path}: units {missing} are missing: a profile gives all of {list(UNITS)}")
        return cls(**values, meta=tuple(meta.items()))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "meta" and getattr(self, f.name) is not None}


@dataclass(slots=True, frozen=True)
class HandoffHost:
    """What a hand-off costs the two sides' host loops beyond the link (module docstring)."""

    hop_s: float = 1e-4  # one message between the two sides' processes (pickled, over a local pipe)
    step_boundaries: bool = True  # each side acts on a hand-off when its running step ends
    # The prefill side's host loop per request it hands off (ending it at its first token, its
    # hand-off message), before its next step when it schedules synchronously.
    per_handoff_s: float = 0.0
    # A synchronous prefill replica admits the requests routed to it during a step after that step,
    # before the next (`admission_s` each; None: its latency model's), as the engine pair's front does.
    admits_between_steps: bool = False
    admission_s: float | None = None
    per_step_s: float = 0.0  # its loop's own turns and its caller's, once a step
    sent_message_s: float = 0.0  # per message to the decode process (a step's hand-offs; a KV message posted)
    kv_message_s: float | None = None  # per KV message posted (None: the receive profile's send_host_s)
    # The prefill side posts a KV send when the decode side's answer reaches it, during its running
    # step (its host free meanwhile: no host time before its next step), as the engine pair's front
    # does by default (disaggregation.sends_mid_step); False: when that step ends.
    sends_mid_step: bool = True
    # With sends mid-step: the front takes no answer before a prefill step's launch is done, this
    # long after the step starts (plus `launch_prompt_s` per prompt in it; FrontHostProfile).
    launch_s: float = 0.0
    launch_prompt_s: float = 0.0

    def __post_init__(self) -> None:
        check_seconds("cluster.handoff_hop_s", self.hop_s)
        check_seconds("cluster.handoff_host_s", self.per_handoff_s)
        for key, value in (("cluster.handoff_step_boundaries", self.step_boundaries),
                           ("cluster.prefill_admits_between_steps", self.admits_between_steps),
                           ("cluster.prefill_sends_mid_step", self.sends_mid_step)):
            if not isinstance(value, bool):
                raise ValueError(f"{key}={value!r} is invalid: must be true or false")  # noqa: TRY004
        for key in ("admission_s", "kv_message_s"):
            check_seconds(f"front host profile: {key}", getattr(self, key), allow_none=True)
        for key in ("per_step_s", "sent_message_s", "launch_s", "launch_prompt_s"):
            check_seconds(f"front host profile: {key}", getattr(self, key))

    @classmethod
    def from_profile(cls, profile: FrontHostProfile, hop_s: float = 1e-4, step_boundaries: bool = True,
                     sends_mid_step: bool = True) -> HandoffHost:
        """The prefill side's loop priced by a measured front host profile (admitting between steps);
        its `hop_s`, where it has one, replaces `hop_s`."""
        hop = hop_s if profile.hop_s is None else profile.hop_s
        return cls(hop, step_boundaries, profile.handoff_s, True, profile.admission_s, profile.step_s,
                   profile.sent_message_s, profile.kv_message_s, sends_mid_step, profile.launch_s or 0.0,
                   profile.launch_prompt_s or 0.0)

    @property
    def has_launch_window(self) -> bool:
        """Whether the front holds answers until a prefill step's launch is done."""
        return self.sends_mid_step and bool(self.launch_s or self.launch_prompt_s)

    def launch_window_s(self, prompts: int) -> float:
        """How long after a prefill step of `prompts` prompts starts the front takes answers."""
        return self.launch_s + self.launch_prompt_s * prompts if self.has_launch_window else 0.0
