"""The layout of ``ccr.methods``: a package per method holding its private parts, and ``layers/``
holding only blocks that two or more methods use (read from the imports; nothing is built)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

METHODS_DIR = Path(__file__).resolve().parents[1] / "ccr" / "methods"
LAYERS = "ccr.methods.layers"
PACKAGES = sorted(
    p.name for p in METHODS_DIR.iterdir() if (p / "__init__.py").is_file() and p.name != "layers"
)


def module_name(path: Path) -> str:
    parts = path.relative_to(METHODS_DIR.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved, ``from a import b`` as ``a.b``."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def layer_files() -> dict[str, Path]:
    return {
        module_name(p): p for p in (METHODS_DIR / "layers").glob("*.py") if p.name != "__init__.py"
    }


def layers_reached(method: str) -> set[str]:
    """The layer modules a method's package reaches, through other layers and the contract
    (``ccr.methods.base``, which every method builds on)."""
    layers = layer_files()
    todo = [*(METHODS_DIR / method).glob("*.py"), METHODS_DIR / "base.py"]
    seen: set[str] = set()
    while todo:
        for name in imports(todo.pop()) & set(layers):
            if name not in seen:
                seen.add(name)
                todo.append(layers[name])
    return seen


def test_the_six_methods_are_packages_each_with_its_module():
    assert PACKAGES == ["ccrk", "cl2cm", "clip", "covlr", "mclip", "rc3"]
    for method in PACKAGES:
        assert (METHODS_DIR / method / "module.py").is_file(), method


@pytest.mark.parametrize("layer", sorted(layer_files()))
def test_a_shared_layer_is_used_by_two_or_more_methods(layer):
    users = [method for method in PACKAGES if layer in layers_reached(method)]
    assert len(users) >= 2, (
        f"{layer_files()[layer]} is used by {users or 'no method'}: "
        f"a block one method alone uses lives in ccr/methods/<that method>/"
    )


@pytest.mark.parametrize("method", PACKAGES)
def test_a_method_imports_no_other_methods_private_part(method):
    """Building on another method is an import of that method (its package or ``module``); its
    other files are private to it (a part two methods use belongs in ``layers/``)."""
    foreign = sorted(
        name
        for path in (METHODS_DIR / method).glob("*.py")
        for name in imports(path)
        for other in PACKAGES
        if other != method
        and name.startswith(f"ccr.methods.{other}.")
        and name.split(".")[3] != "module"
        and (METHODS_DIR / other / f"{name.split('.')[3]}.py").is_file()
    )
    assert not foreign, f"ccr/methods/{method}/ imports private parts of other methods: {foreign}"


def test_layers_and_the_contract_import_no_method_package():
    sources = [*(METHODS_DIR / "layers").glob("*.py"), METHODS_DIR / "base.py"]
    reached = {
        f"{path.relative_to(METHODS_DIR)}: {name}"
        for path in sources
        for name in imports(path)
        if any(name == f"ccr.methods.{m}" or name.startswith(f"ccr.methods.{m}.") for m in PACKAGES)
    }
    assert not reached, sorted(reached)
