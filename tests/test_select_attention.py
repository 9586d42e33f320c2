"""nsa_select_attention and its gradient against the float64 reference
(``nsa_numba.reference.select_attention``), their masks, repeated and unselected
blocks, outputs given in place, strided inputs, and bitwise determinism."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attention_bounds as bounds
import nsa_numba
from conftest import DTYPE_IDS, DTYPES
from nsa_numba import reference as ref
from nsa_numba.bench.cases import select_problem

#: largest error allowed, relative to the largest exact value of the array: two of
#: the dtype's epsilons for half precision (one rounding of the output, and for the
#: gradients the rounded forward output in delta), float32 sums for float32
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-12}
#: the statistics are float32 (float64) sums whatever the input dtype
STAT_TOLERANCE = {"float16": 2e-5, "bfloat16": 2e-5, "float32": 2e-5, "float64": 1e-12}
MASKED = float(np.finfo(np.float32).min)


def _kw(ends, causal):
    return dict(atten_mask=np.ones((1, 1), bool) if causal else None,
                actual_seq_qlen=ends, actual_seq_kvlen=ends, strict=False)


def _close(result, exact, tol, what, floor=1e-30):
    """Largest error within ``tol`` of the array's largest exact value, or of ``floor``
    when that is larger (a gradient that cancels to nothing is held to the size of the
    terms that cancelled: ``gradient_floors``)."""
    exact = np.asarray(exact, np.float64)
    err = np.abs(np.asarray(result, np.float64) - exact).max(initial=0.0)
    scale = max(np.abs(exact).max(initial=0.0), floor)
    assert err <= tol * scale, f"{what}: error {err:.3g} > {tol} * {scale:.3g}"


def gradient_floors(grad, q, k, v, scale):
    """The size of one term of dq, dk and dv: dS = P (dP - delta) cancels terms of
    ``|dO| |V|``, so dq's error scales with ``|scale| |dO| |V| |K|``, dk's with
    ``|scale| |dO| |V| |Q|``, dv's with ``|dO|``."""
    top = [float(np.abs(np.asarray(a, np.float64)).max(initial=0.0)) for a in (grad, q, k, v)]
    g, qm, km, vm = top
    return abs(scale) * g * vm * km, abs(scale) * g * vm * qm, g


def check(q, k, v, topk, scale, block, count, ends, causal, seed=0):
    """Forward and gradient against the reference; returns the five results."""
    N1 = q.shape[1]
    dtype = q.dtype.name
    kw = _kw(ends, causal)
    out, smax, ssum = nsa_numba.nsa_select_attention(q, k, v, topk, scale, N1, block, count,
                                                     **kw)
    rout, rmax, rsum = ref.select_attention(q, k, v, topk, scale, N1, block, count, causal,
                                            ends, ends)
    assert out.dtype == q.dtype and out.shape == rout.shape
    stat = np.float64 if dtype == "float64" else np.float32
    assert smax.dtype == ssum.dtype == stat and smax.shape == (*q.shape[:2], 8)
    assert (smax == smax[..., :1]).all() and (ssum == ssum[..., :1]).all()
    forward, gradient = select_references(topk, N1, block, count, causal, ends, ends)
    keys = count * block
    top = bounds.check_forward(out, rout, forward, q, k, v, scale, keys + q.shape[2] + 16)
    bounds.check_statistics(smax[..., 0], ssum[..., 0], rmax, rsum, forward, q, k, v, scale,
                            keys, q.shape[2], top=top)
    g = np.random.default_rng(seed + 1).standard_normal(out.shape).astype(q.dtype)
    dq, dk, dv = nsa_numba.nsa_select_attention_grad(g, q, k, v, out, smax, ssum, topk, scale,
                                                     N1, block, count, **kw)
    exact = ref.select_attention_grad(g, q, k, v, topk, scale, N1, block, count, causal,
                                      ends, ends)
    for got, like in zip((dq, dk, dv), (q, k, v)):
        assert got.dtype == q.dtype and got.shape == like.shape
    bounds.check_gradient((dq, dk, dv), exact, forward, gradient, g, q, k, v, out, scale,
                          gradient_depth(q, k, v, keys), top=top)
    return out, smax, ssum, dq, dk, dv


def select_references(topk, N1, block, count, causal, ends_q, ends_kv):
    """The float64 reference forward ``(out, softmax_max)`` and gradient of selected
    attention as functions of ``(q, k, v, scale)`` and ``(g, q, k, v, scale)``, the
    other arguments fixed (``attention_bounds`` calls them on absolute values)."""
    def forward(q, k, v, scale):
        return ref.select_attention(q, k, v, topk, scale, N1, block, count, causal, ends_q,
                                    ends_kv)[:2]

    def gradient(g, q, k, v, scale):
        return ref.select_attention_grad(g, q, k, v, topk, scale, N1, block, count, causal,
                                         ends_q, ends_kv)
    return forward, gradient


def gradient_depth(q, k, v, keys):
    """The longest float32 rounding chain of a gradient: a key's sums over every query
    row of the group, a row's over its keys, the dot products over D and Dv."""
    group = q.shape[-2] // k.shape[-2] if q.ndim == k.ndim else 1
    return q.shape[0] * group + keys + q.shape[-1] + v.shape[-1] + 16


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_matches_reference(dtype, causal):
    # two sequences, G = 4, a block of 16 keys (whole 64-lane tiles and 16-lane ones)
    problem = select_problem([200, 312], 8, 2, 48, 32, 16, 5, dtype, seed=1, causal=causal)
    *arrays, scale, ends = problem
    check(*arrays, scale, 16, 5, ends, causal)


@pytest.mark.parametrize("shape", [
    # (lengths, N1, N2, D, Dv, l', c): the paper's head dims; every group size up to 5;
    # blocks and head dims that are not multiples of 16 (scalar tails); one key block
    ([128, 192], 8, 2, 192, 128, 64, 2),
    ([70], 5, 1, 40, 24, 20, 3),
    ([33, 0, 41], 6, 3, 7, 9, 5, 4),
    ([96], 4, 4, 20, 100, 32, 2),
    ([16], 2, 1, 16, 16, 16, 1),
    ([12, 6], 17, 1, 3, 2, 2, 3),
], ids=["paper-dims", "G5", "empty-seq", "G1", "one-block", "G17-tiny-heads"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
def test_shapes_match_reference(shape, causal):
    lengths, N1, N2, D, Dv, block, count = shape
    *arrays, scale, ends = select_problem(lengths, N1, N2, D, Dv, block, count, "float32",
                                          seed=3, causal=causal)
    check(*arrays, scale, block, count, ends, causal)


def test_repeated_blocks_count_twice_and_fully_masked_rows(dtype):
    """A repeated index is read twice; a row whose blocks are all after the query is
    fully masked: the mean of its values, max -FLT_MAX, sum K, no gradient to q."""
    *arrays, scale, ends = select_problem([128], 4, 2, 32, 16, 16, 4, dtype, seed=5)
    q, k, v, topk = arrays
    topk[:, :, 1] = topk[:, :, 0]              # every list repeats its first block
    topk[3] = [[2, 3, 4, 5], [7, 6, 5, 4]]     # token 3 (block 0): only later blocks
    out, smax, ssum, dq, dk, dv = check(q, k, v, topk, scale, 16, 4, ends, causal=True)
    assert (smax[3] == MASKED).all() and (ssum[3] == 64).all()
    assert (dq[3].astype(np.float64) == 0).all()


def test_unselected_keys_and_partial_blocks_get_zero_gradients(dtype):
    # 100 keys in blocks of 16: rows 96..99 are in no whole block
    *arrays, scale, ends = select_problem([100], 2, 1, 16, 16, 16, 2, dtype, seed=7)
    q, k, v, topk = arrays
    topk[:] = np.array([0, 2])                 # blocks 1, 3, 4, 5 and the tail unselected
    g = np.ones((100, 2, 16), dtype)
    out, smax, ssum = nsa_numba.nsa_select_attention(q, k, v, topk, scale, 2, 16, 2,
                                                     strict=False)
    dq, dk, dv = nsa_numba.nsa_select_attention_grad(g, q, k, v, out, smax, ssum, topk,
                                                     scale, 2, 16, 2, strict=False)
    unselected = np.r_[16:32, 48:100]
    assert (dk[unselected].astype(np.float64) == 0).all()
    assert (dv[unselected].astype(np.float64) == 0).all()
    assert (np.abs(dv[:16].astype(np.float64)) > 0).all()


def test_outputs_in_place_and_strided_inputs():
    *arrays, scale, ends = select_problem([96, 160], 4, 2, 24, 20, 16, 3, "float32", seed=9)
    q, k, v, topk = arrays
    kw = _kw(ends, True)
    want = nsa_numba.nsa_select_attention(q, k, v, topk, scale, 4, 16, 3, **kw)
    # inputs as strided views of larger buffers, outputs as strided views too
    wide = [np.zeros(a.shape[:2] + (2 * a.shape[2],), a.dtype) for a in (q, k, v)]
    for w, a in zip(wide, (q, k, v)):
        w[..., ::2] = a
    qs, ks, vs = (w[..., ::2] for w in wide)
    buf = np.full((256, 4, 40), 7, np.float32)
    out = buf[:, :, ::2]
    smax = np.full((256, 4, 8), 7, np.float32)
    ssum = np.full((256, 4, 8), 7, np.float32)
    got = nsa_numba.nsa_select_attention(qs, ks, vs, topk.astype(np.int64), scale, 4, 16, 3,
                                         attention_out=out, softmax_max=smax,
                                         softmax_sum=ssum, **kw)
    assert got[0] is out and got[1] is smax and got[2] is ssum
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    assert (buf[:, :, 1::2] == 7).all()
    g = np.random.default_rng(0).standard_normal(want[0].shape).astype(np.float32)
    grads = nsa_numba.nsa_select_attention_grad(g, q, k, v, *want, topk, scale, 4, 16, 3, **kw)
    given = [np.full(a.shape, 7, np.float32) for a in (q, k, v)]
    got = nsa_numba.nsa_select_attention_grad(g, qs, ks, vs, *want, topk, scale, 4, 16, 3,
                                              dq=given[0], dk=given[1], dv=given[2], **kw)
    for a, b, c in zip(got, grads, given):
        assert a is c and np.array_equal(a, b)


def test_empty_query_tokens():
    q = np.zeros((0, 2, 16), np.float32)
    k = np.random.default_rng(0).standard_normal((32, 1, 16)).astype(np.float32)
    topk = np.zeros((0, 1, 1), np.int32)
    out, smax, ssum = nsa_numba.nsa_select_attention(q, k, k, topk, 1.0, 2, 16, 1,
                                                     strict=False)
    assert out.shape == (0, 2, 16) and smax.shape == (0, 2, 8)
    dq, dk, dv = nsa_numba.nsa_select_attention_grad(out, q, k, k, out, smax, ssum, topk, 1.0,
                                                     2, 16, 1, strict=False)
    assert dq.shape == (0, 2, 16) and (dk == 0).all() and (dv == 0).all()


# -- determinism -------------------------------------------------------------------------

#: several sequences, G = 4, blocks every query selects (block 0) and blocks few do
DETERMINISM = dict(lengths=[640, 384], N1=8, N2=2, D=64, Dv=48, block=32, count=6)

SCRIPT = textwrap.dedent("""
    import hashlib, json
    import numba, numpy as np
    import nsa_numba
    from nsa_numba.bench.cases import select_problem
    p = json.loads({problem!r})
    out = {{}}
    for name in {dtypes!r}:
        *arrays, scale, ends = select_problem(p["lengths"], p["N1"], p["N2"], p["D"], p["Dv"],
                                              p["block"], p["count"], name, seed=11)
        kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends,
                  strict=False)
        res = nsa_numba.nsa_select_attention(*arrays, scale, p["N1"], p["block"], p["count"],
                                             **kw)
        g = np.random.default_rng(12).standard_normal(res[0].shape).astype(res[0].dtype)
        grads = nsa_numba.nsa_select_attention_grad(g, *arrays[:3], *res, arrays[3], scale,
                                                    p["N1"], p["block"], p["count"], **kw)
        out[name] = [hashlib.sha256(a.tobytes()).hexdigest() for a in (*res, *grads)]
    from nsa_numba._core import launch as _launch
    out["threads"] = _launch.count()
    out["helpers"] = _launch.helpers_started()
    print(json.dumps(out))
""")


def _digests(threads, dtypes):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), NSA_NUMBA_QUIET="1")
    code = SCRIPT.format(problem=json.dumps(DETERMINISM), dtypes=list(dtypes))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("threads") == threads
    assert result.pop("helpers") == threads - 1       # every thread was there to take units
    return result


@pytest.mark.slow
def test_same_bits_for_one_two_and_three_threads():
    names = ["bfloat16", "float32"]
    digests = [_digests(n, names) for n in (1, 2, 3)]
    assert digests[0] == digests[1] == digests[2]


def test_same_bits_for_thread_caps_in_process():
    *arrays, scale, ends = select_problem(**dict(DETERMINISM, dtype="float16"), seed=13)
    kw = _kw(ends, True)
    p = DETERMINISM
    results = []
    for n in (1, 2):
        with nsa_numba.threads(n):
            res = nsa_numba.nsa_select_attention(*arrays, scale, p["N1"], p["block"],
                                                 p["count"], **kw)
            grads = nsa_numba.nsa_select_attention_grad(res[0], *arrays[:3], *res, arrays[3],
                                                        scale, p["N1"], p["block"],
                                                        p["count"], **kw)
        results.append([hashlib.sha256(a.tobytes()).hexdigest() for a in (*res, *grads)])
    assert results[0] == results[1]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_paper_heads_in_strict_mode(dtype):
    # D 192, Dv 128, l' 16, c 2, key sequences of whole blocks and at least c * l'
    *arrays, scale, ends = select_problem([32, 48], 4, 1, 192, 128, 16, 2, dtype, seed=17)
    q, k, v, topk = arrays
    kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends)
    out, smax, ssum = nsa_numba.nsa_select_attention(q, k, v, topk, scale, 4, 16, 2, **kw)
    rout, _, _ = ref.select_attention(q, k, v, topk, scale, 4, 16, 2, True, ends, ends)
    _close(out, rout, TOLERANCE[q.dtype.name], "attention_out")


def test_the_npu_test_suites_case():
    # torch_npu's own test of the operator (op-plugin test_npu_nsa_select_attention.py):
    # one query token over 1088 keys, 115 heads (G = 1), l' = 64, c = 16, float16, no
    # mask; the lists are 0..15 for a token in the first c * l' positions
    rng = np.random.default_rng(19)
    q = rng.standard_normal((1, 115, 192)).astype(np.float16)
    k = rng.standard_normal((1088, 115, 192)).astype(np.float16)
    v = rng.standard_normal((1088, 115, 128)).astype(np.float16)
    topk = np.broadcast_to(np.arange(16, dtype=np.int32), (1, 115, 16))
    out, smax, ssum = nsa_numba.nsa_select_attention(q, k, v, topk, 1.0, 115, 64, 16,
                                                     actual_seq_qlen=[1],
                                                     actual_seq_kvlen=[1088])
    rout, rmax, rsum = ref.select_attention(q, k, v, topk, 1.0, 115, 64, 16, False, [1],
                                            [1088])
    _close(out, rout, TOLERANCE["float16"], "attention_out")
    _close(smax[..., 0], rmax, STAT_TOLERANCE["float16"], "softmax_max")
    _close(ssum[..., 0], rsum, STAT_TOLERANCE["float16"], "softmax_sum")
