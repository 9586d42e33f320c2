"""Numba keys the disk cache of a kernel module on that file's text only.

_kernels.py inlines code from _halfprec.py, _prefetch.py, _simd.py and _tiles.py (the
tile table's columns), takes its flags from _jit.py and its vector widths from
_target.py; _attention.py inlines _halfprec.py and _lanes.py. Each module's
CACHE_DEPENDS records digests of what it imports: editing one without updating its
digest there would let a stale compiled kernel be loaded.
"""

import hashlib
import pathlib

import pytest

from nsa_numba import _attention, _kernels


@pytest.mark.parametrize("module", [_kernels, _attention], ids=lambda m: m.__name__)
def test_cache_dependencies_are_current(module):
    here = pathlib.Path(module.__file__).parent
    source = pathlib.Path(module.__file__).name
    imported = {line.split()[1][1:] + ".py" for line in
                (here / source).read_text().splitlines()
                if line.startswith("from ._")}
    assert imported <= set(module.CACHE_DEPENDS), "a module the kernels import has no digest"
    for name, digest in module.CACHE_DEPENDS.items():
        actual = hashlib.sha256((here / name).read_bytes()).hexdigest()[:16]
        assert actual == digest, (
            f"{name} changed: set CACHE_DEPENDS[{name!r}] = {actual!r} in {source}")
