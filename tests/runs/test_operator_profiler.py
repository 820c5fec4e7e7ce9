"""The operator profiler times the engine's elementwise pieces as the engine calls them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")


def test_norms_are_timed_with_a_parameter_weight_as_the_engines_rmsnorm(monkeypatch):
    """torch.compile takes an nn.Parameter's shape as static and a plain tensor's as symbolic: a
    plain-tensor weight compiles another (slower) norm kernel than the engine runs."""
    import engine.models.ops as ops
    from experiments.lib.profiling.operator_grid import OperatorGrid
    from experiments.lib.profiling.operators import Timer, elementwise_rows

    weights: list[torch.Tensor] = []
    built: list[bool] = []

    def recording_ops(compile: bool, eps: float) -> SimpleNamespace:
        built.append(compile)
        plain = real_fused_ops(False, eps)

        def norm(x, w):
            weights.append(w)
            return plain.rms_norm(x, w)

        def add_norm(x, r, w):
            weights.append(w)
            return plain.add_rms_norm(x, r, w)
        return SimpleNamespace(rms_norm=norm, add_rms_norm=add_norm, silu_and_mul=plain.silu_and_mul)

    real_fused_ops = ops.fused_ops
    monkeypatch.setattr(ops, "fused_ops", recording_ops)
    sizes = dict(gemm_m=[1], gemm_k=[8], gemm_n=[8], head_dims=[8], kv_heads=[1], groups=[1], decode_seqs=[1],
                 decode_context=[8], prefill_tokens=[8], prefill_context=[0], tokens=[1, 4], widths=[8, 16],
                 sample_rows=[1], vocab=[32], copy_bytes=[1024], swap_bytes=[1024], launch_kernels=[1],
                 collective_bytes=[1024], world_sizes=[2], target_ms=0.01)
    rows = list(elementwise_rows(OperatorGrid(**sizes), Timer(torch.device("cpu"), 0.01), torch.float32))
    assert {r["op"] for r in rows} >= {"rms_norm", "add_rms_norm"}
    assert weights and all(isinstance(w, torch.nn.Parameter) for w in weights)
    assert len(built) == len(sizes["widths"])  # compiled afresh per width
