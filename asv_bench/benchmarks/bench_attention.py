"""asv benchmarks of selected, compressed and fusion (window) attention, forward and
gradient, on ``python -m nsa_numba bench --select``'s, ``--compress-attention``'s and
``--fusion-attention``'s cases.

``time_`` methods time one call with its outputs given; ``track_`` figures (the % of
the float32 matrix-multiply rate measured in the same run, and the speed-up over the
PyTorch implementation) come from one measurement per case in ``setup_cache``: ratios
are what to track on a shared machine, whose absolute rates drift with its load.
"""

import numpy as np

from nsa_numba import (fusion_attention, fusion_attention_grad, nsa_compress_attention,
                       nsa_compress_attention_grad, nsa_select_attention,
                       nsa_select_attention_grad)
from nsa_numba.bench import attention, cases

PARAMS = [list(cases.SELECT_CASES), ["bf16", "fp16"]]
PARAM_NAMES = ["case", "dtype"]


class SelectedAttention:
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 600

    def setup(self, case, dtype):
        lengths, N1, N2, D, Dv, block, count = cases.SELECT_CASES[case]
        q, k, v, topk, scale, ends = cases.select_problem(lengths, N1, N2, D, Dv, block,
                                                          count, dtype)
        self.args = (q, k, v, topk, scale, N1, block, count)
        self.kw = dict(atten_mask=np.ones(1), actual_seq_qlen=ends, actual_seq_kvlen=ends)
        self.out = nsa_select_attention(*self.args, **self.kw)     # compiles outside timing
        self.grad = np.ones_like(self.out[0])
        self.given = [np.empty_like(a) for a in (q, k, v)]
        self.time_backward(case, dtype)

    def time_forward(self, case, dtype):
        nsa_select_attention(*self.args, attention_out=self.out[0], softmax_max=self.out[1],
                             softmax_sum=self.out[2], **self.kw)

    def time_backward(self, case, dtype):
        q, k, v, topk, *rest = self.args
        nsa_select_attention_grad(self.grad, q, k, v, *self.out, topk, *rest, dq=self.given[0],
                                  dk=self.given[1], dv=self.given[2], **self.kw)


class SelectedAttentionRates:
    """% of the float32 matrix-multiply rate and speed-up over PyTorch, per case."""
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 3600

    run = staticmethod(attention.run_select_case)

    def setup_cache(self):
        try:
            import torch  # noqa: F401
            use_torch = True
        except ImportError:
            use_torch = False
        import numba
        rate, _ = attention.matmul_rate(numba.get_num_threads())
        return {(case, dtype): self.run(case, dtype, 3, rate, use_torch)
                for case in self.params[0] for dtype in self.params[1]}

    def track_forward_pct_of_matmul(self, results, case, dtype):
        return results[case, dtype].get("forward_pct", float("nan"))

    def track_backward_pct_of_matmul(self, results, case, dtype):
        return results[case, dtype].get("backward_pct", float("nan"))

    def track_forward_x_torch(self, results, case, dtype):
        return results[case, dtype].get("forward_speedup", float("nan"))

    def track_backward_x_torch(self, results, case, dtype):
        return results[case, dtype].get("backward_speedup", float("nan"))

    track_forward_pct_of_matmul.unit = track_backward_pct_of_matmul.unit = "%"
    track_forward_x_torch.unit = track_backward_x_torch.unit = "x"


CMP_PARAMS = [list(cases.CMP_CASES), ["bf16", "fp16"]]


class CompressedAttention:
    """Compressed attention with its top-k (``bench --compress-attention``'s cases),
    and its gradient, outputs given."""
    params = CMP_PARAMS
    param_names = PARAM_NAMES
    timeout = 600

    def setup(self, case, dtype):
        lengths, N1, N2, D, Dv, count = cases.CMP_CASES[case]
        q, k, v, mask, lists, scale = cases.cmp_problem(lengths, N1, N2, D, Dv, dtype)
        w = cases.CMP_WINDOW
        self.args = (q, k, v, scale, N1, w["block"], w["stride"], w["select_block"], count)
        self.kw = dict(atten_mask=mask, **lists)
        self.out = nsa_compress_attention(*self.args, **self.kw)   # compiles outside timing
        self.grad = np.ones_like(self.out[0])
        self.given = [np.empty_like(a) for a in (q, k, v)]
        self.seqs = dict(atten_mask=mask, actual_seq_qlen=lists["actual_seq_qlen"],
                         actual_cmp_seq_kvlen=lists["actual_cmp_seq_kvlen"])
        self.time_backward(case, dtype)

    def time_forward(self, case, dtype):
        nsa_compress_attention(*self.args, attention_out=self.out[0],
                               topk_indices=self.out[1], softmax_max=self.out[2],
                               softmax_sum=self.out[3], **self.kw)

    def time_backward(self, case, dtype):
        q, k, v, scale, N1 = self.args[:5]
        nsa_compress_attention_grad(self.grad, q, k, v, self.out[0], self.out[2],
                                    self.out[3], scale, N1, dq=self.given[0],
                                    dk=self.given[1], dv=self.given[2], **self.seqs)


class CompressedAttentionRates(SelectedAttentionRates):
    """% of the float32 matrix-multiply rate and speed-up over PyTorch, per case."""
    params = CMP_PARAMS
    run = staticmethod(attention.run_cmp_case)


FUSION_PARAMS = [list(cases.FUSION_CASES), ["bf16", "fp16"]]


class FusionAttention:
    """Fusion attention (``bench --fusion-attention``'s cases: the NSA window branch and
    a causal case), and its gradient, outputs given."""
    params = FUSION_PARAMS
    param_names = PARAM_NAMES
    timeout = 900

    def setup(self, case, dtype):
        lengths, N1, N2, D, Dv, window = cases.FUSION_CASES[case]
        q, k, v, kw = cases.fusion_problem(lengths, N1, N2, D, Dv, window, dtype)
        self.args = (q, k, v)
        self.N1, self.kw = N1, kw
        self.out = fusion_attention(q, k, v, N1, "TND", **kw)[:3]  # compiles outside timing
        self.grad = np.ones_like(self.out[0])
        self.given = [np.empty_like(a) for a in (q, k, v)]
        self.gkw = dict(kw, scale_value=kw["scale"])
        del self.gkw["scale"]
        self.time_backward(case, dtype)

    def time_forward(self, case, dtype):
        fusion_attention(*self.args, self.N1, "TND", attention_out=self.out[0],
                         softmax_max=self.out[1], softmax_sum=self.out[2], **self.kw)

    def time_backward(self, case, dtype):
        fusion_attention_grad(*self.args, self.grad, self.N1, "TND", softmax_max=self.out[1],
                              softmax_sum=self.out[2], attention_in=self.out[0],
                              dq=self.given[0], dk=self.given[1], dv=self.given[2], **self.gkw)


class FusionAttentionRates(SelectedAttentionRates):
    """% of the float32 matrix-multiply rate and speed-up over PyTorch's
    scaled_dot_product_attention, per case."""
    params = FUSION_PARAMS
    run = staticmethod(attention.run_fusion_case)


class ManySequences:
    """A batch of a million one-token sequences (``fusion_attention`` BSND, S = 1): the
    plan is O(B) vectorised work and tables of about 100 bytes a sequence, and the call
    runs in parts of whole sequences whose staged keys take at most
    ``_dense.PART_BYTES``, so its memory does not grow with B."""
    params = [[250_000, 1_000_000]]
    param_names = ["sequences"]
    timeout = 600

    def setup(self, B):
        from nsa_numba._ops.fusion import fusion_rules
        from nsa_numba._ops.operators import FUSION_ATTENTION
        self.q = np.zeros((B, 1, 2, 16), np.float16)
        self.planner, self.rules = FUSION_ATTENTION.planner, fusion_rules("fusion_attention")
        fusion_attention(self.q[:4], self.q[:4], self.q[:4], 2, "BSND")    # compiles

    def time_plan(self, B):
        q = self.q
        self.planner(self.rules, q, q, q, 2, "BSND", None, None, None, 1.0, 1.0, 2 ** 31 - 1,
                     2 ** 31 - 1, 0, None, None, None, 0, "", None, None, None)

    def peakmem_call(self, B):
        fusion_attention(self.q, self.q, self.q, 2, "BSND")
