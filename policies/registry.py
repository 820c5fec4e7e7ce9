"""One registry style for every pluggable kind (scheduling policies, KV block managers, model
architectures): an implementation registers itself under a name with a decorator, and is looked up
by name with an error that names the kind, the bad name and the allowed names.

    BLOCK_MANAGERS = Registry("block manager", field="kind")

    @BLOCK_MANAGERS.register("paged")
    class PagedBlockManager(BlockManager): ...

    BLOCK_MANAGERS.get("ring")  # ValueError: kind='ring' is unknown: choose a block manager from [...]
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, field: str) -> None:
        """`kind`: what is registered, in words ("block manager"); `field`: the setting that names
        one (`kind`, `policy`, `architecture`), first in the error message so that a caller can
        prefix its config path (`blocks.kind=...`)."""
        self.kind = kind
        self.field = field
        self._entries: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator registering its target under each of `names` (one implementation may serve
        several names). A name taken by another implementation is an error."""
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"{self.kind} names={names!r} are invalid: one or more non-empty strings")

        def wrap(entry: T) -> T:
            for name in names:
                if self._entries.get(name, entry) is not entry:
                    raise ValueError(f"{self.field}={name!r} is already registered as a {self.kind} "
                                     f"(by {self._entries[name]!r})")
                self._entries[name] = entry
            return entry
        return wrap

    def get(self, name: str) -> T:
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ValueError(f"{self.field}={name!r} is unknown: choose a {self.kind} from {self.names()}")
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        """The names in registration order."""
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
