"""`ParallelConfig`: how the engine shards a model over GPUs (tensor parallelism) and which
all-reduce paths and kernels sum its messages (docs/parallelism.md). A leaf module, as
engine/config.py: it imports no other engine module."""
from __future__ import annotations

from dataclasses import dataclass

from policies.sequence_parallel import check_min_rows

# The largest all-reduce the symmetric-memory paths take by default (vLLM's custom all-reduce
# default), and the most any setting may ask for (the buffer each GPU allocates at start-up).
CUSTOM_ALL_REDUCE_MAX_BYTES = 8 * 2**20
CUSTOM_ALL_REDUCE_LIMIT_BYTES = 2**30
# The symmetric-memory all-reduce is on by default, as vLLM's custom all-reduce: a worker's death or
# hang with it on is reported within the same bounds as with NCCL only (docs/parallelism.md, Faults).
DISABLE_CUSTOM_ALL_REDUCE = False
# Which kernels sum the symmetric-memory messages: torch's (`symm_mem` ops), the Triton ones
# (kernels/all_reduce.py: one program per SM), the Triton ones with the layer boundary's
# all-reduce, residual add and RMSNorm fused into one kernel, or the barrier-free one-shot, fused
# alike (kernels/all_reduce_lamport.py; "auto" picks it at two ranks: `ParallelConfig.kernel_for`).
ALL_REDUCE_KERNELS = ("auto", "torch", "triton", "triton_fused", "triton_lamport")
# The kernels that sum a decoder layer's boundary with its residual add and RMSNorm.
FUSED_ALL_REDUCE_KERNELS = ("triton_fused", "triton_lamport")


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model sharded over `tensor_parallel_size` ranks (GPUs, or processes
    on CPU); a worker silent for `timeout_s` in a step is reported hung.

    All-reduces on GPUs (engine/distributed/all_reduce_path.py, docs/parallelism.md): up to
    `custom_all_reduce_one_shot_max_bytes` one-shot over symmetric memory (None: by world size,
    `one_shot_max_bytes`), up to `custom_all_reduce_max_bytes` two-shot, NCCL above;
    `disable_custom_all_reduce` (False by default, as in vLLM, whose name it is) True sends every
    all-reduce through NCCL. `all_reduce_kernel` picks the symmetric paths' kernels
    (`ALL_REDUCE_KERNELS`): torch's ("torch"), Triton's ("triton"), Triton's with each decoder
    layer's all-reduce fused into the next RMSNorm's residual add ("triton_fused"), the same
    boundary without barriers ("triton_lamport": each rank pushes into its peers' buffers and polls
    its own; 1.3-1.5% faster than "triton_fused" at two H200s), or "auto" (the default:
    "triton_lamport" at two ranks, torch's at other sizes; `kernel_for`). The symmetric-memory
    kernels spin without a deadline, so with them on rank 0 never blocks on a step: it polls the
    step's event and raises `WorkerFailure` when a worker exits or `timeout_s` passes
    (engine/distributed/step_wait.py); its GPU is then freed only when the process exits.

    `sequence_parallel_min_rows` (0: off, the default): an eager forward of at least this many
    rows (the step's tokens) runs its layers sequence-parallel (engine/models/sequence_parallel.py):
    each rank holds 1/N of the rows between the layer boundaries, which are matmul + reduce-scatter
    and all-gather + matmul (torch's fused symmetric-memory ops on GPUs) instead of all-reduces;
    steps that large then run eagerly, never from a CUDA graph."""

    tensor_parallel_size: int = 1
    timeout_s: float = 300.0
    disable_custom_all_reduce: bool = DISABLE_CUSTOM_ALL_REDUCE
    custom_all_reduce_one_shot_max_bytes: int | None = None
    custom_all_reduce_max_bytes: int = CUSTOM_ALL_REDUCE_MAX_BYTES
    all_reduce_kernel: str = "auto"
    sequence_parallel_min_rows: int = 0

    def kernel_for(self, world_size: int) -> str:
        """The kernels the symmetric paths run at `world_size` ranks: "auto" is the barrier-free fused
        boundary at two (Qwen3-8B TP=2 on two H200s, 1.61x TP=1 against 1.59x with the fused kernel
        and 1.50x with torch's: docs/parallelism.md) and torch's kernels at other sizes, where the
        Triton kernels are not measured."""
        if self.all_reduce_kernel != "auto":
            return self.all_reduce_kernel
        return "triton_lamport" if world_size == 2 else "torch"

    def __post_init__(self) -> None:
        if self.all_reduce_kernel not in ALL_REDUCE_KERNELS:
            raise ValueError(f"all_reduce_kernel={self.all_reduce_kernel!r} is invalid: one of {ALL_REDUCE_KERNELS}")
        if not isinstance(self.disable_custom_all_reduce, bool):
            raise ValueError(f"disable_custom_all_reduce={self.disable_custom_all_reduce!r} is invalid: "  # noqa: TRY004
                             "true or false")
        check_min_rows(self.sequence_parallel_min_rows)
        one_shot, most = self.custom_all_reduce_one_shot_max_bytes, self.custom_all_reduce_max_bytes
        _check_bytes("custom_all_reduce_max_bytes", most)
        if one_shot is not None:
            _check_bytes("custom_all_reduce_one_shot_max_bytes", one_shot)
            if one_shot > most:
                raise ValueError(f"custom_all_reduce_one_shot_max_bytes={one_shot} is invalid: must be <= "
                                 f"custom_all_reduce_max_bytes={most} (two-shot covers the sizes between them)")

    def one_shot_max_bytes(self, world_size: int) -> int:
        """The largest one-shot all-reduce: the setting, else 1 MiB on 2 GPUs (on 2x H200, replayed
        from a CUDA graph, one-shot beat two-shot up to 1 MiB and two-shot won from 2 MiB:
        experiments.bench_allreduce, docs/parallelism.md) and vLLM's rule above (up to 512 KiB on
        4, up to 256 KiB on more)."""
        if self.custom_all_reduce_one_shot_max_bytes is not None:
            return self.custom_all_reduce_one_shot_max_bytes
        if world_size <= 2:
            return min(self.custom_all_reduce_max_bytes, 2**20)
        return min(self.custom_all_reduce_max_bytes, 512 * 2**10 if world_size <= 4 else 256 * 2**10)


def _check_bytes(field: str, value: object) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= CUSTOM_ALL_REDUCE_LIMIT_BYTES
            or value % 16):
        raise ValueError(f"{field}={value!r} is invalid: a byte count in [0, {CUSTOM_ALL_REDUCE_LIMIT_BYTES}], "
                         "a multiple of 16 (0: no message takes that path)")

