"""nsa_compress_attention (the forward, with its top-k blocks) against the float64
reference (``nsa_numba.reference.compress_attention``): every dtype, the causal
compressed mask and its fully masked first rows, forced blocks, ties, thread counts,
bad arguments, and the workspace that holds no weights matrix."""

import numpy as np
import pytest

import attention_bounds as bounds
import nsa_numba
from conftest import DTYPES
from nsa_numba import NsaError
from nsa_numba import reference as ref
from test_select_attention import gradient_depth

L, D_STRIDE, L_SEL = 32, 16, 64            # l, d, l': m = 4 compressed tokens per block


def causal_mask(rows, cols):
    """The usual compressed mask: key k is visible to position s iff k d + l - 1 <= s."""
    s = np.arange(rows)[:, None]
    k = np.arange(cols)[None, :]
    return k * D_STRIDE + L - 1 > s


def problem(dtype, q_lengths=(200, 150), N1=8, N2=2, D=32, Dv=16, seed=0):
    """Queries of sequences of ``q_lengths`` tokens over their compressed keys."""
    rng = np.random.default_rng(seed)
    c_lengths = [max(0, (n - L) // D_STRIDE + 1) for n in q_lengths]
    q = rng.standard_normal((sum(q_lengths), N1, D)).astype(dtype)
    k = rng.standard_normal((sum(c_lengths), N2, D)).astype(dtype)
    v = rng.standard_normal((sum(c_lengths), N2, Dv)).astype(dtype)
    sel = [-(-n // (L_SEL // D_STRIDE)) for n in c_lengths]
    seqs = dict(actual_seq_qlen=np.cumsum(q_lengths).tolist(),
                actual_cmp_seq_kvlen=np.cumsum(c_lengths).tolist(),
                actual_sel_seq_kvlen=np.cumsum(sel).tolist())
    return q, k, v, seqs, max(q_lengths), max(c_lengths), max(sel)


def check(q, k, v, seqs, count, atten_mask=None, topk_mask=None, strict=False):
    N1, D = q.shape[1], q.shape[2]
    scale = D ** -0.5
    got = nsa_numba.nsa_compress_attention(q, k, v, scale, N1, L, D_STRIDE, L_SEL, count,
                                           atten_mask=atten_mask, topk_mask=topk_mask,
                                           strict=strict, **seqs)
    out, topk, smax, ssum = got
    rout, rtopk, rmax, rsum, score = ref.compress_attention(
        q, k, v, scale, N1, L, D_STRIDE, L_SEL, count, topk_mask, atten_mask,
        seqs["actual_seq_qlen"], seqs["actual_cmp_seq_kvlen"], seqs["actual_sel_seq_kvlen"])
    assert out.dtype == q.dtype and topk.dtype == np.int32
    assert (smax == smax[..., :1]).all() and (ssum == ssum[..., :1]).all()
    forward = compressed_forward(atten_mask, seqs)
    keys = int(np.diff([0] + list(seqs["actual_cmp_seq_kvlen"])).max(initial=0))
    top = bounds.check_forward(out, rout, forward, q, k, v, scale, keys + D + 16)
    bounds.check_statistics(smax[..., 0], ssum[..., 0], rmax, rsum, forward, q, k, v, scale,
                            keys, D, top=top)
    # the same blocks in the same order, except where two blocks' exact scores tie
    # within float32 rounding of the weights' sums
    for t, j, r in zip(*np.nonzero(topk != rtopk)):
        ours, theirs = score[t, j, topk[t, j, r]], score[t, j, rtopk[t, j, r]]
        assert abs(ours - theirs) <= 1e-5 * max(abs(theirs), 1.0), (t, j, r, ours, theirs)
    return got, (rout, rtopk, rmax, rsum, score)


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_matches_reference_under_the_causal_compressed_mask(dtype):
    q, k, v, seqs, sq, sc, _ = problem(dtype)
    (_, topk, smax, ssum), _ = check(q, k, v, seqs, 2, atten_mask=causal_mask(sq, sc))
    # the first l - 1 positions of a sequence see no compressed key: uniform rows
    assert (smax[:L - 1] == np.finfo(np.float32).min).all()
    assert (ssum[:L - 1, :, 0] == 11).all()               # sequence 0: 11 keys


@pytest.mark.parametrize("shape", [
    dict(N1=4, N2=4, D=20, Dv=12),         # G = 1, head dims off the 16-lane grid
    dict(N1=6, N2=2, D=48, Dv=40),         # G = 3
    dict(N1=16, N2=1, D=64, Dv=64),        # G = 16: four head tiles
], ids=["G1", "G3", "G16"])
def test_group_sizes_and_forced_blocks(shape):
    q, k, v, seqs, sq, sc, ss = problem(np.float32, q_lengths=(300, 160), **shape)
    forced = np.zeros((sq, ss), bool)
    forced[:, 0] = True                                    # block 0, as the paper forces
    forced[::3, 2] = True
    (_, topk, _, _), _ = check(q, k, v, seqs, 3, atten_mask=causal_mask(sq, sc),
                               topk_mask=forced)
    assert (topk[:, :, 0] == 0).all()
    assert (topk[::3, :, 1] == 2).all()                    # forced ones first, ascending


def test_ties_go_to_the_lower_block():
    # q = 0: every weight equal, so blocks with equal windows tie exactly
    q, k, v, seqs, _, _, _ = problem(np.float32, q_lengths=(400,), seed=3)
    q[:] = 0
    (_, topk, _, _), (_, rtopk, _, _, score) = check(q, k, v, seqs, 5)
    assert (topk == rtopk).all()
    tied = score[0, 0, topk[0, 0]]
    assert (tied[:-1] >= tied[1:]).all() and (tied == tied[0]).any()
    for a, b in zip(topk[0, 0][:-1], topk[0, 0][1:]):        # equal scores: lower first
        if score[0, 0, a] == score[0, 0, b]:
            assert a < b


@pytest.mark.parametrize("hidden", [16, 32, 40])
def test_a_mask_that_hides_the_leading_keys_of_whole_units(hidden):
    # every row of a unit of 16 tokens hides the compressed keys before ``hidden``, so
    # the keys its rows see start past a block edge: the block just before it still
    # gets the weight of key ``hidden`` through the window (w_0 = 1), and the top-k
    # must be the reference's row for row (ties within float32 sums aside)
    q, k, v, seqs, sq, sc, _ = problem(np.float32, q_lengths=(1000,), N1=8, N2=2, seed=7)
    mask = causal_mask(sq, sc) | (np.arange(sc)[None, :] < hidden)
    (_, topk, _, _), (_, rtopk, _, _, score) = check(q, k, v, seqs, 6, atten_mask=mask)
    seeing = ~mask.all(axis=1)
    assert seeing.sum() > 100
    agree = (topk == rtopk).all(axis=(1, 2))
    assert agree[seeing].mean() > 0.95, np.flatnonzero(~agree)[:10]


def test_strict_paper_shapes():
    # D 192, Dv 128, l = 32, d = 16, l' = 64, G = 4: the NPU's limits hold
    q, k, v, seqs, sq, sc, _ = problem(np.dtype("float16"), q_lengths=(160, 128), N1=8,
                                       N2=2, D=192, Dv=128, seed=7)
    check(q, k, v, seqs, 2, atten_mask=causal_mask(sq, sc), strict=True)


def _call(**change):
    q, k, v, seqs, sq, sc, ss = problem(np.float32, seed=9)
    call = dict(query=q, key=k, value=v, scale_value=0.3, head_num=8,
                compress_block_size=L, compress_stride=D_STRIDE, select_block_size=L_SEL,
                select_block_count=2, atten_mask=causal_mask(sq, sc), **seqs)
    call.update(change)
    out = np.full((350, 8, 16), 7, np.float32)
    args = [call.pop(key) for key in ("query", "key", "value", "scale_value", "head_num",
                                      "compress_block_size", "compress_stride",
                                      "select_block_size", "select_block_count")]
    with pytest.raises(NsaError) as info:
        nsa_numba.nsa_compress_attention(*args, attention_out=out, **call)
    assert (out == 7).all()
    return info.value


@pytest.mark.parametrize("change,status,words", [
    (dict(query=None), 161001, "query"),
    (dict(head_num=4), 161002, "head_num"),
    (dict(compress_block_size=40), 161002, "multiple of compress_stride"),
    (dict(select_block_count=5), 161002, "more than the 3 blocks"),
    (dict(actual_sel_seq_kvlen=[4, 8]), 161002, "ceil(11 / 4) = 3 blocks"),
    (dict(actual_sel_seq_kvlen=None), 161002, "go together"),
    (dict(atten_mask=np.zeros((10, 10), bool)), 161002, "cover [200, 11]"),
    (dict(atten_mask=np.zeros((200, 11), np.float32)), 161002, "bool or uint8"),
    (dict(topk_mask=np.zeros((200, 2), bool)), 161002, "cover [200, 3]"),
    (dict(compress_stride=8, strict=False), 161002, "ceil(11 / 8) = 2 blocks"),
], ids=["query None", "head_num", "l % d", "count", "block count", "lists together",
        "mask shape", "mask dtype", "topk_mask shape", "lengths for another stride"])
def test_bad_arguments(change, status, words):
    err = _call(**change)
    assert err.status == status and words in str(err), str(err)
    assert str(err).startswith("nsa_compress_attention: ")


def test_strict_limits():
    q, k, v, seqs, sq, sc, _ = problem(np.float32, seed=11)
    with pytest.raises(NsaError, match="must divide 128") as info:
        nsa_numba.nsa_compress_attention(q[:, :6], k[:, :1], v[:, :1], 0.3, 6, L, D_STRIDE,
                                         L_SEL, 2, **seqs)
    assert info.value.status == 561002
    with pytest.raises(NsaError, match="Dv = 16 must be <= D = 8"):
        nsa_numba.nsa_compress_attention(q[..., :8], k[..., :8], v, 0.3, 8, L, D_STRIDE,
                                         L_SEL, 2, **seqs)


def test_the_workspace_holds_no_weights_matrix():
    from nsa_numba._ops import pipeline as _pipeline
    from nsa_numba._ops.compress_attention import compress_attention_rules
    from nsa_numba._ops.operators import COMPRESS_ATTENTION
    # the paper's layer: 2 x 4096 tokens, 64 query heads, 255 compressed tokens each
    q = np.zeros((8192, 64, 192), np.float16)
    k = np.zeros((510, 4, 192), np.float16)
    v = np.zeros((510, 4, 128), np.float16)
    plan = _pipeline.plan(COMPRESS_ATTENTION, compress_attention_rules("x"),
                          (q, k, v, 0.1, 64, 32, 16, 64, 16, None, None, [4096, 8192],
                           [255, 510], [64, 128], None, None, None, None))
    weights = 8192 * 64 * 255 * 4
    assert plan.workspace_bytes < k.nbytes + v.nbytes + (4 << 20) < weights // 10


# -- the gradient ------------------------------------------------------------------------

def grad_check(q, k, v, seqs, atten_mask=None, seed=1):
    """The forward, then its gradient against the float64 reference's exact gradient of
    attention over the compressed keys; returns (dq, dk, dv)."""
    N1, D = q.shape[1], q.shape[2]
    scale = D ** -0.5
    lens = dict(actual_seq_qlen=seqs["actual_seq_qlen"],
                actual_cmp_seq_kvlen=seqs["actual_cmp_seq_kvlen"])
    out, _, smax, ssum = nsa_numba.nsa_compress_attention(
        q, k, v, scale, N1, L, D_STRIDE, L_SEL, 1, atten_mask=atten_mask, strict=False,
        **seqs)
    g = np.random.default_rng(seed).standard_normal(out.shape).astype(q.dtype)
    got = nsa_numba.nsa_compress_attention_grad(g, q, k, v, out, smax, ssum, scale, N1,
                                                atten_mask=atten_mask, strict=False, **lens)
    exact = ref.attention_grad(g, q, k, v, scale, atten_mask, lens["actual_seq_qlen"],
                               lens["actual_cmp_seq_kvlen"])
    for name, a, like in zip(("dq", "dk", "dv"), got, (q, k, v)):
        assert a.dtype == q.dtype and a.shape == like.shape, name
    keys = int(np.diff([0] + list(lens["actual_cmp_seq_kvlen"])).max(initial=0))
    bounds.check_gradient(got, exact, compressed_forward(atten_mask, seqs),
                          compressed_gradient(atten_mask, lens), g, q, k, v, out, scale,
                          gradient_depth(q, k, v, keys))
    return got


def compressed_forward(atten_mask, seqs):
    """The reference forward ``(out, softmax_max)`` as a function of ``(q, k, v,
    scale)`` (``attention_bounds``): every compressed key of the sequence under the mask,
    the top-k aside."""
    def forward(q, k, v, scale):
        r = ref.compress_attention(q, k, v, scale, q.shape[1], L, D_STRIDE, L_SEL, 1, None,
                                   atten_mask, seqs["actual_seq_qlen"],
                                   seqs["actual_cmp_seq_kvlen"],
                                   seqs.get("actual_sel_seq_kvlen"))
        return r[0], r[2]
    return forward


def compressed_gradient(atten_mask, lens):
    def gradient(g, q, k, v, scale):
        return ref.attention_grad(g, q, k, v, scale, atten_mask, lens["actual_seq_qlen"],
                                  lens["actual_cmp_seq_kvlen"])
    return gradient


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_gradient_matches_reference_under_the_causal_compressed_mask(dtype):
    # 1200 and 700 tokens: 74 and 42 compressed keys, more than one chunk of 64
    q, k, v, seqs, sq, sc, _ = problem(dtype, q_lengths=(1200, 700), N1=4, N2=2)
    dq, dk, dv = grad_check(q, k, v, seqs, causal_mask(sq, sc))
    # the first l - 1 positions see no key: equal weights, no gradient to their queries
    assert (dq[:L - 1].astype(np.float64) == 0).all()
    assert (dq[1200:1200 + L - 1].astype(np.float64) == 0).all()
    assert np.abs(dv.astype(np.float64)).min(axis=(1, 2)).max() > 0   # and V gets theirs


@pytest.mark.parametrize("shape", [
    dict(N1=4, N2=4, D=20, Dv=12),         # G = 1, head dims off the 16-lane grid
    dict(N1=6, N2=2, D=48, Dv=40),         # G = 3
    dict(N1=16, N2=1, D=64, Dv=64),        # G = 16: one row per owner batch
    dict(N1=2, N2=1, D=7, Dv=3),           # tiny heads: scalar tails only
], ids=["G1", "G3", "G16", "tiny"])
def test_gradient_with_holes_in_the_mask(shape):
    q, k, v, seqs, sq, sc, _ = problem(np.float32, q_lengths=(1500, 0, 300), seed=2, **shape)
    rng = np.random.default_rng(3)
    mask = causal_mask(sq, sc) | (rng.random((sq, sc)) < 0.2)   # holes inside the ranges
    mask[100:140] = True                                        # rows masked whole
    mask[200, :] = False                                        # a row that sees the future
    grad_check(q, k, v, seqs, mask)


def test_gradient_without_a_mask():
    q, k, v, seqs, _, _, _ = problem(np.float64, q_lengths=(900, 400), seed=4)
    grad_check(q, k, v, seqs)


def _grad_call(**change):
    q, k, v, seqs, sq, sc, _ = problem(np.float32, seed=9)
    out = np.ones((350, 8, 16), np.float32)
    stat = np.ones((350, 8, 8), np.float32)
    call = dict(grad=out.copy(), query=q, key=k, value=v, attention_out=out,
                softmax_max=stat, softmax_sum=stat.copy(), scale_value=0.3, head_num=8,
                atten_mask=causal_mask(sq, sc), actual_seq_qlen=seqs["actual_seq_qlen"],
                actual_cmp_seq_kvlen=seqs["actual_cmp_seq_kvlen"])
    call.update(change)
    dq = np.full(q.shape, 7, np.float32)
    args = [call.pop(key) for key in ("grad", "query", "key", "value", "attention_out",
                                      "softmax_max", "softmax_sum", "scale_value",
                                      "head_num")]
    with pytest.raises(NsaError) as info:
        nsa_numba.nsa_compress_attention_grad(*args, dq=dq, **call)
    assert (dq == 7).all()
    assert str(info.value).startswith("nsa_compress_attention_grad: ")
    return info.value


@pytest.mark.parametrize("change,status,words", [
    (dict(grad=None), 161001, "grad"),
    (dict(softmax_sum=None), 161001, "softmax_sum"),
    (dict(grad=np.ones((350, 8, 15), np.float32)), 161002, "[T1, N1, Dv] = (350, 8, 16)"),
    (dict(attention_out=np.ones((350, 8, 16), np.float64)), 161002, "dtype must equal"),
    (dict(softmax_max=np.ones((350, 8, 8), np.float16)), 161002, "float32"),
    (dict(softmax_max=np.ones((349, 8, 8), np.float32)), 161002, "[T1, N1, 8]"),
    (dict(actual_cmp_seq_kvlen=None), 161002, "go together"),
    (dict(actual_cmp_seq_kvlen=[11, 12]), 161002, "end at the token count 19"),
    (dict(atten_mask=np.zeros((10, 10), bool)), 161002, "cover [200, 11]"),
    (dict(head_num=4), 161002, "head_num"),
    (dict(actual_seq_qlen=[200, 350], actual_cmp_seq_kvlen=[0, 19]), 161002,
     "no compressed keys"),
], ids=["grad None", "sum None", "grad shape", "out dtype", "stat dtype", "stat shape",
        "lists together", "kv end", "mask shape", "head_num", "no keys"])
def test_gradient_bad_arguments(change, status, words):
    err = _grad_call(**change)
    assert err.status == status and words in str(err), str(err)


def test_gradient_strict_limits():
    q, k, v, seqs, sq, sc, _ = problem(np.float32, seed=11)
    err = _grad_call(query=q[..., :8].copy(), key=k[..., :8].copy())
    assert err.status == 561002 and "Dv = 16 must be <= D = 8" in str(err)


def test_the_gradient_workspace_holds_no_weights_matrix():
    from nsa_numba._ops import pipeline as _pipeline
    from nsa_numba._ops.compress_attention import compress_attention_rules
    from nsa_numba._ops.operators import COMPRESS_ATTENTION_GRAD
    q = np.zeros((8192, 64, 192), np.float16)
    k = np.zeros((510, 4, 192), np.float16)
    v = np.zeros((510, 4, 128), np.float16)
    o = np.zeros((8192, 64, 128), np.float16)
    stat = np.zeros((8192, 64, 8), np.float32)
    plan = _pipeline.plan(COMPRESS_ATTENTION_GRAD, compress_attention_rules("x"),
                          (o, q, k, v, o, stat, stat, 0.1, 64, None, [4096, 8192], [255, 510],
                           None, None, None))
    weights = 8192 * 64 * 255 * 4
    assert plan.workspace_bytes < 2 * (k.nbytes + v.nbytes) + (4 << 20) < weights // 10
