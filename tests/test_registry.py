"""Method registry: lookup by name, listing, clear errors."""

import pytest

from ccr import methods
from ccr.methods.base import RetrievalModule
from ccr.methods.clip.module import CLIPModule
from ccr.methods.registry import register


def test_clip_is_registered_by_name():
    assert methods.get("clip") is CLIPModule
    assert "clip" in methods.names() and methods.names() == sorted(methods.names())
    assert issubclass(methods.get("clip"), RetrievalModule)


def test_unknown_method_lists_the_registered_names():
    with pytest.raises(KeyError, match="unknown method 'nope'; registered methods: .*clip"):
        methods.get("nope")


def test_a_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="'clip' is already registered by CLIPModule"):
        register("clip")(type("Other", (RetrievalModule,), {}))
    assert methods.get("clip") is CLIPModule
