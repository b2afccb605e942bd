"""NVFP4 cast kernels for the Recipe options beyond the plain cast (issues 4 and 5):
16x16 block scales, the columnwise RHT, stochastic rounding (Philox), 1x64 window scaling,
4over6 (mae/mse, e4m3_max 448/256, exact or FP16 product-domain error) and grouped inputs,
each bit-exact to `cute_fp4.ref.quantize` with the same Recipe.

Grouped layout (one launch for any number of groups; a single tensor is one group): the
[sum(M_i), K] input is split along M. The host gives
  * ttab int32 [T, 2]: per 64-row tile (group, first group-local row); tiles never straddle
    groups; with swizzled rowwise scales every group gets ceil(M_i/128)*2 tiles (the extra
    ones only write the zero padding of the 128-row scale tiles);
  * gtab int64 [G, 10]: per group (first row, rows, byte offsets of its rowwise data, rowwise
    scales, columnwise data, columnwise scales in the flat output buffers, float offsets of its
    row / column amax, the Philox seed and offset).

RecipeCastKernel: one CTA (256 threads) per 64x64 input tile: 16-byte global loads into an
FP32 smem tile (zero-filled outside the group), then a rowwise pass (thread = one 1x16 block
of a row) and a columnwise pass (thread = one 16x1 block of a column, RHT'd in registers).
Four consecutive lanes hold the four blocks of one 64-element window (window64 amax by two
shuffles); 16x16 tile amaxes and the 16x16 4over6 error trees go through smem.

RecipeAmax: the tensor / token outer amax of a group (after the RHT for the columnwise twin),
over chunks of tiles that stay inside one group; accumulators live in per-thread smem slots,
flushed with `red.global.max.u32` on the bit pattern (outputs zeroed beforehand).

Every FP32 step is one explicit correctly rounded PTX operation in the reference's order
(no contraction, no approximate division, no flush-to-zero).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_fp4.common import encode as E
from cute_fp4.common.philox import philox_block16, round_keys
from cute_fp4.common.scales import (e2m1_to_f32, e4m3_to_f32, outer_encode_scale,
                                    swizzled_scale_offset)
from cute_fp4.ref.quantize import RHT_SIGNS

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
TILE = 64
THREADS = 256
SX_STRIDE = TILE + 1  # FP32 smem tile row stride (odd: column reads are conflict-free)
ONE_SIXTH = 0.16666667  # fp32(1/6): the plain block scale multiplies S_enc by it
G_ROW0, G_ROWS, G_Q, G_S, G_QT, G_ST, G_AR, G_AC, G_SEED, G_OFFSET = range(10)
GTAB_COLS = 10
FOUR_OVER_SIX = (None, "mae", "mse")


def _f(code, *args):
    return cute.arch.inline_ptx(code, write_only_types=[Float32],
                                read_only_args=[Float32(a) for a in args])


def add_rn(a, b):
    return _f("add.rn.f32 {$w0}, {$r0}, {$r1};", a, b)


def sub_rn(a, b):
    return _f("sub.rn.f32 {$w0}, {$r0}, {$r1};", a, b)


def neg(a):
    return _f("neg.f32 {$w0}, {$r0};", a)


# Stochastic E2M1 codes of 8 elements (ref.formats.e2m1_encode_stochastic after the clamp of
# quantize_blocks): with a = min(|x * enc|, 6) and the element's random byte b, the code is the
# E2M1 grid value at or below a + (b + 1/2) / 256 of the grid gap, i.e. the magnitude rounds up
# iff frac >= (511 - 2b) / 512. F = float(0x3F804000 | b << 15) = 1 + y, y = (2b + 1) / 512
# (exact, no conversion instruction); the gap-scaled offsets c = g * y for the gaps g = 0.5, 1, 2
# are exact FMAs of F. Like common/encode.py's RN encoder, the code is the FP32 min of one term
# per gap: floor(2 (a + y / 2)), floor(a + y) + 2, floor((a + 2y) / 2) + 4, each
# add.rz(a, c) (its floor onto the gap's grid is that of the exact sum: grid points are FP32
# numbers and RZ is monotone) then an rz add / FMA with the magic 2^23 (ulp 1) holding
# 0x4B000000 + term; the word sums bits << 4i, the constants -0x4B000000 << 4i once per word,
# and 8 << 4i for x * enc < 0. A NaN product only occurs with a NaN enc (NaN block amax), and
# sr_encode8's caller zeroes those words (code 0, as the reference).
_SR_ELEM = (
    "mul.rn.f32 v, {x}, e;\n"
    "abs.f32 a, v;\nmin.f32 a, a, 0f40C00000;\n"
    "{byte}and.b32 b, b, 0x007F8000;\nor.b32 b, b, 0x3F804000;\nmov.b32 f, b;\n"
    "fma.rn.f32 c, f, 0f3F000000, 0fBF000000;\nadd.rz.f32 t, a, c;\n"
    "fma.rz.f32 k, t, 0f40000000, 0f4B000000;\n"
    "sub.rn.f32 c, f, 0f3F800000;\nadd.rz.f32 t, a, c;\nadd.rz.f32 t, t, 0f4B000002;\n"
    "min.f32 k, k, t;\n"
    "fma.rn.f32 c, f, 0f40000000, 0fC0000000;\nadd.rz.f32 t, a, c;\n"
    "fma.rz.f32 t, t, 0f3F000000, 0f4B000004;\nmin.f32 k, k, t;\n"
    "mov.b32 b, k;\n{pack}"
    "setp.lt.f32 p, v, 0f00000000;\n@p add.u32 {$w0}, {$w0}, {sign};\n"
)
# byte k of a random word to bits 15..22
_SR_BYTE = ("shl.b32 b, {w}, 15;\n", "shl.b32 b, {w}, 7;\n", "shr.b32 b, {w}, 1;\n",
            "shr.b32 b, {w}, 9;\n")
_SR_CONST = (-0x4B000000 * 0x11111111) % 2**32


def _sr_encode8_ptx() -> str:
    body = ["{\n.reg .f32 v, a, f, c, t, k, e;\n.reg .b32 b;\n.reg .pred p;\n"
            "mov.f32 e, {$r8};\n"]
    for i in range(8):
        pack = "mov.b32 {$w0}, b;\n" if i == 0 else \
            f"shl.b32 b, b, {4 * i};\nadd.u32 {{$w0}}, {{$w0}}, b;\n"
        body.append(_SR_ELEM.replace("{x}", "{$r%d}" % i)
                    .replace("{byte}", _SR_BYTE[i % 4].replace("{w}", "{$r%d}" % (9 + i // 4)))
                    .replace("{pack}", pack).replace("{sign}", str(8 << (4 * i))))
    body.append(f"add.u32 {{$w0}}, {{$w0}}, {_SR_CONST};\n}}")
    return "".join(body)


_SR_ENCODE8 = _sr_encode8_ptx()


def sr_encode8(xs, enc, words):
    """Stochastic codes of 8 values with the block's enc and their 2 random words (element i:
    byte i % 4 of words[i // 4]): Uint32 of 8 nibbles (element i at bits 4i); 0 when enc is
    NaN."""
    w = cute.arch.inline_ptx(
        _SR_ENCODE8, write_only_types=[Uint32],
        read_only_args=[Float32(x) for x in xs] + [Float32(enc)] + [Uint32(b) for b in words])
    return Uint32(cutlass.select_(E.is_nan(enc) != Uint32(0), Uint32(0), w))


# Round-to-nearest E2M1 codes of 8 elements (the software encoder of common/encode.py) that
# also return each element's E2M1 value: the grid value add.rn(a, M) - M (exact), negated for
# x * enc < 0; for the 4over6 error without decoding the codes again. NaN products (NaN enc)
# give value 6 and a zeroed word; the NaN scale makes their candidate values NaN anyway.
_RN_VAL_ELEM = (
    "mul.rn.f32 v, {x}, e;\n"
    "abs.f32 a, v;\nmin.f32 a, a, 0f40C00000;\n"
    "mov.b32 b, a;\nand.b32 m, b, 0x7F800000;\nmax.u32 m, m, 0x3F800000;\n"
    "shr.u32 t, m, 22;\nadd.u32 m, m, 0x0B000000;\nmov.b32 mf, m;\n"
    "add.rn.f32 a, a, mf;\nsub.rn.f32 {val}, a, mf;\n"
    "mov.b32 b, a;\nsub.u32 b, b, m;\nadd.u32 b, b, t;\nsub.u32 b, b, 254;\n"
    "setp.lt.f32 p, v, 0f00000000;\n@p or.b32 b, b, 8;\n@p neg.f32 {val}, {val};\n"
    "{pack}"
)


def _encode8_values_ptx() -> str:
    body = ["{\n.reg .f32 v, a, mf, e;\n.reg .b32 b, m, t;\n.reg .pred p;\n"
            "mov.f32 e, {$r8};\n"]
    for i in range(8):
        pack = "mov.b32 {$w0}, b;\n" if i == 0 else \
            f"shl.b32 b, b, {4 * i};\nor.b32 {{$w0}}, {{$w0}}, b;\n"
        body.append(_RN_VAL_ELEM.replace("{x}", "{$r%d}" % i).replace("{val}", "{$w%d}" % (1 + i))
                    .replace("{pack}", pack))
    body.append("}")
    return "".join(body)


_ENCODE8_VALUES = _encode8_values_ptx()


def encode8_values(xs, enc):
    """(Uint32 of 8 RN codes, 0 when enc is NaN; list of the 8 E2M1 values as Float32)."""
    out = cute.arch.inline_ptx(
        _ENCODE8_VALUES, write_only_types=[Uint32] + [Float32] * 8,
        read_only_args=[Float32(x) for x in xs] + [Float32(enc)])
    word = Uint32(cutlass.select_(E.is_nan(enc) != Uint32(0), Uint32(0), out[0]))
    return word, list(out[1:])


# Correctly rounded division by the 4over6 error denominators d = 6 * e4m3_max (2688, 1536)
# without div.rn (MUFU.RCP, Newton steps, FCHK and a slow-path branch per element): with
# r = fp32(1/d), q = RN(x * r), t = fma(q, d, -x), x / d = fma(-t, r, q). Verified against IEEE
# FP32 division for every FP32 x of exponent field >= 8 (d = 2688) / >= 10 (d = 1536), i.e. for
# all 2^-117 <= |x| <= FLT_MAX, and for +-0 (sign kept); it fails for some smaller x (quotients
# near the subnormal range) and for +-inf (NaN), where the callers keep div.rn
# (tests/test_compile_quant_recipes.py emulates it exactly; notes/quant_recipes.md: the
# exhaustive run). The fma form t = q * d - x keeps the sign of a zero quotient.
# d -> (fp32 d, fp32(1/d)) as PTX hex literals
DIV_CONST = {2688: ("0f45280000", "0f39C30C31"), 1536: ("0f44C00000", "0f3A2AAAAB")}
DIV_CONST_MIN_HEX = "0f05000000"  # 2^-117


def div_const(x, d: int):
    """RN(x / d) for d in DIV_CONST and x = +-0, NaN or 2^-117 <= |x| <= FLT_MAX."""
    dh, rh = DIV_CONST[d]
    return _f("{\n.reg .f32 q, t;\n"
              f"mul.rn.f32 q, {{$r0}}, {rh};\nneg.f32 t, {{$r0}};\n"
              f"fma.rn.f32 t, q, {dh}, t;\nneg.f32 t, t;\n"
              f"fma.rn.f32 {{$w0}}, t, {rh}, q;\n}}", x)


def div_const_safe(sf, g_amax):
    """1 when every candidate value x = (v * sf) * g_amax of a block (v an E2M1 value, |v| in
    [0.5, 6], or 0) is in div_const's exact domain: RN(6 * sf * g_amax) finite and
    RN(0.5 * sf * g_amax) >= 2^-117 (RN is monotone; v * sf is exact), or sf * g_amax == 0
    exactly (every x is +-0). NaN scale or amax: 0."""
    return cute.arch.inline_ptx(
        "{\n.reg .f32 a;\n.reg .pred p, q;\n"
        "mul.rn.f32 a, {$r0}, 0f40C00000;\nmul.rn.f32 a, a, {$r1};\n"
        "setp.lt.f32 p, a, 0f7F800000;\n"
        "mul.rn.f32 a, {$r0}, 0f3F000000;\nmul.rn.f32 a, a, {$r1};\n"
        f"setp.ge.f32 q, a, {DIV_CONST_MIN_HEX};\n"
        "setp.eq.or.f32 q, {$r0}, 0f00000000, q;\nsetp.eq.or.f32 q, {$r1}, 0f00000000, q;\n"
        "and.pred p, p, q;\nselp.u32 {$w0}, 1, 0, p;\n}",
        write_only_types=[Uint32], read_only_args=[Float32(sf), Float32(g_amax)])


def fp16_products2(byte, scale_code):
    """sm_100a: the two E2M1 x E4M3 products of a byte of two codes, in FP16 (exact), as FP32
    (low nibble first), via cvt.rn.f16x2.e2m1x2 / cvt.rn.f16x2.e4m3x2 and mul.rn.f16x2."""
    return cute.arch.inline_ptx(
        "{\n.reg .b8 c;\n.reg .b16 s;\n.reg .b32 q;\n.reg .b32 sc;\n.reg .b32 pr;\n"
        ".reg .f16 lo;\n.reg .f16 hi;\n.reg .b32 t;\n"
        "cvt.u8.u32 c, {$r0};\ncvt.rn.f16x2.e2m1x2 q, c;\n"
        "and.b32 t, {$r1}, 0xFF;\nshl.b32 sc, t, 8;\nor.b32 t, t, sc;\ncvt.u16.u32 s, t;\n"
        "cvt.rn.f16x2.e4m3x2 sc, s;\nmul.rn.f16x2 pr, q, sc;\nmov.b32 {lo, hi}, pr;\n"
        "cvt.f32.f16 {$w0}, lo;\ncvt.f32.f16 {$w1}, hi;\n}",
        write_only_types=[Float32, Float32], read_only_args=[Uint32(byte), Uint32(scale_code)])


def rht16(xs, scale: bool = True):
    """ref.quantize.rht of 16 values: sign flips, butterflies at strides 1, 2, 4, 8, x 0.25
    (scale=False leaves out the x 0.25: amax(|y| * 0.25) = amax(|y|) * 0.25, RN is monotone)."""
    ys = [neg(x) if s < 0 else x for x, s in zip(xs, RHT_SIGNS)]
    for h in (1, 2, 4, 8):
        nxt = list(ys)
        for j in range(16):
            if not j & h:
                nxt[j] = add_rn(ys[j], ys[j + h])
                nxt[j + h] = sub_rn(ys[j], ys[j + h])
        ys = nxt
    if not scale:
        return ys
    return [E.mul_rn(y, Float32(0.25)) for y in ys]


def block_amax(xs):
    a = Float32(0.0)
    for x in xs:
        a = E.abs_max_nan(a, x)
    return a


def lanes4_max(a):
    """max.NaN over the four consecutive lanes 4j .. 4j+3."""
    return E.shfl_xor_max_nan(E.shfl_xor_max_nan(a, 1), 2)


def tree16(vals):
    """ref.quantize._sum_rows_tree of 16 values: (i, i+8), (i, i+4), (i, i+2), (i, i+1)."""
    for half in (8, 4, 2, 1):
        vals = [add_rn(vals[i], vals[i + half]) for i in range(half)]
    return vals[0]


def nibble(w0, w1, i):
    w = w0 if i < 8 else w1
    return (Uint32(w) >> Uint32(4 * (i % 8))) & Uint32(0xF)


class _TileLoader:
    """Shared by both kernels: 64x64 tile of a group -> FP32 smem (zeros outside)."""

    def _setup(self, dtype):
        if dtype not in DTYPES:
            raise TypeError(f"unsupported input dtype {dtype!r} (bf16, fp16, fp32)")
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.vpr = TILE * self.esize // 16  # 16-byte vectors per tile row
        self.epv = 16 // self.esize  # elements per vector

    def load_tile(self, sx, xbase, grow0, nrows, kt, K, tidx):
        for i in range(TILE * self.vpr // THREADS):
            v = tidx + i * THREADS
            r = v // self.vpr
            cv = v % self.vpr
            col = kt * TILE + cv * self.epv
            ok = (r < nrows) & (col < K)
            addr = xbase + ((grow0 + Int64(r)) * Int64(K) + Int64(col)) * self.esize
            words = E.ld_global_nc_v4(Int64(cutlass.select_(ok, addr, xbase)))
            vals = []
            for w in words:
                wv = Uint32(cutlass.select_(ok, w, Uint32(0)))
                if self.esize == 4:
                    vals.append(E.bits_f32(wv))
                else:
                    vals.append(E.unpack_lo(wv, self.dtype_name))
                    vals.append(E.unpack_hi(wv, self.dtype_name))
            for j in range(self.epv):
                sx[r, cv * self.epv + j] = vals[j]


class RecipeCastKernel(_TileLoader):
    """Compile-time config: input dtype, outputs, scale layout and the Recipe options."""

    def __init__(self, dtype: str, rowwise: bool, columnwise: bool, swizzle: bool,
                 scaling: str, block_rows: int, rht: bool, stochastic: bool,
                 four_over_six, e4m3_max: int, fast_math: bool):
        self._setup(dtype)
        if not (rowwise or columnwise):
            raise ValueError("RecipeCastKernel: at least one of rowwise/columnwise is required")
        if scaling not in ("tensor", "token", "window64"):
            raise ValueError(f"RecipeCastKernel: unknown scaling {scaling!r}")
        if block_rows not in (1, 16):
            raise ValueError(f"RecipeCastKernel: block_rows must be 1 or 16, got {block_rows}")
        if four_over_six not in FOUR_OVER_SIX:
            raise ValueError(f"RecipeCastKernel: four_over_six must be one of {FOUR_OVER_SIX}")
        if e4m3_max not in (448, 256) or (e4m3_max != 448 and four_over_six is None):
            raise ValueError("RecipeCastKernel: e4m3_max 256 needs four_over_six")
        if stochastic and four_over_six is not None:
            raise ValueError("RecipeCastKernel: stochastic rounding excludes four_over_six")
        if fast_math and four_over_six is None:
            raise ValueError("RecipeCastKernel: fast_math needs four_over_six")
        self.rowwise, self.columnwise, self.swizzle = rowwise, columnwise, swizzle
        self.scaling, self.block_rows, self.rht = scaling, block_rows, rht
        self.stochastic, self.fos = stochastic, four_over_six
        self.e4m3_max, self.fast_math = e4m3_max, fast_math

    @cute.jit
    def __call__(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor,
                 amax_r: cute.Tensor, amax_c: cute.Tensor, q: cute.Tensor, s: cute.Tensor,
                 qt: cute.Tensor, st: cute.Tensor, n_kt: Int32, stream):
        self.hw = E.has_hw_e2m1()
        T = ttab.shape[0]
        self.kernel(x, ttab, gtab, amax_r, amax_c, q, s, qt, st).launch(
            grid=(n_kt, T, 1), block=(THREADS, 1, 1), stream=stream)

    # ------------------------------------------------------------ block numerics
    def _encode16(self, xs, enc, idx0, stream, keys, offset):
        """Codes of 16 values with the block's enc: two Uint32 words of 8 nibbles."""
        if cutlass.const_expr(not self.stochastic):
            nan = E.is_nan(enc)
            return E.encode8(xs[0:8], enc, nan, self.hw), E.encode8(xs[8:16], enc, nan, self.hw)
        words = philox_block16(idx0, offset, stream, keys)
        return sr_encode8(xs[0:8], enc, words[0:2]), sr_encode8(xs[8:16], enc, words[2:4])

    def _candidate(self, xs, enc, code, g_amax, s_enc):
        """One 4over6 candidate: (w0, w1, its error). sm_90: the software encode also returns
        each element's E2M1 value; sm_100a: hardware encode, values decoded from the codes
        (fast_math: FP16 products by cvt.rn.f16x2)."""
        sf = e4m3_to_f32(code)
        safe = Uint32(1)
        if cutlass.const_expr(not self.fast_math):
            safe = div_const_safe(sf, g_amax)
        if cutlass.const_expr(self.hw):
            w0, w1 = self._encode16(xs, enc, None, 0, None, None)
            if cutlass.const_expr(self.fast_math):
                prods = []
                for p in range(8):
                    byte = (Uint32(w0 if p < 4 else w1) >> Uint32(8 * (p % 4))) & Uint32(0xFF)
                    prods += list(fp16_products2(byte, code))
                return w0, w1, self._error(xs, prods, None, g_amax, s_enc, Float32(0.0), safe)
            vals = [e2m1_to_f32(nibble(w0, w1, i)) for i in range(16)]
            return w0, w1, self._error(xs, vals, sf, g_amax, s_enc, Float32(0.0), safe)
        # eight elements at a time (fewer live registers), the sum stays in element order
        w0, vals = encode8_values(xs[0:8], enc)
        err = self._error(xs[0:8], vals, sf, g_amax, s_enc, Float32(0.0), safe)
        w1, vals = encode8_values(xs[8:16], enc)
        return w0, w1, self._error(xs[8:16], vals, sf, g_amax, s_enc, err, safe)

    @cute.jit
    def _error(self, xs, vals, sf, g_amax, s_enc, err, safe):
        """4over6 error of one candidate: err plus a sequential sum over the elements of the
        reference terms: fast_math (value * s) - x * S_enc; else (value * s) * amax /
        (6 * e4m3_max) - x, the IEEE division by div_const where the block is in its exact
        domain (safe != 0), else by div.rn. sf None: vals are the FP16-domain products."""
        if cutlass.const_expr(self.fast_math):
            err = self._error_terms(xs, vals, sf, g_amax, s_enc, err, False)
        else:
            if safe != Uint32(0):
                err = self._error_terms(xs, vals, sf, g_amax, s_enc, err, True)
            else:
                err = self._error_terms(xs, vals, sf, g_amax, s_enc, err, False)
        return err

    def _error_terms(self, xs, vals, sf, g_amax, s_enc, err, by_const: bool):
        for i in range(len(vals)):
            cand = vals[i]
            if sf is not None:
                cand = E.mul_rn(cand, sf)  # E2M1 x E4M3: exact
            if cutlass.const_expr(self.fast_math):
                d = sub_rn(cand, E.mul_rn(xs[i], s_enc))
            else:
                cand = E.mul_rn(cand, g_amax)
                if by_const:
                    cand = div_const(cand, 6 * self.e4m3_max)
                else:
                    cand = E.div_rn(cand, Float32(6.0 * self.e4m3_max))
                d = sub_rn(cand, xs[i])
            if cutlass.const_expr(self.fos == "mse"):
                err = add_rn(err, E.mul_rn(d, d))
            else:
                err = add_rn(err, E.fabs(d))
        return err

    def _block(self, xs, eam, g_amax, idx0, stream, keys, offset):
        """Plain path: (scale code, w0, w1). 4over6: both candidates and their errors."""
        s_enc = outer_encode_scale(g_amax, self.e4m3_max)
        s_dec = E.rcp_rn(s_enc)
        if cutlass.const_expr(self.fos is None):
            code, enc = E.block_scale(eam, E.mul_rn(s_enc, Float32(ONE_SIXTH)), s_dec)
            w0, w1 = self._encode16(xs, enc, idx0, stream, keys, offset)
            return code, w0, w1
        base = E.mul_rn(E.div_rn(eam, Float32(6.0)), s_enc)  # IEEE amax_b / 6, as ref.true_div
        c6 = E.e4m3_code(base)
        c4 = E.e4m3_code(E.mul_rn(base, Float32(1.5)))
        a0, a1, e6 = self._candidate(xs, E.enc_from_code(c6, s_dec), c6, g_amax, s_enc)
        b0, b1, e4 = self._candidate(xs, E.enc_from_code(c4, s_dec), c4, g_amax, s_enc)
        return c6, a0, a1, c4, b0, b1, e6, e4

    def _pick(self, cands, e6, e4):
        c6, a0, a1, c4, b0, b1 = cands[:6]
        p4 = e4 < e6
        return (Uint32(cutlass.select_(p4, c4, c6)), Uint32(cutlass.select_(p4, b0, a0)),
                Uint32(cutlass.select_(p4, b1, a1)))

    # ------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor,
               amax_r: cute.Tensor, amax_c: cute.Tensor, q: cute.Tensor, s: cute.Tensor,
               qt: cute.Tensor, st: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        kt, tt, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sx = smem.allocate_tensor(Float32, cute.make_layout((TILE, TILE), stride=(SX_STRIDE, 1)), 16)
        stam = smem.allocate_tensor(Float32, cute.make_layout(16), 16)
        serr = smem.allocate_tensor(Float32, cute.make_layout((2, THREADS), stride=(THREADS, 1)), 16)

        g = ttab[tt, 0]
        lr0 = ttab[tt, 1]
        row0 = gtab[g, G_ROW0]
        Mg = Int32(gtab[g, G_ROWS])
        K = x.shape[1]
        nrows = Mg - lr0
        self.load_tile(sx, x.iterator.toint(), row0 + Int64(lr0), nrows, kt, K, tidx)
        cute.arch.barrier()

        if cutlass.const_expr(self.block_rows == 16):
            # tile amax of the 16 16x16 tiles: 16 threads per tile, one row each
            ti = tidx // 16
            j = tidx % 16
            vals = []
            for i in cutlass.range_constexpr(16):
                vals.append(sx[(ti // 4) * 16 + j, (ti % 4) * 16 + i])
            a = block_amax(vals)
            for m in (8, 4, 2, 1):
                a = E.shfl_xor_max_nan(a, m)
            if j == 0:
                stam[ti] = a
            cute.arch.barrier()

        seed = gtab[g, G_SEED]
        keys = []
        if cutlass.const_expr(self.stochastic):
            keys = round_keys(Uint32(seed & 0xFFFFFFFF), Uint32(seed >> 32))
        offset = Uint32(gtab[g, G_OFFSET])
        if cutlass.const_expr(self.rowwise):
            self._row_pass(sx, stam, serr, tidx, g, lr0, nrows, Mg, kt, K, gtab, amax_r,
                           q, s, keys, offset)
        if cutlass.const_expr(self.columnwise):
            self._col_pass(sx, stam, serr, tidx, g, lr0, Mg, kt, K, gtab, amax_c,
                           qt, st, keys, offset)

    def _finish(self, xs, eam, g_amax, idx0, stream, keys, offset, serr, tidx):
        """(scale code, w0, w1) of this thread's block; 16x16 4over6 sums the errors of the
        tile's 16 blocks (thread slots 4 * j + (tidx % 4) + 64 * (tidx // 64)) in tree order."""
        res = self._block(xs, eam, g_amax, idx0, stream, keys, offset)
        if cutlass.const_expr(self.fos is None):
            return res
        e6 = res[6]
        e4 = res[7]
        if cutlass.const_expr(self.block_rows == 16):
            serr[0, tidx] = e6
            serr[1, tidx] = e4
            cute.arch.barrier()
            first = (tidx // 64) * 64 + tidx % 4
            v6 = []
            v4 = []
            for j in range(16):
                v6.append(serr[0, first + 4 * j])
                v4.append(serr[1, first + 4 * j])
            e6 = tree16(v6)
            e4 = tree16(v4)
            cute.arch.barrier()
        return self._pick(res, e6, e4)

    # ------------------------------------------------------------ rowwise pass
    @cute.jit
    def _row_pass(self, sx, stam, serr, tidx, g, lr0, nrows, Mg, kt, K, gtab, amax_r,
                  q, s, keys, offset):
        r = tidx // 4
        b = tidx % 4
        lrow = lr0 + r
        xs = []
        for i in cutlass.range_constexpr(16):
            xs.append(sx[r, b * 16 + i])
        am = block_amax(xs)
        row_ok = r < nrows
        col0 = kt * TILE + b * 16
        ok = row_ok & (col0 < K)
        ar_base = amax_r.iterator.toint() + gtab[g, G_AR] * 4
        g_amax = Float32(0.0)
        if cutlass.const_expr(self.scaling == "tensor"):
            g_amax = E.ld_global_f32(ar_base)
        if cutlass.const_expr(self.scaling == "token"):
            g_amax = E.ld_global_f32(ar_base + Int64(cutlass.min(lrow, Mg - 1)) * 4)
        if cutlass.const_expr(self.scaling == "window64"):
            g_amax = lanes4_max(am)
            if (b == 0) & row_ok & (kt * TILE < K):
                E.st_global_u32(ar_base + (Int64(lrow) * Int64(K // TILE) + Int64(kt)) * 4,
                                E.f32_bits(g_amax))
        eam = am
        if cutlass.const_expr(self.block_rows == 16):
            eam = stam[(r // 16) * 4 + b]
        idx0 = Int64(lrow) * Int64(K) + Int64(col0)
        code, w0, w1 = self._finish(xs, eam, g_amax, idx0, 0, keys, offset, serr, tidx)

        if ok:
            E.st_global_v2(q.iterator.toint() + gtab[g, G_Q] + Int64(lrow) * Int64(K // 2)
                           + Int64(col0 // 2), w0, w1)
        nsc = K // 16
        scol = kt * 4 + b
        s_base = s.iterator.toint() + gtab[g, G_S]
        if cutlass.const_expr(self.swizzle):
            in_pad = (lrow < (Mg + 127) // 128 * 128) & (scol < (nsc + 3) // 4 * 4)
            if in_pad:
                E.st_global_u8(s_base + Int64(swizzled_scale_offset(lrow, scol, nsc)),
                               Uint32(cutlass.select_(ok, code, Uint32(0))))
        else:
            if ok:
                E.st_global_u8(s_base + Int64(lrow) * Int64(nsc) + Int64(scol), code)

    # ------------------------------------------------------------ columnwise pass
    @cute.jit
    def _col_pass(self, sx, stam, serr, tidx, g, lr0, Mg, kt, K, gtab, amax_c,
                  qt, st, keys, offset):
        c = tidx // 4
        rb = tidx % 4
        kc = kt * TILE + c
        mb = lr0 // 16 + rb  # group-local 16-row block = scale column of the twin
        xs = []
        for i in cutlass.range_constexpr(16):
            xs.append(sx[rb * 16 + i, c])
        if cutlass.const_expr(self.rht):
            xs = rht16(xs)
        am = block_amax(xs)
        ok = (kc < K) & (lr0 + rb * 16 < Mg)
        ac_base = amax_c.iterator.toint() + gtab[g, G_AC] * 4
        g_amax = Float32(0.0)
        if cutlass.const_expr(self.scaling == "tensor"):
            g_amax = E.ld_global_f32(ac_base)
        if cutlass.const_expr(self.scaling == "token"):
            g_amax = E.ld_global_f32(ac_base + Int64(cutlass.min(kc, K - 1)) * 4)
        if cutlass.const_expr(self.scaling == "window64"):
            g_amax = lanes4_max(am)
            if (rb == 0) & (kc < K) & (lr0 < Mg):
                E.st_global_u32(ac_base + (Int64(kc) * Int64(Mg // TILE) + Int64(lr0 // TILE)) * 4,
                                E.f32_bits(g_amax))
        eam = am
        if cutlass.const_expr(self.block_rows == 16):
            eam = stam[rb * 4 + c // 16]
        idx0 = Int64(kc) * Int64(Mg) + Int64(lr0 + rb * 16)
        code, w0, w1 = self._finish(xs, eam, g_amax, idx0, 1, keys, offset, serr, tidx)

        if ok:
            E.st_global_v2(qt.iterator.toint() + gtab[g, G_QT] + Int64(kc) * Int64(Mg // 2)
                           + Int64(mb) * 8, w0, w1)
        nsc = Mg // 16
        st_base = st.iterator.toint() + gtab[g, G_ST]
        if cutlass.const_expr(self.swizzle):
            in_pad = (kc < (K + 127) // 128 * 128) & (mb < (nsc + 3) // 4 * 4)
            if in_pad:
                E.st_global_u8(st_base + Int64(swizzled_scale_offset(kc, mb, nsc)),
                               Uint32(cutlass.select_(ok, code, Uint32(0))))
        else:
            if ok:
                E.st_global_u8(st_base + Int64(kc) * Int64(nsc) + Int64(mb), code)


class RecipeAmax(_TileLoader):
    """Outer amax per group for scaling "tensor" / "token": rowwise (|x|) and/or columnwise
    (|x| or |rht(x)| along M). atab int32 [C, 2]: (first tile, tile count) of each CTA row,
    all inside one group; grid (ceil(n_kt / KT), C)."""

    KT = 4

    def __init__(self, dtype: str, per_token: bool, rht: bool, do_row: bool, do_col: bool):
        self._setup(dtype)
        if not (do_row or do_col):
            raise ValueError("RecipeAmax: nothing to compute")
        self.per_token, self.rht, self.do_row, self.do_col = per_token, rht, do_row, do_col

    @cute.jit
    def __call__(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor, atab: cute.Tensor,
                 amax_r: cute.Tensor, amax_c: cute.Tensor, n_kt: Int32, stream):
        C = atab.shape[0]
        self.kernel(x, ttab, gtab, atab, amax_r, amax_c).launch(
            grid=((n_kt + self.KT - 1) // self.KT, C, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor, atab: cute.Tensor,
               amax_r: cute.Tensor, amax_c: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sx = smem.allocate_tensor(Float32, cute.make_layout((TILE, TILE), stride=(SX_STRIDE, 1)), 16)
        # per-thread accumulators: [0] rowwise (tensor), [1 + ki] columnwise (token: column
        # tidx // 4 of k tile ki; tensor: slot 1)
        acc = smem.allocate_tensor(Float32, cute.make_layout((1 + self.KT, THREADS), stride=(THREADS, 1)), 16)
        for j in cutlass.range_constexpr(1 + self.KT):
            acc[j, tidx] = Float32(0.0)
        K = x.shape[1]
        t0 = atab[by, 0]
        count = atab[by, 1]
        g = ttab[t0, 0]
        row0 = gtab[g, G_ROW0]
        Mg = Int32(gtab[g, G_ROWS])
        ar_base = amax_r.iterator.toint() + gtab[g, G_AR] * 4
        ac_base = amax_c.iterator.toint() + gtab[g, G_AC] * 4
        xbase = x.iterator.toint()
        r = tidx // 4
        for mi in cutlass.range(count, unroll=1):
            lr0 = ttab[t0 + mi, 1]
            nrows = Mg - lr0
            racc = Float32(0.0)
            for ki in cutlass.range_constexpr(self.KT):
                kt = bx * self.KT + ki
                self.load_tile(sx, xbase, row0 + Int64(lr0), nrows, kt, K, tidx)
                cute.arch.barrier()
                if cutlass.const_expr(self.do_row):
                    xs = []
                    for i in cutlass.range_constexpr(16):
                        xs.append(sx[r, (tidx % 4) * 16 + i])
                    racc = E.fmax_nan(racc, block_amax(xs))
                if cutlass.const_expr(self.do_col):
                    xs = []
                    for i in cutlass.range_constexpr(16):
                        xs.append(sx[(tidx % 4) * 16 + i, r])
                    if cutlass.const_expr(self.rht):
                        bam = E.mul_rn(block_amax(rht16(xs, scale=False)), Float32(0.25))
                    else:
                        bam = block_amax(xs)
                    slot = 1
                    if cutlass.const_expr(self.per_token):
                        slot = 1 + ki
                    acc[slot, tidx] = E.fmax_nan(acc[slot, tidx], bam)
                cute.arch.barrier()
            if cutlass.const_expr(self.do_row):
                if cutlass.const_expr(self.per_token):
                    racc = lanes4_max(racc)
                    if (tidx % 4 == 0) & (r < nrows):
                        E.red_max_u32(ar_base + Int64(lr0 + r) * 4, E.canonical_nan_bits(racc))
                else:
                    acc[0, tidx] = E.fmax_nan(acc[0, tidx], racc)
        if cutlass.const_expr(self.do_col and self.per_token):
            for ki in cutlass.range_constexpr(self.KT):
                v = lanes4_max(acc[1 + ki, tidx])
                kc = (bx * self.KT + ki) * TILE + r
                if (tidx % 4 == 0) & (kc < K):
                    E.red_max_u32(ac_base + Int64(kc) * 4, E.canonical_nan_bits(v))
        if cutlass.const_expr(not self.per_token):
            cute.arch.barrier()
            warp = tidx // 32
            lane = tidx % 32
            tot = Float32(0.0)
            if warp < 2:
                for j in cutlass.range_constexpr(THREADS // 32):
                    tot = E.fmax_nan(tot, acc[warp, lane + 32 * j])
                tot = E.warp_max_nan(tot)
                if lane == 0:
                    if warp == 0:
                        if cutlass.const_expr(self.do_row):
                            E.red_max_u32(ar_base, E.canonical_nan_bits(tot))
                    else:
                        if cutlass.const_expr(self.do_col):
                            E.red_max_u32(ac_base, E.canonical_nan_bits(tot))
