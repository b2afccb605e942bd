"""Compile tests (CPU, no GPU needed): the recipe cast and amax kernels build for sm_90a and
sm_100a with IEEE division/reciprocal only; Philox (mul.wide.u32) and a conversion-free
stochastic encode with stochastic rounding; the 4over6 fast path uses cvt.rn.f16x2.e2m1x2 /
e4m3x2 products on sm_100a only. The exact 4over6 path's division by a constant
(cast_recipes.div_const) is checked against IEEE FP32 division by an exact numpy emulation of
its three operations (CUTE_FP4_EXHAUSTIVE_DIV=1: every FP32 bit pattern, ~4 min). The
stochastic E2M1 encode (common.encode._sr_elem) is checked against
ref.formats.e2m1_encode_stochastic by a numpy emulation of its PTX for every random byte
(CUTE_FP4_EXHAUSTIVE_SR=1: 2M values instead of ~40k, ~1 min), and so is its variant that
takes the signs of bf16 / fp16 inputs from sign words (common.encode.sign_word, the plain
cast's stochastic encoder where every block has enc >= 2^-14)."""

import itertools
import math
import os
import random
import re

import numpy as np

import pytest
import torch

from cute_fp4 import Recipe, ref
from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.common.encode import _SR_SEL, _sr_elem, sr_sign_sel
from cute_fp4.quant.cast_recipes import DIV_CONST, DIV_CONST_MIN_HEX
from cute_fp4.ref.formats import e2m1_encode_stochastic
from cute_fp4.quant.dispatch import (L2_WARM_MAX_BYTES, cast_groups, cast_kernel, cast_walk,
                                     row_group_run, walk_run)
from cute_fp4.quant.amax import THREADS as AMAX_THREADS, max_tensor_partials
from cute_fp4.quant.recipes_dispatch import (amax_recipe_kernel, amax_tiles_per_cta,
                                             cast_recipe_kernel, group_chunks, on_plain_cast,
                                             on_row_group_cast, on_token_rows,
                                             plain_cast_walk, ROW_GROUPS_MAX,
                                             row_group_groups, row_group_padding,
                                             row_group_tables, row_group_walk, strip_groups,
                                             token_amax_k1, token_row_streams,
                                             ragged_table)

ARCHS = ["sm_90a", "sm_100a"]
RECIPES = [
    ("bf16", Recipe(block=(16, 16), columnwise=True, swizzle=True)),
    ("fp16", Recipe(rht=True, columnwise=True, scaling="token")),
    ("bf16", Recipe(stochastic_rounding=True, columnwise=True)),
    ("fp32", Recipe(scaling="window64", columnwise=True, rht=True)),
    ("bf16", Recipe(four_over_six="mse", block=(16, 16), columnwise=True)),
    ("bf16", Recipe(four_over_six="mae", fast_math=True, e4m3_max=256, scaling="token")),
]


def _ieee_only(ptx):
    assert "div.approx" not in ptx and "rcp.approx" not in ptx and "div.full" not in ptx
    assert ".ftz" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,recipe", RECIPES)
def test_cast_recipe_ptx(arch, dtype, recipe):
    ptx = compile_ptx(*cast_recipe_kernel(dtype, recipe), arch=arch)
    assert ptx_target(ptx) == arch
    need = [r"div\.rn\.f32", r"rcp\.rn\.f32", r"cvt\.rn\.satfinite\.e4m3x2\.f32",
            r"st\.global\.v2\.b32", r"ld\.global\.nc\.v4"]
    if recipe.stochastic_rounding:
        need += [r"mul\.wide\.u32", r"mul\.rz\.f32"]
        # the stochastic encode needs no float <-> int conversion (slow pipe)
        assert "cvt.rmi" not in ptx and "cvt.rzi" not in ptx and "cvt.rn.f32.u32" not in ptx
    if recipe.rht:
        need += [r"sub\.rn\.f32", r"add\.rn\.f32"]
    if recipe.scaling == "window64":
        need += [r"shfl\.sync\.bfly"]
    assert missing_instructions(ptx, need) == []
    _ieee_only(ptx)
    fast = recipe.four_over_six is not None and recipe.fast_math
    assert ("cvt.rn.f16x2.e2m1x2" in ptx) == (fast and arch == "sm_100a")
    if fast and arch == "sm_100a":
        assert "mul.rn.f16x2" in ptx
    if arch == "sm_100a" and not recipe.stochastic_rounding:
        assert "cvt.rn.satfinite.e2m1x2.f32" in ptx
    if arch == "sm_90a":
        assert "e2m1" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,per_token,rht", [("bf16", False, True), ("fp32", True, True),
                                                 ("fp16", True, False)])
def test_amax_recipe_ptx(arch, dtype, per_token, rht):
    ptx = compile_ptx(*amax_recipe_kernel(dtype, per_token, rht, True, True), arch=arch)
    assert missing_instructions(ptx, [r"red\..*global\.max\.u32", r"ld\.global\.nc\.v4",
                                      r"max\.NaN\.f32"]) == []
    _ieee_only(ptx)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,per_token,rht", [("bf16", True, True), ("fp32", False, True),
                                                 ("fp16", False, False)])
def test_amax_recipe_column_sum_ptx(arch, dtype, per_token, rht):
    """With col_sum the amax pass also sums the columns: correctly rounded FP32 adds, stored
    as plain (non-atomic) partials - the order is fixed, so the result is deterministic."""
    ptx = compile_ptx(*amax_recipe_kernel(dtype, per_token, rht, True, not per_token, True),
                      arch=arch)
    plain = compile_ptx(*amax_recipe_kernel(dtype, per_token, rht, True, not per_token),
                        arch=arch)
    assert missing_instructions(ptx, [r"add\.rn\.f32", r"st\.global\.b32"]) == []
    assert ptx.count("add.rn.f32") > plain.count("add.rn.f32") and "st.global" not in plain
    assert "atom.global.add" not in ptx and "red.global.add" not in ptx
    _ieee_only(ptx)


def _hex_f32(h: str) -> np.float32:
    return np.array([int(h[2:], 16)], dtype=np.uint32).view(np.float32)[0]


def div_const_emulated(x: np.ndarray, d: int) -> np.ndarray:
    """cast_recipes.div_const on float32 x, exactly: q = RN(x * r), t = RN(q * d - x) (fma),
    RN(q - t * r) (fma). Products of two FP32 numbers and q * d - x are exact in float64; the
    last fma's sum is rounded once to float64 and the float64 TwoSum error decides the FP32
    rounding where that sum sits exactly on an FP32 midpoint (no double rounding)."""
    dh, rh = DIV_CONST[d]
    r = np.float64(_hex_f32(rh))
    xd = x.astype(np.float64)
    q = (xd * r).astype(np.float32).astype(np.float64)
    t = (q * np.float64(_hex_f32(dh)) - xd).astype(np.float32).astype(np.float64)
    p = -t * r
    s = q + p
    bv = s - q
    e = (q - (s - bv)) + (p - bv)
    out = s.astype(np.float32)
    lo = np.where(out.astype(np.float64) > s, np.nextafter(out, np.float32(-np.inf)), out)
    hi = np.nextafter(lo, np.float32(np.inf))
    mid = (s - lo.astype(np.float64)) == (hi.astype(np.float64) - s)
    return np.where(mid & (e > 0), hi, np.where(mid & (e < 0), lo, out))


def _div_const_mismatches(d: int, exponent: int) -> int:
    bits = np.arange(1 << 23, dtype=np.uint32) | np.uint32(exponent << 23)
    x = bits.view(np.float32)
    with np.errstate(all="ignore"):
        got = div_const_emulated(x, d)
        want = x / np.float32(d)
    return int((got.view(np.uint32) != want.view(np.uint32)).sum())


@pytest.mark.parametrize("d", sorted(DIV_CONST))
def test_div_const_constants(d):
    dh, rh = DIV_CONST[d]
    assert _hex_f32(dh) == np.float32(d)
    assert _hex_f32(rh) == np.float32(1) / np.float32(d)
    assert _hex_f32(DIV_CONST_MIN_HEX) == np.float32(2.0**-117)


EXHAUSTIVE = os.environ.get("CUTE_FP4_EXHAUSTIVE_DIV") == "1"
# exponent fields: the lowest exact one for either divisor (10 = 2^-117), unit, the top binade;
# the exhaustive run covers 10..254 (every positive finite x >= 2^-117; RN is odd, so -x too)
DIV_EXPONENTS = range(10, 255) if EXHAUSTIVE else [10, 127, 254]


@pytest.mark.parametrize("d", sorted(DIV_CONST))
@pytest.mark.parametrize("exponent", DIV_EXPONENTS)
def test_div_const_is_ieee_division(d, exponent):
    """Every significand of the binade: div_const(x, d) == fp32(x) / fp32(d) bit for bit."""
    assert _div_const_mismatches(d, exponent) == 0


@pytest.mark.parametrize("d,exponent", [(1536, 9), (2688, 7)])
def test_div_const_fails_below_its_domain(d, exponent):
    """Why the kernel keeps div.rn for |x| < 2^-117: the first failing binades."""
    assert _div_const_mismatches(d, exponent) > 0


@pytest.mark.parametrize("d", sorted(DIV_CONST))
def test_div_const_zero_signs_and_specials(d):
    x = np.array([0.0, -0.0, np.nan, np.finfo(np.float32).max, -2.0**-117], dtype=np.float32)
    with np.errstate(all="ignore"):
        got = div_const_emulated(x, d)
        want = x / np.float32(d)
    assert np.array_equal(np.signbit(got[:2]), [False, True])
    assert np.isnan(got[2])
    assert got[3:].view(np.uint32).tolist() == want[3:].view(np.uint32).tolist()
    with np.errstate(invalid="ignore"):
        inf = div_const_emulated(np.array([np.inf], dtype=np.float32), d)
    assert np.isnan(inf[0])  # +-inf is outside the domain (div.rn path)


# ---------------------------------------------------------------- stochastic encode emulation
# The PTX of one element, as emulated below (a = min(|x * enc|, 6), w the random word,
# c = 0x8000): B = bits(RZ(a * 2^-126)), d = 4 B + prmt(w, c); the code is byte 3 of d.
SR_PTX = ("min.f32 a, a, 0f40C00000;\nmul.rz.f32 a, a, 0f00800000;\nmov.b32 b, a;\n"
          "prmt.b32 r, {$r9}, c, {sel};\nmad.lo.u32 d{i}, b, 4, r;\n")


def _prmt(a: np.ndarray, b, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode, selector nibbles < 8) of the words a and the words (or the
    constant) b."""
    b = np.broadcast_to(np.asarray(b, np.uint32), a.shape)
    src = [(w >> np.uint32(8 * i)) & np.uint32(0xFF) for w in (a, b) for i in range(4)]
    out = np.zeros(a.shape, np.uint32)
    for i in range(4):
        out |= src[(sel >> (4 * i)) & 7] << np.uint32(8 * i)
    return out


def _rz_subnormal_bits(a: np.ndarray) -> np.ndarray:
    """bits(mul.rz.f32(a, 2^-126)) of FP32 a in [0, 6]: below 1 the product is subnormal and
    truncated to a multiple of 2^-149 (floor(a * 2^23), exact in float64), above it is exact."""
    a64 = a.astype(np.float64)
    normal = a.view(np.uint32).astype(np.int64) - (126 << 23)
    return np.where(a < 1, np.floor(a64 * 2.0**23).astype(np.int64), normal)


def sr_encode_emulated(v: np.ndarray, word: np.ndarray, k: int) -> np.ndarray:
    """The kernel's stochastic code of FP32 products v with byte k of the random words."""
    a = np.minimum(np.abs(v), np.float32(6)).astype(np.float32)
    r = _prmt(word, 0x8000, int(_SR_SEL[k], 16)).astype(np.int64)
    d = (4 * _rz_subnormal_bits(a) + r) & 0xFFFFFFFF
    return ((d >> 24) + 8 * (v < 0)).astype(np.uint8)


def _sr_values(exhaustive: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    n = 1 << 20 if exhaustive else 1 << 12
    lo = np.array([0, .5, 1, 1.5, 2, 3, 4], np.float64)
    gap = np.array([.5, .5, .5, .5, 1, 1, 2], np.float64)
    frac = np.arange(513, dtype=np.float64) / 512  # the thresholds (511 - 2b) / 512 and more
    grid = (lo[:, None] + gap[:, None] * frac[None, :]).astype(np.float32).ravel()
    parts = [rng.uniform(-7, 7, n).astype(np.float32),
             (rng.standard_normal(n) * 10.0 ** rng.uniform(-45, 3, n)).astype(np.float32),
             grid, np.nextafter(grid, np.float32(0)), np.nextafter(grid, np.float32(9)), -grid,
             np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 6.0000005], np.float32)]
    return np.concatenate(parts)


def test_sr_encode_ptx_is_the_emulated_one():
    for i in range(8):
        elem = _sr_elem(i, "{$r%d}" % i, "{$r9}", "v")
        assert SR_PTX.replace("{sel}", _SR_SEL[i % 4]).replace("{i}", str(i)) in elem


@pytest.mark.parametrize("k", range(4))
def test_sr_prmt_builds_the_rounding_offset(k):
    """prmt(w, 0x8000) = b << 16 | 0x8000 = (2b + 1) << 15 with b = byte k of the word: the
    offset (2b + 1) * 2^13 of the grid step 2^22, times 4."""
    w = np.random.default_rng(k).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    b = (w >> np.uint32(8 * k)) & np.uint32(0xFF)
    r = _prmt(w, 0x8000, int(_SR_SEL[k], 16))
    assert np.array_equal(r, (np.uint32(2) * b + np.uint32(1)) << np.uint32(15))


def _sign_word_emulated(pairs: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """common.encode.sign_word of packed 16-bit pairs: set.lt.u32 per half (IEEE x < 0), then
    lop3 (s & 0x08000800) | 0x80."""
    halves = torch.from_numpy(pairs.view(np.int16).copy()).view(dtype)
    neg = (halves < 0).numpy().reshape(-1, 2)
    s = np.where(neg[:, 0], 0xFFFF, 0) | np.where(neg[:, 1], 0xFFFF0000, 0)
    return ((s & 0x08000800) | 0x80).astype(np.uint32)


def test_sign_word_ptx():
    """The sign word is one set.lt.u32 of the pair against 0 and one lop3 (a & b) | c (its
    values: test_encode_ptx.test_sr_encode16_signed_matches_reference)."""
    from cute_fp4.common import encode

    for name, ty in (("bf16", "bf16x2"), ("fp16", "f16x2")):
        ptx = encode._sign_word_ptx(name)
        assert f"set.lt.u32.{ty} s, {{$r0}}, z;" in ptx
        assert "lop3.b32 {$w0}, s, 0x08000800, 0x80, 0xEA;" in ptx
    assert (0xF0 & 0xCC) | 0xAA == 0xEA  # the LUT of (a & b) | c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sr_sign_word_prmt_builds_offset_and_sign(dtype):
    """prmt(w, sign word) = (2b + 1) << 15 | 8 << 24 where the element is strictly negative:
    every random byte k and half, over random pairs with -0, +-0, +-inf, NaN and subnormals."""
    rng = np.random.default_rng(3)
    pairs = rng.integers(0, 2**32, 1 << 14, dtype=np.uint64).astype(np.uint32)
    pairs[:8] = [0x80000000, 0x00008000, 0x80008000, 0, 0x7FC0FFC0, 0x00018001, 0xFF80FF80,
                 0x7F807F80] if dtype == torch.bfloat16 else [
                 0x80000000, 0x00008000, 0x80008000, 0, 0x7E00FE00, 0x00018001, 0xFC00FC00,
                 0x7C007C00]
    sw = _sign_word_emulated(pairs, dtype)
    halves = torch.from_numpy(pairs.view(np.int16).copy()).view(dtype).reshape(-1, 2)
    w = rng.integers(0, 2**32, pairs.shape, dtype=np.uint64).astype(np.uint32)
    for half in range(2):
        neg = (halves[:, half] < 0).numpy().astype(np.uint32)
        for k in range(4):
            b = (w >> np.uint32(8 * k)) & np.uint32(0xFF)
            r = _prmt(w, sw, int(sr_sign_sel(k, half), 16))
            assert np.array_equal(r, ((2 * b + 1) << 15) | (neg << 27)), (half, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sr_encode_signed_matches_reference(dtype):
    """The signed variant's code, (4 B + prmt(w, sign word)) >> 24 with B from the FP32 product
    x * enc, against ref.formats.e2m1_encode_stochastic of that product, for 16-bit inputs
    x (every finite / infinite pattern of random halves, -0 and the smallest subnormals) and
    enc >= 2^-14 (the kernel's condition): the compare on x gives the product's sign."""
    rng = np.random.default_rng(4)
    pairs = rng.integers(0, 2**32, 1 << 13, dtype=np.uint64).astype(np.uint32)
    pairs[:4] = [0x80000000, 0x80018001, 0x00010001, 0x80008001]
    x = torch.from_numpy(pairs.view(np.int16).copy()).view(dtype).float()
    keep = ~torch.isnan(x).numpy()  # a NaN input makes its block's enc NaN (words zeroed)
    x[torch.isnan(x)] = 0.0
    sw = np.repeat(_sign_word_emulated(pairs, dtype), 2)
    half = np.tile([0, 1], pairs.size)
    for enc in (2.0 ** -14, 2.0 ** -14 * 1.37, 0.05, 1.0, 3.0e5, 3.4e38):
        v = (x * enc).numpy()
        for b in (0, 1, 127, 200, 255):
            w = np.full(v.shape, b << 16, np.uint32)
            r = np.where(half == 0, _prmt(w, sw, int(sr_sign_sel(2, 0), 16)),
                         _prmt(w, sw, int(sr_sign_sel(2, 1), 16))).astype(np.int64)
            a = np.minimum(np.abs(v), np.float32(6)).astype(np.float32)
            got = (((4 * _rz_subnormal_bits(a) + r) & 0xFFFFFFFF) >> 24).astype(np.uint8)
            want = e2m1_encode_stochastic(torch.from_numpy(v), torch.full(v.shape, b)).numpy()
            assert np.array_equal(got[keep], want[keep]), (enc, b)


def test_sr_encode_signed_needs_its_domain():
    """Why the kernel checks enc >= 2^-14: below it a negative bf16 subnormal's product can
    underflow to -0, which the reference encodes as +0 and the input's sign would not."""
    x = torch.tensor([-(2.0 ** -133)], dtype=torch.bfloat16)
    v = (x.float() * 2.0 ** -30).numpy()
    assert v[0] == 0 and np.signbit(v[0])
    sw = _sign_word_emulated(x.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32),
                             torch.bfloat16)
    r = _prmt(np.zeros(1, np.uint32), sw, int(sr_sign_sel(0, 0), 16))
    assert (r >> 24)[0] == 8  # code -0 from the input's sign
    assert e2m1_encode_stochastic(torch.from_numpy(v), torch.zeros(1))[0] == 0


def test_sr_encode_matches_reference():
    """Every random byte against ref.formats.e2m1_encode_stochastic (grid points, the k/512
    fractions of every gap and their FP32 neighbours, tiny / huge / special values)."""
    v = _sr_values(os.environ.get("CUTE_FP4_EXHAUSTIVE_SR") == "1")
    for b in range(256):
        got = sr_encode_emulated(v, np.full(v.shape, b << 16, np.uint32), 2)
        want = e2m1_encode_stochastic(torch.from_numpy(v), torch.full(v.shape, b)).numpy()
        assert np.array_equal(got, want), f"byte {b}"


def test_amax_tiles_per_cta():
    """RecipeAmax CTA rows take 4 m tiles, 2 or 1 where 4 would leave SMs without a CTA (bf16:
    512-byte slabs of K, fp32 128 columns)."""
    assert amax_tiles_per_cta(64, 8192, 2, 132) == 4  # 4096x8192: 32 slabs x 16 rows
    assert amax_tiles_per_cta(256, 2048, 2, 132) == 4  # 16384x2048: 8 x 64
    assert amax_tiles_per_cta(64, 2048, 2, 132) == 2  # 4096x2048: 8 x 16 = 128 at 4
    assert amax_tiles_per_cta(32, 2048, 2, 132) == 1  # 2048x2048: 8 x 16 = 128 at 2
    assert amax_tiles_per_cta(66, 2048, 2, 132) == 4  # 8 x 17 = 136
    assert amax_tiles_per_cta(64, 2048, 4, 132) == 4  # fp32 4096x2048: 16 x 16
    assert amax_tiles_per_cta(1, 16, 2, 132) == 1


def test_token_amax_k1():
    """Per-token recipes with both outputs and per-tensor RHT recipes, without column sums,
    take K1 (with the RHT its transformed column amaxes)."""
    sr = Recipe(scaling="token", stochastic_rounding=True, columnwise=True)
    assert token_amax_k1(sr, False)
    assert not token_amax_k1(sr, True)  # column sums
    assert token_amax_k1(sr.replace(rht=True), False)
    assert token_amax_k1(sr.replace(rht=True, stochastic_rounding=False), False)
    assert not token_amax_k1(sr.replace(rht=True), True)
    assert not token_amax_k1(sr.replace(columnwise=False), False)
    assert not token_amax_k1(sr.replace(scaling="tensor"), False)
    for rowwise in (True, False):
        rht = Recipe(rht=True, columnwise=True, rowwise=rowwise)
        assert token_amax_k1(rht, False) and token_amax_k1(rht.replace(stochastic_rounding=True),
                                                            False)
        assert not token_amax_k1(rht, True)


def test_token_tensor_split():
    """K1 per tensor's (tiles per CTA, CTAs): the fewest tiles per CTA, a power of two, that
    keep the CTAs (the cast's partials) within max_tensor_partials, and enough CTAs for every
    128-row x 512-byte tile."""
    from cute_fp4.quant.amax import max_tensor_partials, token_tensor_split

    cap = max_tensor_partials(132)
    assert token_tensor_split(4096, 8192, 2, 132) == (1, 1024)  # 32 slabs x 32 tile rows
    assert token_tensor_split(8192, 8192, 2, 132) == (2, 1024)
    assert token_tensor_split(32768, 8192, 2, 132) == (8, 1024)
    assert token_tensor_split(16, 16, 2, 132) == (1, 1)
    for m, k, esize in [(4224, 8192, 2), (2064, 8200, 4), (65536, 1040, 2), (160, 16, 4)]:
        tiles = -(-k * esize // 512) * -(-m // 128)
        per_cta, ctas = token_tensor_split(m, k, esize, 132)
        assert per_cta & (per_cta - 1) == 0 and ctas <= cap and per_cta * ctas >= tiles
        assert per_cta == 1 or -(-tiles // (per_cta // 2)) > cap


def test_plain_cast_routing():
    """Single-tensor 1x16 recipes (tensor or token scaling, no 4over6) with the columnwise RHT
    (bf16 / fp16, with the twin) and / or stochastic rounding (any dtype), and per-tensor
    16x16 recipes with stochastic rounding (not RN: the plain dispatch), run on the plain
    cast: SR alone with one CTA per SM and the run for fp32 only; with the RHT two CTAs per
    SM, the run per tensor without SR, per token wherever the shape allows it except RHT + SR
    below L2_WARM_MAX_BYTES, which preloads (as per tensor); every other RHT / SR recipe on
    the recipe kernel."""
    rht = Recipe(rht=True, columnwise=True)
    sr = Recipe(stochastic_rounding=True)
    for recipe, dtype in [(rht, "bf16"), (rht, "fp16"), (sr, "fp32"), (sr, "bf16"),
                          (rht.replace(scaling="token", swizzle=True, rowwise=False), "bf16"),
                          (rht.replace(stochastic_rounding=True), "fp16"),
                          (sr.replace(scaling="token", columnwise=True, swizzle=True), "fp32"),
                          (sr.replace(rht=True), "fp32"),  # rowwise only: SR alone
                          (sr.replace(block=(16, 16)), "bf16"),
                          (sr.replace(block=(16, 16), columnwise=True, swizzle=True), "fp32")]:
        assert on_plain_cast(recipe, 1, dtype), recipe
    for recipe, groups, dtype in [
            (rht, 1, "fp32"), (rht, 2, "bf16"), (rht.replace(columnwise=False), 1, "bf16"),
            (rht.replace(stochastic_rounding=True), 1, "fp32"), (sr, 2, "bf16"),
            (sr.replace(block=(16, 16)), 2, "bf16"), (Recipe(block=(16, 16)), 1, "bf16"),
            (Recipe(block=(16, 16), four_over_six="mae"), 1, "bf16"),
            (sr.replace(scaling="window64"), 1, "bf16"),
            (rht.replace(four_over_six="mse"), 1, "bf16"),
            (rht.replace(scaling="window64"), 1, "bf16"),
            (Recipe(columnwise=True), 1, "bf16")]:
        assert not on_plain_cast(recipe, groups, dtype), recipe
    for m, per_token, esize in [(4096, False, 2), (8192, True, 2), (64, False, 2),
                                (8192, False, 4), (8192, True, 4)]:
        plain = cast_walk(m, 8192, esize, per_token, False, True, True, 132)
        for rht, sr in [(True, False), (False, True), (True, True)]:
            if rht and esize == 4:
                continue
            walk = plain_cast_walk(m, 8192, esize, per_token, True, True, 132, rht, sr)
            assert walk[1:4] == plain[1:4] and walk[5] == plain[5]
            if sr and not rht:  # one CTA per SM, the run for fp32 only
                assert walk[0] == 1
                assert walk[4] == (plain[4] if esize == 4 else 1) and not walk[6]
            elif not per_token:
                assert walk[0] == 2 and walk[4] == (1 if sr else plain[4]) and walk[6] == sr
            else:  # the run wherever the shape allows it, except RHT + SR below the bound
                assert walk[0] == 2 and walk[6] == (sr and walk[1])
                assert walk[4] == (1 if walk[6] else walk_run(m, 8192, esize, True, 132))
    assert plain_cast_walk(8192, 8192, 4, False, True, True, 132, False, True)[4] == 16
    big = L2_WARM_MAX_BYTES // 2 // 8192  # rows of a bf16 [*, 8192] at the bound
    for m, rht, sr, want in [
            (big, True, True, (2, False, True, 4, 8, False, False)),
            (big - 512, True, True, (2, True, True, 4, 1, False, True)),
            (big, False, True, (1, False, True, 4, 1, False, False)),
            (4096, True, False, (2, True, True, 4, 8, False, False)),
            (512, True, False, (2, True, True, 4, 1, False, False))]:  # 64 runs: too few
        assert plain_cast_walk(m, 8192, 2, True, True, True, 132, rht, sr) == want


def test_row_group_cast_routing():
    """Grouped inputs of 2 .. ROW_GROUPS_MAX groups run the plain cast with row groups for
    per-tensor and per-token 1x16 RN recipes, compact or swizzled scales, whose groups are
    multiples of 16 rows (rowwise-only RHT included: it changes nothing), with tables for
    the next power of two of groups from 8; per tensor its walk is the per-tensor cast's with
    the enc tables at every size, no preload, no prefetch (the lanes' groups come from smem
    once per unit), rowwise only two CTAs per SM; per token the per-token cast's with the
    row-group run, no preload; the rest stays on the recipe kernel."""
    sizes = [272, 0, 64, 48]
    for recipe in (Recipe(columnwise=True), Recipe(), Recipe(rowwise=False, columnwise=True),
                   Recipe(rht=True), Recipe(columnwise=True, swizzle=True),
                   Recipe(swizzle=True), Recipe(scaling="token", columnwise=True),
                   Recipe(scaling="token", rowwise=False, columnwise=True, swizzle=True),
                   Recipe(scaling="token", swizzle=True)):
        assert on_row_group_cast(recipe, sizes), recipe
    base = Recipe(columnwise=True)
    assert on_row_group_cast(base, [16] * ROW_GROUPS_MAX)
    for recipe, groups in [(base, [384]), (base, [16, 40, 8]), (Recipe(), [5, 11]),
                           (base, [16] * (ROW_GROUPS_MAX + 1)),
                           (base.replace(swizzle=True), [16, 40, 8]),
                           (base.replace(rht=True), sizes),
                           (base.replace(scaling="token", rht=True), sizes),
                           (base.replace(scaling="token", stochastic_rounding=True), sizes),
                           (base.replace(stochastic_rounding=True), sizes),
                           (base.replace(block=(16, 16)), sizes),
                           (base.replace(four_over_six="mae"), sizes),
                           (base.replace(scaling="window64"), [64, 128])]:
        assert not on_row_group_cast(recipe, groups), (recipe, groups)
    assert [row_group_tables(n) for n in (2, 8, 9, 16, 17, 64)] == [8, 8, 16, 16, 32, 64]
    for m, esize in [(4096, 2), (1 << 16, 2), (8192, 4), (64, 2)]:
        for col, row in [(True, True), (False, True), (True, False)]:
            for swz in (False, True):
                plain = cast_walk(m, 8192, esize, False, False, col and not swz,
                                  row and not swz, 132)
                walk = row_group_walk(m, 8192, esize, col, row, swz, 132)
                assert walk == ((plain[0] if col else 2), plain[1], False, plain[3],
                                row_group_run(m, 8192, esize, 132), True, False)
                assert not swz or walk[3] == 1  # no bands
                if row and not swz:  # the full run stages the compact rowwise scales
                    assert walk[4] == plain[4] or plain[4] == 1
                token = cast_walk(m, 8192, esize, True, False, col and not swz,
                                  row and not swz, 132)
                assert row_group_walk(m, 8192, esize, col, row, swz, 132, True) == (
                    token[:4] + (row_group_run(m, 8192, esize, 132), False, False))
                # groups whose twin rows are not whole sectors: a band of up to 64 tile rows
                # (the most that divides them) with a columnwise output, except per token
                # swizzled; the rest of the walk unchanged
                n_tm = -(-m // 128)
                for per_token, base in ((False, walk), (True, token[:4] + walk[4:5] + (
                        False, False))):
                    ragged = row_group_walk(m, 8192, esize, col, row, swz, 132, per_token, True)
                    wide = col and not (per_token and swz)
                    assert ragged == base[:3] + ((min(64, n_tm & -n_tm) if wide else base[3]),
                                                 ) + base[4:]
    assert [row_group_walk(m, 1024, 2, True, True, False, 132, False, True)[3]
            for m in (64, 1232, 2048, 4096, 1 << 16)] == [1, 2, 16, 32, 64]
    # consumer groups of 16-bit row+col casts: two, except per token swizzled without ragged
    # twins (cast_groups': one below L2_WARM_MAX_BYTES); the rest cast_groups'
    for m, esize, dtype in [(4096, 2, "bf16"), (1232, 2, "fp16"), (1 << 16, 2, "bf16"),
                            (4096, 4, "fp32")]:
        for per_token, swz, row, col, ragged in itertools.product(*[(False, True)] * 5):
            walk = row_group_walk(m, 8192, esize, col, row, swz, 132, per_token, ragged)
            plain = cast_groups(dtype, row, col, swz, per_token, False, walk, False, False,
                                False, m * 8192)
            two = row and col and esize == 2 and not (per_token and swz and not ragged)
            assert row_group_groups(dtype, row, col, swz, per_token, walk, m * 8192,
                                    ragged) == (2 if two else plain), (m, dtype, walk)
            # where two differs from cast_groups': below 2^24 elements, and per token swizzled
            # on two CTAs per SM (below L2_WARM_MAX_BYTES)
            assert plain == 2 or m * 8192 < (1 << 24) or not (row and col and esize == 2) or (
                per_token and swz and m * 8192 * esize < L2_WARM_MAX_BYTES)
    # the longest power-of-two run up to the full one that divides the tile row and leaves
    # RUN_MIN_UNITS_PER_SM runs per SM
    assert [row_group_run(m, k, 2, 132) for m, k in [
        (4096, 8192), (4096, 2048), (8192, 2048), (2048, 2048), (4096, 1040), (32768, 1024)]] \
        == [8, 2, 4, 1, 1, 8]
    assert row_group_run(4096, 8192, 4, 132) == 16 and row_group_run(4096, 2048, 4, 132) == 4
    # the chunked amax pass: each group's chunks (its grid-stride shares of AMAX_THREADS
    # threads) load every vector of the group once, each chunk at least one; one wave of
    # max_tensor_partials chunks (no more than one CTA's loads each allow; more only for more
    # nonempty groups), of about equal loads
    for sizes, k, esize, sms in [([272, 0, 64, 704, 16, 128, 48], 1040, 2, 132),
                                 ([272, 0, 64, 704, 16, 128, 48], 8192, 2, 132),
                                 ([272, 0, 64, 704, 16, 128, 48], 16, 4, 132),
                                 ([272, 0, 64, 704, 16, 128, 48], 64, 2, 1),
                                 ([16] * 12, 64, 2, 1),
                                 ([1584, 2016, 2576, 1488, 2080, 2544, 1616, 2480], 8192, 2, 132),
                                 ([1536, 2048, 2560, 1536, 2048, 2560, 1536, 2560], 8192, 2, 132)]:
        chunks, pfirst = group_chunks(sizes, k, esize, sms)
        per_row = k * esize // 16
        assert len(pfirst) == len(sizes) + 1 and pfirst[-1] == len(chunks)
        wave = max(max_tensor_partials(sms), sum(map(bool, sizes)))
        assert len(chunks) <= wave
        if k == 8192:  # large inputs: the whole wave, chunks within 3% of equal loads
            assert len(chunks) == wave
            share = sum(sizes) * per_row / wave
            assert all(abs(mg * per_row / (pfirst[g + 1] - pfirst[g]) - share) < 0.03 * share
                       for g, mg in enumerate(sizes) if mg)
        row0 = 0
        for g, mg in enumerate(sizes):
            loads = [[v for t in range(AMAX_THREADS) for v in range(first + t, end, step)]
                     for first, end, step in chunks[pfirst[g]:pfirst[g + 1]].tolist()]
            assert sorted(v for mine in loads for v in mine) == list(
                range(row0 * per_row, (row0 + mg) * per_row))
            counts = [len(mine) for mine in loads]
            assert all(counts) and max(counts, default=0) - min(counts, default=0) <= AMAX_THREADS
            row0 += mg
    short = (1, True, False, 1, 4, True, False)
    cast_kernel("bf16", True, True, True, False, walk=short, row_groups=8)
    for bad in ((False, 4, 0), (True, 8, 0), (True, 3, 8), (True, 16, 8)):
        with pytest.raises(ValueError, match="run"):
            cast_kernel("bf16", True, True, bad[0], False, walk=short[:4] + (bad[1],) + short[5:],
                        row_groups=bad[2])


def test_token_rows_routing():
    """TokenRowCast takes per-token rowwise-only 1x16 recipes without 4over6 or column sums:
    single tensors and grouped inputs, rounding to nearest or stochastic (any sizes; swizzled
    every group but the last a multiple of 128 rows); everything else stays off it."""
    token = Recipe(scaling="token")
    sr = token.replace(stochastic_rounding=True)
    for recipe, sizes in [(sr, [48]), (sr.replace(swizzle=True), [48]), (token, [48]),
                          (token.replace(swizzle=True), [5]), (token, [5, 0, 100]),
                          (token, [16, 16]), (token.replace(rht=True), [5, 7]),
                          (token.replace(swizzle=True), [128, 0, 256, 5]),
                          (token.replace(swizzle=True), [0, 7]), (sr, [16, 16]),
                          (sr, [5, 0, 100]), (sr.replace(swizzle=True), [128, 0, 5])]:
        assert on_token_rows(recipe, sizes, False), (recipe, sizes)
    for recipe, sizes, col_sum in [
            (token, [48], True), (sr, [48], True), (sr, [16, 16], True),
            (sr.replace(swizzle=True), [64, 64], False),
            (token.replace(swizzle=True), [64, 64], False),
            (token.replace(swizzle=True), [128, 0, 5, 128], False),
            (token.replace(columnwise=True), [16, 16], False),
            (sr.replace(columnwise=True), [48], False), (Recipe(), [16, 16], False),
            (token.replace(four_over_six="mae"), [16, 16], False),
            (Recipe(scaling="window64"), [64, 64], False)]:
        assert not on_token_rows(recipe, sizes, col_sum), (recipe, sizes, col_sum)


def test_token_row_streams():
    """TokenRowCast grouped's per-row table: each row's Philox stream 2g and its group's first
    row (empty groups take no rows)."""
    sizes = [3, 0, 2, 1]
    want = [v for g, mg in enumerate(sizes) for _ in range(mg)
            for v in (2 * g, sum(sizes[:g]))]
    got = token_row_streams(sizes)
    assert got.dtype == np.int32 and got.tolist() == want
    assert want == [0, 0, 0, 0, 0, 0, 4, 3, 4, 3, 6, 5]
    assert token_row_streams([0, 0]).size == 0


@pytest.mark.parametrize("per_group", [0, 1, 3, 40, 300])
@pytest.mark.parametrize("cols", [1, 2, 3])
def test_ragged_table(cols, per_group):
    """A plan's ragged tables (counts[g] rows of group g, the i-th rows[g] + i * steps, numpy
    int32), against their expansion; token_row_streams and strip_groups of large groups
    too."""
    rnd = random.Random(cols * 1000 + per_group)
    g = 7
    rows = [tuple(rnd.randint(-5000, 5000) for _ in range(cols)) for _ in range(g)]
    counts = [rnd.randint(0, 2 * per_group) for _ in range(g)]
    steps = tuple(rnd.choice([0, 1, -3, 256]) for _ in range(cols))
    for st in (steps, None):
        want = [[v + i * d for v, d in zip(r, st or (0,) * cols)]
                for r, k in zip(rows, counts) for i in range(k)]
        got = ragged_table(rows, counts, st)
        assert got.dtype == np.int32 and got.flags.c_contiguous
        assert got.shape == (sum(counts), cols) and got.tolist() == want
    sizes = [16 * rnd.randint(0, 2 * per_group) for _ in range(g)]
    assert strip_groups(sizes).tolist() == [g for g, mg in enumerate(sizes)
                                            for _ in range(mg // 16)]
    assert token_row_streams(sizes).tolist() == [
        v for g, mg in enumerate(sizes) for _ in range(mg) for v in (2 * g, sum(sizes[:g]))]


def test_arith_runs():
    """Runs of start + j * step (a step per run; empty runs, negative steps) one after another,
    against their expansion."""
    from cute_fp4.quant.tables import arith_runs

    rnd = random.Random(4)
    for _ in range(50):
        runs = [(rnd.randint(-900, 900), rnd.choice([0, 0, 1, 5, 40]), rnd.choice([-7, -1, 1, 64]))
                for _ in range(rnd.randint(1, 9))]
        got = arith_runs(*zip(*runs))
        assert got.dtype == np.int64
        assert got.tolist() == [a + j * d for a, c, d in runs for j in range(c)]


def test_strip_groups():
    """K1 with row groups' table: the group of each 16-row strip (empty groups take none)."""
    sizes = [32, 0, 16, 48]
    got = strip_groups(sizes)
    assert got.dtype == np.int32
    assert got.tolist() == [g for g, mg in enumerate(sizes) for _ in range(mg // 16)]
    assert got.tolist() == [0, 0, 2, 3, 3, 3]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("dtype,row,col,swz,tables", [
    ("bf16", True, True, False, 8), ("fp32", True, True, False, 64),
    ("fp16", False, True, False, 16), ("bf16", True, False, False, 8),
    ("bf16", True, True, True, 8), ("fp32", True, False, True, 16),
    ("fp16", False, True, True, 8)])
def test_row_group_cast_ptx(arch, dtype, row, col, swz, tables):
    """The row-group cast: TMA loads and the plain cast's encoders (hardware e2m1 on sm_100a);
    a prologue computing each group's outer scales (IEEE division, reciprocal) and enc table
    in shared memory (a loop over the groups' scale bytes); no global load per tile or amax
    (each lane's group from a search of the groups' starts in smem); the twin's stores and
    the swizzled rowwise scale stores predicated (@p st: no branch around them)."""
    walk = row_group_walk(4096, 8192, 4 if dtype == "fp32" else 2, col, row, swz, 132)
    ptx = compile_ptx(*cast_kernel(dtype, row, col, swz, False, walk=walk,
                                   row_groups=tables), arch=arch)
    assert missing_instructions(ptx, [r"cp\.async\.bulk\.tensor", r"div\.rn\.f32",
                                      r"rcp\.rn\.f32", r"st\.global\.v2\.b32"]) == []
    assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (arch == "sm_100a")
    assert "rcp.approx" not in ptx and "vote" not in ptx  # no fast copy: one copy of the passes
    assert "ld.global.nc.v4" not in ptx
    assert ("@p st.global.v2.b32" in ptx) == col
    assert ("@p st.global.b8" in ptx) == (col or (row and swz))
    # the prologue's group amaxes: each thread's consecutive partials, then a segmented
    # shuffle reduction per warp and shared atomics
    assert missing_instructions(ptx, [r"red\.relaxed\.cta\.shared\.max\.u32",
                                      r"shfl\.sync\.down", r"shfl\.sync\.up"]) == []
    # rowwise only with swizzled scales: a padding warp (after the producer) waits at the
    # named barrier the consumers arrive at after the prologue
    pad_warp = row and swz and not col
    assert (re.search(r"bar\.arrive\s+2,", ptx) is not None) == pad_warp
    assert (re.search(r"bar\.sync\s+2,", ptx) is not None) == pad_warp
    assert f".reqntid {32 * (8 + 1 + pad_warp)}, 1, 1" in ptx
    with pytest.raises(ValueError, match="row_groups"):  # per tensor the enc tables
        cast_kernel(dtype, row, col, swz, False, walk=walk[:5] + (False, False),
                    row_groups=tables)
    with pytest.raises(ValueError, match="enc_table"):  # per token none
        cast_kernel(dtype, row, col, swz, True, walk=walk, row_groups=tables)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("dtype,row,col,swz,groups,padding", [
    ("bf16", True, True, False, 2, True), ("bf16", True, True, True, 1, True),
    ("bf16", True, True, True, 2, False), ("fp32", True, True, False, 1, True),
    ("fp16", False, True, True, 1, True), ("bf16", True, False, True, 1, True)])
def test_row_group_token_cast_ptx(arch, dtype, row, col, swz, groups, padding):
    """The per-token row-group cast: no prologue reduction (the amax pass wrote the rows'
    amaxes and each group's column amaxes) and no enc tables; the fast copy and the IEEE one
    of the passes behind a warp vote; with the twin one lane per column loads its column's
    amax in its block row's group (used where the tile's block rows lie in one group: a second
    warp vote) and, in the IEEE copy's column pass for tiles spanning groups, each thread its
    own columns' in its block row's group; the twin's stores are predicated; the padding warp
    for swizzled scales with padding (swizzled row+col of two groups: ragged groups, whose
    padding K1 zeroes: row_group_groups)."""
    walk = row_group_walk(4096, 8192, 4 if dtype == "fp32" else 2, col, row, swz, 132, True,
                          not padding)
    ptx = compile_ptx(*cast_kernel(dtype, row, col, swz, True, walk=walk, groups=groups,
                                   row_groups=8, padding=padding), arch=arch)
    assert missing_instructions(ptx, [r"cp\.async\.bulk\.tensor", r"div\.rn\.f32",
                                      r"rcp\.rn\.f32", r"vote\.sync\.all"]) == []
    assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (arch == "sm_100a")
    assert "red.relaxed.cta.shared.max" not in ptx and "shfl.sync.down" not in ptx
    # the lanes' row or column amaxes one tile ahead (the first before the walk); the
    # spanning tiles' own columns'
    cols = 1 if dtype == "fp32" else 2  # input columns per 4-byte word
    assert len(re.findall(r"ld\.global\.f32", ptx)) == 2 + cols * col
    assert len(re.findall(r"vote\.sync\.all", ptx)) == 1 + col
    assert ("@p st.global.v2.b32" in ptx) == col
    pad_warp = swz and padding  # (per tensor only without the twin)
    assert (re.search(r"bar\.arrive\s+2,", ptx) is not None) == pad_warp
    assert f".reqntid {32 * (8 * groups + 1 + pad_warp)}, 1, 1" in ptx


def test_row_group_padding():
    """Whether a grouped input's swizzled scales have padding (CastKernel padding): their
    padded buffers (ref.swizzle.swizzled_shape, one per group) hold more bytes than the
    groups' scales, rowwise ([M_g, k / 16]) or of the twin ([k, M_g / 16])."""
    gen = np.random.default_rng(5)
    for _ in range(300):
        sizes = [16 * int(v) for v in gen.choice([0, 1, 3, 4, 8, 16, 24], gen.integers(1, 6))]
        k = 16 * int(gen.choice([1, 4, 8, 12, 64, 65, 128]))

        def padded(shapes):
            return any(math.prod(ref.swizzle.swizzled_shape(r, c)) > r * c for r, c in shapes)

        pad_row = padded([(mg, k // 16) for mg in sizes])
        pad_col = padded([(k, mg // 16) for mg in sizes])
        for row, col in ((True, True), (True, False), (False, True)):
            assert row_group_padding(sizes, k, row, col) == ((row and pad_row)
                                                             or (col and pad_col)), (sizes, k)
    assert not row_group_padding([128, 0, 256], 1024, True, True)
    assert not row_group_padding([0, 0], 1040, True, True)  # empty groups have no scales
    assert row_group_padding([128, 64], 1024, True, False)
    assert not row_group_padding([128, 64], 1024, False, True)
    assert row_group_padding([128, 256], 1040, False, True)


def test_pack_tables():
    """A plan's tables in one staging buffer (recipes_dispatch._upload, whose pinned copy
    needs a GPU): int32 / int64 numpy tables of any shape, empty ones too, each from a 16-byte
    boundary with zero bytes between (the buffer poisoned first), and typed views of the
    packed buffer (one as_strided each) equal to them."""
    from cute_fp4.quant.tables import pack, pack_offsets, typed_views

    gen = np.random.default_rng(3)
    for _ in range(50):
        tables = {}
        for i in range(int(gen.integers(1, 7))):
            dtype = (np.int32, np.int64)[int(gen.integers(2))]
            n = int(gen.integers(0, 40))
            shape = (n,) if i % 2 else (n, 3)
            tables[f"t{i}"] = gen.integers(-2**31, 2**31, shape).astype(dtype)
        offsets, n = pack_offsets(tables)
        assert n % 16 == 0 and all(o % 16 == 0 for o in offsets) and offsets == sorted(offsets)
        assert n == sum(-(-t.nbytes // 16) * 16 for t in tables.values())
        buf = torch.full((n,), 0xA5, dtype=torch.uint8)
        pack(buf.numpy(), tables, offsets)
        used = torch.zeros(n, dtype=torch.bool)
        for t, o in zip(tables.values(), offsets):
            used[o:o + t.nbytes] = True
        assert not bool(buf[~used].any())  # the gaps are zeros
        views = typed_views(buf, tables, offsets)
        assert list(views) == list(tables)
        for attr, view in views.items():
            t = tables[attr]
            assert view.dtype == {np.int32: torch.int32, np.int64: torch.int64}[t.dtype.type]
            assert view.shape == t.shape and view.is_contiguous()
            assert view.tolist() == t.tolist()
            assert not t.size or view.data_ptr() == buf.data_ptr() + offsets[
                list(tables).index(attr)]


def test_padding_tiles():
    """The tiles the chunked AmaxTensor zeroes (padding_tiles) cover every padding byte of the
    groups' swizzled scales (ref.swizzle offsets of the real [M_g, k / 16] and twin [k, M_g /
    16] scales in each group's padded buffer, the buffers one after another), each holds some
    padding, none twice, all inside the buffers; none where row_group_padding says there is
    no padding."""
    from cute_fp4.quant.padding import padding_tiles

    gen = np.random.default_rng(11)
    for _ in range(200):
        sizes = [16 * int(v) for v in gen.choice([0, 1, 3, 4, 8, 9, 16, 24], gen.integers(2, 7))]
        k = 16 * int(gen.choice([1, 4, 5, 8, 12, 64, 65, 128]))
        real = {}
        for side, shapes in (("s", [(mg, k // 16) for mg in sizes]),
                             ("st", [(k, mg // 16) for mg in sizes])):
            flags = []
            for r, c in shapes:
                buf = torch.zeros(math.prod(ref.swizzle.swizzled_shape(r, c)), dtype=torch.bool)
                if r and c:
                    rr, cc = torch.meshgrid(torch.arange(r), torch.arange(c), indexing="ij")
                    buf[ref.swizzle.swizzled_offset(rr, cc, c).reshape(-1)] = True
                flags.append(buf)
            real[side] = torch.cat(flags)
        for row, col in ((True, True), (True, False), (False, True)):
            tiles = padding_tiles(sizes, k, row, col)
            assert tiles.dtype == np.int64 and len(set(tiles.tolist())) == tiles.size
            zeroed = {"s": torch.zeros_like(real["s"]), "st": torch.zeros_like(real["st"])}
            for v in tiles.tolist():
                side, t = ("s", v) if v >= 0 else ("st", -1 - v)
                tile = real[side][512 * t:512 * t + 512]
                assert len(tile) == 512 and not bool(tile.all())
                zeroed[side][512 * t:512 * t + 512] = True
            for side, on in (("s", row), ("st", col)):
                assert bool((zeroed[side] | real[side]).all()) or not on, (sizes, k, side)
                assert on or not bool(zeroed[side].any())
            assert bool(tiles.size) == row_group_padding(sizes, k, row, col), (sizes, k)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("row,col", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("per_token", [True, False])
def test_row_group_cast_without_padding_ptx(arch, row, col, per_token):
    """padding=False (row groups with swizzled scales and none to zero, or whose amax pass
    zeroes it): no padding warp (9 warps, no named barrier) and no padding code: fewer byte
    and word stores of zeros than with padding, the tiles' scale stores unchanged
    (predicated); refused without row groups or swizzled scales."""
    walk = row_group_walk(4096, 8192, 2, col, row, True, 132, per_token)
    ptx = {pad: compile_ptx(*cast_kernel("bf16", row, col, True, per_token, walk=walk,
                                         row_groups=8, padding=pad), arch=arch)
           for pad in (True, False)}
    assert re.search(r"bar\.(sync|arrive)\s+2,", ptx[False]) is None
    assert ".reqntid 288, 1, 1" in ptx[False]
    stores = {pad: [len(re.findall(rf"^\s*st\.global\.{w}\b", p, re.M)) for w in ("b8", "b32")]
              for pad, p in ptx.items()}
    assert stores[False][0] + stores[False][1] < stores[True][0] + stores[True][1]
    assert ptx[False].count("@p st.global.b8") == ptx[True].count("@p st.global.b8") > 0
    compact = row_group_walk(4096, 8192, 2, col, row, False, 132, per_token)
    for swz, walk, groups in ((False, compact, 8), (True, None, 0)):
        with pytest.raises(ValueError, match="padding=False"):
            cast_kernel("bf16", row, col, swz, per_token, walk=walk, row_groups=groups,
                        padding=False)


def test_rowwise_rht_runs_without_it():
    """The RHT transforms the twin's input only, so a rowwise-only recipe with rht=True gives
    the bytes of the same recipe without it (ref.quantize) and runs its kernels: the plain cast
    for RN, the plain SR cast with stochastic rounding (fp32 included, which the RHT cast does
    not take), the same compiled recipe kernel otherwise."""
    from cute_fp4.ops import plain_cast
    from cute_fp4.quant.recipes_dispatch import _cast_config

    for scaling in ("tensor", "token"):
        row = Recipe(scaling=scaling, rht=True)
        assert not row.twin_rht and row.replace(columnwise=True).twin_rht
        assert row.replace(rowwise=False, columnwise=True).twin_rht
        assert plain_cast(row) and plain_cast(row.replace(swizzle=True))
        assert not plain_cast(row.replace(columnwise=True))
        assert on_plain_cast(row.replace(stochastic_rounding=True), 1, "fp32")
        assert not on_plain_cast(row.replace(stochastic_rounding=True, columnwise=True), 1,
                                 "fp32")
    fos = Recipe(scaling="token", four_over_six="mse")
    assert _cast_config("bf16", fos.replace(rht=True)) == _cast_config("bf16", fos)
    assert _cast_config("bf16", fos.replace(rht=True, columnwise=True)) != \
        _cast_config("bf16", fos.replace(columnwise=True))
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 128)
    for recipe in (Recipe(rht=True), Recipe(scaling="token", rht=True, stochastic_rounding=True)):
        got, want = ref.quantize(x, recipe, seed=7), ref.quantize(x, recipe.replace(rht=False),
                                                                   seed=7)
        assert torch.equal(got.data, want.data) and torch.equal(got.amax, want.amax)
        assert torch.equal(got.scales.view(torch.uint8), want.scales.view(torch.uint8))
