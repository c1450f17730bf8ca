"""Explicit 16-lane vector types and operations for the numba kernels of :mod:`.quant_kernels`.

numba does not keep accumulators of several output rows in registers, nor emit AVX512-VNNI's
``vpdpbusd``; an explicit vector type does both. ``F32x16`` is LLVM's ``<16 x float>`` (one zmm
register on AVX-512), ``I32x16`` its ``<16 x i32>``. Every float operation here is one IEEE
float32 operation per lane (``vfma``: one rounding), and nothing is fast-math, so a kernel written
with them computes exactly the operations it spells out, in that order: LLVM may neither
reassociate nor contract them. The integer ones are exact.

Array arguments are C-contiguous; offsets are in elements of the array for float32 loads
(:func:`vload`) and in bytes for the byte / int32 loads (:func:`iload64`, :func:`ibcast4`).
:func:`dpbusd` needs a CPU with AVX512-VNNI (the caller checks: ``quant.host_has_vnni``).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


class F32x16(types.Type):
    """16 float32 lanes (LLVM ``<16 x float>``)."""

    def __init__(self) -> None:
        super().__init__(name="f32x16")


class I32x16(types.Type):
    """16 int32 lanes (LLVM ``<16 x i32>``)."""

    def __init__(self) -> None:
        super().__init__(name="i32x16")


f32x16 = F32x16()
i32x16 = I32x16()
_V16 = ir.VectorType(ir.FloatType(), 16)
_VI16 = ir.VectorType(ir.IntType(32), 16)
_H16 = ir.VectorType(ir.HalfType(), 16)
_I32 = ir.IntType(32)


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V16)


@register_model(I32x16)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI16)


def _splat(builder, s, vt):
    u = builder.insert_element(ir.Constant(vt, ir.Undefined), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined), ir.Constant(_VI16, [0] * 16))


def _byte_ptr(context, builder, aty, arr, i):
    a = context.make_array(aty)(context, builder, arr)
    return builder.gep(builder.bitcast(a.data, ir.IntType(8).as_pointer()), [i])


@intrinsic
def vzero(typingctx):
    """16 float32 zeros."""
    def cg(context, builder, sig, args):
        return ir.Constant(_V16, [0.0] * 16)
    return f32x16(), cg


@intrinsic
def vload(typingctx, arr, i):
    """``arr.flat[i:i+16]`` of a C-contiguous float32 array."""
    if arr.dtype != types.float32:
        return None

    def cg(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(a.data, [args[1]])
        return builder.load(builder.bitcast(p, _V16.as_pointer()), align=4)
    return f32x16(arr, types.intp), cg


@intrinsic
def vload_h(typingctx, arr, i):
    """``arr.flat[i:i+16]`` of a C-contiguous uint16 array holding IEEE binary16 bit patterns,
    widened to float32 (LLVM ``fpext half -> float``: exact for every binary16 value, one
    ``vcvtph2ps`` with F16C/AVX-512)."""
    if arr.dtype != types.uint16:
        return None

    def cg(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(a.data, [args[1]])
        h = builder.load(builder.bitcast(p, _H16.as_pointer()), align=2)
        return builder.fpext(h, _V16)
    return f32x16(arr, types.intp), cg


@intrinsic
def vstore(typingctx, arr, i, v):
    """``arr.flat[i:i+16] = v`` of a C-contiguous float32 array."""
    def cg(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        builder.store(args[2], builder.bitcast(builder.gep(a.data, [args[1]]), _V16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, types.intp, v), cg


@intrinsic
def vstore_row(typingctx, arr, i, j, v):
    """``arr[i, j:j+16] = v`` for a 2-D float32 array whose rows may be strided (unit inner stride)."""
    def cg(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        st = cgutils.unpack_tuple(builder, a.strides)
        off = builder.add(builder.mul(args[1], st[0]), builder.mul(args[2], ir.Constant(ir.IntType(64), 4)))
        p = builder.gep(builder.bitcast(a.data, ir.IntType(8).as_pointer()), [off])
        builder.store(args[3], builder.bitcast(p, _V16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, types.intp, types.intp, v), cg


@intrinsic
def vfma(typingctx, a, b, c):
    """``fma(a, b, c)`` per lane (one rounding)."""
    def cg(context, builder, sig, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3), "llvm.fma.v16f32")
        return builder.call(f, list(args))
    return f32x16(a, b, c), cg


@intrinsic
def vfma_s(typingctx, a, s, c):
    """``fma(a, s, c)`` per lane with the float32 scalar ``s`` in every lane."""
    def cg(context, builder, sig, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3), "llvm.fma.v16f32")
        return builder.call(f, [args[0], _splat(builder, args[1], _V16), args[2]])
    return f32x16(a, types.float32, c), cg


@intrinsic
def vmul_s(typingctx, a, s):
    """``a * s`` per lane, ``s`` a float32 scalar."""
    def cg(context, builder, sig, args):
        return builder.fmul(args[0], _splat(builder, args[1], _V16))
    return f32x16(a, types.float32), cg


@intrinsic
def vadd(typingctx, a, b):
    """``a + b`` per lane."""
    def cg(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x16(a, b), cg


@intrinsic
def i2f(typingctx, v):
    """int32 lanes -> float32 (exact while |v| < 2^24)."""
    def cg(context, builder, sig, args):
        return builder.sitofp(args[0], _V16)
    return f32x16(v), cg


@intrinsic
def izero(typingctx):
    """16 int32 zeros."""
    def cg(context, builder, sig, args):
        return ir.Constant(_VI16, [0] * 16)
    return i32x16(), cg


@intrinsic
def isplat(typingctx, s):
    """The int32 scalar ``s`` in every lane."""
    def cg(context, builder, sig, args):
        return _splat(builder, builder.trunc(args[0], _I32) if sig.args[0].bitwidth > 32 else args[0], _VI16)
    return i32x16(s), cg


@intrinsic
def iload64(typingctx, arr, i):
    """The 64 bytes at byte offset ``i`` of a C-contiguous array, as 16 int32 lanes."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(builder.bitcast(p, _VI16.as_pointer()), align=1)
    return i32x16(arr, types.intp), cg


@intrinsic
def ibcast4(typingctx, arr, i):
    """The 4 bytes at byte offset ``i`` of a C-contiguous array, in every int32 lane."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        return _splat(builder, builder.load(builder.bitcast(p, _I32.as_pointer()), align=1), _VI16)
    return i32x16(arr, types.intp), cg


@intrinsic
def nib_lo(typingctx, v):
    """The low nibble of every byte (``v & 0x0F0F0F0F`` per lane)."""
    def cg(context, builder, sig, args):
        return builder.and_(args[0], ir.Constant(_VI16, [0x0F0F0F0F] * 16))
    return i32x16(v), cg


@intrinsic
def nib_hi(typingctx, v):
    """The high nibble of every byte, in the low one (``(v >> 4) & 0x0F0F0F0F`` per lane)."""
    def cg(context, builder, sig, args):
        return builder.and_(builder.lshr(args[0], ir.Constant(_VI16, [4] * 16)), ir.Constant(_VI16, [0x0F0F0F0F] * 16))
    return i32x16(v), cg


@intrinsic
def dpbusd(typingctx, acc, a, b):
    """``acc + sum_i u8(a)[4l+i] * s8(b)[4l+i]`` per int32 lane l (AVX512-VNNI ``vpdpbusd``:
    exact, no saturation)."""
    def cg(context, builder, sig, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI16, [_VI16] * 3),
                                           "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(f, list(args))
    return i32x16(acc, a, b), cg


@intrinsic
def vmul(typingctx, a, b):
    """``a * b`` per lane."""
    def cg(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x16(a, b), cg


@intrinsic
def vsub(typingctx, a, b):
    """``a - b`` per lane."""
    def cg(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return f32x16(a, b), cg


@intrinsic
def iadd(typingctx, a, b):
    """``a + b`` per int32 lane."""
    def cg(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return i32x16(a, b), cg


@intrinsic
def isub(typingctx, a, b):
    """``a - b`` per int32 lane."""
    def cg(context, builder, sig, args):
        return builder.sub(args[0], args[1])
    return i32x16(a, b), cg


@intrinsic
def imul(typingctx, a, b):
    """``a * b`` per int32 lane (the low 32 bits)."""
    def cg(context, builder, sig, args):
        return builder.mul(args[0], args[1])
    return i32x16(a, b), cg


def _load16_ext(builder, context, sig, args, signed):
    p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
    v = builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(8), 16).as_pointer()), align=1)
    return builder.sext(v, _VI16) if signed else builder.zext(v, _VI16)


@intrinsic
def iload16_s8(typingctx, arr, i):
    """The 16 bytes at byte offset ``i`` of a C-contiguous array, as signed int8 -> 16 int32 lanes."""
    def cg(context, builder, sig, args):
        return _load16_ext(builder, context, sig, args, True)
    return i32x16(arr, types.intp), cg


@intrinsic
def iload16_u8(typingctx, arr, i):
    """The 16 bytes at byte offset ``i`` of a C-contiguous array, as unsigned bytes -> 16 int32 lanes."""
    def cg(context, builder, sig, args):
        return _load16_ext(builder, context, sig, args, False)
    return i32x16(arr, types.intp), cg
