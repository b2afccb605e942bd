"""Reference GEMM (SPEC section 3): hand-computed block sums and epilogues, FP32 block-ordered
accumulation, and agreement with a float64 dequantize-then-matmul for every operand kind
(per-tensor, per-token, window64, 16x16, 4over6, W4A16, columnwise twins)."""

import pytest
import torch

import cute_fp4
from cute_fp4 import Recipe, ref

F32 = torch.float32


def packed(codes_rows):
    return ref.pack_fp4(torch.tensor(codes_rows, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# Hand-computed ref.gemm
# ---------------------------------------------------------------------------------------------

# a: one row of 16 codes 2 (1.0), factor 2.  b: row 0 = 16 x code 7 (6.0), factor 0.5;
# row 1 = 16 x code 3 (1.5), factor 4.  acc = [16 * 6 * 2 * 0.5, 16 * 1.5 * 2 * 4] = [96, 192]
A_HAND = packed([[2] * 16])
B_HAND = packed([[7] * 16, [3] * 16])
FA_HAND = torch.tensor([[2.0]])
FB_HAND = torch.tensor([[0.5], [4.0]])


def test_gemm_hand_plain():
    d = ref.gemm(A_HAND, FA_HAND, B_HAND, FB_HAND, out_dtype=F32)
    assert d.tolist() == [[96.0, 192.0]]


@pytest.mark.parametrize("kwargs,expected", [
    (dict(alpha=torch.tensor(0.25)), [[24.0, 48.0]]),
    (dict(alpha=torch.tensor([0.25]), row=torch.tensor([3.0])), [[72.0, 144.0]]),
    (dict(alpha=torch.tensor(0.25), row=torch.tensor([3.0]), col=torch.tensor([1.0, 0.5])),
     [[72.0, 72.0]]),
    (dict(alpha=torch.tensor(0.25), row=torch.tensor([3.0]), col=torch.tensor([1.0, 0.5]),
          bias=torch.tensor([1.0, -2.0])), [[73.0, 70.0]]),
    (dict(col=torch.tensor([-1.0, 0.125])), [[-96.0, 24.0]]),
    (dict(bias=torch.tensor([0.5, 1.0], dtype=torch.bfloat16)), [[96.5, 193.0]]),
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemm_hand_epilogue(kwargs, expected, out_dtype):
    # ((acc * alpha) * row[m]) * col[n] + bias[n]; every value here is exact in bf16/fp16
    d = ref.gemm(A_HAND, FA_HAND, B_HAND, FB_HAND, out_dtype=out_dtype, **kwargs)
    assert d.dtype == out_dtype and d.tolist() == expected


def test_gemm_hand_two_k_blocks():
    # K = 32. a = [1.0 x16 | -0.5 x16] with factors [1, 2]; b = [6 x16 | 3 x16], factors [3, 0.5]
    # acc = 16 * 1 * 6 * (1 * 3) + 16 * -0.5 * 3 * (2 * 0.5) = 288 - 24 = 264
    a = packed([[2] * 16 + [9] * 16])
    b = packed([[7] * 16 + [5] * 16])
    d = ref.gemm(a, torch.tensor([[1.0, 2.0]]), b, torch.tensor([[3.0, 0.5]]), out_dtype=F32)
    assert d.tolist() == [[264.0]]


def test_gemm_accumulates_blocks_in_fp32_in_k_order():
    # Three K blocks, one nonzero element each: a = 4, 0.5, -4 and b = 4, 2, 4, factors
    # 2^10 * 2^10, 1, 2^10 * 2^10: block dots 2^24, 1, -2^24. In FP32, in K order,
    # (2^24 + 1) rounds to 2^24 (tie to even) and the sum ends at 0 (float64 would give 1).
    def one(code):
        return [code] + [0] * 15

    a_blocks, b_blocks = [one(6), one(1), one(0xE)], [one(6), one(4), one(6)]
    f = [2.0 ** 10, 1.0, 2.0 ** 10]
    d = ref.gemm(packed([sum(a_blocks, [])]), torch.tensor([f]),
                 packed([sum(b_blocks, [])]), torch.tensor([f]), out_dtype=F32)
    assert d.item() == 0.0
    # blocks reversed: (-2^24 + 1) + 2^24 = 1 exactly
    d = ref.gemm(packed([sum(a_blocks[::-1], [])]), torch.tensor([f[::-1]]),
                 packed([sum(b_blocks[::-1], [])]), torch.tensor([f[::-1]]), out_dtype=F32)
    assert d.item() == 1.0


def test_gemm_w4a16_hand():
    # dense a = [1, 2, ..., 16] (bf16), b = 16 x code 2 (1.0) with factor 0.5: sum = 136 * 0.5
    a = torch.arange(1.0, 17.0).view(1, 16).to(torch.bfloat16)
    d = ref.gemm(a, None, packed([[2] * 16]), torch.tensor([[0.5]]), out_dtype=F32)
    assert d.tolist() == [[68.0]]


def test_gemm_k_mismatch():
    with pytest.raises(ValueError, match="K mismatch"):
        ref.gemm(packed([[2] * 32]), torch.ones(1, 2), B_HAND, FB_HAND)


def test_gemm_bad_out_dtype():
    with pytest.raises(TypeError, match="out_dtype"):
        ref.gemm(A_HAND, FA_HAND, B_HAND, FB_HAND, out_dtype=torch.float64)


def test_snr_db_literal():
    # ||[3, 4]|| = 5, ||error|| = 0.5 -> 20 log10(10) = 20 dB
    assert abs(ref.snr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) - 20.0) < 1e-12
    # error half the signal: 20 log10(2)
    assert abs(ref.snr_db(torch.tensor([1.0, 0.0]), torch.tensor([1.5, 0.0]))
               - 6.020599913279624) < 1e-12


# ---------------------------------------------------------------------------------------------
# cute_fp4.gemm on hand blocks: outer scales as alpha / row / col
# Row [5.25, 2.625, 1.3125, -0.65625, 0 ...] has amax 5.25: S_enc = 2688 / 5.25 = 512 = 2^9,
# s = e4m3(5.25 * (512 * fp32(1/6))) = e4m3(448.0000133) = 448, enc = 1 / (448 / 512) =
# fp32(1/0.875) = 1.1428572: codes 6.0000002->7, 3.0000001->5, 1.50000006->3,
# -0.75000005->A (just past the tie): e2m1 values 6, 3, 1.5, -1.
# a . b (a = b) = (36 + 9 + 2.25 + 1) * 448^2 = 48.25 * 448^2; alpha = 2^-9 * 2^-9:
# D = 48.25 * 448^2 / 2^18 = 48.25 * 0.765625 = 36.94140625 (exact in FP32; bf16 -> 37.0).
# ---------------------------------------------------------------------------------------------

HAND_ROW = [5.25, 2.625, 1.3125, -0.65625] + [0.0] * 12


@pytest.mark.parametrize("scaling", ["tensor", "token", "window64"])
def test_api_gemm_hand(scaling):
    x = torch.tensor([HAND_ROW * 4])  # K = 64: four identical blocks
    t = cute_fp4.quantize(x, Recipe(scaling=scaling))
    assert t.scales.view(torch.uint8).tolist() == [[0x7E] * 4]
    assert ref.unpack_fp4(t.data)[0, :16].tolist() == [7, 5, 3, 0xA] + [0] * 12
    d = cute_fp4.gemm(t, t, out_dtype=F32)
    assert d.tolist() == [[4 * 36.94140625]]
    assert cute_fp4.gemm(t, t, out_dtype=torch.bfloat16).tolist() == [[148.0]]  # 147.77 -> 148
    bias = torch.tensor([0.234375])  # 147.765625 + 0.234375 = 148 exactly
    assert cute_fp4.gemm(t, t, bias=bias, out_dtype=F32).tolist() == [[148.0]]


def test_api_gemm_per_token_rows_and_cols_hand():
    # a rows: HAND_ROW and HAND_ROW / 4 (S_enc 2048); b rows: HAND_ROW and 2 * HAND_ROW
    # (S_enc 256). Per-token codes and scales are identical for all rows (power-of-two
    # scaling), so D[m, n] = 36.94140625 * (1, 1/4)[m] * (1, 2)[n].
    base = torch.tensor([HAND_ROW])
    a = cute_fp4.quantize(torch.cat([base, base / 4]), Recipe(scaling="token"))
    b = cute_fp4.quantize(torch.cat([base, base * 2]), Recipe(scaling="token"))
    d = cute_fp4.gemm(a, b, out_dtype=F32)
    v = 36.94140625
    assert d.tolist() == [[v, 2 * v], [v / 4, v / 2]]


# ---------------------------------------------------------------------------------------------
# vs float64 of the dequantized operands
# ---------------------------------------------------------------------------------------------

def check_vs_float64(d, a_deq, b_deq, bias=None, tol=1e-6):
    """|D - D64| <= tol * (|A| @ |B|^T) elementwise (and 1e-6 norm-wise relative)."""
    a64, b64 = a_deq.double(), b_deq.double()
    d64 = a64 @ b64.t()
    scale = a64.abs() @ b64.abs().t()
    if bias is not None:
        d64 = d64 + bias.double()
        scale = scale + bias.double().abs()
    err = (d.double() - d64).abs()
    assert (err <= tol * scale + 1e-30).all(), float((err / (scale + 1e-30)).max())
    assert (err.norm() / d64.norm()).item() < tol


OPERAND_RECIPES = {
    "tensor": Recipe(),
    "token": Recipe(scaling="token"),
    "window64": Recipe(scaling="window64"),
    "2d": Recipe(block=(16, 16)),
    "4over6": Recipe(four_over_six="mse", e4m3_max=256),
    "4over6-fast": Recipe(four_over_six="mae", fast_math=True),
    "swizzled-token": Recipe(scaling="token", swizzle=True),
    "swizzled-w64": Recipe(scaling="window64", swizzle=True),
}


@pytest.mark.parametrize("a_kind", ["tensor", "token", "window64", "4over6", "swizzled-token",
                                    "swizzled-w64"])
@pytest.mark.parametrize("b_kind", ["tensor", "token", "window64", "2d", "4over6-fast"])
def test_api_gemm_vs_float64(a_kind, b_kind):
    g = torch.Generator().manual_seed(hash((a_kind, b_kind)) % 1000)
    x = torch.randn(48, 256, generator=g) * torch.logspace(-1, 1, 48)[:, None]
    w = torch.randn(32, 256, generator=g) * 0.05
    a = cute_fp4.quantize(x, OPERAND_RECIPES[a_kind])
    b = cute_fp4.quantize(w, OPERAND_RECIPES[b_kind])
    d = cute_fp4.gemm(a, b, out_dtype=F32)
    assert d.shape == (48, 32) and d.dtype == F32
    check_vs_float64(d, ref.dequantize(a, F32), ref.dequantize(b, F32))
    # quantization error itself is bounded: the product is close to the unquantized one
    assert ref.snr_db(x.double() @ w.double().t(), d) > 12.0


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_api_gemm_low_precision_out_is_fp32_cast(out_dtype):
    g = torch.Generator().manual_seed(31)
    a = cute_fp4.quantize(torch.randn(16, 128, generator=g), Recipe(scaling="token"))
    b = cute_fp4.quantize(torch.randn(24, 128, generator=g), Recipe())
    bias = torch.randn(24, generator=g)
    d32 = cute_fp4.gemm(a, b, bias=bias, out_dtype=F32)
    d = cute_fp4.gemm(a, b, bias=bias, out_dtype=out_dtype)
    assert d.dtype == out_dtype and d.equal(d32.to(out_dtype))


def test_api_gemm_bias_vs_float64():
    g = torch.Generator().manual_seed(32)
    a = cute_fp4.quantize(torch.randn(16, 128, generator=g), Recipe())
    b = cute_fp4.quantize(torch.randn(24, 128, generator=g), Recipe(scaling="token"))
    bias = torch.randn(24, generator=g) * 10
    d = cute_fp4.gemm(a, b, bias=bias, out_dtype=F32)
    check_vs_float64(d, ref.dequantize(a, F32), ref.dequantize(b, F32), bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_kind", ["tensor", "token", "2d", "window64"])
def test_api_gemm_w4a16_vs_float64(dtype, b_kind):
    g = torch.Generator().manual_seed(33)
    x = torch.randn(8, 192, generator=g).to(dtype)
    b = cute_fp4.quantize(torch.randn(40, 192, generator=g), OPERAND_RECIPES[b_kind])
    d = cute_fp4.gemm(x, b, out_dtype=F32)
    assert d.shape == (8, 40)
    check_vs_float64(d, x.float(), ref.dequantize(b, F32))


def test_window64_gemm_folds_window_scales_into_factors():
    # window64 with a constant amax across windows equals per-tensor with the same amax
    x = torch.randn(16, 128)
    x[:, ::64] = 8.0  # every window has amax 8 = the tensor amax
    w = torch.randn(16, 128)
    w[:, ::64] = -4.0
    wt = cute_fp4.quantize(w, Recipe())
    d_win = cute_fp4.gemm(cute_fp4.quantize(x, Recipe(scaling="window64")), wt, out_dtype=F32)
    d_ten = cute_fp4.gemm(cute_fp4.quantize(x, Recipe()), wt, out_dtype=F32)
    assert (d_win - d_ten).abs().max() <= 1e-6 * d_ten.abs().max()


# ---------------------------------------------------------------------------------------------
# Training GEMMs through the columnwise twins: fprop x @ w^T, dgrad dy @ w, wgrad dy^T @ x
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [Recipe(columnwise=True),
                                    Recipe(scaling="token", columnwise=True),
                                    Recipe(rht=True, columnwise=True),
                                    Recipe(scaling="token", columnwise=True, swizzle=True)],
                         ids=["tensor", "token", "rht", "token-swizzled"])
def test_twin_gemms_vs_float64(recipe):
    g = torch.Generator().manual_seed(34)
    m, n, k = 64, 48, 128
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    dy = torch.randn(m, n, generator=g) * 0.01
    wq = cute_fp4.quantize(w, Recipe(block=(16, 16), columnwise=True) if not recipe.rht
                           and recipe.scaling == "tensor" else recipe)
    xq, dyq = cute_fp4.quantize(x, recipe), cute_fp4.quantize(dy, recipe)
    y = cute_fp4.gemm(xq, wq, out_dtype=F32)
    dx = cute_fp4.gemm(dyq, wq.t(), out_dtype=F32)
    dw = cute_fp4.gemm(dyq.t(), xq.t(), out_dtype=F32)
    assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (n, k)
    check_vs_float64(y, ref.dequantize(xq, F32), ref.dequantize(wq, F32))
    check_vs_float64(dx, ref.dequantize(dyq, F32), ref.dequantize(wq.t(), F32))
    check_vs_float64(dw, ref.dequantize(dyq.t(), F32), ref.dequantize(xq.t(), F32))
    # and the training products approximate the unquantized ones. With the RHT the twins are
    # rotated along their last dimension: wgrad contracts over M, where both twins carry the
    # same orthogonal rotation, so it is preserved; dgrad would need an unrotated w twin.
    if not recipe.rht:
        assert ref.snr_db(dy.double() @ w.double(), dx) > 12.0
    assert ref.snr_db(dy.double().t() @ x.double(), dw) > 12.0
    assert ref.snr_db(x.double() @ w.double().t(), y) > 12.0


def test_twin_dequantize_is_the_transpose_of_the_quantized_input():
    g = torch.Generator().manual_seed(35)
    x = torch.randn(32, 64, generator=g)
    t = cute_fp4.quantize(x, Recipe(scaling="token", columnwise=True))
    xt_hat = ref.dequantize(t.t(), F32)
    assert xt_hat.shape == (64, 32)
    direct = ref.dequantize(cute_fp4.quantize(x.t().contiguous(), Recipe(scaling="token")), F32)
    assert xt_hat.equal(direct)


def test_gemm_ignores_autocast():
    """The reference GEMM's block products stay FP32 under the caller's torch.autocast (which
    would run the matmuls in BF16), so the CPU fallback of cute_fp4.gemm gives the same bits."""
    g = torch.Generator().manual_seed(52)
    a = cute_fp4.quantize(torch.randn(32, 64, generator=g), Recipe())
    b = cute_fp4.quantize(torch.randn(48, 64, generator=g), Recipe())
    want = cute_fp4.gemm(a, b, out_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cute_fp4.gemm(a, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)
