"""The operator profiler on a GPU, on the tiny grid (seconds): every operator family times through
the engine's CUDA code paths (Triton kernels, torch.compile'd ops, CUDA graphs), the file passes the
schema, and `latency=operators` prices a model from it; collectives where the machine has 2 GPUs
(with the symmetric-memory all-reduce rows and the fused all-reduce + RMSNorm rows where the GPUs
have peer access)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def test_the_tiny_operator_grid_on_this_gpu(tmp_path):
    from hydra import compose, initialize_config_module

    from engine.distributed.custom_all_reduce import symmetric_memory
    from experiments.lib import factory
    from experiments.profile import profile_operators
    from sim.latency.base import BatchShape
    from sim.latency.operator_profile import OperatorProfile, find_operator_files
    from sim.latency.operators import OperatorModel
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="profile", overrides=[
            "mode=operators", "operator_grid=tiny", "device=cuda", "gpu=test", f"operators_dir={tmp_path}"])
        run_cfg = compose(config_name="config", overrides=["model=qwen3-0.6b"])
    paths = profile_operators(cfg, "pytest")
    assert paths[0].name.startswith("test-bfloat16-")
    tp = 2 if torch.cuda.device_count() >= 2 else 1
    assert len(paths) == (2 if tp == 2 else 1)
    profile = OperatorProfile.load(find_operator_files(tmp_path, "test", "bfloat16"))
    if tp == 2 and symmetric_memory() is not None and torch.cuda.can_device_access_peer(0, 1):
        # The engine's symmetric-memory all-reduce paths are timed where the GPUs have them.
        assert profile.has("all_reduce_one_shot", 2) and profile.has("all_reduce_two_shot", 2)
        # The fused boundary (all-reduce + add + RMSNorm) at the grid's fused_norm_width: 8 rows of 4096.
        assert profile.grid("all_reduce_add_rms_norm", 2).axes[1].points == (4096,)
        assert profile.grid("all_reduce_add_rms_norm", 2).axes[0].points == (65536,)
    model = OperatorModel(profile, factory.model_shape(run_cfg), 16, tp)
    decode = model.shape_time(BatchShape(0, 0, 0, 0, 8, 8 * 300, 8))
    prefill = model.shape_time(BatchShape(512, 1, 0, 512 * 513 // 2, 0, 0, 1, 0, ((512, 0),)))
    assert 0 < decode < prefill < 1.0
