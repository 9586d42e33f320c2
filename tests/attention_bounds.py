"""Per-element error bounds for attention outputs and gradients, from the float64
reference called on absolute values.

An attention output ``o = sum_k P_k v_k`` computed with float32 sums and rounded once
to the output dtype is within one unit of that dtype of the exact value, plus what
float32 arithmetic can add: the sums over the keys, and the scores' dot products, whose
error ``delta s`` moves every weight by a factor ``exp(delta s)``. So for each element::

    |o - exact| <= gamma_n * (sum_k P_k |v_k|) * (1 + 2 M) + 1 ulp(|exact| + that)

with ``M`` the row's largest ``|scale| sum_d |q_d| |k_d|`` over the keys it sees and
``gamma_n = n u / (1 - n u)`` for chains of ``n`` float32 roundings (``n`` at least
the keys of a row, plus D, plus a few). Both sums come from the reference itself:
attention is linear in the values, so the reference given ``|v|`` returns ``sum_k P_k
|v_k|``, and given ``|q|``, ``|k|`` and ``|scale|`` its softmax_max is ``M``.

The gradients add one term of the input dtype: ``delta = sum dO * O`` is computed from
the forward output as rounded (``E = u sum_e |dO_e| |O_e|`` per row, ``u`` the unit
roundoff of the dtype), which moves every ``dS_k = P_k (dP_k - delta)`` by ``P_k E``;
and float32 terms of the same shape with ``|dP_k| + |delta| <= 2 V``, ``V`` the row's
largest ``sum_e |dO_e| |v_ke|``. So with ``w = |scale| (E + gamma_n 2 V (1 + 2 M))``::

    dq: w * sum_k P_k |k_k|           (the reference forward given |k| as values)
    dk: sum over rows of P |q| w      (the reference gradient's dv given |q| w as dO)
    dv: gamma_n sum over rows of P |dO| (1 + 2 M)

each plus one ulp, as above. Unlike a tolerance relative to an array's largest value,
these hold every element, small ones included, to what its own terms allow: a weight
rounded to the input dtype before the values' sum, or a key dropped from a row,
leaves them.
"""

import ml_dtypes
import numpy as np

from nsa_numba import reference as ref


def unit_roundoff(dtype):
    """Half the machine epsilon of ``dtype``."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 2


def gamma(depth, accumulator):
    u = unit_roundoff(accumulator)
    return depth * u / (1 - depth * u)


def within(result, exact, bound, dtype, what):
    """Every element within ``bound`` of the exact value, plus one ulp of ``dtype`` at
    ``|exact| + bound``; AssertionError naming the worst element otherwise."""
    r = np.asarray(result, np.float64)
    e = np.asarray(exact, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), e.shape)
    assert r.shape == e.shape, (what, r.shape, e.shape)
    with np.errstate(invalid="ignore"):
        excess = np.maximum(np.abs(r - e) - bound, 0.0) / ref.ulp(np.abs(e) + bound, dtype)
    excess = np.where(np.isnan(r) & np.isnan(e), 0.0, excess)
    worst = int(np.argmax(np.where(np.isnan(excess), np.inf, excess))) if excess.size else 0
    if excess.size and not excess.reshape(-1)[worst] <= 1.0:
        at = np.unravel_index(worst, e.shape)
        raise AssertionError(f"{what}{list(at)}: {r[at]!r} against exact {e[at]!r}, error "
                             f"{abs(r[at] - e[at]):.3g} beyond the bound {bound[at]:.3g} by "
                             f"{excess[at]:.3g} ulp of {np.dtype(dtype).name}")


def largest_scores(forward, q, k, v, scale):
    """``M`` per row: the largest ``|scale| sum_d |q_d| |k_d|`` over the keys the row
    sees (0 for a row that sees none), from the reference's softmax_max."""
    a = np.abs
    return np.maximum(forward(a(q), a(k), a(v), abs(scale))[1], 0)


class Rows:
    """How a layout's per-row values (the statistics' ``[T1, N1]`` for TND, ``[B, N1,
    Sq]`` otherwise) sit in its arrays of a given head width."""

    def __init__(self, layout="TND", heads=None):
        self.layout, self.heads = layout.upper(), heads

    def spread(self, stat, width):
        """``stat`` over every element of the rows of an array of head width ``width``."""
        s = np.asarray(stat, np.float64)
        if self.layout in ("BSND", "BSH"):
            s = s.transpose(0, 2, 1)
        elif self.layout == "SBH":
            s = s.transpose(2, 0, 1)
        if self.layout in ("BSH", "SBH"):               # heads side by side
            return np.repeat(s, width, -1)
        return np.repeat(s[..., None], width, -1)

    def sums(self, x):
        """The sum over each row's elements of an array of this layout."""
        x = np.asarray(x, np.float64)
        if self.layout in ("TND", "BNSD"):
            return x.sum(-1)
        if self.layout == "BSND":
            return x.sum(-1).transpose(0, 2, 1)
        per = x.reshape(*x.shape[:2], self.heads, -1).sum(-1)
        return per.transpose(0, 2, 1) if self.layout == "BSH" else per.transpose(1, 2, 0)


def check_forward(out, exact, forward, q, k, v, scale, depth, rows=Rows()):
    """``out`` within its per-element bound. ``forward(q, k, v, scale)`` is the
    reference on the call's other arguments: ``(out, softmax_max)`` in float64.
    Returns ``M`` (``largest_scores``) for the other checks of the same call."""
    dtype = np.dtype(out.dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    weighted = forward(q, k, np.abs(v), scale)[0]                   # sum_k P_k |v_k|
    top = largest_scores(forward, q, k, v, scale)                    # M
    width = np.asarray(v).shape[-1] if rows.layout not in ("BSH", "SBH") else \
        np.asarray(out).shape[-1] // rows.heads
    bound = gamma(depth, acc) * weighted * (1 + 2 * rows.spread(top, width))
    within(out, exact, bound, dtype, "attention_out")
    return top


def check_gradient(grads, exact, forward, gradient, g, q, k, v, out, scale, depth,
                   rows=Rows(), key_rows=None, top=None):
    """dq, dk, dv within their per-element bounds. ``gradient(g, q, k, v, scale)`` is
    the reference gradient on the call's other arguments; ``out`` the forward output
    the gradient was given (as rounded); ``key_rows`` the layout of the key arrays
    (heads N2), ``rows`` that of the query arrays (heads N1); ``top``: ``M`` where the
    caller has it."""
    key_rows = key_rows or rows
    dtype = np.dtype(q.dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    gm = gamma(depth, acc)
    a = np.abs
    if top is None:
        top = largest_scores(forward, q, k, v, scale)                               # M
    values = np.maximum(forward(a(g), a(v), a(v), 1.0)[1], 0)                       # V
    delta = unit_roundoff(dtype) * rows.sums(a(np.asarray(g, np.float64))
                                             * a(np.asarray(out, np.float64)))      # E
    w = abs(scale) * (delta + gm * 2 * values * (1 + 2 * top))

    def width(x, heads_rows):
        return np.asarray(x).shape[-1] if heads_rows.layout not in ("BSH", "SBH") else \
            np.asarray(x).shape[-1] // heads_rows.heads

    D = width(q, rows)
    bounds = (
        forward(q, k, a(k), scale)[0] * rows.spread(w, D),                          # dq
        gradient(a(np.asarray(q, np.float64)) * rows.spread(w, D), q, k, a(k), scale)[2],
        gm * gradient(a(np.asarray(g, np.float64)) * rows.spread(1 + 2 * top, width(g, rows)),
                      q, k, v, scale)[2])                                           # dv
    for name, got, want, bound in zip(("dq", "dk", "dv"), grads, exact, bounds):
        within(got, want, bound, dtype, name)


def check_statistics(smax, ssum, exact_max, exact_sum, forward, q, k, v, scale, keys, D,
                     top=None):
    """softmax_max and softmax_sum (one lane of the operator's ``[..., 8]``) row by row.
    A row that sees keys: the max within ``gamma_(D+4) M``, the sum within
    ``(gamma_(keys+8) + 2 gamma_(D+4) M)`` of itself, each plus one ulp of the
    statistics' dtype; a row that sees none: exactly the reference's values (the
    masked score, the count or FLT_MAX). Rows are compared one by one, so a row
    whose max is -FLT_MAX does not set the scale of the others. ``D``: the head dim;
    ``top``: ``M`` where the caller has it."""
    stat = np.dtype(smax.dtype)
    if top is None:
        top = largest_scores(forward, q, k, v, scale)
    exact_max = np.asarray(exact_max, np.float64)
    exact_sum = np.asarray(exact_sum, np.float64)
    sees = exact_max > float(np.finfo(np.float32).min)
    g_d = gamma(D + 4, stat)
    got_max, got_sum = np.asarray(smax, np.float64), np.asarray(ssum, np.float64)
    within(np.where(sees, got_max, 0), np.where(sees, exact_max, 0),
           np.where(sees, g_d * top, 0), stat, "softmax_max")
    within(np.where(sees, got_sum, 0), np.where(sees, exact_sum, 0),
           np.where(sees, (gamma(keys + 8, stat) + 2 * g_d * top) * exact_sum, 0), stat,
           "softmax_sum")
    for name, got, want in (("softmax_max", got_max, exact_max),
                            ("softmax_sum", got_sum, exact_sum)):
        wrong = ~sees & (got != want.astype(stat))
        assert not wrong.any(), (f"{name} of a row that sees no key", np.argwhere(wrong)[:3],
                                 got[wrong][:3], want[wrong][:3])
