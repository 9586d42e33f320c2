"""Choice of Numba's threading layer.

The layer must stay correct when the library is called from several Python threads
at once and inside processes forked after a call (data-loader workers):

* ``tbb`` is safe for both. The PyPI ``tbb`` wheel (a dependency on x86-64 Linux)
  installs ``libtbb.so.12`` into ``<prefix>/lib``, which the dynamic loader does not
  search, so we load it from there by absolute path first; Numba's tbb pool then
  links against the already loaded library.
* ``omp`` (GNU OpenMP) is thread-safe but aborts in a forked child.
* ``workqueue`` is fork-safe but aborts when two threads launch kernels at once, so
  under it every launch goes through one lock (:func:`launch`).

So: tbb where a usable libtbb loads (the x86-64 wheel), else workqueue with launches
serialised, on every OS (Numba's own order would pick omp where tbb is missing:
aarch64 Linux and macOS have no tbb wheel). Nothing is changed when the user chose a
layer (``NUMBA_THREADING_LAYER``) or when Numba's layer is already running;
:data:`reason` says which case held (``python -m nsa_numba info`` prints it).
"""

import ctypes
import os
import sys
import threading

import numba

from . import _internals

_TBB_MIN_INTERFACE = 12060  # the oldest TBB interface Numba accepts
_launch_lock = threading.Lock()
concurrent = False      # whether the layer takes concurrent launches, once known
_preloaded_tbb = None
#: why the layer is the one it is (set by :func:`configure`)
reason = None


def _tbb_candidates():
    names = ("libtbb.so.12", "libtbb.12.dylib", "tbb12.dll")
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for sub in ("lib", os.path.join("Library", "bin")):
            for name in names:
                path = os.path.join(prefix, sub, name)
                if os.path.exists(path):
                    yield path
    yield from names  # whatever the system loader finds


def _preload_tbb():
    """Load a usable libtbb globally; return its path or None."""
    for candidate in _tbb_candidates():
        try:
            lib = ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            version = lib.TBB_runtime_interface_version
        except (OSError, AttributeError):
            continue
        version.restype = ctypes.c_int
        if version() >= _TBB_MIN_INTERFACE:
            return candidate
    return None


def configure():
    """Choose tbb, else workqueue, when nobody has chosen a layer yet. Called once at
    import."""
    global _preloaded_tbb, reason
    if os.environ.get("NUMBA_THREADING_LAYER"):
        reason = "chosen by NUMBA_THREADING_LAYER"
        return
    if _internals.numba_pool_started():
        reason = "Numba's pool was running before nsa_numba was imported"
        return
    _preloaded_tbb = _preload_tbb()
    if _preloaded_tbb is not None:
        numba.config.THREADING_LAYER = "tbb"
        reason = "safe under concurrent threads and in forked children"
    else:
        numba.config.THREADING_LAYER = "workqueue"
        reason = ("no usable tbb library: workqueue, safe in forked children, its "
                  "launches serialised across threads (omp aborts in forked children)")


def layer():
    """The active layer's name, or None before the first parallel launch."""
    try:
        return numba.threading_layer()
    except ValueError:
        return None


def launch(kernel, threads, *args):
    """Run a parallel kernel on at most ``threads`` threads (``Plan.threads_useful``);
    serialised only when the layer is workqueue (or unknown).

    Waking a second thread for a kernel with little work only costs (docs/
    performance.md, "Figures behind the code's choices"). Results do not depend on
    the thread count.
    """
    if concurrent or _layer_is_concurrent():
        return call_with_threads(threads, kernel, *args)
    with _launch_lock:
        return call_with_threads(threads, kernel, *args)


def _layer_is_concurrent():
    """Whether the layer is one that takes concurrent launches (tbb, omp); remembered
    once it is (the layer never changes after it starts)."""
    global concurrent
    concurrent = layer() in ("tbb", "omp")
    return concurrent


def tbb_library():
    """Path of the libtbb that :func:`configure` loaded, if any."""
    return _preloaded_tbb


_count_functions = None     # (get, set), once the layer runs


def _thread_count_functions():
    """(get, set) of the calling thread's Numba thread count: once the layer runs, its
    own C functions, which Numba's public ones call after taking its start-up locks
    (one of them a process-shared lock) on every call, a cost measured per call after
    a cache flush (docs/performance.md, "Figures behind the code's choices"). Before
    that, and should Numba no longer have them, the public ones. Its caller reads
    ``_count_functions`` first, once set."""
    global _count_functions
    if _internals.numba_pool_started():
        _count_functions = (_internals.numba_thread_count_functions()
                            or (numba.get_num_threads, numba.set_num_threads))
        return _count_functions
    return numba.get_num_threads, numba.set_num_threads


def call_with_threads(limit, fn, *args):
    """``fn(*args)`` with Numba's thread count for this thread capped at ``limit``
    (None: no cap), then the count restored.

    Numba's count is per calling thread, so a cap here never changes what other
    threads run with. Results do not depend on it: tiles are sized by the problem
    alone (see ``_plan``).
    """
    get, put = _count_functions or _thread_count_functions()
    current = get()
    if current < 1:                  # not a count: let Numba's own function say why
        current = numba.get_num_threads()
    if limit is None or limit >= current:
        return fn(*args)
    put(max(1, limit))
    try:
        return fn(*args)
    finally:
        put(current)


class threads:
    """Context manager: kernels launched from this thread inside the block use at
    most ``n`` threads (``numba.set_num_threads`` for the block, then restored).

    ::

        with nsa_numba.threads(1):
            out = nsa_numba.nsa_compress(x, w, 32, 16)

    ``n`` is capped at ``NUMBA_NUM_THREADS`` (the pool size, fixed when Numba
    starts; set that variable before import to cap a whole process). Other Python
    threads keep their own count. Results are bitwise the same for any ``n``.
    """

    def __init__(self, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"threads: n must be an integer >= 1, got {n!r}")
        self.n = min(n, int(numba.config.NUMBA_NUM_THREADS))
        self._saved = []

    def __enter__(self):
        self._saved.append(numba.get_num_threads())
        numba.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        numba.set_num_threads(self._saved.pop())
        return False
