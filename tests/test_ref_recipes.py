"""Recipe options of SPEC section 2 on hand-worked blocks: window64, 16x16 tiles, 4over6 (mae,
mse, fast_math, e4m3_max 256), stochastic rounding with explicit random bits and Philox, and
the 16-point RHT. Block constants and FP32 derivations: see tests/test_ref_quantize.py."""

import math

import pytest
import torch

from cute_fp4 import Recipe, ref
from cute_fp4.ref.quantize import _fp16_product, _rht_butterflies

F32 = torch.float32

from test_ref_quantize import (BLOCK_A, BLOCK_B, BLOCK_C, BYTES_A, BYTES_B, BYTES_C, u8)

# Block A / 2 (tile rows 1, 3, ... below), quantized with the scale of block A (enc = 1):
#   3->5  -2.5->tie->C  2.25->4  .125->0  .15->0  -.375->9  .625->1  .875->2
#   -1.25->tie->A  1.75->tie->4  2.55->5  0->0  -.05->8  1->2  -3->D  .4->1
# Bytes: C5 04 90 21 4A 05 28 1D.
BYTES_A_HALF_AT_A_SCALE = [0xC5, 0x04, 0x90, 0x21, 0x4A, 0x05, 0x28, 0x1D]


def scaled(block, k):
    return [v * k for v in block]


# ---------------------------------------------------------------------------------------------
# window64: one amax per 64 elements, shared by its four 16-blocks
# ---------------------------------------------------------------------------------------------

# Window 0 = A B C B (amax 6, S_enc 448): scales 7E 76 7C 76 (as per-tensor with amax 6).
# Window 1 = the same / 8 (amax 0.75, S_enc 3584 = 8 * 448): every product in the derivation
# scales by a power of two, so the scales and bytes repeat exactly.
WINDOW_X = sum([BLOCK_A, BLOCK_B, BLOCK_C, BLOCK_B], [])
WINDOW_X = WINDOW_X + scaled(WINDOW_X, 1 / 8)


def test_window64_hand():
    x = torch.tensor([WINDOW_X])
    t = ref.quantize(x, Recipe(scaling="window64"))
    assert t.amax.tolist() == [[6.0, 0.75]]
    assert u8(t.scales) == [[0x7E, 0x76, 0x7C, 0x76] * 2]
    assert t.data.tolist() == [(BYTES_A + BYTES_B + BYTES_C + BYTES_B) * 2]


def test_window64_vs_per_tensor_hand():
    # Per-tensor (amax 6) on the same row: window 1 blocks get smaller scales:
    # A/8 (amax .75): e4m3(56.0000038) = 56 = 0x66; B/8 (amax .375): e4m3(28.0000019) = 28 =
    # 1.75 * 2^4 = 0x5E; C/8 (amax .625): e4m3(46.667) -> 44 | 48, midpoint 46 -> 48 = 0x64.
    # enc is 8x the window-0 value in each case (power-of-two scaling), so the bytes repeat.
    x = torch.tensor([WINDOW_X])
    t = ref.quantize(x, Recipe(scaling="tensor"))
    assert u8(t.scales) == [[0x7E, 0x76, 0x7C, 0x76, 0x66, 0x5E, 0x64, 0x5E]]
    assert t.data.tolist() == [(BYTES_A + BYTES_B + BYTES_C + BYTES_B) * 2]
    w = ref.quantize(x, Recipe(scaling="window64"))
    assert ref.dequantize(t).equal(ref.dequantize(w))


def test_window64_four_blocks_share_one_amax():
    # Window 0: block 0 = A (amax 6), blocks 1-3 = A / 8. The blocks of window 0 use the
    # window amax 6: A / 8 gets 0x66 (as per-tensor above). Window 1 = four copies of A / 8
    # (window amax 0.75) gets 0x7E each.
    small = scaled(BLOCK_A, 1 / 8)
    x = torch.tensor([BLOCK_A + small * 3 + small * 4])
    t = ref.quantize(x, Recipe(scaling="window64"))
    assert t.amax.tolist() == [[6.0, 0.75]]
    assert u8(t.scales) == [[0x7E, 0x66, 0x66, 0x66, 0x7E, 0x7E, 0x7E, 0x7E]]
    assert t.data.tolist() == [BYTES_A * 8]


def test_window64_amax_shape_and_twin():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 192, generator=g)
    t = ref.quantize(x, Recipe(scaling="window64", columnwise=True))
    assert t.amax.shape == (128, 3) and t.amax_t.shape == (192, 2)
    assert t.amax.equal(x.abs().view(128, 3, 64).amax(-1))
    assert t.amax_t.equal(x.t().abs().reshape(192, 2, 64).amax(-1))


def test_window64_snr_beats_per_tensor_with_outlier_rows():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 512, generator=g)
    x[::8] *= 1e5  # outlier rows: per-tensor block scales of the others underflow E4M3
    small = torch.ones(64, dtype=torch.bool)
    small[::8] = False
    snr, snr_small = {}, {}
    for scaling in ("tensor", "token", "window64"):
        deq = ref.dequantize(ref.quantize(x, Recipe(scaling=scaling)))
        snr[scaling] = ref.snr_db(x, deq)
        snr_small[scaling] = ref.snr_db(x[small], deq[small])
    # the whole-tensor SNR is dominated by the outlier rows, which every scaling handles alike
    assert snr["window64"] >= snr["tensor"] - 0.1, snr
    # on the ordinary rows the per-tensor block scales underflow E4M3 and lose precision
    assert snr_small["window64"] > snr_small["tensor"] + 3.0, snr_small
    assert snr_small["token"] > snr_small["tensor"] + 3.0, snr_small
    assert snr_small["window64"] > 18.0, snr_small


def test_window64_snr_beats_per_tensor_with_outlier_windows():
    # outliers confined to some 64-wide windows of every row: per-token cannot help there,
    # window64 can.
    g = torch.Generator().manual_seed(40)
    x = torch.randn(32, 512, generator=g)
    x[:, :64] *= 1e5
    snr = {s: ref.snr_db(x[:, 64:], ref.dequantize(ref.quantize(x, Recipe(scaling=s)))[:, 64:])
           for s in ("tensor", "token", "window64")}
    assert snr["window64"] > snr["tensor"] + 3.0, snr
    assert snr["window64"] > snr["token"] + 1.5, snr


# ---------------------------------------------------------------------------------------------
# 16x16 tiles
# ---------------------------------------------------------------------------------------------

TILE_X = [BLOCK_A if r % 2 == 0 else scaled(BLOCK_A, 0.5) for r in range(16)]


def test_2d_tile_hand():
    # tile amax 6 (= tensor amax): s = 0x7E on all 16 rows, enc = 1 for every row.
    t = ref.quantize(torch.tensor(TILE_X), Recipe(block=(16, 16)))
    assert u8(t.scales) == [[0x7E]] * 16
    assert t.data.tolist() == [BYTES_A, BYTES_A_HALF_AT_A_SCALE] * 8


def test_1d_blocks_same_input_differ():
    # 1x16: odd rows (amax 3) get their own scale 0x76 and enc = 2 -> block A's codes again.
    t = ref.quantize(torch.tensor(TILE_X), Recipe())
    assert u8(t.scales) == [[0x7E], [0x76]] * 8
    assert t.data.tolist() == [BYTES_A] * 16


def test_2d_tiles_scales_are_tile_constant_and_twin_transposes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=g) * torch.linspace(0.1, 10, 96)
    t = ref.quantize(x, Recipe(block=(16, 16), columnwise=True))
    s = t.scales.view(torch.uint8).view(4, 16, 6)
    st = t.scales_t.view(torch.uint8).view(6, 16, 4)
    assert s.eq(s[:, :1]).all() and st.eq(st[:, :1]).all()
    # the per-tensor amax is the same, tile amaxes are transposed: twin scale (J, I) == (I, J)
    assert st[:, 0, :].equal(s[:, 0, :].t())
    # tile scale = e4m3(tile amax * S_enc / 6)
    tile_amax = x.abs().view(4, 16, 6, 16).amax(dim=(1, 3))
    s_enc = ref.encode_scale(x.abs().amax().reshape(1))
    expected = ref.to_e4m3(tile_amax * (s_enc * (1.0 / 6.0))).view(torch.uint8)
    assert s[:, 0, :].equal(expected)


# ---------------------------------------------------------------------------------------------
# 4over6
# With e4m3_max=448 and tensor amax 7: S_enc = 2688 / 7 = 384. A block of amax 4 has
# base = fp32(4/6) * 384 = 256 (exactly, after rounding), s6 = e4m3(256) = 0x78,
# s4 = e4m3(1.5 * 256) = 384 = 0x7C; enc6 = 1 / (256 * fp32(1/384)) = 1.5, enc4 = 1.0.
# With e4m3_max=256 and tensor amax 4: S_enc = 1536 / 4 = 384: the same numbers.
# In the input domain the map-6 grid is {0, 1/3, 2/3, 1, 4/3, 2, 8/3, 4}, the map-4 grid
# {0, 1/2, 1, 3/2, 2, 3, 4}.
# ---------------------------------------------------------------------------------------------

# X: every value on the map-4 grid: err4 = 0; map-6 misses 3 (-> 8/3) and 0.5, 1.5: choose 4.
BLOCK_X = [4, 3, 2, 1, 0.5, -4, -3, 0, 1.5, 2, 3, 4, -1, -2, 0.5, 1]
# map-4 codes = e2m1(x): 6 5 4 2 1 E D 0 3 4 5 6 A C 1 2
BYTES_X_MAP4 = [0x56, 0x24, 0xE1, 0x0D, 0x43, 0x65, 0xCA, 0x21]
# Y: every value on the map-6 grid (fp32(8/3) * 1.5 rounds to 4, etc.): err6 ~ 1e-7; choose 6.
BLOCK_Y = [4, 8 / 3, 2 / 3, 1 / 3, 2, 1, 0, 4 / 3, -4, -8 / 3, -2 / 3, -1 / 3, -2, -1, 0, -4 / 3]
# map-6 codes = e2m1(1.5 y): 7 6 2 1 5 3 0 4 F E A 9 D B 0 C
BYTES_Y_MAP6 = [0x67, 0x12, 0x35, 0x40, 0xEF, 0x9A, 0xBD, 0xC0]
# map-4 codes = e2m1(y): 6 5 1 1 4 2 0 3 E D 9 9 C A 0 B
BYTES_Y_MAP4 = [0x56, 0x11, 0x24, 0x30, 0xDE, 0x99, 0xAC, 0xB0]
# Z: on both grids (4, 2, 1, 0): both errors are 0 -> the tie keeps map-6.
BLOCK_Z = [4, 2, 1, 0, -4, -2, -1, 0] * 2
BYTES_Z_MAP6 = [0x57, 0x03, 0xDF, 0x0B] * 2  # e2m1(1.5 z): 7 5 3 0 F D B 0
# W: 4, 3.3, 8/3, 8/3, 0...: MAE: map-6 |3.3 - 8/3| = .633 vs map-4 .3 + 1/3 + 1/3 = .967
# -> 6; MSE: map-6 .401 vs map-4 .09 + 2/9 = .312 -> 4.
BLOCK_W = [4, 3.3, 8 / 3, 8 / 3] + [0] * 12
BYTES_W_MAP6 = [0x67, 0x66] + [0] * 6  # e2m1(1.5 w): 7 6(4.95) 6 6
BYTES_W_MAP4 = [0x56, 0x55] + [0] * 6  # e2m1(w): 6 5 5 5

# The filler block of the e4m3_max=448 tensors: [7, 0, ...]: base = 7/6 * 384 = 448, so
# s4 = s6 = 448 (0x7E), identical candidates, tie -> map-6; 7 * enc (~6) -> code 7.
FILLER = [7.0] + [0.0] * 15
FILLER_BYTES = [0x07] + [0] * 7

CASES_4OVER6 = [
    # block, mode, expected bytes, expected scale
    (BLOCK_X, "mae", BYTES_X_MAP4, 0x7C),
    (BLOCK_X, "mse", BYTES_X_MAP4, 0x7C),
    (BLOCK_Y, "mae", BYTES_Y_MAP6, 0x78),
    (BLOCK_Y, "mse", BYTES_Y_MAP6, 0x78),
    (BLOCK_Z, "mae", BYTES_Z_MAP6, 0x78),
    (BLOCK_Z, "mse", BYTES_Z_MAP6, 0x78),
    (BLOCK_W, "mae", BYTES_W_MAP6, 0x78),
    (BLOCK_W, "mse", BYTES_W_MAP4, 0x7C),
]


@pytest.mark.parametrize("fast_math", [False, True])
@pytest.mark.parametrize("e4m3_max", [448, 256])
@pytest.mark.parametrize("block,mode,expected,scale", CASES_4OVER6,
                         ids=[f"{n}-{m}" for n, m in zip("XXYYZZWW", ["mae", "mse"] * 4)])
def test_4over6_hand(block, mode, expected, scale, e4m3_max, fast_math):
    recipe = Recipe(four_over_six=mode, e4m3_max=e4m3_max, fast_math=fast_math)
    if e4m3_max == 448:
        t = ref.quantize(torch.tensor([block + FILLER], dtype=torch.float32), recipe)
        assert t.amax.tolist() == [7.0]
        assert u8(t.scales) == [[scale, 0x7E]]
        assert t.data.tolist() == [expected + FILLER_BYTES]
    else:
        t = ref.quantize(torch.tensor([block], dtype=torch.float32), recipe)
        assert t.amax.tolist() == [4.0]
        assert u8(t.scales) == [[scale]]
        assert t.data.tolist() == [expected]


@pytest.mark.parametrize("mode", ["mae", "mse"])
def test_4over6_448_on_the_amax_block_keeps_map6(mode):
    # A block that holds the tensor amax has base = 448: s4 = min(672, 448) = s6, so the
    # candidates coincide and the tie keeps map-6 = plain quantization (block A: 0x7E).
    t = ref.quantize(torch.tensor([BLOCK_A]), Recipe(four_over_six=mode))
    assert u8(t.scales) == [[0x7E]] and t.data.tolist() == [BYTES_A]


# X at map-6 (enc 1.5): 1.5x = 6 4.5 3 1.5 .75 -6 -4.5 0 2.25 3 4.5 6 -1.5 -3 .75 1.5
#   -> 7 6 5 3 2(tie) F E 0 4 5 6 7 B D 2 3
BYTES_X_MAP6 = [0x67, 0x35, 0xF2, 0x0E, 0x54, 0x76, 0xDB, 0x32]


@pytest.mark.parametrize("fast_math", [False, True])
def test_4over6_2d_tile_error_summed_over_rows(fast_math):
    # Rows 0-7 = X (map-4 exact; map-6 misses 3 x {3} by 1/3 and 3 x {.5, 1.5} by 1/6:
    # MAE 1.5, MSE 3/9 + 3/36 = .417 per row), rows 8-15 = Y (map-6 exact; map-4 misses 8/3 by
    # 1/3 and 2/3, 1/3, 4/3 by 1/6, twice: MAE 1.667, MSE .389 per row).
    # Tile sums: MAE err6 = 12.0 < err4 = 13.3 -> map-6 for all 16 rows (s6 = 0x78);
    #            MSE err4 = 3.11 < err6 = 3.33 -> map-4 for all 16 rows (s4 = 0x7C).
    # 1x16 blocks decide per row: X rows map-4, Y rows map-6.
    x = torch.zeros(16, 32)
    x[:8, :16] = torch.tensor(BLOCK_X, dtype=torch.float32)
    x[8:, :16] = torch.tensor(BLOCK_Y)
    x[0, 16] = 7.0  # tensor amax 7 in the second tile column
    t = ref.quantize(x, Recipe(block=(16, 16), four_over_six="mae", fast_math=fast_math))
    assert u8(t.scales) == [[0x78, 0x7E]] * 16
    assert t.data[:, :8].tolist() == [BYTES_X_MAP6] * 8 + [BYTES_Y_MAP6] * 8
    t = ref.quantize(x, Recipe(block=(16, 16), four_over_six="mse", fast_math=fast_math))
    assert u8(t.scales) == [[0x7C, 0x7E]] * 16
    assert t.data[:, :8].tolist() == [BYTES_X_MAP4] * 8 + [BYTES_Y_MAP4] * 8
    for mode in ("mae", "mse"):
        t1 = ref.quantize(x, Recipe(four_over_six=mode, fast_math=fast_math))
        assert [r[0] for r in u8(t1.scales)] == [0x7C] * 8 + [0x78] * 8
        assert t1.data[:, :8].tolist() == [BYTES_X_MAP4] * 8 + [BYTES_Y_MAP6] * 8


def test_fast_math_fp16_products_are_exact():
    """E2M1 x E4M3 products, the fast_math candidates, are exact in FP16: for all 16 codes and
    all 127 finite positive scales they equal the float64 product; the NaN scale gives NaN."""
    codes = torch.arange(16, dtype=torch.uint8).repeat_interleave(128)
    scales = torch.arange(128, dtype=torch.uint8).repeat(16).view(torch.float8_e4m3fn)
    got = _fp16_product(codes, scales)
    exact = ref.e2m1_decode(codes).double() * scales.to(torch.float64)
    finite = scales.view(torch.uint8).ne(0x7F)
    assert got[finite].double().equal(exact[finite])
    assert got[~finite].isnan().all()


def test_4over6_quantize_blocks_direct():
    x = torch.tensor([BLOCK_X + BLOCK_Y], dtype=torch.float32)
    data, scales = ref.quantize_blocks(x, torch.tensor(7.0), four_over_six="mae")
    assert u8(scales) == [[0x7C, 0x78]]
    assert data.tolist() == [BYTES_X_MAP4 + BYTES_Y_MAP6]


def heavy_tailed(rows, cols, seed, sigma):
    """Gaussian scale mixture: randn * exp(sigma * randn) (heavier tails for larger sigma)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g)
            * torch.exp(sigma * torch.randn(rows, cols, generator=g)))


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("block,scaling", [((1, 16), "tensor"), ((1, 16), "token"),
                                           ((16, 16), "tensor")])
def test_4over6_mse_not_worse_than_plain(sigma, block, scaling):
    # Same E4M3_MAX (448): map-6 is the plain candidate, so picking the lower-error one per
    # block cannot lose.
    x = heavy_tailed(128, 256, 6, sigma)
    r = Recipe(block=block, scaling=scaling)
    plain = ref.dequantize(ref.quantize(x, r))
    fos = ref.dequantize(ref.quantize(x, r.replace(four_over_six="mse")))
    mse_plain = (plain.double() - x.double()).square().mean().item()
    mse_fos = (fos.double() - x.double()).square().mean().item()
    assert mse_fos <= mse_plain, (mse_fos, mse_plain)
    if block == (1, 16):
        assert mse_fos < 0.99 * mse_plain  # a real improvement, not just ties


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_4over6_256_beats_plain_448_on_moderate_tails(sigma):
    # e4m3_max=256 trades 1.75x of block-scale range for map-4 headroom on the amax block; on
    # moderately heavy tails that wins. (On extreme tails (sigma 1.5) the lost range can cost
    # more than map-4 gains, so there is no such guarantee.)
    x = heavy_tailed(128, 256, 7, sigma)
    plain = ref.dequantize(ref.quantize(x, Recipe()))
    fos = ref.dequantize(ref.quantize(x, Recipe(four_over_six="mse", e4m3_max=256)))
    mse_plain = (plain.double() - x.double()).square().mean().item()
    mse_fos = (fos.double() - x.double()).square().mean().item()
    assert mse_fos < 0.97 * mse_plain, (mse_fos, mse_plain)


def test_4over6_mae_not_worse_than_plain_in_l1():
    x = heavy_tailed(128, 256, 7, 1.0)
    plain = ref.dequantize(ref.quantize(x, Recipe()))
    fos = ref.dequantize(ref.quantize(x, Recipe(four_over_six="mae")))
    assert (fos - x).abs().sum() <= (plain - x).abs().sum()


@pytest.mark.parametrize("mode", ["mae", "mse"])
@pytest.mark.parametrize("e4m3_max", [448, 256])
def test_4over6_per_block_choice_is_the_lower_error(mode, e4m3_max):
    """Every block keeps the candidate with the lower error, rebuilt here in float64 from the
    formulas of SPEC section 2 (blocks whose two errors are within 1e-5 are not judged)."""
    x = heavy_tailed(32, 256, 8, 1.0)
    t = ref.quantize(x, Recipe(four_over_six=mode, e4m3_max=e4m3_max))
    s_enc = ref.encode_scale(x.abs().amax().reshape(1), e4m3_max)
    xb = x.view(32, 16, 16)
    base = (xb.abs().amax(-1) / 6.0) * s_enc
    errs, codes = [], []
    for s in (ref.to_e4m3(base), ref.to_e4m3(base * 1.5)):
        enc = 1.0 / (s.to(F32) * (1.0 / s_enc))
        q = ref.e2m1_encode((xb * enc.unsqueeze(-1)).clamp(-6, 6))
        deq = ref.e2m1_decode(q).double() * s.double().unsqueeze(-1) / s_enc.double()
        d = deq - xb.double()
        errs.append(d.abs().sum(-1) if mode == "mae" else d.square().sum(-1))
        codes.append(q)
    err6, err4 = errs
    pick4 = err4 < err6
    clear = (err4 - err6).abs() > 1e-5 * (err4 + err6)
    chosen = t.scales.view(torch.uint8)
    s6, s4 = ref.to_e4m3(base).view(torch.uint8), ref.to_e4m3(base * 1.5).view(torch.uint8)
    expect = torch.where(pick4, s4, s6)
    assert chosen[clear].equal(expect[clear])
    got_codes = ref.unpack_fp4(t.data).view(32, 16, 16)
    exp_codes = torch.where(pick4.unsqueeze(-1), codes[1], codes[0])
    assert got_codes[clear].equal(exp_codes[clear])
    assert clear.float().mean() > 0.95
    assert 0.05 < pick4[clear].float().mean() < 0.95  # both choices occur on this data


# ---------------------------------------------------------------------------------------------
# Stochastic rounding with explicit random bytes b: round up iff frac >= (511 - 2b) / 512
# ---------------------------------------------------------------------------------------------

ALL_BYTES = torch.arange(256)


def b_min_for(frac):
    """The smallest byte that rounds a value of fractional position `frac` up."""
    return max(0, math.ceil((511 - 512 * frac) / 2))


SR_THRESHOLDS = [
    # value, lower code, upper code, its fractional position (exact)
    (0.75, 1, 2, 0.5),  # b >= 128 rounds up
    (1.25, 2, 3, 0.5),
    (5.0, 6, 7, 0.5),  # between 4 and 6
    (5.5, 6, 7, 0.75),  # b >= 64
    (2.25, 4, 5, 0.25),  # b >= 192
    (0.3, 0, 1, 0.6000000238418579),  # fp32(0.3) / 0.5: b >= 102 (b = 101: 309/512 > frac)
    (0.125, 0, 1, 0.25),
    (3.75, 5, 6, 0.75),
    (0.5 + 2**-10, 1, 2, 2**-9),  # frac 1/512: only b = 255 rounds up
    (1.0 - 2**-11, 1, 2, 1 - 2**-10),  # frac > 511/512: every byte rounds up
]


@pytest.mark.parametrize("value,lo,hi,frac", SR_THRESHOLDS)
@pytest.mark.parametrize("sign", [1, -1])
def test_sr_threshold(value, lo, hi, frac, sign):
    sbit = 0x8 if sign < 0 else 0
    v = torch.full((256,), sign * value, dtype=torch.float32)
    codes = ref.e2m1_encode_stochastic(v, ALL_BYTES).tolist()
    k = b_min_for(frac)
    assert codes == [lo | sbit] * k + [hi | sbit] * (256 - k)
    assert {0.3: 102, 0.5 + 2**-10: 255, 1.0 - 2**-11: 0}.get(value, k) == k


def test_sr_probability_quantised_to_1_256():
    """Over all 256 bytes, the number rounding up is floor(256 frac + 1/2): P(up) is frac to
    within 1/512, and exactly frac where 256 frac is an integer."""
    v = torch.linspace(0.0, 6.0, 4097, dtype=torch.float32)[1:-1]
    v = torch.cat([v, torch.tensor([0.5 + k / 512 for k in range(256)], dtype=torch.float32)])
    codes = ref.e2m1_encode_stochastic(v.repeat_interleave(256), ALL_BYTES.repeat(v.numel()))
    table = torch.tensor(ref.E2M1_VALUES + (6.0,), dtype=torch.float64)
    lower = (v.double().unsqueeze(1) >= table[1:8]).sum(dim=1)  # code of the grid value below
    up = codes.view(-1, 256).long() - lower.unsqueeze(1)
    assert up.min() >= 0 and up.max() <= 1
    ups = up.sum(dim=1)
    lo = table[lower]
    gap = table[(lower + 1).clamp(max=7)] - lo
    frac = (v.double() - lo) / gap
    assert torch.equal(ups, torch.floor(256 * frac + 0.5).long())
    p_up = ups.double() / 256
    assert float((p_up - frac).abs().max()) <= 1 / 512
    dyadic = (256 * frac).frac() == 0
    assert int(dyadic.sum()) > 256 and torch.equal(p_up[dyadic], frac[dyadic])


@pytest.mark.parametrize("value,code", [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4),
                                        (3.0, 5), (4.0, 6), (6.0, 7), (7.0, 7), (1e30, 7),
                                        (float("inf"), 7), (float("nan"), 0)])
def test_sr_exact_and_saturated_values_never_move(value, code):
    v = torch.full((256,), value, dtype=torch.float32)
    assert ref.e2m1_encode_stochastic(v, ALL_BYTES).tolist() == [code] * 256
    if value and not math.isnan(value):
        assert ref.e2m1_encode_stochastic(-v, ALL_BYTES).tolist() == [code | 8] * 256


def test_sr_negative_rounding_to_zero_keeps_sign():
    v = torch.tensor([-0.1, -0.0, -0.1], dtype=torch.float32)
    bits = torch.tensor([0, 255, 255])  # -0.1: frac 0.2, rounds up from b = 205
    assert ref.e2m1_encode_stochastic(v, bits).tolist() == [0x8, 0x0, 0x9]


def test_sr_argument_errors():
    with pytest.raises(ValueError, match="random bits shape"):
        ref.e2m1_encode_stochastic(torch.zeros(4), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="float32"):
        ref.e2m1_encode_stochastic(torch.zeros(4, dtype=torch.float16),
                                   torch.zeros(4, dtype=torch.int64))


# Block B with scale 0x76 has enc = 2: 2x = 6 -3 .25 .75 1.25 2.25 -1.75 4.5 5.5 .4 -6 2 .1
# -.25 3.5 4.8 (every inexact frac in [0.2, 0.8]).  b = 255 rounds every inexact value up (away
# from zero):
#   7 D 1 2 3 5 C 7 7 1 F 4 1 9 6 7 -> D7 21 53 7C 17 4F 91 76
# b = 0 truncates toward zero:
#   7 D 0 1 2 4 B 6 6 0 F 4 0 8 5 6 -> D7 10 42 6B 06 4F 80 65
BYTES_B_UP = [0xD7, 0x21, 0x53, 0x7C, 0x17, 0x4F, 0x91, 0x76]
BYTES_B_DOWN = [0xD7, 0x10, 0x42, 0x6B, 0x06, 0x4F, 0x80, 0x65]


@pytest.mark.parametrize("byte,expected", [(255, BYTES_B_UP), (0, BYTES_B_DOWN)])
def test_sr_quantize_blocks_hand(byte, expected):
    x = torch.tensor([BLOCK_A + BLOCK_B])
    bits = torch.full((1, 32), byte, dtype=torch.int64)
    data, scales = ref.quantize_blocks(x, torch.tensor(6.0), random_bits=bits)
    assert u8(scales) == [[0x7E, 0x76]]  # SR never changes the scales
    assert data[0, 8:].tolist() == expected


def test_sr_quantize_matches_philox_bits():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(32, 64, generator=g)
    t = ref.quantize(x, Recipe(stochastic_rounding=True, columnwise=True), seed=123, offset=7)
    bits = ref.philox_bits(32 * 64, 123, 7, 0).view(32, 64)
    data, scales = ref.quantize_blocks(x, x.abs().amax(), random_bits=bits)
    assert t.data.equal(data) and u8(t.scales) == u8(scales)
    xt = x.t().contiguous()
    bits_t = ref.philox_bits(32 * 64, 123, 7, 1).view(64, 32)
    data_t, _ = ref.quantize_blocks(xt, xt.abs().amax(), random_bits=bits_t)
    assert t.data_t.equal(data_t)


def test_sr_determinism_and_seed_dependence():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(64, 128, generator=g)
    r = Recipe(stochastic_rounding=True, columnwise=True)
    a = ref.quantize(x, r, seed=1, offset=0)
    b = ref.quantize(x, r, seed=1, offset=0)
    c = ref.quantize(x, r, seed=2, offset=0)
    d = ref.quantize(x, r, seed=1, offset=1)
    assert a.data.equal(b.data) and a.data_t.equal(b.data_t)
    assert not a.data.equal(c.data) and not a.data_t.equal(c.data_t)
    assert not a.data.equal(d.data) and not a.data_t.equal(d.data_t)
    # scales do not depend on the random bits
    assert u8(a.scales) == u8(c.scales) == u8(d.scales)
    # a large fraction of the codes differ between seeds (about half of the inexact ones)
    diff = (ref.unpack_fp4(a.data) != ref.unpack_fp4(c.data)).float().mean().item()
    assert 0.2 < diff < 0.6


def test_sr_rowwise_and_columnwise_use_different_streams():
    i = torch.arange(32, dtype=torch.float32)
    x = torch.sin(i[:, None] + i[None, :]) * 3  # symmetric: RTN twin == rowwise data
    t = ref.quantize(x, Recipe(columnwise=True))
    assert t.data.equal(t.data_t)
    s = ref.quantize(x, Recipe(columnwise=True, stochastic_rounding=True), seed=5)
    assert not s.data.equal(s.data_t)


def test_sr_with_2d_tiles():
    # rows a multiple of 16: tile scales as RTN, codes from the Philox bits of each element
    g = torch.Generator().manual_seed(16)
    x = torch.randn(32, 64, generator=g)
    t = ref.quantize(x, Recipe(block=(16, 16), stochastic_rounding=True), seed=4)
    rtn = ref.quantize(x, Recipe(block=(16, 16)))
    assert u8(t.scales) == u8(rtn.scales)
    bits = ref.philox_bits(32 * 64, 4, 0, 0).view(32, 64)
    data, _ = ref.quantize_blocks(x, x.abs().amax(), 16, random_bits=bits)
    assert t.data.equal(data)


def test_sr_with_2d_tiles_partial_row_tile():
    # 20 rows: the padding rows are zeros (codes 0 whatever the bits); the real rows use the
    # bits of their own elements (element r * cols + c of stream 0).
    g = torch.Generator().manual_seed(17)
    x = torch.randn(20, 32, generator=g)
    t = ref.quantize(x, Recipe(block=(16, 16), stochastic_rounding=True), seed=4)
    padded = torch.cat([x, torch.zeros(12, 32)])
    bits = ref.philox_bits(32 * 32, 4, 0, 0).view(32, 32)
    data, scales = ref.quantize_blocks(padded, x.abs().amax(), 16, random_bits=bits)
    assert t.data.equal(data[:20]) and u8(t.scales) == u8(scales[:20])


@pytest.mark.parametrize("value", [0.3, 0.75, 1.1, 2.2, 3.3, 4.4, 5.9, -0.2, -2.7])
def test_sr_unbiased_e2m1(value):
    n = 1 << 14
    v = torch.full((n,), value, dtype=torch.float32)
    bits = ref.philox_bits(n, seed=42, offset=0, stream=0)
    mean = ref.e2m1_decode(ref.e2m1_encode_stochastic(v, bits)).double().mean().item()
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    a = abs(value)
    lo = max(g for g in grid if g <= a)
    hi = min(g for g in grid if g >= a)
    p = (a - lo) / (hi - lo)
    se = (hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(mean - value) <= 5 * se + (hi - lo) / 512, (mean, value, se)
    # round-to-nearest is biased at these points by more than the SR tolerance
    rtn = ref.e2m1_decode(ref.e2m1_encode(v[:1])).item()
    assert abs(rtn - value) > 5 * se


def test_sr_unbiased_through_quantize_dequantize():
    # 4096 copies of one 16-element row; every row gets the same scales (per-tensor amax).
    g = torch.Generator().manual_seed(11)
    base = torch.randn(1, 16, generator=g) * 2
    x = base.repeat(4096, 1)
    t = ref.quantize(x, Recipe(stochastic_rounding=True), seed=3)
    deq = ref.dequantize(t).double()
    mean = deq.mean(dim=0)
    std = deq.std(dim=0)
    se = std / math.sqrt(4096)
    err = (mean - base[0].double()).abs()
    # bias bound: 1/512 of the code gap (at most 2) times the block's dequantization scale
    bias = 2 / 512 * t.scales.to(torch.float64)[0, 0] / ref.encode_scale(t.amax).double()
    assert (err <= 5 * se + bias).all(), (err, se, bias)
    # rows differ (fresh bits per element) and the RTN result is biased
    assert not t.data[0].equal(t.data[1])


# ---------------------------------------------------------------------------------------------
# Philox4x32-10 known-answer vectors (Random123 kat_vectors)
# ---------------------------------------------------------------------------------------------

PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", PHILOX_KAT)
def test_philox_known_answers(ctr, key, expected):
    c = [torch.tensor([v], dtype=torch.int64) for v in ctr]
    out = ref.philox4x32(*c, *key)
    assert [int(w) for w in out] == list(expected)


def le_bytes(words):
    return [(int(w) >> (8 * k)) & 0xFF for w in words for k in range(4)]


def test_philox_bits_layout():
    # element i = byte i % 4 of word i // 4; word j = output j % 4 of
    # philox(ctr = (j // 4, 0, offset, stream), key = seed halves): 16 elements per call
    bits = ref.philox_bits(20, seed=0, offset=0, stream=0)
    assert bits[:16].tolist() == le_bytes([0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8])
    assert bits[:4].tolist() == [0xD5, 0xE8, 0x27, 0x66]
    one = ref.philox4x32(*[torch.tensor([v]) for v in (1, 0, 0, 0)], 0, 0)
    assert bits[16:].tolist() == le_bytes([one[0]])
    seed = 0xA4093822 | (0x299F31D0 << 32)
    b = ref.philox_bits(16, seed=seed, offset=0x13198A2E, stream=0x03707344)
    w = ref.philox4x32(*[torch.tensor([v]) for v in (0, 0, 0x13198A2E, 0x03707344)],
                       0xA4093822, 0x299F31D0)
    assert b.tolist() == le_bytes(w)


def test_philox_bits_range_and_errors():
    b = ref.philox_bits(1 << 16, seed=2**64 - 1, offset=2**32 - 1, stream=1)
    assert b.dtype == torch.int64 and b.min() >= 0 and b.max() < 256
    counts = torch.bincount(b, minlength=256)  # 256 expected per value, sd 16
    assert counts.numel() == 256 and int(counts.min()) > 170 and int(counts.max()) < 350
    with pytest.raises(ValueError, match="seed"):
        ref.philox_bits(4, seed=-1, offset=0, stream=0)
    with pytest.raises(ValueError, match="seed"):
        ref.philox_bits(4, seed=2**64, offset=0, stream=0)
    with pytest.raises(ValueError, match="offset"):
        ref.philox_bits(4, seed=0, offset=2**32, stream=0)


# ---------------------------------------------------------------------------------------------
# RHT: x @ (diag(sign) @ H16) / 4 along the last dimension, in tiles of 16
# ---------------------------------------------------------------------------------------------

SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def hadamard16():
    h = [[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)]
    return torch.tensor(h, dtype=torch.float64)


def test_rht_sign_vector():
    assert list(ref.RHT_SIGNS) == SIGNS


@pytest.mark.parametrize("j", range(16))
def test_rht_basis_vector(j):
    # e_j -> row j of diag(sign) H16 / 4 = sign_j * (-1)^popcount(j & k) / 4
    x = torch.zeros(1, 16)
    x[0, j] = 1.0
    expected = [SIGNS[j] * (-1) ** bin(j & k).count("1") / 4 for k in range(16)]
    assert ref.rht(x)[0].tolist() == expected


def test_rht_of_ones_and_arange():
    # ones: y_k = (1/4) sum_j sign_j (-1)^popcount(j & k) (the Walsh transform of the signs);
    # e.g. k = 0: (6 - 10) / 4 = -1; k = 9: j in {0,2,4,6,9,11,13,15} add 2, the rest add 6.
    ones = [-1.0, 0.0, 1.0, 0.0, 1.0, 0.0, -1.0, 0.0, 1.0, 2.0, 1.0, 0.0, 1.0, 0.0, 1.0, -2.0]
    assert ref.rht(torch.ones(1, 16))[0].tolist() == ones
    ar = [-14.5, -7.5, 6.5, -0.5, 6.5, -0.5, -14.5, 8.5, 7.5, 14.5, 0.5, 1.5, 0.5, -2.5, 9.5,
          -15.5]
    assert ref.rht(torch.arange(16.0).view(1, 16))[0].tolist() == ar


def test_rht_tiles_are_independent_and_shape_kept():
    x = torch.zeros(3, 2, 48)
    x[1, 1, 16 + 5] = 2.0
    y = ref.rht(x)
    assert y.shape == (3, 2, 48) and y.dtype == torch.float32
    assert y[1, 1, 16:32].tolist() == [2 * SIGNS[5] * (-1) ** bin(5 & k).count("1") / 4
                                       for k in range(16)]
    y[1, 1, 16:32] = 0
    assert y.eq(0).all()


def test_rht_exact_on_a_dyadic_grid_matches_float64_matmul():
    # integers / 8 below 2^12: every butterfly partial sum is exact in FP32, so the result
    # equals the float64 matmul x @ diag(sign) @ H16 / 4 bit for bit.
    g = torch.Generator().manual_seed(12)
    x = torch.randint(-4096, 4096, (256, 64), generator=g).float() / 8
    m = torch.diag(torch.tensor(SIGNS, dtype=torch.float64)) @ hadamard16() / 4
    exact = (x.double().view(-1, 16) @ m).view(256, 64)
    assert ref.rht(x).double().equal(exact)


def test_rht_random_within_fp32_summation_bound():
    # Four rounded butterfly stages: |y - y64| <= 4 * 2^-24 * (sum_j |x_j|) / 4 per output.
    g = torch.Generator().manual_seed(13)
    x = torch.randn(1024, 64, generator=g) * 10
    m = torch.diag(torch.tensor(SIGNS, dtype=torch.float64)) @ hadamard16() / 4
    y64 = (x.double().view(-1, 16) @ m)
    y = ref.rht(x).double().view(-1, 16)
    bound = x.double().abs().view(-1, 16).sum(-1, keepdim=True) * 2.0**-24
    assert ((y - y64).abs() <= bound).all()
    # (No FP32 summation order is within 1 ULP of the exact value where the outputs cancel:
    # measured up to ~3e5 ULP on random data, so the bound above is the meaningful check.)


def test_rht_orthogonal_inverse_and_norm():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(512, 32, generator=g)
    y = ref.rht(x)
    signs = torch.tensor(SIGNS, dtype=torch.float32).repeat(2)
    # M = D H / 4 is orthogonal, M^-1 = M^T = H D / 4, and H / 4 = M applied to D-flipped
    # input: x = rht(y * sign) * sign
    back = ref.rht(y * signs) * signs
    assert (back - x).abs().max() <= 4e-7 * x.abs().max()
    n_in = x.double().view(-1, 16).norm(dim=-1)
    n_out = y.double().view(-1, 16).norm(dim=-1)
    assert ((n_out - n_in).abs() <= 1e-6 * n_in).all()
    # rht(rht(x)) = x @ (D H D H) / 16 exactly on a dyadic grid
    xi = torch.randint(-64, 64, (64, 16), generator=g).float()
    m = torch.diag(torch.tensor(SIGNS, dtype=torch.float64)) @ hadamard16() / 4
    assert ref.rht(ref.rht(xi)).double().equal(xi.double() @ m @ m)


def test_rht_rejects_bad_width():
    with pytest.raises(ValueError, match="divisible by 16"):
        ref.rht(torch.zeros(2, 24))


def test_rht_recipe_applies_to_the_columnwise_twin_only():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(64, 96, generator=g)
    t = ref.quantize(x, Recipe(rht=True, columnwise=True))
    plain = ref.quantize(x, Recipe(columnwise=True))
    assert t.data.equal(plain.data) and u8(t.scales) == u8(plain.scales)
    assert t.amax.equal(plain.amax)
    xt = ref.rht(x.t().contiguous())
    twin = ref.quantize(xt, Recipe())
    assert t.data_t.equal(twin.data) and u8(t.scales_t) == u8(twin.scales)
    # the columnwise amax is taken after the RHT
    assert t.amax_t.equal(xt.abs().amax().reshape(1))
    assert not t.amax_t.equal(plain.amax_t)


def test_rht_twin_hand_basis():
    # x = 16 x 16 with a single 4.0 at (row 3, col 0): the twin row 0 is rht(4 e_3) =
    # sign_3 * (-1)^popcount(3 & k) = -(+1, -1, -1, +1, ...) -> values +-1, amax_t 1.
    # S_enc = 2688, s = e4m3(1 * 2688 * fp32(1/6)) = e4m3(448.0000...) = 0x7E, enc = 6:
    # -1 -> -6 -> F, +1 -> 6 -> 7. Pattern (-1)^popcount(3&k): + - - + repeated; times -1.
    x = torch.zeros(16, 16)
    x[3, 0] = 4.0
    t = ref.quantize(x, Recipe(rht=True, columnwise=True, rowwise=False))
    assert t.amax_t.tolist() == [1.0]
    assert u8(t.scales_t) == [[0x7E]] + [[0x00]] * 15
    codes = [0xF, 0x7, 0x7, 0xF] * 4
    assert ref.unpack_fp4(t.data_t[:1]).tolist() == [codes]
    assert t.data_t[0].tolist() == [0x7F, 0xF7] * 4


def _rht_amax_folded(x):
    """RecipeAmax's RHT column amax before its recompute rule (amax.rht16_amax_fast)
    in torch: the butterflies at strides 1, 2, 4 of ref.rht, then max over j of |a_j| + |b_j|
    for the pairs (j, j + 8) that the last butterfly would combine."""
    y = _rht_butterflies(x, strides=(1, 2, 4))
    return (y[:, :8].abs() + y[:, 8:].abs()).amax(dim=1)


def test_rht_amax_last_butterfly_folded():
    """max(|RN(a + b)|, |RN(a - b)|) = RN(|a| + |b|) in FP32 round-to-nearest (one of the two
    has magnitude |a| + |b|, the other not more; RN is monotone and odd): RecipeAmax's folded
    RHT amax equals the amax of the transform bit for bit on blocks of mixed magnitudes
    (subnormal to near overflow, sums that round and overflow, NaN and lone infinities); it
    differs only with +Inf where two infinities meet in the last butterfly (the transform's
    Inf - Inf = NaN), which its rule (+Inf: recompute with the whole transform) catches."""
    gen = torch.Generator().manual_seed(7)
    n = 200000
    e = torch.randint(-149, 128, (n, 16), generator=gen).float()
    x = torch.randn((n, 16), generator=gen).sign() * (1 + torch.rand((n, 16), generator=gen))
    x = (x * torch.pow(2.0, e)).float()
    x[: n // 4] = torch.randn((n // 4, 16), generator=gen) * 3e37  # sums round and overflow
    x[:100, 0] = x[:100, 8] = float("inf")  # they meet only in the last butterfly
    x[100:200, 3] = float("-inf")
    x[200:300, 5] = float("nan")
    folded = _rht_amax_folded(x)
    exact = (ref.rht(x) * 4).abs().amax(dim=-1)  # x 4: the amax without the exact 0.25
    assert torch.isnan(exact[:100]).all() and (folded[:100] == float("inf")).all()
    assert torch.isinf(exact[100:200]).all() and torch.isnan(exact[200:300]).all()
    assert torch.isinf(exact[300:n // 4]).float().mean() > 0.01  # overflowing sums
    got = torch.where(folded == float("inf"), exact, folded)
    same = (got.view(torch.int32) == exact.view(torch.int32)) | (got.isnan() & exact.isnan())
    assert same.all()
    assert (folded[300:] == exact[300:]).float().mean() == 1.0  # the rule only for infinities
