"""NaN and infinity in keys and values: a row's forward output depends only on the keys
it sees. A non-finite key or value reaches the rows that see it and no other row,
whatever rows share its unit of 16 tokens or its chunk of 64 keys: each case plants
one non-finite element at a unit or chunk edge and compares every row with the same
call on the clean arrays, bit for bit where the row does not see the key."""

import numpy as np
import pytest

import nsa_numba

TRIU = np.triu(np.ones((2048, 2048), bool), 1)
#: positions at the edges of 16-row units and 64-key chunks, and inside them
EDGES = [0, 15, 16, 63, 64, 79, 130]


def _bits(a):
    """``[T, N, X]`` as the bytes of each (token, head) row."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(*a.shape[:2], -1)


def _compare(clean, dirty, sees, what):
    """Rows that see the planted key: not finite (the key's weight is not 0 there);
    the others: the clean call's bits."""
    for name, a, b in zip(("attention_out", "softmax_max", "softmax_sum"), clean, dirty):
        hidden = ~sees
        assert np.array_equal(_bits(a)[hidden], _bits(b)[hidden]), \
            (what, name, np.argwhere(hidden & (_bits(a) != _bits(b)).any(-1))[:8])
    out = np.asarray(dirty[0], np.float64)
    assert not np.isfinite(out[sees]).all(axis=-1).any(), what


@pytest.mark.parametrize("where", ["value", "key"])
@pytest.mark.parametrize("at", EDGES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_the_window_branch(where, at, bad):
    # two sequences of 150 tokens, a window of 40 keys (mode 4): row i sees i - 39 .. i
    rng = np.random.default_rng(0)
    T, N1, N2 = 300, 4, 2
    q = rng.standard_normal((T, N1, 32)).astype(np.float32)
    k = rng.standard_normal((T, N2, 32)).astype(np.float32)
    v = rng.standard_normal((T, N2, 16)).astype(np.float32)
    kw = dict(atten_mask=TRIU, sparse_mode=4, pre_tockens=39, next_tockens=0,
              actual_seq_qlen=[150, 300], actual_seq_kvlen=[150, 300], scale=0.2)
    clean = nsa_numba.fusion_attention(q, k, v, N1, "TND", **kw)[:3]
    (v if where == "value" else k)[at, 1] = bad          # KV head 1: query heads 2, 3
    dirty = nsa_numba.fusion_attention(q, k, v, N1, "TND", **kw)[:3]
    rows = np.arange(T)
    sees = np.zeros((T, N1), bool)
    sees[:, 2:] = ((rows >= at) & (rows <= at + 39) & (rows // 150 == at // 150))[:, None]
    _compare(clean, dirty, sees, (where, at, bad))


@pytest.mark.parametrize("at", [0, 3, 4, 7, 8])
def test_compressed_attention(at):
    # the causal compressed mask: position s sees compressed key c when c d + l - 1 <= s
    rng = np.random.default_rng(1)
    T = 200
    Tc = (T - 32) // 16 + 1
    q = rng.standard_normal((T, 4, 32)).astype(np.float32)
    k = rng.standard_normal((Tc, 2, 32)).astype(np.float32)
    v = rng.standard_normal((Tc, 2, 16)).astype(np.float32)
    mask = np.arange(Tc)[None, :] * 16 + 31 > np.arange(T)[:, None]
    kw = dict(atten_mask=mask, actual_seq_qlen=[T], actual_cmp_seq_kvlen=[Tc],
              actual_sel_seq_kvlen=[-(-Tc // 4)])
    clean = nsa_numba.nsa_compress_attention(q, k, v, 0.2, 4, 32, 16, 64, 2, **kw)
    v[at, 0] = np.nan
    dirty = nsa_numba.nsa_compress_attention(q, k, v, 0.2, 4, 32, 16, 64, 2, **kw)
    sees = np.zeros((T, 4), bool)          # (a row whose keys are all masked: all, equally)
    sees[:, :2] = (~mask[:, at] | mask.all(axis=1))[:, None]
    _compare([clean[0], clean[2], clean[3]], [dirty[0], dirty[2], dirty[3]], sees, at)
    unchanged = ~sees[:, 0]
    assert np.array_equal(clean[1][unchanged], dirty[1][unchanged])


def _selected(seed):
    """q, k, v, dO and the indices of a selected-attention problem: 128 tokens, 4 query
    heads over 2 KV heads, blocks of 32 keys, each token selecting block 0 and its own
    block (block 1 for the first two blocks' tokens)."""
    rng = np.random.default_rng(seed)
    T, N1, N2 = 128, 4, 2
    q = rng.standard_normal((T, N1, 32)).astype(np.float32)
    k = rng.standard_normal((T, N2, 32)).astype(np.float32)
    v = rng.standard_normal((T, N2, 16)).astype(np.float32)
    dy = rng.standard_normal((T, N1, 16)).astype(np.float32)
    topk = np.zeros((T, N2, 2), np.int32)
    topk[:, :, 1] = np.maximum(np.arange(T) // 32, 1)[:, None]
    return q, k, v, dy, topk


@pytest.mark.parametrize("at", [0, 5, 31, 32, 40])
def test_selected_attention_hides_the_rest_of_the_own_block(at):
    # causal: a query sees the keys of its selected blocks up to its own position
    T, N1, block, count = 128, 4, 32, 2
    q, k, v, _, topk = _selected(2)
    kw = dict(atten_mask=np.ones(1), strict=False)
    clean = nsa_numba.nsa_select_attention(q, k, v, topk, 0.2, N1, block, count, **kw)
    v[at, 1] = np.nan
    dirty = nsa_numba.nsa_select_attention(q, k, v, topk, 0.2, N1, block, count, **kw)
    rows = np.arange(T)
    blocks = topk[:, 1, :]
    selected = (blocks == at // block).any(axis=1)
    sees = np.zeros((T, N1), bool)
    sees[:, 2:] = (selected & (rows >= at))[:, None]
    _compare(clean, dirty, sees, at)


# -- gradients: dq of a row from the keys it sees, dk and dv of a key from the rows that
# see it. A row that sees the planted key has a non-finite output, so its delta and
# every dS of its row are not finite: the keys it sees are touched too.

def _same(clean, dirty, keep, what):
    """``keep[t, n]``: the (token, head) rows whose bytes must not change."""
    changed = keep & (_bits(clean) != _bits(dirty)).any(-1)
    assert not changed.any(), (what, np.argwhere(changed)[:8])


@pytest.mark.parametrize("where", ["value", "key"])
@pytest.mark.parametrize("at", EDGES)
def test_the_window_branch_gradients(where, at):
    rng = np.random.default_rng(3)
    T, N1, N2 = 300, 4, 2
    q = rng.standard_normal((T, N1, 32)).astype(np.float32)
    k = rng.standard_normal((T, N2, 32)).astype(np.float32)
    v = rng.standard_normal((T, N2, 16)).astype(np.float32)
    dy = rng.standard_normal((T, N1, 16)).astype(np.float32)
    kw = dict(atten_mask=TRIU, sparse_mode=4, pre_tockens=39, next_tockens=0,
              actual_seq_qlen=[150, 300], actual_seq_kvlen=[150, 300])

    def grads(k, v):
        o, m, s = nsa_numba.fusion_attention(q, k, v, N1, "TND", scale=0.2, **kw)[:3]
        return nsa_numba.fusion_attention_grad(q, k, v, dy, N1, "TND", softmax_max=m,
                                               softmax_sum=s, attention_in=o,
                                               scale_value=0.2, **kw)[:3]
    clean = grads(k, v)
    k2, v2 = k.copy(), v.copy()
    (v2 if where == "value" else k2)[at, 1] = np.nan
    dirty = grads(k2, v2)
    pos = np.arange(T)
    same_seq = pos // 150 == at // 150
    poisoned = (pos >= at) & (pos <= at + 39) & same_seq           # rows that see key at
    touched = (pos >= at - 39) & (pos <= at + 39) & same_seq      # keys those rows see
    heads = np.arange(N1) >= 2                                     # KV head 1's queries
    _same(clean[0], dirty[0], ~(poisoned[:, None] & heads), ("dq", where, at))
    for name, c, d in zip(("dk", "dv"), clean[1:], dirty[1:]):
        _same(c, d, ~(touched[:, None] & (np.arange(N2) == 1)), (name, where, at))


@pytest.mark.parametrize("at", [0, 5, 31, 32, 40])
def test_selected_attention_gradients(at):
    T, N1, N2, block, count = 128, 4, 2, 32, 2
    q, k, v, dy, topk = _selected(4)
    kw = dict(atten_mask=np.ones(1), strict=False)

    def grads(v):
        o, m, s = nsa_numba.nsa_select_attention(q, k, v, topk, 0.2, N1, block, count, **kw)
        return nsa_numba.nsa_select_attention_grad(dy, q, k, v, o, m, s, topk, 0.2, N1, block,
                                                   count, **kw)
    clean = grads(v)
    v2 = v.copy()
    v2[at, 1] = np.nan
    dirty = grads(v2)
    pos = np.arange(T)
    blocks = topk[:, 1, :]
    poisoned = (blocks == at // block).any(axis=1) & (pos >= at)
    # the keys the poisoned rows see: their selected blocks up to their own position
    touched = np.zeros(T, bool)
    for t in np.flatnonzero(poisoned):
        for idx in blocks[t]:
            keys = np.arange(idx * block, idx * block + block)
            touched[keys[keys <= t]] = True
    heads = np.arange(N1) >= 2
    _same(clean[0], dirty[0], ~(poisoned[:, None] & heads), ("dq", at))
    for name, c, d in zip(("dk", "dv"), clean[1:], dirty[1:]):
        _same(c, d, ~(touched[:, None] & (np.arange(N2) == 1)), (name, at))
