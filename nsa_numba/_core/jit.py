"""The Numba decorators every kernel uses, defined once.

All compile flags live here. fastmath stays off everywhere: it lets LLVM reorder
float sums, which would break bitwise determinism and the accuracy guarantee.
``error_model="numpy"`` keeps integer division free of Python's exception checks.

Setting ``NSA_NUMBA_BOUNDSCHECK=1`` before import compiles the kernels with bounds
checking and without the disk cache, so a debugging run can never pick up (or leave
behind) unchecked machine code.
"""

from numba import njit

from . import config as _config

BOUNDSCHECK = _config.boundscheck()

_OPTIONS = dict(
    cache=not BOUNDSCHECK,
    nogil=True,
    fastmath=False,
    error_model="numpy",
    boundscheck=True if BOUNDSCHECK else None,
)

#: the same options for ``numba.extending.overload`` implementations
OVERLOAD_OPTIONS = {k: v for k, v in _OPTIONS.items() if k not in ("cache", "nogil")}


def jit(func=None, **extra):
    """``numba.njit`` with the project's options; ``extra`` adds e.g. ``inline``."""
    decorator = njit(**_OPTIONS, **extra)
    return decorator if func is None else decorator(func)
