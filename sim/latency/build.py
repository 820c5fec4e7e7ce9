"""Latency models by name, each with its own config (conf/latency/<name>.yaml), and the one
builder from a typed config to a model. A new model subclasses `LatencyModel`, declares its config
dataclass (a subclass of `LatencyConfig`), implements `from_config(config, setup)` and registers
(sim/latency/operators.py does, with `OperatorsConfig`):

    @dataclass(kw_only=True)
    class OperatorsConfig(LatencyConfig):
        dir: str | None = None
        ...

    @LATENCY_MODELS.register("operators", config=OperatorsConfig)
    class OperatorModel(LatencyModel):
        @classmethod
        def from_config(cls, config: OperatorsConfig, setup: LatencySetup) -> OperatorModel: ...

plus an import line in sim/latency/__init__.py and `conf/latency/operators.yaml` with `name: operators`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from policies.registry import Registry
from sim.latency.shapes import Hardware, ModelShape

LATENCY_MODELS: Registry[type] = Registry("latency model", field="name", group="latency")


@dataclass(kw_only=True)
class LatencyConfig:
    """The knobs every latency model has (conf/latency/<name>.yaml); a model with more subclasses it."""

    name: str | None = None  # the registered name


@dataclass(slots=True, frozen=True)
class EngineAllReduce:
    """The all-reduce the engine runs at the run's tensor-parallel size, dtype and `parallel`
    settings (engine/distributed/all_reduce_path.py), given by the caller."""

    path: Callable[[int], str]  # a message's path by its bytes: "one-shot", "two-shot" or "nccl"
    one_shot_max_bytes: int
    two_shot_max_bytes: int
    off_reason: str | None = None  # why every message takes NCCL; None: the symmetric-memory paths are on
    kernel: str = "torch"  # whose kernels sum the symmetric paths' messages (`ParallelConfig.kernel_for`)
    # Whether the fused all-reduce + residual add + RMSNorm kernel takes rows of a width (elements);
    # None: the engine does not fuse its layer boundaries (any kernel but "triton_fused" and
    # "triton_lamport": `FUSED_ALL_REDUCE_KERNELS`; NCCL only).
    fuses_width: Callable[[int], bool] | None = None
    # Whether the group maps its peers' memory (the settings leave the symmetric paths on, whatever
    # the dtype: the sequence-parallel steps' fused ops need only that); None: as `off_reason` says.
    symmetric_memory_on: bool | None = None

    @property
    def symmetric_memory(self) -> bool:
        return self.off_reason is None if self.symmetric_memory_on is None else self.symmetric_memory_on


@dataclass(slots=True, frozen=True)
class LatencySetup:
    """What a latency model prices steps for, besides its own config: the whole model (each
    GPU's share follows from `tensor_parallel_size`), the hardware and the run's scheduling."""

    model: ModelShape
    hardware: Hardware
    block_size: int
    tensor_parallel_size: int = 1
    async_scheduling: bool = False
    # The engine's CUDA-graph buckets for the run's limits, (batch sizes, token sizes), computed on
    # demand by the caller (the simulator does not import the engine); None: not known.
    graph_sizes: Callable[[], tuple[list[int], list[int]]] | None = None
    # The engine decode kernel's split-KV count for (programs before splits, programs one wave runs,
    # block-table tokens) (kernels/decode_splits.py), imported on demand by the caller; None: not known.
    decode_splits: Callable[[int, int, int], int] | None = None
    max_model_len: int | None = None  # the engine's block tables hold this many tokens (rounded up to blocks)
    # The engine's all-reduce for the run's settings, built on demand by the caller; None: not
    # known (every all-reduce priced as NCCL's, and the model says so).
    all_reduce: Callable[[], EngineAllReduce] | None = None
    # Eager steps of this many tokens or more run sequence-parallel at N > 1 (the engine's
    # `parallel.sequence_parallel_min_rows`; 0: none). Only models with `prices_sequence_parallel` take it.
    sequence_parallel_min_rows: int = 0


def build_latency_model(config: LatencyConfig, setup: LatencySetup, where: str = "latency"):
    """The latency model `config` names, set up for `setup`."""
    cls = LATENCY_MODELS.get(config.name, where)
    rows = setup.sequence_parallel_min_rows
    if rows and setup.tensor_parallel_size > 1 and not getattr(cls, "prices_sequence_parallel", False):
        raise ValueError(f"parallel.sequence_parallel_min_rows={rows} is invalid with {where}={config.name}: "
                         "it does not price sequence-parallel steps; use latency=operators (their rows "
                         "measured) or latency=roofline, or set it to 0")
    return cls.from_config(config, setup)
