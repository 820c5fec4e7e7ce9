"""servelab's deciding half: requests and sequences, the Scheduler, policies, KV block managers and
the trace recorder. Pure Python (stdlib only); the simulator and the GPU engine both drive it through
the step contract (docs/architecture.md): `out = scheduler.schedule(now)`, run `out`, `scheduler.update(...)`.
"""
from policies.blocks import make_block_manager
from policies.outputs import ScheduledSeq, SchedulerOutput
from policies.policy import make_policy
from policies.request import Request, SamplingParams
from policies.scheduler import Scheduler, SchedulerConfig
from policies.sequence import Sequence, SequenceStatus
from policies.trace import TraceRecorder

__all__ = [
           "Request",
           "SamplingParams",
           "ScheduledSeq",
           "Scheduler",
           "SchedulerConfig",
           "SchedulerOutput",
           "Sequence",
           "SequenceStatus",
           "TraceRecorder",
           "make_block_manager",
           "make_policy",
]
