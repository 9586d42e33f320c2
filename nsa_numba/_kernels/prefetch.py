"""Software prefetch: a hint to start reading memory a kernel will need soon.

It is LLVM's ``llvm.prefetch`` intrinsic, which every LLVM target accepts: a
PREFETCHT1 on x86-64, the target's own instruction elsewhere, nothing where there
is none. A prefetch never faults and changes no result.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: cache line size assumed when stepping through a row
LINE_BYTES = 64
#: how far ahead of its reads the forward's one-token kernel asks for token rows
AHEAD_BYTES = 16384
#: llvm.prefetch locality 2: keep in the outer caches (x86: PREFETCHT1)
_LOCALITY = 2


@intrinsic
def prefetch_row(typingctx, arr, b, t, offset):
    """Hint that the byte ``offset`` bytes after ``arr[b, t, 0, 0]`` will be read.

    For C-contiguous 4-D arrays only, whose ``[b, t]`` rows are contiguous; for any
    other layout it does nothing. The caller keeps ``b``, ``t`` and ``offset``
    inside the array.
    """
    if not (isinstance(arr, types.Array) and arr.ndim == 4
            and all(isinstance(v, types.Integer) for v in (b, t, offset))):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        if aryty.layout != "C":
            return context.get_dummy_value()
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = ir.Constant(ir.IntType(64), 0)
        inds = [context.cast(builder, args[1], sig.args[1], types.intp),
                context.cast(builder, args[2], sig.args[2], types.intp), zero, zero]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False)
        byte_ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        byte_ptr = builder.gep(byte_ptr, [context.cast(builder, args[3], sig.args[3],
                                                       types.intp)])
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr.type] + [ir.IntType(32)] * 3)
        # the name carries the pointer type: p0 (opaque pointers) or p0i8 (older LLVM)
        fn = cgutils.get_or_insert_function(
            builder.module, fnty, "llvm.prefetch." + byte_ptr.type.intrinsic_name)
        i32 = ir.IntType(32)
        # read (0), locality, data cache (1)
        builder.call(fn, [byte_ptr, ir.Constant(i32, 0), ir.Constant(i32, _LOCALITY),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(arr, b, t, offset), codegen
