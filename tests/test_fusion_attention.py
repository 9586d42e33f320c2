"""fusion_attention / fusion_attention_grad (torch_npu's npu_fusion_attention, sparse
modes 0 to 4) against the float64 reference (``reference.fusion_attention``): the
visibility rule of every mode (the reference's rule against the definition written
out key by key), every layout and accepted mask shape, groups, rows without keys,
thread counts, compressed attention's gradient, and bad arguments."""

import hashlib

import numpy as np
import pytest

import attention_bounds as bounds
import nsa_numba
from nsa_numba import NsaError
from nsa_numba import reference as ref

TRIU = np.triu(np.ones((2048, 2048), bool), 1)
LAYOUTS = ["TND", "BSND", "BNSD", "BSH", "SBH"]
FLT_MAX = float(np.finfo(np.float32).max)


def visible_by_definition(mode, Sq, Skv, pre, nxt, masked):
    """The table of docs/reference.md ("Fusion attention"), one key at a time."""
    off = Skv - Sq
    out = np.zeros((Sq, Skv), bool)
    for i in range(Sq):
        for j in range(Skv):
            if masked is None:
                out[i, j] = True
            elif mode == 0:
                out[i, j] = not masked[i, j] and i - pre <= j <= i + nxt
            elif mode == 1:
                out[i, j] = not masked[i, j]
            elif mode == 2:
                out[i, j] = j <= i
            elif mode == 3:
                out[i, j] = j <= i + off
            else:
                out[i, j] = i + off - pre <= j <= i + off + nxt
    return out


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("Sq, Skv", [(7, 7), (5, 9), (9, 5)], ids=["square", "wide", "tall"])
@pytest.mark.parametrize("pre, nxt", [(2, 0), (0, 3), (-1, 4), (3, -2)])
def test_visibility_rule(mode, Sq, Skv, pre, nxt):
    masked = np.random.default_rng(Sq * Skv + mode).random((Sq, Skv)) < 0.3
    visible, admitted = ref.fusion_visibility(mode, Sq, Skv, pre, nxt, masked)
    assert (visible == visible_by_definition(mode, Sq, Skv, pre, nxt, masked)).all()
    # the band: what the mode admits without the mask's holes
    assert (admitted == visible_by_definition(mode, Sq, Skv, pre, nxt,
                                              np.zeros_like(masked))).all()
    assert not (visible & ~admitted).any()
    every, _ = ref.fusion_visibility(mode, Sq, Skv, pre, nxt, None)
    assert every.all()                  # without a mask every key is visible


def test_sliding_window_and_the_documented_band_mask():
    # a window of w keys: mode 4, pre = w - 1, next = 0 sees max(0, i + off - w + 1) .. i + off
    w, Sq, Skv = 4, 6, 10
    visible, _ = ref.fusion_visibility(4, Sq, Skv, w - 1, 0, TRIU[:Sq, :Skv])
    for i in range(Sq):
        assert np.flatnonzero(visible[i]).tolist() == list(range(max(0, i + 4 - w + 1), i + 5))
    # modes 0 and 4 with Sq = Skv: the docs' mask triu(k = next + 1) | tril(k = -pre - 1)
    pre, nxt, S = 2, 1, 8
    band_mask = np.triu(np.ones((S, S), bool), nxt + 1) | np.tril(np.ones((S, S), bool), -pre - 1)
    v4, _ = ref.fusion_visibility(4, S, S, pre, nxt, TRIU[:S, :S])
    v0, _ = ref.fusion_visibility(1, S, S, pre, nxt, band_mask)
    assert (v4 == v0).all()


def layout_shape(layout, B, S, N, X):
    return {"TND": (B * S, N, X), "BSND": (B, S, N, X), "BNSD": (B, N, S, X),
            "BSH": (B, S, N * X), "SBH": (S, B, N * X)}[layout]


def problem(layout, dtype, B=2, Sq=70, Skv=90, N1=4, N2=2, D=32, Dv=16, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(layout_shape(layout, B, S, N, X)).astype(dtype)
              for S, N, X in ((Sq, N1, D), (Skv, N2, D), (Skv, N2, Dv))]
    seqs = {}
    if layout == "TND":
        seqs = dict(actual_seq_qlen=[Sq * (b + 1) for b in range(B)],
                    actual_seq_kvlen=[Skv * (b + 1) for b in range(B)])
    return arrays, seqs


def run(q, k, v, layout, N1, seed=1, **kw):
    """Forward and gradient, each against the reference; returns both."""
    fwd = nsa_numba.fusion_attention(q, k, v, N1, layout, strict=False, **kw)
    out, smax, ssum, softmax_out, seed_out, offset, numels = fwd
    rout, rmax, rsum = ref.fusion_attention(q, k, v, N1, layout, **kw)
    assert out.dtype == q.dtype and smax.dtype == ssum.dtype
    assert softmax_out.size == 0 and (seed_out, offset) == (0, 0)
    assert (smax == smax[..., :1]).all() and (ssum == ssum[..., :1]).all()
    forward, gradient, rows, key_rows, D, keys = fusion_references(q, k, v, layout, N1, kw)
    scale = kw.get("scale", 1.0)
    top = bounds.check_forward(out, rout, forward, q, k, v, scale, keys + D + 16, rows)
    bounds.check_statistics(smax[..., 0], ssum[..., 0], rmax, rsum, forward, q, k, v, scale,
                            keys, D, top=top)
    dy = np.random.default_rng(seed).standard_normal(out.shape).astype(q.dtype)
    scale = kw.pop("scale", 1.0)
    args = dict(softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=scale,
                strict=False, **kw)
    grads = nsa_numba.fusion_attention_grad(q, k, v, dy, N1, layout, **args)
    assert grads[3] is None
    exact = ref.fusion_attention_grad(dy, q, k, v, N1, layout, scale=scale, **kw)
    for name, got, like in zip(("dq", "dk", "dv"), grads[:3], (q, k, v)):
        assert got.dtype == q.dtype and got.shape == like.shape, name
    rows_per_key = q.size // D // key_rows.heads          # every query row of a group
    bounds.check_gradient(grads[:3], exact, forward, gradient, dy, q, k, v, out, scale,
                          rows_per_key + keys + 2 * D + 16, rows, key_rows, top=top)
    return fwd, grads


def fusion_references(q, k, v, layout, N1, kw):
    """The float64 reference forward ``(out, softmax_max)`` and gradient as functions of
    ``(q, k, v, scale)`` and ``(g, q, k, v, scale)`` with ``kw``'s other arguments, the
    layout's rows of the query and key arrays, the head dim and the most keys of a
    sequence (``attention_bounds``)."""
    other = {key: value for key, value in kw.items() if key != "scale"}
    if layout in ("BSH", "SBH"):                        # H = N * D
        D = q.shape[2] // N1
        N2 = k.shape[2] // D
    else:
        D, N2 = q.shape[-1], k.shape[2] if layout == "BSND" else k.shape[1]
    seq_axis = {"TND": 0, "BSND": 1, "BNSD": 2, "BSH": 1, "SBH": 0}[layout]
    if layout == "TND":
        keys = int(np.diff([0] + list(kw["actual_seq_kvlen"])).max(initial=0))
    else:
        keys = k.shape[seq_axis]

    def forward(q, k, v, scale):
        out, smax, _ = ref.fusion_attention(q, k, v, N1, layout, scale=scale, **other)
        return out, smax

    def gradient(g, q, k, v, scale):
        return ref.fusion_attention_grad(g, q, k, v, N1, layout, scale=scale, **other)
    return (forward, gradient, bounds.Rows(layout, N1), bounds.Rows(layout, N2), D, keys)


MASKS = {
    "none": lambda B, N1, Sq, Skv, rng: None,
    "2d": lambda B, N1, Sq, Skv, rng: rng.random((Sq, Skv)) < 0.3,
    "11ss": lambda B, N1, Sq, Skv, rng: rng.random((1, 1, Sq, Skv)) < 0.3,
    "b1ss": lambda B, N1, Sq, Skv, rng: rng.random((B, 1, Sq, Skv)) < 0.3,
    "bnss": lambda B, N1, Sq, Skv, rng: (rng.random((B, N1, Sq, Skv)) < 0.3).astype(np.uint8),
}


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("mode", [0, 1])
def test_padded_layouts_with_every_mask_shape(layout, mask, mode):
    (q, k, v), _ = problem(layout, np.float32)
    atten_mask = MASKS[mask](2, 4, 70, 90, np.random.default_rng(3))
    run(q, k, v, layout, 4, atten_mask=atten_mask, scale=0.3, pre_tockens=20,
        next_tockens=5, sparse_mode=mode)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode, pre, nxt", [(2, 0, 0), (3, 0, 0), (4, 31, 0), (4, 10, 7)])
@pytest.mark.parametrize("Sq, Skv", [(70, 90), (90, 70)], ids=["wide", "tall"])
def test_compressed_mask_modes(layout, mode, pre, nxt, Sq, Skv):
    (q, k, v), seqs = problem(layout, np.float32, Sq=Sq, Skv=Skv, seed=mode)
    run(q, k, v, layout, 4, atten_mask=TRIU, scale=0.25, pre_tockens=pre, next_tockens=nxt,
        sparse_mode=mode, **seqs)


def test_dtypes_on_the_window_branch(dtype):
    # the NSA window branch: GQA 8 over 1, a window of 64 keys, rows past the first chunk
    (q, k, v), _ = problem("BSND", dtype, B=1, Sq=300, Skv=300, N1=8, N2=1, D=48, Dv=32)
    run(q, k, v, "BSND", 8, atten_mask=TRIU, scale=48 ** -0.5, pre_tockens=63, next_tockens=0,
        sparse_mode=4)


@pytest.mark.parametrize("N1, N2", [(3, 3), (6, 2), (16, 1)], ids=["G1", "G3", "G16"])
def test_groups_and_dims_off_the_lane_grid(N1, N2):
    (q, k, v), seqs = problem("TND", np.float32, B=3, Sq=40, Skv=50, N1=N1, N2=N2, D=20, Dv=12)
    run(q, k, v, "TND", N1, atten_mask=np.random.default_rng(1).random((40, 50)) < 0.4,
        scale=0.5, sparse_mode=1, **seqs)


def test_tnd_lengths_masks_and_dropped_batches():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((100, 4, 32)).astype(np.float32)
    k = rng.standard_normal((130, 2, 32)).astype(np.float32)
    v = rng.standard_normal((130, 2, 16)).astype(np.float32)
    # an empty batch repeats the previous value; trailing zeros drop batches
    seqs = dict(actual_seq_qlen=[30, 30, 100, 0], actual_seq_kvlen=[50, 60, 130, 0])
    # the [max Sq, max Skv] mask: each batch its top-left corner
    run(q, k, v, "TND", 4, atten_mask=rng.random((70, 70)) < 0.3, sparse_mode=1, **seqs)
    # the [T1, T2] mask: each batch its diagonal block
    run(q, k, v, "TND", 4, atten_mask=rng.random((100, 130)) < 0.3, sparse_mode=0,
        pre_tockens=40, next_tockens=40, **seqs)


def test_layouts_give_the_same_bits():
    rng = np.random.default_rng(11)
    B, Sq, Skv, N1, N2, D, Dv = 2, 50, 60, 4, 2, 32, 16
    q, k, v = (rng.standard_normal((B, S, N, X)).astype(np.float32)
               for S, N, X in ((Sq, N1, D), (Skv, N2, D), (Skv, N2, Dv)))
    convert = {"BSND": lambda x: x, "BNSD": lambda x: x.transpose(0, 2, 1, 3).copy(),
               "BSH": lambda x: x.reshape(x.shape[0], x.shape[1], -1).copy(),
               "SBH": lambda x: x.reshape(x.shape[0], x.shape[1], -1).transpose(1, 0, 2).copy(),
               "TND": lambda x: x.reshape(-1, *x.shape[2:]).copy()}
    back = {"BSND": lambda x: x, "BNSD": lambda x: x.transpose(0, 2, 1, 3),
            "BSH": lambda x, n: x.reshape(B, -1, n, x.shape[2] // n),
            "SBH": lambda x, n: x.transpose(1, 0, 2).reshape(B, -1, n, x.shape[2] // n),
            "TND": lambda x: x.reshape(B, -1, *x.shape[1:])}
    results = {}
    for layout in LAYOUTS:
        seqs = {} if layout != "TND" else dict(actual_seq_qlen=[Sq, 2 * Sq],
                                               actual_seq_kvlen=[Skv, 2 * Skv])
        a = [convert[layout](x) for x in (q, k, v)]
        kw = dict(atten_mask=TRIU, sparse_mode=3, scale=0.2, **seqs)
        if layout == "TND":             # the bits every layout must give, against the reference
            run(*a, layout, N1, **kw)
        out, smax, ssum, *_ = nsa_numba.fusion_attention(*a, N1, layout, **kw)
        dy = convert[layout](np.ones((B, Sq, N1, Dv), np.float32))
        dq, dk, dv, _ = nsa_numba.fusion_attention_grad(
            *a, dy, N1, layout, softmax_max=smax, softmax_sum=ssum, attention_in=out,
            scale_value=0.2, atten_mask=TRIU, sparse_mode=3, **seqs)
        unpack = back[layout]
        if layout in ("BSH", "SBH"):
            got = [unpack(out, N1), unpack(dq, N1), unpack(dk, N2), unpack(dv, N2)]
        else:
            got = [unpack(x) for x in (out, dq, dk, dv)]
        results[layout] = [np.ascontiguousarray(x).tobytes() for x in got]
    for layout in LAYOUTS[1:]:
        assert results[layout] == results["TND"], layout


def test_equivalent_modes_give_the_same_bits():
    (q, k, v), _ = problem("BSND", np.float32, Sq=80, Skv=80)
    S = 80
    causal = np.triu(np.ones((S, S), bool), 1)
    runs = [dict(atten_mask=TRIU, sparse_mode=2), dict(atten_mask=TRIU, sparse_mode=3),
            dict(atten_mask=causal, sparse_mode=1),
            dict(atten_mask=causal, sparse_mode=0, pre_tockens=1000, next_tockens=0),
            dict(atten_mask=TRIU, sparse_mode=4, pre_tockens=1000, next_tockens=0)]
    digests = {hashlib.sha256(nsa_numba.fusion_attention(q, k, v, 4, "BSND", **kw)[0]
                              .tobytes()).hexdigest() for kw in runs}
    assert len(digests) == 1
    run(q, k, v, "BSND", 4, **runs[2])      # and those bits are causal attention's


def test_rows_without_keys():
    (q, k, v), _ = problem("BSND", np.float32, Sq=90, Skv=70)
    # mode 3 with Sq > Skv: the first 20 rows see no key: zeros, -FLT_MAX, FLT_MAX
    (out, smax, ssum, *_), (dq, *_) = run(q, k, v, "BSND", 4, atten_mask=TRIU, sparse_mode=3)
    assert (out[:, :20] == 0).all() and (dq[:, :20] == 0).all()
    assert (smax[:, :, :20] == -FLT_MAX).all() and (ssum[:, :, :20] == FLT_MAX).all()
    assert (out[:, 20:] != 0).any()
    # rows the mask hides entirely: equal weights over the band, or zeros (inner_precise 2)
    mask = np.zeros((90, 70), bool)
    mask[5:9] = True
    (out, smax, ssum, *_), (dq, *_) = run(q, k, v, "BSND", 4, atten_mask=mask, sparse_mode=0,
                                          pre_tockens=10, next_tockens=3)
    assert (smax[:, :, 5:9] == -FLT_MAX).all()
    assert (ssum[:, :, 5:9, 0] == [9, 10, 11, 12]).all()        # the band: keys 0 .. i + 3
    assert (dq[:, 5:9] == 0).all()
    (out, smax, ssum, *_), _ = run(q, k, v, "BSND", 4, atten_mask=mask, sparse_mode=0,
                                   pre_tockens=10, next_tockens=3, inner_precise=2)
    assert (out[:, 5:9] == 0).all() and (ssum[:, :, 5:9] == FLT_MAX).all()


def test_compressed_attention_gradient_is_this_operators():
    # npu_nsa_compress_attention's backward is npu_fusion_attention_grad, TND, mode 1
    rng = np.random.default_rng(5)
    q = rng.standard_normal((150, 8, 32)).astype(np.float16)
    k = rng.standard_normal((20, 2, 32)).astype(np.float16)
    v = rng.standard_normal((20, 2, 16)).astype(np.float16)
    mask = np.arange(20)[None, :] * 16 + 31 > np.arange(100)[:, None]      # [max Sq, max Skv]
    seqs = dict(actual_seq_qlen=[100, 150], actual_cmp_seq_kvlen=[12, 20])
    out, _, smax, ssum = nsa_numba.nsa_compress_attention(q, k, v, 0.2, 8, 32, 16, 64, 1,
                                                          atten_mask=mask, strict=False,
                                                          actual_sel_seq_kvlen=[3, 5], **seqs)
    dy = rng.standard_normal(out.shape).astype(np.float16)
    ours = nsa_numba.nsa_compress_attention_grad(dy, q, k, v, out, smax, ssum, 0.2, 8,
                                                 atten_mask=mask[:, :12], strict=False, **seqs)
    theirs = nsa_numba.fusion_attention_grad(
        q, k, v, dy, 8, "TND", atten_mask=mask[:, :12], softmax_max=smax, softmax_sum=ssum,
        attention_in=out, scale_value=0.2, sparse_mode=1, actual_seq_qlen=[100, 150],
        actual_seq_kvlen=[12, 20], strict=False)
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


def test_outputs_in_place_and_numels():
    (q, k, v), seqs = problem("TND", np.float32, B=2, Sq=30, Skv=40)
    outs = dict(attention_out=np.empty((60, 4, 16), np.float32),
                softmax_max=np.empty((60, 4, 8), np.float32),
                softmax_sum=np.empty((60, 4, 8), np.float32))
    got = nsa_numba.fusion_attention(q, k, v, 4, "tnd", **seqs, **outs)
    assert all(a is b for a, b in zip(got[:3], outs.values()))
    assert got[6] == 4 * 2 * 30 * 40


def _call(change):
    """A valid BSND call with ``change`` applied to its keyword arguments."""
    (q, k, v), _ = problem("BSND", np.float32, B=1, Sq=16, Skv=16)
    kw = dict(query=q, key=k, value=v, head_num=4, input_layout="BSND", atten_mask=None,
              sparse_mode=0)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change, status, words", [
    (dict(query=None), 161001, "query is required"),
    (dict(input_layout="NSD"), 161002, "input_layout must be one of"),
    (dict(input_layout=3), 161002, "input_layout must be a str"),
    (dict(head_num=3), 161002, "head_num must equal"),
    (dict(head_num=0), 161002, "head_num must be >= 1"),
    (dict(keep_prob=0.0), 161002, "keep_prob must be in (0, 1]"),
    (dict(sparse_mode=9), 161002, "sparse_mode must be one of"),
    (dict(inner_precise=4), 161002, "inner_precise must be"),
    (dict(atten_mask=np.zeros((16, 15), bool)), 161002, "atten_mask must have one of"),
    (dict(atten_mask=np.zeros((16, 16), np.float32)), 161002, "atten_mask dtype"),
    (dict(atten_mask=np.zeros((16, 16), bool), sparse_mode=4), 561002, "2048 x 2048"),
    (dict(atten_mask=TRIU, sparse_mode=4, pre_tockens=-40, next_tockens=-40), 561002,
     "no query row sees a key"),
    (dict(actual_seq_qlen=[16]), 161002, "for input_layout TND only"),
    (dict(scale="big"), 161002, "scale must be a real number"),
])
def test_bad_arguments(change, status, words):
    kw = _call(change)
    with pytest.raises(NsaError) as info:
        nsa_numba.fusion_attention(**kw)
    assert info.value.status == status and words in str(info.value), str(info.value)


@pytest.mark.parametrize("change, words", [
    (dict(pse=np.zeros(1)), "pse is not supported"),
    (dict(padding_mask=np.zeros(1)), "padding_mask is not supported"),
    (dict(prefix=[1]), "prefix is not supported"),
    (dict(keep_prob=0.9), "keep_prob < 1 (dropout)"),
    (dict(sparse_mode=6), "sparse_mode 6"),
    (dict(softmax_layout="BSND"), "softmax_layout"),
])
def test_what_is_not_computed_says_so(change, words):
    with pytest.raises(NotImplementedError, match=words.replace("(", r"\(").replace(")", r"\)")):
        nsa_numba.fusion_attention(**_call(change))


def test_tnd_checks_and_strict_limits():
    (q, k, v), _ = problem("TND", np.float32, B=2, Sq=16, Skv=16)
    kw = dict(query=q, key=k, value=v, head_num=4, input_layout="TND")
    cases = [
        (dict(), 161002, "actual_seq_qlen is required"),
        (dict(actual_seq_qlen=[16, 32], actual_seq_kvlen=[32]), 161002, "the same length"),
        (dict(actual_seq_qlen=[16, 32], actual_seq_kvlen=[16, 30]), 161002,
         "must end at the token count 32"),
        (dict(actual_seq_qlen=[16, 32], actual_seq_kvlen=[20, 32], atten_mask=TRIU,
              sparse_mode=3), 561002, "TND does not take such rows"),
        (dict(actual_seq_qlen=[16, 32], actual_seq_kvlen=[16, 32],
              atten_mask=np.zeros((20, 20), bool)), 161002, "[max Sq, max Skv]"),
    ]
    for change, status, words in cases:
        with pytest.raises(NsaError) as info:
            nsa_numba.fusion_attention(**kw, **change)
        assert info.value.status == status and words in str(info.value), (change, info.value)
    big = np.zeros((16, 4, 800), np.float32)
    with pytest.raises(NsaError) as info:
        nsa_numba.fusion_attention(big, big[:, :2], big[:, :2], 4, "TND", actual_seq_qlen=[16],
                                   actual_seq_kvlen=[16])
    assert info.value.status == 561002 and "D must be <= 768" in str(info.value)
    # non-strict computes what strict refuses: the rows without keys get zeros
    out = nsa_numba.fusion_attention(q, k, v, 4, "TND", atten_mask=TRIU, sparse_mode=3,
                                     actual_seq_qlen=[16, 32], actual_seq_kvlen=[12, 32],
                                     strict=False)[0]
    assert (out[:4] == 0).all() and (out[4:16] != 0).any()


def test_nothing_is_written_on_error():
    (q, k, v), _ = problem("BSND", np.float32, B=1, Sq=16, Skv=16)
    out = np.full((1, 16, 4, 16), 7.0, np.float32)
    with pytest.raises(NsaError):
        nsa_numba.fusion_attention(q, k, v, 4, "BSND", atten_mask=np.zeros((3, 3), bool),
                                   attention_out=out)
    assert (out == 7).all()
    with pytest.raises(NsaError):                       # an output overlapping an input
        nsa_numba.fusion_attention(q, k, v, 4, "BSND", attention_out=q[..., :16])


def test_gradient_checks_the_saved_forward():
    (q, k, v), _ = problem("BSND", np.float32, B=1, Sq=16, Skv=16)
    out, smax, ssum, *_ = nsa_numba.fusion_attention(q, k, v, 4, "BSND")
    dy = np.ones_like(out)
    kw = dict(softmax_max=smax, softmax_sum=ssum, attention_in=out)
    for change, status, words in [
        (dict(attention_in=None), 161001, "attention_in is required"),
        (dict(softmax_max=smax[:, :, :8]), 161002, "softmax_max must have shape"),
        (dict(softmax_sum=ssum.astype(np.float64)), 161002, "softmax_sum dtype"),
        (dict(dq=np.empty((1, 16, 4, 31), np.float32)), 161002, "dq must have shape"),
    ]:
        with pytest.raises(NsaError) as info:
            nsa_numba.fusion_attention_grad(q, k, v, dy, 4, "BSND", **{**kw, **change})
        assert info.value.status == status and words in str(info.value), str(info.value)


def test_reference_gradient_by_finite_differences():
    # the float64 reference's gradient against central differences of its forward,
    # through a band, a fully masked row and a row without keys
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, S, 2, 4)) for S in (6, 5, 5))
    mask = rng.random((6, 5)) < 0.3
    mask[2] = True
    kw = dict(atten_mask=mask, scale=0.7, pre_tockens=1, next_tockens=1, sparse_mode=0)
    dy = rng.standard_normal((1, 6, 2, 4))
    grads = ref.fusion_attention_grad(dy, q, k, v, 2, "BSND", **kw)
    for x, g in zip((q, k, v), grads):
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            up = (ref.fusion_attention(q, k, v, 2, "BSND", **kw)[0] * dy).sum()
            x[idx] = old - 1e-6
            down = (ref.fusion_attention(q, k, v, 2, "BSND", **kw)[0] * dy).sum()
            x[idx] = old
            assert abs((up - down) / 2e-6 - g[idx]) < 1e-6


def _dense_calls(rng):
    """Every dense operator's outputs on a TND batch (a ``[T1, T2]`` mask, an empty and a
    one-token sequence), a padded batch with per-batch masks and a band, and compressed
    attention over three sequences: forward and gradient."""
    dt = np.dtype(np.float16)
    results = []
    lens = [70, 0, 130, 1, 64, 200]
    T, ends = sum(lens), np.cumsum(lens).tolist()
    q, k = (rng.standard_normal((T, n, 32)).astype(dt) for n in (4, 2))
    v = rng.standard_normal((T, 2, 16)).astype(dt)
    kw = dict(atten_mask=rng.random((T, T)) < 0.3, sparse_mode=1, actual_seq_qlen=ends,
              actual_seq_kvlen=ends, strict=False)
    o, m, s = nsa_numba.fusion_attention(q, k, v, 4, "TND", scale=0.2, **kw)[:3]
    results += [o, m, s, *nsa_numba.fusion_attention_grad(
        q, k, v, np.ones_like(o), 4, "TND", softmax_max=m, softmax_sum=s, attention_in=o,
        scale_value=0.2, **kw)[:3]]
    B, S = 5, 40
    q, k = (rng.standard_normal((B, n, S, 32)).astype(dt) for n in (4, 2))
    v = rng.standard_normal((B, 2, S, 16)).astype(dt)
    kw = dict(atten_mask=rng.random((B, 1, S, S)) < 0.3, pre_tockens=7, next_tockens=3)
    o, m, s = nsa_numba.fusion_attention(q, k, v, 4, "BNSD", **kw)[:3]
    results += [o, m, s, *nsa_numba.fusion_attention_grad(
        q, k, v, np.ones_like(o), 4, "BNSD", softmax_max=m, softmax_sum=s, attention_in=o,
        **kw)[:3]]
    lengths = [200, 96, 150]
    cmp = [(n - 32) // 16 + 1 for n in lengths]
    q = rng.standard_normal((sum(lengths), 4, 32)).astype(dt)
    k, v = (rng.standard_normal((sum(cmp), 2, d)).astype(dt) for d in (32, 16))
    kw = dict(atten_mask=np.arange(max(cmp))[None, :] * 16 + 31 > np.arange(200)[:, None],
              actual_seq_qlen=np.cumsum(lengths).tolist(),
              actual_cmp_seq_kvlen=np.cumsum(cmp).tolist(), strict=False)
    r = nsa_numba.nsa_compress_attention(
        q, k, v, 0.25, 4, 32, 16, 64, 2,
        actual_sel_seq_kvlen=np.cumsum([-(-c // 4) for c in cmp]).tolist(), **kw)
    return results + [*r, *nsa_numba.nsa_compress_attention_grad(
        np.ones_like(r[0]), q, k, v, r[0], r[2], r[3], 0.25, 4, **kw)]


def test_a_call_in_parts_gives_the_whole_calls_bits(monkeypatch):
    # a call over many sequences runs in parts of whole sequences (DensePlan.parts): one
    # part per sequence changes no bit of any output, forward or gradient
    from nsa_numba._ops import dense as _dense
    whole = _dense_calls(np.random.default_rng(7))
    monkeypatch.setattr(_dense, "PART_BYTES", 1)
    parts = _dense_calls(np.random.default_rng(7))
    assert len(whole) == len(parts) == 19
    for i, (a, b) in enumerate(zip(whole, parts)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), i
