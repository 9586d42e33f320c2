"""The private Numba and PyTorch names the library uses, in one place.

Each saves measurable time per call (docs/performance.md, "Figures behind the code's
choices") and each has a public fallback, so a Numba or torch that drops one only
makes calls slower. ``tests/test_internals.py`` fails when an installed version no
longer has one, so that the loss is seen.
"""

from numba.np.ufunc import parallel as _nb_parallel


def numba_pool_started():
    """Whether Numba's threading layer has started (its choice is then fixed)."""
    return bool(getattr(_nb_parallel, "_is_initialized", False))


def numba_thread_count_functions():
    """(get, set) of the calling thread's Numba thread count as the layer's own C
    functions, without the locks Numba's public ``get_num_threads`` /
    ``set_num_threads`` take on every call; None before the layer runs or where
    this Numba does not have them."""
    if not numba_pool_started():
        return None
    get = getattr(_nb_parallel, "_get_num_threads", None)
    put = getattr(_nb_parallel, "_set_num_threads", None)
    return (get, put) if callable(get) and callable(put) else None


def torch_probes(torch):
    """(dispatch stack length, function modes enabled, functorch interpreter stack):
    the C functions that tell whether anything intercepts operators (a dispatch or
    function mode, vmap, grad transforms), each None where this torch does not have
    it (the caller then takes the registered operator every time)."""
    C = torch._C
    return (getattr(C, "_len_torch_dispatch_stack", None),
            getattr(C, "_is_torch_function_mode_enabled", None),
            getattr(getattr(C, "_functorch", None), "peek_interpreter_stack", None))
