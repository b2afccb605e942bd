"""CUDA quantize: amax kernel(s) then the K2 cast kernel, compiled once per configuration and
called through TVM-FFI (torch tensors passed directly, launched on torch's current stream).
All outputs (amax, data, scales and their twins) are views of ONE uint8 allocation laid out by
a per-shape cached plan; per-tensor scaling needs no zero-fill (partial maxima, see amax.py).

Supported: recipe.scaling in {"tensor", "token"}, block (1, 16), no rht / stochastic rounding /
4over6 (NotImplementedError naming the option: later issues add them).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import cutlass
import torch

from ..common.jit import KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor
from ..recipe import Recipe
from ..tensor import NVFP4Tensor
from .amax import AmaxTensor, AmaxToken, tensor_partials
from .cast import CastKernel

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_CUTLASS = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _u8_2d():
    return fake_tensor(cutlass.Uint8, (None, None), align=1)


def _f8_2d():
    return fake_tensor(cutlass.Float8E4M3FN, (None, None), align=1)


def cast_kernel(dtype: str, rowwise: bool, columnwise: bool, swizzle: bool, per_token: bool,
                num_sms: int = 132):
    """(kernel, *fake compile arguments) of the K2 cast for a configuration."""
    op = CastKernel(dtype, rowwise, columnwise, swizzle, per_token, num_sms)
    esize = _CUTLASS[dtype].width // 8
    m, k = dyn(), dyn(16 // esize)
    return (op, fake_tensor(_CUTLASS[dtype], (m, k)),
            fake_tensor(cutlass.Float32, (None,), align=4),
            fake_tensor(cutlass.Float32, (None,), align=4),
            _u8_2d(), _f8_2d(), _u8_2d(), _f8_2d(), env_stream())


def amax_tensor_kernel(dtype: str, num_sms: int = 132):
    esize = _CUTLASS[dtype].width // 8
    return (AmaxTensor(dtype, num_sms), fake_tensor(_CUTLASS[dtype], (dyn(), dyn(16 // esize))),
            fake_tensor(cutlass.Float32, (None,), align=4), env_stream())


def amax_token_kernel(dtype: str):
    esize = _CUTLASS[dtype].width // 8
    return (AmaxToken(dtype), fake_tensor(_CUTLASS[dtype], (dyn(), dyn(16 // esize))),
            fake_tensor(cutlass.Float32, (None,), align=4),
            fake_tensor(cutlass.Float32, (None,), align=4), env_stream())


def _check_recipe(recipe: Recipe):
    if recipe.rht:
        raise NotImplementedError("cute_fp4 CUDA quantize: Recipe.rht is not implemented yet")
    if recipe.stochastic_rounding:
        raise NotImplementedError(
            "cute_fp4 CUDA quantize: Recipe.stochastic_rounding is not implemented yet")
    if recipe.four_over_six is not None:
        raise NotImplementedError(
            "cute_fp4 CUDA quantize: Recipe.four_over_six is not implemented yet")
    if recipe.block != (1, 16):
        raise NotImplementedError(
            f"cute_fp4 CUDA quantize: Recipe.block={recipe.block} is not implemented yet")
    if recipe.scaling not in ("tensor", "token"):
        raise NotImplementedError(
            f"cute_fp4 CUDA quantize: Recipe.scaling={recipe.scaling!r} is not implemented yet")


def _check_shape(m: int, k: int, esize: int, recipe: Recipe):
    if m == 0 or k == 0:
        raise ValueError(f"x must be non-empty, got the 2D shape {(m, k)}")
    if recipe.rowwise and k % 16:
        raise ValueError(f"x: the last dimension ({k}) must be a multiple of 16 for rowwise output")
    if recipe.columnwise and m % 16:
        raise ValueError(f"x: the flattened leading dimensions ({m}) must be a multiple of 16 "
                         "for the columnwise twin")
    if (k * esize) % 16:
        raise ValueError(f"x: rows of {k} elements are not a multiple of 16 bytes (TMA needs it)")


def _alloc(nbytes: int, device) -> torch.Tensor:
    """The one output allocation of a call (uninitialised; tests replace it with a poisoning
    one)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _scale_shape(rows: int, cols: int, swizzle: bool):
    if swizzle:
        return ((rows + 127) // 128 * 128, (cols // 16 + 3) // 4 * 4)
    return (rows, cols // 16)


class _Plan:
    """Per-(shape, dtype, recipe, device) constants of a call, validated once: compiled kernels
    and the byte layout of the single output buffer. Pieces start on 256-byte boundaries: a
    misaligned data piece splits every 32-byte row segment of a tile over two sectors
    (measured: the per-tensor cast ran 2x slower with 16-byte alignment).

    Per-tensor amax words: [amax, partial 1..P]; with a cross-rank reduction (``reduced``)
    [amax, local amax, partial 1..P]: the local amax is reduced in place and the cast reads it
    as its single partial. Per token: [row amax (M), column amax (K)], zeroed per call (the
    token amax kernel reduces across CTAs with atomics)."""

    def __init__(self, m, k, name, recipe, reduced, dev):
        _check_recipe(recipe)
        esize = _CUTLASS[name].width // 8
        _check_shape(m, k, esize, recipe)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        arch = device_arch(dev)
        sms = _num_sms(index)
        row, col, swz = recipe.rowwise, recipe.columnwise, recipe.swizzle
        self.per_token = per_token = recipe.scaling == "token"
        self.reduced = reduced
        self.row, self.col = row, col
        if per_token:
            self.amax = KERNELS.get(("amax_token", name, arch),
                                    lambda: compile_kernel(*amax_token_kernel(name), arch=arch))
            n_amax = m + k
        else:
            self.amax = KERNELS.get(("amax_tensor", name, sms, arch),
                                    lambda: compile_kernel(*amax_tensor_kernel(name, sms), arch=arch))
            n_amax = 1 + int(reduced) + tensor_partials(m, k, esize, sms)
        self.cast = KERNELS.get(("cast", name, row, col, swz, per_token, sms, arch),
                                lambda: compile_kernel(*cast_kernel(name, row, col, swz, per_token, sms),
                                                       arch=arch))
        off = (4 * n_amax + 255) // 256 * 256
        self.m, self.k, self.n_amax = m, k, n_amax
        # (shape, strides, byte offset) of each present output; absent ones are None
        self.data = self.scales = self.data_t = self.scales_t = None
        shapes = {}
        if row:
            shapes["data"], shapes["scales"] = (m, k // 2), _scale_shape(m, k, swz)
        if col:
            shapes["data_t"], shapes["scales_t"] = (k, m // 2), _scale_shape(k, m, swz)
        for key, shape in shapes.items():
            setattr(self, key, (shape, (shape[1], 1), off))
            off += (shape[0] * shape[1] + 255) // 256 * 256
        self.nbytes = off
        self.dummy = torch.empty((1, 1), dtype=torch.uint8, device=dev)
        self.dummy_f8 = self.dummy.view(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=4096)
def _plan(m, k, name, recipe, reduced, dev) -> _Plan:
    return _Plan(m, k, name, recipe, reduced, dev)


def quantize(x: torch.Tensor, recipe: Recipe = Recipe(), *, seed: int = 0,
             offset: int = 0, amax_reduce: Optional[Callable[[torch.Tensor], None]] = None
             ) -> NVFP4Tensor:
    """NVFP4 quantize of a CUDA tensor [..., K] (flattened to [M, K]); see the module doc.
    seed/offset are accepted for API symmetry (stochastic rounding is not implemented).

    amax_reduce (tensor / sequence parallelism, input sharded along M): called between the
    amax kernel and the cast on the float32 amaxes that span M, which it must reduce in place
    across ranks (e.g. ``lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)``):
    the one global amax [1] for per-tensor scaling, the column amax [K] for per-token (the
    per-row amaxes are local). The cast then quantizes with the reduced values.

    Per call (the plan holds everything else): one allocation, the views of the outputs, the
    amax kernel (per token after a zero-fill of the amax words) and the cast."""
    if not x.is_cuda:
        raise ValueError("cute_fp4.quant.dispatch.quantize needs a CUDA tensor")
    shape = tuple(x.shape)
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        if x.dim() < 2:
            raise ValueError(f"x must have at least 2 dimensions, got shape {tuple(x.shape)}")
        x = x.reshape(-1, x.shape[-1])
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous() first)")
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    m, k = x.shape
    reduced = amax_reduce is not None
    plan = _plan(m, k, name, recipe, reduced, x.device)

    buf = _alloc(plan.nbytes, x.device)
    words = buf.view(torch.float32)
    f8 = buf.view(torch.float8_e4m3fn) if plan.scales or plan.scales_t else None
    data = None if plan.data is None else buf.as_strided(*plan.data)
    scales = None if plan.scales is None else f8.as_strided(*plan.scales)
    data_t = None if plan.data_t is None else buf.as_strided(*plan.data_t)
    scales_t = None if plan.scales_t is None else f8.as_strided(*plan.scales_t)
    if plan.per_token:
        amax_all = words[:m + k]
        amax_all.zero_()
        amax_r, amax_c = amax_all[:m], amax_all[m:]
        plan.amax(x, amax_r, amax_c)
        if reduced:
            amax_reduce(amax_c)
        amax_out_r, amax_out_c = amax_r, amax_c
    else:
        amax_r = amax_c = words[:plan.n_amax]
        if reduced:
            plan.amax(x, amax_r[1:])
            torch.amax(amax_r[2:], dim=0, keepdim=True, out=amax_r[1:2])
            amax_reduce(amax_r[1:2])
            amax_r = amax_c = amax_r[:2]
        else:
            plan.amax(x, amax_r)
        amax_out_r = amax_out_c = words[:1]
    dummy, dummy_f8 = plan.dummy, plan.dummy_f8
    plan.cast(x, amax_r, amax_c, dummy if data is None else data,
              dummy_f8 if scales is None else scales, dummy if data_t is None else data_t,
              dummy_f8 if scales_t is None else scales_t)
    return NVFP4Tensor(
        data=data, scales=scales, amax=amax_out_r if plan.row else None,
        data_t=data_t, scales_t=scales_t, amax_t=amax_out_c if plan.col else None,
        recipe=recipe, shape=shape, dtype=x.dtype,
    )
