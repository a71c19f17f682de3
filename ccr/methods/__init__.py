"""Retrieval methods (LightningModules) and the building blocks they share.

Method modules register themselves when imported. They are imported on the first ``get``/``names``
call, so the building blocks (encoders, losses, ...) import without Lightning and stay light, e.g.
in spawned worker processes. Add one entry to ``METHOD_MODULES`` per new method.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ccr.methods import registry
from ccr.methods.registry import register

if TYPE_CHECKING:
    from ccr.methods.base import RetrievalModule

METHOD_MODULES = (
    "ccr.methods.clip.module",
    "ccr.methods.ccrk.module",
    "ccr.methods.mclip.module",
    "ccr.methods.cl2cm.module",
    "ccr.methods.covlr.module",
    "ccr.methods.rc3.module",
)


def _import_methods() -> None:
    for module in METHOD_MODULES:
        import_module(module)


def get(name: str) -> type[RetrievalModule]:
    """The method class registered as ``name``; an unknown name raises KeyError listing them."""
    _import_methods()
    return registry.get(name)


def names() -> list[str]:
    """Every registered method name, sorted."""
    _import_methods()
    return registry.names()


__all__ = ["METHOD_MODULES", "get", "names", "register"]
