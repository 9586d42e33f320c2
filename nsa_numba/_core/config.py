"""The library's settings from the environment, read in one place.

Each ``NSA_NUMBA_*`` variable is read once, at import, by the module that needs it,
through the function here; a value that cannot be read fails the import with a
ValueError naming the variable (a setting silently ignored is worse than none).

========================== ======================================================
``NSA_NUMBA_KEEP_OUTPUTS_MB`` the output pool's budget in MiB (default 1024; 0: off)
``NSA_NUMBA_QUIET``          1: no compile messages on stderr (default 0)
``NSA_NUMBA_BOUNDSCHECK``    1: kernels compiled with index checks, no disk cache
========================== ======================================================

Numba's own variables (``NUMBA_NUM_THREADS``, ``NUMBA_THREADING_LAYER``,
``NUMBA_CACHE_DIR``...) are Numba's to read.
"""

import os

POOL_BUDGET = "NSA_NUMBA_KEEP_OUTPUTS_MB"
QUIET = "NSA_NUMBA_QUIET"
BOUNDSCHECK = "NSA_NUMBA_BOUNDSCHECK"

#: the output pool's budget when the environment does not set one
DEFAULT_POOL_MB = 1024


def _flag(name):
    """An on/off variable: unset, empty or 0 is off, anything else on."""
    return os.environ.get(name, "").strip() not in ("", "0")


def pool_budget():
    """The output pool's budget in bytes (``_core.pool``)."""
    text = os.environ.get(POOL_BUDGET, "").strip()
    if not text:
        return DEFAULT_POOL_MB << 20
    if not text.isdigit():
        raise ValueError(f"{POOL_BUDGET} must be a whole number of MiB (0 turns the keeping "
                         f"off), got {text!r}")
    return int(text) << 20


def quiet():
    """Whether compile messages start off (``_firstrun``)."""
    return _flag(QUIET)


def boundscheck():
    """Whether kernels compile with bounds checks and no disk cache (``_core.jit``)."""
    return _flag(BOUNDSCHECK)
