"""Device rule: every tensor that ccr/metrics/ creates from scratch names its device (taken from an
input), so evaluation on a GPU never mixes in a CPU tensor. Checked on the source: every call of a
torch factory function in ccr/metrics/*.py passes ``device=``."""

import ast
from pathlib import Path

import pytest

FACTORIES = {
    "arange",
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "eye",
    "linspace",
    "rand",
    "randn",
    "randint",
    "as_tensor",
    "scalar_tensor",
}
SOURCES = sorted((Path(__file__).resolve().parents[1] / "ccr/metrics").glob("*.py"))


def factory_calls_without_device(source: str) -> list[int]:
    """Lines of ``torch.<factory>(...)`` calls that lack a ``device=`` keyword."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in FACTORIES
            and not any(keyword.arg == "device" for keyword in node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def test_the_check_catches_a_fixed_device_factory():
    assert factory_calls_without_device("import torch\nx = torch.arange(3)\n") == [2]
    assert (
        factory_calls_without_device("import torch\nx = torch.arange(3, device=y.device)\n") == []
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.name)
def test_every_factory_call_in_metrics_names_its_device(path):
    assert factory_calls_without_device(path.read_text()) == [], (
        f"{path.name}: factory without device="
    )
