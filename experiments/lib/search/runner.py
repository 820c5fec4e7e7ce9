"""A capacity search end to end: deployments -> pruning -> capacities (cached, in parallel) ->
the table, the Pareto front and the cheapest deployment for the target rate."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.lib import factory
from experiments.lib.config_schema import check_config
from experiments.lib.search.cache import ResultCache, data_digest, result_key
from experiments.lib.search.catalogue import GpuType, load_catalogue
from experiments.lib.search.outputs import SearchResult, finish
from experiments.lib.search.simulate import (
    MIN_REQUESTS,
    arrival_rate,
    deployment_capacity,
    requests_at,
    workload_for,
)
from experiments.lib.search.slo import SearchSlo
from experiments.lib.search.space import Deployment, deployments, run_config

RESULT_VERSION = 3  # bump when a cached result's meaning changes


@dataclass(slots=True, frozen=True)
class SearchSettings:
    target_rate: float
    start_per_replica: float
    growth: float
    max_iterations: int
    rtol: float
    min_kv_tokens: int | None
    duration_s: float | None
    n_jobs: int
    cache_dir: str


def settings(s: Mapping[str, Any]) -> SearchSettings:
    allowed = {"space", "slo", "target_rate", "rate", "min_kv_tokens", "duration_s", "n_jobs", "cache_dir"}
    for key in s:
        if key not in allowed:
            raise ValueError(f"search.{key} is unknown: allowed are {sorted(allowed)}")
    rate = dict(s.get("rate") or {})
    for key in rate:
        if key not in ("start_per_replica", "growth", "max_iterations", "rtol"):
            raise ValueError(f"search.rate.{key} is unknown: allowed are ['growth', 'max_iterations', 'rtol', "
                             "'start_per_replica']")
    target = s.get("target_rate")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
        raise ValueError(f"search.target_rate={target!r} is invalid: must be a number > 0 (req/s)")
    start = rate.get("start_per_replica", 2.0)
    if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0 < start < math.inf:
        raise ValueError(f"search.rate.start_per_replica={start!r} is invalid: must be a number > 0 (req/s)")
    growth = rate.get("growth", 4.0)
    if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not 1 < growth < math.inf:
        raise ValueError(f"search.rate.growth={growth!r} is invalid: must be a number > 1")
    iters = rate.get("max_iterations", 12)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"search.rate.max_iterations={iters!r} is invalid: must be an integer >= 1")
    rtol = rate.get("rtol", 0.05)
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 < rtol < 1:
        raise ValueError(f"search.rate.rtol={rtol!r} is invalid: must be in (0, 1)")
    min_kv = s.get("min_kv_tokens")
    if min_kv is not None and (isinstance(min_kv, bool) or not isinstance(min_kv, int) or min_kv < 1):
        raise ValueError(f"search.min_kv_tokens={min_kv!r} is invalid: must be an integer >= 1 or null")
    duration = s.get("duration_s")
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                 or not 0 < duration < math.inf):
        raise ValueError(f"search.duration_s={duration!r} is invalid: must be a number > 0 (seconds) or null")
    n_jobs = s.get("n_jobs", 1)
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0 or n_jobs < -1:
        raise ValueError(f"search.n_jobs={n_jobs!r} is invalid: must be an integer >= 1, or -1 (one per core)")
    return SearchSettings(float(target), float(start), float(growth), iters, float(rtol), min_kv, None if duration is None else float(duration), n_jobs, str(s.get("cache_dir")))


def check_covers(cfg: DictConfig, duration_s: float, target_rate: float) -> None:
    """The workload holds the requests of `duration_s` seconds of arrivals at the target rate: a
    trace of fewer rows would be run shorter than `duration_s` where the answer is decided (a
    rate above the target that it does not cover is run at the most it covers, which makes that
    capacity a lower bound)."""
    need = requests_at(target_rate, duration_s)
    wl = workload_for(cfg, target_rate, duration_s)
    if len(wl) < need:
        where = f" (workload.path={cfg.workload.path!r})" if cfg.workload.get("path") else ""
        fix = f"or search.duration_s <= {math.floor(len(wl) / target_rate * 1000) / 1000:g}" \
            if len(wl) >= MIN_REQUESTS else f"(a run offers at least {MIN_REQUESTS})"
        raise ValueError(f"search.duration_s={duration_s:g} is too long for workload={wl.name!r}: a run at "
                         f"search.target_rate={target_rate:g} req/s offers {need} requests, but it holds {len(wl)}"
                         f"{where}, which cover {duration_s:g} s of arrivals only up to {len(wl) / duration_s:.3g} "
                         f"req/s: give a longer trace {fix}")


def check_latency_data(base: DictConfig, gpus: list[GpuType], d: Deployment) -> None:
    """Every searched GPU type has latency data for this run's latency model (one line naming the
    GPU and the latency field otherwise)."""
    for gpu in gpus:
        one = Deployment(gpu.name, 1, 1, d.max_num_seqs, d.max_num_batched_tokens, d.policy, d.router)
        try:
            factory.build_latency(run_config(base, one, gpu))
        except ValueError as e:
            raise ValueError(f"search.space.gpu={gpu.name!r} has no latency data (catalogue.gpus.{gpu.name}.hardware="
                             f"{gpu.hardware!r}, latency={base.latency.name}): {e}") from None


def prune_reason(cfg: DictConfig, min_kv_tokens: int | None, latency_checked: dict) -> str | None:
    """Why a deployment cannot run (None: it can): its weights and a minimum KV pool do not fit
    one GPU's memory at its tensor-parallel size, or its latency model has no data for that size."""
    try:
        shard = factory.gpu_model_shape(cfg)
    except ValueError as e:  # the heads do not split over the GPUs: not a memory limit
        return f"sharding: {e}"
    try:
        gpu_blocks, _ = factory.kv_block_counts(cfg)
    except ValueError as e:
        return f"memory: {e}"
    need = min_kv_tokens if min_kv_tokens is not None else cfg.scheduler.max_model_len
    tokens = gpu_blocks * factory.block_size(cfg)
    if tokens < need:
        return (f"memory: {shard.weight_bytes / 2**30:.1f} GiB of weights per GPU leave a KV pool of {tokens} tokens "
                f"< {need} (search.min_kv_tokens, null: scheduler.max_model_len)")
    reason, _ = latency_check(cfg, latency_checked)
    return reason


def latency_check(cfg: DictConfig, latency_checked: dict) -> tuple[str | None, str]:
    """(why the deployment's latency model refuses it or None, what its prices rest on: the
    model's `data_sources()` as one line), once per GPU type and tensor-parallel size."""
    key = (cfg.hardware.name, factory.tensor_parallel_size(cfg))
    if key not in latency_checked:
        try:
            sources = factory.build_latency(cfg).data_sources()
            latency_checked[key] = (None, "; ".join(f"{part}: {text}" for part, text in sources.items()))
        except ValueError as e:
            latency_checked[key] = (f"latency: {e}", "")
    return latency_checked[key]


def latency_files(cfg: DictConfig) -> list[Path]:
    """The data files the deployment's latency model reads: a profile (`latency.path`), or the
    operator files of its GPU type and dtype in `latency.dir`; none for the roofline."""
    config = factory.latency_config(cfg)
    if getattr(config, "path", None):
        return [Path(config.path)]
    if getattr(config, "dir", None):
        from sim.latency.operator_profile import find_operator_files
        return find_operator_files(config.dir, str(config.gpu), str(config.dtype), str(config.kernels))
    return []


def run_search(cfg: DictConfig, out_dir: str | Path, progress: bool = True) -> SearchResult:
    s = settings(OmegaConf.to_container(cfg.search, resolve=True))  # type: ignore[arg-type]
    catalogue = load_catalogue(OmegaConf.to_container(cfg.catalogue, resolve=True) if cfg.get("catalogue") else None)
    slo = SearchSlo.from_dict(OmegaConf.to_container(cfg.search.slo, resolve=True))  # type: ignore[arg-type]
    space = deployments(OmegaConf.to_container(cfg.search.space, resolve=True), catalogue)  # type: ignore[arg-type]
    first = run_config(cfg, space[0], catalogue[space[0].gpu])
    if s.duration_s is not None and "num_requests" not in first.workload:
        raise ValueError(f"search.duration_s={s.duration_s:g} needs a workload with num_requests (workload.kind="
                         f"{first.workload.get('kind')!r} has none): set search.duration_s=null")
    check_config(first)
    workload = factory.workload(first)
    if arrival_rate(workload) <= 0:
        raise ValueError(f"workload={workload.name!r} is invalid for a search: its requests arrive at once (an offline "
                         "workload), so it has no arrival rate to scale; pick one with arrival times")
    if s.duration_s is not None:
        check_covers(first, s.duration_s, s.target_rate)
    mean_output = sum(workload.output_lens) / len(workload)
    check_latency_data(cfg, [catalogue[g] for g in dict.fromkeys(d.gpu for d in space)], space[0])

    rows: list[dict[str, Any]] = []
    tasks: list[tuple[int, str, dict[str, Any]]] = []
    cache = ResultCache(s.cache_dir)
    latency_checked: dict = {}
    for d in space:
        gpu = catalogue[d.gpu]
        cfg_d = run_config(cfg, d, gpu)
        row: dict[str, Any] = {**d.as_dict(), "num_gpus": d.num_gpus, "price_per_gpu_hour": gpu.price_per_hour,
                               "dollars_per_hour": d.num_gpus * gpu.price_per_hour}
        reason = prune_reason(cfg_d, s.min_kv_tokens, latency_checked)
        if reason is not None:
            row.update(status="pruned", reason=reason, latency_data="")
        else:
            resolved = OmegaConf.to_container(cfg_d, resolve=True)
            key = result_key(resolved, slo.as_dict(), s.duration_s, s.start_per_replica, s.growth, s.max_iterations, s.rtol,
                             RESULT_VERSION, data_digest(latency_files(cfg_d)))
            row.update(status="cached" if key in cache else "simulated", reason="", key=key,
                       latency_data=latency_check(cfg_d, latency_checked)[1])
            if key not in cache:
                tasks.append((len(rows), key, resolved))
        rows.append(row)
    if all(r["status"] == "pruned" for r in rows):
        other = [r["reason"] for r in rows if not r["reason"].startswith("memory")]
        if not other:
            raise ValueError(f"model.name={cfg.model.name!r} fits no catalogue GPU at search.space.tensor_parallel_size="
                             f"{sorted({d.tensor_parallel_size for d in space})}: {rows[-1]['reason']}")
        raise ValueError(f"search.space leaves no deployment to simulate: every one is pruned, e.g. {other[0]}")
    _simulate(tasks, rows, cache, slo, s, progress)
    for row in rows:
        if row["status"] != "pruned":
            row.update(cache.get(row["key"]))
    return finish(cfg, rows, slo, s, mean_output, workload, out_dir)


def _simulate(tasks, rows, cache: ResultCache, slo: SearchSlo, s: SearchSettings, progress: bool) -> None:
    from joblib import Parallel, delayed
    from tqdm import tqdm
    if not tasks:
        return
    calls = (delayed(deployment_capacity)(resolved, slo.as_dict(), s.start_per_replica * rows[i]["replicas"],
                                          s.max_iterations, s.rtol, s.growth, s.duration_s) for i, _, resolved in tasks)
    parallel = Parallel(n_jobs=s.n_jobs, return_as="generator")
    with tqdm(total=len(tasks), desc="search", unit="deployment", disable=not progress, dynamic_ncols=True) as bar:
        for (_, key, _), result in zip(tasks, parallel(calls)):
            cache.put(key, result)  # written as each ends: an interrupted search resumes from here
            bar.update(1)

