"""Public API on CPU tensors (SPEC section 4): Recipe validation, argument errors of quantize /
dequantize / gemm / quantize_grouped, 3D inputs, NVFP4Tensor.t(), and agreement with the
references."""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import cute_fp4
from cute_fp4 import GroupedNVFP4Tensor, NVFP4Tensor, Recipe, ref
from cute_fp4.grouped import group_lengths
from cute_fp4.tensor import FIELDS
from quant_checks import check_grouped_layout

from test_ref_quantize import BLOCK_A, BYTES_A, u8

F32 = torch.float32


# ---------------------------------------------------------------------------------------------
# Recipe
# ---------------------------------------------------------------------------------------------

RECIPE_ERRORS = [
    (dict(scaling="row"), r"Recipe\.scaling must be one of"),
    (dict(scaling="Tensor"), r"Recipe\.scaling must be one of"),
    (dict(block=(1, 32)), r"Recipe\.block must be one of"),
    (dict(block=(16, 1)), r"Recipe\.block must be one of"),
    (dict(block=(32, 32)), r"Recipe\.block must be one of"),
    (dict(four_over_six="l1"), r"Recipe\.four_over_six must be one of"),
    (dict(four_over_six="MAE"), r"Recipe\.four_over_six must be one of"),
    (dict(e4m3_max=300), r"Recipe\.e4m3_max must be 448 or 256"),
    (dict(e4m3_max=300, four_over_six="mse"), r"Recipe\.e4m3_max must be 448 or 256"),
    (dict(e4m3_max=256), r"e4m3_max=256 is only defined with four_over_six"),
    (dict(fast_math=True), r"fast_math selects the 4over6 error path"),
    (dict(rowwise=False, columnwise=False), r"rowwise=True or columnwise=True"),
    (dict(block=(16, 16), scaling="token"), r"block=\(16, 16\) needs scaling='tensor'"),
    (dict(block=(16, 16), scaling="window64"), r"block=\(16, 16\) needs scaling='tensor'"),
    (dict(rht=True, block=(16, 16)), r"rht applies to 1x16 blocks only"),
    (dict(stochastic_rounding=True, four_over_six="mae"), r"cannot be combined with four_over_six"),
]


@pytest.mark.parametrize("kwargs,match", RECIPE_ERRORS, ids=[m for _, m in RECIPE_ERRORS])
def test_recipe_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**kwargs)


VALID_RECIPES = [
    dict(), dict(scaling="token"), dict(scaling="window64"), dict(block=(16, 16)),
    dict(block=[16, 16]), dict(rht=True, columnwise=True), dict(stochastic_rounding=True),
    dict(four_over_six="mae"), dict(four_over_six="mse", e4m3_max=256, fast_math=True),
    dict(four_over_six="mse", block=(16, 16)), dict(rowwise=False, columnwise=True),
    dict(swizzle=True, scaling="token", rht=True, stochastic_rounding=True, columnwise=True),
]


@pytest.mark.parametrize("kwargs", VALID_RECIPES)
def test_recipe_valid(kwargs):
    r = Recipe(**kwargs)
    assert isinstance(r.block, tuple) and r.block_rows == r.block[0]
    assert r == Recipe(**kwargs) and hash(r) == hash(Recipe(**kwargs))


def test_recipe_defaults_frozen_and_replace():
    r = Recipe()
    assert (r.scaling, r.block, r.rht, r.stochastic_rounding, r.four_over_six, r.e4m3_max,
            r.fast_math, r.rowwise, r.columnwise, r.swizzle) == (
        "tensor", (1, 16), False, False, None, 448, False, True, False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.scaling = "token"
    r2 = r.replace(scaling="token", columnwise=True)
    assert r2.scaling == "token" and r2.columnwise and r.scaling == "tensor"
    with pytest.raises(ValueError, match="needs scaling='tensor'"):
        r2.replace(block=(16, 16))


# ---------------------------------------------------------------------------------------------
# quantize argument errors
# ---------------------------------------------------------------------------------------------

QUANTIZE_ERRORS = [
    (lambda: [[1.0] * 16], Recipe(), TypeError, r"x must be a torch\.Tensor, got list"),
    (lambda: torch.zeros(4, 16), {"scaling": "tensor"}, TypeError,
     r"recipe must be a cute_fp4\.Recipe, got dict"),
    (lambda: torch.zeros(4, 16, dtype=torch.float64), Recipe(), TypeError,
     r"x must be float32, bfloat16 or float16, got torch\.float64"),
    (lambda: torch.zeros(4, 16, dtype=torch.int32), Recipe(), TypeError,
     r"float32, bfloat16 or float16, got torch\.int32"),
    (lambda: torch.zeros(4, 16).to(torch.float8_e4m3fn), Recipe(), TypeError,
     r"float32, bfloat16 or float16"),
    (lambda: torch.zeros(32), Recipe(), ValueError, r"at least 2 dimensions, got shape \(32,\)"),
    (lambda: torch.zeros(4, 24), Recipe(), ValueError,
     r"last dimension \(24\) must be a multiple of 16 for rowwise 'tensor'"),
    (lambda: torch.zeros(4, 96), Recipe(scaling="window64"), ValueError,
     r"last dimension \(96\) must be a multiple of 64 for rowwise 'window64'"),
    (lambda: torch.zeros(24, 16), Recipe(columnwise=True), ValueError,
     r"flattened leading dimensions \(24\) must be a multiple of 16 for the columnwise"),
    (lambda: torch.zeros(2, 12, 16), Recipe(columnwise=True), ValueError,
     r"flattened leading dimensions \(24\) must be a multiple of 16"),
    (lambda: torch.zeros(32, 64), Recipe(scaling="window64", columnwise=True), ValueError,
     r"flattened leading dimensions \(32\) must be a multiple of 64 for the columnwise "
     r"'window64' twin"),
    (lambda: torch.zeros(16, 64).t(), Recipe(), ValueError, r"x must be contiguous"),
    (lambda: torch.zeros(16, 64)[:, ::2], Recipe(), ValueError, r"x must be contiguous"),
]


@pytest.mark.parametrize("make,recipe,exc,match", QUANTIZE_ERRORS,
                         ids=[m[:40] for *_, m in QUANTIZE_ERRORS])
def test_quantize_argument_errors(make, recipe, exc, match):
    with pytest.raises(exc, match=match):
        cute_fp4.quantize(make(), recipe)


def test_quantize_columnwise_only_does_not_need_k_multiple_of_16():
    t = cute_fp4.quantize(torch.randn(16, 8), Recipe(rowwise=False, columnwise=True))
    assert t.data is None and t.data_t.shape == (8, 8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=-1), r"seed must be in \[0, 2\*\*64\)"),
    (dict(seed=2**64), r"seed must be in \[0, 2\*\*64\)"),
    (dict(offset=2**32), r"offset must be in \[0, 2\*\*32\)"),
    (dict(offset=-5), r"offset must be in \[0, 2\*\*32\)"),
    (dict(rng_state=torch.tensor([1, 2], dtype=torch.int32)), r"rng_state must be an int64 tensor of shape"),
    (dict(rng_state=torch.tensor([1, 2, 3])), r"rng_state must be an int64 tensor of shape"),
])
def test_quantize_sr_seed_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cute_fp4.quantize(torch.randn(16, 32), Recipe(stochastic_rounding=True), **kwargs)


def test_quantize_rng_state_equals_seed_offset():
    x = torch.randn(32, 64)
    r = Recipe(stochastic_rounding=True, columnwise=True)
    a = cute_fp4.quantize(x, r, rng_state=torch.tensor([77, 5]))
    b = cute_fp4.quantize(x, r, seed=77, offset=5)
    assert a.data.equal(b.data) and a.data_t.equal(b.data_t)


def _fill(t: NVFP4Tensor, byte: int):
    for name in FIELDS:
        f = getattr(t, name)
        if f is not None:
            f.view(torch.uint8).fill_(byte)


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(scaling="token", columnwise=True),
                                    Recipe(rowwise=False, columnwise=True, swizzle=True),
                                    Recipe(rht=True, stochastic_rounding=True, columnwise=True),
                                    Recipe(scaling="window64", columnwise=True)])
def test_quantize_out_writes_in_place(recipe):
    """out= returns the very NVFP4Tensor it was given, its field tensors (poisoned first)
    holding the bytes of a fresh quantize of the new input."""
    x = torch.randn(64, 128) * torch.logspace(-2, 2, 128)
    want = cute_fp4.quantize(x, recipe, seed=9)
    out = cute_fp4.quantize(torch.randn(64, 128), recipe, seed=9)
    before = {n: getattr(out, n) for n in FIELDS}
    _fill(out, 0xFF)
    got = cute_fp4.quantize(x, recipe, seed=9, out=out)
    assert got is out
    for n in FIELDS:
        assert getattr(out, n) is before[n]
        w, g = getattr(want, n), getattr(out, n)
        assert (w is None) == (g is None), n
        if w is not None:
            assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), n
    t, sums = cute_fp4.quantize_dbias(x, recipe, seed=9, out=out)
    assert t is out and torch.allclose(sums, x.sum(0))


def test_quantize_out_torch_compile():
    """out= inside torch.compile(fullgraph=True): the custom op's outputs are copied into out."""
    r = Recipe(scaling="token", columnwise=True)
    x = torch.randn(64, 128)
    out = cute_fp4.quantize(torch.randn(64, 128), r)
    _fill(out, 0xFF)

    def step(x, out):
        cute_fp4.quantize(x * 2, r, out=out)
        return out.data.float().sum()

    torch.compile(step, fullgraph=True, backend="aot_eager")(x, out)
    want = cute_fp4.quantize(x * 2, r)
    for n in FIELDS:
        assert torch.equal(getattr(want, n).view(torch.uint8), getattr(out, n).view(torch.uint8))


def test_quantize_out_rechecked_after_changes():
    """The accepted out is remembered (a hit skips the field checks); any change to it is seen:
    a field replaced, a field's storage swapped in place, another recipe object, another
    input shape."""
    r = Recipe(columnwise=True)
    x = torch.randn(32, 64)
    out = cute_fp4.quantize(x, r)
    assert cute_fp4.quantize(x, r, out=out) is out
    assert cute_fp4.quantize(x, r, out=out) is out
    data = out.data
    out.data = torch.zeros(32, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out.data must be"):
        cute_fp4.quantize(x, r, out=out)
    out.data = data
    cute_fp4.quantize(x, r, out=out)
    out.scales_t.set_(torch.zeros(3, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"out.scales_t must be"):
        cute_fp4.quantize(x, r, out=out)
    out = cute_fp4.quantize(x, r)
    cute_fp4.quantize(x, r, out=out)
    with pytest.raises(ValueError, match=r"another recipe"):
        cute_fp4.quantize(x, Recipe(columnwise=True, swizzle=True), out=out)
    with pytest.raises(ValueError, match=r"same shape and dtype"):
        cute_fp4.quantize(x.view(2, 16, 64), r, out=out)


def _out_with(**fields):
    t = cute_fp4.quantize(torch.randn(32, 64), Recipe(columnwise=True))
    return dataclasses.replace(t, **fields)


OUT_ERRORS = [
    (lambda: torch.zeros(32, 64), TypeError, r"out must be an NVFP4Tensor, got Tensor"),
    (lambda: cute_fp4.quantize(torch.randn(32, 64), Recipe()), ValueError,
     r"out was quantized with another recipe"),
    (lambda: cute_fp4.quantize(torch.randn(32, 128), Recipe(columnwise=True)), ValueError,
     r"out must come from a quantize of the same shape and dtype"),
    (lambda: cute_fp4.quantize(torch.randn(32, 64, dtype=torch.bfloat16), Recipe(columnwise=True)),
     ValueError, r"same shape and dtype"),
    (lambda: _out_with(data=torch.zeros(32, 64, dtype=torch.uint8)[:, :32]), ValueError,
     r"out.data must be a contiguous torch.uint8 tensor of shape \(32, 32\) on cpu"),
    (lambda: _out_with(scales_t=torch.zeros(64, 2, dtype=torch.uint8)), ValueError,
     r"out.scales_t must be a contiguous torch.float8_e4m3fn tensor of shape \(64, 2\)"),
    (lambda: _out_with(amax_t=None), ValueError,
     r"out.amax_t must be a contiguous torch.float32 tensor of shape \(1,\)"),
    (lambda: _out_with(amax=torch.zeros(2)), ValueError, r"out.amax must be a contiguous"),
    (lambda: _out_with(data=torch.zeros(32, 32, dtype=torch.uint8, device="meta")),
     ValueError, r"out.data must be .* on cpu"),
]


@pytest.mark.parametrize("make,exc,match", OUT_ERRORS, ids=[m[:40] for *_, m in OUT_ERRORS])
def test_quantize_out_errors(make, exc, match):
    out = make()
    with pytest.raises(exc, match=match):
        cute_fp4.quantize(torch.randn(32, 64), Recipe(columnwise=True), out=out)


# ---------------------------------------------------------------------------------------------
# API == reference on CPU
# ---------------------------------------------------------------------------------------------

API_RECIPES = [Recipe(), Recipe(scaling="token", columnwise=True),
               Recipe(scaling="window64", swizzle=True, columnwise=True),
               Recipe(block=(16, 16), columnwise=True, four_over_six="mse"),
               Recipe(rht=True, stochastic_rounding=True, columnwise=True),
               Recipe(four_over_six="mae", e4m3_max=256, fast_math=True)]


@pytest.mark.parametrize("recipe", API_RECIPES, ids=range(len(API_RECIPES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_api_quantize_equals_reference(recipe, dtype):
    g = torch.Generator().manual_seed(50)
    x = (torch.randn(64, 128, generator=g) * 3).to(dtype)
    a = cute_fp4.quantize(x, recipe, seed=9, offset=3)
    b = ref.quantize(x, recipe, seed=9, offset=3)
    for f in ("data", "data_t", "amax", "amax_t"):
        fa, fb = getattr(a, f), getattr(b, f)
        assert (fa is None and fb is None) or fa.equal(fb), f
    for f in ("scales", "scales_t"):
        fa, fb = getattr(a, f), getattr(b, f)
        assert (fa is None and fb is None) or u8(fa) == u8(fb), f
    assert a.recipe == recipe and a.shape == (64, 128) and a.dtype == dtype
    assert cute_fp4.dequantize(a, F32).equal(ref.dequantize(b, F32))


def test_api_quantize_hand_block():
    t = cute_fp4.quantize(torch.tensor([BLOCK_A]))
    assert t.data.tolist() == [BYTES_A] and u8(t.scales) == [[0x7E]] and t.amax.tolist() == [6.0]


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------

def test_dequantize_argument_errors():
    t = cute_fp4.quantize(torch.randn(16, 32))
    with pytest.raises(TypeError, match="dequantize expects an NVFP4Tensor, got Tensor"):
        cute_fp4.dequantize(torch.zeros(16, 32))
    with pytest.raises(TypeError, match=r"dtype must be float32, bfloat16 or float16, got "
                                        r"torch\.float64"):
        cute_fp4.dequantize(t, torch.float64)
    col = cute_fp4.quantize(torch.randn(16, 32), Recipe(rowwise=False, columnwise=True))
    with pytest.raises(ValueError, match=r"no rowwise data; use dequantize\(t\.t\(\)\)"):
        cute_fp4.dequantize(col)
    with pytest.raises(ValueError, match="no rowwise data"):
        col.dequantize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_default_dtypes(dtype):
    x = torch.randn(16, 64).to(dtype)
    t = cute_fp4.quantize(x)
    assert cute_fp4.dequantize(t).dtype == torch.bfloat16  # the API default
    assert t.dequantize().dtype == dtype  # the method returns the input dtype
    assert t.dequantize().equal(cute_fp4.dequantize(t, dtype))


def test_dequantize_empty_api():
    t = cute_fp4.quantize(torch.zeros(0, 64))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = cute_fp4.dequantize(t, dtype)
        assert out.shape == (0, 64) and out.dtype == dtype


def test_dequantize_out():
    """out= (eager, the method, and inside torch.compile): written, returned, equal to the
    allocating call; a wrong type, dtype, shape or layout raises naming the rule."""
    x = torch.randn(2, 16, 64)
    t = cute_fp4.quantize(x, Recipe(scaling="token"))
    want = cute_fp4.dequantize(t, F32)
    out = torch.full((2, 16, 64), float("nan"))
    assert cute_fp4.dequantize(t, F32, out=out) is out and out.equal(want)
    out16 = torch.full((2, 16, 64), float("nan"), dtype=torch.bfloat16)
    assert t.dequantize(torch.bfloat16, out=out16) is out16
    assert out16.equal(cute_fp4.dequantize(t, torch.bfloat16))
    out.fill_(float("nan"))
    torch.compile(lambda t, o: cute_fp4.dequantize(t, F32, out=o), fullgraph=True,
                  backend="aot_eager")(t, out)
    assert out.equal(want)
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got list"):
        cute_fp4.dequantize(t, F32, out=[])
    with pytest.raises(ValueError, match=r"out must be a torch.float32 tensor of shape "
                                         r"\(2, 16, 64\) on cpu, got torch.bfloat16"):
        cute_fp4.dequantize(t, F32, out=out16)
    with pytest.raises(ValueError, match=r"shape \(2, 16, 64\) on cpu, got torch.float32 "
                                         r"\(32, 64\)"):
        cute_fp4.dequantize(t, F32, out=torch.empty(32, 64))
    with pytest.raises(ValueError, match="out must be contiguous"):
        cute_fp4.dequantize(t, F32, out=torch.empty(2, 64, 16).transpose(1, 2))


# ---------------------------------------------------------------------------------------------
# 3D inputs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [Recipe(columnwise=True), Recipe(scaling="token", swizzle=True),
                                    Recipe(scaling="window64")], ids=["tensor", "token", "w64"])
def test_3d_quantize_dequantize(recipe):
    g = torch.Generator().manual_seed(51)
    x = torch.randn(2, 32, 128, generator=g)
    t = cute_fp4.quantize(x, recipe)
    flat = cute_fp4.quantize(x.view(64, 128), recipe)
    assert t.shape == (2, 32, 128) and t.rows == 64 and t.cols == 128
    assert t.data.shape == (64, 64) and t.data.equal(flat.data)
    assert u8(t.scales) == u8(flat.scales)
    out = cute_fp4.dequantize(t, F32)
    assert out.shape == (2, 32, 128)
    assert out.view(64, 128).equal(cute_fp4.dequantize(flat, F32))
    if recipe.columnwise:
        assert t.data_t.shape == (128, 32)
        assert t.t().shape == (128, 64)


def test_3d_gemm_nvfp4_and_w4a16():
    g = torch.Generator().manual_seed(52)
    x = torch.randn(3, 16, 64, generator=g)
    w = cute_fp4.quantize(torch.randn(24, 64, generator=g))
    xq = cute_fp4.quantize(x, Recipe(scaling="token"))
    d = cute_fp4.gemm(xq, w, out_dtype=F32)
    assert d.shape == (3, 16, 24)
    d2 = cute_fp4.gemm(cute_fp4.quantize(x.view(48, 64), Recipe(scaling="token")), w,
                       out_dtype=F32)
    assert d.view(48, 24).equal(d2)
    xb = x.to(torch.bfloat16)
    d3 = cute_fp4.gemm(xb, w, out_dtype=torch.bfloat16)
    assert d3.shape == (3, 16, 24) and d3.dtype == torch.bfloat16
    assert d3.view(48, 24).equal(cute_fp4.gemm(xb.view(48, 64), w, out_dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# NVFP4Tensor.t()
# ---------------------------------------------------------------------------------------------

def test_nvfp4tensor_t_swaps_everything():
    g = torch.Generator().manual_seed(53)
    x = torch.randn(32, 48, generator=g)
    t = cute_fp4.quantize(x, Recipe(scaling="token", columnwise=True))
    tt = t.t()
    assert isinstance(tt, NVFP4Tensor)
    assert tt.shape == (48, 32) and tt.rows == 48 and tt.cols == 32
    assert tt.data is t.data_t and tt.scales is t.scales_t and tt.amax is t.amax_t
    assert tt.data_t is t.data and tt.scales_t is t.scales and tt.amax_t is t.amax
    assert tt.recipe.rowwise and tt.recipe.columnwise and tt.dtype == t.dtype
    back = tt.t()
    assert back.shape == t.shape and back.data is t.data and back.recipe == t.recipe
    # the twin dequantizes to (an approximation of) x^T, quantized from x, not from the FP4 data
    xt_hat = cute_fp4.dequantize(tt, F32)
    assert xt_hat.shape == (48, 32)
    assert ref.snr_db(x.t(), xt_hat) > 15.0
    assert xt_hat.equal(cute_fp4.dequantize(cute_fp4.quantize(x.t().contiguous(),
                                                              Recipe(scaling="token")), F32))


def test_nvfp4tensor_t_of_one_sided_tensors():
    x = torch.randn(16, 32)
    row_only = cute_fp4.quantize(x, Recipe())
    t = row_only.t()
    assert t.data is None and t.recipe.rowwise is False and t.recipe.columnwise is True
    with pytest.raises(ValueError, match="no rowwise data"):
        cute_fp4.dequantize(t)
    col_only = cute_fp4.quantize(x, Recipe(rowwise=False, columnwise=True))
    assert col_only.t().data is col_only.data_t
    assert col_only.t().recipe.rowwise and not col_only.t().recipe.columnwise
    assert col_only.device == torch.device("cpu") and t.device == torch.device("cpu")


def test_nvfp4tensor_t_of_3d():
    x = torch.randn(2, 16, 32)
    t = cute_fp4.quantize(x, Recipe(columnwise=True))
    assert t.t().shape == (32, 32) and t.t().t().shape == (32, 32)  # the 2D [M, K] view


# ---------------------------------------------------------------------------------------------
# gemm argument errors
# ---------------------------------------------------------------------------------------------

def _ops():
    a = cute_fp4.quantize(torch.randn(16, 64))
    b = cute_fp4.quantize(torch.randn(8, 64))
    return a, b


GEMM_ERRORS = [
    (lambda a, b: cute_fp4.gemm(a, torch.zeros(8, 64)), TypeError,
     r"b must be an NVFP4Tensor, got Tensor"),
    (lambda a, b: cute_fp4.gemm(a, b, out_dtype=torch.float64), TypeError,
     r"out_dtype must be float32, bfloat16 or float16, got torch\.float64"),
    (lambda a, b: cute_fp4.gemm(a, b, bias=torch.zeros(9)), ValueError,
     r"bias must be 1D of length N=8, got shape \(9,\)"),
    (lambda a, b: cute_fp4.gemm(a, b, bias=torch.zeros(1, 8)), ValueError,
     r"bias must be 1D of length N=8, got shape \(1, 8\)"),
    (lambda a, b: cute_fp4.gemm(cute_fp4.quantize(torch.randn(16, 32)), b), ValueError,
     r"K mismatch: a is \[16, 32\], b is \[8, 64\]"),
    (lambda a, b: cute_fp4.gemm(torch.zeros(4, 64), b), TypeError,
     r"a dense activation must be bfloat16 or float16, got torch\.float32"),
    (lambda a, b: cute_fp4.gemm(torch.zeros(4, 32, dtype=torch.bfloat16), b), ValueError,
     r"K mismatch: a has last dimension 32, b has K=64"),
    (lambda a, b: cute_fp4.gemm(torch.zeros(64, 4, dtype=torch.bfloat16).t(), b), ValueError,
     r"a must be contiguous"),
    (lambda a, b: cute_fp4.gemm([[0.0] * 64], b), TypeError,
     r"a must be an NVFP4Tensor or a torch\.Tensor, got list"),
    (lambda a, b: cute_fp4.gemm(a, cute_fp4.quantize(torch.randn(16, 64),
                                                     Recipe(rowwise=False, columnwise=True))),
     ValueError, r"b has no rowwise data: quantize it with rowwise=True, or pass b\.t\(\)"),
    (lambda a, b: cute_fp4.gemm(cute_fp4.quantize(torch.randn(16, 64),
                                                  Recipe(rowwise=False, columnwise=True)), b),
     ValueError, r"a has no rowwise data"),
    (lambda a, b: cute_fp4.gemm(a, a.t()), ValueError, r"b has no rowwise data"),
]


@pytest.mark.parametrize("call,exc,match", GEMM_ERRORS, ids=[m[:40] for *_, m in GEMM_ERRORS])
def test_gemm_argument_errors(call, exc, match):
    a, b = _ops()
    with pytest.raises(exc, match=match):
        call(a, b)


def test_gemm_output_dtypes_and_shapes():
    a, b = _ops()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        d = cute_fp4.gemm(a, b, out_dtype=dtype)
        assert d.shape == (16, 8) and d.dtype == dtype
    assert cute_fp4.gemm(a, b).dtype == torch.bfloat16  # the default


def test_gemm_mixed_swizzle_layouts_agree():
    g = torch.Generator().manual_seed(54)
    x, w = torch.randn(16, 64, generator=g), torch.randn(8, 64, generator=g)
    outs = [cute_fp4.gemm(cute_fp4.quantize(x, Recipe(swizzle=sa)),
                          cute_fp4.quantize(w, Recipe(swizzle=sb)), out_dtype=F32)
            for sa in (False, True) for sb in (False, True)]
    assert all(o.equal(outs[0]) for o in outs[1:])


# ---------------------------------------------------------------------------------------------
# quantize_grouped
# ---------------------------------------------------------------------------------------------

def test_quantize_grouped_equals_per_group():
    g = torch.Generator().manual_seed(55)
    x = torch.randn(80, 64, generator=g) * torch.tensor([1.0] * 16 + [100.0] * 64)[:, None]
    parts = cute_fp4.quantize_grouped(x, [16, 0, 64], Recipe(columnwise=True))
    assert len(parts) == 3
    assert parts[1].data.shape == (0, 32) and parts[1].amax.tolist() == [0.0]
    for p, (lo, hi) in zip(parts, [(0, 16), (16, 16), (16, 80)]):
        q = cute_fp4.quantize(x[lo:hi].contiguous(), Recipe(columnwise=True))
        assert p.data.equal(q.data) and u8(p.scales) == u8(q.scales) and p.amax.equal(q.amax)
        assert p.data_t.equal(q.data_t)
    assert parts[0].amax.item() < 10 and parts[2].amax.item() > 100


@pytest.mark.parametrize("recipe", [
    Recipe(columnwise=True), Recipe(scaling="token", columnwise=True, swizzle=True),
    Recipe(scaling="window64", columnwise=True), Recipe(rowwise=False, columnwise=True,
                                                        swizzle=True),
    Recipe(scaling="token", swizzle=True),
])
def test_grouped_tensor_layout(recipe):
    """quantize_grouped's GroupedNVFP4Tensor: each group equals the per-group reference and is
    a view of the flat fields at offsets(); the flat fields hold the groups' fields back to
    back (group_lengths elements each, padded swizzled scales included)."""
    sizes, k = [64, 0, 128, 192], 192
    gen = torch.Generator().manual_seed(50)
    x = torch.cat([torch.randn(mg, k, generator=gen) * 4.0 ** g for g, mg in enumerate(sizes)])
    got = cute_fp4.quantize_grouped(x, sizes, recipe)
    want = ref.quantize_grouped(x, sizes, recipe)
    assert isinstance(got, GroupedNVFP4Tensor) and got.split_sizes == tuple(sizes)
    check_grouped_layout(got, want)
    for g, (t, w) in enumerate(zip(got, want)):
        lengths = group_lengths(sizes[g], k, recipe)
        for name, n in zip(FIELDS, lengths):
            a, b = getattr(t, name), getattr(w, name)
            if b is not None:
                assert a.numel() == b.numel() == n, (name, g)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, g)
    assert got[-1] is got.groups()[3] and got[1:3] == got.groups()[1:3]
    assert list(got) == got.groups() and len(got) == 4


def test_grouped_tensor_dequantize_and_to():
    """GroupedNVFP4Tensor.dequantize: every group's rowwise data one after another, equal to
    each group's dequantize; .to moves every present flat field (its groups follow)."""
    r = Recipe(scaling="token", columnwise=True, swizzle=True)
    x = torch.randn(112, 64, generator=torch.Generator().manual_seed(4))
    sizes = [48, 0, 64]
    got = cute_fp4.quantize_grouped(x, sizes, r)
    deq = got.dequantize()
    assert deq.shape == (112, 64) and deq.dtype == torch.float32
    want = torch.cat([cute_fp4.dequantize(t, torch.float32) for t in got])
    assert torch.equal(deq, want) and torch.equal(got.dequantize(torch.bfloat16),
                                                   want.to(torch.bfloat16))
    assert (deq - x).abs().max() < 0.25 * x.abs().max()
    meta = got.to("meta")
    assert all(getattr(meta, f).device.type == "meta" for f in FIELDS)
    assert meta[2].scales_t.device.type == "meta" and meta.split_sizes == got.split_sizes
    with pytest.raises(ValueError, match="no rowwise data"):
        cute_fp4.quantize_grouped(x, sizes, r.replace(rowwise=False)).dequantize()


def test_quantize_grouped_no_rows():
    """No groups, or only empty ones: empty flat fields of the recipe's dtypes, one (empty)
    NVFP4Tensor per group."""
    r = Recipe(scaling="token", columnwise=True, swizzle=True)
    x = torch.zeros(0, 64)
    none = cute_fp4.quantize_grouped(x, [], r)
    assert len(none) == 0 and list(none) == [] and none.offsets("data") == [0]
    two = cute_fp4.quantize_grouped(x, [0, 0], r)
    assert len(two) == 2 and two[1].data.shape == (0, 32) and two[1].scales.shape == (0, 4)
    for g in (none, two):
        assert g.data.shape == (0, 32) and g.scales.shape == (0, 4)
        assert g.data.dtype == torch.uint8 and g.scales.dtype == torch.float8_e4m3fn
        assert g.amax_t.dtype == torch.float32 and g.amax_t.numel() == 64 * len(g)


@pytest.mark.parametrize("recipe", [Recipe(columnwise=True, swizzle=True),
                                    Recipe(scaling="token", stochastic_rounding=True,
                                           columnwise=True)])
def test_quantize_grouped_torch_compile(recipe):
    """quantize_grouped inside torch.compile(fullgraph=True) is the custom op
    cute_fp4::quantize_grouped: its flat fields equal eager's bytes (the fake gives their
    shapes and dtypes), its groups too, indexed inside and outside the compiled function."""
    x = torch.randn(112, 64, generator=torch.Generator().manual_seed(9))
    sizes = [32, 0, 80]

    def step(x):
        g = cute_fp4.quantize_grouped(x, sizes, recipe, seed=3, offset=4)
        return g, g[2].data.float().sum()

    backend = CompileCounterWithBackend("aot_eager")
    got, total = torch.compile(step, fullgraph=True, backend=backend)(x)
    assert "cute_fp4.quantize_grouped" in str(backend.graphs[0].graph)
    want = cute_fp4.quantize_grouped(x, sizes, recipe, seed=3, offset=4)
    assert isinstance(got, GroupedNVFP4Tensor) and got.split_sizes == tuple(sizes)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    check_grouped_layout(got, list(want))
    assert total.item() == want[2].data.float().sum().item()


def test_quantize_grouped_rng_state():
    """rng_state (int64 [seed, offset] on the CPU) replaces seed / offset; each group draws its
    own Philox streams, so two equal groups round differently."""
    part = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    x = torch.cat([part, part])
    r = Recipe(stochastic_rounding=True, columnwise=True)
    got = cute_fp4.quantize_grouped(x, [32, 32], r, rng_state=torch.tensor([5, 2**32 + 6]))
    want = cute_fp4.quantize_grouped(x, [32, 32], r, seed=5, offset=6)
    for g, w in zip(got, want):
        assert g.data.equal(w.data) and g.data_t.equal(w.data_t)
    assert not got[0].data.equal(got[1].data) and not got[0].data_t.equal(got[1].data_t)
    with pytest.raises(ValueError, match=r"rng_state must be an int64 tensor of shape"):
        cute_fp4.quantize_grouped(x, [32, 32], r, rng_state=torch.tensor([1, 2, 3]))


def test_quantize_grouped_tensor_sizes():
    """split_sizes as a 1D integer tensor equals the same ints."""
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(8))
    r = Recipe(columnwise=True)
    got = cute_fp4.quantize_grouped(x, torch.tensor([32, 0, 64], dtype=torch.int32), r)
    want = cute_fp4.quantize_grouped(x, [32, 0, 64], r)
    assert got.split_sizes == (32, 0, 64) and all(type(v) is int for v in got.split_sizes)
    assert torch.equal(got.data, want.data) and torch.equal(got.data_t, want.data_t)
    with pytest.raises(ValueError, match="1D integer tensor"):
        cute_fp4.quantize_grouped(x, torch.tensor([32.0, 64.0]), r)


@pytest.mark.parametrize("x,sizes,exc,match", [
    (torch.zeros(32, 64), [16, 8], ValueError, r"split_sizes \[16, 8\] must be non-negative and "
                                               r"sum to 32"),
    (torch.zeros(32, 64), [40, -8], ValueError, r"must be non-negative"),
    (torch.zeros(2, 16, 64), [32], ValueError, r"quantize_grouped expects a 2D"),
    (torch.zeros(64, 32).t(), [32], ValueError, r"x must be contiguous"),
])
def test_quantize_grouped_errors(x, sizes, exc, match):
    with pytest.raises(exc, match=match):
        cute_fp4.quantize_grouped(x, sizes)


def test_nvfp4_tensor_to_moves_every_present_field():
    t = cute_fp4.quantize(torch.randn(32, 64), Recipe(rowwise=False, columnwise=True))
    moved = t.to("meta")
    assert moved.data is None and moved.scales is None and moved.amax is None
    for name in ("data_t", "scales_t", "amax_t"):
        got, src = getattr(moved, name), getattr(t, name)
        assert got.device.type == "meta" and got.shape == src.shape and got.dtype == src.dtype
    assert moved.recipe == t.recipe and moved.shape == t.shape and src.device.type == "cpu"
