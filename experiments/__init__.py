"""Entry points, workloads, metrics and analysis. Registers the OmegaConf resolver the configs use:
`${profile_suffix:${scheduler.async_scheduling}}` is "-async" for async scheduling, else "" (a
latency profile is taken in one scheduling mode: experiments/profiles/<gpu>-<model>[-async].csv), and
`${tp_suffix:N}` is "-tpN" for a tensor-parallel size N > 1, else "" (<gpu>-<model>[-tpN][-async].csv),
and `${fresh_run_dir:outputs/x}` is a run's own directory, outputs/x/<date>/<time>[-N]
(experiments/lib/run_dirs.py: runs started in the same second get one each)."""
from omegaconf import OmegaConf

from experiments.lib.run_dirs import fresh_run_dir


def profile_suffix(async_scheduling: bool) -> str:
    return "-async" if async_scheduling else ""


def tp_suffix(tensor_parallel_size: int) -> str:
    return f"-tp{tensor_parallel_size}" if int(tensor_parallel_size) > 1 else ""


OmegaConf.register_new_resolver("profile_suffix", profile_suffix, replace=True)
OmegaConf.register_new_resolver("tp_suffix", tp_suffix, replace=True)
# Cached: however often Hydra resolves `hydra.run.dir`, the run claims one directory.
OmegaConf.register_new_resolver("fresh_run_dir", fresh_run_dir, use_cache=True, replace=True)
