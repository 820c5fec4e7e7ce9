"""`python -m experiments.profiles.synthetic [overrides]`: write a latency profile computed by the
roofline model (not measured!) on the grid a GPU profiler would measure. It is the shipped
`example-synthetic.csv` (qwen3-0.6b on h200), used by tests and to try `latency=profiled` without a GPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_module

from experiments.lib import factory
from sim.latency.base import BatchShape
from sim.latency.profile_io import write_profile
from sim.latency.roofline import RooflineModel

PREFILL_TOKENS = (0, 64, 256, 1024, 2048)
DECODE_SEQS = (0, 1, 16, 64, 256)
CONTEXT_PER_DECODE = (128, 512, 2048)
SWAP_BLOCKS = (1, 16, 256, 4096)
DEFAULT_PATH = Path(__file__).parent / "example-synthetic.csv"


def synthetic_profile(cfg, path: Path) -> Path:
    model = factory.model_shape(cfg)
    bs = factory.block_size(cfg)
    roofline = RooflineModel(model, factory.hardware(cfg), bs)
    steps = []
    for p in PREFILL_TOKENS:
        for d in DECODE_SEQS:
            for ctx in (CONTEXT_PER_DECODE if d else (0,)):
                shape = BatchShape(num_prefill_tokens=p, num_prefill_seqs=1 if p else 0,
                                   prefill_attention_pairs=p * (p + 1) // 2, num_decode_seqs=d,
                                   num_context_tokens=d * ctx, num_samples=d + (1 if p else 0))
                steps.append((p, d, d * ctx, roofline.shape_time(shape)))
    swaps = [(n, roofline.swap_time(n)) for n in SWAP_BLOCKS]
    meta = {"servelab latency profile": "v1", "device": f"synthetic (roofline model of {cfg.hardware.name})",
            "model": model.name, "dtype": cfg.model.dtype, "block_size": bs,
            "command": "python -m experiments.profiles.synthetic",
            "async_scheduling": "any"}  # computed, not measured: it stands for either scheduling mode
    return write_profile(path, meta, steps, swaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=args.overrides)
    print(f"wrote {synthetic_profile(cfg, args.out)}")


if __name__ == "__main__":
    main()
