"""One registry style for every pluggable kind: policies, block managers, model architectures."""
from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.engine_args import EngineArgs
from engine.models import MODELS, LlamaForCausalLM
from policies.blocks import BLOCK_MANAGERS, PagedBlockManager, make_block_manager
from policies.policy import make_policy
from policies.policy.base import POLICIES
from policies.registry import Registry


@pytest.mark.parametrize("build, registry, message", [
    (lambda: make_policy("lifo"), POLICIES, "policy='lifo' is unknown: choose a scheduling policy from "),
    (lambda: make_block_manager("ring", 16, 8), BLOCK_MANAGERS, "kind='ring' is unknown: choose a block manager from "),
    (lambda: MODELS.get("mistral"), MODELS, "architecture='mistral' is unknown: choose a model architecture from "),
])
def test_unknown_names_say_kind_name_and_choices(build, registry, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value) == message + str(registry.names())


def test_registered_names():
    assert {"fcfs", "priority"} <= set(POLICIES.names())
    assert BLOCK_MANAGERS.names() == ["contiguous", "paged", "prefix"]
    assert MODELS.names() == ["llama", "qwen2", "qwen3"]


def test_the_three_kinds_share_one_registry():
    assert all(isinstance(r, Registry) for r in (POLICIES, BLOCK_MANAGERS, MODELS))
    assert BLOCK_MANAGERS.get("paged") is PagedBlockManager and "prefix" in BLOCK_MANAGERS
    assert {MODELS.get(name) for name in ("llama", "qwen2", "qwen3")} == {LlamaForCausalLM}


def test_the_engine_checks_the_model_architecture_against_the_registry():
    fields = {"name": "m", "architecture": "gpt2", "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
              "vocab_size": 32, "max_position_embeddings": 64, "rope_theta": 10000.0, "rope_scaling": None,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "dtype": "float32",
              "weights": "dummy"}
    with pytest.raises(ValueError, match=r"architecture='gpt2' is unknown: choose a model architecture from \['llama'"):
        EngineArgs(model=ModelConfig(**fields)).model_config()
    assert ModelConfig(**{**fields, "architecture": "qwen3"}).architecture == "qwen3"


def test_registering_a_taken_name_is_refused():
    registry: Registry[type] = Registry("widget", field="widget")

    @registry.register("a", "b")
    class A:
        pass

    registry.register("a")(A)  # the same class again: allowed (a module imported twice)
    with pytest.raises(ValueError, match="widget='a' is already registered as a widget"):
        registry.register("a")(type("B", (), {}))
    with pytest.raises(ValueError, match="names=\\(\\) are invalid"):
        registry.register()
    assert list(registry) == ["a", "b"] and len(registry) == 2 and registry.get("b") is A
    with pytest.raises(ValueError, match="widget=3 is unknown: choose a widget from \\['a', 'b'\\]"):
        registry.get(3)
