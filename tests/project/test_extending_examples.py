"""The worked examples of docs/extending.md run as written: a block manager with its own knob
(through a Hydra run config, the simulator and `EngineArgs`) and a policy with arguments through
`LLM`. The examples are files the page includes (docs/examples/); the page must still include them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.lib.fidelity_spec import compose_cfg

DOCS = Path(__file__).resolve().parents[2] / "docs"


def load_example(name: str):
    """docs/examples/<name>.py as a module (by its path: docs/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"extending_example_{name}", DOCS / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def registered_example(registry, name: str):
    """docs/examples/<name>.py, whose plugin is in `registry` for one test only: the other tests
    list the registered plugins and must not see it."""
    saved = dict(registry._entries), dict(registry._configs)
    yield load_example(name)
    sys.modules.pop(f"extending_example_{name}", None)
    registry._entries, registry._configs = saved


@pytest.fixture
def headroom():
    from policies.blocks import BLOCK_MANAGERS

    yield from registered_example(BLOCK_MANAGERS, "headroom_blocks")


@pytest.mark.parametrize("example", ["headroom_blocks.py", "policy_through_llm.py", "fixed_backend.py"])
def test_the_page_includes_the_example(example):
    page = (DOCS / "extending.md").read_text()
    body = (DOCS / "examples" / example).read_text()
    assert f"docs/examples/{example}" in page and body.split('"""', 2)[2].strip() in page


def test_a_block_manager_knob_reaches_the_simulator_and_the_engine_args(headroom):
    from experiments.lib import factory
    from experiments.lib.config_schema import check_config
    from experiments.lib.engine_backend import engine_args

    overrides = ["blocks.kind=headroom", "+blocks.headroom_tokens=64", "blocks.num_gpu_blocks=100",
                 "model=tiny-qwen3", "scheduler.max_model_len=1600"]  # what 100 blocks hold
    cfg = compose_cfg(overrides)
    check_config(cfg)
    scheduler = factory.build_scheduler(cfg, 100, 0)
    assert isinstance(scheduler.block_manager, headroom.HeadroomBlockManager)
    assert scheduler.block_manager.watermark_blocks == 1 + 64 // 16
    args = engine_args(compose_cfg([*overrides, "backend=engine", "backend.device=cpu"]))
    assert args.block_manager == "headroom" and args.block_manager_config == {"headroom_tokens": 64}
    with pytest.raises(ValueError, match="key blocks.headroom_token is unknown"):
        check_config(compose_cfg(["blocks.kind=headroom", "+blocks.headroom_token=64"]))
    with pytest.raises(ValueError, match="blocks.headroom_tokens=-1 is invalid"):
        factory.build_scheduler(compose_cfg([*overrides, "blocks.headroom_tokens=-1"]), 100, 0)


def test_a_policy_with_arguments_through_llm():
    from engine import LLM

    assert [len(tokens) for tokens in load_example("policy_through_llm").generate_with_srpt()] == [4, 4]
    llm_policy = LLM("tiny-llama", device="cpu", num_gpu_blocks=16, max_model_len=64, policy="srpt",
                     policy_config={"aging": 2.0}).engine.scheduler.policy
    assert llm_policy.aging == 2.0 and llm_policy.preempt_running
    with pytest.raises(ValueError, match=r"policy_config.agin is unknown for scheduling policy 'srpt'"):
        LLM("tiny-llama", device="cpu", num_gpu_blocks=16, policy="srpt", policy_config={"agin": 2.0})
    with pytest.raises(ValueError, match=r"policy_config.aging=-1.0 is invalid"):
        LLM("tiny-llama", device="cpu", num_gpu_blocks=16, policy="srpt", policy_config={"aging": -1.0})


def test_the_server_takes_a_policy_with_arguments():
    from engine.serve import build_parser, engine_args_from

    ns = build_parser().parse_args(["--model", "tiny-llama", "--policy", "srpt", "--policy-config", "{aging: 1.0}"])
    args = engine_args_from(ns)
    assert args.policy == "srpt" and args.scheduling_config(64).policy.aging == 1.0


@pytest.fixture
def fixed_backend():
    from experiments.lib.backends import BACKENDS

    yield from registered_example(BACKENDS, "fixed_backend")


def test_a_backend_runs_a_workload_into_the_trace_files(fixed_backend, tmp_path):
    """The page's backend, with its yaml's keys, runs a whole workload through `experiments.run`'s
    run: every request ends, each step takes `step_time_s`, and the usual trace files are written."""
    from omegaconf import OmegaConf, open_dict

    from experiments.lib.run_workload import run

    cfg = compose_cfg(["workload=offline", "workload.num_requests=20", "progress=false", "plots=false"])
    with open_dict(cfg):
        cfg.backend = OmegaConf.create({"name": "fixed", "step_time_s": 0.02})
    summary = run(cfg, tmp_path, "fixed")
    assert summary["num_requests"] == summary["completed"] == 20
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert len(steps) > 0 and steps["duration"].to_numpy() == pytest.approx(0.02)
    assert {p.name for p in tmp_path.iterdir()} >= {"requests.parquet", "steps.parquet", "events.parquet",
                                                   "summary.json"}
    with open_dict(cfg):
        cfg.backend.step_time = 0.02
    with pytest.raises(ValueError, match="backend.step_time"):
        run(cfg, tmp_path / "bad", "fixed")
