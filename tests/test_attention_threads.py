"""Compressed and fusion attention give the same bits on 1, 2 and 3 threads, forward and
gradient: each count in a child process of its own (``NUMBA_NUM_THREADS``, which a
process cannot raise once Numba is loaded), asserting the count the child used, on
float32 problems whose units outnumber the threads many times over (a float32 sum
grouped otherwise shows in its last bits, where a half-precision output could round
it away)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import hashlib, json
    import numba, numpy as np
    import nsa_numba

    def digest(arrays):
        return [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]
                for a in arrays]

    rng = np.random.default_rng(3)
    out = {}
    # compressed attention: two sequences (1300 and 500 tokens), the causal compressed
    # mask with a band that hides the leading keys of the longer rows, G = 4
    lengths = [1300, 500]
    cmp = [(n - 32) // 16 + 1 for n in lengths]
    q = rng.standard_normal((sum(lengths), 8, 32)).astype(np.float32)
    k, v = (rng.standard_normal((sum(cmp), 2, d)).astype(np.float32) for d in (32, 24))
    s, c = np.arange(1300)[:, None], np.arange(max(cmp))[None, :]
    mask = (c * 16 + 31 > s) | (c < (s - 31) // 16 - 40)
    seqs = dict(atten_mask=mask, actual_seq_qlen=np.cumsum(lengths).tolist(),
                actual_cmp_seq_kvlen=np.cumsum(cmp).tolist(), strict=False)
    res = nsa_numba.nsa_compress_attention(
        q, k, v, 0.2, 8, 32, 16, 64, 4,
        actual_sel_seq_kvlen=np.cumsum([-(-n // 4) for n in cmp]).tolist(), **seqs)
    g = rng.standard_normal(res[0].shape).astype(np.float32)
    grads = nsa_numba.nsa_compress_attention_grad(g, q, k, v, res[0], res[2], res[3], 0.2, 8,
                                                  **seqs)
    out["compressed"] = digest((*res, *grads))
    # fusion attention: the window branch (mode 4) over two sequences of 600 tokens
    q = rng.standard_normal((1200, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1200, 2, d)).astype(np.float32) for d in (64, 48))
    kw = dict(atten_mask=np.triu(np.ones((2048, 2048), bool), 1), sparse_mode=4,
              pre_tockens=100, next_tockens=0, actual_seq_qlen=[600, 1200],
              actual_seq_kvlen=[600, 1200])
    o, m, s_ = nsa_numba.fusion_attention(q, k, v, 8, "TND", scale=0.125, **kw)[:3]
    g = rng.standard_normal(o.shape).astype(np.float32)
    grads = nsa_numba.fusion_attention_grad(q, k, v, g, 8, "TND", softmax_max=m,
                                            softmax_sum=s_, attention_in=o,
                                            scale_value=0.125, **kw)[:3]
    out["fusion"] = digest((o, m, s_, *grads))
    from nsa_numba._core import launch as _launch
    out["threads"] = _launch.count()
    out["helpers"] = _launch.helpers_started()
    print(json.dumps(out))
""")


def _digests(threads):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), NSA_NUMBA_QUIET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("threads") == threads
    assert result.pop("helpers") == threads - 1       # every thread was there to take units
    return result


@pytest.mark.slow
def test_compressed_and_fusion_attention_same_bits_on_one_two_and_three_threads():
    one, two, three = (_digests(n) for n in (1, 2, 3))
    for op in ("compressed", "fusion"):
        assert one[op] == two[op] == three[op], (op, one[op], two[op], three[op])
