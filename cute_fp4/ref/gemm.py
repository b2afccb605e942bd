"""Reference scaled NVFP4 GEMM (SPEC section 3) and the SNR metric."""

from __future__ import annotations

from typing import Optional

import torch

from .formats import FLOAT_DTYPES as OUT_DTYPES
from .formats import decode_scale, e2m1_decode, unpack_fp4


def epilogue_factors(a_scaling: str, a_amax: Optional[torch.Tensor], a_e4m3_max: int,
                     b_scaling: str, b_amax: torch.Tensor, b_e4m3_max: int):
    """(alpha, row, col) of `gemm` from the operands' outer amaxes (None where absent): the
    per-tensor decode scales 1 / S_enc multiply into alpha (a's first), per-token ones are the
    row (a) / column (b) vectors; window64 (per-block factors) and dense (W4A16) sides give
    none."""
    alpha = row = col = None
    for side, scaling, amax, e4m3_max in (("a", a_scaling, a_amax, a_e4m3_max),
                                          ("b", b_scaling, b_amax, b_e4m3_max)):
        if scaling == "tensor":
            dec = decode_scale(amax, e4m3_max)
            alpha = dec if alpha is None else alpha * dec
        elif scaling == "token":
            dec = decode_scale(amax, e4m3_max)
            row, col = (dec, col) if side == "a" else (row, dec)
    return alpha, row, col


def block_values(data: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [rows, K/2] and per-block factors [rows, K/16] -> FP32 [rows, K/16, 16]
    values e2m1 * factor (exact when the factor is an E4M3 scale)."""
    rows = data.shape[0]
    v = e2m1_decode(unpack_fp4(data)).view(rows, -1, 16)
    return v * factors.to(torch.float32).unsqueeze(-1)


def gemm(a: torch.Tensor, a_factors: Optional[torch.Tensor], b: torch.Tensor,
         b_factors: torch.Tensor, *, alpha: Optional[torch.Tensor] = None,
         row: Optional[torch.Tensor] = None, col: Optional[torch.Tensor] = None,
         bias: Optional[torch.Tensor] = None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """D[m, n] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]).

    a: packed E2M1 uint8 [M, K/2] with per-block factors a_factors [M, K/16] (the E4M3 block
       scales as FP32, or scale / S_enc_window for window64 operands), or a dense
       bf16/fp16/fp32 [M, K] activation with a_factors None (W4A16).
    b: packed E2M1 uint8 [N, K/2] with b_factors [N, K/16].
    The sum runs over 16-element K blocks: each block's dot product is formed in FP32 and
    scaled by a_factor * b_factor, and the blocks accumulate in FP32 in K order. The epilogue is
    FP32: ((acc * alpha) * row[m]) * col[n] + bias[n], then the cast.
    """
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    n = b.shape[0]
    vb = block_values(b, torch.ones_like(b_factors, dtype=torch.float32))
    fb = b_factors.to(torch.float32)
    if a_factors is None:
        m, k = a.shape
        va = a.to(torch.float32).view(m, k // 16, 16)
        fa = torch.ones(m, k // 16, device=a.device)
    else:
        m = a.shape[0]
        va = block_values(a, torch.ones_like(a_factors, dtype=torch.float32))
        fa = a_factors.to(torch.float32)
    if va.shape[1] != vb.shape[1]:
        raise ValueError(f"K mismatch: a has {va.shape[1] * 16}, b has {vb.shape[1] * 16}")
    acc = torch.zeros(m, n, dtype=torch.float32, device=b.device)
    # FP32 block products whatever the caller's torch.autocast (it would run them in BF16)
    with torch.autocast(b.device.type, enabled=False):
        for kb in range(vb.shape[1]):
            dot = va[:, kb, :] @ vb[:, kb, :].t()
            acc = acc + torch.outer(fa[:, kb], fb[:, kb]) * dot
    if alpha is not None:
        acc = acc * alpha.to(torch.float32).reshape(())
    if row is not None:
        acc = acc * row.to(torch.float32).view(m, 1)
    if col is not None:
        acc = acc * col.to(torch.float32).view(1, n)
    if bias is not None:
        acc = acc + bias.to(torch.float32).view(1, n)
    return acc.to(out_dtype)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio in dB: 20 * log10(||ref|| / ||ref - approx||) (torchao's
    compute_error)."""
    r = reference.to(torch.float64)
    e = r - approx.to(torch.float64)
    return float(20 * torch.log10(torch.linalg.vector_norm(r) / torch.linalg.vector_norm(e)))
