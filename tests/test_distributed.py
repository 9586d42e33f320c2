"""Data-parallel training across processes: torchrun, gloo on 127.0.0.1, two ranks."""

import os
import socket
import subprocess
import sys

import pytest

if os.environ.get("NSA_NUMBA_REQUIRE_TORCH"):
    import torch  # CI: torch must be there, these tests must run
else:
    torch = pytest.importorskip("torch")

import ddp_train  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
TIMEOUT_S = 600


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_ddp_training_matches_one_process_bitwise(tmp_path):
    # the single-process run first: it also leaves the kernels compiled in the disk
    # cache, so the ranks load them rather than write the same entries at once
    before = torch.get_num_threads()
    torch.set_num_threads(1)          # torch's own reductions as in the ranks
    try:
        expected = ddp_train.reference(RANKS)
    finally:
        torch.set_num_threads(before)
    initial = dict(ddp_train.Compress().named_parameters())
    assert not any(torch.equal(initial[k], v) for k, v in expected.items())   # it trained
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}",
               "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               os.path.join(HERE, "ddp_train.py"), str(tmp_path)]
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"torchrun did not finish in {TIMEOUT_S} s:\n{err.stderr}") from None
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RANKS)]
    for r, got in enumerate(ranks):
        assert got["world_size"] == RANKS
        # torchrun's default for several ranks, which torch follows, and so do the
        # kernels: every launch ran on one thread though it had work for more
        assert got["omp"] == "1" and got["torch_threads"] == 1
        assert len(got["launches"]) == 2 * ddp_train.STEPS
        assert all(threads == 1 for threads, _ in got["launches"]), got["launches"]
        assert any(useful > 1 for _, useful in got["launches"]), got["launches"]
        assert got["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got["params"][name], value), (r, name)
