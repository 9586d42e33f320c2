"""Fixed-width float32 vectors, so a kernel can keep window sums in registers.

Numba has no vector type. :class:`F32Vector` is one: a value of ``WIDTH`` float32
lanes that lowers to an LLVM ``<WIDTH x float>``, which LLVM splits into as many
machine registers as the target needs (for 32 lanes: two 512-bit registers with
AVX-512, four 256-bit ones with AVX2, eight with SSE; any LLVM target takes it). The functions
here are the only operations on it; each is a few LLVM instructions that the
kernels inline:

=================================== ==============================================
``vzeros()``                       all lanes 0
``vload(a, i)``                     ``a[i:i + WIDTH]`` of a 1-D float32 array
``vstore(a, i, v)``                 the reverse
``vload_row(x, b, t, n, e)``        ``x[b, t, n, e:e + WIDTH]`` widened to float32
``vmul_add(acc, w, v)``             ``acc + w * v`` per lane: the product rounded
                                    to float32, then the sum, as the scalar
                                    kernels do (no fused multiply-add, which
                                    rounds once and gives other bits)
``vstore_row(out, b, t, n, e, v)``  ``out[b, t, n, e:e + WIDTH]`` = ``v`` rounded
                                    to out's storage type
=================================== ==============================================

Conversions give exactly what :func:`nsa_numba._halfprec.widen` and ``narrow`` give
per element: bfloat16 as the top half of float32, rounded to nearest even with NaN
kept quiet; float16 through LLVM's ``fpext``/``fptrunc``, which are the F16C
instructions. Rows must be unit-stride in the storage dtypes of :data:`STORAGE`
(float16 only when the target has F16C: the portable float16 code stays scalar);
:func:`row_fits` says whether an array qualifies. The caller keeps every index
in range; under ``NSA_NUMBA_BOUNDSCHECK=1`` :func:`check_row` is where a kernel
checks them.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from ._halfprec import HAVE_F16C
from ._jit import BOUNDSCHECK, jit

#: lanes per vector: 32 float32, one 64-byte line of a 16-bit row. Two windows' sums
#: then take 8 of AVX2's 16 registers, leaving room for the loads; 128 lanes (a
#: whole head of D = 128) spill on AVX2 and measured slower than 32.
WIDTH = 32

#: storage dtypes whose rows vload_row and vstore_row convert (see _halfprec's table)
STORAGE = (np.dtype(np.int16), np.dtype(np.float32)) + (
    (np.dtype(np.uint16),) if HAVE_F16C else ())

_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, WIDTH)
_I16 = ir.VectorType(ir.IntType(16), WIDTH)
_I32 = ir.VectorType(ir.IntType(32), WIDTH)
_HALF = ir.VectorType(ir.HalfType(), WIDTH)


class F32Vector(types.Type):
    """WIDTH float32 lanes, held as one LLVM vector value."""

    def __init__(self):
        super().__init__(name=f"F32Vector{WIDTH}")


f32vector = F32Vector()


@register_model(F32Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def row_fits(arr):
    """True when ``arr`` (a 4-D storage view) has unit-stride rows that vload_row and
    vstore_row can convert."""
    return arr.ndim == 4 and arr.dtype in STORAGE and arr.strides[3] == arr.itemsize


def _splat(value, vector_type):
    return ir.Constant(vector_type, [value] * vector_type.count)


def _element_pointer(context, builder, aryty, ary_value, index_types, index_values):
    ary = context.make_array(aryty)(context, builder, ary_value)
    inds = [context.cast(builder, v, t, types.intp) for v, t in zip(index_values, index_types)]
    return cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)


def _is_index(*values):
    return all(isinstance(v, types.Integer) for v in values)


def _is_row_array(arr):
    return (isinstance(arr, types.Array) and arr.ndim == 4
            and arr.dtype in (types.int16, types.uint16, types.float32))


@intrinsic
def vzeros(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, None)
    return f32vector(), codegen


@intrinsic
def vload(typingctx, arr, i):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32
            and _is_index(i)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1:], args[1:])
        return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)
    return f32vector(arr, i), codegen


@intrinsic
def vstore(typingctx, arr, i, value):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32
            and _is_index(i) and value == f32vector):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1:2],
                               args[1:2])
        builder.store(args[2], builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, i, value), codegen


@intrinsic
def vload_row(typingctx, x, b, t, n, e):
    if not (_is_row_array(x) and _is_index(b, t, n, e)):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _element_pointer(context, builder, aryty, args[0], sig.args[1:], args[1:])
        if aryty.dtype == types.float32:
            return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        bits = builder.load(builder.bitcast(ptr, _I16.as_pointer()), align=2)
        if aryty.dtype == types.uint16:              # float16
            return builder.fpext(builder.bitcast(bits, _HALF), _VEC)
        wide = builder.shl(builder.zext(bits, _I32), _splat(16, _I32))   # bfloat16
        return builder.bitcast(wide, _VEC)
    return f32vector(x, b, t, n, e), codegen


@intrinsic
def vmul_add(typingctx, acc, w, v):
    if not (acc == f32vector and v == f32vector and w == types.float32):
        return None

    def codegen(context, builder, sig, args):
        acc, w, v = args
        lane0 = builder.insert_element(ir.Constant(_VEC, ir.Undefined), w,
                                       ir.Constant(ir.IntType(32), 0))
        ws = builder.shuffle_vector(lane0, ir.Constant(_VEC, ir.Undefined),
                                    ir.Constant(_I32, None))
        return builder.fadd(acc, builder.fmul(ws, v))
    return f32vector(acc, w, v), codegen


@intrinsic
def vstore_row(typingctx, out, b, t, n, e, value):
    if not (_is_row_array(out) and _is_index(b, t, n, e) and value == f32vector):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _element_pointer(context, builder, aryty, args[0], sig.args[1:5], args[1:5])
        value = args[5]
        if aryty.dtype == types.float32:
            builder.store(value, builder.bitcast(ptr, _VEC.as_pointer()), align=4)
            return context.get_dummy_value()
        if aryty.dtype == types.uint16:              # float16, round to nearest even
            bits = builder.bitcast(builder.fptrunc(value, _HALF), _I16)
        else:                                        # bfloat16: as _halfprec.f32_to_bf16
            f = builder.bitcast(value, _I32)
            high = builder.lshr(f, _splat(16, _I32))
            biased = builder.add(builder.add(f, _splat(0x7FFF, _I32)),
                                 builder.and_(high, _splat(1, _I32)))
            nan = builder.icmp_unsigned(">", builder.and_(f, _splat(0x7FFFFFFF, _I32)),
                                        _splat(0x7F800000, _I32))
            quiet = builder.or_(high, _splat(0x0040, _I32))
            bits = builder.trunc(builder.select(nan, quiet, builder.lshr(biased,
                                                                         _splat(16, _I32))),
                                 _I16)
        builder.store(bits, builder.bitcast(ptr, _I16.as_pointer()), align=2)
        return context.get_dummy_value()
    return types.none(out, b, t, n, e, value), codegen


@jit
def check_row(arr, b, t, n, e):
    """In the bounds-checked build, index the first and last element of the row a
    vector operation on ``arr[b, t, n, e:]`` will touch, so an index out of range
    raises IndexError; in the normal build, nothing. Returns a value so the reads
    are not dropped as dead code."""
    if BOUNDSCHECK:
        return arr[b, t, n, e] == arr[b, t, n, e + WIDTH - 1]
    return True


@jit
def check_span(arr, i):
    """``check_row`` for ``load``/``store`` on ``arr[i:i + WIDTH]`` (1-D)."""
    if BOUNDSCHECK:
        return arr[i] == arr[i + WIDTH - 1]
    return True
