"""Reference NVFP4 quantizer (SPEC sections 1-2), bit-exact in semantics to TransformerEngine's
`reference_nvfp4.py` for the options it shares, and the contract the CuTe DSL kernels match."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from ..recipe import Recipe
from ..tensor import NVFP4Tensor
from .formats import (E2M1_MAX, FLOAT_DTYPES, FLT_MAX, RCP_E2M1_MAX, e2m1_decode, e2m1_encode,
                      e2m1_encode_stochastic, encode_scale, pack_fp4, to_e4m3)
from .philox import philox_bits
from .swizzle import swizzle_scales

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def true_div(t: torch.Tensor, value: float) -> torch.Tensor:
    """t / value as an IEEE FP32 division on every device. (On CUDA, torch turns a division by
    a Python number into a product with its FP32 reciprocal; a divisor tensor on t's device
    keeps the true division, as TransformerEngine's reference has it.)"""
    return t / torch.full((), value, dtype=torch.float32, device=t.device)


def rht(x: torch.Tensor) -> torch.Tensor:
    """16-point Random Hadamard Transform along the last dimension, in FP32:
    x @ (diag(RHT_SIGNS) @ H16) / 4, computed as sign flips, four Walsh-Hadamard butterfly
    stages (a + b, a - b at strides 1, 2, 4, 8) and an exact scaling by 1/4."""
    if x.shape[-1] % 16:
        raise ValueError(f"rht needs the last dimension divisible by 16, got {x.shape[-1]}")
    return (_rht_butterflies(x) * 0.25).reshape(x.shape)


def _rht_butterflies(x: torch.Tensor, strides=(1, 2, 4, 8)) -> torch.Tensor:
    """[N, 16] FP32 blocks of x after rht's sign flips and its butterflies at `strides` (the
    first ones of the four), before the scaling."""
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device)
    y = (x.to(torch.float32).reshape(-1, 16) * signs)
    for h in strides:
        y = y.view(-1, 16 // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2)
    return y.reshape(-1, 16)


def amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor amax as an FP32 tensor of shape [1] (NaN propagates)."""
    return x.abs().amax().to(torch.float32).reshape(1) if x.numel() else torch.zeros(1, device=x.device)


def amax_per_token(x: torch.Tensor):
    """(per-row amax [M], per-column amax [K]) of a 2D tensor, FP32."""
    a = x.abs().to(torch.float32)
    return a.amax(dim=1), a.amax(dim=0)


def amax_window64(x: torch.Tensor) -> torch.Tensor:
    """Amax per 1x64 window along the rows of a 2D tensor: [M, K / 64], FP32."""
    m, k = x.shape
    return x.abs().to(torch.float32).view(m, k // 64, 64).amax(dim=-1)


def _fp16_product(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E2M1 x E4M3 products, exact in FP16 (and returned as FP32); NaN scales give NaN."""
    return (e2m1_decode(codes, torch.float16) * scales.to(torch.float16)).to(torch.float32)


def _sum_rows_tree(err: torch.Tensor) -> torch.Tensor:
    """Sum [T*16, nb] row errors over each 16-row tile in a fixed tree order:
    rows (i, i+8), then (i, i+4), (i, i+2), (i, i+1)."""
    rows = err.view(-1, 16, err.shape[-1])
    for half in (8, 4, 2, 1):
        rows = rows[:, :half] + rows[:, half:2 * half]
    return rows[:, 0]


def quantize_blocks(
    x: torch.Tensor,
    block_amax_outer: torch.Tensor,
    block_rows: int = 1,
    *,
    e4m3_max: int = 448,
    four_over_six: Optional[str] = None,
    fast_math: bool = False,
    random_bits: Optional[torch.Tensor] = None,
):
    """Quantize a 2D [m, n] tensor (n % 16 == 0, m % block_rows == 0) to NVFP4.

    block_amax_outer: the outer (global) amax each 1x16 block uses, broadcastable to
        [m, n / 16] (a scalar for per-tensor, [m, 1] per-token, [m, n / 16] per-window).
    block_rows: 1 for 1x16 blocks, 16 for 16x16 tiles (block amax over the tile).
    random_bits: int64 [m, n] random bytes for stochastic rounding, or None for round-to-nearest.
    Returns (packed data uint8 [m, n / 2], scales float8_e4m3fn [m, n / 16]).
    """
    m, n = x.shape
    nb = n // 16
    xf = x.to(torch.float32).view(m, nb, 16)
    block_amax = xf.abs().amax(dim=-1)  # [m, nb]
    if block_rows == 16:
        tile = block_amax.view(m // 16, 16, nb).amax(dim=1)
        block_amax = tile.repeat_interleave(16, dim=0)
    g_amax = torch.broadcast_to(block_amax_outer.to(torch.float32), (m, nb))
    s_enc = encode_scale(g_amax, e4m3_max)
    s_dec = 1.0 / s_enc

    def encode_with(scale_e4m3):
        enc = (1.0 / (scale_e4m3.to(torch.float32) * s_dec)).clamp(max=FLT_MAX)
        v = (xf * enc.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).view(m, n)
        if random_bits is None:
            return e2m1_encode(v)
        return e2m1_encode_stochastic(v, random_bits)

    if four_over_six is None:
        s = to_e4m3((block_amax * (s_enc * RCP_E2M1_MAX)).clamp(max=FLT_MAX))
        return pack_fp4(encode_with(s)), s

    # 4over6: the map-to-6 and map-to-4 candidates, keep map-to-4 where strictly better.
    base = true_div(block_amax, E2M1_MAX) * s_enc
    s6, s4 = to_e4m3(base), to_e4m3(base * 1.5)
    q6, q4 = encode_with(s6), encode_with(s4)
    if fast_math:
        target = xf * s_enc.unsqueeze(-1)
        cand6 = _fp16_product(q6.view(m, nb, 16), s6.unsqueeze(-1))
        cand4 = _fp16_product(q4.view(m, nb, 16), s4.unsqueeze(-1))
    else:
        target = xf
        denom = E2M1_MAX * float(e4m3_max)
        g = g_amax.unsqueeze(-1)
        cand6 = true_div((e2m1_decode(q6).view(m, nb, 16) * s6.to(torch.float32).unsqueeze(-1)) * g,
                         denom)
        cand4 = true_div((e2m1_decode(q4).view(m, nb, 16) * s4.to(torch.float32).unsqueeze(-1)) * g,
                         denom)
    err6 = torch.zeros(m, nb, device=x.device)
    err4 = torch.zeros(m, nb, device=x.device)
    for i in range(16):  # sequential FP32 sum in element order
        d6 = cand6[:, :, i] - target[:, :, i]
        d4 = cand4[:, :, i] - target[:, :, i]
        if four_over_six == "mse":
            err6, err4 = err6 + d6 * d6, err4 + d4 * d4
        else:
            err6, err4 = err6 + d6.abs(), err4 + d4.abs()
    if block_rows == 16:
        err6 = _sum_rows_tree(err6).repeat_interleave(16, dim=0)
        err4 = _sum_rows_tree(err4).repeat_interleave(16, dim=0)
    pick4 = err4 < err6
    codes = torch.where(pick4.repeat_interleave(16, dim=1), q4, q6)
    return pack_fp4(codes), torch.where(pick4, s4, s6)


def outer_amax(x: torch.Tensor, scaling: str) -> torch.Tensor:
    """The outer amax of one 2D output [rows, cols]: [1], [rows] or [rows, cols / 64]."""
    if scaling == "tensor":
        return amax(x)
    if scaling == "token":
        if x.shape[1] == 0:  # amax of nothing is 0, as for scaling="tensor"
            return torch.zeros(x.shape[0], device=x.device)
        return x.abs().to(torch.float32).amax(dim=1)
    return amax_window64(x)


def block_outer_amax(outer: torch.Tensor, scaling: str, rows: int) -> torch.Tensor:
    """The outer amax broadcastable to the [rows, cols / 16] blocks."""
    if scaling == "tensor":
        return outer.view(1, 1)
    if scaling == "token":
        return outer.view(rows, 1)
    return outer.repeat_interleave(4, dim=1)


AmaxReduce = Callable[[torch.Tensor], object]


def _quantize_output(x: torch.Tensor, recipe: Recipe, seed: int, offset: int, stream: int,
                     reduce: Optional[AmaxReduce] = None):
    """One output (rowwise data of x). `reduce`, when given, is applied in place to the outer
    amax before it is used (the caller passes it only for amaxes that span sharded rows)."""
    rows, cols = x.shape
    outer = outer_amax(x, recipe.scaling)
    if reduce is not None:
        reduce(outer)
    per_block = block_outer_amax(outer, recipe.scaling, rows)
    pad = (-rows) % recipe.block_rows
    xq = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    bits = None
    if recipe.stochastic_rounding:
        # Element (r, c) takes random byte r * cols + c of the stream (byte c % 4 of word
        # (r * cols + c) // 4), padding rows included.
        bits = philox_bits((rows + pad) * cols, seed, offset, stream, x.device).view(rows + pad,
                                                                                    cols)
    data, scales = quantize_blocks(
        xq, per_block, recipe.block_rows, e4m3_max=recipe.e4m3_max,
        four_over_six=recipe.four_over_six, fast_math=recipe.fast_math, random_bits=bits,
    )
    data, scales = data[:rows], scales[:rows]
    if recipe.swizzle:
        scales = swizzle_scales(scales)
    return data, scales, outer


def check_quantize_input(x: torch.Tensor, recipe: Recipe, name: str = "x") -> torch.Tensor:
    """Validate an input for `quantize` and return it as 2D [M, K]."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a cute_fp4.Recipe, got {type(recipe).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dimensions, got shape {tuple(x.shape)}")
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a view costs ~2 us of host time
    m, k = x2.shape
    unit = 64 if recipe.scaling == "window64" else 16
    if recipe.rowwise and k % unit:
        raise ValueError(f"{name}: the last dimension ({k}) must be a multiple of {unit} for "
                         f"rowwise {recipe.scaling!r} quantization")
    if recipe.columnwise and m % unit:
        raise ValueError(f"{name}: the flattened leading dimensions ({m}) must be a multiple of "
                         f"{unit} for the columnwise {recipe.scaling!r} twin")
    return x2


def quantize(x: torch.Tensor, recipe: Recipe = Recipe(), *, seed: int = 0,
             offset: int = 0, stream: int = 0,
             amax_reduce: Optional[AmaxReduce] = None) -> NVFP4Tensor:
    """Quantize `x` ([..., K], flattened to [M, K]) per `recipe` (reference implementation).
    Stochastic rounding draws Philox stream `stream` for the rowwise data and `stream + 1`
    for the twin (quantize_grouped gives group g the streams 2g and 2g + 1).

    amax_reduce: for inputs sharded along M over ranks (sequence parallelism), a function that
    reduces an FP32 amax tensor in place across the ranks (a MAX all-reduce). It is applied to
    the outer amaxes that span M, before they are used: the per-tensor amax of each output and
    the per-token column amax of the twin. Per-row and per-window amaxes are local."""
    x2 = check_quantize_input(x, recipe)
    data = scales = outer = data_t = scales_t = outer_t = None
    spans_m = recipe.scaling in ("tensor", "token")
    if recipe.rowwise:
        data, scales, outer = _quantize_output(
            x2, recipe, seed, offset, stream,
            amax_reduce if recipe.scaling == "tensor" else None)
    if recipe.columnwise:
        xt = x2.t().contiguous()
        if recipe.rht:
            xt = rht(xt)
        data_t, scales_t, outer_t = _quantize_output(xt, recipe, seed, offset, stream + 1,
                                                     amax_reduce if spans_m else None)
    return NVFP4Tensor(data=data, scales=scales, amax=outer, data_t=data_t, scales_t=scales_t,
                       amax_t=outer_t, recipe=recipe, shape=tuple(x.shape), dtype=x.dtype)


def quantize_grouped(x: torch.Tensor, split_sizes: Sequence[int], recipe: Recipe = Recipe(), *,
                     seed: int = 0, offset: int = 0) -> List[NVFP4Tensor]:
    """Quantize the row groups of a [sum(M_i), K] tensor independently (MoE experts), each
    with its own outer scales and its own stochastic-rounding streams."""
    if x.dim() != 2:
        raise ValueError(f"quantize_grouped expects a 2D [sum(M_i), K] tensor, got {tuple(x.shape)}")
    sizes = [int(s) for s in split_sizes]
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(f"split_sizes {sizes} must be non-negative and sum to {x.shape[0]}")
    return [quantize(part, recipe, seed=seed, offset=offset, stream=2 * g)
            for g, part in enumerate(torch.split(x, sizes, dim=0))]


__all__ = ["rht", "amax", "amax_per_token", "amax_window64", "quantize_blocks", "quantize",
           "quantize_grouped", "check_quantize_input", "outer_amax", "block_outer_amax"]
