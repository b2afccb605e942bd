"""CuTe DSL helpers for NVFP4 numbers, shared by the quantize, dequantize and GEMM kernels:
bit casts, the FP32 outer scale from an amax, E4M3 / E2M1 / E8M0 decoding and swizzled scale
offsets. Each mirrors a function of `cute_fp4.ref` bit for bit."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .encode import div_fast, mul_rn, rcp_fast, rcp_rn

FLT_MAX = 3.4028234663852886e38
ONE_SIXTH = 0.16666667  # fp32(1/6) = 0x3E2AAAAB: the block scale multiplies S_enc by it


@dsl_user_op
def bits_to_f32(bits, *, loc=None, ip=None) -> Float32:
    """Reinterpret 32 bits as FP32."""
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32_to_bits(value, *, loc=None, ip=None) -> Uint32:
    """Reinterpret an FP32 as 32 bits."""
    return Uint32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


# outer_encode_scale / outer_block_scales with fast are exact for amax 0 and amax in
# [OUTER_FAST_MIN, OUTER_FAST_MAX] (checked for every FP32 value there, e4m3_max 448 and 256:
# test_outer_scales_fast_exhaustive); S_enc then lies in [2^-89, 2^112], inside the fast
# reciprocal's range.
OUTER_FAST_MIN = 2.0 ** -100
OUTER_FAST_MAX = 2.0 ** 100


@cute.jit
def outer_encode_scale(amax: Float32, e4m3_max: cutlass.Constexpr[float],
                       fast: cutlass.Constexpr[bool] = False) -> Float32:
    """S_enc = e4m3_max * 6 / amax, capped at FLT_MAX (NaN propagates), and 1 where amax is 0
    or S_enc is 0 (ref.formats.encode_scale). The division is IEEE (div.rn); fast: its fast
    path without the slow-path branch (encode.div_fast), exact where the caller has checked
    amax (0 or in [OUTER_FAST_MIN, OUTER_FAST_MAX])."""
    num = Float32(e4m3_max * 6.0)
    if cutlass.const_expr(fast):
        q = div_fast(num, amax)
    else:
        q = num / amax
    s = cute.arch.fmin(q, Float32(FLT_MAX), nan=True)
    return Float32(cutlass.select_((amax == Float32(0.0)) | (s == Float32(0.0)), Float32(1.0), s))


@cute.jit
def outer_fast_ok(amax: Float32):
    """Whether the fast outer scales (outer_encode_scale, decode_outer_scale and
    outer_block_scales with fast) are the IEEE ones for this amax: 0 or in [OUTER_FAST_MIN,
    OUTER_FAST_MAX]."""
    return (amax == Float32(0.0)) | ((amax >= Float32(OUTER_FAST_MIN))
                                     & (amax <= Float32(OUTER_FAST_MAX)))


@cute.jit
def decode_outer_scale(amax: Float32, e4m3_max: cutlass.Constexpr[float],
                       fast: cutlass.Constexpr[bool] = False) -> Float32:
    """S_dec = 1 / S_enc (ref.formats.decode_scale: IEEE reciprocal, subnormals kept). fast:
    the division and the reciprocal without their slow-path branches (exact where
    `outer_fast_ok`)."""
    if cutlass.const_expr(fast):
        return rcp_fast(outer_encode_scale(amax, e4m3_max, fast))
    return rcp_rn(outer_encode_scale(amax, e4m3_max))


@cute.jit
def outer_block_scales(amax: Float32, e4m3_max: cutlass.Constexpr[float],
                       fast: cutlass.Constexpr[bool] = False):
    """(S_enc * fp32(1/6), S_dec) of an outer amax: the two per-amax operands of
    encode.block_scale (one rounded product, one IEEE reciprocal). fast: the division and the
    reciprocal without their slow-path branches (outer_encode_scale, encode.rcp_fast)."""
    s_enc = outer_encode_scale(amax, e4m3_max, fast)
    s6 = mul_rn(s_enc, Float32(ONE_SIXTH))
    if cutlass.const_expr(fast):
        s_dec = rcp_fast(s_enc)
    else:
        s_dec = rcp_rn(s_enc)
    return s6, s_dec


@cute.jit
def e4m3_to_f32(code: Uint32) -> Float32:
    """E4M3 (fn) code in the low byte -> FP32, exactly; codes 0x7F and 0xFF are NaN."""
    exp = (code >> 3) & Uint32(0xF)
    man = code & Uint32(0x7)
    normal = bits_to_f32(((exp + Uint32(120)) << 23) | (man << 20))
    subnormal = Float32(Int32(man)) * Float32(2.0**-9)
    mag = Float32(cutlass.select_(exp == Uint32(0), subnormal, normal))
    mag = Float32(cutlass.select_((code & Uint32(0x7F)) == Uint32(0x7F), Float32(float("nan")),
                                  mag))
    return Float32(cutlass.select_((code & Uint32(0x80)) != Uint32(0), -mag, mag))


@cute.jit
def e2m1_to_f32(code: Uint32) -> Float32:
    """E2M1 code (low nibble) -> FP32, exactly: 0, 0.5, 1, 1.5, 2, 3, 4, 6 with bit 3 the
    sign. The nibble's exponent/mantissa bits go straight into the FP32 fields; the only
    subnormal code (0.5) is selected."""
    exp = (code >> 1) & Uint32(0x3)
    man = code & Uint32(0x1)
    normal = bits_to_f32(((exp + Uint32(126)) << 23) | (man << 22))
    mag = Float32(cutlass.select_(exp == Uint32(0), Float32(Int32(man)) * Float32(0.5), normal))
    return Float32(cutlass.select_((code & Uint32(0x8)) != Uint32(0), -mag, mag))


@cute.jit
def e8m0_to_f32(code: Uint32) -> Float32:
    """E8M0 code -> 2**(code - 127); code 255 is NaN, code 0 is 2**-127 (subnormal)."""
    normal = bits_to_f32(code << 23)
    value = Float32(cutlass.select_(code == Uint32(0), Float32(2.0**-127), normal))
    return Float32(cutlass.select_(code == Uint32(0xFF), Float32(float("nan")), value))


@cute.jit
def swizzled_scale_offset(row: Int32, col: Int32, cols: Int32) -> Int32:
    """Byte offset of scale (row, col) in the 128x4 swizzled layout of a scale matrix with
    `cols` columns (ref.swizzle.swizzled_offset)."""
    tiles_per_row = (cols + Int32(3)) // Int32(4)
    tile = (row // Int32(128)) * tiles_per_row + col // Int32(4)
    rr = row % Int32(128)
    return tile * Int32(512) + (rr % Int32(32)) * Int32(16) + (rr // Int32(32)) * Int32(4) \
        + col % Int32(4)
