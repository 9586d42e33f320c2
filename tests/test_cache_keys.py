"""Numba keys the disk cache of _kernels.py on that file's text only.

The kernels inline code from _halfprec.py, _prefetch.py, _simd.py and _tiles.py (the
tile table's columns), take their flags from _jit.py and their vector widths from
_target.py, so _kernels.CACHE_DEPENDS records digests of all six: editing one without
updating its digest there would let a stale compiled kernel be loaded.
"""

import hashlib
import pathlib

from nsa_numba import _kernels


def test_cache_dependencies_are_current():
    here = pathlib.Path(_kernels.__file__).parent
    imported = {line.split()[1][1:] + ".py" for line in
                (here / "_kernels.py").read_text().splitlines()
                if line.startswith("from ._")}
    assert imported <= set(_kernels.CACHE_DEPENDS), "a module the kernels import has no digest"
    for name, digest in _kernels.CACHE_DEPENDS.items():
        actual = hashlib.sha256((here / name).read_bytes()).hexdigest()[:16]
        assert actual == digest, (
            f"{name} changed: set CACHE_DEPENDS[{name!r}] = {actual!r} in _kernels.py")
