"""E2M1 (+ E4M3 block scale) -> BF16 decode for sm_90 kernels (CuTe DSL helpers).

Hopper has no E2M1 converter, so the decode is bit arithmetic. A 4-bit code `s e1 e0 m` with
its magnitude bits `e1 e0 m` placed at bits [8:6] of a BF16 half and its sign at bit 15 is
exactly `e2m1 * 2**-126` (codes with e = 0 land on BF16 subnormals, which is what makes one
placement right for every code). One BF16x2 multiply by `scale * 2**119` then gives
`e2m1 * scale * 2**-DECODE_EXP_SHIFT`: a product of a 2-bit and a 4-bit significand, exact in
BF16, never subnormal (the smallest is 2**-17). Kernels remove the 2**-7 (exactly) later.

Per 8 values (one 32-bit word of packed codes): 7 shifts, 4 mask/or ops and 4 BF16x2 multiplies.
The fast form returns the pairs (v_i, v_{i+4}), i = 0..3, i.e. the 8 values in the K order
[0, 4, 1, 5, 2, 6, 3, 7]. A GEMM that decodes both operands with it permutes K identically on
both sides, which leaves every dot product unchanged; `natural_order=True` adds 4 byte permutes
to return (v_0, v_1), (v_2, v_3), ... for consumers that need the original order.
"""

from __future__ import annotations

from typing import Tuple

from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from .ptx import inline_asm

# Decoded values are e2m1 * scale * 2**-DECODE_EXP_SHIFT (FP16: 2**-FP16_DECODE_EXP_SHIFT).
DECODE_EXP_SHIFT = 7
FP16_DECODE_EXP_SHIFT = 14
# BF16 bit pattern of 2**(126 - DECODE_EXP_SHIFT - 7) (the scale trick's second factor:
# 2**-120 * 2**127 * 2**112 = 2**119).
_SCALE_TAIL_BF16 = (127 + 126 - DECODE_EXP_SHIFT - 7) << 7


_SCALE_ASM = (
    "{\n\t.reg .b32 t, c0, c1;\n\t"
    "and.b32 t, $1, 0x7F;\n\t"
    "mul.lo.u32 t, t, 0x00100010;\n\t"
    "mov.b32 c0, 0x7F007F00;\n\t"
    f"mov.b32 c1, 0x{_SCALE_TAIL_BF16:04X}{_SCALE_TAIL_BF16:04X};\n\t"
    "mul.rn.bf16x2 t, t, c0;\n\t"
    "mul.rn.bf16x2 $0, t, c1;\n\t}"
)


@dsl_user_op
def e4m3_to_bf16x2_scale(sf_byte: Int32, *, loc=None, ip=None) -> Int32:
    """One E4M3 block scale (low byte of `sf_byte`, zero-extended) -> BF16x2 (both halves) of
    scale * 2**119, the multiplier `decode_e2m1x8` expects. Exact: 4 significant bits, no
    overflow (448 * 2**119 < 2**128).

    No conversion-unit instructions: the magnitude bits `eeee mmm` placed at bits [10:4] of a
    BF16 half are exactly `scale * 2**-120` (subnormal E4M3 scales land on BF16 subnormals,
    the same trick as the E2M1 codes), then two exact BF16x2 multiplies by 2**127 and 2**112.
    The sign bit is ignored (NVFP4 block scales are unsigned) and NaN (0x7F) is not special."""
    return inline_asm(_SCALE_ASM, "=r,r", [sf_byte], loc=loc, ip=ip)


def _decode_asm(natural_order: bool) -> str:
    lines = ["{", ".reg .b32 a, b, t0, t1, t2, t3;"]
    # pair i = (v_i, v_{i+4}): magnitudes from w << (6 - 4i), signs from w << (12 - 4i)
    for i in range(4):
        mag_shift = 6 - 4 * i
        sign_shift = 12 - 4 * i
        if mag_shift >= 0:
            lines.append(f"shl.b32 a, $4, {mag_shift};")
        else:
            lines.append(f"shr.u32 a, $4, {-mag_shift};")
        if sign_shift > 0:
            lines.append(f"shl.b32 b, $4, {sign_shift};")
        else:
            lines.append("mov.b32 b, $4;")
        lines.append("and.b32 a, a, 0x01C001C0;")
        lines.append("and.b32 b, b, 0x80008000;")
        lines.append("or.b32 a, a, b;")
        dst = f"t{i}" if natural_order else f"${i}"
        lines.append(f"mul.rn.bf16x2 {dst}, a, $5;")
    if natural_order:
        # (v0,v4),(v1,v5) -> (v0,v1),(v4,v5); (v2,v6),(v3,v7) -> (v2,v3),(v6,v7)
        lines += [
            "prmt.b32 $0, t0, t1, 0x5410;",
            "prmt.b32 $1, t2, t3, 0x5410;",
            "prmt.b32 $2, t0, t1, 0x7632;",
            "prmt.b32 $3, t2, t3, 0x7632;",
        ]
    lines.append("}")
    return "\n\t".join(lines)


_DECODE_ASM = {False: _decode_asm(False), True: _decode_asm(True)}


@dsl_user_op
def decode_e2m1x8(
    w: Int32, scale2: Int32, natural_order: bool = False, *, loc=None, ip=None
) -> Tuple[Int32, Int32, Int32, Int32]:
    """8 packed E2M1 codes (value j in nibble j of `w`) times the BF16x2 scale from
    `e4m3_to_bf16x2_scale` -> 4 BF16x2 registers holding e2m1 * scale * 2**-7, in the K order
    [0, 4, 1, 5, 2, 6, 3, 7] (or [0..7] with natural_order)."""
    return inline_asm(_DECODE_ASM[bool(natural_order)], "=r,=r,=r,=r,r,r", [w, scale2], loc=loc,
                      ip=ip)


def kperm8():
    """The K order of `decode_e2m1x8` (fast form) as a list: position p holds value kperm8()[p]."""
    return [0, 4, 1, 5, 2, 6, 3, 7]


_F16_SCALE_ASM = ("{\n\t.reg .b32 d;\n\t.reg .b16 q;\n\tand.b32 d, $1, 0xFF;\n\t"
                  "mul.lo.u32 d, d, 0x101;\n\tcvt.u16.u32 q, d;\n\t"
                  "cvt.rn.f16x2.e4m3x2 $0, q;\n\t}")


@dsl_user_op
def e4m3_to_f16x2_scale(sf_byte: Int32, *, loc=None, ip=None) -> Int32:
    """One E4M3 scale (low byte) -> FP16x2 (both halves), exact."""
    return inline_asm(_F16_SCALE_ASM, "=r,r", [sf_byte], loc=loc, ip=ip)


def _fp16_decode_asm(natural_order: bool) -> str:
    """Like the BF16 decode above, for FP16: magnitude bits at [11:9] and the sign at
    bit 15 make e2m1 * 2**-14 (e = 0 codes are FP16 subnormals); one FP16x2 multiply by the
    scale gives e2m1 * scale * 2**-14, exact (least bit >= 2**-24). Pairs (v_i, v_{i+4}), or
    natural K order with 4 byte permutes."""
    lines = ["{", ".reg .b32 a, b, t0, t1, t2, t3;"]
    for i in range(4):
        mag = 9 - 4 * i
        lines.append(f"shl.b32 a, $4, {mag};" if mag >= 0 else f"shr.u32 a, $4, {-mag};")
        lines.append(f"shl.b32 b, $4, {12 - 4 * i};" if i < 3 else "mov.b32 b, $4;")
        lines += ["and.b32 a, a, 0x0E000E00;", "and.b32 b, b, 0x80008000;", "or.b32 a, a, b;",
                  f"mul.rn.f16x2 {f't{i}' if natural_order else f'${i}'}, a, $5;"]
    if natural_order:
        lines += ["prmt.b32 $0, t0, t1, 0x5410;", "prmt.b32 $1, t2, t3, 0x5410;",
                  "prmt.b32 $2, t0, t1, 0x7632;", "prmt.b32 $3, t2, t3, 0x7632;"]
    lines.append("}")
    return "\n\t".join(lines)


_FP16_DECODE_ASM = {False: _fp16_decode_asm(False), True: _fp16_decode_asm(True)}


@dsl_user_op
def decode_e2m1x8_f16(w: Int32, scale2: Int32, natural_order: bool, *, loc=None, ip=None):
    """8 packed E2M1 codes -> 4 FP16x2 registers of e2m1 * scale * 2**-14 (scale2 from
    `e4m3_to_f16x2_scale`), in the K order of `decode_e2m1x8`."""
    return inline_asm(_FP16_DECODE_ASM[bool(natural_order)], "=r,=r,=r,=r,r,r", [w, scale2],
                      loc=loc, ip=ip)
