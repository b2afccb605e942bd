"""The 128x4 swizzled scale layout (SPEC section 1), NVFP4 dequantization from compact and
swizzled scales, and MXFP8 (E8M0 per 32) dequantize / quantize."""

import math

import pytest
import torch

from cute_fp4 import Recipe, ref

from test_ref_quantize import BLOCK_A, BLOCK_B, BLOCK_C, u8

def spec_offset(r, c, cols):
    """SPEC section 1, written out: 128x4 tiles of 512 bytes, row-tile-major; inside a tile
    (r, c) sits at (r % 32) * 16 + (r // 32) * 4 + c."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + (c // 4)
    rr, cc = r % 128, c % 4
    return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc


# (r, c, cols, byte offset): worked by hand from the formula above
OFFSETS = [
    (0, 0, 8, 0), (0, 1, 8, 1), (0, 3, 8, 3), (1, 0, 8, 16), (31, 0, 8, 496), (32, 0, 8, 4),
    (33, 2, 8, 22),  # 1*16 + 1*4 + 2
    (64, 1, 8, 9), (96, 3, 8, 15), (127, 3, 8, 511),  # 31*16 + 3*4 + 3
    (0, 4, 8, 512),  # second tile of row-tile 0
    (5, 6, 8, 594),  # 512 + 5*16 + 2
    (128, 0, 8, 1024),  # row-tile 1 starts after 2 tiles
    (130, 5, 8, 1569),  # tile 3: 1536 + 2*16 + 1
    (255, 7, 8, 2047),
    (130, 4, 5, 1568),  # 5 columns pad to 8: same tiles (tile 3: 1536 + 2*16)
    (128, 0, 3, 512),  # 3 columns pad to 4: one tile per row-tile
    (200, 2, 3, 650),  # 512 + (72 % 32)*16 + (72 // 32)*4 + 2
    (300, 9, 12, 3 * 2 * 512 + 2 * 512 + 12 * 16 + 1 * 4 + 1),  # tile 8 = 4096, + 197 = 4293
]


@pytest.mark.parametrize("r,c,cols,offset", OFFSETS)
def test_swizzled_offset_literal(r, c, cols, offset):
    assert spec_offset(r, c, cols) == offset
    assert int(ref.swizzled_offset(torch.tensor(r), torch.tensor(c), cols)) == offset


@pytest.mark.parametrize("r,c,cols,offset", OFFSETS)
def test_swizzle_places_entry_at_offset(r, c, cols, offset):
    rows = max(r + 1, 1)
    s = torch.zeros(rows, cols, dtype=torch.uint8)
    s[r, c] = 0xA5
    sw = ref.swizzle_scales(s).view(-1)
    assert sw[offset].item() == 0xA5
    assert int(sw.ne(0).sum()) == 1


@pytest.mark.parametrize("rows,cols,shape", [
    (1, 1, (128, 4)), (128, 4, (128, 4)), (129, 4, (256, 4)), (130, 5, (256, 8)),
    (0, 4, (0, 4)), (256, 12, (256, 12)), (300, 13, (384, 16)),
])
def test_swizzled_shape(rows, cols, shape):
    assert ref.swizzled_shape(rows, cols) == shape


SHAPES = [(1, 1), (3, 5), (127, 3), (128, 4), (129, 7), (200, 9), (256, 8), (300, 13)]


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_matches_spec_formula_everywhere_and_pads_zero(rows, cols):
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    compact = ((r * 7 + c * 3) % 254 + 1).to(torch.uint8)  # never 0
    sw = ref.swizzle_scales(compact)
    pr, pc = ref.swizzled_shape(rows, cols)
    assert sw.shape == (pr, pc) and sw.dtype == torch.uint8
    flat = sw.reshape(-1)
    expected = torch.zeros(pr * pc, dtype=torch.uint8)
    for i in range(rows):
        for j in range(cols):
            expected[spec_offset(i, j, cols)] = compact[i, j]
    assert flat.equal(expected)
    # padding is zero: exactly rows * cols nonzero bytes
    assert int(flat.ne(0).sum()) == rows * cols


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_swizzle_round_trip(rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    s = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    sw = ref.swizzle_scales(s)
    assert ref.unswizzle_scales(sw, rows, cols).equal(s)
    # a flat buffer of the right size works too
    assert ref.unswizzle_scales(sw.reshape(-1), rows, cols).equal(s)


def test_swizzle_keeps_fp8_dtype():
    s = torch.tensor([[1.0, 2.0], [448.0, 0.5]]).to(torch.float8_e4m3fn)
    sw = ref.swizzle_scales(s)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (128, 4)
    assert u8(sw)[0][:4] == [0x38, 0x40, 0, 0]
    assert u8(sw)[4][:4] == [0x7E, 0x30, 0, 0]  # row 1 starts at byte 16
    back = ref.unswizzle_scales(sw, 2, 2)
    assert back.dtype == torch.float8_e4m3fn and u8(back) == u8(s)


def test_swizzle_errors():
    with pytest.raises(ValueError, match="2D scale matrix"):
        ref.swizzle_scales(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="need 512 bytes"):
        ref.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 3, 4)


# TransformerEngine's `_recover_swizzled_scales` un-swizzles by reshaping to
# (m/128, n/4, 32, 4, 4) and permuting (0, 3, 2, 1, 4); check against that formulation.
@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (130, 5)])
def test_unswizzle_matches_te_formulation(rows, cols):
    g = torch.Generator().manual_seed(7)
    s = torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.uint8)
    sw = ref.swizzle_scales(s)
    pr, pc = sw.shape
    te = sw.reshape(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(pr, pc)
    assert te[:rows, :cols].equal(s)


# ---------------------------------------------------------------------------------------------
# NVFP4 dequantize
# ---------------------------------------------------------------------------------------------

DEQ_RECIPES = [Recipe(), Recipe(scaling="token"), Recipe(scaling="window64"),
               Recipe(block=(16, 16)), Recipe(four_over_six="mse", e4m3_max=256),
               Recipe(rht=True, columnwise=True)]


@pytest.mark.parametrize("recipe", DEQ_RECIPES, ids=lambda r: f"{r.scaling}-{r.block[0]}-"
                         f"{r.four_over_six}-{r.rht}")
@pytest.mark.parametrize("rows", [16, 144, 256])
def test_dequantize_compact_equals_swizzled(recipe, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 320, generator=g) * 5
    compact = ref.quantize(x, recipe)
    swz = ref.quantize(x, recipe.replace(swizzle=True))
    assert compact.data.equal(swz.data)
    assert swz.scales.shape == ref.swizzled_shape(rows, 20)
    assert u8(ref.swizzle_scales(compact.scales)) == u8(swz.scales)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a, b = ref.dequantize(compact, dtype), ref.dequantize(swz, dtype)
        assert a.dtype == dtype and a.equal(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_hand_values_in_every_dtype(dtype):
    # block C (scale 384, S_enc 448): values e2m1 * 384 / 448, computed in FP32 then cast
    t = ref.quantize(torch.tensor([BLOCK_A + BLOCK_B + BLOCK_C]), Recipe())
    vc = [6, -4, 4, .5, 1, -2, 3, 0, 2, -.5, 0, 6, -6, 4, 1, 1.5]
    expected = (torch.tensor(vc) * 384.0 / 448.0).to(dtype)
    got = ref.dequantize(t, dtype)
    assert got.dtype == dtype
    assert got[0, 32:].equal(expected)
    assert got[0, :16].tolist() == [6, -4, 4, 0, .5, -1, 1, 2, -2, 4, 6, 0, 0, 2, -6, 1]


def test_dequantize_window64_hand():
    # one row [A, A, A, A, A/8 x4]: windows have amax 6 (S_enc 448) and 0.75 (S_enc 3584);
    # window 1 dequantizes to e2m1 * 448 / 3584 = e2m1 / 8.
    small = [v / 8 for v in BLOCK_A]
    t = ref.quantize(torch.tensor([BLOCK_A * 4 + small * 4]), Recipe(scaling="window64"))
    got = ref.dequantize(t)[0]
    assert got[64:].equal(got[:64] / 8)
    assert got[:16].tolist() == [6, -4, 4, 0, .5, -1, 1, 2, -2, 4, 6, 0, 0, 2, -6, 1]


@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("scaling", ["tensor", "token", "window64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_empty(swizzle, scaling, dtype):
    t = ref.quantize(torch.zeros(0, 128), Recipe(scaling=scaling, swizzle=swizzle))
    out = ref.dequantize(t, dtype)
    assert out.shape == (0, 128) and out.dtype == dtype


def test_dequantize_matrix_direct():
    t = ref.quantize(torch.tensor([BLOCK_A + BLOCK_B]), Recipe())
    out = ref.dequantize_matrix(t.data, t.scales, t.amax, t.recipe, 32, torch.float32)
    assert out.equal(ref.dequantize(t))


def test_dequantize_errors():
    t = ref.quantize(torch.randn(16, 32), Recipe(columnwise=True, rowwise=False))
    with pytest.raises(ValueError, match="no rowwise data"):
        ref.dequantize(t)
    t = ref.quantize(torch.randn(16, 32), Recipe())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        ref.dequantize(t, torch.float64)


# ---------------------------------------------------------------------------------------------
# MXFP8: E8M0 scale per 32 elements, value = data * 2^(code - 127); code 255 is NaN
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,value", [(127, 1.0), (128, 2.0), (126, 0.5), (130, 8.0),
                                        (0, 2.0 ** -127), (1, 2.0 ** -126), (254, 2.0 ** 127)])
def test_e8m0_to_float(code, value):
    assert ref.e8m0_to_float(torch.tensor([code], dtype=torch.uint8)).item() == value


def test_e8m0_255_is_nan():
    assert math.isnan(ref.e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())


E4M3_ROW = [1.0, -2.0, 0.5, 448.0, -448.0, 0.0, 0.015625, 3.5] * 4  # 32 exact E4M3 values


def mx_data(dtype=torch.float8_e4m3fn):
    return torch.tensor([E4M3_ROW * 2, E4M3_ROW * 2]).to(dtype)


@pytest.mark.parametrize("swizzled", [False, True])
def test_mxfp8_dequantize_hand(swizzled):
    codes = torch.tensor([[127, 128], [255, 120]], dtype=torch.uint8)
    sc = ref.swizzle_scales(codes) if swizzled else codes
    out = ref.mxfp8_dequantize(mx_data(), sc, torch.float32, swizzled=swizzled)
    assert out[0, :32].tolist() == E4M3_ROW  # code 127: x 1
    assert out[0, 32:].tolist() == [2 * v for v in E4M3_ROW]  # code 128: x 2
    assert out[1, :32].isnan().all()  # code 255
    assert out[1, 32:].tolist() == [v * 2.0 ** -7 for v in E4M3_ROW]  # code 120: x 2^-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_dequantize_out_dtypes(dtype):
    codes = torch.tensor([[127, 128], [126, 127]], dtype=torch.uint8)
    out = ref.mxfp8_dequantize(mx_data(), codes, dtype)
    assert out.dtype == dtype
    assert out[1, :32].tolist() == [v / 2 for v in E4M3_ROW]


def test_mxfp8_dequantize_e5m2_and_e8m0_dtype_scales():
    data = torch.tensor([[1.0, -1.5, 57344.0, 2.0 ** -16] * 8]).to(torch.float8_e5m2)
    codes = torch.tensor([[129]], dtype=torch.uint8)
    out = ref.mxfp8_dequantize(data, codes)
    assert out[0, :4].tolist() == [4.0, -6.0, 229376.0, 2.0 ** -14]
    if hasattr(torch, "float8_e8m0fnu"):  # scales given as E8M0 bytes in their own dtype
        out2 = ref.mxfp8_dequantize(data, codes.view(torch.float8_e8m0fnu))
        assert out2.equal(out)


def test_mxfp8_quantize_hand():
    # block 0: amax 1792 = 448 * 4 -> ratio 4.0 = 2^2 exactly -> code 129, data = x / 4;
    # block 1: amax 1000 -> ratio 2.23 -> exponent 128 plus a mantissa -> code 129 (x4),
    #          1000 / 4 = 250 -> E4M3 240 | 256 -> 256;
    # block 2: amax 448 -> ratio 1 -> code 127; block 3: all zero -> code 0.
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 1792.0, -3.0
    x[0, 32], x[0, 33] = 1000.0, 10.0
    x[0, 64], x[0, 65] = 448.0, 0.3
    data, codes = ref.mxfp8_quantize(x)
    assert codes.tolist() == [[129, 129, 127, 0]]
    d = data.to(torch.float32)[0]
    assert d[[0, 1, 32, 33, 64]].tolist() == [448.0, -0.75, 256.0, 2.5, 448.0]
    assert d[65].item() == 0.3125  # 0.3 -> E4M3 0.28125 | 0.3125 -> 0.3125
    assert d[96:].eq(0).all()


@pytest.mark.parametrize("fp8_dtype,rel,sub", [(torch.float8_e4m3fn, 2.0 ** -4, 2.0 ** -10),
                                               (torch.float8_e5m2, 2.0 ** -3, 2.0 ** -17)])
@pytest.mark.parametrize("swizzle", [False, True])
def test_mxfp8_round_trip_error_bound(fp8_dtype, rel, sub, swizzle):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(160, 256, generator=g) * torch.logspace(-6, 6, 256)
    data, codes = ref.mxfp8_quantize(x, fp8_dtype, swizzle=swizzle)
    assert data.dtype == fp8_dtype
    assert codes.shape == (ref.swizzled_shape(160, 8) if swizzle else (160, 8))
    xh = ref.mxfp8_dequantize(data, codes, torch.float32, swizzled=swizzle)
    compact = ref.unswizzle_scales(codes, 160, 8) if swizzle else codes
    scale = ref.e8m0_to_float(compact).repeat_interleave(32, dim=1)
    # half an ULP relative, or half the smallest subnormal step, in the scaled domain
    bound = rel * x.abs() + sub * scale
    assert ((xh - x).abs() <= bound).all()
    # the block amax never clips: amax / scale <= fp8 max
    fmax = 448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0
    amax = x.abs().view(160, 8, 32).amax(-1)
    assert (amax / ref.e8m0_to_float(compact) <= fmax).all()
    assert (amax / ref.e8m0_to_float(compact) > fmax / 2).all()  # smallest such power of two


def test_mxfp8_errors():
    with pytest.raises(ValueError, match="divisible by 32"):
        ref.mxfp8_quantize(torch.zeros(2, 48))
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        ref.mxfp8_quantize(torch.zeros(2, 64), torch.float16)
    with pytest.raises(TypeError, match="MXFP8 data"):
        ref.mxfp8_dequantize(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="dtype must be"):
        ref.mxfp8_dequantize(mx_data(), torch.zeros(2, 2, dtype=torch.uint8), torch.float64)
    with pytest.raises(ValueError, match="divisible by 32"):
        ref.mxfp8_dequantize(torch.zeros(2, 48).to(torch.float8_e4m3fn),
                             torch.zeros(2, 2, dtype=torch.uint8))


def test_mxfp8_dequantize_out_argument():
    """`out=` of cute_fp4.mxfp8_dequantize (any device): filled and returned; a wrong
    dtype, shape or layout raises ValueError naming the rule."""
    from cute_fp4 import mxfp8_dequantize

    data, scales = ref.mxfp8_quantize(torch.randn(4, 64) * 10)
    out = torch.full((4, 64), float("nan"))
    assert mxfp8_dequantize(data, scales, torch.float32, out=out) is out
    assert torch.equal(out, ref.mxfp8_dequantize(data, scales, torch.float32))
    with pytest.raises(ValueError, match="out must be a torch.float32 tensor of shape"):
        mxfp8_dequantize(data, scales, torch.float32, out=torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be a torch.float32 tensor of shape"):
        mxfp8_dequantize(data, scales, torch.float32, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="out must be contiguous"):
        mxfp8_dequantize(data, scales, torch.float32, out=torch.empty(64, 4).t())


def test_mxfp8_dequantize_scale_checks():
    """The package's mxfp8_dequantize checks the scales against the data (the GPU kernel
    reads them as flat bytes: a wrong shape would read the wrong scales)."""
    from cute_fp4.quant.dequantize import mxfp8_dequantize

    data, scales = ref.mxfp8_quantize(torch.randn(5, 64))
    with pytest.raises(ValueError, match=r"MXFP8 scales must be .* shape \(5, 2\) \(compact\)"):
        mxfp8_dequantize(data, scales[:, :1])
    with pytest.raises(ValueError, match=r"shape \(128, 4\) \(swizzled\)"):
        mxfp8_dequantize(data, scales, swizzled=True)
    with pytest.raises(ValueError, match="contiguous 1-byte"):
        mxfp8_dequantize(data, scales.to(torch.int16))
    with pytest.raises(ValueError, match="contiguous 1-byte"):
        mxfp8_dequantize(data, scales.t().contiguous().t())
    swz = ref.swizzle_scales(scales)
    assert torch.equal(mxfp8_dequantize(data, swz, swizzled=True), mxfp8_dequantize(data, scales))


def test_swizzle_scales_off_the_gpu():
    """quant.swizzle.swizzle_scales (the GEMMs' layout conversion) runs the reference for CPU
    tensors and names the rule for bad input."""
    from cute_fp4.quant.swizzle import swizzle_scales

    s = torch.randint(0, 256, (130, 5), dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = swizzle_scales(s)
    assert got.dtype == s.dtype and torch.equal(got.view(torch.uint8),
                                                ref.swizzle_scales(s).view(torch.uint8))
    with pytest.raises(ValueError, match="2D scale matrix"):
        swizzle_scales(torch.zeros(2, 3, 4, dtype=torch.uint8))
