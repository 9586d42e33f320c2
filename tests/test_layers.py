"""The package's layers import one way down: ``_core`` nothing of the package,
``_kernels`` only ``_core``, ``_ops`` ``_kernels`` and ``_core``; the front ends (the
modules at the top, ``bench``) any of them (docs/design.md, "Layout of the code")."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nsa_numba"
#: a layer may import from the layers after it in this list, and from itself
ORDER = ["front", "_ops", "_kernels", "_core"]


def _layer(parts):
    """The layer of a module given as its parts below the package."""
    return parts[0] if parts and parts[0] in ORDER[1:] else "front"


def _imports(path):
    """The modules of the package ``path`` imports, as parts below the package."""
    here = list(path.relative_to(PACKAGE).with_suffix("").parts)
    package = here[:-1]                      # __init__ files too: their folder
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "nsa_numba":
                target = node.module.split(".")[1:]
            else:
                continue
            if node.module is None:          # from . import a, b: modules a and b
                for alias in node.names:
                    yield target + [alias.name]
            else:
                yield target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nsa_numba":
                    yield alias.name.split(".")[1:]


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way_down(path):
    own = _layer(list(path.relative_to(PACKAGE).parts))
    for target in _imports(path):
        layer = _layer(target)
        assert ORDER.index(layer) >= ORDER.index(own), (
            f"{path.relative_to(PACKAGE)} ({own}) imports {'.'.join(target)} ({layer})")


def test_the_layers_have_modules():
    layers = {_layer(list(p.relative_to(PACKAGE).parts)) for p in MODULES}
    assert layers == set(ORDER)
