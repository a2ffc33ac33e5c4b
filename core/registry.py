"""Named plug-ins: one small registry type for every extension point (parallel strategies, routers,
expert-parallel dispatchers, GEMM backends), so each is added with one registration line and an
unknown name fails the same way everywhere."""

from __future__ import annotations

from typing import Generic, TypeVar

from .config import ConfigError

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """name -> plug-in (a class). ``kind`` names what it holds in error messages."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, item: T) -> T:
        """Register ``item`` under ``name``; ConfigError if the name is empty or taken by another."""
        if not name:
            raise ConfigError(f"{self.kind} {getattr(item, '__name__', item)} needs a name")
        if name in self and self[name] is not item:
            raise ConfigError(f"a {self.kind} named {name!r} is already registered")
        self[name] = item
        return item

    def lookup(self, name: str, setting: str) -> T:
        """The plug-in registered as ``name``; ConfigError naming ``setting`` and the choices."""
        if name not in self:
            raise ConfigError(f"{setting}={name!r} is not a registered {self.kind}: choose one of {sorted(self)}")
        return self[name]
