"""The search space (`search.space`): deployments, and the run configuration of each."""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.lib.paths import REPO_ROOT
from experiments.lib.search.catalogue import GpuType

CONF_DIR = REPO_ROOT / "conf"
# Dimension -> (its type, the conf/ group whose file names it takes, or None).
DIMENSIONS: dict[str, tuple[type, str | None]] = {
    "gpu": (str, None), "tensor_parallel_size": (int, None), "replicas": (int, None),
    "max_num_seqs": (int, None), "max_num_batched_tokens": (int, None),
    "policy": (str, "policy"), "router": (str, "router"),
}
# Prefill/decode disaggregation needs replicas with a prefill or decode role, which the fleet does
# not have: the space refuses these dimensions by name rather than ignoring them.
DISAGGREGATION_KEYS = ("pd_split", "prefill_replicas", "decode_replicas", "role")


@dataclass(slots=True, frozen=True)
class Deployment:
    gpu: str
    tensor_parallel_size: int
    replicas: int
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    router: str

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.replicas

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def deployments(space: Mapping[str, Any], catalogue: Mapping[str, GpuType]) -> list[Deployment]:
    """Every combination of `search.space`'s lists, each value checked (the field is named)."""
    for key in space:
        if key in DISAGGREGATION_KEYS:
            raise ValueError(f"search.space.{key} is not available: prefill/decode disaggregation needs replica "
                             "roles, which the simulated fleet does not have yet (docs/search.md)")
        if key not in DIMENSIONS:
            raise ValueError(f"search.space.{key} is unknown: allowed are {sorted(DIMENSIONS)}")
    values: dict[str, list] = {}
    for key, (kind, group) in DIMENSIONS.items():
        vals = space.get(key)
        if not isinstance(vals, (list, tuple)) or not vals:
            raise ValueError(f"search.space.{key}={vals!r} is invalid: must be a non-empty list")
        for i, v in enumerate(vals):
            where = f"search.space.{key}[{i}]={v!r}"
            if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where} is invalid: must be an integer >= 1")
            if kind is str and not isinstance(v, str):
                raise ValueError(f"{where} is invalid: must be a name")
            if key == "gpu" and v not in catalogue:
                raise ValueError(f"{where} is unknown: the catalogue has {sorted(catalogue)} (conf/catalogue)")
            if group is not None and not (CONF_DIR / group / f"{v}.yaml").is_file():
                known = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
                raise ValueError(f"{where} is unknown: choose one of {known} (conf/{group})")
        values[key] = list(dict.fromkeys(vals))
    out = []
    for combo in itertools.product(*values.values()):
        d = Deployment(*combo)
        if d.replicas == 1 and d.router != values["router"][0]:
            continue  # one replica: the router routes nothing, keep one of them
        out.append(d)
    return out


def run_config(base: DictConfig, d: Deployment, gpu: GpuType) -> DictConfig:
    """The `experiments.run` configuration of deployment `d`: the search's run keys with the
    deployment's GPU, sizes, policy and router (the search's own keys left out)."""
    cfg = base.copy()
    OmegaConf.set_struct(cfg, False)
    for key in ("search", "catalogue"):
        cfg.pop(key, None)
    cfg.hardware = OmegaConf.create(gpu.hardware_config())
    cfg.parallel = OmegaConf.merge(cfg.get("parallel") or {}, {"tensor_parallel_size": d.tensor_parallel_size})
    cfg.cluster = OmegaConf.merge(cfg.get("cluster") or {}, {"replicas": d.replicas, "hardware": None})
    cfg.scheduler.max_num_seqs = d.max_num_seqs
    cfg.scheduler.max_num_batched_tokens = d.max_num_batched_tokens
    cfg.policy = OmegaConf.load(CONF_DIR / "policy" / f"{d.policy}.yaml")
    cfg.router = OmegaConf.load(CONF_DIR / "router" / f"{d.router}.yaml")
    return cfg
