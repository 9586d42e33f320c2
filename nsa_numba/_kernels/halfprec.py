"""Per-element conversions between the 16-bit storage formats and float32.

Numba has no float16 or bfloat16 type on the CPU, so half-precision arrays enter
the kernels as integer views of their bits. The view's dtype says which format the
bits are in, so Numba's ordinary type dispatch picks the conversion at compile time:

=========== ================ =========================================
storage     format           decode / encode
=========== ================ =========================================
``uint16``  IEEE float16     conversion instructions where the target has
                             them (F16C, AArch64's FCVT), else integer
                             bit manipulation
``int16``   bfloat16         16-bit shift / round to nearest even
``float32`` float32          identity
``float64`` float64          identity
=========== ================ =========================================

Inputs read at a step of 2 or 4 elements arrive as wider words, each holding one
element and the gap after it (``_ops.layouts.word_view``): ``uint32``/``uint64`` words
hold a float16 in their low 16 bits, ``int32``/``int64`` a bfloat16, ``complex64``/
``complex128`` a float32/float64 as the real part. :func:`widen` decodes those too.

:func:`widen` turns one stored element into the accumulator type, :func:`narrow`
rounds an accumulator value into the storage type of a given array. LLVM inlines
both into the kernels' loops; no whole-array conversion pass ever runs. Integer
steps are truncated back to 32 bits as they go: Numba widens ``uint32 op uint32``
to 64 bits, which would halve the SIMD width of every conversion.

Encoding rounds to nearest, ties to even. Overflow gives infinity. NaN keeps its
sign and leading payload bits and comes out quiet, in both directions and on both
float16 paths (this is what F16C and FCVT do; the portable code matches them bit for
bit).
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .._core.jit import jit
from . import target as _target

#: the instructions float16 conversions use (``_kernels.target.half_conversions``), or None
#: for the portable code
HALF_INSTRUCTIONS = _target.half_conversions()
HARDWARE_HALF = HALF_INSTRUCTIONS is not None


# -- bit casts ---------------------------------------------------------------

@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an unsigned integer as float32.

    Numba widens ``uint32 op uint32`` to uint64, so any unsigned width is taken
    and truncated here rather than cast at every call site.
    """
    if not isinstance(bits, types.Integer) or bits.signed or bits.bitwidth < 32:
        return None

    def codegen(context, builder, sig, args):
        low = args[0]
        if bits.bitwidth > 32:
            low = builder.trunc(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """Reinterpret a float32 as uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


# -- float16 through conversion instructions ----------------------------------

@intrinsic
def f16_to_f32_hw(typingctx, bits):
    """float16 bits to float32 with LLVM's ``fpext half`` (vcvtph2ps, fcvt). Needs
    ``HARDWARE_HALF``."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16_hw(typingctx, value):
    """float32 to float16 bits with LLVM's ``fptrunc`` (vcvtps2ph, fcvt). Needs
    ``HARDWARE_HALF``."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))
    return types.uint16(types.float32), codegen


# -- float16, portable ---------------------------------------------------------

_F16_EXP_SHIFTED = np.uint32(0x7C00 << 13)   # float16 exponent field, moved to float32's place
_EXP_ADJUST = np.uint32((127 - 15) << 23)     # rebias the exponent
_F32_QUIET = np.uint32(0x00400000)
_SUBNORMAL_MAGIC = np.float32(2.0 ** -14)     # 113 << 23 as a float


@jit
def f16_to_f32_portable(bits):
    """float16 bits (uint16) to float32, exactly, with integer operations only."""
    h = np.uint32(bits)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    o = (h & np.uint32(0x7FFF)) << np.uint32(13)
    exp = o & _F16_EXP_SHIFTED
    o = o + _EXP_ADJUST
    if exp == _F16_EXP_SHIFTED:          # Inf or NaN: exponent to 255, NaN made quiet
        o = o + _EXP_ADJUST
        if o & np.uint32(0x007FFFFF):
            o = o | _F32_QUIET
    elif exp == np.uint32(0):            # zero or subnormal: renormalise in float
        o = o + np.uint32(1 << 23)
        o = bits_from_f32(f32_from_bits(o) - _SUBNORMAL_MAGIC)
    return f32_from_bits(o | sign)


_F32_INF = np.uint32(255 << 23)
_F16_OVERFLOW = np.uint32((127 + 16) << 23)            # 65536.0: rounds to inf
_F16_MIN_NORMAL = np.uint32(113 << 23)                # 2**-14
_DENORM_MAGIC = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)
_REBIAS = np.uint32((127 - 15) << 23)


@jit
def f32_to_f16_portable(value):
    """float32 to float16 bits (uint16), round to nearest even, integer operations only."""
    f = bits_from_f32(np.float32(value))
    sign = f & np.uint32(0x80000000)
    f = f ^ sign
    if f >= _F16_OVERFLOW:
        if f > _F32_INF:                     # NaN: quiet, keep the leading payload bits
            o = np.uint32(0x7E00) | ((f >> np.uint32(13)) & np.uint32(0x03FF))
        else:                                # too large, or Inf
            o = np.uint32(0x7C00)
    elif f < _F16_MIN_NORMAL:                # the float adder does the rounding
        o = bits_from_f32(f32_from_bits(f) + f32_from_bits(_DENORM_MAGIC)) - _DENORM_MAGIC
    else:
        # rebias the exponent, then round the 13 dropped bits to nearest even
        mant_odd = (f >> np.uint32(13)) & np.uint32(1)
        o = (f - _REBIAS + np.uint32(0xFFF) + mant_odd) >> np.uint32(13)
    return np.uint16((o | (sign >> np.uint32(16))) & np.uint32(0xFFFF))


# -- bfloat16 ------------------------------------------------------------------

@jit
def bf16_to_f32(bits):
    """bfloat16 bits (int16 storage) to float32: the bits are float32's top half."""
    return f32_from_bits(np.uint32(np.uint32(np.uint16(bits)) << np.uint32(16)))


@jit
def f32_to_bf16(value):
    """float32 to bfloat16 bits (int16 storage), round to nearest even, NaN kept quiet."""
    f = bits_from_f32(np.float32(value))
    high = np.uint32(f >> np.uint32(16))
    rounded = np.uint32(np.uint32(f + np.uint32(0x7FFF)) + (high & np.uint32(1)))
    if np.uint32(f & np.uint32(0x7FFFFFFF)) > _F32_INF:
        o = high | np.uint32(0x0040)
    else:
        o = np.uint32(rounded >> np.uint32(16))
    return np.int16(np.uint16(o))


# -- the two functions the kernels call ----------------------------------------

def widen(stored):
    """One stored element as its accumulator type (float32, or float64 for float64)."""
    # This body runs only under NUMBA_DISABLE_JIT; compiled code uses _widen_impl.
    if isinstance(stored, (np.uint32, np.uint64, np.int32, np.int64)):
        stored = np.array(stored).astype(np.uint16 if stored.dtype.kind == "u" else np.int16)[()]
    if isinstance(stored, (np.complex64, np.complex128)):
        return stored.real
    if isinstance(stored, np.uint16):
        return np.float32(np.array(stored).view(np.float16))
    if isinstance(stored, np.int16):
        import ml_dtypes
        return np.float32(np.array(stored).view(ml_dtypes.bfloat16))
    return stored


def narrow(value, like):
    """``value`` rounded to the storage type of array ``like``."""
    # This body runs only under NUMBA_DISABLE_JIT; compiled code uses _narrow_impl.
    if like.dtype == np.uint16:
        return np.array(np.float32(value)).astype(np.float16).view(np.uint16)[()]
    if like.dtype == np.int16:
        import ml_dtypes
        return np.array(np.float32(value)).astype(ml_dtypes.bfloat16).view(np.int16)[()]
    return like.dtype.type(value)


@overload(widen)
def _widen_impl(stored):
    if stored == types.uint16:
        if HARDWARE_HALF:
            return lambda stored: f16_to_f32_hw(stored)
        return lambda stored: f16_to_f32_portable(stored)
    if stored == types.int16:
        return lambda stored: bf16_to_f32(stored)
    if stored in (types.float32, types.float64):
        return lambda stored: stored
    # words of inputs read at a step (_layouts.word_view): the element is the low
    # half (integers: little-endian only, which word_view checks) or the real part
    if stored in (types.uint32, types.uint64):
        return lambda stored: widen(np.uint16(stored))
    if stored in (types.int32, types.int64):
        return lambda stored: widen(np.int16(stored))
    if stored in (types.complex64, types.complex128):
        return lambda stored: stored.real
    return None


@overload(narrow)
def _narrow_impl(value, like):
    kind = like.dtype
    if kind == types.uint16:
        if HARDWARE_HALF:
            return lambda value, like: f32_to_f16_hw(np.float32(value))
        return lambda value, like: f32_to_f16_portable(np.float32(value))
    if kind == types.int16:
        return lambda value, like: f32_to_bf16(np.float32(value))
    if kind == types.float32:
        return lambda value, like: np.float32(value)
    if kind == types.float64:
        return lambda value, like: np.float64(value)
    return None
