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
over chunks of tiles that stay inside one group, from global memory straight into registers
(a thread holds 16 rows x one 16-byte column vector: whole column blocks for the RHT); maxima
flushed with `red.global.max.u32` on the bit pattern (outputs zeroed beforehand). Optionally
the column sums of the input too (a Linear's bias gradient, read in the same pass): one FP32
partial per CTA row and column, in a fixed order (deterministic), summed by the host.

Every FP32 step is one explicit correctly rounded PTX operation in the reference's order
(no contraction, no approximate division, no flush-to-zero).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_fp4.common import encode as E
from cute_fp4.common.encode import add_rn, block_amax, sub_rn
from cute_fp4.common.philox import philox_block16, rng_round_keys
from cute_fp4.common.ptx import st_shared
from cute_fp4.common.scales import (ONE_SIXTH, e2m1_to_f32, e4m3_to_f32, outer_encode_scale,
                                    swizzled_scale_offset)
from cute_fp4.quant.amax import (fold_cta_maxima, fold_slab_columns, keep_load, keep_policies,
                                  rht16, rht16_amax_fast, vec_amax, vec_value)

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
TILE = 64
THREADS = 256
G_ROW0, G_ROWS, G_Q, G_S, G_QT, G_ST, G_AR, G_AC = range(8)
GTAB_COLS = 8
FOUR_OVER_SIX = (None, "mae", "mse")


# Magnitudes of the round-to-nearest E2M1 values of 8 elements (the grid rounding of
# common/encode.py's software encoder without the codes): with a = min(|x * enc|, 6), the
# value is add.rn(a, M) - M (exact) with the magic M = 2^22 * max(1, 2^floor(log2 a)), i.e.
# 2^22, 2^23, 2^24 for the grid gaps 0.5, 1, 2 (bits: max(exponent bits of a + 22 << 23,
# 0x4A800000), one add-max instruction); ties go to the even code. For the 4over6
# errors, which need no codes: the chosen candidate is encoded once afterwards. A NaN product
# (NaN enc) gives 6; the NaN scale makes its candidate values NaN anyway.
_RN_VAL_ELEM = (
    "mul.rn.f32 a, {x}, e;\n"
    "abs.f32 a, a;\nmin.f32 a, a, 0f40C00000;\n"
    "mov.b32 b, a;\nand.b32 m, b, 0x7F800000;\nadd.u32 m, m, 0x0B000000;\n"
    "max.u32 m, m, 0x4A800000;\nmov.b32 mf, m;\n"
    "add.rn.f32 a, a, mf;\nsub.rn.f32 {val}, a, mf;\n"
)


def _values8_ptx() -> str:
    body = ["{\n.reg .f32 a, mf, e;\n.reg .b32 b, m;\nmov.f32 e, {$r8};\n"]
    for i in range(8):
        body.append(_RN_VAL_ELEM.replace("{x}", "{$r%d}" % i).replace("{val}", "{$w%d}" % i))
    body.append("}")
    return "".join(body)


_VALUES8 = _values8_ptx()


def values8(xs, enc):
    """|E2M1 value| (Float32) of the RN codes of 8 values with the block's enc."""
    return list(cute.arch.inline_ptx(
        _VALUES8, write_only_types=[Float32] * 8,
        read_only_args=[Float32(x) for x in xs] + [Float32(enc)]))


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
    return cute.arch.inline_ptx(
        "{\n.reg .f32 q, t;\n"
        f"mul.rn.f32 q, {{$r0}}, {rh};\nneg.f32 t, {{$r0}};\n"
        f"fma.rn.f32 t, q, {dh}, t;\nneg.f32 t, t;\n"
        f"fma.rn.f32 {{$w0}}, t, {rh}, q;\n}}",
        write_only_types=[Float32], read_only_args=[Float32(x)])


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


def _nonneg(v):
    """v & 0x7FFFFFFF for an Int32 that is never negative (a row or column count or index):
    the same value, but the compiler then knows the sign, so divisions and remainders by
    powers of two become shifts and masks (no signed-rounding fix-ups)."""
    return Int32(v) & Int32(0x7FFFFFFF)


def _swizzled_in_tile(tidx):
    """The thread's term of a swizzled scale offset in both passes: thread t writes scale
    (r0 + t // 4, c0 + t % 4) of a 64-row by 4-column corner (r0 % 64 == 0, c0 % 4 == 0), and
    swizzled_scale_offset(r0 + r, c0 + b, n) = swizzled_scale_offset(r0, c0, n)
    + swizzled_scale_offset(r, b, 4) there (same 128x4 tile, rows r0 % 128 + r, whole 32-row
    quarters), so the division-heavy part is per CTA."""
    return swizzled_scale_offset(tidx // 4, tidx % 4, Int32(4))


def sx_off(row, chunk):
    """Byte offset of 16-byte chunk `chunk` (FP32 columns 4 chunk .. 4 chunk + 3) of row `row`
    in the FP32 tile: rows of 256 bytes, the chunk XOR-swizzled within its row by
    s = (chunk bit 3) | (row bit 0 ^ row bit 4) << 1 | (row bit 5) << 2, so that the hot
    accesses are free of bank conflicts: the loader's 16-byte stores (8 lanes: one row, chunks
    2 cv + e or cv), the rowwise pass's 16-byte loads (8 lanes: rows 2j, 2j + 1, chunks
    4 b + k) and the columnwise pass's 4-byte loads (a warp: 8 columns = 2 chunks, rows
    16 rb + i for rb = 0 .. 3). s flips no chunk bit above bit 2 and no row bit enters it
    but bits 0, 4 and 5; the passes use that to derive a thread's offsets from one or two
    base offsets (XOR of chunk bits 0 .. 2, row steps)."""
    sw = ((chunk >> 3) & 1) | (((row ^ (row >> 4)) & 1) << 1) | (((row >> 5) & 1) << 2)
    return row * (TILE * 4) + ((chunk ^ sw) << 4)


def sx_row16(sbase, row, col0, rot=None):
    """The 16 FP32 values of `row`, columns col0 .. col0 + 15 (col0 % 16 == 0): 4 x 16 bytes
    (sbase 256-byte aligned: the chunks differ in address bits 4, 5 only). rot: load the
    chunks in the order (k + rot) % 4 instead (a max over them does not care)."""
    a0 = sbase + sx_off(row, col0 // 4)
    xs = []
    for k in range(4):
        kk = k if rot is None else (rot + k) & 3
        xs += [E.bits_f32(w) for w in E.ld_shared_v4(a0 ^ (kk << 4))]
    return xs


def sx_col16(sbase, row0, col):
    """The 16 FP32 values of column `col`, rows row0 .. row0 + 15 (row0 % 16 == 0): the
    swizzle of row row0 + i is that of row0 + i % 2."""
    a0 = sbase + sx_off(row0, col // 4) + (col % 4) * 4
    a = [a0, (a0 ^ 32) + TILE * 4]  # row0 + 1: swizzle bit 1 flips (address bit 5)
    return [E.bits_f32(E.ld_shared_u32(a[i % 2] + (i - i % 2) * TILE * 4)) for i in range(16)]


class _TileLoader:
    """64x64 tile of a group -> FP32 smem (sx_off layout; zeros outside)."""

    def _setup(self, dtype):
        if dtype not in DTYPES:
            raise TypeError(f"unsupported input dtype {dtype!r} (bf16, fp16, fp32)")
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.vpr = TILE * self.esize // 16  # 16-byte vectors per tile row
        self.epv = 16 // self.esize  # elements per vector

    def load_tile(self, sbase, xbase, grow0, nrows, kt, K, tidx):
        """Vector i of thread t: tile row t // vpr + i * (256 / vpr), vector t % vpr; its
        FP32 values go to smem as 16-byte chunks. Every chunk address comes from the first
        one: the rows of later i add 32 (2-byte inputs) or 16 (fp32) per i, which flips
        swizzle bit 2 (bit 1 and 2 for fp32: i bits 0, 1); a vector of a 2-byte input is
        chunks 2 cv, 2 cv + 1 (chunk bit 0, same swizzle)."""
        rstep = THREADS // self.vpr
        cpv = self.epv // 4  # 16-byte chunks per vector
        a0 = sbase + sx_off(tidx // self.vpr, (tidx % self.vpr) * cpv)
        for i in range(TILE * self.vpr // THREADS):
            v = tidx + i * THREADS
            r = v // self.vpr
            cv = v % self.vpr
            flip = (i << 6) if rstep == 32 else (i << 5)  # chunk ^ 4i / ^ 2i, in bytes
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
            for e in range(cpv):
                st_shared((a0 ^ (flip | (e << 4))) + i * rstep * TILE * 4,
                          *[E.f32_bits(v) for v in vals[4 * e:4 * e + 4]], clobber=False)


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
                 qt: cute.Tensor, st: cute.Tensor, rng: cute.Tensor, n_kt: Int32, stream):
        """rng: int64 [seed, offset] of the Philox stream (read by stochastic rounding only)."""
        self.hw = E.has_hw_e2m1()
        T = ttab.shape[0]
        self.kernel(x, ttab, gtab, amax_r, amax_c, q, s, qt, st, rng).launch(
            grid=(n_kt, T, 1), block=(THREADS, 1, 1), stream=stream)

    # ------------------------------------------------------------ block numerics
    def _encode16(self, xs, enc, idx0, stream, keys, offset, quarter: bool = False):
        """Codes of 16 values with the block's enc: two Uint32 words of 8 nibbles. quarter:
        xs are RHT outputs without their x 0.25 (2-byte inputs only), encoded as xs * 0.25."""
        words = None
        if cutlass.const_expr(self.stochastic):
            words = philox_block16(idx0, offset, stream, keys)
        if cutlass.const_expr(not self._sign_bits()):
            return self._encode16_any(xs, enc, words)
        return self._encode16_guarded(xs, enc, words, quarter)

    def _sign_bits(self) -> bool:
        """Whether the encoders may take the signs from the products' sign bits (blocks with
        enc >= 2^-14, _encode16_guarded): 2-byte inputs and a software encoder (sm_90, or
        stochastic rounding)."""
        return self.esize == 2 and (self.stochastic or not self.hw)

    def _encode16_any(self, xs, enc, words):
        """Codes of 16 values, any enc (NaN: zeros)."""
        if cutlass.const_expr(not self.stochastic):
            return E.encode16(xs, enc, self.hw)
        return E.sr_encode16(xs, enc, words)

    @cute.jit
    def _encode16_guarded(self, xs, enc, words, quarter: cutlass.Constexpr):
        """sm_90, 2-byte inputs: blocks with enc >= 2^-14 (not NaN) take the encoders that set
        the signs 8 at a time from the products' sign bits. Exact there: every nonzero input
        (and RHT output) of a bf16 / fp16 tensor is a multiple of 2^-133 / 2^-24 (sums and
        RN of such stay multiples), so a nonzero product is at least 2^-149 in magnitude and
        never rounds to a -0 that the reference would not call negative; an exact zero product
        is +0 (fma with +0). With the RHT's x 0.25 left out (quarter), RN(y * 0.25) is exact
        for such y and enc * 0.25 is exact for enc >= 2^-124, so RN(RN(y * 0.25) * enc) =
        RN(y * RN(enc * 0.25)): one multiply per block instead of 16. Other blocks: the
        general encoders (on y * 0.25)."""
        w0 = Uint32(0)
        w1 = Uint32(0)
        if enc >= Float32(2.0 ** -14):
            e = enc
            if cutlass.const_expr(quarter):
                e = E.mul_rn(enc, Float32(0.25))
            if cutlass.const_expr(self.stochastic):
                w0 = E.sr_encode8_nonzero_products(xs[0:8], e, words[0:2])
                w1 = E.sr_encode8_nonzero_products(xs[8:16], e, words[2:4])
            else:
                w0 = E.encode8_nonzero_products(xs[0:8], e)
                w1 = E.encode8_nonzero_products(xs[8:16], e)
        else:
            ys = xs
            if cutlass.const_expr(quarter):
                ys = [E.mul_rn(x, Float32(0.25)) for x in xs]
            w0, w1 = self._encode16_any(ys, enc, words)
        return w0, w1

    def _candidate(self, xs, refs, enc, code, g_amax):
        """4over6 error of one candidate (scale code, enc), from magnitudes: the errors are
        |cand| - |ref| up to the sign (a candidate value has the sign of x, or is 0; RN is
        odd), with refs = |x| (exact path) or |x| * S_enc (fast_math, RN(|x| S) = |RN(x S)|).
        sm_90: software value rounding (no codes); sm_100a: hardware encode, values decoded
        from the codes (fast_math: FP16 products by cvt.rn.f16x2)."""
        sf = e4m3_to_f32(code)
        safe = Uint32(1)
        if cutlass.const_expr(not self.fast_math):
            safe = div_const_safe(sf, g_amax)
        if cutlass.const_expr(self.hw):
            w0, w1 = self._encode16(xs, enc, None, 0, None, None)
            if cutlass.const_expr(self.fast_math):
                prods = []
                for p in range(8):
                    byte = (Uint32(w0 if p < 4 else w1) >> Uint32(8 * (p % 4))) & Uint32(0x77)
                    prods += list(fp16_products2(byte, code))
                return self._error(refs, prods, None, g_amax, Float32(0.0), safe)
            vals = [e2m1_to_f32(nibble(w0, w1, i) & Uint32(7)) for i in range(16)]
            return self._error(refs, vals, sf, g_amax, Float32(0.0), safe)
        # eight elements at a time (fewer live registers), the sum stays in element order
        err = self._error(refs[0:8], values8(xs[0:8], enc), sf, g_amax, Float32(0.0), safe)
        return self._error(refs[8:16], values8(xs[8:16], enc), sf, g_amax, err, safe)

    @cute.jit
    def _error(self, refs, vals, sf, g_amax, err, safe):
        """4over6 error of one candidate: err plus a sequential sum over the elements of the
        reference terms: fast_math (value * s) - x * S_enc; else (value * s) * amax /
        (6 * e4m3_max) - x, the IEEE division by div_const where the block is in its exact
        domain (safe != 0), else by div.rn. sf None: vals are the FP16-domain products."""
        if cutlass.const_expr(self.fast_math):
            err = self._error_terms(refs, vals, sf, g_amax, err, False)
        else:
            if safe != Uint32(0):
                err = self._error_terms(refs, vals, sf, g_amax, err, True)
            else:
                err = self._error_terms(refs, vals, sf, g_amax, err, False)
        return err

    def _error_terms(self, refs, vals, sf, g_amax, err, by_const: bool):
        for i in range(len(vals)):
            cand = vals[i]
            if sf is not None:
                cand = E.mul_rn(cand, sf)  # E2M1 x E4M3: exact
            if cutlass.const_expr(not self.fast_math):
                cand = E.mul_rn(cand, g_amax)
                if by_const:
                    cand = div_const(cand, 6 * self.e4m3_max)
                else:
                    cand = E.div_rn(cand, Float32(6.0 * self.e4m3_max))
            d = sub_rn(cand, refs[i])
            if cutlass.const_expr(self.fos == "mse"):
                err = add_rn(err, E.mul_rn(d, d))
            else:
                err = add_rn(err, E.fabs(d))
        return err

    def _outer(self, g_amax):
        """(amax, S_enc, 1 / S_enc) of an outer scale."""
        s_enc = outer_encode_scale(g_amax, self.e4m3_max)
        return g_amax, s_enc, E.rcp_rn(s_enc)

    def _shared_outer(self, sosc, side: int, i):
        """The kernel's smem outer scale of tile row / column i (tensor scaling: entry 0);
        None for window64 (the passes compute theirs)."""
        if self.scaling == "window64":
            return None
        if self.scaling == "tensor":
            i = 0
        return sosc[side, i, 0], sosc[side, i, 1], sosc[side, i, 2]

    def _block(self, xs, eam, osc, idx0, stream, keys, offset, quarter: bool = False):
        """Plain path: (scale code, w0, w1). 4over6: both candidates (code, enc) and their
        errors. osc: the outer scale (_outer). quarter: see _encode16 (plain path only)."""
        g_amax, s_enc, s_dec = osc
        if cutlass.const_expr(self.fos is None):
            code, enc = E.block_scale(eam, E.mul_rn(s_enc, Float32(ONE_SIXTH)), s_dec)
            w0, w1 = self._encode16(xs, enc, idx0, stream, keys, offset, quarter)
            return code, w0, w1
        base = E.mul_rn(E.div_rn(eam, Float32(6.0)), s_enc)  # IEEE amax_b / 6, as ref.true_div
        c6 = E.e4m3_code(base)
        c4 = E.e4m3_code(E.mul_rn(base, Float32(1.5)))
        enc6 = E.enc_from_code(c6, s_dec)
        enc4 = E.enc_from_code(c4, s_dec)
        refs = [E.fabs(x) for x in xs]
        if cutlass.const_expr(self.fast_math):
            refs = [E.mul_rn(r, s_enc) for r in refs]  # shared by both candidates
        e6 = self._candidate(xs, refs, enc6, c6, g_amax)
        e4 = self._candidate(xs, refs, enc4, c4, g_amax)
        return c6, enc6, c4, enc4, e6, e4

    def _pick(self, xs, cands, e6, e4):
        """Map-to-4 only when strictly better; the chosen candidate is encoded (RN)."""
        c6, enc6, c4, enc4 = cands[:4]
        p4 = e4 < e6
        w0, w1 = self._encode16(xs, Float32(cutlass.select_(p4, enc4, enc6)), None, 0, None,
                                None)
        return Uint32(cutlass.select_(p4, c4, c6)), w0, w1

    # ------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor,
               amax_r: cute.Tensor, amax_c: cute.Tensor, q: cute.Tensor, s: cute.Tensor,
               qt: cute.Tensor, st: cute.Tensor, rng: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        kt, tt, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sx = smem.allocate_tensor(Float32, cute.make_layout(TILE * TILE), 256)
        sbase = sx.iterator.toint()
        stam = smem.allocate_tensor(Float32, cute.make_layout(16), 16)
        serr = smem.allocate_tensor(Float32, cute.make_layout((2, THREADS), stride=(THREADS, 1)), 16)
        # outer scales [row / column side, tile row / column, (amax, S_enc, 1 / S_enc)]
        sosc = smem.allocate_tensor(Float32, cute.make_layout((2, TILE, 3), stride=(TILE * 3, 3, 1)), 16)

        g = ttab[tt, 0]
        lr0 = _nonneg(ttab[tt, 1])
        row0 = gtab[g, G_ROW0]
        Mg = _nonneg(Int32(gtab[g, G_ROWS]))
        K = _nonneg(x.shape[1])
        nrows = Mg - lr0
        ar_base = amax_r.iterator.toint() + gtab[g, G_AR] * 4
        ac_base = amax_c.iterator.toint() + gtab[g, G_AC] * 4
        # Outer scales of scaling "tensor" / "token" (amax, S_enc, 1 / S_enc: a division and
        # a reciprocal) once per tile row / column (token: threads 0 .. 127) or per tile
        # (tensor: threads 0 and 64), shared through smem, instead of once per thread and
        # pass; their amax loads are issued before the tile's.
        osc_i = tidx % TILE
        osc_amax = Float32(0.0)
        if cutlass.const_expr(self.scaling == "tensor"):
            osc_amax = E.ld_global_f32(cutlass.select_(tidx < TILE, ar_base, ac_base))
        if cutlass.const_expr(self.scaling == "token"):
            osc_amax = E.ld_global_f32(cutlass.select_(
                tidx < TILE, ar_base + Int64(cutlass.min(lr0 + osc_i, Mg - 1)) * 4,
                ac_base + Int64(cutlass.min(kt * TILE + osc_i, K - 1)) * 4))
        self.load_tile(sbase, x.iterator.toint(), row0 + Int64(lr0), nrows, kt, K, tidx)
        if cutlass.const_expr(self.scaling != "window64"):
            writer = tidx < 2 * TILE
            if cutlass.const_expr(self.scaling == "tensor"):
                writer = writer & (osc_i == 0)  # entry 0 of each side
            if writer:
                g_amax, s_enc, s_dec = self._outer(osc_amax)
                side = tidx // TILE
                sosc[side, osc_i, 0] = g_amax
                sosc[side, osc_i, 1] = s_enc
                sosc[side, osc_i, 2] = s_dec
        cute.arch.barrier()

        if cutlass.const_expr(self.block_rows == 16):
            # tile amax of the 16 16x16 tiles: 16 threads per tile, one row each
            ti = tidx // 16
            j = tidx % 16
            a = block_amax(sx_row16(sbase, (ti // 4) * 16 + j, (ti % 4) * 16, j // 2))
            for m in (8, 4, 2, 1):
                a = E.shfl_xor_max_nan(a, m)
            if j == 0:
                stam[ti] = a
            cute.arch.barrier()

        keys = []
        offset = Uint32(0)
        if cutlass.const_expr(self.stochastic):
            keys, offset = rng_round_keys(rng)
        if cutlass.const_expr(self.rowwise):
            self._row_pass(sbase, stam, serr, sosc, tidx, g, lr0, nrows, Mg, kt, K, gtab,
                           ar_base, q, s, keys, offset)
        if cutlass.const_expr(self.columnwise):
            self._col_pass(sbase, stam, serr, sosc, tidx, g, lr0, Mg, kt, K, gtab, ac_base,
                           qt, st, keys, offset)

    def _finish(self, xs, eam, osc, idx0, stream, keys, offset, serr, tidx,
                quarter: bool = False):
        """(scale code, w0, w1) of this thread's block; 16x16 4over6 sums the errors of the
        tile's 16 blocks (thread slots 4 * j + (tidx % 4) + 64 * (tidx // 64)) in tree order."""
        res = self._block(xs, eam, osc, idx0, stream, keys, offset, quarter)
        if cutlass.const_expr(self.fos is None):
            return res
        e6 = res[4]
        e4 = res[5]
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
        return self._pick(xs, res, e6, e4)

    # ------------------------------------------------------------ rowwise pass
    @cute.jit
    def _row_pass(self, sbase, stam, serr, sosc, tidx, g, lr0, nrows, Mg, kt, K, gtab, ar_base,
                  q, s, keys, offset):
        r = tidx // 4
        b = tidx % 4
        lrow = lr0 + r
        xs = sx_row16(sbase, r, b * 16)
        am = block_amax(xs)
        row_ok = r < nrows
        col0 = kt * TILE + b * 16
        ok = row_ok & (col0 < K)
        osc = self._shared_outer(sosc, 0, r)
        if cutlass.const_expr(self.scaling == "window64"):
            g_amax = lanes4_max(am)
            if (b == 0) & row_ok & (kt * TILE < K):
                E.st_global_u32(ar_base + (Int64(lrow) * Int64(K // TILE) + Int64(kt)) * 4,
                                E.f32_bits(g_amax))
            osc = self._outer(g_amax)
        eam = am
        if cutlass.const_expr(self.block_rows == 16):
            eam = stam[(r // 16) * 4 + b]
        idx0 = Int64(lrow) * Int64(K) + Int64(col0)
        # group g draws Philox streams 2g (rowwise) and 2g + 1 (twin), as ref.quantize_grouped
        code, w0, w1 = self._finish(xs, eam, osc, idx0, 2 * g, keys, offset, serr, tidx)

        if ok:
            E.st_global_v2(q.iterator.toint() + gtab[g, G_Q] + Int64(lrow) * Int64(K // 2)
                           + Int64(col0 // 2), w0, w1)
        nsc = K // 16
        scol = kt * 4 + b
        s_base = s.iterator.toint() + gtab[g, G_S]
        if cutlass.const_expr(self.swizzle):
            in_pad = (lrow < (Mg + 127) // 128 * 128) & (scol < (nsc + 3) // 4 * 4)
            if in_pad:
                E.st_global_u8(s_base + Int64(swizzled_scale_offset(lr0, kt * 4, nsc)
                                              + _swizzled_in_tile(tidx)),
                               Uint32(cutlass.select_(ok, code, Uint32(0))))
        else:
            if ok:
                E.st_global_u8(s_base + Int64(lrow) * Int64(nsc) + Int64(scol), code)

    # ------------------------------------------------------------ columnwise pass
    @cute.jit
    def _col_pass(self, sbase, stam, serr, sosc, tidx, g, lr0, Mg, kt, K, gtab, ac_base,
                  qt, st, keys, offset):
        c = tidx // 4
        rb = tidx % 4
        kc = kt * TILE + c
        mb = lr0 // 16 + rb  # group-local 16-row block = scale column of the twin
        xs = sx_col16(sbase, rb * 16, c)
        # plain 1x16 blocks on the sign-bit encoders: the RHT's x 0.25 goes into the block
        # amax (amax(|y| * 0.25) = amax(|y|) * 0.25, exact here) and enc (_encode16_guarded)
        quarter = self.rht and self._sign_bits() and self.fos is None and self.block_rows == 1
        if cutlass.const_expr(self.rht):
            xs = rht16(xs, scale=not quarter)
        am = block_amax(xs)
        if cutlass.const_expr(quarter):
            am = E.mul_rn(am, Float32(0.25))
        ok = (kc < K) & (lr0 + rb * 16 < Mg)
        osc = self._shared_outer(sosc, 1, c)
        if cutlass.const_expr(self.scaling == "window64"):
            g_amax = lanes4_max(am)
            if (rb == 0) & (kc < K) & (lr0 < Mg):
                E.st_global_u32(ac_base + (Int64(kc) * Int64(Mg // TILE) + Int64(lr0 // TILE)) * 4,
                                E.f32_bits(g_amax))
            osc = self._outer(g_amax)
        eam = am
        if cutlass.const_expr(self.block_rows == 16):
            eam = stam[rb * 4 + c // 16]
        idx0 = Int64(kc) * Int64(Mg) + Int64(lr0 + rb * 16)
        code, w0, w1 = self._finish(xs, eam, osc, idx0, 2 * g + 1, keys, offset, serr, tidx,
                                    quarter)

        if ok:
            E.st_global_v2(qt.iterator.toint() + gtab[g, G_QT] + Int64(kc) * Int64(Mg // 2)
                           + Int64(mb) * 8, w0, w1)
        nsc = Mg // 16
        st_base = st.iterator.toint() + gtab[g, G_ST]
        if cutlass.const_expr(self.swizzle):
            in_pad = (kc < (K + 127) // 128 * 128) & (mb < (nsc + 3) // 4 * 4)
            if in_pad:
                E.st_global_u8(st_base + Int64(swizzled_scale_offset(kt * TILE, lr0 // 16, nsc)
                                               + _swizzled_in_tile(tidx)),
                               Uint32(cutlass.select_(ok, code, Uint32(0))))
        else:
            if ok:
                E.st_global_u8(st_base + Int64(kc) * Int64(nsc) + Int64(mb), code)


class RecipeAmax:
    """Outer amax per group for scaling "tensor" / "token": rowwise (|x|) and/or columnwise
    (|x| or |rht(x)| along M). Straight from global memory into registers (no smem tile): a
    warp covers a slab of 32 x 16-byte vectors of one row (256 bf16 columns) and reads it in
    16-row strips, 16 loads in flight per thread; the thread then holds 16 rows x 8 (bf16)
    columns, i.e. whole 16-row column blocks for the RHT. atab int32 [C, 2]: (first tile, tile
    count) of each CTA row, consecutive 64-row tiles inside one group; the CTA row's strips
    (four per tile, fewer at the group's end) are dealt to the warps in turn (warp w: strips
    w, w + WARPS, ...), so that small CTA rows keep every warp busy. Grid (ceil(K / slab), C).
    l2_keep (bytes): the L2 priorities of amax.keep_policies (the last l2_keep bytes of x
    normal, the rest evict_first), for the plain RHT cast walking backwards
    (recipes_dispatch)."""

    WARPS = THREADS // 32
    SLAB_BYTES = 32 * 16  # a warp's row slab: one 16-byte vector per lane

    def __init__(self, dtype: str, per_token: bool, rht: bool, do_row: bool, do_col: bool,
                 col_sum: bool = False, l2_keep: int = 0):
        if dtype not in DTYPES:
            raise TypeError(f"unsupported input dtype {dtype!r} (bf16, fp16, fp32)")
        if not (do_row or do_col):
            raise ValueError("RecipeAmax: nothing to compute")
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.epv = 16 // self.esize  # elements per 16-byte vector = columns per thread
        self.slab = self.SLAB_BYTES // self.esize
        self.per_token, self.rht, self.do_row, self.do_col = per_token, rht, do_row, do_col
        self.col_sum = col_sum
        self.l2_keep = l2_keep

    @cute.jit
    def __call__(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor, atab: cute.Tensor,
                 amax_r: cute.Tensor, amax_c: cute.Tensor, psum: Optional[cute.Tensor],
                 stream):
        """psum (with col_sum, single-group inputs): FP32 [C * K], row c of it receives the
        column sums of the rows of CTA row c."""
        C = atab.shape[0]
        self.kernel(x, ttab, gtab, atab, amax_r, amax_c, psum).launch(
            grid=((x.shape[1] + self.slab - 1) // self.slab, C, 1), block=(THREADS, 1, 1),
            stream=stream)

    @cute.jit
    def _strip_rows(self, s, base, nrows, rbytes, xbase, policies):
        """The thread's 16 row vectors of strip s (rows past nrows clamped onto the last)."""
        rows = []
        for i in cutlass.range_constexpr(16):
            r = cutlass.min(s * 16 + i, nrows - 1)
            addr = base + Int64(r) * rbytes
            if cutlass.const_expr(policies is None):
                rows.append(list(E.ld_global_nc_v4(addr)))
            else:
                rows.append(list(keep_load(xbase, addr - xbase, policies)))
        return rows

    def _maxima(self, facc, pacc):
        """(row max, [column maxima]) of this thread from its accumulators."""
        racc = facc[0]
        if self.esize == 2:
            racc = E.amax_fold(pacc[0], self.dtype_name)
        cacc = [facc[1 + j] for j in range(self.epv)]
        if self.esize == 2 and not self.rht:
            cacc = []
            for k in range(4):
                cacc += [E.unpack_lo(pacc[1 + k], self.dtype_name),
                         E.unpack_hi(pacc[1 + k], self.dtype_name)]
        if self.rht:  # amax(|y| * 0.25) = amax(|y|) * 0.25 (RN is monotone)
            cacc = [E.mul_rn(c, Float32(0.25)) for c in cacc]
        return racc, cacc

    @cute.kernel
    def kernel(self, x: cute.Tensor, ttab: cute.Tensor, gtab: cute.Tensor, atab: cute.Tensor,
               amax_r: cute.Tensor, amax_c: cute.Tensor, psum: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        smem = cutlass.memory.SmemAllocator()
        # cross-warp reduction: [warp, column of the slab] (token) or [warp, row / column]
        red = smem.allocate_tensor(Float32, cute.make_layout((self.WARPS, self.slab),
                                                             stride=(self.slab, 1)), 16)
        if cutlass.const_expr(self.col_sum):
            red_sum = smem.allocate_tensor(Float32, cute.make_layout(
                (self.WARPS, self.slab), stride=(self.slab, 1)), 16)
            sacc = cute.make_rmem_tensor((self.epv,), Float32)
            for j in cutlass.range_constexpr(self.epv):
                sacc[j] = Float32(0.0)
        K = x.shape[1]
        t0 = atab[by, 0]
        count = atab[by, 1]
        g = ttab[t0, 0]
        row0 = gtab[g, G_ROW0]
        Mg = Int32(gtab[g, G_ROWS])
        ar_base = amax_r.iterator.toint() + gtab[g, G_AR] * 4
        ac_base = amax_c.iterator.toint() + gtab[g, G_AC] * 4
        xbase = x.iterator.toint()
        col = bx * self.slab + lane * self.epv
        # Out-of-range reads are clamped onto in-range elements of the same strip: duplicates
        # leave every max unchanged (columns >= K and rows >= nrows are never written). Whole
        # 16-row strips past the group are skipped (the RHT needs full blocks: with a
        # columnwise twin the group's rows are a multiple of 16).
        lr0 = ttab[t0, 1]
        nrows = Mg - lr0
        nstrips = cutlass.min(count * (TILE // 16), (nrows + 15) // 16)
        rbytes = Int64(K) * self.esize
        base = (xbase + (row0 + Int64(lr0)) * rbytes
                + Int64(cutlass.min(col, K - self.epv)) * self.esize)
        policies = keep_policies(self.l2_keep, Int64(x.shape[0]) * rbytes)
        # register accumulators (tensors: they live across the dynamic loop): facc[0] the
        # row max (tensor), facc[1 + j] column j's max; the same as packed 16-bit maxima in
        # pacc[0] and pacc[1 + word] (bf16 / fp16 inputs; columns without the RHT)
        facc = cute.make_rmem_tensor((1 + self.epv,), Float32)
        pacc = cute.make_rmem_tensor((5,), Uint32)
        for j in cutlass.range_constexpr(1 + self.epv):
            facc[j] = Float32(0.0)
        for j in cutlass.range_constexpr(5):
            pacc[j] = Uint32(0)
        for s in cutlass.range(warp, nstrips, self.WARPS, unroll=1):
            rows = self._strip_rows(s, base, nrows, rbytes, xbase, policies)
            if cutlass.const_expr(self.col_sum):
                for i in cutlass.range_constexpr(16):
                    keep = s * 16 + i < nrows  # rows past the group are clamped copies
                    for j in cutlass.range_constexpr(self.epv):
                        v = vec_value(rows[i], j, self.dtype_name)
                        sacc[j] = add_rn(sacc[j], cutlass.select_(keep, v, Float32(0.0)))
            if cutlass.const_expr(self.do_row and self.per_token):
                rm = E.lanes_transpose_max16([vec_amax(w, self.dtype_name) for w in rows], lane)
                r = s * 16 + lane // 2  # the row whose max this lane now holds
                if (lane % 2 == 0) & (r < nrows):
                    E.red_max_u32(ar_base + (Int64(lr0) + Int64(r)) * 4,
                                  E.canonical_nan_bits(rm))
            if cutlass.const_expr(self.do_row and not self.per_token):
                if cutlass.const_expr(self.esize == 4):
                    facc[0] = E.fmax_nan(facc[0], block_amax([E.bits_f32(w) for ws in rows
                                                              for w in ws]))
                else:
                    pacc[0] = E.amax_pairs([pacc[0]] + [w for ws in rows for w in ws],
                                           self.dtype_name)
            if cutlass.const_expr(self.do_col and self.esize == 2 and not self.rht):
                for k in cutlass.range_constexpr(4):
                    pacc[1 + k] = E.amax_pairs([pacc[1 + k]] + [ws[k] for ws in rows],
                                               self.dtype_name)
            if cutlass.const_expr(self.do_col and self.esize == 4 and not self.rht):
                for j in cutlass.range_constexpr(self.epv):
                    facc[1 + j] = E.fmax_nan(facc[1 + j], block_amax(
                        [vec_value(w, j, self.dtype_name) for w in rows]))
            if cutlass.const_expr(self.do_col and self.rht):
                for j in cutlass.range_constexpr(self.epv):
                    facc[1 + j] = E.fmax_nan(facc[1 + j], rht16_amax_fast(
                        [vec_value(w, j, self.dtype_name) for w in rows]))
        if cutlass.const_expr(self.do_col and self.rht):
            # rht16_amax_fast's +Inf may be a NaN of the transform (two infinities in a final
            # butterfly): those threads take their columns' maxima again with rht16 (rare:
            # infinite inputs or overflowing sums)
            inf = facc[1] == Float32(float("inf"))
            for j in cutlass.range_constexpr(1, self.epv):
                inf = inf | (facc[1 + j] == Float32(float("inf")))
            if inf:
                for j in cutlass.range_constexpr(self.epv):
                    facc[1 + j] = Float32(0.0)
                for s in cutlass.range(warp, nstrips, self.WARPS, unroll=1):
                    rows = self._strip_rows(s, base, nrows, rbytes, xbase, policies)
                    for j in cutlass.range_constexpr(self.epv):
                        xs = rht16([vec_value(w, j, self.dtype_name) for w in rows], scale=False)
                        facc[1 + j] = E.fmax_nan(facc[1 + j], block_amax(xs))
        if cutlass.const_expr(self.col_sum):
            def store_sum(c, v):
                psum[by * K + c] = v
            fold_slab_columns(red_sum, [sacc[j] for j in range(self.epv)], self.WARPS, warp, lane,
                              tidx, bx * self.slab, K, add_rn, store_sum)
        racc, cacc = self._maxima(facc, pacc)
        if cutlass.const_expr(self.per_token):
            if cutlass.const_expr(self.do_col):
                def store_max(c, v):
                    E.red_max_u32(ac_base + Int64(c) * 4, E.canonical_nan_bits(v))
                fold_slab_columns(red, cacc, self.WARPS, warp, lane, tidx, bx * self.slab, K,
                                  E.fmax_nan, store_max)
        else:
            fold_cta_maxima(red, racc, block_amax(cacc), self.WARPS, warp, lane, tidx, ar_base,
                            ac_base, self.do_row, self.do_col)
