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
    "policy": (str, "policy"), "router": (str, "router"), "pd_split": (str, None),
}
# Dimensions a space may leave out, and the one value they then take.
OPTIONAL = {"pd_split": ["mixed"]}
MIXED = "mixed"


def parse_split(value: object, where: str) -> tuple[int, int]:
    """A `pd_split` value: "mixed" -> (0, 0); "P:D" -> (P, D) prefill and decode replicas, each >= 1."""
    if value == MIXED:
        return 0, 0
    parts = value.split(":") if isinstance(value, str) else []
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"{where} is invalid: give 'mixed' or 'P:D', prefill and decode replica counts >= 1 "
                         "(e.g. '1:3')")
    return int(parts[0]), int(parts[1])


@dataclass(slots=True, frozen=True)
class Deployment:
    gpu: str
    tensor_parallel_size: int
    replicas: int
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    router: str
    pd_split: str = MIXED  # "mixed": every replica serves whole requests; "P:D": P prefill + D decode replicas

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.replicas

    @property
    def roles(self) -> list[str] | None:
        """`cluster.roles` of this deployment (None: all mixed)."""
        prefill, decode = parse_split(self.pd_split, "pd_split")
        return None if not prefill else ["prefill"] * prefill + ["decode"] * decode

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def deployments(space: Mapping[str, Any], catalogue: Mapping[str, GpuType]) -> list[Deployment]:
    """Every combination of `search.space`'s lists, each value checked (the field is named)."""
    for key in space:
        if key not in DIMENSIONS:
            raise ValueError(f"search.space.{key} is unknown: allowed are {sorted(DIMENSIONS)}")
    values: dict[str, list] = {}
    for key, (kind, group) in DIMENSIONS.items():
        vals = space.get(key, OPTIONAL.get(key))
        if not isinstance(vals, (list, tuple)) or not vals:
            raise ValueError(f"search.space.{key}={vals!r} is invalid: must be a non-empty list")
        for i, v in enumerate(vals):
            where = f"search.space.{key}[{i}]={v!r}"
            if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where} is invalid: must be an integer >= 1")
            if kind is str and not isinstance(v, str):
                raise ValueError(f"{where} is invalid: must be a name")
            if key == "pd_split":
                prefill, decode = parse_split(v, where)
                if prefill and prefill + decode not in space.get("replicas", ()):
                    raise ValueError(f"{where} needs replicas={prefill + decode}, which search.space.replicas="
                                     f"{space.get('replicas')!r} does not hold")
            if key == "gpu" and v not in catalogue:
                raise ValueError(f"{where} is unknown: the catalogue has {sorted(catalogue)} (conf/catalogue)")
            if group is not None and not (CONF_DIR / group / f"{v}.yaml").is_file():
                known = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
                raise ValueError(f"{where} is unknown: choose one of {known} (conf/{group})")
        values[key] = list(dict.fromkeys(vals))
    out = []
    for combo in itertools.product(*values.values()):
        d = Deployment(*combo)
        prefill, decode = parse_split(d.pd_split, "pd_split")
        if prefill and prefill + decode != d.replicas:
            continue  # a P:D split is a deployment of P + D replicas only
        front = prefill or d.replicas  # replicas the first router chooses among
        if front == 1 and d.router != values["router"][0]:
            continue  # one replica takes the arrivals: the router routes nothing, keep one of them
        out.append(d)
    return out


def run_config(base: DictConfig, d: Deployment, gpu: GpuType) -> DictConfig:
    """The `experiments.run` configuration of deployment `d`: the search's run keys with the
    deployment's GPU, sizes, policy, router and prefill/decode split (`cluster.roles`; the search's
    own keys left out)."""
    cfg = base.copy()
    OmegaConf.set_struct(cfg, False)
    for key in ("search", "catalogue"):
        cfg.pop(key, None)
    cfg.hardware = OmegaConf.create(gpu.hardware_config())
    cfg.parallel = OmegaConf.merge(cfg.get("parallel") or {}, {"tensor_parallel_size": d.tensor_parallel_size})
    cfg.cluster = OmegaConf.merge(cfg.get("cluster") or {}, {"replicas": d.replicas, "hardware": None,
                                                              "roles": d.roles})
    cfg.scheduler.max_num_seqs = d.max_num_seqs
    cfg.scheduler.max_num_batched_tokens = d.max_num_batched_tokens
    cfg.policy = OmegaConf.load(CONF_DIR / "policy" / f"{d.policy}.yaml")
    cfg.router = OmegaConf.load(CONF_DIR / "router" / f"{d.router}.yaml")
    return cfg
