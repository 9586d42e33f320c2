"""The operators, registered with the pipeline (``_ops.pipeline``).

An operator is its rules and planner (the checks and the plan: ``_ops.compress`` for the
training compress pair, ``_ops.infer`` for the with-cache operator), its kernels
(``_kernels.compress``) and their launch (``_ops.dispatch``), put together here. Adding one means
writing those, and a record below; nothing else in the call path changes
(docs/design.md, "Adding an operator").
"""

import numpy as np

from . import dispatch as _dispatch
from .compress import forward_signature, grad_signature, plan_forward, plan_grad
from .compress_attention import plan_compress_attention, plan_compress_attention_grad
from .dense import run_dense
from .fusion import numels, plan_fusion, plan_fusion_grad
from .infer import plan_infer
from .pipeline import Operator, register
from .select import plan_select, plan_select_grad, run_select

#: nsa_compress (aclnnNsaCompress): args (input, weight, block, stride,
#: actual_seq_len, actual_seq_len_type, layout, out) -> out
COMPRESS = register(Operator(
    name="forward", planner=plan_forward, launch=_dispatch.run_compress,
    results=lambda plan: plan.arrays["out"],
    signature=forward_signature, fast=_dispatch.forward_again,
    prepare=_dispatch.prepare_forward))

#: nsa_compress_grad (aclnnNsaCompressGrad): args (grad, input, weight, block,
#: stride, actual_seq_len, actual_seq_len_type, layout, input_grad, weight_grad)
#: -> (input_grad, weight_grad)
COMPRESS_GRAD = register(Operator(
    name="grad", planner=plan_grad, launch=_dispatch.run_compress,
    results=lambda plan: (plan.arrays["input_grad"], plan.arrays["weight_grad"]),
    signature=grad_signature, fast=_dispatch.grad_again, prepare=_dispatch.prepare_grad))

#: nsa_compress_infer (aclnnNsaCompressWithCache): args (input, weight,
#: slot_mapping, block, stride, page, block_table, actual_seq_len,
#: actual_seq_len_type, layout, cache) -> cache
COMPRESS_INFER = register(Operator(
    name="infer", planner=plan_infer, launch=_dispatch.run_infer,
    results=lambda plan: plan.arrays["cache"], reads_contents=True))

#: nsa_select_attention (aclnnNsaSelectedAttention): args (query, key, value,
#: topk_indices, scale_value, head_num, select_block_size, select_block_count,
#: atten_mask, actual_seq_qlen, actual_seq_kvlen, attention_out, softmax_max,
#: softmax_sum) -> (attention_out, softmax_max, softmax_sum). No prepared calls: the
#: checks read the indices' contents, which a signature cannot hold.
SELECT = register(Operator(
    name="select", planner=plan_select, launch=run_select,
    results=lambda plan: (plan.arrays["attention_out"], plan.arrays["softmax_max"],
                          plan.arrays["softmax_sum"]), reads_contents=True))

#: nsa_select_attention_grad (aclnnNsaSelectedAttentionGrad): args (grad, query, key,
#: value, attention_out, softmax_max, softmax_sum, topk_indices, scale_value, head_num,
#: select_block_size, select_block_count, atten_mask, actual_seq_qlen,
#: actual_seq_kvlen, dq, dk, dv) -> (dq, dk, dv)
SELECT_GRAD = register(Operator(
    name="select_grad", planner=plan_select_grad, launch=run_select,
    results=lambda plan: (plan.arrays["dq"], plan.arrays["dk"], plan.arrays["dv"]),
    reads_contents=True))

#: nsa_compress_attention (aclnnNsaCompressAttention), the forward with its top-k
#: blocks: args (query, key, value, scale_value, head_num, compress_block_size,
#: compress_stride, select_block_size, select_block_count, topk_mask, atten_mask,
#: actual_seq_qlen, actual_cmp_seq_kvlen, actual_sel_seq_kvlen, attention_out,
#: topk_indices, softmax_max, softmax_sum) -> (attention_out, topk_indices, softmax_max,
#: softmax_sum)
COMPRESS_ATTENTION = register(Operator(
    name="compress_attention", planner=plan_compress_attention,
    launch=run_dense,
    results=lambda plan: (plan.arrays["attention_out"], plan.arrays["topk"],
                          plan.arrays["softmax_max"], plan.arrays["softmax_sum"])))

#: nsa_compress_attention_grad (torch_npu: npu_fusion_attention_grad, sparse_mode 1):
#: args (grad, query, key, value, attention_out, softmax_max, softmax_sum, scale_value,
#: head_num, atten_mask, actual_seq_qlen, actual_cmp_seq_kvlen, dq, dk, dv) -> (dq, dk, dv)
COMPRESS_ATTENTION_GRAD = register(Operator(
    name="compress_attention_grad", planner=plan_compress_attention_grad,
    launch=run_dense,
    results=lambda plan: (plan.arrays["dq"], plan.arrays["dk"], plan.arrays["dv"])))

#: npu_fusion_attention (the NPU's generic attention, modes 0 to 4): args (query, key,
#: value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
#: pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
#: sparse_mode, softmax_layout, attention_out, softmax_max, softmax_sum) ->
#: (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)
FUSION_ATTENTION = register(Operator(
    name="fusion_attention", planner=plan_fusion, launch=run_dense,
    results=lambda plan: (plan.arrays["attention_out"], plan.arrays["softmax_max"],
                          plan.arrays["softmax_sum"], np.zeros(0, plan.dtype), 0, 0,
                          numels(plan))))

#: npu_fusion_attention_grad: args (query, key, value, dy, head_num, input_layout, pse,
#: padding_mask, atten_mask, softmax_max, softmax_sum, attention_in, scale_value,
#: keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
#: actual_seq_kvlen, sparse_mode, softmax_layout, dq, dk, dv) -> (dq, dk, dv, None)
FUSION_ATTENTION_GRAD = register(Operator(
    name="fusion_attention_grad", planner=plan_fusion_grad, launch=run_dense,
    results=lambda plan: (plan.arrays["dq"], plan.arrays["dk"], plan.arrays["dv"], None)))
