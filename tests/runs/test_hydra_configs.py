"""Every option of every config group composes and builds its objects."""
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module

from experiments.lib import factory

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("policy", "blocks", "backend", "model", "hardware", "workload", "latency", "cluster", "router")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
PROFILE = "latency.path=experiments/profiles/example-synthetic.csv"


def compose_with(*overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_every_group_has_options():
    assert {g for g, _ in OPTIONS} == set(GROUPS)
    assert {"fcfs", "priority"} <= {o for g, o in OPTIONS if g == "policy"}
    assert {"paged", "prefix", "contiguous"} <= {o for g, o in OPTIONS if g == "blocks"}
    assert {"h200", "h100", "a100"} <= {o for g, o in OPTIONS if g == "hardware"}


@pytest.mark.parametrize("group, option", OPTIONS)
def test_option_composes_and_builds(group, option):
    overrides = [f"{group}={option}", "workload.num_requests=7"]
    if option == "profiled":
        overrides.append(PROFILE)
    if option == "operators":  # the committed CPU operator profile (GPU ones are named by hardware)
        overrides += ["latency.gpu=cpu", "latency.dtype=float32"]
    if group == "model":  # tiny models would get millions of blocks from 140 GiB (tested below)
        overrides.append("blocks.kv_cache_gib=2")  # 1.25 GiB of Llama-3.1-70B's KV hold one 4096-token sequence
        positions = yaml.safe_load((CONF / "model" / f"{option}.yaml").read_text())["max_position_embeddings"]
        overrides.append(f"scheduler.max_model_len={min(4096, positions)}")  # the tiny models hold 2048
    cfg = compose_with(*overrides)
    assert cfg[group] is not None
    assert factory.model_shape(cfg).kv_bytes_per_token > 0
    gpu, cpu = factory.kv_block_counts(cfg)
    assert gpu >= 1 and cpu >= 0
    scheduler = factory.build_scheduler(cfg, gpu, cpu)
    assert scheduler.block_manager.num_gpu_blocks == gpu
    assert factory.build_latency(cfg).swap_time(1) > 0
    assert len(factory.workload(cfg)) == 7


def test_unsized_kv_pool_is_derived_from_hardware_memory():
    cfg = compose_with("blocks.kv_cache_gib=null")  # the default run sets 3 GiB (conf/config.yaml)
    gpu, cpu = factory.kv_block_counts(cfg)
    block_bytes = 2 * 28 * 8 * 128 * 2 * 16  # qwen3-0.6b, bf16, 16 tokens
    budget = 140.4 * 2**30 * 0.9 - factory.model_shape(cfg).weight_bytes
    assert budget / block_bytes - 300 < gpu < budget / block_bytes  # minus the activation estimate
    assert cpu == 4 * 2**30 // block_bytes
    assert factory.kv_block_counts(compose_with("blocks.kv_cache_gib=1"))[0] == 2**30 // block_bytes
    assert factory.kv_block_counts(compose_with("blocks.num_gpu_blocks=300"))[0] == 300
    assert factory.kv_block_counts(compose_with("blocks.kv_cache_gib=null", "hardware=h100"))[0] < gpu


SCHEMA_FILES = [(g, p.stem) for g in ("profile_grid", "operator_grid", "fidelity") for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("group, option", OPTIONS + SCHEMA_FILES)
def test_every_file_matches_its_group_schema(group, option):
    """experiments/lib/config_schema.py knows every key of every shipped file (else a run fails)."""
    import yaml

    from experiments.lib.config_schema import _check, _Origin, check_fidelity_spec, group_schema
    data = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    if group == "fidelity":
        check_fidelity_spec(data, CONF / group / f"{option}.yaml")
        return
    schema = group_schema(group, data)
    assert schema is not None, f"no schema for {group}={option}"
    _check(data, schema, group, _Origin("config", None, (), [CONF]))


def test_every_pluggable_group_is_a_registry_and_every_plugin_has_a_file():
    """The groups' schemas come from the registries: each registered plugin of a group has a config
    dataclass and a shipped file naming it (else it could not be picked by `<group>=<name>`)."""
    import dataclasses

    from experiments.lib.config_schema import CONFIG_GROUPS, SINGLE_SCHEMA_GROUPS
    assert set(CONFIG_GROUPS) | set(SINGLE_SCHEMA_GROUPS) >= set(GROUPS)
    for group, registry in CONFIG_GROUPS.items():
        named = {(yaml_load(p) or {}).get(registry.key) for p in (CONF / group).glob("*.yaml")}
        for name in registry:
            if not registry.get(name).__module__.startswith(PACKAGES):
                continue  # registered by a test (a plugin of its own), not shipped
            assert dataclasses.is_dataclass(registry.config_type(name))
            assert name in named, f"{registry.kind} {name!r} has no conf/{group}/*.yaml"


PACKAGES = ("policies.", "sim.", "engine.", "experiments.")


def yaml_load(path: Path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_model_schema_is_the_engine_model_config():
    import dataclasses

    from engine.config import ModelConfig
    from policies.model_shape import ModelShape
    assert issubclass(ModelConfig, ModelShape)
    yaml_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"bos_token_id", "eos_token_id"}
    assert {f.name for f in dataclasses.fields(ModelShape)} == yaml_fields
