"""Fixed-width float32 vectors, so a kernel can keep window sums in registers.

Numba has no vector type. :class:`F32Vector` is one: a value of a fixed number of
float32 lanes that lowers to an LLVM ``<lanes x float>``, which LLVM splits into as
many machine registers as the target needs (any LLVM target takes it). Two widths
exist: ``WIDTH`` lanes (the forward's window sums: four of the target's registers,
so 64 lanes with AVX-512, 32 with AVX2, 16 with SSE2) and ``SHORT_WIDTH`` (the
backward, whose loop holds more vectors at once). The functions
here are the only operations on them; each is a few LLVM instructions that the
kernels inline:

========================================= ========================================
``vzeros()``, ``vzeros_short()``          all lanes 0
``vload(a, i)``, ``vload_short(a, i)``    ``a[i:i + lanes]`` of a 1-D float32 array
``vstore(a, i, v)``                       the reverse (any width)
``vload_row_short(x, b, t, n, e)``        ``x[b, t, n, e:e + lanes]`` widened to
                                          float32
``vload_row_split(x, b, t, n, e)``        the same (``WIDTH`` lanes) in *split
                                          order* (below)
``vmul_add(acc, w, v)``                   ``acc + w * v`` per lane, ``w`` a float32
                                          or a vector: the product rounded to
                                          float32, then the sum, as the scalar
                                          kernels do (no fused multiply-add, which
                                          rounds once and gives other bits)
``vstore_row(out, b, t, n, e, v)``        ``out[b, t, n, e:e + lanes]`` = ``v``
                                          rounded to out's storage type
``vstore_row_split(out, b, t, n, e, v)``  the same from a vector in split order
========================================= ========================================

Split order is a lane order the storage type chooses so that converting a row takes
fewer instructions; ``vstore_row_split`` takes the lanes back to their elements, and
lane-wise arithmetic does not care where an element sits. For bfloat16 the first
half of the lanes holds the row's even elements and the second half its odd ones:
each 32-bit word of the row holds an even element in its low half and the next odd
one in its high half, so one shift and one mask widen two elements, where the
element-wise widening takes a zero-extension and a shift for each. That leaves more
of the vector ports to the products and sums (the llvm-mca cycle counts and the
timing are in docs/performance.md). Float16 and float32 rows keep their own order.

Conversions give exactly what :func:`nsa_numba._kernels.halfprec.widen` and ``narrow`` give
per element: bfloat16 as the top half of float32, rounded to nearest even with NaN
kept quiet; float16 through LLVM's ``fpext``/``fptrunc``, which are the F16C
instructions on x86 and FCVT on AArch64. Rows must be unit-stride in the storage
dtypes of :data:`STORAGE` (float16 only where the target has those instructions:
the portable float16 code stays scalar);
:func:`row_fits` says whether an array qualifies. The caller keeps every index
in range; under ``NSA_NUMBA_BOUNDSCHECK=1`` :func:`check_row` is where a kernel
checks them.
"""

import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .._core.jit import BOUNDSCHECK, jit
from . import target as _target
from .halfprec import HARDWARE_HALF

#: float32 lanes in one of the target's vector registers (4, 8 or 16)
REGISTER_LANES = _target.vector_bits() // 32
#: lanes per vector of the forward: four registers, so the sums of the two windows a
#: token can be in take 8 registers and leave the rest for the loads. On AVX2 (16
#: registers) that is 32 lanes, one 64-byte line of a 16-bit row (a whole head spilled
#: there); on AVX-512 (32 registers) 64 lanes, half the loop overhead per element
#: (docs/design.md, "Vector widths", has the measurements).
WIDTH = 4 * REGISTER_LANES
#: lanes per vector of the backward, whatever the target: its loop holds five input
#: vectors and four results, which at 32 lanes spilled from AVX2's registers; 8 lanes
#: (one AVX2 register) beat the loop LLVM vectorises from scalar code, and on AVX-512
#: wider vectors did no better (docs/design.md, "Vector widths").
SHORT_WIDTH = 8

#: storage dtypes whose rows vload_row and vstore_row convert (see _halfprec's table)
STORAGE = (np.dtype(np.int16), np.dtype(np.float32)) + (
    (np.dtype(np.uint16),) if HARDWARE_HALF else ())

_F32 = ir.FloatType()


def _vec(element, lanes):
    return ir.VectorType(element, lanes)


class F32Vector(types.Type):
    """``lanes`` float32 lanes, held as one LLVM vector value."""

    def __init__(self, lanes):
        self.lanes = lanes
        super().__init__(name=f"F32Vector{lanes}")


f32vector = F32Vector(WIDTH)
f32vector_short = F32Vector(SHORT_WIDTH)


@register_model(F32Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _vec(_F32, fe_type.lanes))


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


#: whether bfloat16 rows load in split order: the pairing of elements into words
#: assumes a little-endian target (the only kind Numba supports today)
SPLIT_BFLOAT16 = sys.byteorder == "little"
_HIGH_HALF = -(1 << 16)        # 0xFFFF0000 as a signed 32-bit constant


def _split(aryty, lanes):
    """Whether a row of ``aryty``'s dtype loads and stores in split order."""
    return SPLIT_BFLOAT16 and aryty.dtype == types.int16 and lanes % 2 == 0


def _constructors(vector_type, split):
    """(zeros, load, load_row) intrinsics that make vectors of ``vector_type``;
    load_row gives split order when ``split``."""
    lanes = vector_type.lanes
    vec = _vec(_F32, lanes)

    @intrinsic
    def zeros(typingctx):
        def codegen(context, builder, sig, args):
            return ir.Constant(vec, None)
        return vector_type(), codegen

    @intrinsic
    def load(typingctx, arr, i):
        if not (isinstance(arr, types.Array) and arr.ndim == 1
                and arr.dtype == types.float32 and _is_index(i)):
            return None

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1:],
                                   args[1:])
            return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)
        return vector_type(arr, i), codegen

    @intrinsic
    def load_row(typingctx, x, b, t, n, e):
        if not (_is_row_array(x) and _is_index(b, t, n, e)):
            return None

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ptr = _element_pointer(context, builder, aryty, args[0], sig.args[1:], args[1:])
            if aryty.dtype == types.float32:
                return builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)
            if split and _split(aryty, lanes):            # bfloat16 pairs as words
                i32 = _vec(ir.IntType(32), lanes // 2)
                words = builder.load(builder.bitcast(ptr, i32.as_pointer()), align=2)
                even = builder.shl(words, _splat(16, i32))
                odd = builder.and_(words, _splat(_HIGH_HALF, i32))
                both = builder.shuffle_vector(even, odd, ir.Constant(
                    _vec(ir.IntType(32), lanes), list(range(lanes))))
                return builder.bitcast(both, vec)
            i16 = _vec(ir.IntType(16), lanes)
            bits = builder.load(builder.bitcast(ptr, i16.as_pointer()), align=2)
            if aryty.dtype == types.uint16:              # float16
                return builder.fpext(builder.bitcast(bits, _vec(ir.HalfType(), lanes)), vec)
            i32 = _vec(ir.IntType(32), lanes)
            wide = builder.shl(builder.zext(bits, i32), _splat(16, i32))   # bfloat16
            return builder.bitcast(wide, vec)
        return vector_type(x, b, t, n, e), codegen

    return zeros, load, load_row


vzeros, vload, vload_row_split = _constructors(f32vector, split=True)
vzeros_short, vload_short, vload_row_short = _constructors(f32vector_short, split=False)


@intrinsic
def vstore(typingctx, arr, i, value):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32
            and _is_index(i) and isinstance(value, F32Vector)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1:2],
                               args[1:2])
        builder.store(args[2], builder.bitcast(ptr, args[2].type.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, i, value), codegen


@intrinsic
def vmul_add(typingctx, acc, w, v):
    if not (isinstance(acc, F32Vector) and v == acc and (w == types.float32 or w == acc)):
        return None

    def codegen(context, builder, sig, args):
        acc, w, v = args
        if sig.args[1] == types.float32:             # the same w in every lane
            vec = acc.type
            lane0 = builder.insert_element(ir.Constant(vec, ir.Undefined), w,
                                           ir.Constant(ir.IntType(32), 0))
            w = builder.shuffle_vector(lane0, ir.Constant(vec, ir.Undefined),
                                       ir.Constant(_vec(ir.IntType(32), vec.count), None))
        return builder.fadd(acc, builder.fmul(w, v))
    return acc(acc, w, v), codegen


def _row_storer(split):
    """The intrinsic that rounds a vector into a row; from split order when ``split``."""

    @intrinsic
    def store_row(typingctx, out, b, t, n, e, value):
        if not (_is_row_array(out) and _is_index(b, t, n, e)
                and isinstance(value, F32Vector)):
            return None

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ptr = _element_pointer(context, builder, aryty, args[0], sig.args[1:5],
                                   args[1:5])
            value = args[5]
            lanes = value.type.count
            if aryty.dtype == types.float32:
                builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=4)
                return context.get_dummy_value()
            i16 = _vec(ir.IntType(16), lanes)
            if aryty.dtype == types.uint16:              # float16, round to nearest even
                bits = builder.bitcast(builder.fptrunc(value, _vec(ir.HalfType(), lanes)),
                                       i16)
                builder.store(bits, builder.bitcast(ptr, i16.as_pointer()), align=2)
                return context.get_dummy_value()
            # bfloat16: as _halfprec.f32_to_bf16
            i32 = _vec(ir.IntType(32), lanes)
            f = builder.bitcast(value, i32)
            high = builder.lshr(f, _splat(16, i32))
            biased = builder.add(builder.add(f, _splat(0x7FFF, i32)),
                                 builder.and_(high, _splat(1, i32)))
            # NaN: the compare of a value with itself, one instruction where the bit
            # test (magnitude bits above infinity's) takes three
            nan = builder.fcmp_unordered("uno", value, value)
            quiet = builder.or_(high, _splat(0x0040, i32))
            rounded = builder.select(nan, quiet, builder.lshr(biased, _splat(16, i32)))
            if split and _split(aryty, lanes):           # even and odd halves into words
                half = _vec(ir.IntType(32), lanes // 2)
                even = builder.shuffle_vector(rounded, rounded, ir.Constant(
                    half, list(range(lanes // 2))))
                odd = builder.shuffle_vector(rounded, rounded, ir.Constant(
                    half, list(range(lanes // 2, lanes))))
                words = builder.or_(even, builder.shl(odd, _splat(16, half)))
                builder.store(words, builder.bitcast(ptr, half.as_pointer()), align=2)
            else:
                builder.store(builder.trunc(rounded, i16),
                              builder.bitcast(ptr, i16.as_pointer()), align=2)
            return context.get_dummy_value()
        return types.none(out, b, t, n, e, value), codegen
    return store_row


vstore_row = _row_storer(split=False)
vstore_row_split = _row_storer(split=True)


@jit
def check_row(arr, b, t, n, e, lanes=WIDTH):
    """In the bounds-checked build, index the first and last element of the row a
    vector operation on ``arr[b, t, n, e:e + lanes]`` will touch, so an index out of
    range raises IndexError; in the normal build, nothing. Returns a value so the
    reads are not dropped as dead code."""
    if BOUNDSCHECK:
        return arr[b, t, n, e] == arr[b, t, n, e + lanes - 1]
    return True


@jit
def check_span(arr, i, lanes=WIDTH):
    """``check_row`` for ``vload``/``vstore`` on ``arr[i:i + lanes]`` (1-D)."""
    if BOUNDSCHECK:
        return arr[i] == arr[i + lanes - 1]
    return True
