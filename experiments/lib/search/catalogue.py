"""The GPU catalogue of a search (conf/catalogue/): GPU types, their conf/hardware files and prices."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from experiments.lib.paths import REPO_ROOT

HARDWARE_DIR = REPO_ROOT / "conf" / "hardware"


@dataclass(slots=True, frozen=True)
class GpuType:
    name: str  # the catalogue's key
    hardware: str  # conf/hardware/<hardware>.yaml
    price_per_hour: float  # USD per GPU-hour

    def hardware_config(self) -> dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.load(HARDWARE_DIR / f"{self.hardware}.yaml"))  # type: ignore[return-value]


def load_catalogue(section: Mapping[str, Any] | None) -> dict[str, GpuType]:
    """`catalogue.gpus` checked: every entry names a conf/hardware file and a positive price."""
    gpus = (section or {}).get("gpus")
    if not isinstance(gpus, Mapping) or not gpus:
        raise ValueError("catalogue.gpus is missing or empty: give {name: {hardware: ..., price_per_hour: ...}}")
    known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
    out = {}
    for name, entry in gpus.items():
        where = f"catalogue.gpus.{name}"
        if not isinstance(entry, Mapping) or set(entry) - {"hardware", "price_per_hour"}:
            raise ValueError(f"{where}={entry!r} is invalid: give exactly hardware and price_per_hour")
        hardware = entry.get("hardware")
        if hardware not in known:
            raise ValueError(f"{where}.hardware={hardware!r} is unknown: choose one of {known} (conf/hardware)")
        price = entry.get("price_per_hour")
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not 0 < price < math.inf:
            raise ValueError(f"{where}.price_per_hour={price!r} is invalid: must be a number > 0 (USD per GPU-hour)")
        out[str(name)] = GpuType(str(name), hardware, float(price))
    return out
