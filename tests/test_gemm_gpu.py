"""GPU tests of the NVFP4 GEMM (cute_fp4.gemm.dispatch.gemm_nvfp4) against a float64
dequantize-and-matmul and against cute_fp4.ref.gemm.

Error bound. Every product a*b is exact (BF16 wgmma inputs hold e2m1 * e4m3 exactly); the
only differences are FP32 summation order/rounding inside the tensor cores and the final cast:
    |D - D64| <= 2 * eps(out) * |D64| + K * 2**-22 * |alpha row col| * sum_k |a_k b_k| + tiny
(eps(out) = 2**-8 bf16, 2**-11 fp16, 2**-24 fp32), checked elementwise.
"""

import itertools

import pytest
import torch

from cute_fp4 import ref
from cute_fp4.ref.formats import e2m1_decode, unpack_fp4
from cute_fp4.ref.swizzle import swizzle_scales

pytestmark = pytest.mark.gpu

EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def rand_operand(rows, k, gen, lo=-4.0, hi=2.0):
    """Random packed FP4 bytes and positive E4M3 scales 2**U(lo, hi) (CPU)."""
    data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    e = torch.rand(rows, k // 16, generator=gen) * (hi - lo) + lo
    scales = torch.exp2(e).to(torch.float8_e4m3fn)
    return data, scales


def values64(data, scales):
    rows = data.shape[0]
    v = e2m1_decode(unpack_fp4(data)).to(torch.float64).view(rows, -1, 16)
    return (v * scales.to(torch.float64).unsqueeze(-1)).view(rows, -1)


def expected(a, sa, b, sb, alpha, row, col, bias):
    va, vb = values64(a, sa), values64(b, sb)
    d = va @ vb.t()
    mag = va.abs() @ vb.abs().t()
    f = torch.ones_like(d)
    if alpha is not None:
        f = f * alpha.double().reshape(())
    if row is not None:
        f = f * row.double().view(-1, 1)
    if col is not None:
        f = f * col.double().view(1, -1)
    d = d * f
    mag = mag * f.abs()
    if bias is not None:
        d = d + bias.double().view(1, -1)
    return d, mag


def check(out, d64, mag, k, out_dtype):
    assert not torch.isnan(out).any()
    got = out.double().cpu()
    tol = 2 * EPS[out_dtype] * d64.abs() + k * 2.0**-22 * mag + 1e-30
    err = (got - d64).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outside the bound; worst "
                           f"err/tol {float((err / tol).max()):.3g}")


def run(a, sa, b, sb, *, alpha=None, row=None, col=None, bias=None,
        out_dtype=torch.bfloat16, swizzled=False, **kw):
    from cute_fp4.gemm.dispatch import gemm_nvfp4

    dev = "cuda"
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev)
    if swizzled:
        sa, sb = swizzle_scales(sa), swizzle_scales(sb)
    cu = lambda t: None if t is None else t.to(dev)  # noqa: E731
    res = gemm_nvfp4(a.to(dev), sa.to(dev), b.to(dev), sb.to(dev), alpha=cu(alpha),
                     row=cu(row), col=cu(col), bias=cu(bias), out_dtype=out_dtype,
                     scales_swizzled=swizzled, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return out


SHAPES = [(1, 256, 128), (200, 300, 512), (128, 256, 16), (130, 64, 4096), (257, 1000, 160),
          (77, 520, 176), (1024, 512, 1024), (300, 129, 8192)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_shapes_vs_float64(m, n, k, gen):
    a, sa = rand_operand(m, k, gen)
    b, sb = rand_operand(n, k, gen)
    out = run(a, sa, b, sb)
    d64, mag = expected(a, sa, b, sb, None, None, None, None)
    check(out, d64, mag, k, torch.bfloat16)


@pytest.mark.parametrize("tile_n", [128, 256])
def test_tile_configs(tile_n, gen):
    m, n, k = 384, 640, 1024
    a, sa = rand_operand(m, k, gen)
    b, sb = rand_operand(n, k, gen)
    out = run(a, sa, b, sb, tile_n=tile_n, out_dtype=torch.float32)
    d64, mag = expected(a, sa, b, sb, None, None, None, None)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=4)))
def test_epilogue(flags, out_dtype, gen):
    has_alpha, has_row, has_col, has_bias = flags
    m, n, k = 160, 272, 320
    a, sa = rand_operand(m, k, gen)
    b, sb = rand_operand(n, k, gen)
    alpha = torch.rand(1, generator=gen) * 0.5 + 0.25 if has_alpha else None
    row = torch.rand(m, generator=gen) + 0.5 if has_row else None
    col = torch.rand(n, generator=gen) + 0.5 if has_col else None
    bias = None
    if has_bias:
        bias_dtype = torch.float32 if out_dtype == torch.bfloat16 else out_dtype
        bias = (torch.randn(n, generator=gen) * 8).to(bias_dtype)
    out = run(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype)
    d64, mag = expected(a, sa, b, sb, alpha, row, col, bias)
    check(out, d64, mag, k, out_dtype)
    # the lead's torch reference (FP32, block order) agrees within the same bound
    r = ref.gemm(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype)
    check(r, d64, mag, k, out_dtype)


def test_full_scale_range(gen):
    """E4M3 scales over the whole positive range, subnormals included, FP32 output."""
    m, n, k = 256, 384, 2048
    a, sa = rand_operand(m, k, gen, lo=-9.0, hi=8.8)
    b, sb = rand_operand(n, k, gen, lo=-9.0, hi=8.8)
    out = run(a, sa, b, sb, out_dtype=torch.float32)
    d64, mag = expected(a, sa, b, sb, None, None, None, None)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("m,n,k", [(200, 300, 512), (1, 256, 128), (333, 520, 176)])
def test_swizzled_equals_compact(m, n, k, gen):
    a, sa = rand_operand(m, k, gen)
    b, sb = rand_operand(n, k, gen)
    c = run(a, sa, b, sb, out_dtype=torch.float32)
    s = run(a, sa, b, sb, out_dtype=torch.float32, swizzled=True)
    assert torch.equal(c, s)


def test_exact_small_sums(gen):
    """Integers small enough that FP32 sums are exact: the result must be bit-exact."""
    m, n, k = 192, 320, 256
    a, _ = rand_operand(m, k, gen)
    b, _ = rand_operand(n, k, gen)
    sa = torch.ones(m, k // 16).to(torch.float8_e4m3fn)
    sb = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    out = run(a, sa, b, sb, out_dtype=torch.float32)
    d64, _ = expected(a, sa, b, sb, None, None, None, None)
    assert torch.equal(out.double().cpu(), d64)
