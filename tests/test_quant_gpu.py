"""GPU quantize (amax kernels + K2 cast) vs the reference: byte equality of data, scales and
amax, for many shapes, distributions, dtypes, every output combination and both scale layouts.
Outputs are poisoned (0xFF) before the launch."""

import pytest
import torch

from cute_fp4 import NVFP4Tensor, Recipe, ref
from cute_fp4.quant import dispatch

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(16, 16), (32, 64), (48, 16), (128, 128), (112, 336), (256, 1040), (640, 2064),
          (1024, 4096), (4096, 1024)]
KINDS = ["normal", "outliers", "tiny", "huge", "special"]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    def alloc(nbytes, device):
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)
    monkeypatch.setattr(dispatch, "_alloc", alloc)


def make_input(shape, kind, dtype, gen):
    m, k = shape
    x = torch.randn(shape, generator=gen) * 2
    if kind == "outliers":
        x = x * torch.randn(shape, generator=gen).exp()  # heavy-tailed
        x[torch.rand(m, generator=gen) < 0.05] *= 1000.0            # outlier rows
        x[:, torch.rand(k, generator=gen) < 0.05] *= 300.0          # outlier columns
        x[:16, :16] = 0.0                                           # all-zero blocks
        x[-16:, -16:] = -0.0
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


def _u8(t):
    return t.view(torch.uint8)


def same_amax(a, b):
    """Bitwise equal, except that any NaN matches any NaN (torch's NaN payload on CUDA may
    differ from the canonical 0x7FC00000 the kernels write)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


def check(got, want, recipe):
    if recipe.rowwise:
        assert torch.equal(got.data, want.data), "rowwise data"
        assert torch.equal(_u8(got.scales), _u8(want.scales)), "rowwise scales"
        assert same_amax(got.amax, want.amax), "amax"
    else:
        assert got.data is None
    if recipe.columnwise:
        assert torch.equal(got.data_t, want.data_t), "columnwise data"
        assert torch.equal(_u8(got.scales_t), _u8(want.scales_t)), "columnwise scales"
        assert same_amax(got.amax_t, want.amax_t), "amax_t"
    else:
        assert got.data_t is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_quantize_bit_exact(shape, kind, dtype, scaling, gen):
    x = make_input(shape, kind, dtype, gen)
    for row, col in [(True, True), (True, False), (False, True)]:
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("shape", [(200, 48), (1, 16), (77, 4112)])
def test_rowwise_any_m(shape, gen):
    x = make_input(shape, "outliers", torch.bfloat16, gen)
    for scaling in ("tensor", "token"):
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


def test_columnwise_any_k(gen):
    x = make_input((64, 40), "normal", torch.bfloat16, gen)
    for swizzle in (False, True):
        recipe = Recipe(scaling="token", rowwise=False, columnwise=True, swizzle=swizzle)
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


def test_large(gen):
    x = make_input((8192, 8192), "outliers", torch.bfloat16, gen)
    recipe = Recipe(scaling="token", rowwise=True, columnwise=True, swizzle=True)
    check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


def test_bad_inputs():
    x = torch.randn(32, 24, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        dispatch.quantize(x, Recipe())
    with pytest.raises(ValueError, match="multiple of 16"):
        dispatch.quantize(torch.randn(24, 32, device="cuda"), Recipe(rowwise=False, columnwise=True))
    with pytest.raises(TypeError):
        dispatch.quantize(torch.randn(32, 32, device="cuda").to(torch.float64), Recipe())
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.quantize(torch.randn(32, 64, device="cuda").t(), Recipe())
    for opt in [dict(rht=True), dict(stochastic_rounding=True), dict(four_over_six="mae"),
                dict(scaling="window64")]:
        with pytest.raises(NotImplementedError, match=next(iter(opt))):
            dispatch.quantize(torch.randn(64, 64, device="cuda"), Recipe(**opt))


def reduced_reference(x, recipe, amax_reduce):
    """The reference quantization of a rank's shard when the amaxes that span M (the per-tensor
    amax, the per-token column amax) are replaced by amax_reduce's in-place result."""
    out = {}
    for name, mat, spans_m in (("", x, recipe.scaling == "tensor"), ("_t", x.t().contiguous(), True)):
        if not (recipe.rowwise if name == "" else recipe.columnwise):
            out.update({f"data{name}": None, f"scales{name}": None, f"amax{name}": None})
            continue
        outer = ref.outer_amax(mat, recipe.scaling)
        if spans_m:
            amax_reduce(outer)
        data, scales = ref.quantize_blocks(mat, ref.block_outer_amax(outer, recipe.scaling,
                                                                      mat.shape[0]))
        out.update({f"data{name}": data, f"amax{name}": outer,
                    f"scales{name}": ref.swizzle_scales(scales) if recipe.swizzle else scales})
    return NVFP4Tensor(**out, recipe=recipe, shape=tuple(x.shape), dtype=x.dtype)


@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_reduce(scaling, dtype, gen):
    """A cross-rank amax reduction stand-in that raises the amax (x3, or a fixed larger value):
    the outputs are the reference's with that amax; the per-row amaxes stay local."""
    x = make_input((256, 1040), "outliers", dtype, gen)
    big = float(x.float().abs().max()) * 3
    for amax_reduce in (lambda t: t.copy_(t * 3), lambda t: t.fill_(big)):
        for row, col in [(True, True), (True, False), (False, True)]:
            for swizzle in (False, True):
                recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=swizzle)
                got = dispatch.quantize(x, recipe, amax_reduce=amax_reduce)
                check(got, reduced_reference(x, recipe, amax_reduce), recipe)
                if scaling == "token" and row:
                    assert same_amax(got.amax, ref.amax_per_token(x)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_subnormal_blocks(dtype, gen):
    """Blocks made only of subnormal 16-bit values (the packed block amax keeps them)."""
    tiny = 1e-39 if dtype == torch.bfloat16 else 3e-6
    x = (torch.randn(64, 128, generator=gen) * tiny).to(dtype).cuda()
    assert bool((x != 0).any())
    for scaling in ("tensor", "token"):
        recipe = Recipe(scaling=scaling, rowwise=True, columnwise=True)
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)
