"""Reference dequantization: NVFP4 (compact or swizzled scales) and MXFP8 (E8M0 per 32)."""

from __future__ import annotations

import torch

from ..tensor import NVFP4Tensor
from .formats import FLOAT_DTYPES as OUT_DTYPES
from .formats import e2m1_decode, encode_scale, unpack_fp4
from .quantize import block_outer_amax
from .swizzle import swizzle_scales, unswizzle_scales

MXFP8_DTYPES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def check_out_tensor(out, shape, dtype: torch.dtype, device):
    """A caller's output tensor: a torch.Tensor of `dtype` and `shape` on `device`,
    contiguous (the dequantize kernels store it as one flat array)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype or tuple(out.shape) != tuple(shape) or out.device != device:
        raise ValueError(f"out must be a {dtype} tensor of shape {tuple(shape)} on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def compact_scales(scales: torch.Tensor, rows: int, cols: int, swizzled: bool) -> torch.Tensor:
    """Scales [rows, cols / 16] in the compact layout, whatever layout they are stored in."""
    return unswizzle_scales(scales, rows, cols // 16) if swizzled else scales


def dequantize_matrix(data: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor,
                      recipe, cols: int, dtype=torch.float32) -> torch.Tensor:
    """One 2D NVFP4 matrix [rows, cols] -> x_hat = e2m1(q) * float(s) / S_enc, cast to dtype."""
    rows = data.shape[0]
    s = compact_scales(scales, rows, cols, recipe.swizzle).to(torch.float32)
    s_enc = encode_scale(torch.broadcast_to(block_outer_amax(outer, recipe.scaling, rows),
                                            s.shape), recipe.e4m3_max)
    v = e2m1_decode(unpack_fp4(data)).view(rows, cols // 16, 16)
    return ((v * s.unsqueeze(-1)) / s_enc.unsqueeze(-1)).view(rows, cols).to(dtype)


def dequantize(t: NVFP4Tensor, dtype=torch.float32) -> torch.Tensor:
    """The rowwise data of `t` in `dtype`, reshaped to the original shape."""
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dequantize dtype must be float32, bfloat16 or float16, got {dtype}")
    if t.data is None:
        raise ValueError("this NVFP4Tensor has no rowwise data (quantized with rowwise=False); "
                         "use t.t().dequantize() for the columnwise twin")
    out = dequantize_matrix(t.data, t.scales, t.amax, t.recipe, t.cols, dtype)
    return out.view(t.shape)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> 2**(code - 127) in FP32; code 255 is NaN."""
    c = codes.to(torch.int32)
    v = torch.ldexp(torch.ones_like(c, dtype=torch.float32), c - 127)
    return torch.where(c == 255, torch.full_like(v, float("nan")), v)


def mxfp8_quantize(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, swizzle: bool = False):
    """MXFP8: one E8M0 scale per 32 elements of a row: the block amax / fp8_max rounded up to a
    power of two (code = biased exponent, +1 if any mantissa bit is set, clamped to [0, 254]);
    data = fp8(clamp(x / scale, +-fp8_max)). Returns (data [M, K], scales uint8 [M, K/32])."""
    if fp8_dtype not in MXFP8_DTYPES:
        raise TypeError(f"fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    m, k = x.shape
    if k % 32:
        raise ValueError(f"MXFP8 needs the last dimension divisible by 32, got {k}")
    fmax = MXFP8_DTYPES[fp8_dtype]
    xf = x.to(torch.float32).view(m, k // 32, 32)
    ratio = xf.abs().amax(dim=-1) / fmax
    bits = ratio.view(torch.int32)
    code = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    code = code.clamp(0, 254).to(torch.uint8)
    scale = e8m0_to_float(code).unsqueeze(-1)
    data = (xf / scale).clamp(-fmax, fmax).to(fp8_dtype).view(m, k)
    if swizzle:
        code = swizzle_scales(code)
    return data, code


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, dtype=torch.float32,
                     swizzled: bool = False) -> torch.Tensor:
    """MXFP8 [M, K] data with E8M0 scales [M, K/32] (or swizzled) -> data * 2**(e - 127)."""
    if data.dtype not in MXFP8_DTYPES:
        raise TypeError(f"MXFP8 data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dequantize dtype must be float32, bfloat16 or float16, got {dtype}")
    m, k = data.shape
    if k % 32:
        raise ValueError(f"MXFP8 needs the last dimension divisible by 32, got {k}")
    codes = scales.view(torch.uint8)
    if swizzled:
        codes = unswizzle_scales(codes, m, k // 32)
    s = e8m0_to_float(codes).unsqueeze(-1)
    return (data.to(torch.float32).view(m, k // 32, 32) * s).view(m, k).to(dtype)
