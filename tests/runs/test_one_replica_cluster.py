"""The `cluster` and `router` settings of a one-replica run (the default, `cluster.replicas=1`):
checked as a fleet's are, on every backend, and `cluster.hardware` honoured (the replica runs on
the GPU it names, as replica 0 of a fleet would)."""
from __future__ import annotations

import re

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from test_bad_input_run import cli_error

from experiments.lib.run_workload import run

SMALL = ["workload.num_requests=12", "progress=false", "plots=false"]


@pytest.mark.parametrize("overrides, match", [
    (["cluster.roles=[prefill]"], r"cluster.roles=\['prefill'\] has 1 prefill replica\(s\) and 0 decode"),
    (["cluster.roles=[decode]"], r"cluster.roles=\['decode'\] has 1 decode replica\(s\) and 0 prefill"),
    (["cluster.hardware=[nope]"], r"cluster.hardware\[0\]='nope' is unknown: choose one of \['a100'"),
    (["cluster.hardware=[a100,h100,h200]"], r"cluster.hardware=\['a100', 'h100', 'h200'\] is invalid: give one "
                                             r"conf/hardware name per replica \(1\)"),
    (["cluster.handoff_queue=0"], r"cluster.handoff_queue=0 is invalid: must be an integer >= 1"),
    (["cluster.dispatch_hop_s=-1"], r"cluster.dispatch_hop_s=-1 is invalid: must be a number of seconds >= 0"),
    (["cluster.refresh_s=-1"], r"cluster.refresh_s=-1 is invalid"),
    (["router=prefix_aware", "router.cache_threshold=2"], r"router.cache_threshold=2 is invalid: must be a number "
                                                          r"in \[0, 1\]"),
    (["backend=server", "backend.url=http://127.0.0.1:1", "cluster.hardware=[a100]"],
     r"cluster.hardware=\['a100'\] is invalid with backend=server: it picks simulated GPUs"),
])
def test_one_replica_cluster_settings_are_checked(overrides, match, monkeypatch, capsys):
    err = cli_error(["workload.num_requests=5", *overrides], monkeypatch, capsys)
    assert re.search(match, err), err


def _cfg(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*SMALL, *overrides])


def test_one_replica_runs_on_the_cluster_hardware(tmp_path):
    named = run(_cfg("cluster.hardware=[a100]"), tmp_path / "named")
    run(_cfg("hardware=a100"), tmp_path / "direct")
    default = run(_cfg(), tmp_path / "default")
    assert named["run"]["hardware"] == "a100" and default["run"]["hardware"] == "h200"
    frames = {d: pd.read_parquet(tmp_path / d / "requests.parquet") for d in ("named", "direct", "default")}
    pd.testing.assert_frame_equal(frames["named"], frames["direct"])
    assert not frames["named"]["finish_time"].equals(frames["default"]["finish_time"])  # a slower GPU's times
