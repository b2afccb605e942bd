"""The 128x4 swizzled scale layout (cuBLAS / CUTLASS / torch._scaled_mm SWIZZLE_32_4_4).

A scale matrix [rows, cols] is zero-padded to [ceil(rows/128)*128, ceil(cols/4)*4] and stored as
128x4 tiles of 512 bytes, tiles in row-tile-major order; entry (r, c) of a tile sits at byte
(r % 32) * 16 + (r // 32) * 4 + c. Swizzled scales are returned with the padded 2D shape.
"""

from __future__ import annotations

import torch


def swizzled_shape(rows: int, cols: int) -> tuple:
    return (-(-rows // 128) * 128, -(-cols // 4) * 4)


def scale_shape(rows: int, cols: int, swizzle: bool) -> tuple:
    """Shape of the scales of a [rows, cols] scale matrix: padded when swizzled."""
    return swizzled_shape(rows, cols) if swizzle else (rows, cols)


def swizzled_offset(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Byte offset of scale (r, c) in the swizzled buffer of a matrix with `cols` columns."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    rr = r % 128
    return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] scales (any 1-byte dtype) -> padded, swizzled [R, C] of the same dtype."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales expects a 2D scale matrix, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    pr, pc = swizzled_shape(rows, cols)
    raw = scales.view(torch.uint8)
    padded = torch.zeros((pr, pc), dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = raw
    tiled = padded.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return tiled.contiguous().view(pr, pc).view(scales.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Padded, swizzled [R, C] scales -> compact [rows, cols]."""
    pr, pc = swizzled_shape(rows, cols)
    if swizzled.numel() != pr * pc:
        raise ValueError(
            f"swizzled scales for [{rows}, {cols}] need {pr * pc} bytes, got {swizzled.numel()}"
        )
    raw = swizzled.contiguous().view(torch.uint8).reshape(pr // 128, pc // 4, 32, 4, 4)
    compact = raw.permute(0, 3, 2, 1, 4).reshape(pr, pc)[:rows, :cols]
    return compact.contiguous().view(swizzled.dtype)
