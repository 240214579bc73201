"""Bit-level helpers of the kernels that read and write the quantized caches: conversions PTX has and the DSL does
not wrap (IEEE division, fp32 pairs to e4m3, byte permutes), and reinterpretations between fp32 and its bits."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def div_rn(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """a / b rounded to nearest (IEEE), as torch divides."""
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
        "div.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def e4m3_pair(lo: cutlass.Float32, hi: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Int32:
    """Two fp32 values as e4m3 bytes (round to nearest even; ``lo`` the low byte), in the low half."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Float32(lo).ir_value(loc=loc, ip=ip), cutlass.Float32(hi).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 p; cvt.rn.satfinite.e4m3x2.f32 p, $2, $1; cvt.u32.u16 $0, p; }", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def bf16_pair(lo: cutlass.Float32, hi: cutlass.Float32) -> cutlass.Int32:
    """Two values as bf16 (round to nearest even; ``lo`` the low half), a NaN as 0x7FFF."""
    pair = cute.make_rmem_tensor((2,), cutlass.Float32)
    pair[0] = lo
    pair[1] = hi
    halves = cute.make_rmem_tensor((2,), cutlass.BFloat16)
    halves.store(pair.load().to(cutlass.BFloat16))
    word = cute.recast_tensor(halves, cutlass.Int32)[0]
    if lo != lo:
        word = (word & -65536) | 0x7FFF
    if hi != hi:
        word = (word & 0xFFFF) | 0x7FFF0000
    return word


@cute.jit
def as_bits(x: cutlass.Float32) -> cutlass.Int32:
    r = cute.make_rmem_tensor((1,), cutlass.Float32)
    r[0] = x
    return cute.recast_tensor(r, cutlass.Int32)[0]


@cute.jit
def from_bits(b: cutlass.Int32) -> cutlass.Float32:
    r = cute.make_rmem_tensor((1,), cutlass.Int32)
    r[0] = b
    return cute.recast_tensor(r, cutlass.Float32)[0]


@cute.jit
def e4m3_value(byte):
    """The fp32 value of a positive finite e4m3 byte (0 to 0x7E): normal ones through their bits (exponent and
    mantissa moved into fp32's, rebiased by 2^120), subnormal ones m 2^-9."""
    value = from_bits(byte << 20) * cutlass.Float32(2.0 ** 120)
    if byte < 8:
        value = cutlass.Float32(byte) * cutlass.Float32(2.0 ** -9)
    return value


@dsl_user_op
def byte_perm(a: cutlass.Int32, b: cutlass.Int32, selector: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """``prmt.b32``: byte i of the result is byte (nibble i of ``selector``) of the 8 bytes b:a."""
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, selector)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))
