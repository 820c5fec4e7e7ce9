"""One registry style for every pluggable kind (scheduling policies, KV block managers, latency
models, backends, workloads, model architectures, routers): an implementation registers itself
under a name with a decorator, together with its own typed config (a dataclass of its knobs), and
is looked up by name with an error that names the kind, the bad name and the allowed names.

    BLOCK_MANAGERS = Registry("block manager", field="kind", group="blocks")

    @dataclass(kw_only=True)
    class RingConfig(BlockManagerConfig):
        headroom_tokens: int = 0

    @BLOCK_MANAGERS.register("ring", config=RingConfig)
    class RingBlockManager(BlockManager): ...

    BLOCK_MANAGERS.get("ring")  # the class
    BLOCK_MANAGERS.config("ring", {"headroom_tokens": 8}, where="blocks")  # a RingConfig
    BLOCK_MANAGERS.get("disk")  # ValueError: kind='disk' is unknown: choose a block manager from [...]

A registry that names a config `group` (conf/<group>/*.yaml) joins `CONFIG_GROUPS`, from which
experiments/lib/config_schema.py derives that group's schema: a yaml file is checked against the
config of the plugin its `key` names, so a plugin's new knob needs no edit anywhere else.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(kw_only=True)
class NoConfig:
    """The config of a plugin without knobs."""


class Registry(Generic[T]):
    def __init__(self, kind: str, field: str, group: str | None = None, key: str | None = None) -> None:
        """`kind`: what is registered, in words ("block manager"); `field`: the setting that names
        one (`kind`, `policy`, `architecture`), first in the error message so that a caller can
        prefix its config path (`blocks.kind=...`). `group`: the Hydra config group whose files
        pick one of these (None: not chosen by a config group); `key`: the key of such a file that
        names the plugin (default `field`)."""
        self.kind = kind
        self.field = field
        self.group = group
        self.key = key or field
        self._entries: dict[str, T] = {}
        self._configs: dict[str, type] = {}
        if group is not None:
            if CONFIG_GROUPS.get(group, self) is not self:
                raise ValueError(f"group={group!r} already has a registry ({CONFIG_GROUPS[group].kind})")
            CONFIG_GROUPS[group] = self

    def register(self, *names: str, config: type | None = None) -> Callable[[T], T]:
        """Decorator registering its target under each of `names` (one implementation may serve
        several names), with `config` the dataclass of its knobs (default: none). A name taken by
        another implementation is an error."""
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"{self.kind} names={names!r} are invalid: one or more non-empty strings")
        if config is not None and not dataclasses.is_dataclass(config):
            raise ValueError(f"config={config!r} of {self.kind} {names[0]!r} is invalid: must be a dataclass")

        def wrap(entry: T) -> T:
            for name in names:
                if self._entries.get(name, entry) is not entry:
                    raise ValueError(f"{self.field}={name!r} is already registered as a {self.kind} "
                                     f"(by {self._entries[name]!r})")
                self._entries[name] = entry
                self._configs[name] = config or NoConfig
            return entry
        return wrap

    def get(self, name: str, where: str | None = None) -> T:
        """The implementation registered as `name`; `where` (a config path such as "blocks")
        names the setting in the error as `<where>.<key>` instead of `field`."""
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            setting = f"{where}.{self.key}" if where else self.field
            raise ValueError(f"{setting}={name!r} is unknown: choose a {self.kind} from {self.names()}")
        return entry

    def config_type(self, name: str, where: str | None = None) -> type:
        """The config dataclass `name` registered with."""
        self.get(name, where)
        return self._configs[name]

    def config(self, name: str, values: Mapping[str, Any] | None = None, where: str | None = None) -> Any:
        """`name`'s config from `values` (a mapping of its knobs; the key naming the plugin may be
        among them). An unknown knob is a ValueError naming it and the allowed ones."""
        cls = self.config_type(name, where)
        allowed = {f.name for f in dataclasses.fields(cls) if f.init}
        given = {k: v for k, v in (values or {}).items() if k != self.key}
        unknown = sorted(set(given) - allowed)
        if unknown:
            prefix = f"{where}." if where else ""
            raise ValueError(f"{prefix}{unknown[0]} is unknown for {self.kind} {name!r}: allowed are "
                             f"{sorted(allowed - {self.key})}")
        if self.key in allowed:
            given[self.key] = name
        return cls(**given)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        """The names in registration order."""
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


# Config group -> the registry of the plugins its files choose (filled as registries are made).
CONFIG_GROUPS: dict[str, Registry[Any]] = {}


def knobs(config: Any, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A config dataclass's fields as keyword arguments (shallow: nested values are kept as they are)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.init and f.name not in exclude}


def check_arguments(cls: type, config: type, exclude: frozenset[str] = frozenset()) -> None:
    """That `cls(...)` takes each field of `config` (but `exclude`) as a keyword argument with the
    field's default, so that a plugin built from its config and one built by hand agree."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    for f in dataclasses.fields(config):
        if f.name in exclude or not f.init:
            continue
        param = params.get(f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty)
        if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ValueError(f"{cls.__name__} takes no argument {f.name!r}, a field of its config {config.__name__}")
        if param.default != default and not (param.default is None and default in ({}, [])):
            raise ValueError(f"{cls.__name__}({f.name}={param.default!r}) differs from its config "
                             f"{config.__name__}.{f.name}={default!r}")
