"""Sixteen float32 lanes as one value, for the attention kernels' register tiles.

The attention kernels (``_kernels.attention``) multiply small matrices: four query heads (or
four keys) by 64 or 16 consecutive lanes, over a depth of up to a few thousand. Their
tiles keep 16 sums of 16 lanes each in registers (an AVX-512 target's 32 registers
hold them with room for the operands; a narrower target splits each value into two
or four registers, which LLVM does on its own). The operations, each a few LLVM
instructions:

=================================== ================================================
``lzeros()``, ``lsplat(x)``          all lanes 0, all lanes ``x``
``lload(a, i)``, ``lstore(a, i, v)`` ``a[i:i + 16]`` of a 1-D float32 array
``lload_wide(a, i)``                 the same of float32 or 16-bit storage, widened
``lstore_narrow(a, i, v)``           ``v`` rounded to ``a``'s float32, bfloat16
                                     (int16) or float16 (uint16) storage
``lload_wide_at(a, t, s, h, e)``,    the same for ``a[t, h, e:e + 16]`` of a 3-axis
``lstore_narrow_at(a, t, s, h,       array (``s`` unused) or ``a[t, s, h, e:e + 16]``
e, v)``                              of a 4-axis one (no view made)
``lfma(acc, w, v)``                  ``w * v + acc`` per lane, rounded once (LLVM's
                                     ``fma``: the same correctly rounded result on
                                     every CPU; a library call where there is no
                                     FMA unit). ``w`` a float32 or lanes
``ladd``, ``lsub``, ``lmul``,        per lane, each rounded as the scalar operation
``ldiv``, ``lmax``                   is (``lmax(a, b)``: ``a`` if ``a > b`` else ``b``)
``lexp(v)``                          ``exp`` per lane (below)
``lsum(v)``                          the lanes added in lane order, 0 to 15
``lmax_of(v)``                       the largest lane
=================================== ================================================

Every operation is exact IEEE arithmetic in a fixed order, so results do not depend
on how LLVM splits the values, on the thread count or on the CPU. :func:`exp32` is
the scalar twin of ``lexp`` (same operations, same bits), for tails shorter than 16.

``exp``: ``x`` is split as ``n ln 2 + r`` (``n`` the nearest integer to ``x / ln
2``, ``ln 2`` in two parts, so ``r`` is exact to float32 rounding), ``e**r`` is a
degree-6 polynomial on ``|r| <= ln 2 / 2`` (the Cephes ``expf`` coefficients, about
1 ulp) and ``2**n`` is put into the exponent bits. Below ``-87.33`` (where ``e**x``
is under float32's smallest normal) the result is 0; above ``88.72``, infinity; NaN
stays NaN. The kernels take exponentials of ``score - max <= 0`` only, where a
flushed subnormal is below one ulp of the sum it joins.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .._core.jit import BOUNDSCHECK, jit

LANES = 16

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VEC = ir.VectorType(_F32, LANES)
_IVEC = ir.VectorType(_I32, LANES)


class Lanes(types.Type):
    """Sixteen float32 lanes, one LLVM ``<16 x float>`` value."""

    def __init__(self):
        super().__init__(name="Lanes16")


lanes = Lanes()


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _splat(builder, value):
    lane0 = builder.insert_element(ir.Constant(_VEC, ir.Undefined), value,
                                   ir.Constant(_I32, 0))
    return builder.shuffle_vector(lane0, ir.Constant(_VEC, ir.Undefined),
                                  ir.Constant(_IVEC, None))


def _const(value):
    return ir.Constant(_VEC, [float(np.float32(value))] * LANES)


def _pointer(context, builder, aryty, ary, index_type, index):
    array = context.make_array(aryty)(context, builder, ary)
    i = context.cast(builder, index, index_type, types.intp)
    ptr = cgutils.get_item_pointer(context, builder, aryty, array, [i], wraparound=False)
    return builder.bitcast(ptr, _VEC.as_pointer())


def _is_f32_vector_array(arr, i):
    return (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32
            and isinstance(i, types.Integer))


@intrinsic
def lzeros(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, None)
    return lanes(), codegen


@intrinsic
def lsplat(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, args[0])
    return lanes(x), codegen


@intrinsic
def lload(typingctx, arr, i):
    if not _is_f32_vector_array(arr, i):
        return None

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load(ptr, align=4)
    return lanes(arr, i), codegen


def _widen_from(builder, aryty, ptr):
    """16 elements of ``aryty``'s storage from ``ptr`` as float32 lanes."""
    if aryty.dtype == types.float32:
        return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)
    i16 = ir.VectorType(ir.IntType(16), LANES)
    bits = builder.load(builder.bitcast(ptr, i16.as_pointer()), align=2)
    if aryty.dtype == types.uint16:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), _VEC)
    wide = builder.shl(builder.zext(bits, _IVEC), ir.Constant(_IVEC, [16] * LANES))
    return builder.bitcast(wide, _VEC)


def _item_pointer(context, builder, sig, args, ndim):
    aryty = sig.args[0]
    array = context.make_array(aryty)(context, builder, args[0])
    index = [context.cast(builder, args[1 + d], sig.args[1 + d], types.intp)
             for d in range(ndim)]
    return cgutils.get_item_pointer(context, builder, aryty, array, index, wraparound=False)


_STORAGES = (types.float32, types.int16, types.uint16)


@intrinsic
def lload_wide(typingctx, arr, i):
    """``arr[i:i + 16]`` widened to float32 lanes, ``arr`` 1-D float32, or 16-bit
    storage: bfloat16 as int16 (the top half of a float32) or float16 as uint16 (LLVM's
    ``fpext``). Exact: the lanes hold the elements' values."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(i, types.Integer)
            and arr.dtype in _STORAGES):
        return None

    def codegen(context, builder, sig, args):
        return _widen_from(builder, sig.args[0], _item_pointer(context, builder, sig, args, 1))
    return lanes(arr, i), codegen


def _row_pointer(context, builder, sig, args):
    """The pointer to ``arr[a, h, e]`` (3 axes; ``s`` unused) or ``arr[a, s, h, e]``
    (4 axes) for arguments ``(arr, a, s, h, e, ...)``."""
    aryty = sig.args[0]
    axes = (1, 3, 4) if aryty.ndim == 3 else (1, 2, 3, 4)
    array = context.make_array(aryty)(context, builder, args[0])
    index = [context.cast(builder, args[d], sig.args[d], types.intp) for d in axes]
    return cgutils.get_item_pointer(context, builder, aryty, array, index, wraparound=False)


def _row_args(arr, index):
    return (isinstance(arr, types.Array) and arr.ndim in (3, 4) and arr.dtype in _STORAGES
            and all(isinstance(x, types.Integer) for x in index))


@intrinsic
def lload_wide_at(typingctx, arr, a, s, h, e):
    """``arr[a, h, e:e + 16]`` of a 3-axis array (``s`` unused) or ``arr[a, s, h, e:e +
    16]`` of a 4-axis one, of any layout, widened as by ``lload_wide``; the caller
    checks that the last axis is contiguous. No view is made (a view would count a
    reference on the array, an atomic operation on memory every thread shares)."""
    if not _row_args(arr, (a, s, h, e)):
        return None

    def codegen(context, builder, sig, args):
        return _widen_from(builder, sig.args[0], _row_pointer(context, builder, sig, args))
    return lanes(arr, a, s, h, e), codegen


@intrinsic
def lstore(typingctx, arr, i, value):
    if not (_is_f32_vector_array(arr, i) and value == lanes):
        return None

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        builder.store(args[2], ptr, align=4)
        return context.get_dummy_value()
    return types.none(arr, i, value), codegen


def _narrow_to(builder, aryty, ptr, v):
    """Lanes ``v`` stored at ``ptr`` rounded to ``aryty``'s storage."""
    i16 = ir.VectorType(ir.IntType(16), LANES)
    if aryty.dtype == types.float32:
        builder.store(v, builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        return
    if aryty.dtype == types.uint16:
        half = builder.fptrunc(v, ir.VectorType(ir.HalfType(), LANES))
        builder.store(builder.bitcast(half, i16), builder.bitcast(ptr, i16.as_pointer()),
                      align=2)
        return
    bits = builder.bitcast(v, _IVEC)
    c16 = ir.Constant(_IVEC, [16] * LANES)
    high = builder.lshr(bits, c16)
    odd = builder.and_(high, ir.Constant(_IVEC, [1] * LANES))
    bias = builder.add(ir.Constant(_IVEC, [0x7FFF] * LANES), odd)
    rounded = builder.lshr(builder.add(bits, bias), c16)
    magnitude = builder.and_(bits, ir.Constant(_IVEC, [0x7FFFFFFF] * LANES))
    nan = builder.icmp_unsigned(">", magnitude, ir.Constant(_IVEC, [0x7F800000] * LANES))
    quiet = builder.or_(high, ir.Constant(_IVEC, [0x0040] * LANES))
    out = builder.trunc(builder.select(nan, quiet, rounded), i16)
    builder.store(out, builder.bitcast(ptr, i16.as_pointer()), align=2)


@intrinsic
def lstore_narrow(typingctx, arr, i, value):
    """``arr[i:i + 16] = value`` rounded to the storage of 1-D ``arr``: float32 as is;
    bfloat16 (int16) to nearest even, NaN kept quiet (as ``_kernels.halfprec.f32_to_bf16``);
    float16 (uint16) by LLVM's ``fptrunc`` (nearest even: the caller uses it only
    where the CPU converts in hardware)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(i, types.Integer)
            and arr.dtype in _STORAGES and value == lanes):
        return None

    def codegen(context, builder, sig, args):
        _narrow_to(builder, sig.args[0], _item_pointer(context, builder, sig, args, 1),
                   args[2])
        return context.get_dummy_value()
    return types.none(arr, i, value), codegen


@intrinsic
def lstore_narrow_at(typingctx, arr, a, s, h, e, value):
    """``lload_wide_at``'s row ``= value`` as ``lstore_narrow`` rounds it, for an array
    of any layout whose last axis is contiguous (no view made)."""
    if not (_row_args(arr, (a, s, h, e)) and value == lanes):
        return None

    def codegen(context, builder, sig, args):
        _narrow_to(builder, sig.args[0], _row_pointer(context, builder, sig, args), args[5])
        return context.get_dummy_value()
    return types.none(arr, a, s, h, e, value), codegen


@intrinsic
def lfma(typingctx, acc, w, v):
    if not (acc == lanes and v == lanes and (w == types.float32 or w == lanes)):
        return None

    def codegen(context, builder, sig, args):
        acc, w, v = args
        if sig.args[1] == types.float32:
            w = _splat(builder, w)
        return _fma(builder, w, v, acc)
    return lanes(acc, w, v), codegen


def _binary(build):
    @intrinsic
    def operation(typingctx, a, b):
        if not (a == lanes and (b == lanes or b == types.float32)):
            return None

        def codegen(context, builder, sig, args):
            x, y = args
            if sig.args[1] == types.float32:
                y = _splat(builder, y)
            return build(builder, x, y)
        return lanes(a, b), codegen
    return operation


ladd = _binary(lambda b, x, y: b.fadd(x, y))
lsub = _binary(lambda b, x, y: b.fsub(x, y))
lmul = _binary(lambda b, x, y: b.fmul(x, y))
ldiv = _binary(lambda b, x, y: b.fdiv(x, y))
lmax = _binary(lambda b, x, y: b.select(b.fcmp_ordered(">", x, y), x, y))


@intrinsic
def lsum(typingctx, v):
    if v != lanes:
        return None

    def codegen(context, builder, sig, args):
        total = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for i in range(1, LANES):
            total = builder.fadd(total, builder.extract_element(args[0], ir.Constant(_I32, i)))
        return total
    return types.float32(v), codegen


@intrinsic
def lmax_of(typingctx, v):
    if v != lanes:
        return None

    def codegen(context, builder, sig, args):
        best = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for i in range(1, LANES):
            x = builder.extract_element(args[0], ir.Constant(_I32, i))
            best = builder.select(builder.fcmp_ordered(">", x, best), x, best)
        return best
    return types.float32(v), codegen


#: exp's constants (float32): range limits, 1 / ln 2, ln 2 in two parts, polynomial
EXP_LOW, EXP_HIGH = -87.33654, 88.72283
LOG2E, LN2_HI, LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
            1.6666665459e-1, 5.0000001201e-1)


@intrinsic
def lexp(typingctx, v):
    if v != lanes:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        clamped = builder.select(builder.fcmp_ordered(">", x, _const(EXP_HIGH)),
                                 _const(EXP_HIGH), x)
        clamped = builder.select(builder.fcmp_ordered("<", clamped, _const(EXP_LOW)),
                                 _const(EXP_LOW), clamped)
        n = _round(builder, builder.fmul(clamped, _const(LOG2E)))
        r = _fma(builder, n, _const(-LN2_HI), clamped)
        r = _fma(builder, n, _const(-LN2_LO), r)
        p = _const(EXP_POLY[0])
        for c in EXP_POLY[1:]:
            p = _fma(builder, p, r, _const(c))
        r2 = builder.fmul(r, r)
        y = builder.fadd(_fma(builder, p, r2, r), _const(1.0))
        # 2**n as two powers of two (n up to 128 and down to -126 stay normal in
        # each); both products are exact
        whole = builder.fptosi(n, _IVEC)
        half = builder.ashr(whole, ir.Constant(_IVEC, [1] * LANES))
        for part in (half, builder.sub(whole, half)):
            bits = builder.shl(builder.add(part, ir.Constant(_IVEC, [127] * LANES)),
                               ir.Constant(_IVEC, [23] * LANES))
            y = builder.fmul(y, builder.bitcast(bits, _VEC))
        y = builder.select(builder.fcmp_ordered("<", x, _const(EXP_LOW)), _const(0.0), y)
        y = builder.select(builder.fcmp_ordered(">", x, _const(EXP_HIGH)),
                           _const(np.inf), y)
        return builder.select(builder.fcmp_unordered("uno", x, x), x, y)
    return lanes(v), codegen


def _fma(builder, a, b, c):
    """LLVM's ``fma`` on scalars or vectors (llvmlite's builder takes scalars only)."""
    t = a.type
    name = (f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType)
            else "llvm.fma.f64" if isinstance(t, ir.DoubleType) else "llvm.fma.f32")
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name)
    return builder.call(fn, [a, b, c])


def _round(builder, x):
    """Round to the nearest integer, ties to even (LLVM's ``rint``: vrndscaleps)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC]),
                                        f"llvm.rint.v{LANES}f32")
    return builder.call(fn, [x])


@jit
def exp32(x):
    """``lexp`` for one float32 (the same bits as its lane would be)."""
    return lsum_first(lexp(lsplat(x)))


@intrinsic
def lsum_first(typingctx, v):
    """Lane 0."""
    if v != lanes:
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], ir.Constant(_I32, 0))
    return types.float32(v), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` rounded once, for float32 or float64 scalars (LLVM's ``fma``)."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None

    def codegen(context, builder, sig, args):
        return _fma(builder, *args)
    return a(a, b, c), codegen


@jit
def check_lanes(arr, i, count=LANES):
    """In the bounds-checked build, index the first and last element a lane operation
    on ``arr[i:i + count]`` touches (IndexError if out of range); else nothing."""
    if BOUNDSCHECK:
        return arr[i] == arr[i + count - 1]
    return True
