"""Config -> objects: model/hardware shapes, KV block counts, scheduler, latency model, workload.

Every check raises ValueError naming the config key (`blocks.block_size=0 is invalid: ...`), which
the entry points print as one line.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.lib.paths import resolve_path
from experiments.lib.workloads import Workload, build_workload
from sim.latency import Hardware, LatencyModel, ModelShape, ProfiledModel, RooflineModel
from sim.latency.tensor_parallel import shard_shape

LATENCY_MODELS = ("roofline", "profiled", "operators")


def section(cfg: DictConfig, key: str) -> dict[str, Any]:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{key} is missing from the config")
    return OmegaConf.to_container(cfg[key], resolve=True)  # type: ignore[return-value]


def model_shape(cfg: DictConfig) -> ModelShape:
    return ModelShape.from_dict(section(cfg, "model"))


def hardware(cfg: DictConfig) -> Hardware:
    return Hardware.from_dict(section(cfg, "hardware"))


def tensor_parallel_size(cfg: DictConfig) -> int:
    """`parallel.tensor_parallel_size` (1 when the config has no `parallel` block)."""
    size = (cfg.get("parallel") or {}).get("tensor_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"parallel.tensor_parallel_size={size!r} is invalid: must be an integer >= 1")
    return size


def gpu_model_shape(cfg: DictConfig) -> ModelShape:
    """The model one GPU holds under `parallel.tensor_parallel_size` (the whole model for 1)."""
    try:
        return shard_shape(model_shape(cfg), tensor_parallel_size(cfg))
    except ValueError as e:
        raise ValueError(f"parallel.{e}" if str(e).startswith("tensor_parallel_size") else f"model.{e}") from None


def _int_at_least(b: Mapping[str, Any], key: str, low: int) -> int:
    v = b.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"blocks.{key}={v!r} is invalid: must be an integer >= {low}")
    return v


def _gib(b: Mapping[str, Any], key: str, allow_zero: bool) -> float:
    v = b.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"blocks.{key}={v!r} is invalid: must be a number {'>=' if allow_zero else '>'} 0 (GiB)")
    return float(v)


def block_size(cfg: DictConfig) -> int:
    bs = cfg.blocks.get("block_size")
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
        raise ValueError(f"blocks.block_size={bs!r} is invalid: must be a power of two >= 1")
    return bs


def kv_block_counts(cfg: DictConfig) -> tuple[int, int]:
    """(num_gpu_blocks, num_cpu_blocks) for the simulated GPU, as vLLM sizes its pools."""
    b = section(cfg, "blocks")
    model, hw = gpu_model_shape(cfg), hardware(cfg)  # per GPU: each holds its share of weights and KV
    block_bytes = model.kv_bytes_per_token * block_size(cfg)
    if b.get("num_gpu_blocks") is not None:
        gpu = _int_at_least(b, "num_gpu_blocks", 1)
    elif b.get("kv_cache_gib") is not None:
        gpu = int(_gib(b, "kv_cache_gib", allow_zero=False) * 2**30 // block_bytes)
        if gpu < 1:
            raise ValueError(f"blocks.kv_cache_gib={b['kv_cache_gib']!r} is invalid: it holds no KV block "
                             f"of {block_bytes} bytes (model={model.name}, block_size={block_size(cfg)})")
    else:
        util = b.get("gpu_memory_utilization")
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"blocks.gpu_memory_utilization={util!r} is invalid: must be in (0, 1]")
        sched = cfg.scheduler
        # Peak activations of one max-size forward (vLLM measures this with a profiling run).
        activations = (sched.max_num_batched_tokens * (4 * model.hidden_size + 2 * model.intermediate_size)
                       * model.dtype_bytes + sched.max_num_seqs * model.vocab_size * 4)
        budget = hw.memory_bytes * util - model.weight_bytes - activations
        gpu = int(budget // block_bytes)
        if gpu < 1:
            raise ValueError(f"blocks.gpu_memory_utilization={util!r} is invalid: {hw.name} memory x {util} "
                             f"leaves {budget / 2**30:.2f} GiB for KV after weights and activations: no block fits")
    if b.get("num_cpu_blocks") is not None:
        cpu = _int_at_least(b, "num_cpu_blocks", 0)
    else:
        cpu = int(_gib(b, "swap_space_gib", allow_zero=True) * 2**30 // block_bytes)
    return gpu, cpu


def build_block_manager(cfg: DictConfig, num_gpu_blocks: int, num_cpu_blocks: int):
    from policies.blocks import BLOCK_MANAGERS, make_block_manager
    kind = cfg.blocks.get("kind")
    if kind not in BLOCK_MANAGERS:
        raise ValueError(f"blocks.kind={kind!r} is unknown: choose one of {sorted(BLOCK_MANAGERS)}")
    watermark = cfg.blocks.get("watermark")
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise ValueError(f"blocks.watermark={watermark!r} is invalid: must be in [0, 1)")
    return make_block_manager(kind, block_size(cfg), num_gpu_blocks, num_cpu_blocks, float(watermark),
                              cfg.scheduler.max_model_len)


def build_predictor(cfg: DictConfig, workload: Workload | None):
    """The policy's output-length predictor (experiments/lib/predictors.py), or None if it has none."""
    from experiments.lib.predictors import build_predictor as build
    spec = section(cfg, "policy").get("predictor")
    if spec is None:
        return None
    workload_cfg = section(cfg, "workload") if cfg.get("workload") is not None else None
    return build(spec, workload, workload_cfg, int(cfg.get("seed") or 0), model_shape(cfg).vocab_size)


def build_scheduler(cfg: DictConfig, num_gpu_blocks: int, num_cpu_blocks: int, recorder=None,
                    workload: Workload | None = None):
    """The policies.Scheduler for this config (both backends use it; the engine passes its own
    measured block counts). `workload`: the run's, for a policy whose predictor reads its true
    output lengths (the oracle)."""
    from policies import Scheduler, SchedulerConfig, make_policy
    pol = section(cfg, "policy")
    name = pol.pop("name", None)
    if pol.get("predictor") is not None:
        pol["predictor"] = build_predictor(cfg, workload)
    try:
        policy = make_policy(name, **pol)
    except TypeError as e:
        raise ValueError(f"policy: {e} (keys of conf/policy/{name}.yaml must match the policy's arguments)") from None
    except ValueError as e:  # "<kind> policy=<value> ..." or "<field>=<value> ...": name the config key
        msg = str(e)
        head = f"policy={name!r}"
        raise ValueError(f"policy.name={name!r}{msg.split(head, 1)[1]}" if head in msg else f"policy.{msg}") from None
    s = section(cfg, "scheduler")
    try:
        sched_cfg = SchedulerConfig(**s)
    except TypeError as e:
        raise ValueError(f"scheduler: {e}") from None
    except ValueError as e:
        raise ValueError(f"scheduler.{e}") from None
    return Scheduler(sched_cfg, policy, build_block_manager(cfg, num_gpu_blocks, num_cpu_blocks), recorder)


def build_latency(cfg: DictConfig) -> LatencyModel:
    lat = section(cfg, "latency")
    name = lat.get("name")
    if name == "roofline":
        gpu_model_shape(cfg)  # the size's errors, named by config key
        try:
            return RooflineModel(model_shape(cfg), hardware(cfg), block_size(cfg), tensor_parallel_size(cfg))
        except ValueError as e:
            raise ValueError(f"parallel.tensor_parallel_size: {e}") from None
    if name == "profiled":
        path = resolve_path(str(lat.get("path")))
        if not path.is_file():
            raise ValueError(f"latency.path={str(lat.get('path'))!r} is invalid: no such profile. Run "
                             "`python -m experiments.profile` on that GPU, or try "
                             "latency.path=experiments/profiles/example-synthetic.csv")
        return ProfiledModel(path, block_size(cfg), model_name=cfg.model.get("name"),
                             tensor_parallel_size=tensor_parallel_size(cfg),
                             async_scheduling=bool((cfg.get("scheduler") or {}).get("async_scheduling", False)))
    if name == "operators":
        return build_operator_model(cfg, lat)
    raise ValueError(f"latency.name={name!r} is unknown: choose one of {list(LATENCY_MODELS)}")


def build_operator_model(cfg: DictConfig, lat: Mapping[str, Any]) -> LatencyModel:
    """`latency=operators` (sim/latency/operators.py) from the operator files of `latency.gpu` and
    `latency.dtype` in `latency.dir`."""
    from sim.latency.operator_profile import OperatorProfile, find_operator_files
    from sim.latency.operators import OperatorModel
    directory = resolve_path(str(lat.get("dir")))
    if not directory.is_dir():
        raise ValueError(f"latency.dir={str(lat.get('dir'))!r} is invalid: no such directory of operator profiles")
    files = find_operator_files(directory, str(lat.get("gpu")), str(lat.get("dtype")), str(lat.get("kernels", "auto")))
    gpu_model_shape(cfg)  # the size's errors, named by config key
    batch_sizes = token_sizes = None
    if lat.get("cuda_graphs", True):  # the engine's graph buckets: steps run padded to them
        from engine.cuda_graph import graph_batch_sizes, graph_token_sizes
        batch_sizes = graph_batch_sizes(cfg.scheduler.max_num_seqs)
        token_sizes = graph_token_sizes(cfg.scheduler.max_num_batched_tokens)
    return OperatorModel(OperatorProfile.load(files), model_shape(cfg), block_size(cfg), tensor_parallel_size(cfg),
                         host_step_s=lat.get("host_step_s", 0.0), admission_s=lat.get("admission_s", 0.0),
                         batch_sizes=batch_sizes, token_sizes=token_sizes, sync_host_s=lat.get("sync_host_s", 0.0),
                         sync_host_per_seq_s=lat.get("sync_host_per_seq_s", 0.0),
                         async_scheduling=bool((cfg.get("scheduler") or {}).get("async_scheduling", False)))


def workload(cfg: DictConfig) -> Workload:
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is invalid: must be an integer >= 0")
    return build_workload(section(cfg, "workload"), seed, model_shape(cfg).vocab_size)
