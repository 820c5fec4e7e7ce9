"""Bad input to the smaller experiment CLIs (make_mooncake_trace, calibrate, showcase, bench_sim,
bench_scheduler) and to the simulator's notebook API (Hardware/ModelShape.from_dict,
RooflineModel, ProfiledModel): one specific error naming the option or key, exit code 2 from a
CLI, never a traceback, a hang or a silently used invalid value."""
import math
from pathlib import Path

import pytest
import yaml

from experiments import bench_scheduler, bench_sim, calibrate, make_mooncake_trace, showcase
from experiments.lib.paths import REPO_ROOT
from sim.latency.profiled import ProfiledModel
from sim.latency.roofline import RooflineModel
from sim.latency.shapes import Hardware, ModelShape

HARDWARE = yaml.safe_load((REPO_ROOT / "conf/hardware/h200.yaml").read_text())
MODEL = yaml.safe_load((REPO_ROOT / "conf/model/qwen3-0.6b.yaml").read_text())
PROFILE = REPO_ROOT / "experiments/profiles/h200-qwen3-0.6b.csv"
UNWRITABLE = "/dev/null/x"  # a path under a file: no directory can be made there


def fails(capsys, call, *needles: str) -> None:
    with pytest.raises(SystemExit) as exc:
        call()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--seed", "-1"], "--seed=-1 is invalid: must be an integer >= 0"),
    (["--hours", "1e12"], "(the trace is built in memory): lower hours or rate"),
    (["--rate", "1e300", "--hours", "0.001"], "more than 10,000,000"),
])
def test_make_mooncake_trace_refuses_bad_seed_and_sizes(capsys, tmp_path, argv, needle):
    fails(capsys, lambda: make_mooncake_trace.main(["--out", str(tmp_path / "t.jsonl"), *argv]), needle)


def test_make_mooncake_trace_unwritable_out_is_one_line(capsys):
    fails(capsys, lambda: make_mooncake_trace.main(["--out", f"{UNWRITABLE}/t.jsonl", "--hours", "0.0005"]),
          f"--out='{UNWRITABLE}/t.jsonl' is invalid: cannot write it")


def test_calibrate_names_a_missing_profile(capsys, tmp_path):
    fails(capsys, lambda: calibrate.main([str(tmp_path / "h200-x.csv"), "--out", "-"]),
          "error: profile=", "is invalid: not a file")


def test_calibrate_unwritable_out_is_one_line(capsys):
    fails(capsys, lambda: calibrate.main([str(PROFILE), "--out", f"{UNWRITABLE}/h.yaml"]),
          f"error: --out='{UNWRITABLE}/h.yaml' is invalid: cannot write it")


def test_showcase_refuses_no_sections(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["showcase", "--sections", ",", "--out", str(tmp_path)])
    fails(capsys, showcase.main, "error: --sections=',' is invalid: choose from")
    assert not (tmp_path / "showcase.md").exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (["--requests", "0"], "--requests=0 is invalid: must be an integer >= 1"),
    (["--repeat", "0"], "--repeat=0 is invalid: must be an integer >= 1"),
    (["--workloads", ","], "--workloads=',' is invalid"),
    (["--workloads", "nope", "--requests", "5", "--repeat", "1"], "error: In 'config': Could not find 'workload/nope'"),
    (["--workloads", "poisson", "--requests", "5", "--repeat", "1", "foo=bar"],
     "error: the command line (foo=bar): key foo is unknown: allowed are ['backend', "),
])
def test_bench_sim_bad_options_are_one_line(capsys, argv, needle):
    fails(capsys, lambda: bench_sim.main(argv), needle)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--waiting", "-1"], "--waiting=-1 is invalid: must be an integer >= 0"),  # hung before
    (["--block-size", "0"], "--block-size=0 is invalid: must be an integer >= 1"),
    (["--repeats", "0"], "--repeats=0 is invalid"),
    (["--steps", "0"], "--steps=0 is invalid"),
    (["--num-seqs", "0"], "--num-seqs=0 is invalid"),
    (["--steps", "1", "--repeats", "1"], "the p99 needs at least 2 timed steps"),
    (["--policy", "nope"], "--policy='nope' is unknown: choose a scheduling policy from"),
])
def test_bench_scheduler_bad_options_are_one_line(capsys, argv, needle):
    fails(capsys, lambda: bench_scheduler.main(["--kinds", "paged", *argv]), needle)


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("hbm_bandwidth", math.nan, "hardware.hbm_bandwidth=nan is invalid: must be a finite number > 0"),
    ("bf16_flops", math.inf, "hardware.bf16_flops=inf is invalid: must be a finite number > 0"),
    ("step_overhead_s", math.nan, "hardware.step_overhead_s=nan is invalid: must be a finite number >= 0"),
    ("swap_latency_s", math.inf, "hardware.swap_latency_s=inf is invalid"),
    ("l2_bandwidth", math.nan, "hardware.l2_bandwidth=nan is invalid"),
    ("links", {"x": {"bandwidth_gb_s": 1, "latency_s": math.nan}}, "hardware.links.x.latency_s=nan is invalid"),
    ("links", {"x": {"bandwidth_gb_s": math.inf, "latency_s": 0}}, "hardware.links.x.bandwidth_gb_s=inf is invalid"),
])
def test_hardware_refuses_non_finite_numbers(key, value, needle):
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        Hardware.from_dict({**HARDWARE, key: value})


@pytest.mark.parametrize("build", [Hardware.from_dict, ModelShape.from_dict])
def test_from_dict_refuses_a_non_mapping(build):
    with pytest.raises(ValueError, match=r"=None is invalid: a mapping of conf/"):
        build(None)


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("head_dim", 0, "model.head_dim=0 is invalid: must be a positive integer"),
    ("num_key_value_heads", 0, "model.num_key_value_heads=0 is invalid: must be a positive integer"),
    ("max_position_embeddings", 0, "model.max_position_embeddings=0 is invalid"),
    ("num_key_value_heads", 3, "model.num_key_value_heads=3 is invalid: must divide num_attention_heads=16"),
])
def test_model_shape_refuses_zero_and_ungrouped_heads(key, value, needle):
    with pytest.raises(ValueError, match="^" + needle):
        ModelShape.from_dict({**MODEL, key: value})


def test_roofline_refuses_bad_arguments():
    model, hardware = ModelShape.from_dict(MODEL), Hardware.from_dict(HARDWARE)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=0 is invalid: must be an integer >= 1"):
        RooflineModel(model, hardware, 16, tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"^block_size=True is invalid"):
        RooflineModel(model, hardware, True)
    with pytest.raises(ValueError, match=r"^model=dict is invalid: a ModelShape \(ModelShape.from_dict"):
        RooflineModel(MODEL, hardware, 16)
    with pytest.raises(ValueError, match=r"^hardware=dict is invalid: a Hardware \(Hardware.from_dict"):
        RooflineModel(model, HARDWARE, 16)


@pytest.mark.parametrize("block_size", [0, -16, True, 16.0])
def test_profiled_model_refuses_a_bad_block_size(block_size):
    with pytest.raises(ValueError, match=rf"^block_size={block_size!r} is invalid: must be an integer >= 1"):
        ProfiledModel(Path(PROFILE), block_size)
