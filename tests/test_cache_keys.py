"""Numba keys the disk cache of a kernel module on that file's text only.

_kernels/compress.py inlines code from halfprec.py, prefetch.py, simd.py and tiles.py
(the tile table's columns), takes its flags from _core/jit.py, its units from
_core/launch.py and its vector widths from target.py; _kernels/attention.py inlines
halfprec.py and lanes.py. Each module's CACHE_DEPENDS records digests of what it
imports (paths relative to its folder): editing one without updating its digest
there would let a stale compiled kernel be loaded.
"""

import hashlib
import pathlib

import pytest

from nsa_numba._kernels import attention as _attention, compress as _kernels


@pytest.mark.parametrize("module", [_kernels, _attention], ids=lambda m: m.__name__)
def test_cache_dependencies_are_current(module):
    here = pathlib.Path(module.__file__).parent
    source = pathlib.Path(module.__file__).name
    imported = set()
    for line in (here / source).read_text().splitlines():
        if line.startswith("from ."):
            spec = line.split()[1]
            ups = len(spec) - len(spec.lstrip("."))
            imported.add("../" * (ups - 1) + spec[ups:].replace(".", "/") + ".py")
    assert imported <= set(module.CACHE_DEPENDS), "a module the kernels import has no digest"
    for name, digest in module.CACHE_DEPENDS.items():
        actual = hashlib.sha256((here / name).read_bytes()).hexdigest()[:16]
        assert actual == digest, (
            f"{name} changed: set CACHE_DEPENDS[{name!r}] = {actual!r} in {source}")
