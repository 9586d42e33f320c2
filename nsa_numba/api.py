"""The Python API, named after torch_npu / MindSpore's ``npu_nsa_compress`` and
``npu_nsa_compress_infer``."""

from ._ops import pipeline as _pipeline
from ._ops.checks import Rules
from ._ops.compress_attention import compress_attention_rules
from ._ops.fusion import NO_BOUND, fusion_rules
from ._ops.infer import infer_rules
from ._ops.operators import (
    COMPRESS,
    COMPRESS_ATTENTION,
    COMPRESS_ATTENTION_GRAD,
    COMPRESS_GRAD,
    COMPRESS_INFER,
    FUSION_ATTENTION,
    FUSION_ATTENTION_GRAD,
    SELECT,
    SELECT_GRAD,
)
from ._ops.select import select_rules

_FORWARD, _GRAD = "nsa_compress", "nsa_compress_grad"
#: one Rules object per operator and strictness: the pipeline knows calls that come
#: again by it; a ``strict`` that is not a bool gets new Rules and the full path (read
#: inline in each function: after a cache flush a helper call costs microseconds)
_RULES = {(op, strict): Rules(op, strict=strict) for op in (_FORWARD, _GRAD)
          for strict in (False, True)}
_INFER = "nsa_compress_infer"
_INFER_RULES = {strict: infer_rules(_INFER, strict=strict) for strict in (False, True)}


def nsa_compress(input, weight, compress_block_size, compress_stride, *,
                 actual_seq_len=None, actual_seq_len_type=0, layout="TND", out=None,
                 strict=True):
    """Weighted sliding-window compression of packed sequences (``aclnnNsaCompress``).

    ``out[k, n, :] = sum_j weight[j, n] * input[start(k) + j, n, :]`` over the
    windows ``k`` of every sequence, in sequence order.

    Parameters
    ----------
    input : ndarray [T, N, D] (or the ``layout``'s shape)
        float16, ml_dtypes.bfloat16, float32 or float64; any strides.
    weight : ndarray [l, N]
        same dtype as ``input``.
    compress_block_size, compress_stride : int
        window length ``l`` and step ``d``.
    actual_seq_len : None, list, tuple or 1-D integer array
        None: all of T is one sequence. Otherwise see ``actual_seq_len_type``.
    actual_seq_len_type : int
        0: cumulative ends (``[0, 128, 272]`` = lengths 0, 128, 144; last == T);
        1: one length per sequence (sum == T).
    layout : str or None
        "TND" (None means TND), or a padded layout "BSND", "BNSD", "BSH", "SBH":
        every batch row is one sequence of length S, ``actual_seq_len`` must be
        None, and the output has the input's layout with S' = (S - l) // d + 1
        windows in place of the S tokens.
    out : ndarray [T', N, D] (or the layout's shape), optional
        written in place (any strides) and returned; must not share memory with
        the inputs.
    strict : bool
        True: the NPU's documented constraints (multiples of 16, ``l >= d``, no
        empty tensors...). False: only what the maths needs.

    Returns
    -------
    ndarray [T', N, D] of ``input``'s dtype, T' = total number of windows (for a
    padded layout, that layout's shape with S' windows per row).

    Raises
    ------
    NsaError
        (a ValueError) with ``.status`` 161001 for a required array that is None,
        161002 for any other invalid argument. Nothing is written then.
    """
    rules = _RULES.get((_FORWARD, strict)) if type(strict) is bool else None
    return _pipeline.call(COMPRESS, rules or Rules(_FORWARD, strict=strict),
                          (input, weight, compress_block_size, compress_stride,
                           actual_seq_len, actual_seq_len_type, layout, out),
                          known=rules is not None)


def nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, *,
                      actual_seq_len=None, actual_seq_len_type=0, layout="TND",
                      input_grad=None, weight_grad=None, strict=True):
    """Gradients of :func:`nsa_compress` (``aclnnNsaCompressGrad``).

    ``input_grad[t, n, :] = sum over windows k covering t of
    weight[t - start(k), n] * grad[k, n, :]`` (0 for tokens no window covers);
    ``weight_grad[j, n] = sum_k dot(grad[k, n, :], input[start(k) + j, n, :])``.

    ``grad`` has the forward output's shape (``[T', N, D]`` for TND); the other
    parameters are those of :func:`nsa_compress` (strict mode requires ``l >= d``
    here too: the NPU accepts ``l == d`` in its backward). ``input_grad`` (``input``'s shape)
    and ``weight_grad`` (``[l, N]``) may be given to be written in place; they must
    not share memory with the inputs or each other.

    Returns ``(input_grad, weight_grad)`` in ``input``'s dtype. Deterministic:
    bitwise identical results for any thread count.
    """
    rules = _RULES.get((_GRAD, strict)) if type(strict) is bool else None
    return _pipeline.call(COMPRESS_GRAD, rules or Rules(_GRAD, strict=strict),
                          (grad, input, weight, compress_block_size, compress_stride,
                           actual_seq_len, actual_seq_len_type, layout, input_grad,
                           weight_grad), known=rules is not None)


def nsa_compress_infer(input, weight, slot_mapping, compress_block_size, compress_stride,
                       page_block_size, *, block_table=None, actual_seq_len, layout="TND",
                       cache, strict=True):
    """One decoding step of the compressed-KV cache (``aclnnNsaCompressWithCache``).

    Every sequence ``b`` whose length ``s = actual_seq_len[b]`` is on a window
    boundary (``s >= l`` and ``(s - l) % d == 0``) compresses its newest window::

        cache[slot_mapping[b], n, :] = sum_j weight[j, n] * x_b[s - l + j, n, :]

    Other sequences and every other cache row are left as they are; ``cache`` is
    updated in place and returned.

    Parameters
    ----------
    input : ndarray
        Paged: ``[block_num, page_block_size, N, D]`` with ``block_table``, token ``p``
        of sequence ``b`` at ``input[block_table[b, p // page_block_size],
        p % page_block_size]`` (a window may straddle pages). Packed: ``[T, N, D]``
        without one (layout TND), the sequences back to back from token 0 (their
        lengths may sum to less than T). float16, bfloat16, float32 or float64; any
        strides.
    weight : ndarray [l, N], same dtype.
    slot_mapping : 1-D integers [B] (an array of any integer dtype, list or tuple):
        the cache row of each sequence's new token; only the writers' are used.
    compress_block_size, compress_stride, page_block_size : int
        ``l``, ``d`` and the page size (``input.shape[1]`` when paged).
    block_table : 2-D integers [B, blocks_per_seq], or None for a packed input.
        Only the entries a writer reads are used (padding beyond a sequence's length
        may hold anything).
    actual_seq_len : 1-D integers [B]: each sequence's current length.
    layout : "TND" or None; ignored with a block table.
    cache : ndarray [rows, N, D], same dtype; any strides; must not share memory with
        the other arguments.
    strict : bool
        True: the NPU's limits (l, d multiples of 16, ``d <= l <= 64``, d in 16, 32,
        48, 64, page size 64 or 128, D a multiple of 16 and <= 256, N <= 64 and even
        above 50, more than ``(block_num * page - l) / d`` cache rows, no empty
        arrays, no repeated rows among the writers). False: only what the maths
        needs; a cache row given to several writers gets the last one's.

    Raises
    ------
    NsaError
        status 161001 (a required array is None), 561002 (what the NPU's tiling
        rejects) or 161002 (anything else: dtypes, shapes, lengths past the block
        table or past T, block or slot indices out of range). Nothing is written then.
    """
    rules = _INFER_RULES.get(strict) if type(strict) is bool else None
    return _pipeline.call(COMPRESS_INFER, rules or infer_rules(_INFER, strict=strict),
                          (input, weight, slot_mapping, compress_block_size, compress_stride,
                           page_block_size, block_table, actual_seq_len, 1, layout, cache))


_SELECT, _SELECT_GRAD = "nsa_select_attention", "nsa_select_attention_grad"
_SELECT_RULES = {(op, strict): select_rules(op, strict=strict)
                 for op in (_SELECT, _SELECT_GRAD) for strict in (False, True)}


def nsa_select_attention(query, key, value, topk_indices, scale_value, head_num,
                         select_block_size, select_block_count, *, atten_mask=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, attention_out=None,
                         softmax_max=None, softmax_sum=None, strict=True):
    """Selected attention (``aclnnNsaSelectedAttention``), layout TND.

    Query token ``t`` of sequence ``b``, head ``h`` attends over the blocks of
    ``select_block_size`` keys (``l'``) that ``topk_indices[t, h // G]`` lists (``G =
    N1 / N2``), each counted from the sequence's first key, in list order::

        out[t, h] = softmax(scale_value * q[t, h] . K_sel^T) V_sel

    Parameters
    ----------
    query, key, value : ndarray ``[T1, N1, D]``, ``[T2, N2, D]``, ``[T2, N2, Dv]``
        one dtype: float16, bfloat16, float32 or float64; any strides.
    topk_indices : integer ndarray ``[T1, N2, select_block_count]``
        block indices, each within its token's key sequence (whole blocks only).
    scale_value : float; head_num : int (N1)
    select_block_size, select_block_count : int (``l'``, ``c``)
    atten_mask : None or any array
        given: causal, with the mask derived from the indices (a block after the
        query's own is masked, and in its own block the keys after it); its contents
        are never read. None: nothing masked.
    actual_seq_qlen, actual_seq_kvlen : None, or prefix sums without a leading 0
        (``[128, 272]``: sequences of 128 and 144 tokens), one value per sequence,
        ending at T1 and T2. None (both): one sequence.
    attention_out, softmax_max, softmax_sum : ndarray, optional
        written in place and returned (shapes below); must not share memory with the
        inputs or each other.
    strict : bool
        True: the NPU's limits (D 192, Dv 128, ``l'`` a multiple of 16 up to 128,
        ``c <= 32``, ``N1 <= 128``, ``G <= 32``, key sequences multiples of ``l'`` and
        at least ``c * l'`` long...). False: only what the maths needs.

    Returns
    -------
    (attention_out ``[T1, N1, Dv]`` in the input dtype, softmax_max and softmax_sum
    ``[T1, N1, 8]`` float32, float64 for float64 inputs): the row maximum of the
    scaled, masked scores and ``sum exp(score - max)``, in all 8 lanes.

    Raises
    ------
    NsaError
        status 161001 for a required array that is None, 561002 for the NPU's tiling
        limits (strict), 161002 for anything else, including an index outside its
        sequence's blocks. Nothing is written then.
    """
    rules = _SELECT_RULES.get((_SELECT, strict)) if type(strict) is bool else None
    return _pipeline.call(SELECT, rules or select_rules(_SELECT, strict=strict),
                          (query, key, value, topk_indices, scale_value, head_num,
                           select_block_size, select_block_count, atten_mask,
                           actual_seq_qlen, actual_seq_kvlen, attention_out, softmax_max,
                           softmax_sum))


def nsa_select_attention_grad(grad, query, key, value, attention_out, softmax_max,
                              softmax_sum, topk_indices, scale_value, head_num,
                              select_block_size, select_block_count, *, atten_mask=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, dq=None, dk=None,
                              dv=None, strict=True):
    """Gradients of :func:`nsa_select_attention` (``aclnnNsaSelectedAttentionGrad``):
    ``(dq, dk, dv)`` for the output gradient ``grad`` ``[T1, N1, Dv]``.

    ``attention_out``, ``softmax_max`` and ``softmax_sum`` are the forward's results
    for the same arguments. The gradient is the exact gradient of the forward as
    called (masked only when ``atten_mask`` is given, as the forward is): masked
    scores pass nothing to q and k; keys no query selects get 0; a key selected
    several times gets every term. Bitwise identical for any thread count. Strict
    mode allows D 128 or 192 (Dv 128). ``dq``, ``dk``, ``dv`` may be given to be
    written in place.
    """
    rules = _SELECT_RULES.get((_SELECT_GRAD, strict)) if type(strict) is bool else None
    return _pipeline.call(SELECT_GRAD, rules or select_rules(_SELECT_GRAD, strict=strict),
                          (grad, query, key, value, attention_out, softmax_max, softmax_sum,
                           topk_indices, scale_value, head_num, select_block_size,
                           select_block_count, atten_mask, actual_seq_qlen,
                           actual_seq_kvlen, dq, dk, dv))


_CMP = "nsa_compress_attention"
_CMP_RULES = {strict: compress_attention_rules(_CMP, strict=strict) for strict in (False, True)}


def nsa_compress_attention(query, key, value, scale_value, head_num, compress_block_size,
                           compress_stride, select_block_size, select_block_count, *,
                           topk_mask=None, atten_mask=None, actual_seq_qlen=None,
                           actual_cmp_seq_kvlen=None, actual_sel_seq_kvlen=None,
                           attention_out=None, topk_indices=None, softmax_max=None,
                           softmax_sum=None, strict=True):
    """Compressed attention with top-k block selection (``aclnnNsaCompressAttention``),
    layout TND: the forward.

    Every query attends over its sequence's compressed keys and values (``key``,
    ``value``: ``npu_nsa_compress``'s outputs ``[Tc, N2, D]``, ``[Tc, N2, Dv]``), masked
    where ``atten_mask[s, k]`` is set (bool or uint8, at least ``[max Sq, max Tc]``, each
    sequence using its top-left corner); the group's attention weights then score each
    block of ``select_block_size`` raw keys through the NPU's window (docs/reference.md),
    ``topk_mask[s, b']`` forces a block, and ``topk_indices[t, j]`` lists the
    ``select_block_count`` chosen blocks: forced ones first (ascending), then the
    highest scores, ties to the lower block.

    ``actual_seq_qlen``, ``actual_cmp_seq_kvlen``, ``actual_sel_seq_kvlen``: prefix sums
    without a leading 0, all three or none (one sequence); the block counts must be
    ``ceil(Tc_b / (select_block_size / compress_stride))``.

    Returns ``(attention_out [T1, N1, Dv], topk_indices [T1, N2, c] int32, softmax_max,
    softmax_sum [T1, N1, 8])``, the statistics float32 (float64 for float64 inputs),
    token-major. ``strict``: the NPU's limits (561002) or only what the maths needs.
    Its gradient: :func:`nsa_compress_attention_grad`.
    """
    rules = _CMP_RULES.get(strict) if type(strict) is bool else None
    return _pipeline.call(COMPRESS_ATTENTION,
                          rules or compress_attention_rules(_CMP, strict=strict),
                          (query, key, value, scale_value, head_num, compress_block_size,
                           compress_stride, select_block_size, select_block_count, topk_mask,
                           atten_mask, actual_seq_qlen, actual_cmp_seq_kvlen,
                           actual_sel_seq_kvlen, attention_out, topk_indices, softmax_max,
                           softmax_sum))


_CMP_GRAD = "nsa_compress_attention_grad"
_CMP_GRAD_RULES = {strict: compress_attention_rules(_CMP_GRAD, strict=strict)
                   for strict in (False, True)}


def nsa_compress_attention_grad(grad, query, key, value, attention_out, softmax_max,
                                softmax_sum, scale_value, head_num, *, atten_mask=None,
                                actual_seq_qlen=None, actual_cmp_seq_kvlen=None, dq=None,
                                dk=None, dv=None, strict=True):
    """The gradient of :func:`nsa_compress_attention` for ``query``, ``key`` and
    ``value`` (the top-k path has none): attention over the sequence's compressed keys
    masked by ``atten_mask``, what torch_npu computes with its generic attention
    gradient (``sparse_mode`` 1).

    ``grad`` is the gradient of ``attention_out`` ``[T1, N1, Dv]``; ``attention_out``,
    ``softmax_max``, ``softmax_sum`` are the forward's outputs (P is rebuilt from the
    statistics, ``delta = sum grad * attention_out``). A row whose keys are all masked
    took equal weights: its query gets no gradient, its values ``grad / K``.

    Returns ``(dq, dk, dv)`` in the input dtype, summed in float32 (float64 for float64
    inputs) and rounded once; dk and dv are computed by the owner of each chunk of keys,
    so the result is bitwise identical for any thread count. ``strict``: the NPU's
    limits (N1 <= 256, D <= 768, Dv <= D; 561002). ``dq``, ``dk``, ``dv`` may be given
    to be written in place.
    """
    rules = _CMP_GRAD_RULES.get(strict) if type(strict) is bool else None
    return _pipeline.call(COMPRESS_ATTENTION_GRAD,
                          rules or compress_attention_rules(_CMP_GRAD, strict=strict),
                          (grad, query, key, value, attention_out, softmax_max, softmax_sum,
                           scale_value, head_num, atten_mask, actual_seq_qlen,
                           actual_cmp_seq_kvlen, dq, dk, dv))


_FUSION, _FUSION_GRAD = "fusion_attention", "fusion_attention_grad"
_FUSION_RULES = {(grad, strict): fusion_rules(_FUSION_GRAD if grad else _FUSION, grad=grad,
                                              strict=strict)
                 for grad in (False, True) for strict in (False, True)}


def fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                     atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=NO_BOUND,
                     next_tockens=NO_BOUND, inner_precise=0, prefix=None,
                     actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                     gen_mask_parallel=True, sync=False, softmax_layout="", *,
                     attention_out=None, softmax_max=None, softmax_sum=None, strict=True):
    """torch_npu's ``npu_fusion_attention`` (the NPU's generic attention) on NumPy
    arrays, for the sparse modes 0 to 4.

    ``S = scale * q k^T`` per head (query head ``h`` reads KV head ``h // (N1 / N2)``),
    masked scores replaced by -FLT_MAX, ``P = softmax(S)`` in float32, ``out = P v``
    rounded once. Which keys a query row sees: ``sparse_mode`` 0, ``atten_mask`` (True
    or 1 = masked) and the band ``i - pre_tockens <= j <= i + next_tockens``; 1, the
    mask alone; 2, causal from the top-left corner; 3, causal from the bottom-right;
    4, the band ``[i + off - pre_tockens, i + off + next_tockens]`` with ``off = Skv -
    Sq`` (the sliding window of ``w`` keys: ``pre_tockens = w - 1, next_tockens = 0``).
    Modes 2 to 4 take the 2048 x 2048 upper-triangle mask (not read); without
    ``atten_mask`` every key is visible, whatever the mode.

    ``input_layout``: "TND" (``actual_seq_qlen`` / ``actual_seq_kvlen``: prefix sums
    of the lengths, required), "BSND", "BNSD", "BSH", "SBH" (any case). ``query``,
    ``key``, ``value``: float16, bfloat16, float32 (or float64), any strides.

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels)``: the output in the query's layout with Dv; the row statistics (max
    and sum of ``exp(S - max)``, each in 8 lanes) ``[T1, N1, 8]`` for TND, ``[B, N1,
    Sq, 8]`` else, float32; an empty ``softmax_out``; 0, 0 (no dropout); ``N1 * sum Sq
    * Skv``. ``gen_mask_parallel`` and ``sync`` are accepted and have no effect. Rows
    that see no key: see docs/reference.md, "Fusion attention". ``pse``,
    ``padding_mask``, ``prefix``, ``keep_prob < 1`` and modes 5 to 8 raise
    NotImplementedError; bad input raises NsaError (``strict``: the NPU's limits
    too, 561002). Outputs may be given, to be written in place.
    """
    rules = _FUSION_RULES.get((False, strict)) if type(strict) is bool else None
    return _pipeline.call(FUSION_ATTENTION,
                          rules or fusion_rules(_FUSION, strict=strict),
                          (query, key, value, head_num, input_layout, pse, padding_mask,
                           atten_mask, scale, keep_prob, pre_tockens, next_tockens,
                           inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
                           sparse_mode, softmax_layout, attention_out, softmax_max,
                           softmax_sum))


def fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
                          padding_mask=None, atten_mask=None, softmax_max=None,
                          softmax_sum=None, softmax_in=None, attention_in=None,
                          scale_value=1.0, keep_prob=1.0, pre_tockens=NO_BOUND,
                          next_tockens=NO_BOUND, inner_precise=0, seed=0, offset=0, numels=0,
                          prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                          sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="",
                          dq=None, dk=None, dv=None, strict=True):
    """torch_npu's ``npu_fusion_attention_grad``: the gradient of
    :func:`fusion_attention` for ``query``, ``key`` and ``value`` given ``dy`` (the
    gradient of ``attention_out``), the forward's ``attention_in`` (its output),
    ``softmax_max`` and ``softmax_sum``, and the forward's other arguments.

    ``dS = P (dy v^T - delta)``, ``delta = sum dy * attention_in``, P rebuilt from the
    statistics; ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dy``, summed in
    float32 and rounded once. A row with equal weights over masked keys passes its
    values ``dy / count`` and nothing to q and k; a row without keys passes nothing.
    dk and dv are computed by the owner of each chunk of keys (no atomics): the result
    is bitwise identical for any thread count. Returns ``(dq, dk, dv, None)`` (no
    ``pse``, so no ``dpse``). ``softmax_in``, ``seed``, ``offset``, ``numels``,
    ``gen_mask_parallel`` and ``sync`` are accepted and not read.
    """
    rules = _FUSION_RULES.get((True, strict)) if type(strict) is bool else None
    return _pipeline.call(FUSION_ATTENTION_GRAD,
                          rules or fusion_rules(_FUSION_GRAD, grad=True, strict=strict),
                          (query, key, value, dy, head_num, input_layout, pse, padding_mask,
                           atten_mask, softmax_max, softmax_sum, attention_in, scale_value,
                           keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
                           actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, dq,
                           dk, dv))
