"""The benchmark tooling runs: the asv suite (checked and exercised once) and ``bench``."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ASV_DIR = pathlib.Path(__file__).resolve().parent.parent / "asv_bench"
sys.path.insert(0, str(ASV_DIR))

from benchmarks import bench_compress as suite  # noqa: E402

from nsa_numba._ops import dispatch as _dispatch, pipeline as _pipeline  # noqa: E402
from nsa_numba import bench as nsa_bench  # noqa: E402


@pytest.mark.slow
def test_history_config_builds_this_commit():
    # asv.conf.json's virtualenv, build and install commands on the checked-out commit
    # (dependencies from PyPI), one benchmark once
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=ASV_DIR)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    subprocess.run([sys.executable, "-m", "asv", "machine", "--yes"], cwd=ASV_DIR,
                   capture_output=True, timeout=120)
    proc = subprocess.run([sys.executable, "-m", "asv", "run", "--quick", "--show-stderr",
                           "--bench", "InferStep", f"{head.stdout.strip()}^!"],
                          cwd=ASV_DIR, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "virtualenv-py" in proc.stdout and "InferStep.time_step" in proc.stdout
    assert "failed" not in proc.stdout, proc.stdout[-3000:]


def test_asv_check_finds_no_problems():
    proc = subprocess.run([sys.executable, "-m", "asv", "check", "--python=same"],
                          cwd=ASV_DIR, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No problems found" in proc.stdout


@pytest.mark.parametrize("cls", [suite.Forward, suite.Backward])
def test_benchmark_classes_run_once(cls):
    shape = suite.PARAMS[0][0]
    bench = cls()
    bench.setup(shape, "bf16")
    for name in dir(bench):
        if name.startswith("time_"):
            getattr(bench, name)(shape, "bf16")


@pytest.mark.slow
@pytest.mark.parametrize("cls", [suite.Throughput, suite.Memory])
def test_shared_measurement_classes_run_once(cls):
    shape = suite.PARAMS[0][0]

    class One(cls):                   # one case, two rounds
        params = [[shape], ["bf16"]]
        rounds = 2

    bench = One()
    results = bench.setup_cache()
    if hasattr(bench, "setup"):
        bench.setup(results, shape, "bf16")
    values = {name: getattr(bench, name)(results, shape, "bf16")
              for name in dir(bench) if name.startswith("track_")}
    assert values
    for name, value in values.items():
        if "x_torch" in name and not os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
            continue
        assert value >= 0 if name.endswith("added_mib") else value > 0, (name, value)


def test_infer_benchmark_runs():
    bench = suite.InferStep()
    for case in suite.InferStep.params[0][:2]:      # the small steps
        bench.setup(case, "fp16")
        bench.time_step(case, "fp16")


@pytest.mark.slow
def test_bench_infer_command(tmp_path):
    out = tmp_path / "infer.json"
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "bench", "--infer", "--dtype",
                           "fp16", "--repeat", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["infer"]
    assert [r["case"] for r in results] == ["typical step", "one sequence", "large step"]
    for r in results:
        assert r["us"] > 0 and r["gbs"] > 0
    assert results[-1]["pct_copy"] > 0 and "pct_copy" not in results[0]


def test_torch_overhead_benchmark_runs():
    with pytest.raises(NotImplementedError):      # what asv's environments without torch see
        suite.TorchOverhead().setup({})
    pytest.importorskip("torch")
    bench = suite.TorchOverhead()
    us = bench.setup_cache()
    bench.setup(us)
    for name in dir(bench):
        if name.startswith("track_"):
            value = getattr(bench, name)(us)
            assert isinstance(value, float)
            if not name.endswith("bridge_us"):
                assert value > 0


@pytest.mark.slow
def test_bench_overhead_command():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "bench", "--overhead",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for fragment in ("empty custom op", "forward, torch", "backward, NumPy",
                     "beyond the empty custom op", "to its kernel launch"):
        assert fragment in proc.stdout


def test_python_to_launch_stops_at_the_launch():
    case = nsa_bench.Case(256, 2, 32, 32, 16, 2, "bf16")
    measured, us = nsa_bench.python_to_launch(case, rounds=3)
    assert measured is case and set(us) == {"forward", "backward"}
    assert all(v > 0 for v in us.values())
    kernels = [p.kernel for p in _pipeline.prepared_calls()]
    assert kernels and all(k in _dispatch.KERNELS for k in kernels)    # put back


def test_first_call_snippet_runs():
    code = suite.FirstCall().timeraw_first_call_warm_cache()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_bench_command_small_case(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_numba", "bench", "--shape", "2048,2,64,32,16,2",
         "--dtype", "bf16", "--repeat", "2", "--no-torch", "--strided", "--split", "--json",
         str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "copy bandwidth" in proc.stdout and "backward" in proc.stdout
    assert "launch ms" in proc.stdout
    assert "[1/3]" in proc.stderr and "[3/3]" in proc.stderr      # progress
    data = json.loads(out.read_text())
    assert [r["case"]["view"] for r in data["results"]] == ["contiguous", "sliced", "strided"]
    for r in data["results"]:
        for op in ("forward", "backward"):
            assert r[op]["ms"] > 0 and r[op]["gbs"] > 0 and r[op]["pct_copy"] > 0
            assert r[op]["launch_ms"] > 0 and r[op]["launch_pct_copy"] > 0     # --split
    # the saved run as the documentation's markdown table: a row per case and op
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "bench", "--markdown", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 * len(data["results"])
    for r, fwd, bwd in zip(data["results"], rows[1::2], rows[2::2]):
        assert fwd[0] == "| " + r["label"] and fwd[1] == "forward" and bwd[1] == "backward"
        assert fwd[3] == f"{r['forward']['pct_copy']:.0f}%"
        assert bwd[3] == f"{r['backward']['pct_copy']:.0f}%"
        assert fwd[4] == f"{r['forward']['launch_pct_copy']:.0f}%"


def test_bench_read_yardstick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_numba", "bench", "--shape", "2048,2,64,32,16,2",
         "--dtype", "fp16", "--repeat", "2", "--no-torch", "--read", "--threads", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "read bandwidth" in proc.stdout
    [result] = json.loads(out.read_text())["results"]
    assert result["read_gbs"] > 0


@pytest.mark.slow
def test_bench_reads_each_cases_own_input(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_numba", "bench", "--shape", "2048,2,64,32,16,2",
         "--dtype", "bf16", "--repeat", "2", "--no-torch", "--read", "--split", "--strided",
         "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    contiguous, *views = json.loads(out.read_text())["results"]
    assert contiguous["input_read_gbs"] > 0
    assert contiguous["forward"]["pct_input_read"] > 0
    assert contiguous["forward"]["launch_pct_input_read"] > 0
    assert len(views) == 2 and all("input_read_gbs" not in r for r in views)
    table = proc.stdout.split("forward against reading its input once")[1].splitlines()
    assert table[1].startswith(contiguous["label"])
    assert table[1].split()[-2] == f"{contiguous['forward']['pct_input_read']:.0f}%"
    assert all(line.endswith("(input not C-contiguous)") for line in table[2:4])


@pytest.mark.parametrize("allocate", [False, True])
def test_bench_allocate_has_the_calls_allocate(monkeypatch, allocate):
    seen = []
    real = nsa_bench.api.nsa_compress, nsa_bench.api.nsa_compress_grad

    def forward(*args, **kw):
        seen.append(("forward", "out" in kw))
        return real[0](*args, **kw)

    def grad(*args, **kw):
        seen.append(("grad", "input_grad" in kw and "weight_grad" in kw))
        return real[1](*args, **kw)

    monkeypatch.setattr(nsa_bench.api, "nsa_compress", forward)
    monkeypatch.setattr(nsa_bench.api, "nsa_compress_grad", grad)
    case = nsa_bench.Case(2048, 2, 64, 32, 16, 2, "bf16")
    result = nsa_bench.run_case(case, 2, nsa_bench.copy_task(0), False,
                                nsa_bench.CacheFlush(1 << 20), allocate=allocate)
    assert result["forward"]["ms"] > 0 and result["backward"]["ms"] > 0
    timed = seen[1:]                  # the first forward is make_data's, to size out
    assert {op for op, _ in timed} == {"forward", "grad"}
    assert all(given is not allocate for _, given in timed)


def test_bench_allocate_command(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, NSA_NUMBA_KEEP_OUTPUTS_MB="0")
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_numba", "bench", "--shape", "2048,2,64,32,16,2",
         "--dtype", "bf16", "--repeat", "2", "--no-torch", "--allocate", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "(--allocate: the calls allocate their outputs and drop them; output pool: off)" \
        in proc.stdout
    data = json.loads(out.read_text())
    assert data["allocate"] is True and data["pool_budget"] == 0


def test_input_read_reads_every_word():
    x = np.random.default_rng(0).integers(0, 2**63, 3 * 32768 + 5, np.uint64)   # 4 chunks
    read, nbytes = nsa_bench.input_read_task(x)
    chunk = nsa_bench.harness._INPUT_READ_CHUNK // 8
    parts = [np.bitwise_xor.reduce(x[i:i + chunk]) for i in range(0, x.size, chunk)]
    assert nbytes == x.nbytes and read() == np.sum(parts, dtype=np.uint64)
    assert nsa_bench.input_read_task(x[::2]) is None


def test_bench_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "bench", "--shape", "1,2,3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "T,N,D,l,d,seqs" in proc.stderr


def test_bench_plot(tmp_path):
    out = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_numba", "bench", "--shape", "2048,2,64,32,16,2",
         "--shape", "1024,4,32,32,32,1", "--dtype", "fp16", "--repeat", "2", "--no-torch",
         "--plot", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_bench_compare_needs_a_checkout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "bench", "--compare", "main"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--compare runs in a git checkout" in proc.stderr


#: a selected-attention case small enough for a test: (lengths, N1, N2, D, Dv, l', c)
TINY_SELECT = ((64, 32), 4, 2, 192, 128, 16, 2)


def test_attention_benchmarks_run_once(monkeypatch):
    from benchmarks import bench_attention
    from nsa_numba.bench import attention, cases
    monkeypatch.setitem(cases.SELECT_CASES, "tiny", TINY_SELECT)
    bench = bench_attention.SelectedAttention()
    bench.setup("tiny", "fp16")
    bench.time_forward("tiny", "fp16")
    bench.time_backward("tiny", "fp16")
    use_torch = bool(os.environ.get("NSA_NUMBA_REQUIRE_TORCH"))
    if use_torch:
        pytest.importorskip("torch")
    result = attention.run_select_case("tiny", "fp16", 2, 100.0, use_torch, split=True)
    assert list(result["steps"]) == ["select stage", "select forward", "select_grad stage",
                                     "select_grad dq", "select_grad index",
                                     "select_grad dk dv"]
    assert all(step["s"] > 0 for step in result["steps"].values())
    assert "gflops" in result["steps"]["select_grad dq"]
    assert "select_grad dq" in attention.format_steps([result], 100.0)
    keys = cases.visible_keys(cases.select_problem(*TINY_SELECT, "fp16")[3], (64, 32), 16)
    assert result["forward_gflops"] == pytest.approx(2 * keys * 2 * 320 / result["forward_s"]
                                                     / 1e9)
    assert result["forward_pct"] == pytest.approx(result["forward_gflops"])
    assert result["backward_pct"] > 0
    if use_torch:
        assert result["forward_speedup"] > 0 and not result["backward_speedup"] <= 0
    table = attention.format_select([result])
    assert table.splitlines()[1].startswith("tiny")


def test_visible_keys_counts_what_the_mask_leaves():
    from nsa_numba.bench.cases import visible_keys
    topk = np.array([[[0, 1]], [[1, 0]], [[0, 1]]], np.int32)      # tokens 0, 1, 2; l' = 2
    # token 0 sees key 0 of block 0; token 1 keys 0-1; token 2 block 0 and key 2 of block 1
    assert visible_keys(topk, [3], 2) == 1 + 2 + 3
    assert visible_keys(topk, [3], 2, causal=False) == 12


@pytest.mark.slow
def test_bench_select_command(tmp_path):
    out = tmp_path / "select.json"
    proc = subprocess.run([sys.executable, "-m", "nsa_numba", "bench", "--select",
                           "--select-case", "small group", "--dtype", "bf16", "--repeat", "1",
                           "--no-torch", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "float32 matrix-multiply rate" in proc.stdout
    run = json.loads(out.read_text())
    assert run["matmul_gflops"] > 0
    (result,) = run["select"]
    assert result["case"] == "small group" and 0 < result["forward_pct"] < 100


#: a compressed-attention case small enough for a test: (lengths, N1, N2, D, Dv, c)
TINY_CMP = ((256, 160), 4, 2, 192, 128, 2)


def _dense_bench_once(monkeypatch, cases_name, case, asv_class, runner, op):
    """The asv class's setup and timings once on ``case`` (as "tiny"), then the bench
    runner with --split; checks the launches' names and returns (result, whether
    PyTorch ran)."""
    from benchmarks import bench_attention
    from nsa_numba.bench import attention, cases
    monkeypatch.setitem(getattr(cases, cases_name), "tiny", case)
    bench = getattr(bench_attention, asv_class)()
    bench.setup("tiny", "bf16")
    bench.time_forward("tiny", "bf16")
    bench.time_backward("tiny", "bf16")
    use_torch = bool(os.environ.get("NSA_NUMBA_REQUIRE_TORCH"))
    if use_torch:
        pytest.importorskip("torch")
    result = getattr(attention, runner)("tiny", "bf16", 2, 100.0, use_torch, split=True)
    assert list(result["steps"]) == [
        f"{op} stage", f"{op} ranges", f"{op} forward", f"{op}_grad stage",
        f"{op}_grad ranges", f"{op}_grad dq", f"{op}_grad order", f"{op}_grad dk dv"]
    return result, use_torch


def test_compressed_attention_benchmarks_run_once(monkeypatch):
    from nsa_numba.bench import attention, cases
    result, use_torch = _dense_bench_once(monkeypatch, "CMP_CASES", TINY_CMP,
                                          "CompressedAttention", "run_cmp_case",
                                          "compress_attention")
    keys = cases.cmp_visible((256, 160)) * 4
    mask = cases.cmp_mask((256, 160))
    assert keys == 4 * ((~mask[:256, :15]).sum() + (~mask[:160, :9]).sum())
    assert result["forward_gflops"] == pytest.approx(2 * keys * 320 / result["forward_s"]
                                                     / 1e9)
    assert 0 < result["forward_workspace"] < result["weights_bytes"] + (1 << 20)
    if use_torch:
        assert result["forward_speedup"] > 0 and not result["backward_speedup"] <= 0
    table = attention.format_cmp([result])
    assert table.splitlines()[1].startswith("tiny") and "ws MiB" in table


#: a fusion-attention case small enough for a test: (lengths, N1, N2, D, Dv, window)
TINY_FUSION = ((200, 120), 8, 2, 64, 32, 48)


def test_fusion_attention_benchmarks_run_once(monkeypatch):
    from nsa_numba.bench import attention, cases
    result, use_torch = _dense_bench_once(monkeypatch, "FUSION_CASES", TINY_FUSION,
                                          "FusionAttention", "run_fusion_case",
                                          "fusion_attention")
    # the window of 48 keys: min(i + 1, 48) per query position, 8 heads
    keys = 8 * sum(min(i + 1, 48) for n in (200, 120) for i in range(n))
    assert cases.fusion_visible((200, 120), 48) * 8 == keys
    assert cases.fusion_visible((5,), None) == 15
    assert result["forward_gflops"] == pytest.approx(2 * keys * 96 / result["forward_s"] / 1e9)
    assert result["backward_gflops"] == pytest.approx(2 * keys * (3 * 64 + 2 * 32)
                                                      / result["backward_s"] / 1e9)
    if use_torch:
        assert result["forward_speedup"] > 0 and not result["backward_speedup"] <= 0
    table = attention.format_fusion([result])
    assert table.splitlines()[1].startswith("tiny") and "x torch f+b" in table


def test_torch_window_baseline_computes_the_same_attention():
    torch = pytest.importorskip("torch")
    from nsa_numba import fusion_attention
    from nsa_numba.bench import cases
    import torch.nn.functional as F
    q, k, v, kw = cases.fusion_problem((100, 60), 4, 2, 32, 16, 24, "float32")
    ours = fusion_attention(q, k, v, 4, "TND", **kw)[0]
    # the baseline's band over a chunk, as bench.attention.torch_window builds it
    i, j = torch.arange(100)[:, None], torch.arange(100)[None, :]
    band = (j <= i) & (j > i - 24)
    t = [torch.from_numpy(a[:100]).transpose(0, 1)[None] for a in (q, k, v)]
    theirs = F.scaled_dot_product_attention(*t, attn_mask=band, scale=kw["scale"],
                                            enable_gqa=True)[0].transpose(0, 1)
    assert np.allclose(ours[:100], theirs.numpy(), atol=1e-5)
