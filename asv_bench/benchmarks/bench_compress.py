"""asv benchmarks of nsa_numba's forward, backward and with-cache operators.

Shapes are the reference ones of ``python -m nsa_numba bench``. Compilation is
warmed up in ``setup`` (never at import: a parallel Numba call while asv imports
the module breaks its forkserver with some threading layers). ``track_`` figures
come from one measurement per case made in ``setup_cache`` (``Throughput``,
``Memory``, ``TorchOverhead``).
"""

import numpy as np

from nsa_numba import bench, nsa_compress, nsa_compress_grad, nsa_compress_infer

SHAPES = {f"T={T},N={N},D={D},l={l},d={d},seqs={s}": (T, N, D, l, d, s)
          for T, N, D, l, d, s in bench.DEFAULT_SHAPES}
PARAMS = [list(SHAPES), ["bf16", "fp16"]]
PARAM_NAMES = ["shape", "dtype"]


class _Problem:
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 300

    def setup(self, shape, dtype):
        case = bench.Case(*SHAPES[shape], dtype=dtype)
        self.case = case
        self.x, self.w, self.g, self.out, self.seq = bench.make_data(case)
        self.dx = np.empty(self.x.shape, self.x.dtype)
        self.dw = np.empty_like(self.w)
        self.forward()          # compile (or load from the cache) outside the timing
        self.backward()
        self.backward_allocating()

    def forward(self):
        nsa_compress(self.x, self.w, self.case.block, self.case.stride,
                     actual_seq_len=self.seq, out=self.out)

    def backward(self):
        nsa_compress_grad(self.g, self.x, self.w, self.case.block, self.case.stride,
                          actual_seq_len=self.seq, input_grad=self.dx, weight_grad=self.dw)

    def backward_allocating(self):
        """The backward as autograd calls it: its outputs allocated, then dropped."""
        nsa_compress_grad(self.g, self.x, self.w, self.case.block, self.case.stride,
                          actual_seq_len=self.seq)


class Forward(_Problem):
    def time_forward(self, shape, dtype):
        self.forward()


class Backward(_Problem):
    def time_backward(self, shape, dtype):
        self.backward()

    def time_backward_allocating(self, shape, dtype):
        self.backward_allocating()


def _cases(params):
    return [(shape, dtype) for shape in params[0] for dtype in params[1]]


class Throughput:
    """GB/s, % of the copy bandwidth and speed-up over PyTorch, as ``python -m nsa_numba
    bench`` measures them: one measurement per case (``rounds`` rounds timing the copy
    and both calls in turn, caches flushed between; medians), shared by the track_
    methods, so a case's figures all come from the same rounds. Ratios to the copy of
    the same rounds are what to track across commits: absolute rates drift with the
    load on a shared machine."""
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 1800
    rounds = 11

    def setup_cache(self):
        cases = {key: bench.Case(*SHAPES[key[0]], dtype=key[1]) for key in _cases(self.params)}
        biggest = max(c.T * c.N * c.D * bench.numpy_dtype(c.dtype).itemsize
                      for c in cases.values())
        copy = bench.copy_task(2 * biggest)
        flush = bench.CacheFlush()
        try:
            import torch  # noqa: F401
            use_torch = True
        except ImportError:
            use_torch = False
        return {key: bench.run_case(case, self.rounds, copy, use_torch, flush)
                for key, case in cases.items()}

    def track_forward_pct_of_copy(self, results, shape, dtype):
        return round(results[shape, dtype]["forward"]["pct_copy"])

    def track_backward_pct_of_copy(self, results, shape, dtype):
        return round(results[shape, dtype]["backward"]["pct_copy"])

    def track_forward_gbs(self, results, shape, dtype):
        return round(results[shape, dtype]["forward"]["gbs"], 1)

    def track_backward_gbs(self, results, shape, dtype):
        return round(results[shape, dtype]["backward"]["gbs"], 1)

    def track_forward_x_torch(self, results, shape, dtype):
        """How many times faster than PyTorch's unfold + einsum (NaN without torch)."""
        return round(results[shape, dtype]["forward"].get("speedup", float("nan")), 1)

    def track_backward_x_torch(self, results, shape, dtype):
        return round(results[shape, dtype]["backward"].get("speedup", float("nan")), 1)

    track_forward_pct_of_copy.unit = track_backward_pct_of_copy.unit = "%"
    track_forward_gbs.unit = track_backward_gbs.unit = "GB/s"
    track_forward_x_torch.unit = track_backward_x_torch.unit = "x"


class Memory:
    """MiB of resident memory a call adds above what the process held before it
    (outputs given, kernels loaded; peak reset through /proc, in a new process per
    case), next to the workspace the aclnn API announces for the same call."""
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 900

    def setup_cache(self):
        return {key: bench.call_memory(bench.Case(*SHAPES[key[0]], dtype=key[1]))
                for key in _cases(self.params)}

    def setup(self, results, shape, dtype):
        if results[shape, dtype] is None:
            raise NotImplementedError("needs Linux /proc/self/clear_refs")

    def _mib(self, results, shape, dtype, op, what):
        # added memory to 0.1 MiB: resident-set figures move by a few pages between
        # runs (0 -> 0.01 MiB flagged a documentation-only commit); workspaces are exact
        digits = 1 if what == "added" else 2
        return round(results[shape, dtype][op][what] / (1 << 20), digits)

    def track_forward_added_mib(self, results, shape, dtype):
        return self._mib(results, shape, dtype, "forward", "added")

    def track_forward_workspace_mib(self, results, shape, dtype):
        return self._mib(results, shape, dtype, "forward", "workspace")

    def track_backward_added_mib(self, results, shape, dtype):
        return self._mib(results, shape, dtype, "backward", "added")

    def track_backward_workspace_mib(self, results, shape, dtype):
        return self._mib(results, shape, dtype, "backward", "workspace")

    track_forward_added_mib.unit = track_forward_workspace_mib.unit = "MiB"
    track_backward_added_mib.unit = track_backward_workspace_mib.unit = "MiB"


class InferStep:
    """One decoding step of the with-cache operator through the NumPy API
    (``python -m nsa_numba bench --infer`` has the same cases)."""
    params = [list(bench.INFER_CASES), ["bf16", "fp16"]]
    param_names = ["case", "dtype"]
    timeout = 300

    def setup(self, case, dtype):
        B, writers, N = bench.INFER_CASES[case]
        self.x, self.w, self.slots, self.table, self.lengths, self.cache = \
            bench.infer_problem(B, writers, N, dtype)
        self.time_step(case, dtype)            # compile (or load) outside the timing

    def time_step(self, case, dtype):
        win = bench.INFER_WINDOW
        nsa_compress_infer(self.x, self.w, self.slots, win["block"], win["stride"],
                           win["page"], block_table=self.table, actual_seq_len=self.lengths,
                           cache=self.cache)


class TorchOverhead:
    """Per-call microseconds of the torch functions on a tiny problem, against the NumPy
    API and an empty custom op with autograd (``python -m nsa_numba bench --overhead``:
    one measurement, shared by the track_ methods)."""
    timeout = 300

    def setup_cache(self):
        # (not None without torch: asv then calls setup without the cache argument)
        try:
            import torch  # noqa: F401
        except ImportError:
            return {}
        return bench.overhead(repeat=5, calls=500)

    def setup(self, us):
        if not us:
            raise NotImplementedError("torch is not installed")

    def track_forward_torch_us(self, us):
        return round(us["forward, torch"], 1)

    def track_forward_numpy_us(self, us):
        return round(us["forward, NumPy"], 1)

    def track_empty_custom_op_us(self, us):
        return round(us["empty custom op"], 1)

    def track_forward_bridge_us(self, us):
        """What the torch forward adds to the NumPy call beyond an empty custom op."""
        return round(us["forward, torch"] - us["forward, NumPy"] - us["empty custom op"], 1)

    def track_backward_bridge_us(self, us):
        return round(us["backward, torch"] - us["backward, NumPy"] - us["empty custom op"], 1)

    track_forward_torch_us.unit = track_forward_numpy_us.unit = "us"
    track_empty_custom_op_us.unit = "us"
    track_forward_bridge_us.unit = track_backward_bridge_us.unit = "us"


_FIRST_CALL = """
import numpy as np
import nsa_numba
x = np.ones((272, 64, 128), np.float16)
w = np.ones((32, 64), np.float16)
y = nsa_numba.nsa_compress(x, w, 32, 16, actual_seq_len=[0, 128, 272])
nsa_numba.nsa_compress_grad(y, x, w, 32, 16, actual_seq_len=[0, 128, 272])
"""


class FirstCall:
    """import + first forward + first backward in a new interpreter."""
    timeout = 300
    repeat = 3
    number = 1

    def setup_cache(self):
        import subprocess
        import sys
        subprocess.run([sys.executable, "-c", _FIRST_CALL], check=True)  # fill the cache

    def timeraw_first_call_warm_cache(self):
        return _FIRST_CALL

    def timeraw_first_call_cold_cache(self):
        return ("import os, tempfile\n"
                "os.environ['NUMBA_CACHE_DIR'] = tempfile.mkdtemp()\n" + _FIRST_CALL)
