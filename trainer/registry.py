"""Named choices at the seams that vary (tasks, models, datasets, gradient-sync methods, optimizers).

A registry is the single source of a seam's names: the CLI's choices and ``--help``, config
validation and the lookup itself all read it, so an entry added here is usable everywhere at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from trainer.errors import ConfigError

__all__ = ["Entry", "Registry"]

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    value: T
    help: str


class Registry(Generic[T]):
    """Names of one kind of thing, each with its value and a one-line description.

    ``patterns`` describe names resolved rather than listed (``torchvision/<name>``): a resolver
    returns the value for a name it understands, or None.

    ``home``: the module (or modules) whose import fills the registry, imported when the names are first read.
    A registry declared apart from its entries (trainer.seams) lets the config read the names without importing the
    implementations, which import the config.
    """

    def __init__(self, kind: str, flag: str, home: str | tuple[str, ...] = "") -> None:
        self.kind = kind  # what the names name, for messages: "model", "dataset"
        self.flag = flag  # where users type them: "--model"
        self.homes = (home,) if isinstance(home, str) else home
        self._entries: dict[str, Entry[T]] = {}
        self._resolvers: list[tuple[str, Callable[[str], T | None]]] = []

    def _filled(self) -> dict[str, Entry[T]]:
        for home in self.homes:
            if home:
                importlib.import_module(home)  # once imported, a lookup in sys.modules
        return self._entries

    def add(self, name: str, value: T, help: str = "") -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = Entry(name, value, help)
        return value

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        """Decorator form of add()."""
        return lambda value: self.add(name, value, help)

    def add_pattern(self, pattern: str, resolve: Callable[[str], T | None]) -> None:
        self._resolvers.append((pattern, resolve))

    def names(self) -> tuple[str, ...]:
        return tuple(self._filled())

    def describe(self) -> str:
        """The choices for --help: every name, then every pattern."""
        return ", ".join([*self._filled(), *(pattern for pattern, _ in self._resolvers)])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._filled() or self._resolve(name) is not None)

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self._filled().values())

    def get(self, name: str) -> T:
        entry = self._filled().get(name)
        if entry is not None:
            return entry.value
        resolved = self._resolve(name)
        if resolved is None:
            raise ConfigError(f"{self.flag} {name!r}: no such {self.kind}; choose one of {self.describe()}")
        return resolved

    def check(self, name: str) -> None:
        """ConfigError naming the flag and the choices unless ``name`` is known."""
        self.get(name)

    def _resolve(self, name: str) -> T | None:
        for _, resolve in self._resolvers:
            value = resolve(name)
            if value is not None:
                return value
        return None
