"""Helpers shared by the GPU quantize tests: input distributions and the byte-equality check
of an NVFP4Tensor against the reference's."""

import torch

from cute_fp4 import ref
from cute_fp4.ref.swizzle import swizzle_scales, swizzled_shape
from cute_fp4.tensor import FIELDS


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


def sign_input(guard, dtype, gen):
    """384x512 of `dtype` for the sign tests: 20% -0, two 16-element runs of a negative
    subnormal-sized value (a row piece, a column piece); huge: 3e38 (fp16: +inf) beside them;
    tiny: a row and a column scaled by 1e-33 with a zero block."""
    m, k = 384, 512
    x = torch.randn((m, k), generator=gen)
    x = x.sign() * x.abs().clamp_min(2.0 ** -10)  # no random value at -tiny (counted below)
    x[torch.rand((m, k), generator=gen) < 0.2] = -0.0
    tiny = torch.finfo(dtype).smallest_normal * 2.0 ** -3
    x[5, 32:48] = -tiny
    x[200:216, 70] = -tiny
    if guard == "huge":
        x[5, 40] = 3e38 if dtype == torch.bfloat16 else float("inf")
        x[200, 72] = x[5, 40]
    if guard == "tiny":
        x[77] *= 1e-33
        x[:, 300] *= 1e-33
        x[77, 0:16] = 0.0  # a zero block: scale byte 0, enc FLT_MAX
    x = x.to(dtype).cuda()
    assert (x.view(torch.int16) == -32768).float().mean() > 0.15  # -0 inputs
    assert (x == -tiny).sum() == 31 + int(guard != "huge")
    return x


def u8(t):
    return t.view(torch.uint8)


def same_amax(a, b):
    """Same shape and bitwise equal, except that any NaN matches any NaN (torch's NaN payload
    on CUDA may differ from the canonical 0x7FC00000 the kernels write)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    return a.shape == b.shape and bool(((a.view(torch.int32) == b.view(torch.int32))
                                        | both_nan).all())


def rht_exact_blocks(x):
    """[K, M / 16] bool: the twin blocks of x [M, K] whose 16 RHT outputs are exact in FP32
    (the float64 transform is representable). There the reference's butterflies round nothing
    and the tensor core's sum (exact products, one rounding) gives the same values, so the
    twin's codes and scale must be the reference's bytes; elsewhere the SPEC's RHT rule."""
    xt = x.t().double().cpu()
    matrix = ref.rht(torch.eye(16)).double()  # x @ matrix is the transform of a row block
    y = xt.reshape(-1, 16) @ matrix
    exact = torch.isfinite(y) & (y.float().double() == y)
    return exact.all(dim=1).view(xt.shape[0], xt.shape[1] // 16)


def check(got, want, recipe, twin_agree=None, twin_exact=None):
    """Byte equality of data, scales and amax for each output the recipe asks for; the others
    are absent. twin_agree (the RHT twin where its FP32 sums may round differently from the
    reference's butterflies, SPEC section 2): at least that fraction of the twin's codes and
    scale bytes equal instead of all of them, and all of them in the blocks where twin_exact
    (rht_exact_blocks) is true (its amax stays exact: the amax pass computes it with the
    reference's butterflies)."""
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
            same = (codes == wcodes).view(codes.shape[0], -1)
            same_sc = u8(scales) == u8(wscales)
            assert same.float().mean().item() >= twin_agree, "data_t"
            assert same_sc.float().mean().item() >= twin_agree, "scales_t"
            if twin_exact is not None:
                exact = twin_exact.to(same.device)
                assert bool(same[exact.repeat_interleave(16, 1)].all()), "data_t (exact blocks)"
                if recipe.swizzle:  # the padding entries are exact (zero)
                    rows, cols = exact.shape
                    pad = torch.ones(swizzled_shape(rows, cols), dtype=torch.bool,
                                     device=exact.device)
                    pad[:rows, :cols] = exact
                    exact = swizzle_scales(pad.view(torch.uint8)).view(torch.bool)
                assert bool(same_sc[exact].all()), "scales_t (exact blocks)"
            assert same_amax(amax, wamax), "amax_t"
            continue
        assert torch.equal(data, wdata), "data" + side
        assert torch.equal(u8(scales), u8(wscales)), "scales" + side
        assert same_amax(amax, wamax), "amax" + side
    assert got.shape == want.shape


def check_grouped_layout(got, want_groups):
    """got, a GroupedNVFP4Tensor: its groups are as many as want_groups (per-group results),
    each field of group g a contiguous view of got's flat field starting at
    got.offsets(name)[g], of want_groups[g]'s shape and dtype; the flat fields end at the last
    offsets."""
    assert len(got) == len(want_groups) == len(got.split_sizes)
    for name in FIELDS:
        flat = getattr(got, name)
        if flat is None:
            assert all(getattr(w, name) is None for w in want_groups)
            continue
        offs = got.offsets(name)
        assert flat.is_contiguous() and flat.shape[0] == offs[-1], name
        unit = flat.stride(0) * flat.element_size()  # bytes per unit of offsets
        for g, (t, w) in enumerate(zip(got, want_groups)):
            t, w = getattr(t, name), getattr(w, name)
            assert t.shape == w.shape and t.dtype == w.dtype and t.is_contiguous(), (name, g)
            assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            start = flat.storage_offset() * flat.element_size() + offs[g] * unit
            assert t.storage_offset() * t.element_size() == start, (name, g)
