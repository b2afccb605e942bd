"""Shared DSL helpers for NVFP4 encoding (SPEC section 1).

Everything here is called from inside ``@cute.jit`` / ``@cute.kernel`` code and emits
explicit PTX, so that every FP32 step is one correctly rounded IEEE operation (no
fast-math contraction, no approximate reciprocal, no flush-to-zero):

* outer scale: ``S_enc = min(2688 / amax, FLT_MAX)`` (1 where amax == 0 or the result is 0),
  ``S_dec = 1 / S_enc``;
* block scale: ``s = e4m3(min(amax_b * (S_enc * fp32(1/6)), 448))``,
  ``enc = min(1 / (float(s) * S_dec), FLT_MAX)``;
* element code: ``e2m1(clamp(x * enc, -6, 6))``, RN ties-to-even, sign 0x8 only for
  strictly negative products; a NaN in the block (NaN block amax) gives code 0 everywhere.

NaN propagation follows torch (the reference): ``min.NaN`` / ``max.NaN``.

FP4 encode: on sm_90 in software (branch-free integer/FP32 arithmetic, no register arrays
indexed at run time); on Blackwell (``sm_100a`` and friends) the hardware
``cvt.rn.satfinite.e2m1x2.f32``. The switch is taken at compile time from the DSL's target
arch (``CUTE_DSL_ARCH`` or the current GPU).
"""

import functools

import cutlass
from cutlass import Float32, Int32, Uint32
from cutlass.base_dsl import BaseDSL
import cutlass.cute as cute

from .ptx import ld_global, ld_shared, st_global, st_shared
from .ptx import red_max_u32, red_shared_max_u32  # noqa: F401  (the quantize kernels' E.*)

FLT_MAX_HEX = "0f7F7FFFFF"
E4M3_MAX = 448.0
FP4_MAX = 6.0

# Targets whose PTX has cvt.rn.satfinite.e2m1x2.f32 (arch-specific / family-specific).
_HW_E2M1_ARCHS = {
    "sm_100a", "sm_100f", "sm_101a", "sm_101f", "sm_103a", "sm_103f",
    "sm_110a", "sm_110f", "sm_120a", "sm_120f", "sm_121a", "sm_121f",
}


def target_arch() -> str:
    """Name of the arch the DSL is compiling for, e.g. ``"sm_90a"``."""
    return str(BaseDSL._get_dsl().get_arch_enum().name)


def has_hw_e2m1(arch: str = None) -> bool:
    """True when the target has the hardware FP32 -> E2M1 conversion."""
    return (arch or target_arch()) in _HW_E2M1_ARCHS


def _ptx1(code, ty, *args):
    return cute.arch.inline_ptx(code, write_only_types=[ty], read_only_args=list(args))


# ---------------------------------------------------------------- scalar FP32 ops
def mul_rn(a, b):
    return _ptx1("mul.rn.f32 {$w0}, {$r0}, {$r1};", Float32, Float32(a), Float32(b))


def add_rn(a, b):
    return _ptx1("add.rn.f32 {$w0}, {$r0}, {$r1};", Float32, Float32(a), Float32(b))


def sub_rn(a, b):
    return _ptx1("sub.rn.f32 {$w0}, {$r0}, {$r1};", Float32, Float32(a), Float32(b))


def neg(a):
    return _ptx1("neg.f32 {$w0}, {$r0};", Float32, Float32(a))


def rcp_rn(a):
    return _ptx1("rcp.rn.f32 {$w0}, {$r0};", Float32, Float32(a))


def div_rn(a, b):
    return _ptx1("div.rn.f32 {$w0}, {$r0}, {$r1};", Float32, Float32(a), Float32(b))


def fmin_nan(a, b):
    return _ptx1("min.NaN.f32 {$w0}, {$r0}, {$r1};", Float32, Float32(a), Float32(b))


def fmax_nan(a, b):
    return _ptx1("max.NaN.f32 {$w0}, {$r0}, {$r1};", Float32, Float32(a), Float32(b))


def fabs(x):
    return _ptx1("abs.f32 {$w0}, {$r0};", Float32, Float32(x))


def abs_max_nan(acc, x):
    """max.NaN(acc, |x|): the running block/row amax, NaN-propagating like torch.amax."""
    return _ptx1(
        "{\n.reg .f32 t;\nabs.f32 t, {$r1};\nmax.NaN.f32 {$w0}, {$r0}, t;\n}",
        Float32, Float32(acc), Float32(x),
    )


def abs_max2_nan(a, b):
    """max.NaN(|a|, |b|): one max with both operands' abs modifiers."""
    return _ptx1(
        "{\n.reg .f32 s, t;\nabs.f32 s, {$r0};\nabs.f32 t, {$r1};\nmax.NaN.f32 {$w0}, s, t;\n}",
        Float32, Float32(a), Float32(b),
    )


def block_amax(xs, tree: bool = False):
    """max.NaN of |x| over a list of FP32 values (a block amax): n - 1 max instructions, the
    value of a max from 0 (|x| >= 0; -0 gives +0, NaN propagates). tree: pairwise (a chain of
    log2(n) maxima instead of n - 1, for values that are all ready at once)."""
    if len(xs) == 1:
        return fabs(xs[0])
    if tree:
        ms = [abs_max2_nan(xs[i], xs[i + 1]) for i in range(0, len(xs) - 1, 2)]
        if len(xs) % 2:
            ms.append(fabs(xs[-1]))
        while len(ms) > 1:
            ms = [fmax_nan(ms[i], ms[i + 1]) for i in range(0, len(ms) - 1, 2)] + (
                [ms[-1]] if len(ms) % 2 else [])
        return ms[0]
    a = abs_max2_nan(xs[0], xs[1])
    for x in xs[2:]:
        a = abs_max_nan(a, x)
    return a


def f32_bits(x):
    return _ptx1("mov.b32 {$w0}, {$r0};", Uint32, Float32(x))


def bits_f32(x):
    return _ptx1("mov.b32 {$w0}, {$r0};", Float32, Uint32(x))


def is_nan(x):
    """Uint32 1 where x is NaN, else 0."""
    return _ptx1(
        "{\n.reg .pred p;\nsetp.nan.f32 p, {$r0}, {$r0};\nselp.u32 {$w0}, 1, 0, p;\n}", Uint32, Float32(x)
    )


def canonical_nan_bits(x):
    """Bits of ``x`` with every NaN replaced by torch's quiet NaN 0x7FC00000."""
    return _ptx1(
        "{\n.reg .pred p;\n.reg .b32 t;\nmov.b32 t, {$r0};\nsetp.nan.f32 p, {$r0}, {$r0};\n"
        "selp.b32 {$w0}, 0x7FC00000, t, p;\n}",
        Uint32, Float32(x),
    )


# ---------------------------------------------------------------- scales
def e4m3_code(p):
    """E4M3 code (Uint32) of min(p, 448), RN (min.NaN: +Inf saturates to 448, NaN -> 0x7F)."""
    return _ptx1(
        "{\n.reg .f32 p;\n.reg .f32 z;\n.reg .b16 h;\n"
        "mov.f32 z, 0f00000000;\n"
        "min.NaN.f32 p, {$r0}, 0f43E00000;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h, z, p;\n"
        "cvt.u32.u16 {$w0}, h;\n}",
        Uint32, Float32(p),
    )


# rcp.rn / div.rn without their slow-path branches. rcp.rn.f32 compiles to MUFU.RCP and one
# FMA Newton step (correctly rounded) for operands in [2^-126, 2^126) and calls a subroutine
# elsewhere; div.rn.f32 to MUFU.RCP, one FMA refinement of the reciprocal, the quotient and one
# FMA correction when FCHK passes, else a call. The branch region around every call splits
# ptxas' scheduling; these are the fast paths alone, for operands the caller has checked
# (ptxas emits the same fast paths for sm_90a and sm_100a, so the sequences hold on both). The
# reciprocal's start is capped at FLT_MAX so that a zero operand ends at inf like the IEEE
# reciprocal instead of NaN; NaN stays NaN.
RCP_FAST_MIN = 2.0 ** -126
RCP_FAST_END = 2.0 ** 126
_RCP_FAST = (
    ".reg .f32 r;\n.reg .f32 e;\n"
    "rcp.approx.ftz.f32 r, f;\n"
    "min.f32 r, r, " + FLT_MAX_HEX + ";\n"
    "neg.f32 f, f;\n"
    "fma.rn.f32 e, f, r, 0f3F800000;\n"
    "fma.rn.f32 f, r, e, r;\n"
)


def rcp_fast(a):
    """1 / a as rcp.rn.f32 gives it, exact for a in [RCP_FAST_MIN, RCP_FAST_END) (0: inf)."""
    return _ptx1("{\n.reg .f32 f;\nmov.f32 f, {$r0};\n" + _RCP_FAST + "mov.f32 {$w0}, f;\n}",
                 Float32, Float32(a))


def div_fast(a, b):
    """a / b as div.rn.f32 gives it where its FCHK test passes (the caller checks its operands:
    scales.outer_encode_scale with fast): rcp_fast's reciprocal, the quotient and one correction."""
    return _ptx1(
        "{\n.reg .f32 f;\n.reg .f32 n;\n.reg .f32 q;\n.reg .f32 c;\n"
        "mov.f32 f, {$r1};\nneg.f32 n, {$r1};\n" + _RCP_FAST +
        "mul.rn.f32 q, {$r0}, f;\n"
        "fma.rn.f32 c, n, q, {$r0};\n"
        "fma.rn.f32 {$w0}, f, c, q;\n}",
        Float32, Float32(a), Float32(b))


def enc_from_code(code, s_dec, fast: bool = False):
    """The block's element multiplier ``enc = min(1 / (float(s) * s_dec), FLT_MAX)`` for the
    E4M3 scale byte ``code``. fast (compile-time): the reciprocal without its slow path, exact
    where every nonzero scale's product s * s_dec lies in [RCP_FAST_MIN, RCP_FAST_END) (the
    caller checks the outer scale: CastKernel._fast_blocks_ok)."""
    rcp = _RCP_FAST if fast else "rcp.rn.f32 f, f;\n"
    return _ptx1(
        "{\n.reg .b16 h;\n.reg .b32 w;\n.reg .f16 lo;\n.reg .f16 hi;\n.reg .f32 f;\n"
        "cvt.u16.u32 h, {$r0};\n"
        "cvt.rn.f16x2.e4m3x2 w, h;\n"
        "mov.b32 {lo, hi}, w;\n"
        "cvt.f32.f16 f, lo;\n"
        "mul.rn.f32 f, f, {$r1};\n"
        + rcp +
        "min.NaN.f32 {$w0}, f, " + FLT_MAX_HEX + ";\n}",
        Float32, Uint32(code), Float32(s_dec),
    )


def fast_outer_ok(sdec, bulk_signs: bool, fast_rcp: bool):
    """Whether every block quantized with the outer scale sdec (scale bytes <= E4M3_MAX) may
    take the fast encoders (false for a NaN sdec):
    - bulk_signs: enc >= 2^-14, so that no nonzero product of a 16-bit input (a multiple of
      2^-133 / 2^-24; RHT outputs of 2^-135 / 2^-26) with enc rounds to zero and the codes'
      signs can come from the products' or the inputs' sign bits (encode8_nonzero_products,
      sr_encode16_signed): enc = min(1 / RN(scale * sdec), FLT_MAX) decreases with the
      scale, so RN(E4M3_MAX * sdec) <= 2^14 suffices (and implies the next bound);
    - else every nonzero scale's product below RCP_FAST_END: RN(E4M3_MAX * sdec) < 2^126;
    - fast_rcp: the smallest nonzero product, 2^-9 * sdec, is exact and >= RCP_FAST_MIN from
      sdec >= 2^-117 on (enc_from_code with fast)."""
    top = mul_rn(Float32(E4M3_MAX), sdec)
    if bulk_signs:
        ok = top <= Float32(2.0 ** 14)
    else:
        ok = top < Float32(RCP_FAST_END)
    if fast_rcp:
        ok = ok & (sdec >= Float32(RCP_FAST_MIN * 2.0 ** 9))
    return ok


def block_scale_byte(amax_b, s_enc_6):
    """The E4M3 scale byte (Uint32) of a 16-element block with amax ``amax_b``; ``s_enc_6`` is
    ``S_enc * fp32(1/6)`` (one rounded product)."""
    return e4m3_code(mul_rn(amax_b, s_enc_6))


def block_scale(amax_b, s_enc_6, s_dec, fast: bool = False):
    """One 16-element block: returns (E4M3 scale byte as Uint32, enc as Float32).

    ``s_enc_6`` is ``S_enc * fp32(1/6)`` (one rounded product), ``s_dec`` is ``1 / S_enc``;
    fast: enc_from_code's reciprocal without its slow path.
    """
    code = block_scale_byte(amax_b, s_enc_6)
    return code, enc_from_code(code, s_dec, fast)


# ---------------------------------------------------------------- E2M1 encode
# Software encoder, one element i of a word (PTX registers x: input, e: enc, w: the word).
# With a = min(|x*e|, 6), the E2M1 code (RN, ties to the even code) is
#     min(rne(2a), rne(a) + 2, rne(a/2) + 4)
# (rne(2a) on [0, 2): spacing 0.5; rne(a) + 2 on [2, 4): spacing 1; rne(a/2) + 4 on [4, 6]:
# spacing 2; each term is the largest of the three outside its own range). Each rne is one
# single-rounding FP32 add of the magic 2^23 (ulp 1): c = RN(k*a + 2^23 + offset) has bits
# 0x4B000000 + term, and the FP32 min of the three is the min of the terms. Only FP32 adds,
# FMAs and min (no integer exponent work): on sm_90 the ALU pipe (min/max, logic, compares)
# runs at half rate and bounds the cast.
# The word is built by additions (nibbles never overlap in the final sum, so carries of the
# partial sums cancel modulo 2^32): w += bits(c) << 4i, the constants -0x4B000000 << 4i are added
# once per word, and the sign adds 8 << 4i for strictly negative products (an exact -0
# encodes as code 0).
_SW_DECL = (
    ".reg .f32 v;\n.reg .f32 a;\n.reg .f32 c;\n.reg .f32 d;\n.reg .b32 b;\n"
    ".reg .pred p;\n.reg .f32 e;\n"
)
_SW_CONST = (-0x4B000000 * 0x11111111) % 2**32


def _magnitude_ptx(x: str, e: str, v: str) -> list:
    """PTX lines of a = min(|x * e|, 6) (registers v, a). v = "v": the product is mul.rn and the
    caller sets the sign per element; else it goes to register v as fma with +0 (an exact zero
    product is +0) for sign_nibbles_ptx."""
    return [f"mul.rn.f32 v, {x}, {e};" if v == "v" else f"fma.rn.f32 {v}, {x}, {e}, 0f00000000;",
            f"abs.f32 a, {v};", "min.f32 a, a, 0f40C00000;"]


def _sw_elem(i: int, x: str, v: str = "v") -> str:
    """Element i (PTX register x, multiplier register e) into the word {$w0}. v = "v": the
    sign by a compare and a predicated add per element; else the product goes to register v
    (fma with +0, see sign_nibbles_ptx) and the sign is left to the caller."""
    signed = v == "v"
    lines = _magnitude_ptx(x, "e", v) + [
        "fma.rn.f32 c, a, 0f40000000, 0f4B000000;",
        "add.rn.f32 d, a, 0f4B000002;",
        "min.f32 c, c, d;",
        "fma.rn.f32 d, a, 0f3F000000, 0f4B000004;",
        "min.f32 c, c, d;",
        "mov.b32 b, c;",
    ]
    if i == 0:
        lines.append("mov.b32 {$w0}, b;")
    else:
        lines += [f"shl.b32 b, b, {4 * i};", "add.u32 {$w0}, {$w0}, b;"]
    if signed:
        lines += ["setp.lt.f32 p, v, 0f00000000;",
                  f"@p add.u32 {{$w0}}, {{$w0}}, {8 << (4 * i)};"]
    return "\n".join(lines) + "\n"


# Sign nibbles of 8 elements in 8 instructions instead of a compare and a predicated add each:
# the products v0 .. v7 are fma(x, enc, +0), so an exact zero product is +0 and the sign bit
# of v_i is "strictly negative" unless a nonzero product underflows to -0 (callers rule that
# out per block: see RecipeCastKernel). prmt's sign-replicate mode (selector bit 3) turns
# byte 3 of v_i into 0x00 / 0xFF; bytes of the even elements go to E, of the odd ones to O,
# byte j of each from elements 2j / 2j + 1, and bit 3 of byte j of E (bit 7 of O) is bit 3
# of nibble 2j (2j + 1) of the word.
def sign_nibbles_ptx(v, w: str) -> str:
    """PTX ORing the signs of the FP32 registers v[0..7] into bit 4i + 3 of register w (its
    bits 4i + 3 must be 0); uses registers se, so, st (declared here)."""
    return ("{\n.reg .b32 se, so, st;\n"
            f"prmt.b32 se, {v[0]}, {v[2]}, 0xFB;\nprmt.b32 st, {v[4]}, {v[6]}, 0xFB00;\n"
            "prmt.b32 se, se, st, 0x7610;\n"
            f"prmt.b32 so, {v[1]}, {v[3]}, 0xFB;\nprmt.b32 st, {v[5]}, {v[7]}, 0xFB00;\n"
            "prmt.b32 so, so, st, 0x7610;\n"
            f"and.b32 se, se, 0x08080808;\nor.b32 {w}, {w}, se;\n"
            f"and.b32 so, so, 0x80808080;\nor.b32 {w}, {w}, so;\n}}\n")


def _sw_encode8_signs_ptx():
    vs = [f"v{i}" for i in range(8)]
    body = ["{\n", _SW_DECL, ".reg .f32 " + ", ".join(vs) + ";\n", "mov.f32 e, {$r8};\n"]
    for i in range(8):
        body.append(_sw_elem(i, "{$r%d}" % i, vs[i]))
    body.append(f"add.u32 {{$w0}}, {{$w0}}, {_SW_CONST};\n")
    body.append(sign_nibbles_ptx(vs, "{$w0}"))
    body.append("}")
    return "".join(body)


def _sw_encode8_ptx():
    body = ["{\n", _SW_DECL, "mov.f32 e, {$r8};\n"]
    for i in range(8):
        body.append(_sw_elem(i, "{$r%d}" % i))
    body.append(f"add.u32 {{$w0}}, {{$w0}}, {_SW_CONST};\n}}")
    return "".join(body)


def _hw_encode8_ptx():
    lines = [
        "{\n.reg .b8 c;\n.reg .b32 w;\n.reg .f32 v0;\n.reg .f32 v1;\n.reg .f32 e;\n",
        "mov.f32 e, {$r8};\n",
    ]
    for j in range(4):
        # -0 (and +0) -> +0: x*e + 0 turns -0 into +0 and leaves every other value.
        lines.append(f"mul.rn.f32 v0, {{$r{2 * j}}}, e;\nadd.rn.f32 v0, v0, 0f00000000;\n")
        lines.append(f"mul.rn.f32 v1, {{$r{2 * j + 1}}}, e;\nadd.rn.f32 v1, v1, 0f00000000;\n")
        lines.append("cvt.rn.satfinite.e2m1x2.f32 c, v1, v0;\n")
        lines.append("cvt.u32.u8 w, c;\n")
        if j == 0:
            lines.append("mov.b32 {$w0}, w;\n")
        else:
            lines.append(f"shl.b32 w, w, {8 * j};\nor.b32 {{$w0}}, {{$w0}}, w;\n")
    lines.append("}")
    return "".join(lines)


_SW_ENCODE8 = _sw_encode8_ptx()
_SW_ENCODE8_SIGNS = _sw_encode8_signs_ptx()
_HW_ENCODE8 = _hw_encode8_ptx()


def encode8(xs, enc, block_nan, hw: bool):
    """Encode 8 FP32 values (a Python list) with the block's ``enc``: Uint32 of 8 nibbles,
    element i in bits [4i, 4i+4) (even element in the low nibble of each byte).
    ``block_nan`` (nonzero when enc is NaN) zeroes the word: code 0 everywhere, like the reference."""
    code = _HW_ENCODE8 if hw else _SW_ENCODE8
    w = cute.arch.inline_ptx(
        code, write_only_types=[Uint32], read_only_args=[Float32(x) for x in xs] + [Float32(enc)]
    )
    return _ptx1(
        "{\n.reg .pred p;\nsetp.ne.u32 p, {$r1}, 0;\nselp.b32 {$w0}, 0, {$r0}, p;\n}",
        Uint32, w, Uint32(block_nan),
    )


def encode8_nonzero_products(xs, enc):
    """sm_90 software encode8 for a block whose enc is not NaN and whose nonzero products
    x * enc do not underflow to zero (the caller's per-block guarantee): the signs come from
    the products' sign bits, 8 at a time (sign_nibbles_ptx); same codes as encode8."""
    return cute.arch.inline_ptx(
        _SW_ENCODE8_SIGNS, write_only_types=[Uint32],
        read_only_args=[Float32(x) for x in xs] + [Float32(enc)])


def encode16(xs, enc, hw: bool):
    """Codes of 16 FP32 values with their block's ``enc`` (any enc; NaN: code 0 everywhere):
    two words of 8 nibbles."""
    nan = is_nan(enc)
    return encode8(xs[0:8], enc, nan, hw), encode8(xs[8:16], enc, nan, hw)


# ---------------------------------------------------------------- stochastic rounding
# Stochastic E2M1 codes (ref.formats.e2m1_encode_stochastic after the clamp of
# quantize_blocks; software on every arch) by integer arithmetic on FP32 bits. With
# a = min(|x * enc|, 6), B = bits(RZ(a * 2^-126)) puts the E2M1 grid at the multiples of 2^22
# in every binade: 0, 0.5, 1, 1.5 in the subnormals and the first normal binade (spacing
# 2^-149 there), 2, 3 and 4, 6 one binade up each, where the top mantissa bit is the code's.
# B mod 2^22 is floor(frac * 2^22) (exact for a >= 1, truncated below), and the magnitude
# rounds up iff frac >= (511 - 2b) / 512 for the element's random byte b, i.e. iff
# floor(frac * 2^22) + (2b + 1) * 2^13 >= 2^22: one carry into the code. So with
# d = 4 B + (b << 16) + 2^15 (one prmt puts b << 16 | 0x8000, one mad adds 4 B) the code is byte
# 3 of d (bits 24..26: a <= 6 has B <= 7 * 2^22 and never carries past code 7). Bytes 3 of
# eight d are gathered with six prmt and the odd ones shifted into the high nibbles: in SASS
# ~8 instructions per element (2 of them the per-element sign) plus ~1 for the gather (the
# min-of-three-terms form of the round-to-nearest encoder above took 13 with the rounding
# offset). Signs: 8 << 24 added to d for strictly negative products,
# or (nonzero-products variant) 8 at a time from the products' sign bits (sign_nibbles_ptx),
# or (16-bit inputs, sr_encode16_signed) inside the rounding offset's prmt, from a sign word.
_SR_SEL = ("0x4054", "0x4154", "0x4254", "0x4354")  # d bytes: 0x00, 0x80, b (byte k), 0x00


def sr_sign_sel(k: int, half: int) -> str:
    """prmt selector of an element with random byte k whose sign is in half `half` of its
    sign word (sign_word): bytes 0x00, 0x80, b, and 0x08 / 0x00 (strictly negative or not)."""
    return "0x%d%d46" % (5 + 2 * half, k)


def _sr_elem(i: int, x: str, w: str, v: str, sign_word: str = None, half: int = 0) -> str:
    """Element i (input register x, multiplier {$r8}, random word w) into register d{i}. Signs:
    v = "v" and no sign_word: a compare and a predicated add per element; v another register:
    the product goes to v (fma with +0) for sign_nibbles_ptx; sign_word (v = "v"): the sign
    word of the element's input (sign_word(), the element in half `half`) supplies the
    rounding offset's bytes and the sign bit, 8 << 24, in one prmt (no instruction of its
    own)."""
    if sign_word is None:
        r = f"prmt.b32 r, {w}, c, {_SR_SEL[i % 4]};"
    else:
        r = f"prmt.b32 r, {w}, {sign_word}, {sr_sign_sel(i % 4, half)};"
    lines = _magnitude_ptx(x, "{$r8}", v) + [
        "mul.rz.f32 a, a, 0f00800000;",
        "mov.b32 b, a;",
        r,
        f"mad.lo.u32 d{i}, b, 4, r;",
    ]
    if v == "v" and sign_word is None:
        lines += ["setp.lt.f32 p, v, 0f00000000;", f"@p add.u32 d{i}, d{i}, 0x08000000;"]
    return "\n".join(lines) + "\n"


def _sr_encode8_ptx(signs8: bool = False, halves: tuple = None) -> str:
    """Operands: x {$r0..7}, enc {$r8}, then the two random words (element i: byte i % 4 of
    word i // 4); with halves (the signs from sign words): then the 8 elements' sign words,
    element i in half halves[i] of its word."""
    ds = [f"d{i}" for i in range(8)]
    vs = [f"v{i}" for i in range(8)] if signs8 else ["v"] * 8
    body = ["{\n.reg .f32 v, a;\n.reg .b32 b, r, c, t, u, ev, od;\n.reg .pred p;\n",
            ".reg .b32 " + ", ".join(ds) + ";\n", "mov.b32 c, 0x8000;\n"]
    if signs8:
        body.append(".reg .f32 " + ", ".join(vs) + ";\n")
    for i in range(8):
        sw, half = (None, 0) if halves is None else ("{$r%d}" % (11 + i), halves[i])
        body.append(_sr_elem(i, "{$r%d}" % i, "{$r%d}" % (9 + i // 4), vs[i], sw, half))
    # byte 3 of d0, d2 / d4, d6 -> bytes 0, 1 / 2, 3 of the even codes (odd likewise)
    for name, a in (("ev", 0), ("od", 1)):
        body.append(f"prmt.b32 t, d{a}, d{a + 2}, 0x73;\nprmt.b32 u, d{a + 4}, d{a + 6}, 0x7300;\n"
                    f"prmt.b32 {name}, t, u, 0x7610;\n")
    body.append("shl.b32 od, od, 4;\nadd.u32 {$w0}, ev, od;\n")
    if signs8:
        body.append(sign_nibbles_ptx(vs, "{$w0}"))
    body.append("}")
    return "".join(body)


_SR_ENCODE8 = _sr_encode8_ptx()
_SR_ENCODE8_SIGNS = _sr_encode8_ptx(signs8=True)


@functools.lru_cache(maxsize=None)
def _sr_encode8_signed_ptx(halves: tuple) -> str:
    return _sr_encode8_ptx(halves=halves)


def sr_encode8(xs, enc, words):
    """Stochastic codes of 8 values with the block's enc and their 2 random words (element i:
    byte i % 4 of words[i // 4]): Uint32 of 8 nibbles (element i at bits 4i); 0 when enc is
    NaN (code 0, as the reference)."""
    w = cute.arch.inline_ptx(
        _SR_ENCODE8, write_only_types=[Uint32],
        read_only_args=[Float32(x) for x in xs] + [Float32(enc)] + [Uint32(b) for b in words])
    return Uint32(cutlass.select_(is_nan(enc) != Uint32(0), Uint32(0), w))


def sr_encode8_nonzero_products(xs, enc, words):
    """sr_encode8 for a block whose enc is not NaN and whose nonzero products x * enc do not
    underflow to zero (the caller's guarantee): signs 8 at a time (sign_nibbles_ptx)."""
    return cute.arch.inline_ptx(
        _SR_ENCODE8_SIGNS, write_only_types=[Uint32],
        read_only_args=[Float32(x) for x in xs] + [Float32(enc)] + [Uint32(b) for b in words])


def encode16_nonzero_products(xs, enc, words=None):
    """The software codes of 16 values (rounding to nearest, or stochastic with the block's 4
    random words `words`, as sr_encode16) where no nonzero product x * enc rounds to zero
    (enc >= 2^-14 or NaN with bf16 / fp16 inputs, multiples of 2^-133 / 2^-24, or their RHT
    outputs, of 2^-135 / 2^-26): signs 8 at a time; NaN enc: code 0 everywhere."""
    nan = is_nan(enc) != Uint32(0)
    out = []
    for h in range(2):
        half = xs[8 * h:8 * h + 8]
        if words is None:
            w = encode8_nonzero_products(half, enc)
        else:
            w = sr_encode8_nonzero_products(half, enc, words[2 * h:2 * h + 2])
        out.append(Uint32(cutlass.select_(nan, Uint32(0), w)))
    return out


def sr_encode16(xs, enc, words):
    """Stochastic codes of 16 values (any enc; NaN: code 0 everywhere) with the 4 random words
    of their block: two words of 8 nibbles."""
    return sr_encode8(xs[0:8], enc, words[0:2]), sr_encode8(xs[8:16], enc, words[2:4])


# Signs of 16-bit inputs (sr_encode16_signed). Where every nonzero product x * enc of a
# block is nonzero in FP32 (bf16 / fp16 inputs and enc >= 2^-14: |x * enc| >= 2^-147), the
# product is strictly negative iff the input is (IEEE compare: -0 and NaN are not), so one
# HSET2 per pair of inputs and one LOP3 give a sign word: byte 0 0x80, byte 2 0x00, bytes 1 /
# 3 0x08 where the low / high input is strictly negative. The encoder's per-element prmt then
# builds its rounding offset (b << 16 | 0x8000) with the sign bit 8 << 24 from it: one
# instruction per pair of elements instead of a compare and a predicated add per element.
def _sign_word_ptx(dtype_name: str) -> str:
    ty = "bf16x2" if dtype_name == "bf16" else "f16x2"
    return ("{\n.reg .b32 s, z;\nmov.b32 z, 0;\n"
            f"set.lt.u32.{ty} s, {{$r0}}, z;\n"
            "lop3.b32 {$w0}, s, 0x08000800, 0x80, 0xEA;\n}")


def sign_word(word, dtype_name: str):
    """The sign word (see above) of a packed pair of bf16 / fp16 inputs."""
    return _ptx1(_sign_word_ptx(dtype_name), Uint32, Uint32(word))


def input_signs16(words, dtype_name: str):
    """(sign words, halves) for sr_encode16_signed of a block of 16 consecutive 16-bit inputs
    packed two per word: element i is in half i % 2 of word i // 2."""
    sws = [sign_word(w, dtype_name) for w in words]
    return [sws[i // 2] for i in range(16)], [i % 2 for i in range(16)]


def sr_encode16_signed(xs, enc, words, signs, halves):
    """sr_encode16 of 16-bit inputs whose block has enc >= 2^-14 or NaN (the caller's
    guarantee), with the signs from sign words: element i is in half halves[i] of
    signs[i]."""
    nan = is_nan(enc) != Uint32(0)
    out = []
    for h in range(2):
        ptx = _sr_encode8_signed_ptx(tuple(halves[8 * h:8 * h + 8]))
        w = cute.arch.inline_ptx(
            ptx, write_only_types=[Uint32],
            read_only_args=[Float32(x) for x in xs[8 * h:8 * h + 8]] + [Float32(enc)]
            + [Uint32(b) for b in words[2 * h:2 * h + 2]]
            + [Uint32(s) for s in signs[8 * h:8 * h + 8]])
        out.append(Uint32(cutlass.select_(nan, Uint32(0), w)))
    return out


def rotl_nibbles(w, n):
    """Rotate a word of 8 nibbles left by ``n`` nibbles (run-time n in 0..7): nibble i moves to
    nibble (i + n) % 8."""
    return _ptx1(
        "{\n.reg .b32 s;\nshl.b32 s, {$r1}, 2;\nshf.l.wrap.b32 {$w0}, {$r0}, {$r0}, s;\n}",
        Uint32, Uint32(w), Uint32(n),
    )


# ---------------------------------------------------------------- packed 16-bit amax
def _amax_pairs_ptx(n: int, dtype_name: str) -> str:
    """max.NaN of |.| over n packed 16-bit pairs: one pair (register {$w0}) of two maxima."""
    ty = "bf16x2" if dtype_name == "bf16" else "f16x2"
    lines = ["{\n.reg .b32 a;\n", f"abs.{ty} {{$w0}}, {{$r0}};\n"]
    for i in range(1, n):
        lines.append(f"abs.{ty} a, {{$r{i}}};\nmax.NaN.{ty} {{$w0}}, {{$w0}}, a;\n")
    lines.append("}")
    return "".join(lines)


def amax_pairs(words, dtype_name: str):
    """NaN-propagating max of |x| over packed bf16/fp16 words, per half: one Uint32 with the
    maximum of the low halves in its low half and of the high halves in its high half (the
    packed min/max pipe instead of one FP32 max per element)."""
    return cute.arch.inline_ptx(_amax_pairs_ptx(len(words), dtype_name),
                                write_only_types=[Uint32],
                                read_only_args=[Uint32(w) for w in words])


def amax_fold(pair, dtype_name: str):
    """FP32 max.NaN of the two halves of an amax_pairs result (exact)."""
    if dtype_name == "bf16":
        return _ptx1(
            "{\n.reg .b16 l;\n.reg .b16 h;\n.reg .b16 m;\n.reg .b16 z;\nmov.b32 {l, h}, {$r0};\n"
            "max.NaN.bf16 m, l, h;\nmov.b16 z, 0;\nmov.b32 {$w0}, {z, m};\n}",
            Float32, Uint32(pair))
    return _ptx1(
        "{\n.reg .b16 l;\n.reg .b16 h;\n.reg .b16 m;\nmov.b32 {l, h}, {$r0};\n"
        "max.NaN.f16 m, l, h;\ncvt.f32.f16 {$w0}, m;\n}",
        Float32, Uint32(pair))


# ---------------------------------------------------------------- bf16/fp16 unpack
def unpack_lo(word, dtype_name: str):
    """Low 16-bit element of a 32-bit word as FP32 (exact)."""
    if dtype_name == "bf16":
        return _ptx1("{\n.reg .b32 t;\nshl.b32 t, {$r0}, 16;\nmov.b32 {$w0}, t;\n}", Float32, Uint32(word))
    return _ptx1(
        "{\n.reg .b16 l;\n.reg .b16 h;\nmov.b32 {l, h}, {$r0};\ncvt.f32.f16 {$w0}, l;\n}",
        Float32, Uint32(word),
    )


def unpack_hi(word, dtype_name: str):
    """High 16-bit element of a 32-bit word as FP32 (exact)."""
    if dtype_name == "bf16":
        return _ptx1(
            "{\n.reg .b32 t;\nand.b32 t, {$r0}, 0xFFFF0000;\nmov.b32 {$w0}, t;\n}", Float32, Uint32(word)
        )
    return _ptx1(
        "{\n.reg .b16 l;\n.reg .b16 h;\nmov.b32 {l, h}, {$r0};\ncvt.f32.f16 {$w0}, h;\n}",
        Float32, Uint32(word),
    )


def half_to_f32(h16, dtype_name: str):
    """A 16-bit element held in the low half of a Uint32 as FP32 (exact)."""
    return unpack_lo(h16, dtype_name)


# ---------------------------------------------------------------- memory accessors
# The quantize kernels' accessors (common.ptx): Uint32 words, volatile, no memory clobber.
def ld_shared_v4(addr):
    """16-byte shared-memory load at a 32-bit shared address: 4 x Uint32."""
    return ld_shared(addr, 4, clobber=False, dtype=Uint32)


def ld_shared_v2(addr):
    """8-byte shared-memory load at a 32-bit shared address: 2 x Uint32."""
    return ld_shared(addr, 2, clobber=False, dtype=Uint32)


def st_shared_v2(addr, v0, v1):
    st_shared(addr, Uint32(v0), Uint32(v1), clobber=False)


def st_shared_v4(addr, words):
    st_shared(addr, *[Uint32(w) for w in words], clobber=False)


def st_shared_u32(addr, v):
    st_shared(addr, Uint32(v), clobber=False)


def st_shared_u8(addr, v):
    st_shared(addr, Uint32(v), clobber=False, ty="b8")


def ld_shared_u32(addr):
    return ld_shared(addr, clobber=False, dtype=Uint32)


def st_global_u8(addr, v, pred=None):
    st_global(addr, Uint32(v), ty="b8", clobber=False, pred=pred)


def st_global_u32(addr, v):
    st_global(addr, Uint32(v), clobber=False)


def st_global_v2(addr, v0, v1, pred=None):
    st_global(addr, Uint32(v0), Uint32(v1), clobber=False, pred=pred)


def st_global_v4(addr, words):
    st_global(addr, *[Uint32(w) for w in words], clobber=False)


def ld_global_nc_v4(addr):
    """16-byte read-only global load: 4 x Uint32."""
    return ld_global(addr, 4, nc=True, volatile=True, dtype=Uint32)


def ld_global_f32(addr):
    return ld_global(addr, ty="f32", volatile=True)


def ld_global_v2_s32(addr):
    """8-byte read-only global load: 2 x Int32."""
    return ld_global(addr, 2, nc=True, volatile=True, dtype=Int32)


def redux_max_u32(v):
    """Warp-wide max of a Uint32 (every lane gets it)."""
    return _ptx1("redux.sync.max.u32 {$w0}, {$r0}, 0xFFFFFFFF;", Uint32, Uint32(v))


def max_u32(a, b):
    return _ptx1("max.u32 {$w0}, {$r0}, {$r1};", Uint32, Uint32(a), Uint32(b))


def shfl_xor_max_nan(x, mask):
    """max.NaN of x and the value of lane (lane ^ mask)."""
    return _ptx1(
        "{\n.reg .f32 o;\nshfl.sync.bfly.b32 o, {$r0}, " + str(mask) + ", 31, 0xFFFFFFFF;\n"
        "max.NaN.f32 {$w0}, {$r0}, o;\n}", Float32, Float32(x),
    )


def warp_max_nan(x):
    for m in (16, 8, 4, 2, 1):
        x = shfl_xor_max_nan(x, m)
    return x


def lanes_transpose_max16(vals, lane):
    """max.NaN of 16 per-lane values over the warp, as a transpose-reduction: at each butterfly
    step a lane keeps half of its values and trades the other half with its partner (8, 4, 2, 1
    shuffles, then a last full step): lane l ends with the max of value l // 2 (16 shuffles
    instead of 80)."""
    for m in (16, 8, 4, 2):
        half = len(vals) // 2
        hi = (lane & m) != 0
        nxt = []
        for i in range(half):
            keep = cutlass.select_(hi, vals[i + half], vals[i])
            send = cutlass.select_(hi, vals[i], vals[i + half])
            got = cute.arch.shuffle_sync_bfly(Float32(send), offset=m)
            nxt.append(fmax_nan(keep, got))
        vals = nxt
    return shfl_xor_max_nan(vals[0], 1)
