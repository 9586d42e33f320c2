"""The first run: a line on stderr while kernels compile into a cold cache, none once
it is warm or when silenced, and ``python -m nsa_numba warmup`` compiling ahead
everything a user's calls need. Each test gets its own empty kernel cache."""

import os
import subprocess
import sys

import pytest

USER_CALLS = """
import numpy as np
import nsa_numba
rng = np.random.default_rng(0)
for step in range(2):          # a training loop: the second step's calls come again
    for T, N, D, seq in [(300, 4, 128, [0, 100, 300]), (96, 2, 48, None),
                         (200, 32, 128, [0, 200])]:
        x = rng.standard_normal((T, N, D)).astype(np.float32)
        w = rng.standard_normal((32, N)).astype(np.float32)
        out = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=seq, strict=False)
        nsa_numba.nsa_compress_grad(np.ones_like(out), x, w, 32, 16, actual_seq_len=seq,
                                    strict=False)
    x = rng.standard_normal((300, 4, 256)).astype(np.float32)[..., ::2]   # every other element
    out = nsa_numba.nsa_compress(x, w[:, :4], 32, 16, actual_seq_len=[0, 300])
    nsa_numba.nsa_compress_grad(np.ones_like(out), x, w[:, :4], 32, 16,
                                actual_seq_len=[0, 300])
from nsa_numba.bench.cases import select_problem
for step in range(2):          # selected attention, a training step twice
    *arrays, scale, ends = select_problem([96, 64], 4, 2, 64, 32, 16, 3, "float32")
    kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends,
              strict=False)
    res = nsa_numba.nsa_select_attention(*arrays, scale, 4, 16, 3, **kw)
    nsa_numba.nsa_select_attention_grad(np.ones_like(res[0]), *arrays[:3], *res, arrays[3],
                                        scale, 4, 16, 3, **kw)
x = rng.standard_normal((8, 64, 2, 128)).astype(np.float32)
cache = np.zeros((40, 2, 128), np.float32)
for writers in (1, 40):
    nsa_numba.nsa_compress_infer(x, w[:, :2], np.arange(writers), 32, 16, 64,
                                 block_table=np.arange(writers).reshape(-1, 1) % 8,
                                 actual_seq_len=[64] * writers, cache=cache, strict=False)
"""

# a first training step through torch (eager), as a user writes one: keys compressed
# from a slice of a projection, attention-shaped contractions whose gradients reach the
# backward in their own memory order, a float32 loss over bfloat16 values
TORCH_STEP = """
import torch
from nsa_numba.torch import npu_nsa_compress
torch.manual_seed(0)
for dtype in (torch.bfloat16,):           # one dtype shows it; each compiles alike
    for step in range(2):
        qkv = torch.randn(200, 3, 2, 64, dtype=dtype, requires_grad=True)
        q, k = qkv[:, 0], qkv[:, 1]                      # views, as a split makes them
        w = torch.randn(32, 2, dtype=dtype, requires_grad=True)
        kc = npu_nsa_compress(k, w, 32, 16, actual_seq_len=[0, 80, 200])
        s = torch.einsum("thd,khd->htk", q, kc).float().softmax(-1)
        (s @ kc.float().transpose(0, 1)).sum().backward()
        kc2 = npu_nsa_compress(k.contiguous(), w, 32, 16, actual_seq_len=[0, 80, 200])
        torch.matmul(q.transpose(0, 1), kc2.permute(1, 2, 0)).float().square().sum().backward()
from nsa_numba.torch import npu_nsa_select_attention
from nsa_numba.bench.cases import select_problem
for step in range(2):                     # selected attention, its output projected
    *arrays, scale, ends = select_problem([32, 48], 4, 2, 192, 128, 16, 2, "float32")
    q, k, v = (torch.from_numpy(a).to(torch.bfloat16).requires_grad_() for a in arrays[:3])
    proj = torch.randn(128, 64, dtype=torch.bfloat16)
    out, _, _ = npu_nsa_select_attention(q, k, v, torch.from_numpy(arrays[3]), scale, 4, 16,
                                         2, atten_mask=torch.ones(1), actual_seq_qlen=ends,
                                         actual_seq_kvlen=ends)
    (out @ proj).float().square().sum().backward()
"""

FORWARD = """
import numpy as np
import nsa_numba
nsa_numba.nsa_compress(np.ones((64, 2, 16), np.float32), np.ones((32, 2), np.float32), 32, 16)
"""


@pytest.fixture
def cold(tmp_path):
    """Runs Python code or the CLI with an empty kernel cache of its own."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("NSA_NUMBA_QUIET", None)

    def run(*args, code=None, **extra):
        cmd = [sys.executable] + (["-c", code] if code else ["-m", "nsa_numba", *args])
        proc = subprocess.run(cmd, env=dict(env, **extra), capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr
        return proc
    return run


@pytest.mark.slow
def test_a_cold_cache_says_what_compiles_once(cold, tmp_path):
    first = cold(code=FORWARD).stderr.splitlines()
    assert first[0].startswith("nsa_numba: compiling the planning helper ")
    assert f"(once per machine, kept in {tmp_path / 'cache'}" in first[0]
    # the explanation once, and every line names what compiles
    assert all("once per machine" not in line for line in first[1:])
    assert all(line.startswith(("nsa_numba: compiling the planning helper ",
                                "nsa_numba: compiling the kernel ")) for line in first)
    assert "NSA_NUMBA_QUIET=1" in first[0] and "python -m nsa_numba warmup" in first[0]
    assert any(line.startswith("nsa_numba: compiling the kernel compress_forward")
               and line.endswith(" for float32") for line in first[1:])
    assert cold(code=FORWARD).stderr == ""              # warm: nothing


@pytest.mark.slow
def test_silenced_by_the_environment(cold):
    assert cold(code=FORWARD, NSA_NUMBA_QUIET="1").stderr == ""


@pytest.mark.slow
def test_warmup_compiles_what_calls_need(cold):
    proc = cold("warmup", "--dtype", "fp32", "--strided", "--times")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("nsa_numba warmup: fp32; cache ")
    # 8 steps on contiguous arrays, 6 on strided views
    assert [line.split()[0] for line in lines[1:15]] == [f"[{i}/14]" for i in range(1, 15)]
    assert lines[15].startswith("done in ") and lines[15].endswith(" s")
    # --times: what compiled, one row per kernel or helper variant, then the total
    assert lines[16].split() == ["compiled", "dtype", "variant", "seconds", "IR", "KiB"]
    rows = [line.split() for line in lines[17:-1]]
    backward = [r for r in rows if r[0] == "compress_backward_simd"]   # D = 2 * WIDTH
    # (work, then g, x, ...): a contraction's gradient is a variant of its own
    assert {r[2] for r in backward} >= {"CCCCCCCCCC", "CACCCCCCCC"}
    assert all(r[1] == "float32" and float(r[3]) > 0 and int(r[4]) > 0 for r in backward)
    assert lines[-1].split()[0] == "total"
    assert abs(float(lines[-1].split()[1]) - sum(float(r[3]) for r in rows)) <= 0.01 * len(rows)
    assert proc.stderr == ""
    assert cold(code=USER_CALLS).stderr == ""           # nothing left to compile
    again = cold("warmup", "--dtype", "fp32", "--times").stdout.splitlines()
    assert again[-1].startswith("nothing compiled: the kernel cache is warm")


@pytest.mark.slow
def test_warmup_covers_a_torch_training_step(cold):
    # warmup as the README says, then a first training step: nothing left to compile
    # (the backward's gradients come from contractions, in their own memory order)
    pytest.importorskip("torch")
    proc = cold("warmup", "--dtype", "bf16", "--strided")
    assert proc.stderr == ""
    step = cold(code=TORCH_STEP)
    assert step.stderr == "", step.stderr


#: what a cold ``python -m nsa_numba demo`` (one dtype, forward and backward, each
#: called twice) may compile: the planning helpers, then one forward and one backward
#: kernel, one variant each. A change that compiles more (a second variant for the
#: call that comes again, a helper compiled apart) breaks this budget; the attention
#: operators keep to the same shape: one compiled function per kernel and layout.
DEMO_BUDGET = {"the planning helper": 3, "the kernel": 2}


@pytest.mark.slow
def test_the_demo_compiles_within_its_budget(cold):
    lines = cold("demo").stderr.splitlines()
    compiled = [line.split(" ", 2)[2] for line in lines if line.startswith("nsa_numba: ")]
    counts = {kind: sum(what.startswith(kind) for what in compiled) for kind in DEMO_BUDGET}
    assert counts == DEMO_BUDGET and len(compiled) == sum(DEMO_BUDGET.values()), compiled
    kernels = [what.split()[2] for what in compiled if what.startswith("the kernel")]
    assert kernels[0] == "compress_forward" and kernels[1].startswith("compress_backward")
    # and all of it loads from the cache in the next process (a kernel Numba cannot
    # match to its cache entry, such as a closure over a compiled function, would not)
    assert "nsa_numba: compiling" not in cold("demo").stderr


#: what a first selected-attention training step (one dtype, forward and gradient)
#: may compile: the index check, then the staging, forward, dq, inverted-index and
#: owners' kernels, one variant each
SELECT_BUDGET = ["the planning helper _first_bad_index", "the kernel select_stage",
                 "the kernel select_forward", "the kernel select_grad_dq",
                 "the kernel select_owners", "the kernel select_grad_dkdv"]

SELECT_STEP = """
import numpy as np
import nsa_numba
from nsa_numba.bench.cases import select_problem
for step in range(2):
    *arrays, scale, ends = select_problem([64, 96], 8, 2, 32, 16, 16, 2, "float16", seed=step)
    kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends,
              strict=False)
    res = nsa_numba.nsa_select_attention(*arrays, scale, 8, 16, 2, **kw)
    nsa_numba.nsa_select_attention_grad(res[0], *arrays[:3], *res, arrays[3], scale, 8, 16,
                                        2, **kw)
"""


@pytest.mark.slow
def test_a_selected_attention_step_compiles_within_its_budget(cold):
    lines = cold(code=SELECT_STEP).stderr.splitlines()
    compiled = [line.split(" ", 2)[2].split(" (")[0] for line in lines
                if line.startswith("nsa_numba: ")]
    names = [what.removesuffix(" for float16") for what in compiled]
    assert names == SELECT_BUDGET, compiled
    assert "nsa_numba: compiling" not in cold(code=SELECT_STEP).stderr


#: the same for compressed attention: its staging and row ranges, the forward, then
#: the gradient's dq, the owners' ranking and the owners' kernel
CMP_BUDGET = ["the kernel dense_stage", "the kernel dense_ranges", "the kernel cmp_forward",
              "the kernel dense_grad_dq", "the planning helper chunk_work",
              "the kernel dense_grad_dkdv"]

CMP_STEP = """
import numpy as np
import nsa_numba
rng = np.random.default_rng(0)
for lengths in ([200, 120], [96, 256]):
    cmp = [(n - 32) // 16 + 1 for n in lengths]
    q = rng.standard_normal((sum(lengths), 8, 32)).astype(np.float16)
    k = rng.standard_normal((sum(cmp), 2, 32)).astype(np.float16)
    v = rng.standard_normal((sum(cmp), 2, 16)).astype(np.float16)
    mask = np.arange(max(cmp))[None, :] * 16 + 31 > np.arange(max(lengths))[:, None]
    seqs = dict(actual_seq_qlen=np.cumsum(lengths), actual_cmp_seq_kvlen=np.cumsum(cmp))
    out, _, smax, ssum = nsa_numba.nsa_compress_attention(
        q, k, v, 0.2, 8, 32, 16, 64, 1, atten_mask=mask,
        actual_sel_seq_kvlen=np.cumsum([-(-c // 4) for c in cmp]), **seqs)
    nsa_numba.nsa_compress_attention_grad(out, q, k, v, out, smax, ssum, 0.2, 8,
                                          atten_mask=mask, **seqs)
"""


#: and for the window branch (npu_fusion_attention): the dense kernels, its own forward
FUSION_BUDGET = ["the kernel dense_stage", "the kernel dense_ranges", "the kernel dense_forward",
                 "the kernel dense_grad_dq", "the planning helper chunk_work",
                 "the kernel dense_grad_dkdv"]

FUSION_STEP = """
import numpy as np
import nsa_numba
rng = np.random.default_rng(0)
triu = np.triu(np.ones((2048, 2048), bool), 1)
for lengths in ([200, 120], [96, 256]):
    q = rng.standard_normal((sum(lengths), 8, 32)).astype(np.float16)
    k = rng.standard_normal((sum(lengths), 2, 32)).astype(np.float16)
    v = rng.standard_normal((sum(lengths), 2, 16)).astype(np.float16)
    kw = dict(atten_mask=triu, sparse_mode=4, pre_tockens=63, next_tockens=0,
              actual_seq_qlen=np.cumsum(lengths), actual_seq_kvlen=np.cumsum(lengths))
    out, smax, ssum, *_ = nsa_numba.fusion_attention(q, k, v, 8, "TND", **kw)
    nsa_numba.fusion_attention_grad(q, k, v, out, 8, "TND", softmax_max=smax,
                                    softmax_sum=ssum, attention_in=out, **kw)
"""


@pytest.mark.slow
@pytest.mark.parametrize("step, budget", [(CMP_STEP, CMP_BUDGET), (FUSION_STEP, FUSION_BUDGET)],
                         ids=["compressed", "window"])
def test_a_dense_attention_step_compiles_within_its_budget(cold, step, budget):
    lines = cold(code=step).stderr.splitlines()
    compiled = [line.split(" ", 2)[2].split(" (")[0] for line in lines
                if line.startswith("nsa_numba: ")]
    names = [what.removesuffix(" for float16") for what in compiled]
    assert names == budget, compiled
    assert "nsa_numba: compiling" not in cold(code=step).stderr


WARMUP_IN_PROCESSES = """
import io, nsa_numba
out = io.StringIO()
nsa_numba.warmup(("fp32", "fp64"), ops=("decoding",), out=out, times=True, jobs=2)
print(out.getvalue())
"""


@pytest.mark.slow
def test_warmup_in_processes_compiles_each_dtype_once(cold):
    # the decoding kernels only: the processes and the merged table are what is tested
    lines = cold(code=WARMUP_IN_PROCESSES).stdout.splitlines()
    assert lines[0].endswith("; 2 processes")
    steps = [line.split() for line in lines if line.startswith("  [")]
    assert [s[1] for s in steps] == ["fp32"] * 2 + ["fp64"] * 2
    start = next(i for i, line in enumerate(lines) if line.startswith("compiled"))
    kernels = [tuple(line.split()[:3]) for line in lines[start + 1:]
               if line.startswith("compress_")]
    assert {k[0] for k in kernels} == {"compress_infer"}
    assert {k[1] for k in kernels} == {"float32", "float64"}
    assert len(kernels) == len(set(kernels)) == 2       # each compiled once, in one process
    assert "nothing compiled" in cold(code=WARMUP_IN_PROCESSES).stdout


def test_warmup_refuses_unknown_dtypes_ops_and_process_counts():
    import nsa_numba
    for kwargs, message in (({"dtypes": ("fp32", "fp8")}, "unknown dtype 'fp8'"),
                            ({"ops": ("forward", "fwd")}, "unknown op 'fwd'"),
                            ({"jobs": 0}, "jobs must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            nsa_numba.warmup(**kwargs)


def test_warmup_refuses_a_process_count_below_one():
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "warmup", "--jobs", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--jobs must be at least 1, got 0" in proc.stderr
