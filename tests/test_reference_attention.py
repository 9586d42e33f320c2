"""The float64 references of selected attention (``reference.select_attention`` and
its gradient) and of compressed attention (``reference.compress_attention``,
``attention_grad``), checked against independent formulations, finite differences,
and the NPU's rules for masked, fully masked, repeated and forced blocks and ties."""

import numpy as np
import pytest

from nsa_numba import reference as ref

BLOCK, COUNT, SCALE = 4, 3, 0.37
Q_ENDS, KV_ENDS = [16, 36], [16, 36]          # two sequences of 16 and 20 tokens


def problem(seed=0, N1=4, N2=2, D=8, Dv=6, repeat=False):
    """Random q, k, v and top-k lists: each query of each KV head picks COUNT distinct
    blocks of its sequence (past, own and future ones), or with ``repeat`` one block
    twice."""
    rng = np.random.default_rng(seed)
    T = Q_ENDS[-1]
    q = rng.standard_normal((T, N1, D))
    k = rng.standard_normal((T, N2, D))
    v = rng.standard_normal((T, N2, Dv))
    topk = np.zeros((T, N2, COUNT), np.int32)
    for start, end in zip([0] + Q_ENDS[:-1], Q_ENDS):
        blocks = (end - start) // BLOCK
        for t in range(start, end):
            for j in range(N2):
                picked = rng.choice(blocks, COUNT, replace=False)
                if repeat:
                    picked[1] = picked[0]
                topk[t, j] = picked
    return q, k, v, topk


def dense(q, k, v, topk, causal):
    """Masked softmax over every key of the query's sequence, the keys outside its
    selected blocks (and, with ``causal``, after its own position) left out: the
    selected formulation for lists without repeats, written another way."""
    T, N1, _ = q.shape
    group = N1 // k.shape[1]
    out = np.zeros((T, N1, v.shape[2]))
    for start, end in zip([0] + Q_ENDS[:-1], Q_ENDS):
        keys = np.arange(end - start)
        for t in range(start, end):
            for h in range(N1):
                j = h // group
                chosen = np.isin(keys // BLOCK, topk[t, j])
                visible = chosen & (keys <= t - start) if causal else chosen
                scores = SCALE * k[start:end, j] @ q[t, h]
                if not visible.any():                # all masked: uniform over chosen
                    weights = chosen / chosen.sum()
                else:
                    e = np.where(visible, np.exp(scores - scores[visible].max()), 0.0)
                    weights = e / e.sum()
                out[t, h] = weights @ v[start:end, j]
    return out


def call(q, k, v, topk, causal):
    return ref.select_attention(q, k, v, topk, SCALE, q.shape[1], BLOCK, COUNT, causal,
                                Q_ENDS, KV_ENDS)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_dense_formulation(causal):
    q, k, v, topk = problem()
    out, _, _ = call(q, k, v, topk, causal)
    np.testing.assert_allclose(out, dense(q, k, v, topk, causal), rtol=1e-12, atol=1e-12)


def test_statistics_are_the_row_max_and_the_sum_of_exponentials():
    q, k, v, topk = problem(seed=1)
    out, row_max, row_sum = call(q, k, v, topk, False)
    t, h = 21, 3
    j = h // 2
    rows = np.concatenate([16 + np.arange(b * BLOCK, (b + 1) * BLOCK) for b in topk[t, j]])
    scores = SCALE * k[rows, j] @ q[t, h]
    assert row_max[t, h] == pytest.approx(scores.max(), rel=1e-14)
    assert row_sum[t, h] == pytest.approx(np.exp(scores - scores.max()).sum(), rel=1e-14)
    assert 1 <= row_sum[t, h] <= COUNT * BLOCK


def test_a_fully_masked_row_attends_uniformly_with_the_npu_statistics():
    # token 1 of sequence 0 with only future blocks (1, 2, 3): every score masked
    q, k, v, topk = problem(seed=2)
    topk[1, :] = [1, 2, 3]
    out, row_max, row_sum = call(q, k, v, topk, True)
    for h in range(4):
        j = h // 2
        rows = np.arange(BLOCK, 4 * BLOCK)
        np.testing.assert_allclose(out[1, h], v[rows, j].mean(axis=0), rtol=1e-12)
        assert row_max[1, h] == ref.MASKED_SCORE
        assert row_sum[1, h] == COUNT * BLOCK
    grad = np.zeros_like(out)
    grad[1] = np.random.default_rng(3).standard_normal(grad[1].shape)
    dq, dk, dv = ref.select_attention_grad(grad, q, k, v, topk, SCALE, 4, BLOCK, COUNT, True,
                                           Q_ENDS, KV_ENDS)
    assert not dq.any() and not dk.any()             # constant scores: no gradient
    expected = np.zeros_like(dv)
    for h in range(4):
        expected[BLOCK:4 * BLOCK, h // 2] += grad[1, h] / (COUNT * BLOCK)
    np.testing.assert_allclose(dv, expected, rtol=1e-12, atol=1e-15)


def test_a_repeated_block_counts_twice():
    q, k, v, topk = problem(seed=4, repeat=True)
    once = topk.copy()
    once[:, :, 1] = once[:, :, 2]                # the repeat replaced by the third pick
    out, row_max, row_sum = call(q, k, v, topk, False)
    # softmax over a block listed twice: its keys weigh double in the sum
    t, h = 30, 1
    j = h // 2
    a, c = topk[t, j, 0], topk[t, j, 2]
    rows = 16 + np.concatenate([np.arange(b * BLOCK, (b + 1) * BLOCK) for b in (a, a, c)])
    scores = SCALE * k[rows, j] @ q[t, h]
    e = np.exp(scores - scores.max())
    np.testing.assert_allclose(out[t, h], (e / e.sum()) @ v[rows, j], rtol=1e-12)
    assert row_sum[t, h] == pytest.approx(e.sum(), rel=1e-14)
    assert not np.allclose(out, call(q, k, v, once, False)[0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("repeat", [False, True])
def test_gradient_matches_finite_differences(causal, repeat):
    q, k, v, topk = problem(seed=5, repeat=repeat)
    weights = np.random.default_rng(6).standard_normal(call(q, k, v, topk, causal)[0].shape)

    def loss(q, k, v):
        return float((call(q, k, v, topk, causal)[0] * weights).sum())

    grads = ref.select_attention_grad(weights, q, k, v, topk, SCALE, 4, BLOCK, COUNT,
                                      causal, Q_ENDS, KV_ENDS)
    check_finite_differences(loss, dict(q=q, k=k, v=v), grads, seed=7)


def check_finite_differences(loss, arrays, analytic, seed, probes=12, eps=1e-6):
    """Central differences of ``loss(**arrays)`` at ``probes`` random elements of each
    array against the analytic gradients (in ``arrays``' order)."""
    rng = np.random.default_rng(seed)
    for (name, target), grad in zip(arrays.items(), analytic):
        for _ in range(probes):
            index = tuple(rng.integers(0, n) for n in target.shape)
            plus, minus = target.copy(), target.copy()
            plus[index] += eps
            minus[index] -= eps
            numeric = (loss(**{**arrays, name: plus}) - loss(**{**arrays, name: minus})) / (2 * eps)
            assert grad[index] == pytest.approx(numeric, rel=1e-6, abs=1e-8), (name, index)


def test_keys_no_query_selects_get_no_gradient():
    q, k, v, topk = problem(seed=8)
    topk[:16] = np.array([0, 1, 2])                # sequence 0 never reads block 3
    grad = np.ones((36, 4, 6))
    _, dk, dv = ref.select_attention_grad(grad, q, k, v, topk, SCALE, 4, BLOCK, COUNT, False,
                                          Q_ENDS, KV_ENDS)
    assert not dk[12:16].any() and not dv[12:16].any()
    assert dk[:12].any() and dv[:12].any()


# -- compressed attention ---------------------------------------------------------------

#: l = 32, d = 16, l' = 64 in compressed tokens: m = 4 per select block, n = 2 per window
CMP = dict(block=32, stride=16, select_block=64)


def test_importance_weights_follow_the_npu_offset_and_triangle():
    w = ref.importance_weights(20, **CMP)
    assert w.shape == (5, 20)
    # block b' reads compressed tokens 4b' .. 4b' + 4 with weights 1, 2, 2, 2, 1
    np.testing.assert_array_equal(w[1, 4:9], [1, 2, 2, 2, 1])
    assert w[1].sum() == 8 and not w[1, :4].any() and not w[1, 9:].any()
    assert w[4].sum() == 1 + 2 + 2 + 2          # token 20 is past the end
    # l == d: block b' takes tokens m b' + 1 .. m b' + m, weight 1 each
    w1 = ref.importance_weights(12, 16, 16, 64)
    np.testing.assert_array_equal(np.flatnonzero(w1[0]), [1, 2, 3, 4])
    assert (w1[0, 1:5] == 1).all()


def _scores_by_loops(p, compressed, m, n, blocks):
    """The importance of each block from one row of weights, summed term by term as
    the NPU's own test writes it (an independent spelling of importance_weights)."""
    out = np.zeros(blocks)
    for i in range(blocks, 0, -1):
        for j in range(m + n - 1):
            times = min(j + 1 if j < (m + n - 1) / 2 else m + n - 1 - j, n)
            if 0 <= m * i - j < compressed:
                out[i - 1] += p[m * i - j] * times
    return out


def compress_problem(seed=0, N1=4, N2=2, D=8, Dv=6, lengths=(13, 22)):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(lengths), N1, D))
    k = rng.standard_normal((sum(lengths), N2, D))
    v = rng.standard_normal((sum(lengths), N2, Dv))
    ends = np.cumsum(lengths).tolist()
    return q, k, v, ends


def test_compress_attention_scores_and_order():
    q, k, v, ends = compress_problem()
    mask = np.triu(np.ones((22, 22), bool), k=1)          # causal over compressed tokens
    out, topk, row_max, row_sum, score = ref.compress_attention(
        q, k, v, SCALE, 4, count=3, atten_mask=mask, actual_seq_qlen=ends,
        actual_cmp_seq_kvlen=ends, **CMP)
    t, j = 13 + 9, 1                                       # sequence 1, position 9
    total = np.zeros(6)
    for h in (2, 3):
        s = SCALE * k[13:, j] @ q[t, h]
        s[10:] = ref.MASKED_SCORE
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        np.testing.assert_allclose(out[t, h], p @ v[13:, j], rtol=1e-12)
        assert row_max[t, h] == pytest.approx(s.max(), rel=1e-14)
        assert row_sum[t, h] == pytest.approx(np.exp(s - s.max()).sum(), rel=1e-14)
        total += _scores_by_loops(p, 22, 4, 2, 6)
    np.testing.assert_allclose(score[t, j], total, rtol=1e-12)
    assert list(topk[t, j]) == list(np.argsort(-total, kind="stable")[:3])
    assert (score[:13, :, 4:] == -np.inf).all()           # sequence 0 has 4 blocks


def test_compress_attention_forced_blocks_and_ties():
    # q = 0: every weight equal, so blocks with the same weights tie; forced blocks come
    # first in ascending order, then the descending score, ties to the lower block
    q, k, v, ends = compress_problem(seed=1, lengths=(24,))
    q[:] = 0
    forced = np.zeros((24, 6), bool)
    forced[:, 4] = forced[:, 2] = True
    _, topk, _, _, score = ref.compress_attention(q, k, v, SCALE, 4, count=5,
                                                  topk_mask=forced, **CMP)
    tied = score[0, 0, [0, 1, 3]]                          # blocks with all 8 weights
    assert (tied == tied[0]).all() and score[0, 0, 5] < tied[0]     # block 5: 7
    assert list(topk[0, 0]) == [2, 4, 0, 1, 3]


def test_a_fully_masked_compressed_row_is_uniform_and_still_scores():
    q, k, v, ends = compress_problem(seed=2, lengths=(12,))
    mask = np.ones((12, 12), bool)
    mask[1:, 0] = False                                    # row 0 masks every key
    out, topk, row_max, row_sum, score = ref.compress_attention(
        q, k, v, SCALE, 4, count=2, atten_mask=mask, **CMP)
    np.testing.assert_allclose(out[0, 0], v[:, 0].mean(axis=0), rtol=1e-12)
    assert row_max[0, 0] == ref.MASKED_SCORE and row_sum[0, 0] == 12
    uniform = np.full(12, 1 / 12)
    np.testing.assert_allclose(score[0, 0], 2 * _scores_by_loops(uniform, 12, 4, 2, 3),
                               rtol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_gradient_matches_finite_differences(masked):
    q, k, v, ends = compress_problem(seed=3)
    mask = np.triu(np.ones((22, 22), bool), k=1) if masked else None
    if masked:
        mask[0, 0] = True                                  # a fully masked first row
    weights = np.random.default_rng(4).standard_normal((35, 4, 6))

    def loss(q, k, v):
        out = ref.compress_attention(q, k, v, SCALE, 4, count=1, atten_mask=mask,
                                     actual_seq_qlen=ends, actual_cmp_seq_kvlen=ends,
                                     **CMP)[0]
        return float((out * weights).sum())

    grads = ref.attention_grad(weights, q, k, v, SCALE, mask, ends, ends)
    check_finite_differences(loss, dict(q=q, k=k, v=v), grads, seed=5)
    if masked:
        assert not grads[0][0].any()                       # the fully masked row
