"""Retrieval methods (LightningModules) and the building blocks they share.

Importing a method module registers it; add one import line here per new method.
"""

from methods.registry import get, names, register
from methods import clip  # noqa: F401  (registers "clip")

__all__ = ["get", "names", "register"]
