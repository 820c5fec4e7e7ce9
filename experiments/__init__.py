"""Entry points, workloads, metrics and analysis. Registers the OmegaConf resolver the configs use:
`${profile_suffix:${scheduler.async_scheduling}}` is "-async" for async scheduling, else "" (a
latency profile is taken in one scheduling mode: experiments/profiles/<gpu>-<model>[-async].csv)."""
from omegaconf import OmegaConf


def profile_suffix(async_scheduling: bool) -> str:
    return "-async" if async_scheduling else ""


OmegaConf.register_new_resolver("profile_suffix", profile_suffix, replace=True)
