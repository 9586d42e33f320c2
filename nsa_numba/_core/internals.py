"""The private PyTorch names the library uses, in one place.

Each saves measurable time per call (docs/performance.md, "Figures behind the code's
choices") and each has a public fallback, so a torch that drops one only
makes calls slower. ``tests/test_internals.py`` fails when an installed version no
longer has one, so that the loss is seen.
"""


def torch_probes(torch):
    """(dispatch stack length, function modes enabled, functorch interpreter stack):
    the C functions that tell whether anything intercepts operators (a dispatch or
    function mode, vmap, grad transforms), each None where this torch does not have
    it (the caller then takes the registered operator every time)."""
    C = torch._C
    return (getattr(C, "_len_torch_dispatch_stack", None),
            getattr(C, "_is_torch_function_mode_enabled", None),
            getattr(getattr(C, "_functorch", None), "peek_interpreter_stack", None))
