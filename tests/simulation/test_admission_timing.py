"""When a request that arrives while a step runs gets its first token: the simulator and the engine
follow one rule (`Scheduler.schedule_ahead`, policies/lookahead.py). Synchronous steps: it joins the
next step, first token at that step's end. Async scheduling: the next step was decided when the
running one started, so it joins the step after, first token two steps after the one it arrived in.
The engine's arrival is made while its step runs on the device (the runner's collect), as an online
server's arrives; the simulator's falls in the middle of a step."""
import pytest
from engine_helpers import save_tiny_model
from test_sim import Constant, request, scheduler

from engine.device.sampler import SampleResult
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine
from policies.request import SamplingParams
from sim import Simulator

STEP = 0.01
ARRIVAL_STEP = 1  # the late request arrives while step 1 runs (steps counted from 0)


class MidStepRunner:
    """ModelRunner's interface for LLMEngine: token 7 for every sample; while step ARRIVAL_STEP runs
    on the 'device' the late request is added (another thread's add_request, as a server's)."""

    def __init__(self) -> None:
        self.vocab_size, self.num_gpu_blocks, self.num_cpu_blocks = 256, 64, 0
        self.engine: LLMEngine | None = None
        self.steps_run = 0

    def execute(self, out):
        results = {seq.seq_id: SampleResult([7] * n) for seq, _, n in out.scheduled if n}
        if self.steps_run == ARRIVAL_STEP:
            self.engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True,
                                                                      output_kind="delta"))
        self.steps_run += 1
        return results

    def launch(self, out, after=None):
        return out

    def collect(self, out):
        return self.execute(out)

    def release(self, seq_ids) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("admission") / "qwen3"
    save_tiny_model(path, "qwen3", seed=1)
    return path


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_a_request_arriving_mid_step_gets_its_first_token_when_the_engine_gives_it(model_dir, ahead):
    runner = MidStepRunner()
    engine = LLMEngine(EngineArgs(model=str(model_dir), max_model_len=64, block_size=8, async_scheduling=ahead),
                       runner=runner)
    runner.engine = engine
    engine.add_request("early", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True, output_kind="delta"))
    first_token_step = None
    for step in range(12):
        outputs = engine.step()
        if first_token_step is None and any(o.request_id == "late" and o.outputs[0].token_ids for o in outputs):
            first_token_step = step  # step() returns the outputs of the step it collected: this one
        if not engine.has_unfinished_requests():
            break
    engine_steps = first_token_step - ARRIVAL_STEP

    sched = scheduler(async_scheduling=ahead)
    Simulator(sched, Constant(STEP), [request("early", 2.0, 4, 6),
                                      request("late", 2.0 + (ARRIVAL_STEP + 0.5) * STEP, 3, 2)]).run()
    late = next(r for r in sched.recorder.requests if r["request_id"] == "late")
    sim_steps = round((late["first_token_time"] - 2.0) / STEP) - 1 - ARRIVAL_STEP  # the step it ended
    assert engine_steps == sim_steps == (2 if ahead else 1)
