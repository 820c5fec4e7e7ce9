"""The disaggregated pair with its prefill engine scheduling ahead (`prefill_async_scheduling`), on
CPU (gloo) as tests/device/test_disagg_engine.py: greedy tokens equal the co-located engine's
(chunked prefill, n = 2), the prefill engine does schedule steps ahead yet never schedules a
sequence past its first token (no decode of a handed-off sequence, checked on every step it
launches), and an abort holds its meaning before, during and after the hand-off."""
from __future__ import annotations

import pytest
from test_disagg_engine import ARGS, GREEDY, PROMPTS, TIMEOUT_S, _fork, _run, check_aborts_around_the_hand_off

from engine.disagg.config import DisaggregationConfig
from engine.disagg.pd_engine import DisaggregatedEngine
from engine.engine_args import EngineArgs
from engine.offline.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def reference():
    with LLMEngine(EngineArgs(**ARGS)) as engine:
        yield {"greedy": _run(engine), "fork": _run(engine, PROMPTS[:3], _fork())}


@pytest.fixture(scope="module")
def pair():
    config = DisaggregationConfig(transfer_timeout_s=TIMEOUT_S, prefill_async_scheduling=True)
    engine = DisaggregatedEngine(EngineArgs(**ARGS), config)
    runner, launched = engine.prefill.runner, []
    launch = runner.launch

    def recording_launch(out, after=None):
        # Each launched step's rows as the device gets them: (sequence, first position, tokens).
        launched.append([(seq, seq.num_computed_tokens, num_new) for seq, num_new, _ in out.scheduled])
        return launch(out, after=after)

    runner.launch = recording_launch
    engine.launched_steps = launched
    yield engine
    engine.close()


def _assert_prefill_only(pair) -> None:
    """No launched prefill step computes a position past a prompt (a decode of a handed-off sequence
    would compute position len(prompt), the first token's)."""
    assert pair.launched_steps
    for step in pair.launched_steps:
        for seq, start, num_new in step:
            assert start + num_new <= seq.num_prompt_tokens, (
                f"{seq.request.request_id} (seq {seq.seq_id}) was scheduled at positions {start}..{start + num_new - 1}, "
                f"past its prompt of {seq.num_prompt_tokens} tokens, on the prefill engine")


def test_greedy_tokens_equal_the_colocated_engine_with_chunks_and_n2(pair, reference):
    assert pair.prefill.scheduler.config.async_scheduling
    assert max(map(len, PROMPTS)) > ARGS["max_num_batched_tokens"]  # a prompt spans steps (chunked prefill)
    assert _run(pair) == reference["greedy"]
    assert _run(pair, PROMPTS[:3], _fork()) == reference["fork"]
    assert pair.prefill.scheduler.num_scheduled_ahead > 0  # steps were scheduled while another ran
    _assert_prefill_only(pair)
    assert pair.prefill.scheduler.block_manager.num_free_gpu_blocks() == pair.prefill.runner.num_gpu_blocks


def test_a_handed_off_sequence_is_never_scheduled_on_the_prefill_side(pair, reference):
    # Many short prompts: each step finishes some prefills while the next one is scheduled.
    prompts = [p[:5 + 3 * i] for i, p in enumerate(PROMPTS * 2)]
    done = _run(pair, prompts, tag="short")
    assert all(reasons == ["length"] and len(tokens[0]) == GREEDY.max_tokens for tokens, reasons, _ in done.values())
    _assert_prefill_only(pair)
    handed_off = {row["request_id"] for row in pair.decode_rows}
    assert handed_off >= {f"short-{i}" for i in range(len(prompts))}  # every one decoded on the decode side


def test_abort_before_during_and_after_the_hand_off(pair, reference):
    check_aborts_around_the_hand_off(pair, reference)
    _assert_prefill_only(pair)
    assert not pair.side.holds_blocks
