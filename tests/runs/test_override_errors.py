"""A command-line override of a key the config lacks gets `check_config`'s line for a yaml file's
unknown key (naming the keys allowed there), not OmegaConf's bare "Key 'foo' is not in struct";
and a search deployment whose heads do not split over its GPUs is pruned as such, not for memory."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from experiments.lib.cli import one_line
from experiments.lib.paths import REPO_ROOT
from experiments.lib.search.catalogue import load_catalogue
from experiments.lib.search.runner import prune_reason
from experiments.lib.search.space import Deployment, run_config


def compose_error(*overrides: str, config: str = "config") -> str:
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"), \
            pytest.raises(HydraException) as caught:
        compose(config, list(overrides))
    return one_line(caught.value)


@pytest.mark.parametrize(("overrides", "line"), [
    (["cluster.foo=1"], "the command line (cluster.foo=1): key cluster.foo is unknown: allowed are ['decode_router', "),
    (["foo=1"], "the command line (foo=1): key foo is unknown: allowed are ['backend', 'blocks', 'cluster', "),
    (["scheduler.foo=1"], "key scheduler.foo is unknown: allowed are ['async_scheduling', 'enable_chunked_prefill', "),
    (["workload=azure", "workload.bogus=3"], "key workload.bogus is unknown: allowed are ['drop_empty', 'kind', "),
    # a knob of the schema that the chosen file leaves out: `+` adds it
    (["router=round_robin", "router.count_routed=false"],
     "the command line (router.count_routed=false): key router.count_routed is not in the chosen router config "
     "(its keys: ['name']): add it with +router.count_routed=false"),
    (["workload=poisson", "workload.length_correlation=0.5"],
     "key workload.length_correlation is not in the chosen workload config"),
])
def test_an_unknown_override_names_the_keys_allowed_there(overrides, line):
    assert line in compose_error(*overrides)


def test_other_apps_and_other_errors_keep_their_lines():
    assert "key search.foo is unknown: allowed are ['cache_dir', 'duration_s', " in compose_error("search.foo=1",
                                                                                                  config="search")
    assert compose_error("policy=nope").startswith("In 'config': Could not find 'policy/nope'")


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_pruned_as_sharding():
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("search", ["model=qwen3-0.6b"])
    catalogue = load_catalogue(cfg.catalogue)
    reason = prune_reason(run_config(cfg, Deployment("h200", 3, 1, 64, 2048, "fcfs", "round_robin"),
                                     catalogue["h200"]), None, {})
    assert reason == ("sharding: model.num_attention_heads=16 of model 'qwen3-0.6b' is not divisible by "
                      "tensor_parallel_size=3")
