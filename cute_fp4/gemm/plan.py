"""Per-configuration plans of `cute_fp4.gemm` for two NVFP4 operands on sm_90a.

Through the general path (api.gemm's checks, ops.gemm, the epilogue factors, gemm_nvfp4's
checks, the scales' flat views, the kernel pick and its keys, the temporary of the decoded
operand) a GEMM took ~150-200 us of host time on the device host, and a Linear training step
makes three: the eager step was host-bound below ~2.5 ms of GPU work (notes/gemm.md, session
52). A plan holds what depends on the call's configuration alone: the path, the compiled
kernels, the roles of the outer amaxes in the epilogue, the output's shape. Its key is every
property of the operands that the general path checks or derives from (recipes, shapes,
dtypes, devices, contiguity, 16-byte alignment, the bias's), so a call with a planned key
only allocates its output (and the temporary) and launches.

The first call of a configuration runs the general path (its checks, its errors); the plan is
made after that call succeeded, with the general path's kernels and kernel configurations,
so both give the same bits. Configurations a plan does not take (K % 64 != 0 on the
predecode and window paths, misaligned or non-contiguous fields, scale layouts that differ,
other architectures) keep the general path: their key maps to None. Compact scales on the
predecode and window paths are swizzled per call by the swizzle kernel, as on the general
path.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..common.jit import device_arch, num_sms
from ..quant.dequantize import nvfp4_launcher
from ..quant.swizzle import swizzle_scales
from ..ref.swizzle import scale_shape
from ..tensor import NVFP4Tensor
from .dispatch import _unit_amax, pick_sm90_path, predecode_swap
from .factors import amax_roles, factor_kind, factors_launcher, window_factors
from .sm90_mixed import UNSCALE_W4A4, k_pad, mixed_launcher, predecode_launcher
from .sm90_w4a16 import w4a16_launcher
from .sm90_window import window_launcher

# plans (or None: the general path) by key; cleared when full (a process cycling through
# more configurations than this makes them again)
_PLANS: Dict[tuple, Optional["GemmPlan"]] = {}
MAX_PLANS = 4096
_UNSEEN = object()


def _signature(t: NVFP4Tensor) -> tuple:
    """What the general path checks of an operand, and what a plan assumes of it."""
    d, s, a = t.data, t.scales, t.amax
    return (t.recipe, tuple(t.shape), d.shape, d.dtype, d.device, d.is_contiguous(),
            d.data_ptr() % 16, s.shape, s.dtype, s.device, s.is_contiguous(), s.data_ptr() % 16,
            a.shape, a.dtype, a.device, a.is_contiguous())


def gemm_key(a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[torch.Tensor],
             out_dtype: torch.dtype) -> Optional[tuple]:
    """The plan key of cute_fp4.gemm(a, b, bias=bias, out_dtype=out_dtype) for CUDA NVFP4
    operands with rowwise data, else None (the general path, which raises for bad ones)."""
    if any(f is None for f in (a.data, a.scales, a.amax, b.data, b.scales, b.amax)):
        return None
    bias_sig = None if bias is None else (bias.dtype, bias.shape, bias.device,
                                          bias.is_contiguous())
    return _signature(a), _signature(b), bias_sig, out_dtype


def gemm(key: tuple, a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[torch.Tensor],
         out_dtype: torch.dtype, general: Callable) -> torch.Tensor:
    """cute_fp4.gemm through the plan of `key` (`gemm_key`): a configuration's first call
    runs `general(a, b, bias, out_dtype)` (the general path, its checks and errors) and then
    makes the plan (or records that none applies); later calls run the plan, or the general
    path where none applies."""
    plan = _PLANS.get(key, _UNSEEN)
    if plan is _UNSEEN:
        out = general(a, b, bias, out_dtype)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = GemmPlan.make(a, b, bias, out_dtype)
        return out
    if plan is None:
        return general(a, b, bias, out_dtype)
    return plan(a, b, bias)


class GemmPlan:
    """cute_fp4.gemm(a, b, bias=, out_dtype=) of one configuration on sm_90a, on the path
    `pick_sm90_path` chooses: "predecode" (one operand decoded to BF16 by one kernel, the
    mixed wgmma kernel: the smaller, or the one that is not window64, whose factors the
    kernel then applies per k-tile), "weight_stream" (the smaller operand decoded by the
    dequantize kernel, the weight-streaming kernel, which reads the larger one's window
    amaxes where it is window64) or, with two window64 operands, "window" (both operands
    decoded to BF16, their window factors by one launch each, the window kernel), as
    `gemm_nvfp4` runs them."""

    @classmethod
    def make(cls, a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[torch.Tensor],
             out_dtype: torch.dtype) -> Optional["GemmPlan"]:
        """The plan of a configuration the general path has run, or None where it takes
        the general path."""
        ra, rb = a.recipe, b.recipe
        fields = (a.data, a.scales, b.data, b.scales)
        device = a.data.device
        m, n, k = a.data.shape[0], b.data.shape[0], b.data.shape[1] * 2
        if (device_arch(device) != "sm_90a" or ra.swizzle != rb.swizzle
                or any(r.scaling not in ("tensor", "token", "window64") for r in (ra, rb))
                or any(not t.is_contiguous() or t.data_ptr() % 16 for t in fields)
                or a.scales.dtype != torch.float8_e4m3fn or b.scales.dtype != torch.float8_e4m3fn
                or tuple(a.scales.shape) != scale_shape(m, k // 16, ra.swizzle)
                or tuple(b.scales.shape) != scale_shape(n, k // 16, rb.swizzle)
                or a.amax.dtype != torch.float32 or b.amax.dtype != torch.float32
                or not (a.amax.is_contiguous() and b.amax.is_contiguous())
                or (bias is not None and not bias.is_contiguous())):
            return None
        path = pick_sm90_path("auto", m, n, (ra.scaling == "window64",
                                             rb.scaling == "window64"))
        if m == 0 or n == 0 or (path in ("predecode", "window") and k_pad(k // 2) != k):
            return None
        return cls(a, b, bias, out_dtype, path)

    def __init__(self, a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[torch.Tensor],
                 out_dtype: torch.dtype, path: str):
        ra, rb = a.recipe, b.recipe
        device = a.data.device
        arch = device_arch(device)
        m, n, k = a.data.shape[0], b.data.shape[0], b.data.shape[1] * 2
        self.path, self.device, self.out_dtype = path, device, out_dtype
        self.out_shape = (m, n)
        self.view_shape = tuple(a.shape[:-1]) + (n,) if len(a.shape) != 2 else None
        a_kind, b_kind = factor_kind(ra.scaling), factor_kind(rb.scaling)
        self.roles = amax_roles(a_kind, b_kind)
        if self.roles is None:  # alpha = the product of two decode scales: the factors kernel
            self.factors = factors_launcher(a_kind, b_kind, ra.e4m3_max, rb.e4m3_max, arch)
            decode, flags = (None, None, None), (True, False, False)
        else:
            self.factors = None
            e4m3 = {"a": ra.e4m3_max, "b": rb.e4m3_max}
            decode = tuple(None if side is None else e4m3[side] for side in self.roles)
            flags = tuple(side is not None for side in self.roles)
        bias_dtype = None if bias is None else bias.dtype
        self.windows = tuple(r.scaling == "window64" for r in (ra, rb))
        self.arch = arch
        # compact scales on the TMA paths: swizzled per call by the swizzle kernel
        self.swizzle = path != "weight_stream" and not ra.swizzle
        if path == "window":
            # both operands decoded to BF16 block values, each window64 one's factors
            self.shapes = ((m, k), (n, k))
            self.predecode = predecode_launcher(arch)
            out_bytes = n * out_dtype.itemsize
            self.gemm = window_launcher(n, out_dtype, flags + (bias is not None,), bias_dtype,
                                        out_bytes % 16 == 0, self.windows, decode,
                                        num_sms(device), arch)
        elif path == "predecode":
            # one operand decoded once to BF16, the other one (window64 or the larger) in
            # registers
            swap = self.a_decoded = predecode_swap(m, n, self.windows)
            self.packed_window = self.windows[swap]
            rows_y = m if swap else n
            self.y_shape = (rows_y, k)
            self.decode_y = predecode_launcher(arch)
            out_bytes = n * out_dtype.itemsize
            self.gemm = mixed_launcher(
                n if swap else m, rows_y, out_dtype, flags + (bias is not None,),
                bias_dtype, transposed=swap, unscale_exp=UNSCALE_W4A4,
                vec_store=out_bytes % 16 == 0, fp16=False, sms=num_sms(device), arch=arch,
                decode=decode, x_window=self.packed_window)
        else:
            # the smaller operand (A on ties) decoded to BF16 as the streaming kernel's tokens
            swap = n < m
            self.a_decoded = not swap
            rows_x = n if swap else m
            self.y_shape = (rows_x, k)
            self.decode_y = nvfp4_launcher(torch.bfloat16, "tensor", ra.swizzle, 448, arch)
            # window64 weights (the larger operand): the streaming kernel reads their amaxes
            big_recipe = ra if swap else rb
            self.packed_window = self.windows[not swap]
            self.gemm = w4a16_launcher(
                torch.bfloat16, out_dtype, rows_x, m if swap else n, k,
                (flags[0], flags[2], bias is not None), bias_dtype, has_row=flags[1],
                transposed=swap, swizzled=ra.swizzle, arch=arch, decode=decode,
                window=big_recipe.e4m3_max if self.packed_window else 0)

    def _scales(self, t: NVFP4Tensor) -> torch.Tensor:
        """t's scales as the flat uint8 view the kernels read (swizzled when `self.swizzle`)."""
        scales = swizzle_scales(t.scales) if self.swizzle else t.scales
        return scales.view(torch.uint8).view(-1)

    def __call__(self, a: NVFP4Tensor, b: NVFP4Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
        device = self.device
        if self.factors is None:
            amaxes = {"a": a.amax, "b": b.amax}
            alpha, row, col = (None if side is None else amaxes[side] for side in self.roles)
        else:
            alpha, row, col = torch.empty(1, dtype=torch.float32, device=device), None, None
            self.factors(a.amax, b.amax, alpha, None, None)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        if self.path == "window":
            values, factors = [], []
            for t, shape, windowed in zip((a, b), self.shapes, self.windows):
                v = torch.empty(shape, dtype=torch.bfloat16, device=device)
                self.predecode(t.data.view(torch.int32), self._scales(t).view(torch.int32),
                               v.view(torch.int32))
                values.append(v)
                factors.append(window_factors(t.amax, t.recipe.e4m3_max, self.arch)
                               if windowed else None)
            self.gemm(*values, out, alpha, row, col, bias, *factors)
            return out if self.view_shape is None else out.view(self.view_shape)
        dec, packed = (a, b) if self.a_decoded else (b, a)
        y = torch.empty(self.y_shape, dtype=torch.bfloat16, device=device)
        sf = self._scales(packed)
        if self.path == "predecode":
            self.decode_y(dec.data.view(torch.int32), self._scales(dec).view(torch.int32),
                          y.view(torch.int32))
            self.gemm(packed.data, sf, y, out, alpha, row, col, bias,
                      window_factors(packed.amax, packed.recipe.e4m3_max, self.arch)
                      if self.packed_window else None)
        else:  # the streaming kernel takes its tokens first
            self.decode_y(dec.data, dec.scales, _unit_amax(device), y)
            self.gemm(y, packed.data, sf, out, alpha, row, col, bias,
                      packed.amax if self.packed_window else None)
        return out if self.view_shape is None else out.view(self.view_shape)
