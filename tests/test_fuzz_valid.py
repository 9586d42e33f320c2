"""Generated valid problems against the float64 reference.

Random T, N, D, l, d, sequence lengths (empty and shorter than a window included),
both ``actual_seq_len`` forms and containers, every dtype and layout, strided inputs
and outputs, strict and non-strict rules. Padded layouts are checked against the
reference of the same data packed as TND, one sequence per batch row.
"""

import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

import attention_bounds as bounds
import nsa_numba
from nsa_numba import reference as ref
from conftest import DTYPES, assert_forward_accurate, assert_grad_accurate
from fuzzing import EXTENDED_EXAMPLES
from test_layouts import from_layout, to_layout
from test_strides import VIEWS

PADDED = ["BSND", "BNSD", "BSH", "SBH"]


# the memory an array of given values may live in (padding holds 7s)
MEMORY = {"contiguous": lambda a: a,
          **{name: (lambda a, view=view: view(a, 7)) for name, view in VIEWS.items()}}


def _sentinel_output(shape, dtype, memory):
    """An output of ``shape`` in ``memory`` order, filled with a sentinel."""
    return MEMORY[memory](np.full(shape, 5, dtype=dtype))


@st.composite
def problems(draw):
    strict = draw(st.booleans())
    op = draw(st.sampled_from(["forward", "grad"]))
    dtype = draw(st.sampled_from(DTYPES))
    N = draw(st.integers(1, 4))
    if strict:
        D = 16 * draw(st.integers(1, 3))
        stride = 16 * draw(st.integers(1, 2))
        low = stride // 16                           # l >= d, both operators
        block = 16 * draw(st.integers(low, 4))
    else:
        D = draw(st.integers(1, 40))
        block = draw(st.integers(1, 24))
        stride = draw(st.integers(1, 30))
    layout = draw(st.sampled_from(["TND", None] + PADDED))
    longest = 3 * block + 2 * stride
    if layout in PADDED:
        B = draw(st.integers(1, 3))
        S = draw(st.integers(block if strict else 0, longest))
        lengths, seq, seq_type = [S] * B, None, 0
    else:
        lengths = draw(st.lists(st.integers(0, longest), min_size=1, max_size=6))
        if strict and max(lengths) < block:   # the NPU rejects problems without a window
            lengths[draw(st.integers(0, len(lengths) - 1))] = draw(
                st.integers(block, longest))
        seq_type = draw(st.sampled_from([0, 1]))
        values = np.cumsum(lengths) if seq_type == 0 else np.array(lengths)
        seq = draw(st.sampled_from(["list", "tuple", "int32", "int64", "uint64"]
                                   + (["none"] if len(lengths) == 1 else [])))
        seq = {"list": lambda: values.tolist(), "tuple": lambda: tuple(values.tolist()),
               "none": lambda: None}.get(seq, lambda: values.astype(seq))()
    memory = {role: draw(st.sampled_from(list(MEMORY)))
              for role in ("input", "weight", "grad", "out")}
    give_outputs = draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 2.0 ** -6]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return dict(strict=strict, op=op, dtype=np.dtype(dtype), N=N, D=D, block=block,
                stride=stride, layout=layout, lengths=lengths, seq=seq, seq_type=seq_type,
                memory=memory, give_outputs=give_outputs, scale=scale, seed=seed)


def _windows(length, block, stride):
    return max(0, (length - block) // stride + 1)


def _data(p):
    """TND values of the problem: x [T, N, D], w [l, N], g [T', N, D]."""
    rng = np.random.default_rng(p["seed"])
    T = sum(p["lengths"])
    Tp = sum(_windows(n, p["block"], p["stride"]) for n in p["lengths"])
    N, D, dtype = p["N"], p["D"], p["dtype"]
    x = (p["scale"] * rng.standard_normal((T, N, D))).astype(dtype)
    w = rng.standard_normal((p["block"], N)).astype(dtype)
    g = rng.standard_normal((Tp, N, D)).astype(dtype)
    return x, w, g


def _as_layout(a, p):
    """A TND array of the problem in its layout (padded: one sequence per batch row)."""
    if p["layout"] not in PADDED:
        return a
    B = len(p["lengths"])
    return to_layout(a.reshape(B, a.shape[0] // B, *a.shape[1:]), p["layout"])


def _as_tnd(a, p):
    if p["layout"] not in PADDED:
        return a
    a4 = from_layout(a, p["layout"], p["N"])
    return a4.reshape(a4.shape[0] * a4.shape[1], *a4.shape[2:])


@pytest.mark.slow
@given(problems())
def test_generated_problem_matches_reference(p):
    check_problem(p)


@pytest.mark.extended
@settings(max_examples=EXTENDED_EXAMPLES)
@given(problems())
def test_more_generated_problems_match_reference(p):
    # other cases than the test above draws (hypothesis derives the fixed cases from
    # the test function), run by CI: pytest -m extended
    check_problem(p)


def check_problem(p):
    note(f"problem: {p}")
    x, w, g = _data(p)
    xs = MEMORY[p["memory"]["input"]](_as_layout(x, p))
    ws = MEMORY[p["memory"]["weight"]](w)
    kw = dict(actual_seq_len=p["seq"], actual_seq_len_type=p["seq_type"],
              layout=p["layout"], strict=p["strict"])
    block, stride = p["block"], p["stride"]
    # the reference gets the TND data with per-sequence lengths (type 1)
    ref_args = (block, stride, p["lengths"], 1)
    if p["op"] == "forward":
        out = None
        if p["give_outputs"]:
            shape = _as_layout(np.empty(g.shape, np.int8), p).shape
            out = _sentinel_output(shape, p["dtype"], p["memory"]["out"])
        result = nsa_numba.nsa_compress(xs, ws, block, stride, out=out, **kw)
        assert out is None or result is out
        assert_forward_accurate(_as_tnd(result, p), x, w, *ref_args)
        return
    gs = MEMORY[p["memory"]["grad"]](_as_layout(g, p))
    dx = dw = None
    if p["give_outputs"]:
        dx = _sentinel_output(xs.shape, p["dtype"], p["memory"]["out"])
        dw = _sentinel_output(w.shape, p["dtype"], p["memory"]["out"])
    rdx, rdw = nsa_numba.nsa_compress_grad(gs, xs, ws, block, stride, input_grad=dx,
                                           weight_grad=dw, **kw)
    assert dx is None or (rdx is dx and rdw is dw)
    assert_grad_accurate(_as_tnd(rdx, p), rdw, g, x, w, *ref_args)


# -- the with-cache (decoding) operator ------------------------------------------------------

@st.composite
def infer_problems(draw):
    strict = draw(st.booleans())
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    N = draw(st.integers(1, 4))
    if strict:
        D = 16 * draw(st.integers(1, 3))
        stride = 16 * draw(st.integers(1, 2))
        block = 16 * draw(st.integers(stride // 16, 4))
        page = draw(st.sampled_from([64, 128]))
    else:
        D = draw(st.integers(1, 40))
        block = draw(st.integers(1, 24))
        stride = draw(st.integers(1, 30))
        page = draw(st.integers(1, 40))
    paged = draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, 3 * block + 2 * stride), min_size=1, max_size=6))
    if draw(st.booleans()):   # several writers: put some on a boundary
        for b in range(len(lengths)):
            if draw(st.booleans()):
                lengths[b] = block + stride * draw(st.integers(0, 3))
    B = len(lengths)
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    writers = [b for b, s in enumerate(lengths) if s >= block and (s - block) % stride == 0]
    per_seq = max(1, -(-max(lengths) // page))
    pages = B * per_seq + draw(st.integers(0, 2))
    rows_min = B
    if strict and paged:
        rows_min = max(rows_min, (pages * page - block) // stride + 1)
    rows = rows_min + draw(st.integers(0, 3))
    slots = rng.permutation(rows)[:B]
    if not strict and len(writers) > 1 and draw(st.booleans()):
        slots[writers[-1]] = slots[writers[0]]        # a repeated row: the last one wins
    memory = {role: draw(st.sampled_from(list(MEMORY))) for role in ("input", "weight", "cache")}
    index_type = draw(st.sampled_from(["int32", "int64", "uint16", "list"]))
    return dict(strict=strict, dtype=dtype, N=N, D=D, block=block, stride=stride, page=page,
                paged=paged, lengths=lengths, pages=pages, per_seq=per_seq, rows=rows,
                slots=slots, memory=memory, index_type=index_type, seed=seed)


@pytest.mark.slow
@given(infer_problems())
def test_generated_decoding_step_matches_reference(p):
    check_decoding_step(p)


@pytest.mark.extended
@settings(max_examples=EXTENDED_EXAMPLES)
@given(infer_problems())
def test_more_generated_decoding_steps_match_reference(p):
    check_decoding_step(p)


def check_decoding_step(p):
    note(f"problem: {p}")
    rng = np.random.default_rng(p["seed"])
    N, D, block, page = p["N"], p["D"], p["block"], p["page"]
    lengths, dtype = p["lengths"], p["dtype"]
    w = rng.standard_normal((block, N)).astype(dtype)
    cache = rng.standard_normal((p["rows"], N, D)).astype(dtype)
    if p["paged"]:
        x = rng.standard_normal((p["pages"], page, N, D)).astype(dtype)
        pool = rng.permutation(p["pages"])
        table = np.full((len(lengths), p["per_seq"]), -1, np.int64)   # padding: never read
        for b, s in enumerate(lengths):
            used = -(-s // page)
            table[b, :used] = pool[b * p["per_seq"]:b * p["per_seq"] + used]
    else:
        spare = int(rng.integers(p["strict"] and not sum(lengths), 3))   # strict: not empty
        x = rng.standard_normal((sum(lengths) + spare, N, D)).astype(dtype)
        table = None
    index = {"list": lambda a: a.tolist()}.get(p["index_type"],
                                               lambda a: a.astype(p["index_type"]))
    if p["index_type"] == "uint16" and table is not None:
        table = table.clip(0)            # unsigned: padding with a page that exists
    xs = MEMORY[p["memory"]["input"]](x)
    ws = MEMORY[p["memory"]["weight"]](w)
    cs = MEMORY[p["memory"]["cache"]](cache.copy())
    got = nsa_numba.nsa_compress_infer(
        xs, ws, index(p["slots"]), block, p["stride"], page,
        block_table=None if table is None else index(table), actual_seq_len=lengths,
        cache=cs, strict=p["strict"])
    assert got is cs
    from test_infer import check_step
    check_step(np.asarray(cs), cache, x, w, p["slots"], block, p["stride"], page, lengths,
               table)


# -- selected attention -------------------------------------------------------------------

@st.composite
def select_problems(draw):
    strict = draw(st.booleans())
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    N2 = draw(st.integers(1, 3))
    G = draw(st.integers(1, 5))
    if strict:
        D, Dv = 192, 128
        block = 16 * draw(st.integers(1, 2))
        count = draw(st.integers(1, 3))
        kv = [block * draw(st.integers(count, count + 2))
              for _ in range(draw(st.integers(1, 3)))]
        q = list(kv)
    else:
        D, Dv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        block, count = draw(st.integers(1, 24)), draw(st.integers(1, 4))
        B = draw(st.integers(1, 3))
        kv = [draw(st.integers(block, 4 * block)) for _ in range(B)]
        q = [draw(st.integers(0, 40)) for _ in range(B)]
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    topk = np.concatenate([rng.integers(0, n // block, (m, N2, count))
                           for m, n in zip(q, kv)]).astype(np.int32)
    if count > 1 and draw(st.booleans()):
        topk[:, :, -1] = topk[:, :, 0]                   # a block read twice
    memory = {role: draw(st.sampled_from(list(MEMORY)))
              for role in ("query", "key", "value", "grad", "out")}
    return dict(strict=strict, dtype=dtype, N2=N2, G=G, D=D, Dv=Dv, block=block,
                count=count, q=q, kv=kv, topk=topk, causal=draw(st.booleans()),
                memory=memory, give_outputs=draw(st.booleans()),
                index=draw(st.sampled_from(["int32", "int64", "uint8"])),
                given_ends=draw(st.booleans()) or len(q) > 1, seed=seed)


@pytest.mark.slow
@given(select_problems())
def test_generated_selected_attention_matches_reference(p):
    check_select(p)


@pytest.mark.extended
@settings(max_examples=EXTENDED_EXAMPLES)
@given(select_problems())
def test_more_generated_selected_attention_matches_reference(p):
    check_select(p)


def check_select(p):
    from test_select_attention import gradient_depth, select_references
    note(f"problem: {p}")
    rng = np.random.default_rng(p["seed"])
    N2, G, dtype = p["N2"], p["G"], p["dtype"]
    N1 = N2 * G
    T1, T2 = sum(p["q"]), sum(p["kv"])
    q = rng.standard_normal((T1, N1, p["D"])).astype(dtype)
    k = rng.standard_normal((T2, N2, p["D"])).astype(dtype)
    v = rng.standard_normal((T2, N2, p["Dv"])).astype(dtype)
    g = rng.standard_normal((T1, N1, p["Dv"])).astype(dtype)
    qs, ks, vs, gs = (MEMORY[p["memory"][r]](a)
                      for r, a in (("query", q), ("key", k), ("value", v), ("grad", g)))
    ends_q, ends_kv = np.cumsum(p["q"]).tolist(), np.cumsum(p["kv"]).tolist()
    if not p["given_ends"]:
        ends_q = ends_kv = None
    topk = p["topk"].astype(p["index"])
    scale = float(p["D"]) ** -0.5
    kw = dict(atten_mask=np.zeros((2, 2), np.uint8) if p["causal"] else None,
              actual_seq_qlen=ends_q, actual_seq_kvlen=ends_kv, strict=p["strict"])
    outs = {}
    if p["give_outputs"]:
        stat = np.float64 if dtype == np.float64 else np.float32
        outs = dict(attention_out=_sentinel_output(g.shape, dtype, p["memory"]["out"]),
                    softmax_max=_sentinel_output((T1, N1, 8), stat, p["memory"]["out"]),
                    softmax_sum=_sentinel_output((T1, N1, 8), stat, p["memory"]["out"]))
    res = nsa_numba.nsa_select_attention(qs, ks, vs, topk, scale, N1, p["block"], p["count"],
                                         **outs, **kw)
    assert all(res[i] is outs[k] for i, k in enumerate(outs))
    exact = ref.select_attention(q, k, v, p["topk"], scale, N1, p["block"], p["count"],
                                 p["causal"], ends_q, ends_kv)
    forward, gradient = select_references(p["topk"], N1, p["block"], p["count"], p["causal"],
                                          ends_q, ends_kv)
    keys = p["count"] * p["block"]
    top = bounds.check_forward(res[0], exact[0], forward, q, k, v, scale, keys + p["D"] + 16)
    bounds.check_statistics(np.asarray(res[1])[..., 0], np.asarray(res[2])[..., 0], exact[1],
                            exact[2], forward, q, k, v, scale, keys, p["D"], top=top)
    grads = nsa_numba.nsa_select_attention_grad(gs, qs, ks, vs, *res, topk, scale, N1,
                                                p["block"], p["count"], **kw)
    exact = ref.select_attention_grad(g, q, k, v, p["topk"], scale, N1, p["block"],
                                      p["count"], p["causal"], ends_q, ends_kv)
    bounds.check_gradient(grads, exact, forward, gradient, g, q, k, v, res[0], scale,
                          gradient_depth(q, k, v, keys), top=top)


# -- compressed attention (forward and gradient) ---------------------------------------

@st.composite
def compress_attention_problems(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    N2, G = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    stride = draw(st.integers(1, 4))
    n, m = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    B = draw(st.integers(1, 3))
    compressed = [draw(st.integers(1, 30)) for _ in range(B)]
    blocks = [-(-c // m) for c in compressed]
    count = draw(st.integers(1, min(blocks)))
    queries = [draw(st.integers(0, 20)) for _ in range(B)]
    return dict(dtype=dtype, N2=N2, G=G, D=draw(st.integers(1, 40)),
                Dv=draw(st.integers(1, 40)), stride=stride, block=n * stride,
                select_block=m * stride, count=count, compressed=compressed,
                blocks=blocks, queries=queries,
                masked=draw(st.sampled_from(["none", "random", "band", "leading"])),
                band=draw(st.integers(1, 8)), forced=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 32 - 1)))


def _compressed_mask(p, rng, rows, cols):
    """None, random (40%), a sliding band (position s sees keys s // 2 - band .. s // 2:
    the leading keys hidden from whole runs of rows), or the first keys hidden (a number
    per row that grows with it, some rows hiding all)."""
    s, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return {"none": lambda: None,
            "random": lambda: rng.random((rows, cols)) < 0.4,
            "band": lambda: (c > s // 2) | (c < s // 2 - p["band"]),
            "leading": lambda: c < (s * p["band"]) // 8}[p["masked"]]()


@pytest.mark.slow
@given(compress_attention_problems())
def test_generated_compressed_attention_matches_reference(p):
    from test_compress_attention import compressed_gradient
    from test_select_attention import gradient_depth
    note(f"problem: {p}")
    rng = np.random.default_rng(p["seed"])
    N1, dtype = p["N2"] * p["G"], p["dtype"]
    q = rng.standard_normal((sum(p["queries"]), N1, p["D"])).astype(dtype)
    k = rng.standard_normal((sum(p["compressed"]), p["N2"], p["D"])).astype(dtype)
    v = rng.standard_normal((sum(p["compressed"]), p["N2"], p["Dv"])).astype(dtype)
    rows = max(p["queries"])
    mask = _compressed_mask(p, rng, rows, max(p["compressed"]))
    forced = rng.random((rows, max(p["blocks"]))) < 0.2 if p["forced"] else None
    seqs = [np.cumsum(p[key]).tolist() for key in ("queries", "compressed", "blocks")]
    args = (q, k, v, 0.3, N1, p["block"], p["stride"], p["select_block"], p["count"])
    got = nsa_numba.nsa_compress_attention(*args, topk_mask=forced, atten_mask=mask,
                                           actual_seq_qlen=seqs[0],
                                           actual_cmp_seq_kvlen=seqs[1],
                                           actual_sel_seq_kvlen=seqs[2], strict=False)
    out, topk, smax, ssum = got
    rout, rtopk, rmax, rsum, score = ref.compress_attention(*args, forced, mask, *seqs)
    lens = dict(actual_seq_qlen=seqs[0], actual_cmp_seq_kvlen=seqs[1])

    def forward(q, k, v, scale):
        r = ref.compress_attention(q, k, v, scale, *args[4:8], 1, None, mask, *seqs)
        return r[0], r[2]

    keys = max(p["compressed"])
    top = bounds.check_forward(out, rout, forward, q, k, v, 0.3, keys + p["D"] + 16)
    bounds.check_statistics(smax[..., 0], ssum[..., 0], rmax, rsum, forward, q, k, v, 0.3,
                            keys, p["D"], top=top)
    for t, j, r in zip(*np.nonzero(topk != rtopk)):
        ours, theirs = score[t, j, topk[t, j, r]], score[t, j, rtopk[t, j, r]]
        assert abs(ours - theirs) <= 1e-5 * max(abs(theirs), 1.0), (t, j, r, ours, theirs)
    # and its gradient, from the outputs as computed
    g = rng.standard_normal(out.shape).astype(dtype)
    grads = nsa_numba.nsa_compress_attention_grad(g, q, k, v, out, smax, ssum, 0.3, N1,
                                                  atten_mask=mask, actual_seq_qlen=seqs[0],
                                                  actual_cmp_seq_kvlen=seqs[1], strict=False)
    exact = ref.attention_grad(g, q, k, v, 0.3, mask, seqs[0], seqs[1])
    bounds.check_gradient(grads, exact, forward, compressed_gradient(mask, lens), g, q, k, v,
                          out, 0.3, gradient_depth(q, k, v, keys), top=top)


# -- fusion attention (forward and gradient) -------------------------------------------

@st.composite
def fusion_problems(draw):
    layout = draw(st.sampled_from(["TND", "BSND", "BNSD", "BSH", "SBH"]))
    mode = draw(st.integers(0, 4))
    N2, G = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 5, 16]))
    if layout == "TND":
        B = draw(st.integers(1, 3))
        sq = [draw(st.integers(0, 40)) for _ in range(B)]
        skv = [draw(st.integers(0, 40)) for _ in range(B)]
        if not sum(sq) or not sum(skv):
            sq[0], skv[0] = sq[0] or 1, skv[0] or 1
    else:
        B = draw(st.integers(1, 2))
        sq, skv = [draw(st.integers(1, 40))] * B, [draw(st.integers(1, 40))] * B
    if mode >= 2:
        mask = "triu"
    elif layout == "TND":
        mask = draw(st.sampled_from(["none", "corner", "diagonal", "band"]))
    else:
        mask = draw(st.sampled_from(["none", "2d", "11ss", "b1ss", "bnss", "band"]))
    return dict(layout=layout, mode=mode, N2=N2, G=G, B=B, sq=sq, skv=skv, mask=mask,
                D=draw(st.integers(1, 40)), Dv=draw(st.integers(1, 40)),
                dtype=np.dtype(draw(st.sampled_from(DTYPES))),
                pre=draw(st.integers(-5, 50)), nxt=draw(st.integers(-5, 50)),
                inner_precise=draw(st.sampled_from([0, 2])),
                density=draw(st.sampled_from([0.1, 0.5, 0.95])),
                seed=draw(st.integers(0, 2 ** 32 - 1)))


def _fusion_arrays(p, rng):
    from test_fusion_attention import layout_shape
    N1 = p["N2"] * p["G"]
    if p["layout"] == "TND":
        shapes = [(sum(p["sq"]), N1, p["D"]), (sum(p["skv"]), p["N2"], p["D"]),
                  (sum(p["skv"]), p["N2"], p["Dv"])]
    else:
        shapes = [layout_shape(p["layout"], p["B"], S, N, X) for S, N, X in (
            (p["sq"][0], N1, p["D"]), (p["skv"][0], p["N2"], p["D"]),
            (p["skv"][0], p["N2"], p["Dv"]))]
    q, k, v = (rng.standard_normal(s).astype(p["dtype"]) for s in shapes)
    Sq, Skv, dens = max(p["sq"]), max(p["skv"]), p["density"]
    mask = {"none": lambda: None,
            "triu": lambda: np.triu(np.ones((2048, 2048), bool), 1),
            "corner": lambda: rng.random((Sq, Skv)) < dens,
            "diagonal": lambda: rng.random((sum(p["sq"]), sum(p["skv"]))) < dens,
            "2d": lambda: rng.random((Sq, Skv)) < dens,
            "11ss": lambda: rng.random((1, 1, Sq, Skv)) < dens,
            "b1ss": lambda: rng.random((p["B"], 1, Sq, Skv)) < dens,
            "bnss": lambda: rng.random((p["B"], N1, Sq, Skv)) < dens,
            # a sliding window as a mask: each row hides the keys before its band and
            # after itself, so runs of rows hide whole leading chunks of keys
            "band": lambda: _band(Sq, Skv, 1 + p["pre"] % 17)}[p["mask"]]()
    kw = dict(atten_mask=mask, scale=0.3, pre_tockens=p["pre"], next_tockens=p["nxt"],
              inner_precise=p["inner_precise"], sparse_mode=p["mode"])
    if p["layout"] == "TND":
        kw.update(actual_seq_qlen=np.cumsum(p["sq"]).tolist(),
                  actual_seq_kvlen=np.cumsum(p["skv"]).tolist())
    return q, k, v, N1, kw


def _band(rows, cols, width):
    i, j = np.arange(rows)[:, None] + max(cols - rows, 0), np.arange(cols)[None, :]
    return (j > i) | (j <= i - width)


@pytest.mark.slow
@given(fusion_problems())
def test_generated_fusion_attention_matches_reference(p):
    check_fusion(p)


@pytest.mark.extended
@settings(max_examples=EXTENDED_EXAMPLES)
@given(fusion_problems())
def test_more_generated_fusion_attention_matches_reference(p):
    check_fusion(p)


def check_fusion(p):
    """Forward and gradient against the float64 reference (test_fusion_attention.run)."""
    from test_fusion_attention import run
    note(f"problem: {p}")
    q, k, v, N1, kw = _fusion_arrays(p, np.random.default_rng(p["seed"]))
    run(q, k, v, p["layout"], N1, **kw)
