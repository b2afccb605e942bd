"""Hand-worked 16-element blocks through the reference quantizer (SPEC section 1): per-tensor and
per-token outer scales, the columnwise twin, and NaN / Inf / zero handling.

Constants used in the derivations below (all FP32, exact bit patterns):
  fp32(1/6)   = 11184811 * 2^-26
  S_enc(6)    = 2688 / 6 = 448;   448 * fp32(1/6) = 74.66667175292969 (one rounding)
  fp32(1/448) = 9586981 * 2^-32;  448 * fp32(1/448) = 1 + 3 * 2^-26 -> rounds to 1.0,
                and k * 448 * fp32(1/448) rounds to k for k = 1/2, 1/8, ... (powers of two).
"""

import math

import pytest
import torch

import cute_fp4
from cute_fp4 import Recipe, ref

NAN = float("nan")
INF = float("inf")

# Block A: amax 6. With S_enc = 448: s = e4m3(6 * 74.66667175) = e4m3(448.00003) = 448 = 0x7E,
# enc = 1 / (448 * fp32(1/448)) = 1 / 1.0 = 1, so the codes are e2m1(x) directly:
#   6->7  -5->tie->6|8=E  4.5->6  0.25->tie->0  0.3->1  -0.75->tie->2|8=A  1.25->tie->2
#   1.75->tie->4  -2.5->tie->4|8=C  3.5->tie->6  5.1->7  0->0  -0.1->-0 (8)  2->4  -6->F  0.8->2
# Bytes (even element in the low nibble): E7 06 A1 42 6C 07 48 2F.
BLOCK_A = [6.0, -5.0, 4.5, 0.25, 0.3, -0.75, 1.25, 1.75, -2.5, 3.5, 5.1, 0.0, -0.1, 2.0, -6.0, 0.8]
BYTES_A = [0xE7, 0x06, 0xA1, 0x42, 0x6C, 0x07, 0x48, 0x2F]
CODES_A = [7, 0xE, 6, 0, 1, 0xA, 2, 4, 0xC, 6, 7, 0, 8, 4, 0xF, 2]

# Block B: amax 3 in a tensor of amax 6 (S_enc = 448): s = e4m3(3 * 74.66667175) =
# e4m3(224.00002) = 224 = 1.75 * 2^7 = 0x76; enc = 1 / (224 * fp32(1/448)) = 1 / 0.5 = 2.
# 2x = 6 -3 .25 .75 1.25 2.25 -1.75 4.5 5.5 .4 -6 2 .1 -.25 3.5 4.8
#   -> 7 D 0(tie) 2(tie) 2(tie) 4 C(tie) 6 7 1 F 4 0 8 6 6
# Bytes: D7 20 42 6C 17 4F 80 66.
BLOCK_B = [3.0, -1.5, 0.125, 0.375, 0.625, 1.125, -0.875, 2.25,
           2.75, 0.2, -3.0, 1.0, 0.05, -0.125, 1.75, 2.4]
BYTES_B = [0xD7, 0x20, 0x42, 0x6C, 0x17, 0x4F, 0x80, 0x66]

# Block C: amax 5 in a tensor of amax 6: s = e4m3(5 * 74.66667175) = e4m3(373.33337): between
# 352 (m=3) and 384 (m=4), midpoint 368 -> 384 = 1.5 * 2^8 = 0x7C.
# 384 * fp32(1/448) = 0.8571429252624512, enc = fp32(1 / that) = 1.1666666269302368.
# x * enc (one FP32 rounding each):
#   5->5.83->7  -4->-4.67->E  3->3.4999998808 rounds to 3.5 (halfway, ties-to-even)->tie->6
#   .5->.58->1  1->1.17->2  -2->-2.33->C  2.5->2.92->5  .2->.23->0
#   1.5->1.7499999404 rounds to 1.75 (halfway)->tie->4  -.3->-.35->9  0->0  4.5->5.25->7
#   -5->F  3.9->4.55->6  .7->.82->2  1.3->1.52->3
# Bytes: E7 16 C2 05 94 70 6F 32.
BLOCK_C = [5.0, -4.0, 3.0, 0.5, 1.0, -2.0, 2.5, 0.2, 1.5, -0.3, 0.0, 4.5, -5.0, 3.9, 0.7, 1.3]
BYTES_C = [0xE7, 0x16, 0xC2, 0x05, 0x94, 0x70, 0x6F, 0x32]


def u8(t):
    return t.view(torch.uint8).tolist()


def row(*blocks):
    return torch.tensor([sum(blocks, [])], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Per-tensor
# ---------------------------------------------------------------------------------------------

def test_per_tensor_hand_block_a():
    t = ref.quantize(row(BLOCK_A), Recipe())
    assert t.amax.tolist() == [6.0]
    assert u8(t.scales) == [[0x7E]]
    assert t.data.tolist() == [BYTES_A]
    assert ref.unpack_fp4(t.data).tolist() == [CODES_A]


def test_per_tensor_hand_blocks_abc():
    t = ref.quantize(row(BLOCK_A, BLOCK_B, BLOCK_C), Recipe())
    assert t.amax.tolist() == [6.0]
    assert t.data.shape == (1, 24) and t.scales.shape == (1, 3)
    assert u8(t.scales) == [[0x7E, 0x76, 0x7C]]
    assert t.data.tolist() == [BYTES_A + BYTES_B + BYTES_C]


def test_per_tensor_hand_dequantize():
    t = ref.quantize(row(BLOCK_A, BLOCK_B, BLOCK_C), Recipe())
    got = ref.dequantize(t, torch.float32)[0]
    # x_hat = e2m1 * s / S_enc: block A: v * 448 / 448 = v, block B: v * 224 / 448 = v / 2,
    # block C: v * 384 / 448 (one FP32 product, one FP32 division).
    va = [6, -4, 4, 0, .5, -1, 1, 2, -2, 4, 6, 0, -0.0, 2, -6, 1]
    vb = [6, -3, 0, 1, 1, 2, -2, 4, 6, .5, -6, 2, 0, -0.0, 4, 4]
    vc = [6, -4, 4, .5, 1, -2, 3, 0, 2, -.5, 0, 6, -6, 4, 1, 1.5]
    assert got[:16].tolist() == va
    assert got[16:32].tolist() == [v / 2 for v in vb]
    expected_c = torch.tensor(vc, dtype=torch.float32) * 384.0 / 448.0
    assert got[32:].equal(expected_c)


def test_per_tensor_scale_is_the_same_for_all_rows():
    # rows: A and A / 8 (amax 0.75). Per-tensor S_enc = 448 for both rows;
    # row 1: s = e4m3(0.75 * 74.66667175) = e4m3(56.0000038) = 56 = 1.75 * 2^5 = 0x66,
    # enc = 1 / (56 * fp32(1/448)) = 8, so the codes equal block A's.
    x = torch.tensor([BLOCK_A, [v / 8 for v in BLOCK_A]])
    t = ref.quantize(x, Recipe())
    assert t.amax.tolist() == [6.0]
    assert u8(t.scales) == [[0x7E], [0x66]]
    assert t.data.tolist() == [BYTES_A, BYTES_A]


# ---------------------------------------------------------------------------------------------
# Per-token
# ---------------------------------------------------------------------------------------------

def test_per_token_row_amax_hand():
    # Same rows as above. Per-token: row 1 has amax 0.75 -> S_enc = 2688 / 0.75 = 3584 = 8 * 448;
    # s = e4m3(0.75 * (3584 * fp32(1/6))) = e4m3(448.00003) = 0x7E, enc = 1 / (448 / 3584) = 8.
    x = torch.tensor([BLOCK_A, [v / 8 for v in BLOCK_A]])
    t = ref.quantize(x, Recipe(scaling="token"))
    assert t.amax.tolist() == [6.0, 0.75]
    assert u8(t.scales) == [[0x7E], [0x7E]]
    assert t.data.tolist() == [BYTES_A, BYTES_A]
    # dequantize: row 1 = e2m1 * 448 / 3584 = e2m1 / 8, exactly
    got = ref.dequantize(t, torch.float32)
    assert got[1].equal(got[0] / 8)


def test_per_token_rows_are_independent():
    # Row 1 = blocks A B C (amax 6); row 0 = the same blocks / 4 (amax 1.5, S_enc = 1792 =
    # 4 * 448): every product scales by a power of two, so the scales and codes are identical.
    base = sum([BLOCK_A, BLOCK_B, BLOCK_C], [])
    x = torch.tensor([[v / 4 for v in base], base])
    t = ref.quantize(x, Recipe(scaling="token"))
    assert t.amax.tolist() == [1.5, 6.0]
    assert u8(t.scales) == [[0x7E, 0x76, 0x7C]] * 2
    assert t.data.tolist() == [BYTES_A + BYTES_B + BYTES_C] * 2


def test_per_token_column_amax_of_the_twin():
    # x[i, j] = (i + 1) * (j + 1) / 16: row amax i + 1, column amax j + 1.
    i = torch.arange(16, dtype=torch.float32)
    x = (i[:, None] + 1) * (i[None, :] + 1) / 16
    t = ref.quantize(x, Recipe(scaling="token", columnwise=True))
    assert t.amax.tolist() == [float(k) for k in range(1, 17)]
    assert t.amax_t.tolist() == [float(k) for k in range(1, 17)]
    # every row of either output holds its own amax: s = e4m3(~448) = 0x7E
    assert u8(t.scales) == [[0x7E]] * 16
    assert u8(t.scales_t) == [[0x7E]] * 16
    # x is symmetric, so the twin is bit-identical to the rowwise output
    assert t.data_t.equal(t.data)


def test_per_token_twin_uses_column_amax():
    x = torch.randn(32, 48) * torch.logspace(-2, 2, 48)[None, :]
    t = ref.quantize(x, Recipe(scaling="token", columnwise=True))
    assert t.amax.equal(x.abs().amax(dim=1))
    assert t.amax_t.equal(x.abs().amax(dim=0))
    assert t.amax.shape == (32,) and t.amax_t.shape == (48,)


# ---------------------------------------------------------------------------------------------
# Columnwise twin == quantizing x.t() (rowwise), for every scaling and block shape
# ---------------------------------------------------------------------------------------------

TWIN_RECIPES = [
    Recipe(scaling="tensor"), Recipe(scaling="token"), Recipe(scaling="window64"),
    Recipe(block=(16, 16)), Recipe(four_over_six="mae"), Recipe(scaling="token", swizzle=True),
    Recipe(four_over_six="mse", block=(16, 16), e4m3_max=256),
]


@pytest.mark.parametrize("recipe", TWIN_RECIPES, ids=lambda r: f"{r.scaling}-{r.block}-"
                         f"{r.four_over_six}-{r.swizzle}")
def test_columnwise_twin_equals_quantizing_transpose(recipe):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 192, generator=g) * 3
    both = ref.quantize(x, recipe.replace(columnwise=True))
    twin = ref.quantize(x.t().contiguous(), recipe)
    assert both.data_t.equal(twin.data)
    assert u8(both.scales_t) == u8(twin.scales)
    assert both.amax_t.equal(twin.amax)
    row_only = ref.quantize(x, recipe)
    assert both.data.equal(row_only.data)
    assert u8(both.scales) == u8(row_only.scales)


def test_columnwise_twin_hand_block():
    # Column 0 of x is block A (the other 15 columns are 0): the twin's row 0 is block A.
    x = torch.zeros(16, 16)
    x[:, 0] = torch.tensor(BLOCK_A)
    t = ref.quantize(x, Recipe(columnwise=True, rowwise=False))
    assert t.data is None and t.scales is None
    assert t.amax_t.tolist() == [6.0]
    assert t.data_t.shape == (16, 8)
    assert t.data_t[0].tolist() == BYTES_A
    assert t.data_t[1:].eq(0).all()
    assert u8(t.scales_t) == [[0x7E]] + [[0x00]] * 15


def test_columnwise_twin_from_bf16_input():
    x = torch.randn(64, 32).to(torch.bfloat16)
    t = ref.quantize(x, Recipe(columnwise=True))
    twin = ref.quantize(x.float().t().contiguous(), Recipe())
    assert t.data_t.equal(twin.data) and u8(t.scales_t) == u8(twin.scales)


# ---------------------------------------------------------------------------------------------
# Zero / Inf / NaN
# ---------------------------------------------------------------------------------------------

def test_all_zero_block_scale_zero_codes_zero():
    t = ref.quantize(row(BLOCK_A, [0.0] * 16), Recipe())
    assert u8(t.scales) == [[0x7E, 0x00]]
    assert t.data.tolist() == [BYTES_A + [0] * 8]
    assert ref.dequantize(t)[0, 16:].eq(0).all()


def test_all_zero_tensor():
    t = ref.quantize(torch.zeros(16, 32), Recipe(columnwise=True))
    assert t.amax.tolist() == [0.0] and t.amax_t.tolist() == [0.0]
    assert t.data.eq(0).all() and t.data_t.eq(0).all()
    assert t.scales.view(torch.uint8).eq(0).all()
    assert ref.dequantize(t).eq(0).all()


def test_negative_zeros_encode_as_positive_zero():
    t = ref.quantize(torch.full((1, 16), -0.0), Recipe())
    assert t.data.eq(0).all() and u8(t.scales) == [[0]]


def test_all_zero_row_per_token():
    x = torch.tensor([[0.0] * 16, BLOCK_A])
    t = ref.quantize(x, Recipe(scaling="token"))
    assert t.amax.tolist() == [0.0, 6.0]
    assert u8(t.scales) == [[0x00], [0x7E]]
    assert t.data.tolist() == [[0] * 8, BYTES_A]


def test_inf_element_per_tensor():
    # amax = inf -> S_enc = 2688 / inf = 0 -> guard -> 1.
    # Block 0 (holds inf): s = e4m3(min(inf * fp32(1/6), FLT_MAX)) = 448 = 0x7E, enc = 1/448:
    #   1 * enc = 0.0022 -> code 0, inf -> clamp 6 -> code 7: bytes 00 70 00 ...
    # Block 1 (ones): s = e4m3(fp32(1/6)) = 0.171875 = 0x23, enc = 1/0.171875 = 5.82 -> code 7.
    x = torch.ones(1, 32)
    x[0, 3] = INF
    t = ref.quantize(x, Recipe())
    assert t.amax.tolist() == [INF]
    assert u8(t.scales) == [[0x7E, 0x23]]
    assert t.data.tolist() == [[0x00, 0x70] + [0x00] * 6 + [0x77] * 8]


def test_negative_inf_element_with_finite_outer_amax():
    # quantize_blocks with outer amax 6 (S_enc 448): the -inf block gets s = 448 (0x7E),
    # enc = 1, so -inf -> 0xF and the ones -> code 2 (1.0); the second block (ones, amax 1):
    # s = e4m3(74.66667) = 72 (0x69), enc = 1 / (72 / 448) = 6.22 -> 7.
    x = torch.ones(1, 32)
    x[0, 0] = -INF
    data, scales = ref.quantize_blocks(x, torch.tensor(6.0))
    assert u8(scales) == [[0x7E, 0x69]]
    assert data.tolist() == [[0x2F] + [0x22] * 7 + [0x77] * 8]


def test_nan_element_poisons_its_block():
    # With a finite outer amax only the NaN block is affected: its amax is NaN, the scale NaN
    # (E4M3 0x7F), enc NaN, and every element of the block encodes as code 0 (as in TE).
    x = row(BLOCK_A, BLOCK_A)
    x[0, 20] = NAN
    data, scales = ref.quantize_blocks(x, torch.tensor(6.0))
    assert u8(scales) == [[0x7E, 0x7F]]
    assert data.tolist() == [BYTES_A + [0] * 8]


def test_nan_element_per_tensor_poisons_the_tensor():
    # The per-tensor amax is NaN, so S_enc is NaN and every scale is NaN (0x7F), every code 0.
    x = row(BLOCK_A, BLOCK_B)
    x[0, 3] = NAN
    t = ref.quantize(x, Recipe())
    assert math.isnan(t.amax.item())
    assert u8(t.scales) == [[0x7F, 0x7F]]
    assert t.data.eq(0).all()
    assert ref.dequantize(t).isnan().all()


def test_nan_element_per_token_poisons_its_row_only():
    x = torch.tensor([BLOCK_A, BLOCK_A])
    x[1, 5] = NAN
    t = ref.quantize(x, Recipe(scaling="token"))
    assert t.amax[0].item() == 6.0 and math.isnan(t.amax[1].item())
    assert u8(t.scales) == [[0x7E], [0x7F]]
    assert t.data.tolist() == [BYTES_A, [0] * 8]


# ---------------------------------------------------------------------------------------------
# Input dtypes, padding of 16x16 tiles, quantize_blocks arguments
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", ["tensor", "token", "window64"])
def test_half_inputs_match_fp32_of_the_same_values(dtype, scaling):
    x = (torch.randn(64, 128) * 4).to(dtype)
    r = Recipe(scaling=scaling, columnwise=True)
    a, b = ref.quantize(x, r), ref.quantize(x.float(), r)
    assert a.data.equal(b.data) and u8(a.scales) == u8(b.scales) and a.amax.equal(b.amax)
    assert a.data_t.equal(b.data_t) and u8(a.scales_t) == u8(b.scales_t)
    assert a.dtype == dtype and b.dtype == torch.float32


def test_hand_blocks_from_bf16():
    # blocks A and B hold values not exact in bf16 (0.3, 5.1, 0.8, 0.2, 2.4, 0.05): after the
    # bf16 rounding they still land on the same codes (bf16 keeps 8 bits of mantissa).
    x = row(BLOCK_A, BLOCK_B).to(torch.bfloat16)
    t = ref.quantize(x, Recipe())
    assert u8(t.scales) == [[0x7E, 0x76]]
    assert t.data.tolist() == [BYTES_A + BYTES_B]


def test_2d_tiles_pad_partial_row_tile_with_zeros():
    # 20 rows: the second row tile has 4 real rows; padding rows are zeros and do not change
    # the tile amax. Data/scales are cut back to 20 rows.
    x = torch.randn(20, 32)
    t = ref.quantize(x, Recipe(block=(16, 16)))
    assert t.data.shape == (20, 16) and t.scales.shape == (20, 2)
    padded = torch.cat([x, torch.zeros(12, 32)])
    full = ref.quantize(padded, Recipe(block=(16, 16)))
    assert t.data.equal(full.data[:20]) and u8(t.scales) == u8(full.scales[:20])
    s = t.scales.view(torch.uint8)
    assert s[16:].eq(s[16]).all() and s[:16].eq(s[0]).all()


def test_quantize_blocks_matches_quantize_per_tensor():
    x = torch.randn(16, 64)
    data, scales = ref.quantize_blocks(x, x.abs().amax())
    t = ref.quantize(x, Recipe())
    assert data.equal(t.data) and u8(scales) == u8(t.scales)


def test_quantize_blocks_outer_amax_broadcast_per_block():
    # An outer amax per block [m, n/16] (the window64 form) equal everywhere is per-tensor.
    x = torch.randn(8, 64)
    a = x.abs().amax()
    d1, s1 = ref.quantize_blocks(x, a)
    d2, s2 = ref.quantize_blocks(x, torch.full((8, 4), a.item()))
    assert d1.equal(d2) and u8(s1) == u8(s2)


def test_amax_helpers():
    x = torch.tensor([[1.0, -3.0] * 32, [-0.5, 2.0] * 32])
    assert ref.amax(x).tolist() == [3.0]
    r, c = ref.amax_per_token(x)
    assert r.tolist() == [3.0, 2.0] and c.tolist() == [1.0, 3.0] * 32
    assert ref.amax_window64(x).tolist() == [[3.0], [2.0]]
    assert ref.amax(torch.zeros(0, 16)).tolist() == [0.0]
    assert math.isnan(ref.amax(torch.tensor([[1.0, NAN]])).item())


def test_outer_amax_shapes():
    x = torch.randn(4, 128)
    assert ref.outer_amax(x, "tensor").shape == (1,)
    assert ref.outer_amax(x, "token").shape == (4,)
    assert ref.outer_amax(x, "window64").shape == (4, 2)
    w = ref.outer_amax(x, "window64")
    assert ref.block_outer_amax(w, "window64", 4).tolist() == [
        [w[i, 0].item()] * 4 + [w[i, 1].item()] * 4 for i in range(4)]


def test_quantize_output_shapes_and_dtypes():
    x = torch.randn(48, 96)
    t = ref.quantize(x, Recipe(columnwise=True))
    assert t.data.dtype == torch.uint8 and t.data.shape == (48, 48)
    assert t.scales.dtype == torch.float8_e4m3fn and t.scales.shape == (48, 6)
    assert t.data_t.shape == (96, 24) and t.scales_t.shape == (96, 3)
    assert t.amax.dtype == torch.float32 and t.amax_t.dtype == torch.float32
    assert t.shape == (48, 96) and t.dtype == torch.float32


@pytest.mark.parametrize("recipe", [
    Recipe(scaling="token", columnwise=True),
    Recipe(scaling="tensor", columnwise=True),
    Recipe(scaling="window64", columnwise=True),
], ids=["token", "tensor", "window64"])
def test_quantize_zero_rows(recipe):
    """An empty [0, K] input quantizes to empty outputs (the twin is [K, 0], amax 0)."""
    x = torch.zeros(0, 64)
    t = ref.quantize(x, recipe)
    assert t.data.shape == (0, 32) and t.scales.shape == (0, 4)
    assert t.data_t.shape == (64, 0) and t.scales_t.shape == (64, 0)
    assert ref.dequantize(t).shape == (0, 64)


def test_quantize_grouped_hand_blocks():
    x = torch.tensor([BLOCK_A, [v / 8 for v in BLOCK_A], [v / 8 for v in BLOCK_A]])
    parts = ref.quantize_grouped(x, [1, 2], Recipe())
    assert [p.amax.tolist() for p in parts] == [[6.0], [0.75]]
    # each group has its own per-tensor amax: group 1 (amax 0.75) gets scale 0x7E, not 0x66
    assert [u8(p.scales) for p in parts] == [[[0x7E]], [[0x7E], [0x7E]]]
    assert [p.data.tolist() for p in parts] == [[BYTES_A], [BYTES_A, BYTES_A]]


def test_cute_fp4_quantize_is_the_reference_on_cpu():
    x = torch.randn(32, 64)
    r = Recipe(scaling="token", columnwise=True, swizzle=True)
    a, b = cute_fp4.quantize(x, r), ref.quantize(x, r)
    assert a.data.equal(b.data) and u8(a.scales) == u8(b.scales)
    assert a.data_t.equal(b.data_t) and u8(a.scales_t) == u8(b.scales_t)
