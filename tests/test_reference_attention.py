"""The float64 reference of selected attention (``reference.select_attention`` and
its gradient), checked against an independent dense formulation, finite
differences, and the NPU's rules for masked, fully masked and repeated blocks."""

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

    dq, dk, dv = ref.select_attention_grad(weights, q, k, v, topk, SCALE, 4, BLOCK, COUNT,
                                           causal, Q_ENDS, KV_ENDS)
    rng = np.random.default_rng(7)
    eps = 1e-6
    for name, analytic in (("q", dq), ("k", dk), ("v", dv)):
        arrays = {"q": q, "k": k, "v": v}
        target = arrays[name]
        for _ in range(12):
            index = tuple(rng.integers(0, n) for n in target.shape)
            plus, minus = target.copy(), target.copy()
            plus[index] += eps
            minus[index] -= eps
            numeric = (loss(**{**arrays, name: plus}) - loss(**{**arrays, name: minus})) / (2 * eps)
            assert analytic[index] == pytest.approx(numeric, rel=1e-6, abs=1e-8), (name, index)


def test_keys_no_query_selects_get_no_gradient():
    q, k, v, topk = problem(seed=8)
    topk[:16] = np.array([0, 1, 2])                # sequence 0 never reads block 3
    grad = np.ones((36, 4, 6))
    _, dk, dv = ref.select_attention_grad(grad, q, k, v, topk, SCALE, 4, BLOCK, COUNT, False,
                                          Q_ENDS, KV_ENDS)
    assert not dk[12:16].any() and not dv[12:16].any()
    assert dk[:12].any() and dv[:12].any()
