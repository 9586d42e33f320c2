"""Variable-length sequence handling (TND): offsets, short sequences, tails, seq-len types."""

import re

import numpy as np
import pytest

import nsa_numba
from nsa_numba import reference as ref
from conftest import assert_forward_accurate, assert_grad_accurate, random_problem

L, S = 32, 16


@pytest.mark.parametrize("lengths", [
    [0, 0, 100, 0],           # empty sequences, leading and trailing
    [1, 31, 32, 33, 47, 48],  # shorter than, equal to and just past the window
    [5, 200],                 # the torch_npu grad test: a sequence with no window
    [31, 300, 1],
], ids=["empty", "window-edges", "no-window-seq", "short-ends"])
def test_short_and_empty_sequences(lengths, dtype):
    seq = np.cumsum(lengths).tolist()
    T = seq[-1]
    x, w, g = random_problem(T, 4, 32, L, S, seq, dtype)
    out = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq)
    assert_forward_accurate(out, x, w, L, S, seq)
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=seq)
    assert_grad_accurate(dx, dw, g, x, w, L, S, seq)


def test_lengths_type_equals_cumulative_type(dtype):
    lengths = [0, 130, 7, 200, 40]
    ends = np.cumsum(lengths).tolist()
    x, w, g = random_problem(ends[-1], 3, 32, L, S, ends, dtype, seed=3)
    a = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=ends, actual_seq_len_type=0)
    b = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=lengths, actual_seq_len_type=1)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    ga = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=ends)
    gb = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=np.array(lengths),
                                     actual_seq_len_type=1)
    for u, v in zip(ga, gb):
        assert np.array_equal(u.view(np.uint8), v.view(np.uint8))


def test_none_means_one_sequence(dtype):
    x, w, g = random_problem(300, 2, 16, L, S, None, dtype)
    a = nsa_numba.nsa_compress(x, w, L, S)
    b = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=[300])
    c = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=(0, 300))
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert np.array_equal(a.view(np.uint8), c.view(np.uint8))


@pytest.mark.parametrize("values", [
    [0, 128, 272], (0, 128, 272), [np.int32(0), 128, np.uint8(16)], [2 ** 63 - 1, -2 ** 63],
    list(range(2048)), list(np.arange(0, 4096, 2)), [np.uint64(7), np.uint32(2 ** 32 - 1)], [],
], ids=["list", "tuple", "numpy-ints", "int64-limits", "long", "long-numpy", "uint64", "empty"])
def test_sequence_values_read_lists_and_tuples_exactly(values):
    from nsa_numba._ops import seqlens as _seqlens
    got, kind = _seqlens.sequence_values("op", values, 1, 0, {"actual_seq_len": "s"})
    assert got.dtype == np.int64 and kind == 1
    assert got.tolist() == [int(v) for v in values]


@pytest.mark.parametrize("values, where", [
    ([272, True], "s[1]"), ([0, 2 ** 63], "s[1]"), ([-2 ** 63 - 1], "s[0]"), ([1, 2.0], "s[1]"),
    ([np.int64(5), True], "s[1]"), ([np.uint64(2 ** 64 - 1)], "s[0]"),
])
def test_sequence_values_name_the_value_they_reject(values, where):
    from nsa_numba._ops import seqlens as _seqlens
    with pytest.raises(nsa_numba.NsaError, match=re.escape(where)):
        _seqlens.sequence_values("op", values, 0, 0, {"actual_seq_len": "s"})


def test_uncovered_tail_gets_zero_gradient_and_is_never_read(dtype):
    # lengths 100 and 90: windows end at 96 and 80 (+100), leaving tails of 4 and 10
    seq = [100, 190]
    x, w, g = random_problem(190, 3, 16, L, S, seq, dtype)
    tails = np.r_[96:100, 180:190]
    x[tails] = np.nan  # a read would poison the results
    out = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq)
    assert not np.isnan(out.astype(np.float64)).any()
    dx, dw = nsa_numba.nsa_compress_grad(g, x, w, L, S, actual_seq_len=seq)
    assert not np.isnan(dw.astype(np.float64)).any()
    assert np.all(dx[tails].astype(np.float64) == 0)
    assert not np.signbit(dx[tails].astype(np.float64)).any()   # +0, as from a zeroed buffer
    x[tails] = 0
    assert_forward_accurate(out, x, w, L, S, seq)
    assert_grad_accurate(dx, dw, g, x, w, L, S, seq)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_propagate(bad, dtype):
    seq = [0, 64, 128]
    x, w, g = random_problem(128, 2, 16, L, S, seq, dtype)
    x[90, 1, 3] = bad          # in windows [64, 96) and [80, 112) of the 2nd sequence
    out = nsa_numba.nsa_compress(x, w, L, S, actual_seq_len=seq).astype(np.float64)
    exact = ref.compress(x, w, L, S, seq)
    hit = ~np.isfinite(exact)
    assert hit.sum() == 2      # the two windows' element (head 1, d 3), nothing else
    assert np.array_equal(np.isnan(out), np.isnan(exact))
    assert np.array_equal(out[np.isinf(exact)], exact[np.isinf(exact)])
    assert np.isfinite(out[~hit]).all()


# -- the compiled sequence tables against the NumPy steps they replace -------------

def _numpy_tables(values, seq_type, T, block, stride):
    """(offsets, lengths, counts, rows) by the NumPy functions, or the NsaError."""
    from nsa_numba._ops import seqlens as _seqlens
    try:
        offsets = _seqlens.sequence_offsets("op", values, seq_type, T, _NAMES)
    except nsa_numba.NsaError as e:
        return e
    lengths = np.diff(offsets)
    counts = _seqlens.window_counts(lengths, block, stride)
    return offsets, lengths, counts, np.concatenate(([0], np.cumsum(counts)))


_NAMES = {"actual_seq_len": "actual_seq_len", "actual_seq_len_type": "actual_seq_len_type"}
_BIG = np.iinfo(np.int64).max


def _sequence_cases():
    rng = np.random.default_rng(7)
    yield None, 0, 100
    yield [], 0, 0
    yield [0], 0, 0
    yield [_BIG, _BIG], 1, 50             # a running sum past int64
    yield [50, _BIG], 1, 50
    yield np.array([2 ** 63 + 5], np.uint64), 0, 5
    for _ in range(400):
        n = int(rng.integers(1, 7))
        lengths = rng.integers(0, 90, n)
        T = int(lengths.sum())
        seq_type = int(rng.integers(0, 2))
        values = (np.cumsum(lengths) if seq_type == 0 else lengths).tolist()
        breakage = rng.integers(0, 5)
        if breakage == 1:                 # one value off by a little, either way
            values[int(rng.integers(0, n))] += int(rng.choice([-3, -1, 1, 2]))
        elif breakage == 2:               # a negative value
            values[int(rng.integers(0, n))] = -int(rng.integers(1, 5))
        elif breakage == 3:               # T off by one
            T += int(rng.choice([-1, 1]))
        yield (np.array(values) if rng.integers(0, 2) else values), seq_type, max(T, 0)


@pytest.mark.parametrize("block,stride", [(32, 16), (16, 16), (5, 3)])
def test_compiled_sequence_tables_match_numpy(block, stride):
    from nsa_numba._ops import seqlens as _seqlens

    def tables(values, seq_type, T):
        checked = _seqlens.sequence_values("op", values, seq_type, T, _NAMES)
        return _seqlens.packed_tables("op", *checked, T, block, stride, _NAMES)

    rejected = 0
    for values, seq_type, T in _sequence_cases():
        expected = _numpy_tables(values, seq_type, T, block, stride)
        if isinstance(expected, Exception):
            rejected += 1
            with pytest.raises(nsa_numba.NsaError) as got:
                tables(values, seq_type, T)
            assert str(got.value) == str(expected) and got.value.status == expected.status
            continue
        got = tables(values, seq_type, T)
        for a, b in zip(got, expected):
            assert a.dtype == np.int64 and np.array_equal(a, b), (values, seq_type, T)
    assert 100 < rejected < 350              # both kinds of case were exercised


# -- tables kept across calls (_ops.compress._tables) ----------------------------------

def _plan(x, w, seq, seq_type=0, strict=True, op="forward"):
    from nsa_numba._ops.checks import Rules
    from nsa_numba._ops.compress import plan_forward, plan_grad
    rules = Rules("test", strict=strict)
    if op == "forward":
        return plan_forward(rules, x, w, L, S, seq, seq_type, "TND", None)
    g = np.zeros((ref.window_starts(x.shape[0], L, S, seq, seq_type).size,) + x.shape[1:],
                 x.dtype)
    return plan_grad(rules, g, x, w, L, S, seq, seq_type, "TND", None, None)


def _fresh_tables():
    from nsa_numba._ops import compress as _compress
    _compress.forget_tables()


@pytest.mark.parametrize("op", ["forward", "grad"])
def test_kept_tables_equal_fresh_ones(op):
    x = np.zeros((300, 2, 16), np.float32)
    w = np.zeros((L, 2), np.float32)
    for seq, seq_type in (([40, 41, 300], 0), ([40, 1, 259], 1), (np.array([300]), 0), (None, 0)):
        _fresh_tables()
        fresh = _plan(x, w, seq, seq_type, op=op)
        again = _plan(x, w, list(seq) if seq is not None else None, seq_type, op=op)
        assert again.tiles is fresh.tiles            # kept, not rebuilt
        _fresh_tables()
        rebuilt = _plan(x, w, seq, seq_type, op=op)
        assert rebuilt.tiles is not fresh.tiles
        assert np.array_equal(rebuilt.tiles, fresh.tiles)
        assert rebuilt.out_rows == fresh.out_rows


def test_kept_tables_depend_on_everything_they_are_built_from():
    _fresh_tables()
    x = np.zeros((300, 2, 16), np.float32)
    w = np.zeros((L, 2), np.float32)
    base = _plan(x, w, [100, 200, 300])
    # the same numbers read as lengths; another op; another N; another T
    others = [_plan(x, w, [100, 100, 100], seq_type=1), _plan(x, w, [100, 200, 300], op="grad"),
              _plan(np.zeros((300, 3, 16), np.float32), np.zeros((L, 3), np.float32),
                    [100, 200, 300]),
              _plan(np.zeros((301, 2, 16), np.float32), w, [100, 200, 301])]
    for other in others:
        assert other.tiles is not base.tiles
    assert _plan(x, w, (100, 200, 300)).tiles is base.tiles


def test_kept_tables_keep_the_checks():
    _fresh_tables()
    x = np.zeros((60, 2, 16), np.float32)
    w = np.zeros((L, 2), np.float32)
    # no sequence holds a window: allowed when not strict, and then kept...
    assert _plan(x, w, [20, 40, 60], strict=False).out_rows == 0
    # ...but a strict call with the same geometry still raises
    with pytest.raises(nsa_numba.NsaError, match="no sequence is as long"):
        _plan(x, w, [20, 40, 60])
    from nsa_numba._ops import compress as plan_module
    kept = len(plan_module._table_cache)
    for bad in ([20, 10, 60], [20, 40, 61], [-1, 60], [20.0, 60]):
        with pytest.raises(nsa_numba.NsaError):
            _plan(x, w, bad, strict=False)
    assert len(plan_module._table_cache) == kept      # rejected values are never kept


def test_kept_tables_are_bounded():
    from nsa_numba._ops import compress as plan_module
    _fresh_tables()
    x = np.zeros((400, 1, 16), np.float32)
    w = np.zeros((L, 1), np.float32)
    for end in range(plan_module.TABLE_CACHE_ENTRIES + 10):
        _plan(x, w, [end, 400])
    assert len(plan_module._table_cache) == plan_module.TABLE_CACHE_ENTRIES


def test_big_tables_are_not_kept():
    from nsa_numba._ops import compress as plan_module
    _fresh_tables()
    x = np.zeros((40000, 1, 16), np.float32)
    w = np.zeros((L, 1), np.float32)
    few = _plan(x, w, [20000, 40000])
    ends = list(range(1, 40001))                     # 40000 one-token sequences: 1.6 MB
    many = _plan(x, w, ends, strict=False)
    assert _plan(x, w, [20000, 40000]).tiles is few.tiles
    assert _plan(x, w, ends, strict=False).tiles is not many.tiles
    assert len(plan_module._table_cache) == 1
    assert plan_module._table_cache.nbytes <= plan_module.TABLE_CACHE_BYTES // 8
