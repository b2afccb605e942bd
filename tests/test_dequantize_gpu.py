"""GPU dequantize kernels vs the references: bit-exact, every layout, scaling and out dtype."""

import pytest
import torch

import cute_fp4
from cute_fp4 import Recipe, ref
from cute_fp4.quant.dequantize import dequantize, mxfp8_dequantize

pytestmark = pytest.mark.gpu

SHAPES = [(1, 16), (7, 48), (128, 128), (300, 1040), (1024, 4096)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare floats by their bits (NaN payloads, signed zeros)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _input(shape, kind):
    x = torch.randn(shape, device="cuda") * 3
    if kind == "outliers":
        x[torch.rand(shape[0], device="cuda") < 0.05] *= 1000
        x[:, :16] = 0.0  # an all-zero block per row
    if kind == "magnitudes":  # rows from 1e-9 to 1e7: blocks on both sides of the fast paths'
        # bounds (dequantize.TABLE_BOUNDS, the fp32 exponent additions)
        x = x * torch.logspace(-9, 7, shape[0], device="cuda")[:, None]
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scaling", ["tensor", "token", "window64"])
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "outliers", "magnitudes"])
def test_nvfp4_dequantize_bit_exact(shape, scaling, swizzle, dtype, kind):
    """Every block of a thread (BLOCKS_PER_THREAD for bf16 / fp16; the grid's tail blocks
    included), fast paths (scaled q1 / q15, the bf16 / fp16 tables) and IEEE divisions."""
    if scaling == "window64" and shape[1] % 64:
        shape = (shape[0], 64 * ((shape[1] + 63) // 64))
    x = _input(shape, kind)
    t = ref.quantize(x, Recipe(scaling=scaling, swizzle=swizzle))
    got = cute_fp4.dequantize(t, dtype)
    want = ref.dequantize(t, dtype)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(want))


def test_nvfp4_dequantize_special_values():
    x = torch.randn(64, 64, device="cuda")
    x[0, 3] = float("inf")
    x[1, 5] = float("nan")
    x[2, :16] = 0.0
    x[3, 7] = 1e-30
    t = ref.quantize(x, Recipe(scaling="token"))
    got = cute_fp4.dequantize(t, torch.float32)
    assert torch.equal(_bits(got), _bits(ref.dequantize(t, torch.float32)))
    assert torch.isnan(got[1, :16]).all()


def test_nvfp4_dequantize_columnwise_twin():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    t = ref.quantize(x, Recipe(scaling="token", rowwise=False, columnwise=True, swizzle=True))
    got = cute_fp4.dequantize(t.t(), torch.bfloat16)
    assert got.shape == (512, 256)
    assert torch.equal(_bits(got), _bits(ref.dequantize(t.t(), torch.bfloat16)))


def test_nvfp4_dequantize_empty():
    t = ref.quantize(torch.empty(0, 64, device="cuda"), Recipe())
    assert cute_fp4.dequantize(t, torch.float32).shape == (0, 64)


def test_nvfp4_dequantize_3d_shape():
    x = torch.randn(4, 8, 32, device="cuda")
    t = ref.quantize(x, Recipe())
    got = cute_fp4.dequantize(t, torch.float32)
    assert got.shape == (4, 8, 32)
    assert torch.equal(got, ref.dequantize(t, torch.float32))


@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (256, 1024)])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_dequantize_bit_exact(shape, fp8, swizzle, dtype):
    x = torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")
    data, scales = ref.mxfp8_quantize(x, fp8, swizzle=swizzle)
    got = mxfp8_dequantize(data, scales, dtype, swizzled=swizzle)
    want = ref.mxfp8_dequantize(data, scales, dtype, swizzled=swizzle)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 301])
def test_dequantize_writes_nothing_past_the_output(fmt, dtype, rows):
    """The warps store whole 512-byte lines of their blocks: the ones past the last block
    (the grid's tail) must not be written. The output is the head of a poisoned buffer."""
    cols = 1056  # 66 NVFP4 / 33 MXFP8 blocks per row: no row count fills a warp's blocks
    x = torch.randn(rows, cols, device="cuda") * 4
    buf = torch.full((rows + 8, cols), float("nan"), device="cuda").to(dtype)
    poison = buf[rows:].clone()
    out = buf[:rows]
    if fmt == "nvfp4":
        t = ref.quantize(x, Recipe(scaling="token"))
        dequantize(t, dtype, out=out)
        want = ref.dequantize(t, dtype)
    else:
        data, scales = ref.mxfp8_quantize(x)
        mxfp8_dequantize(data, scales, dtype, out=out)
        want = ref.mxfp8_dequantize(data, scales, dtype)
    assert torch.equal(_bits(out), _bits(want))
    assert torch.equal(_bits(buf[rows:]), _bits(poison))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_public_out(dtype):
    """cute_fp4.dequantize(t, dtype, out=...) on CUDA: a poisoned 3D out is written in full,
    returned, and bit-equal to the allocating call."""
    x = torch.randn(3, 100, 272, device="cuda")
    t = cute_fp4.quantize(x, Recipe(scaling="token", swizzle=True))
    out = torch.full((3, 100, 272), float("nan"), device="cuda").to(dtype)
    assert cute_fp4.dequantize(t, dtype, out=out) is out
    assert torch.equal(_bits(out), _bits(cute_fp4.dequantize(t, dtype)))
