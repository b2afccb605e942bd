"""Argument checks and layout preparation shared by the NVFP4 GEMM host wrappers (sm_90a
`dispatch.gemm_nvfp4`, sm_100a `sm100_blockscaled.gemm_nvfp4_sm100`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..ref.formats import FLOAT_DTYPES as OUT_DTYPES
from ..quant.swizzle import swizzle_scales
from ..ref.swizzle import swizzled_shape


def _check_operand(data: torch.Tensor, scales: torch.Tensor, name: str, swizzled: bool,
                   to_swizzled: bool = True):
    """The checked scales as a flat uint8 tensor: swizzled ones as they are, compact ones
    swizzled (a torch copy) when to_swizzled, else as they are."""
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise TypeError(f"{name}_data must be a 2D uint8 tensor [rows, K/2], got "
                        f"{data.dtype} {tuple(data.shape)}")
    if not data.is_contiguous():
        raise ValueError(f"{name}_data must be contiguous")
    if scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"{name}_scales must be float8_e4m3fn, got {scales.dtype}")
    rows, k = data.shape[0], data.shape[1] * 2
    if k % 16:
        raise ValueError(f"K must be a multiple of 16, got {k}")
    if swizzled:
        pr, pc = swizzled_shape(rows, k // 16)
        if scales.numel() != pr * pc:
            raise ValueError(f"swizzled {name}_scales for [{rows}, {k // 16}] need {pr * pc} "
                             f"bytes ([{pr}, {pc}]), got {tuple(scales.shape)}")
        return scales.contiguous().view(torch.uint8).reshape(-1)
    if tuple(scales.shape) != (rows, k // 16):
        raise ValueError(f"{name}_scales must be [{rows}, {k // 16}], got {tuple(scales.shape)}")
    if not to_swizzled:
        return scales.contiguous().view(torch.uint8).reshape(-1)
    return swizzle_scales(scales.view(torch.uint8)).reshape(-1)


def _check_operands(a_data: torch.Tensor, a_scales: torch.Tensor, b_data: torch.Tensor,
                    b_scales: torch.Tensor, swizzled: bool, out_dtype: torch.dtype, who: str,
                    to_swizzled: bool = True):
    """The checks both W4A4 wrappers share: output dtype, each operand, matching K and one
    CUDA device. Returns (flat uint8 scales of a and b, swizzled unless the scales are compact
    and not to_swizzled, m, n, k, device)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    sfa = _check_operand(a_data, a_scales, "a", swizzled, to_swizzled)
    sfb = _check_operand(b_data, b_scales, "b", swizzled, to_swizzled)
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"K mismatch: a_data is {tuple(a_data.shape)}, b_data is "
                         f"{tuple(b_data.shape)}")
    device = a_data.device
    if device.type != "cuda" or b_data.device != device:
        raise ValueError(f"{who} needs a_data and b_data on one CUDA device")
    return sfa, sfb, a_data.shape[0], b_data.shape[0], a_data.shape[1] * 2, device


def _prepare_data(data: torch.Tensor) -> torch.Tensor:
    """TMA needs 16-byte aligned rows and base: pad K/2 to a multiple of 16 bytes with zero codes
    (which contribute 0) and realign a misaligned view."""
    kh = data.shape[1]
    if kh % 16:
        padded = torch.zeros((data.shape[0], -(-kh // 16) * 16), dtype=torch.uint8,
                             device=data.device)
        padded[:, :kh] = data
        return padded
    if data.data_ptr() % 16:
        return data.clone()
    return data


@dataclasses.dataclass(frozen=True)
class OuterAmax:
    """An epilogue vector (alpha, row or col) given as an NVFP4 operand's outer amaxes (FP32,
    [1] or one per row): the GEMM kernel multiplies by their decode scales 1 / S_enc(amax,
    e4m3_max) (ref.formats.decode_scale, bit for bit), computed where it loads them, so no
    launch turns the amaxes into factors first. `cute_fp4.gemm` passes the amaxes of its
    operands this way (gemm.factors.epilogue_operands)."""

    amax: torch.Tensor
    e4m3_max: int = 448

    def __post_init__(self):
        if not isinstance(self.amax, torch.Tensor):
            raise TypeError(f"OuterAmax.amax must be a tensor, got {type(self.amax).__name__}")
        if self.e4m3_max not in (448, 256):
            raise ValueError(f"OuterAmax.e4m3_max must be 448 or 256, got {self.e4m3_max}")


def _vector(v, n: int, name: str, device) -> Optional[torch.Tensor]:
    """An optional epilogue vector (alpha, row, col) as contiguous FP32 of n elements."""
    if v is None:
        return None
    if isinstance(v, OuterAmax):
        v = v.amax
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(v).__name__}")
    if v.device != device:
        raise ValueError(f"{name} must be on {device}, got {v.device}")
    if v.numel() != n:
        raise ValueError(f"{name} must have {n} elements, got shape {tuple(v.shape)}")
    if v.dtype == torch.float32 and v.dim() == 1 and v.is_contiguous():
        return v  # as the kernels take it (the usual case: an amax or epilogue_factors' output)
    return v.reshape(-1).to(torch.float32).contiguous()


def _bias(bias: Optional[torch.Tensor], n: int, out_dtype: torch.dtype,
          device) -> Optional[torch.Tensor]:
    """An optional bias [N] of the output dtype or FP32, flattened and contiguous."""
    if bias is None:
        return None
    if bias.dtype not in (out_dtype, torch.float32):
        raise TypeError(f"bias must be {out_dtype} or float32, got {bias.dtype}")
    if bias.device != device or bias.numel() != n:
        raise ValueError(f"bias must be [N={n}] on {device}, got {tuple(bias.shape)}")
    return bias.reshape(-1).contiguous()


def _epilogue(alpha, row, col, bias, m: int, n: int, out_dtype: torch.dtype, device):
    """The optional epilogue operands as the kernels take them: alpha [1], row [M] and col [N]
    as contiguous FP32, bias [N] of the output dtype or FP32, and `decode`: for alpha, row
    and col the e4m3_max of an OuterAmax given there, else None (parts.EpilogueOperands)."""
    decode = tuple(v.e4m3_max if isinstance(v, OuterAmax) else None for v in (alpha, row, col))
    return (_vector(alpha, 1, "alpha", device), _vector(row, m, "row", device),
            _vector(col, n, "col", device), _bias(bias, n, out_dtype, device), decode)
