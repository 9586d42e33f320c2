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

:func:`warmup` (``python -m nsa_numba warmup``) runs small problems that reach
every kernel for the chosen dtypes (and, on request, common strided views), so that
an image or a CI cache can carry the compiled code.
"""

import os
import sys
import time

import numpy as np
from numba.core import event

_PACKAGE = __name__.rsplit(".", 1)[0]

_enabled = os.environ.get("NSA_NUMBA_QUIET", "") in ("", "0")
_said_where = False
_said_helpers = False
#: the dtype of the call being run (``_dispatch`` sets it before each launch),
#: which the kernels see only as their storage types
calling = None


def compile_messages(enabled):
    """Turn the compile lines on or off for this process (they start on unless
    ``NSA_NUMBA_QUIET`` is set to something other than 0)."""
    global _enabled
    _enabled = bool(enabled)


def cache_dir():
    """Where the compiled kernels are kept, or None when the cache is off."""
    from . import _kernels
    cache = getattr(_kernels.compress_forward, "_cache", None)
    return getattr(cache, "_cache_path", None)


class _Listener(event.Listener):
    """Prints a line when one of this package's functions starts compiling from
    outside another compilation."""

    def __init__(self):
        self.depth = 0

    def on_start(self, ev):
        self.depth += 1
        if self.depth > 1 or not _enabled:
            return
        func = getattr(ev.data["dispatcher"], "py_func", None)
        if (getattr(func, "__module__", None) or "").startswith(_PACKAGE + "."):
            _announce(func.__name__)

    def on_end(self, ev):
        self.depth -= 1


def _announce(name):
    """One line for kernel ``name`` (the planning helpers: one line in all)."""
    global _said_where, _said_helpers
    if name.startswith(("compress_", "reduce_")):
        what = f"the kernel {name}" + (f" for {calling}" if calling is not None else "")
    elif _said_helpers:
        return
    else:
        _said_helpers = True
        what = "the planning helpers"
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


# -- warmup ----------------------------------------------------------------------

#: the dtypes ``warmup`` knows, by their short names
DTYPES = ("bf16", "fp16", "fp32", "fp64")


def _numpy_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp16": np.float16, "fp32": np.float32, "fp64": np.float64}[name])


#: what ``warmup`` can compile, by operator
OPS = ("forward", "backward", "decoding")
#: the inputs ``warmup(strided=True)`` adds, with contiguous weights, gradients and
#: outputs: views users often pass (each a variant of its own for the kernels), every
#: other element of the last axis and tokens in reverse order
_VIEWS = {"every-other-element": lambda a: np.repeat(a, 2, axis=-1)[..., ::2],
          "reversed-tokens": lambda a: np.ascontiguousarray(a[::-1])[::-1]}


def _steps(dtype, strided):
    """(op, label, function) triples that between them reach every kernel for
    ``dtype`` on C-contiguous arrays (and with ``strided``, on the views of _VIEWS)."""
    from . import _simd, api
    from ._seqlens import window_counts
    from ._threading import threads

    rng = np.random.default_rng(0)

    def data(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def problem(T, N, D, view):
        seq = [0, T // 3, T]
        windows = int(window_counts(np.diff(seq), 32, 16).sum())
        return view(data(T, N, D)), data(32, N), data(windows, N, D), seq

    # each call twice: the second, like a training loop's next step, runs through the
    # kernel's entry for calls that come again (``_repeat``), which compiles apart
    def forward(T, N, D, view=lambda a: a):
        x, w, _, seq = problem(T, N, D, view)
        for _ in range(2):
            api.nsa_compress(x, w, 32, 16, actual_seq_len=seq, strict=False)

    def backward(T, N, D, view=lambda a: a):
        x, w, g, seq = problem(T, N, D, view)
        for _ in range(2):
            api.nsa_compress_grad(g, x, w, 32, 16, actual_seq_len=seq, strict=False)

    def decode(writers, parallel):
        x, w = data(4, 64, 2, 64), data(32, 2)          # 4 pages of 64 tokens
        cache = np.zeros((writers, 2, 64), dtype)
        table = (np.arange(writers, dtype=np.int32) % 4).reshape(writers, 1)
        with threads(2 if parallel else 1):
            api.nsa_compress_infer(x, w, np.arange(writers), 32, 16, 64,
                                   block_table=table, actual_seq_len=[48] * writers,
                                   cache=cache, strict=False)

    width = _simd.WIDTH
    steps = [
        ("forward", "forward, vector rows", lambda: forward(96, 2, 2 * width)),
        ("forward", "forward, other rows", lambda: forward(96, 2, 20)),
        ("forward", "forward, long rows", lambda: forward(64, 32, 256)),
        ("backward", "backward, vector rows", lambda: backward(96, 2, 2 * width)),
        ("decoding", "decoding step, one thread", lambda: decode(2, False)),
        ("decoding", "decoding step, threads", lambda: decode(64, True)),
    ]
    if strided:
        for name, view in _VIEWS.items():
            steps += [("forward", f"forward, {name}", lambda v=view: forward(96, 2, 64, v)),
                      ("backward", f"backward, {name}",
                       lambda v=view: backward(96, 2, 64, v))]
    return steps


def warmup(dtypes=DTYPES, ops=OPS, strided=False, out=sys.stdout):
    """Compile (or load from the cache) the kernels of ``ops`` (see ``OPS``) for
    ``dtypes`` (short names, see ``DTYPES``) on contiguous arrays, and with ``strided``
    on common views too; prints each step and its time to ``out`` and returns the
    total seconds."""
    start = time.perf_counter()
    where = cache_dir()
    print(f"nsa_numba warmup: {', '.join(dtypes)}; cache "
          f"{where or 'off (nothing will be kept)'}", file=out, flush=True)
    plan = [(name, label, fn) for name in dtypes
            for op, label, fn in _steps(_numpy_dtype(name), strided) if op in ops]
    for i, (name, label, fn) in enumerate(plan, 1):
        t = time.perf_counter()
        fn()
        step = f"[{i}/{len(plan)}]"
        print(f"  {step:<8}{name:<6}{label:<36}{time.perf_counter() - t:6.1f} s", file=out,
              flush=True)
    total = time.perf_counter() - start
    print(f"done in {total:.1f} s", file=out, flush=True)
    return total
