"""Host entry points of the NVFP4 GEMMs: validation, layout preparation, kernel choice, launch."""

from __future__ import annotations

from typing import Optional

import torch

from ..common.jit import KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor, \
    torch_to_cutlass
from ..ref.swizzle import swizzle_scales, swizzled_shape

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_operand(data: torch.Tensor, scales: torch.Tensor, name: str, swizzled: bool):
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
    return swizzle_scales(scales.view(torch.uint8)).reshape(-1)


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


def _vector(v: Optional[torch.Tensor], n: int, name: str, device) -> Optional[torch.Tensor]:
    if v is None:
        return None
    if v.device != device:
        raise ValueError(f"{name} must be on {device}, got {v.device}")
    if v.numel() != n:
        raise ValueError(f"{name} must have {n} elements, got shape {tuple(v.shape)}")
    return v.reshape(-1).to(torch.float32).contiguous()


def _w4a4_kernel(out_dtype, tile_n, stages, flags, bias_dtype):
    import cutlass

    from .sm90_w4a4 import Sm90GemmNVFP4

    has_alpha, has_row, has_col, has_bias = flags
    op = Sm90GemmNVFP4(torch_to_cutlass(out_dtype), tile_n=tile_n, stages=stages,
                       has_alpha=has_alpha, has_row=has_row, has_col=has_col,
                       has_bias=has_bias)
    m, n, kh = dyn(), dyn(), dyn(16)
    args = (
        fake_tensor(cutlass.Uint8, (m, kh)),
        fake_tensor(cutlass.Uint8, (n, kh)),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(torch_to_cutlass(out_dtype), (m, n), align=4 if out_dtype == torch.float32
                    else 2),
        fake_tensor(cutlass.Float32, (1,), align=4) if has_alpha else None,
        fake_tensor(cutlass.Float32, (m,), align=4) if has_row else None,
        fake_tensor(cutlass.Float32, (n,), align=4) if has_col else None,
        fake_tensor(torch_to_cutlass(bias_dtype), (n,), align=2) if has_bias else None,
        env_stream(),
    )
    return op, args


def pick_w4a4_config(m: int, n: int, k: int):
    """(tile_n, stages) for a problem; 128-wide N tiles when 256-wide ones leave SMs idle."""
    tiles_256 = -(-m // 128) * -(-n // 256)
    if tiles_256 < 132 or n <= 128:
        return 128, 8
    return 256, 6


def gemm_nvfp4(a_data: torch.Tensor, a_scales: torch.Tensor, b_data: torch.Tensor,
               b_scales: torch.Tensor, *, alpha: Optional[torch.Tensor] = None,
               row: Optional[torch.Tensor] = None, col: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
               scales_swizzled: bool = False, out: Optional[torch.Tensor] = None,
               tile_n: Optional[int] = None, stages: Optional[int] = None) -> torch.Tensor:
    """D[M, N] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]) for NVFP4
    operands: packed E2M1 uint8 [rows, K/2] (even element in the low nibble) with E4M3 block
    scales, compact [rows, K/16] or swizzled (SPEC 1). FP32 accumulation and epilogue.
    `out` (optional, contiguous [M, N] of out_dtype) receives the result; tile_n / stages
    override the kernel configuration (benchmarks)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    sfa = _check_operand(a_data, a_scales, "a", scales_swizzled)
    sfb = _check_operand(b_data, b_scales, "b", scales_swizzled)
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"K mismatch: a_data is {tuple(a_data.shape)}, b_data is "
                         f"{tuple(b_data.shape)}")
    device = a_data.device
    if device.type != "cuda" or b_data.device != device:
        raise ValueError("gemm_nvfp4 needs a_data and b_data on one CUDA device")
    m, n, k = a_data.shape[0], b_data.shape[0], a_data.shape[1] * 2
    if alpha is not None and alpha.numel() != 1:
        raise ValueError(f"alpha must have one element, got shape {tuple(alpha.shape)}")
    alpha = _vector(alpha, 1, "alpha", device)
    row = _vector(row, m, "row", device)
    col = _vector(col, n, "col", device)
    if bias is not None:
        if bias.dtype not in (out_dtype, torch.float32):
            raise TypeError(f"bias must be {out_dtype} or float32, got {bias.dtype}")
        if bias.device != device or bias.numel() != n:
            raise ValueError(f"bias must be [N={n}] on {device}, got {tuple(bias.shape)}")
        bias = bias.reshape(-1).contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
    elif out.dtype != out_dtype or tuple(out.shape) != (m, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] {out_dtype} tensor")
    if m == 0 or n == 0:
        return out
    if k == 0:
        raise ValueError("K must be positive")
    auto_tile_n, auto_stages = pick_w4a4_config(m, n, k)
    tile_n = tile_n or auto_tile_n
    stages = stages or auto_stages
    flags = (alpha is not None, row is not None, col is not None, bias is not None)
    bias_dtype = bias.dtype if bias is not None else None
    arch = device_arch(device)
    if arch != "sm_90a":
        raise NotImplementedError(f"gemm_nvfp4 runs on sm_90a only for now (device is {arch})")
    key = ("gemm_w4a4_sm90", out_dtype, tile_n, stages, flags, bias_dtype)
    def build():
        op, args = _w4a4_kernel(out_dtype, tile_n, stages, flags, bias_dtype)
        return compile_kernel(op, *args, arch=arch)

    fn = KERNELS.get(key, build)
    fn(_prepare_data(a_data), _prepare_data(b_data), sfa, sfb, out, alpha, row, col, bias)
    return out


def gemm_w4a16(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor, *,
               alpha: Optional[torch.Tensor] = None, col: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
               scales_swizzled: bool = False) -> torch.Tensor:
    """BF16/FP16 activations [M, K] x NVFP4 weights [N, K/2]: not implemented on the GPU yet."""
    raise NotImplementedError("the CUDA W4A16 GEMM is not implemented yet")
