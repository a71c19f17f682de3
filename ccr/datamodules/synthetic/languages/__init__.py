"""Caption grammars, one module per language; adding a language means adding one file here.

A language module defines ``CODE`` (language code), ``SEPARATOR`` (" ", or "" for scripts written
without spaces), ``FULL_STOP`` and ``words(plan) -> list[str]``: the caption's words for a
:class:`~ccr.datamodules.synthetic.plans.CaptionPlan`, covering every key of the attribute lists in
``scene.py``. Modules are discovered automatically; see docs/synthetic.md for a worked example.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ..plans import CaptionPlan

_REQUIRED = ("CODE", "SEPARATOR", "FULL_STOP", "words")


def _discover() -> dict[str, ModuleType]:
    grammars = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        missing = [name for name in _REQUIRED if not hasattr(module, name)]
        if missing:
            raise AttributeError(f"{module.__file__}: language module lacks {', '.join(missing)}")
        grammars[module.CODE] = module
    return grammars


GRAMMARS = _discover()


def available() -> list[str]:
    """Codes of every language the synthetic world can caption."""
    return sorted(GRAMMARS)


def grammar(code: str) -> ModuleType:
    if code not in GRAMMARS:
        raise KeyError(
            f"no synthetic grammar for language '{code}'; available: {', '.join(available())}"
        )
    return GRAMMARS[code]


def join(code: str, words: list[str]) -> str:
    """Put words into a sentence: separator, full stop, capitalised first letter."""
    module = grammar(code)
    text = module.SEPARATOR.join(words) + module.FULL_STOP
    return text[:1].upper() + text[1:]


def realise(code: str, plan: CaptionPlan) -> str:
    """The caption of ``plan`` in language ``code``."""
    return join(code, grammar(code).words(plan))
