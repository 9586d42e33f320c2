"""The float64 reference itself, on cases whose answers are known in closed form."""

import numpy as np

from nsa_numba import reference as ref


def test_window_starts_follow_sequences():
    # lengths 0, 128, 144 with l=32, d=16: 7 windows in the 2nd, 8 in the 3rd
    starts = ref.window_starts(272, 32, 16, [0, 128, 272])
    assert starts.tolist() == [16 * i for i in range(7)] + [128 + 16 * i for i in range(8)]
    assert ref.window_starts(272, 32, 16, [0, 128, 144], 1).tolist() == starts.tolist()
    assert ref.window_starts(10, 16, 16).size == 0


def test_all_ones_seed_example():
    # The seed's C example fills everything with 1: each output is l, each input
    # gradient counts the windows covering the token, each weight gradient is T' * D.
    T, N, D, block, stride = 272, 2, 16, 32, 16
    seq = [0, 128, 272]
    x = np.ones((T, N, D))
    w = np.ones((block, N))
    out = ref.compress(x, w, block, stride, seq)
    assert out.shape == (15, N, D) and np.all(out == block)
    dx, dw = ref.compress_grad(np.ones_like(out), x, w, block, stride, seq)
    cover = np.zeros(T)
    for s in ref.window_starts(T, block, stride, seq):
        cover[s:s + block] += 1
    assert np.array_equal(dx, np.broadcast_to(cover[:, None, None], dx.shape))
    assert np.all(dw == 15 * D)


def test_ulp_scale():
    assert ref.ulp(1.0, np.float16) == 2.0 ** -10
    assert ref.ulp(0.0, np.float16) == 2.0 ** -24          # smallest subnormal step
    assert ref.ulp(3.0, np.float32) == 2.0 ** -22
    assert ref.ulp_error(np.float16(1.0) + np.float16(2 ** -10), 1.0, np.float16) == 1.0
