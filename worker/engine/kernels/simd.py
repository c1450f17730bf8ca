"""Explicit 16-lane vector types and operations for the numba kernels of :mod:`.quant_kernels`.

numba does not keep accumulators of several output rows in registers, nor emit AVX512-VNNI's
``vpdpbusd``; an explicit vector type does both. ``F32x16`` is LLVM's ``<16 x float>`` (one zmm
register on AVX-512), ``I32x16`` its ``<16 x i32>``. Every float operation here is one IEEE
float32 operation per lane (``vfma``: one rounding), and nothing is fast-math, so a kernel written
with them computes exactly the operations it spells out, in that order: LLVM may neither
reassociate nor contract them. The integer ones are exact.

Array arguments are C-contiguous; offsets are in elements of the array for float32 loads
(:func:`vload`) and in bytes for the byte / int32 loads (:func:`iload64`, :func:`ibcast4`).
The integer dot products (:func:`dpbusd`, :func:`maddubs`, ...) are lowered for the host's
instruction set (:data:`ISA`: AVX512-VNNI or AVX2); the caller checks that it has one
(``quant.host_has_vnni``).
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
def claim(typingctx, taken):
    """The next work item of a parallel loop whose threads take items as they come: an atomic
    fetch-and-add of 1 on ``taken[0]`` (int64 array, zero before the loop), returning its value
    before (items >= the item count: none left). Only the count is atomic (monotonic order); the
    items' results are published by the loop's end."""
    if not (isinstance(taken, types.Array) and taken.dtype == types.int64):
        return None

    def cg(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", a.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(taken), cg


@intrinsic
def prefetch(typingctx, arr, i):
    """Ask for the cache line holding byte offset ``i`` of a C-contiguous array to be brought into
    the L2 cache ahead of its loads (``prefetcht1``, measured faster here than into L1 for the
    weight streams; changes no value), for streams the hardware prefetcher does not follow
    (``quant_kernels._PF_BYTES``). A prefetch never faults: ``i`` may lie past the array's end."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        i8p = ir.IntType(8).as_pointer()
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                           "llvm.prefetch.p0i8")
        builder.call(f, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(arr, types.intp), cg


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


def _host_features() -> dict[str, bool]:
    from llvmlite import binding
    return {k: bool(v) for k, v in binding.get_host_cpu_features().items()}


def host_isa() -> str:
    """The instruction set the integer dot products are lowered to, from the host CPU (numba
    compiles for the host; its on-disk cache is keyed by the CPU, so a cached kernel of another
    machine is never run here): ``"vnni"`` (AVX512-VNNI with F and BW: ``vpdpbusd``), ``"avx2"``
    (AVX2 with FMA and F16C: ``vpmaddubsw`` + ``vpmaddwd``, the way ggml's own AVX2 kernels take
    their integer dot products) or ``""`` (neither: the vector kernels are not used)."""
    f = _host_features()
    if f.get("avx512vnni") and f.get("avx512bw") and f.get("avx512f"):
        return "vnni"
    if f.get("avx2") and f.get("fma") and f.get("f16c"):
        return "avx2"
    return ""


#: :func:`host_isa` of this process
ISA = host_isa()
_V32B = ir.VectorType(ir.IntType(8), 32)
_V64B = ir.VectorType(ir.IntType(8), 64)
_V16W = ir.VectorType(ir.IntType(16), 16)
_V32W = ir.VectorType(ir.IntType(16), 32)
_V8D = ir.VectorType(ir.IntType(32), 8)


def _halves(builder, v, vt_half, n_half):
    """The two 256-bit halves of a 512-bit vector value ``v`` (already of the element type)."""
    lo = builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, n_half), list(range(n_half))))
    hi = builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                ir.Constant(ir.VectorType(_I32, n_half), list(range(n_half, 2 * n_half))))
    return lo, hi


def _concat(builder, lo, hi, n_half):
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 2 * n_half), list(range(2 * n_half))))


def _maddubs(builder, a, b):
    """<16 x i32> bags of bytes -> <32 x i16>: per i16 lane u8(a)*s8(b) + u8(a')*s8(b') of its two
    bytes, saturated to int16 (``vpmaddubsw``, per 256-bit half on AVX2)."""
    a8 = builder.bitcast(a, _V64B)
    b8 = builder.bitcast(b, _V64B)
    if ISA == "vnni":
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32W, [_V64B, _V64B]),
                                           "llvm.x86.avx512.pmaddubs.w.512")
        return builder.call(f, [a8, b8])
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16W, [_V32B, _V32B]),
                                       "llvm.x86.avx2.pmadd.ub.sw")
    alo, ahi = _halves(builder, a8, _V32B, 32)
    blo, bhi = _halves(builder, b8, _V32B, 32)
    return _concat(builder, builder.call(f, [alo, blo]), builder.call(f, [ahi, bhi]), 16)


def _maddwd(builder, a, b):
    """<32 x i16> x <32 x i16> -> <16 x i32>: per i32 lane the sum of its two int16 products
    (``vpmaddwd``: exact)."""
    if ISA == "vnni":
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI16, [_V32W, _V32W]),
                                           "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(f, [a, b])
    f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8D, [_V16W, _V16W]),
                                       "llvm.x86.avx2.pmadd.wd")
    alo, ahi = _halves(builder, a, _V16W, 16)
    blo, bhi = _halves(builder, b, _V16W, 16)
    return _concat(builder, builder.call(f, [alo, blo]), builder.call(f, [ahi, bhi]), 8)


def _ones16():
    return ir.Constant(_V32W, [1] * 32)


@intrinsic
def dpbusd(typingctx, acc, a, b):
    """``acc + sum_i u8(a)[4l+i] * s8(b)[4l+i]`` per int32 lane l, exact for every byte value
    (AVX512-VNNI ``vpdpbusd``; on AVX2 the bytes of ``a`` split in nibbles, each taken by
    ``vpmaddubsw`` + ``vpmaddwd``, which then cannot saturate)."""
    def cg(context, builder, sig, args):
        if ISA == "vnni":
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI16, [_VI16] * 3),
                                               "llvm.x86.avx512.vpdpbusd.512")
            return builder.call(f, list(args))
        acc, a, b = args
        lo = builder.and_(a, ir.Constant(_VI16, [0x0F0F0F0F] * 16))
        hi = builder.and_(builder.lshr(a, ir.Constant(_VI16, [4] * 16)), ir.Constant(_VI16, [0x0F0F0F0F] * 16))
        plo = _maddwd(builder, _maddubs(builder, lo, b), _ones16())
        phi = _maddwd(builder, _maddubs(builder, hi, b), ir.Constant(_V32W, [16] * 32))
        return builder.add(acc, builder.add(plo, phi))
    return i32x16(acc, a, b), cg


@intrinsic
def dpbusd_s(typingctx, acc, a, b):
    """:func:`dpbusd` where every pair of adjacent products ``u8(a)*s8(b)`` sums within int16
    (the caller's guarantee: e.g. ``a`` below 128 and ``b`` in [-127, 127], as nibbles and 6-bit
    levels against q8 levels): exact, one ``vpmaddubsw`` + ``vpmaddwd`` per half on AVX2."""
    def cg(context, builder, sig, args):
        if ISA == "vnni":
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI16, [_VI16] * 3),
                                               "llvm.x86.avx512.vpdpbusd.512")
            return builder.call(f, list(args))
        acc, a, b = args
        return builder.add(acc, _maddwd(builder, _maddubs(builder, a, b), _ones16()))
    return i32x16(acc, a, b), cg


@intrinsic
def maddubs(typingctx, a, b):
    """Per int16 lane (two per int32 lane of the result's bag) ``u8*s8 + u8*s8`` of its two bytes
    of ``a`` (unsigned) and ``b`` (signed), saturated to int16 (``vpmaddubsw``): exact where the
    caller guarantees the sums fit. Returned as an ``i32x16`` bag of 32 int16."""
    def cg(context, builder, sig, args):
        return builder.bitcast(_maddubs(builder, args[0], args[1]), _VI16)
    return i32x16(a, b), cg


@intrinsic
def addw(typingctx, a, b):
    """``a + b`` per int16 lane of two bags of 32 int16 (wrapping; exact where the sums fit)."""
    def cg(context, builder, sig, args):
        return builder.bitcast(builder.add(builder.bitcast(args[0], _V32W), builder.bitcast(args[1], _V32W)), _VI16)
    return i32x16(a, b), cg


@intrinsic
def maddw1(typingctx, a):
    """A bag of 32 int16 -> 16 int32: each int32 lane the sum of its two int16 (``vpmaddwd`` with
    ones: exact)."""
    def cg(context, builder, sig, args):
        return _maddwd(builder, builder.bitcast(args[0], _V32W), _ones16())
    return i32x16(a), cg


@intrinsic
def maddw_s(typingctx, a, s):
    """A bag of 32 int16 ``a`` and 16 int32 lanes ``s`` holding int16 values (scales loaded by
    :func:`iload16_u8` / :func:`iload16_s8`) -> 16 int32: lane l = s_l * (a[2l] + a[2l+1])
    (``vpmaddwd`` against ``s`` in both int16 halves of each lane: exact)."""
    def cg(context, builder, sig, args):
        sv = args[1]
        pair = builder.or_(builder.and_(sv, ir.Constant(_VI16, [0xFFFF] * 16)),
                           builder.shl(sv, ir.Constant(_VI16, [16] * 16)))
        return _maddwd(builder, builder.bitcast(args[0], _V32W), builder.bitcast(pair, _V32W))
    return i32x16(a, s), cg


@intrinsic
def q6_level(typingctx, lo4, hi2, sel):
    """The 6-bit levels (0..63) of 64 bytes from their packed parts (``quant.pack_q6``): per byte
    ``((lo4 >> 4*n) & 15) | (((hi2 >> 2*p) & 3) << 4)`` with ``n = sel & 1`` (the high nibble of
    ``lo4``) and ``p = sel >> 1`` (the bit pair of ``hi2``, 0..3). Byte arithmetic on int32 lanes:
    the masks keep each byte's own bits, and no needed bit leaves its lane (pairs 0-1 shift left
    by 4 - 2p, pairs 2-3 right by 2p - 4)."""
    def cg(context, builder, sig, args):
        lo4, hi2, sel = args
        sel = builder.trunc(sel, _I32) if sig.args[2].bitwidth > 32 else sel
        n4 = builder.shl(builder.and_(sel, ir.Constant(_I32, 1)), ir.Constant(_I32, 2))
        p2 = builder.shl(builder.lshr(sel, ir.Constant(_I32, 1)), ir.Constant(_I32, 1))
        lo = builder.and_(builder.lshr(lo4, _splat(builder, n4, _VI16)), ir.Constant(_VI16, [0x0F0F0F0F] * 16))
        left = builder.icmp_signed("<=", p2, ir.Constant(_I32, 4))
        amt_l = builder.select(left, builder.sub(ir.Constant(_I32, 4), p2), ir.Constant(_I32, 0))
        amt_r = builder.select(left, ir.Constant(_I32, 0), builder.sub(p2, ir.Constant(_I32, 4)))
        h = builder.lshr(builder.shl(hi2, _splat(builder, amt_l, _VI16)), _splat(builder, amt_r, _VI16))
        return builder.or_(lo, builder.and_(h, ir.Constant(_VI16, [0x30303030] * 16)))
    return i32x16(lo4, hi2, types.intp), cg


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
