"""The first run on a machine: say when kernels compile, and compile them ahead.

Numba compiles a kernel the first time it meets a new combination of argument
types and keeps the machine code in its disk cache (``__pycache__`` beside the
source, or ``NUMBA_CACHE_DIR``); later processes load it in milliseconds. Numba
raises its ``numba:compile`` event only when it compiles, never for a cache hit, so
a listener on that event is silent once the cache is warm. While a cold cache is
being filled it prints one line on stderr per top-level function of this package
that starts compiling (the helpers a kernel inlines compile inside it and are not
named). ``NSA_NUMBA_QUIET=1`` in the environment, or ``compile_messages(False)``,
turns the lines off.

``_warmup`` compiles the kernels ahead (``python -m nsa_numba warmup``).
"""

import sys
import time

from numba.core import event

from ._core import config as _config

_PACKAGE = __name__.rsplit(".", 1)[0]

_enabled = not _config.quiet()
_said_where = False
#: the dtypes the kernels see arrays of each kind as (``_ops.checks.STORAGE``), by the
#: Numba name of that storage type: how a compile message names the call's dtype
_KIND_OF_STORAGE = {"uint16": "float16", "int16": "bfloat16", "float32": "float32",
                    "float64": "float64"}


def compile_messages(enabled):
    """Turn the compile lines on or off for this process (they start on unless
    ``NSA_NUMBA_QUIET`` is set to something other than 0)."""
    global _enabled
    _enabled = bool(enabled)


def cache_dir():
    """Where the compiled kernels are kept, or None when the cache is off."""
    from ._kernels import compress as _kernels
    cache = getattr(_kernels.compress_forward, "_cache", None)
    return getattr(cache, "_cache_path", None)


#: while a list: each compilation of one of this package's functions from outside
#: another, as (name, dtype, variant, seconds, LLVM IR characters) (``record``)
_records = None


def record(on=True):
    """Start recording compilations (``warmup --times``) and return the list they go
    to; ``record(False)`` stops."""
    global _records
    _records = [] if on else None
    return _records


def _variant(args):
    """The layouts of a compilation's array arguments, in order (C, F or A), with an
    r for a read-only one: what tells apart two variants of one kernel and dtype."""
    return "".join(arg.layout + ("" if getattr(arg, "mutable", True) else "r")
                   for arg in args if hasattr(arg, "layout") and hasattr(arg, "ndim"))


class _Listener(event.Listener):
    """Prints a line when one of this package's functions starts compiling from
    outside another compilation (and records it, while ``record`` is on)."""

    def __init__(self):
        self.depth = 0
        self.started = None

    def on_start(self, ev):
        self.depth += 1
        if self.depth > 1:
            return
        func = getattr(ev.data["dispatcher"], "py_func", None)
        if not (getattr(func, "__module__", None) or "").startswith(_PACKAGE + "."):
            return
        args = tuple(ev.data.get("args", ()))
        if _records is not None:
            self.started = (time.perf_counter(), func.__name__, args)
        if _enabled:
            _announce(func.__name__, _dtype_of(args))

    def on_end(self, ev):
        self.depth -= 1
        if self.depth or self.started is None:
            return
        start, name, args = self.started
        self.started = None
        seconds = time.perf_counter() - start
        try:
            ir = len(ev.data["dispatcher"].inspect_llvm(args))
        except Exception:          # noqa: BLE001 - a size we cannot read is left out
            ir = None
        if _records is not None:
            _records.append((name, _dtype_of(args), _variant(args), seconds, ir))


def _dtype_of(args):
    """The dtype of the call a kernel compiles for, from its array arguments' storage
    types: a half-precision one where any is (the accumulators beside it are float32),
    else the first array's; None without arrays."""
    kinds = [_KIND_OF_STORAGE.get(str(arg.dtype)) for arg in args
             if getattr(arg, "ndim", 0) and getattr(arg, "dtype", None) is not None]
    kinds = [k for k in kinds if k is not None]         # not index or count arrays
    half = [k for k in kinds if k in ("float16", "bfloat16")]
    return half[0] if half else (kinds[0] if kinds else None)


def _announce(name, dtype):
    """One line for kernel ``name`` compiling for ``dtype``, or for planning helper
    ``name``; the first line of a process also says where the code is kept."""
    global _said_where
    if name.startswith(("compress_", "reduce_", "select_", "cmp_", "dense_")):
        what = f"the kernel {name}" + (f" for {dtype}" if dtype is not None else "")
    else:
        what = f"the planning helper {name}"
    if _said_where:
        print(f"nsa_numba: compiling {what}", file=sys.stderr, flush=True)
        return
    _said_where = True
    where = cache_dir()
    keep = (f"once per machine, kept in {where}" if where
            else "the disk cache is off, so every process compiles again")
    print(f"nsa_numba: compiling {what} ({keep}; `python -m nsa_numba warmup` does it "
          f"ahead, NSA_NUMBA_QUIET=1 hides these lines)", file=sys.stderr, flush=True)


def install():
    """Listen for compilations (once per process)."""
    if not getattr(install, "done", False):
        event.register("numba:compile", _Listener())
        install.done = True
