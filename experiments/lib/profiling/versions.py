"""The library versions a measurement ran with, for its metadata (profiles, fidelity runs)."""
from __future__ import annotations


def versions() -> str:
    import torch
    import transformers
    try:
        import triton
        tri = triton.__version__
    except ImportError:
        tri = "none"
    return (f"torch {torch.__version__}, triton {tri}, transformers {transformers.__version__}, "
            f"CUDA {torch.version.cuda or 'none'}")
