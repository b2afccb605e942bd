"""Helpers shared by the GPU quantize tests: input distributions and the byte-equality check
of an NVFP4Tensor against the reference's."""

import torch


def make_input(shape, kind, dtype, gen, window_outlier=False):
    """A CUDA input of `kind`: normal; outliers (heavy-tailed, outlier rows and columns,
    all-zero blocks, and with window_outlier one outlier in a 64-column window); tiny
    (subnormal); huge; special (+-Inf, NaN, a zero block)."""
    m, k = shape
    x = torch.randn(shape, generator=gen) * 2
    if kind == "outliers":
        x = x * torch.randn(shape, generator=gen).exp()  # heavy-tailed
        x[torch.rand(m, generator=gen) < 0.05] *= 1000.0            # outlier rows
        x[:, torch.rand(k, generator=gen) < 0.05] *= 300.0          # outlier columns
        x[:16, :16] = 0.0                                           # all-zero blocks
        x[-16:, -16:] = -0.0
        if window_outlier and k >= 64:
            x[m // 2, 3] = 5e4
    elif kind == "tiny":
        x = x * 1e-30
        x[0, :8] = torch.tensor([1e-45, -1e-45, 3e-40, -2e-39, 0.0, -0.0, 1e-38, -1e-38])
    elif kind == "huge":
        x = x * (1e30 if dtype == torch.float32 else 1e4)
    elif kind == "special":
        x[0, 1] = float("inf")
        x[m // 2, k // 2] = float("-inf")
        x[-1, -1] = float("nan")
        x[m // 3, :16] = 0.0
    return x.to(dtype).cuda()


def u8(t):
    return t.view(torch.uint8)


def same_amax(a, b):
    """Same shape and bitwise equal, except that any NaN matches any NaN (torch's NaN payload
    on CUDA may differ from the canonical 0x7FC00000 the kernels write)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    return a.shape == b.shape and bool(((a.view(torch.int32) == b.view(torch.int32))
                                        | both_nan).all())


def check(got, want, recipe, twin_agree=None):
    """Byte equality of data, scales and amax for each output the recipe asks for; the others
    are absent. twin_agree (the RHT twin where its FP32 sums may round differently from the
    reference's butterflies, SPEC section 2): at least that fraction of the twin's codes and
    scale bytes equal instead of all of them (its amax stays exact: the amax pass computes
    it with the reference's butterflies)."""
    for side in ("", "_t"):
        on = recipe.rowwise if side == "" else recipe.columnwise
        data, scales, amax = (getattr(got, n + side) for n in ("data", "scales", "amax"))
        if not on:
            assert data is None and scales is None and amax is None
            continue
        wdata, wscales, wamax = (getattr(want, n + side) for n in ("data", "scales", "amax"))
        if side == "_t" and twin_agree is not None:
            assert data.shape == wdata.shape and scales.shape == wscales.shape
            codes, wcodes = (torch.stack([d & 0xF, d >> 4], -1) for d in (data, wdata))
            assert (codes == wcodes).float().mean().item() >= twin_agree, "data_t"
            assert (u8(scales) == u8(wscales)).float().mean().item() >= twin_agree, "scales_t"
            assert same_amax(amax, wamax), "amax_t"
            continue
        assert torch.equal(data, wdata), "data" + side
        assert torch.equal(u8(scales), u8(wscales)), "scales" + side
        assert same_amax(amax, wamax), "amax" + side
    assert got.shape == want.shape
