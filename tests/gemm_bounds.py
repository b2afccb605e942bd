"""Helpers shared by the GPU GEMM tests: random NVFP4 operands (and window64 amaxes with their
reference block factors), their float64 values, the float64 expected result with its
magnitude, and the elementwise error bound (stated in each test module's docstring)."""

import torch

from cute_fp4.ref.formats import e2m1_decode, unpack_fp4

EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def rand_fp4(rows, k, gen, lo=-4.0, hi=2.0):
    """Random packed FP4 bytes and positive E4M3 scales 2**U(lo, hi) (CPU)."""
    data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    e = torch.rand(rows, k // 16, generator=gen) * (hi - lo) + lo
    return data, torch.exp2(e).to(torch.float8_e4m3fn)


def values64(data, scales):
    """The operand's values e2m1 * scale in float64 (scales: E4M3 or FP32 factors [rows, K/16])."""
    rows = data.shape[0]
    v = e2m1_decode(unpack_fp4(data)).to(torch.float64).view(rows, -1, 16)
    return (v * scales.to(torch.float64).unsqueeze(-1)).view(rows, -1)


def expected64(va, vb, alpha=None, row=None, col=None, bias=None):
    """(D, magnitude) in float64 for the float64 operand values va [M, K], vb [N, K]:
    D = alpha * row * col * va @ vb.T + bias, magnitude = |alpha row col| * |va| @ |vb|.T."""
    d = va @ vb.t()
    mag = va.abs() @ vb.abs().t()
    f = torch.ones_like(d)
    if alpha is not None:
        f = f * alpha.double().reshape(())
    if row is not None:
        f = f * row.double().view(-1, 1)
    if col is not None:
        f = f * col.double().view(1, -1)
    d, mag = d * f, mag * f.abs()
    if bias is not None:
        d = d + bias.double().view(1, -1)
    return d, mag


def check(out, d64, mag, k, out_dtype):
    """|out - D64| <= 2 eps(out) |D64| + K 2**-22 magnitude + tiny, elementwise, no NaN."""
    assert not torch.isnan(out).any()
    got = out.double().cpu()
    tol = 2 * EPS[out_dtype] * d64.abs() + k * 2.0**-22 * mag + 1e-30
    err = (got - d64).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outside the bound; worst "
                           f"err/tol {float((err / tol).max()):.3g}")


def window_amax(rows, k, gen, outliers=True):
    """FP32 window amax [rows, K/64]: 2**U(-3, 3) * 2688, with outlier windows (x 2**+-12) and
    all-zero windows (amax 0 -> S_dec 1) when asked."""
    amax = torch.exp2(torch.rand(rows, k // 64, generator=gen) * 6 - 3) * 2688.0
    if outliers:
        pick = torch.rand(rows, k // 64, generator=gen)
        amax = torch.where(pick < 0.05, amax * 2.0**12, amax)
        amax = torch.where((pick >= 0.05) & (pick < 0.10), amax * 2.0**-12, amax)
        amax = torch.where((pick >= 0.10) & (pick < 0.13), torch.zeros_like(amax), amax)
    return amax


def window_factors(scales, amax, e4m3_max):
    """The reference's per-block FP32 factors: scale * S_dec(window amax)."""
    from cute_fp4.ref.formats import decode_scale

    return scales.to(torch.float32) * decode_scale(amax, e4m3_max).repeat_interleave(4, dim=1)
