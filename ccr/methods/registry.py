"""Name -> method class registry, so configs and the CLI pick a method by its name."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ccr.methods.base import RetrievalModule

M = TypeVar("M", bound="RetrievalModule")
_METHODS: dict[str, type[RetrievalModule]] = {}


def register(name: str):
    """Class decorator: make ``cls`` available as ``methods.get(name)``."""

    def decorate(cls: type[M]) -> type[M]:
        if name in _METHODS and _METHODS[name] is not cls:
            raise ValueError(
                f"method name {name!r} is already registered by {_METHODS[name].__name__}"
            )
        _METHODS[name] = cls
        cls.method_name = name
        return cls

    return decorate


def get(name: str) -> type[RetrievalModule]:
    """The class registered as ``name``; an unknown name raises KeyError listing the known ones."""
    try:
        return _METHODS[name]
    except KeyError:
        raise KeyError(
            f"unknown method {name!r}; registered methods: {', '.join(names())}"
        ) from None


def names() -> list[str]:
    """Registered method names, sorted."""
    return sorted(_METHODS)
