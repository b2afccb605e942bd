"""The epilogue factors of a scaled NVFP4 GEMM from its operands' outer amaxes, in one launch
(`ref.gemm.epilogue_factors`, bit for bit): alpha = the product of the per-tensor decode scales
1 / S_enc, row[m] / col[n] = the per-token decode scales of a's rows / b's rows.

Why a kernel: in torch these are ~10 elementwise launches per operand (the IEEE formula with
its zero / FLT_MAX cases), ~60 per training step of a Linear, which made the eager step
host-bound (notes/gemm.md, session 5). Since session 18 the GEMM kernels decode a single
operand's amaxes themselves (`epilogue_operands`, `parts.EpilogueOperands` decode): this kernel
runs only for alpha = the product of two per-tensor decode scales."""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from ..common import encode as E
from ..common.jit import KERNELS, compile_kernel, dyn, env_stream, fake_tensor
from ..common.scales import decode_outer_scale
from ..common.smem import padded_tile, padded_tile_storage
from .operands import OuterAmax

THREADS = 256
# The outer-scale kinds that make epilogue factors (window64 amaxes are per-block factors
# handled in the mainloop; dense W4A16 activations have none).
FACTOR_SCALINGS = ("tensor", "token")


def factor_kind(scaling: str):
    """The scaling of an operand as the factors see it: "tensor", "token", or None (it makes
    no factor)."""
    return scaling if scaling in FACTOR_SCALINGS else None


class EpilogueFactors:
    """alpha [1], row [M], col [N] from a_amax ([1] per tensor, [M] per token) and b_amax
    ([1] / [N]); a side whose scaling is neither "tensor" nor "token" contributes nothing."""

    def __init__(self, a_scaling: str, b_scaling: str, a_e4m3_max: int, b_e4m3_max: int):
        self.a_kind, self.b_kind = factor_kind(a_scaling), factor_kind(b_scaling)
        self.a_e4m3_max, self.b_e4m3_max = float(a_e4m3_max), float(b_e4m3_max)
        self.has_alpha = "tensor" in (self.a_kind, self.b_kind)

    @cute.jit
    def __call__(self, a_amax: Optional[cute.Tensor], b_amax: Optional[cute.Tensor],
                 alpha: Optional[cute.Tensor], row: Optional[cute.Tensor],
                 col: Optional[cute.Tensor], stream):
        count = Int32(1)
        if cutlass.const_expr(self.a_kind == "token"):
            count = cutlass.max(count, row.shape[0])
        if cutlass.const_expr(self.b_kind == "token"):
            count = cutlass.max(count, col.shape[0])
        self.kernel(a_amax, b_amax, alpha, row, col).launch(
            grid=(cute.ceil_div(count, THREADS), 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, a_amax: Optional[cute.Tensor], b_amax: Optional[cute.Tensor],
               alpha: Optional[cute.Tensor], row: Optional[cute.Tensor],
               col: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        if cutlass.const_expr(self.a_kind == "token"):
            if i < row.shape[0]:
                row[i] = decode_outer_scale(a_amax[i], self.a_e4m3_max)
        if cutlass.const_expr(self.b_kind == "token"):
            if i < col.shape[0]:
                col[i] = decode_outer_scale(b_amax[i], self.b_e4m3_max)
        if cutlass.const_expr(self.has_alpha):
            if i == 0:
                if cutlass.const_expr(self.a_kind == "tensor" and self.b_kind == "tensor"):
                    alpha[0] = E.mul_rn(decode_outer_scale(a_amax[0], self.a_e4m3_max),
                                        decode_outer_scale(b_amax[0], self.b_e4m3_max))
                elif cutlass.const_expr(self.a_kind == "tensor"):
                    alpha[0] = decode_outer_scale(a_amax[0], self.a_e4m3_max)
                else:
                    alpha[0] = decode_outer_scale(b_amax[0], self.b_e4m3_max)


def factors_kernel(a_scaling: str, b_scaling: str, a_e4m3_max: int, b_e4m3_max: int):
    """The op and fake arguments of one EpilogueFactors configuration."""
    op = EpilogueFactors(a_scaling, b_scaling, a_e4m3_max, b_e4m3_max)
    m, n = dyn(), dyn()

    def vector(extent):
        return fake_tensor(cutlass.Float32, (extent,), align=4)

    def amax(kind, extent):
        return None if kind is None else vector(extent if kind == "token" else 1)

    return op, (
        amax(op.a_kind, m), amax(op.b_kind, n),
        vector(1) if op.has_alpha else None,
        vector(m) if op.a_kind == "token" else None,
        vector(n) if op.b_kind == "token" else None,
        env_stream(),
    )


def epilogue_factors(a_scaling: str, a_amax: Optional[torch.Tensor], a_e4m3_max: int,
                     b_scaling: str, b_amax: torch.Tensor, b_e4m3_max: int, arch: str):
    """(alpha, row, col) on b_amax's CUDA device, as `ref.gemm.epilogue_factors` returns them
    (None where absent), in one launch. The amaxes are FP32 and contiguous (NVFP4Tensor's)."""
    a_kind, b_kind = factor_kind(a_scaling), factor_kind(b_scaling)
    if a_kind is None and b_kind is None:
        return None, None, None
    a_amax, b_amax = (a_amax if a_kind else None), (b_amax if b_kind else None)
    has_alpha = "tensor" in (a_kind, b_kind)
    m = a_amax.shape[0] if a_kind == "token" else 0
    n = b_amax.shape[0] if b_kind == "token" else 0
    device = (b_amax if b_kind else a_amax).device
    first = int(has_alpha)
    out = torch.empty((first + m + n,), dtype=torch.float32, device=device)
    alpha = out[:1] if has_alpha else None
    row = out[first:first + m] if a_kind == "token" else None
    col = out[first + m:] if b_kind == "token" else None
    if (row is not None and m == 0) or (col is not None and n == 0):
        return alpha, row, col  # an empty GEMM: nothing to compute
    factors_launcher(a_kind, b_kind, a_e4m3_max, b_e4m3_max, arch)(a_amax, b_amax, alpha, row,
                                                                   col)
    return alpha, row, col


def factors_launcher(a_kind: Optional[str], b_kind: Optional[str], a_e4m3_max: int,
                     b_e4m3_max: int, arch: str):
    """The compiled EpilogueFactors (its TVM-FFI function) for factor kinds a_kind / b_kind
    (`factor_kind`), called with (a_amax, b_amax, alpha, row, col), absent ones None."""
    key = ("epilogue_factors", a_kind, b_kind, a_e4m3_max, b_e4m3_max)

    def build():
        op, args = factors_kernel(a_kind, b_kind, a_e4m3_max, b_e4m3_max)
        return compile_kernel(op, *args, arch=arch)

    return KERNELS.ffi(key, build)


# WindowFactors: tiles of 32 rows x 32 windows, 8 rows of threads (4 elements each)
WINDOW_TILE, WINDOW_TILE_ROWS = 32, 8


class WindowFactors:
    """The window64 decode factors S_dec(amax) (`decode_outer_scale`, ref.formats.decode_scale
    bit for bit) of window amaxes [rows, W] into out [W, rows_pad] (rows_pad >= rows; the
    padding gets 0): transposed, so that out.t() is the [rows_pad, W] view with contiguous rows
    whose [rows] k-tile vectors the window64 GEMMs load by TMA. A CTA transposes a tile of 32
    rows x 32 windows through shared memory, so that both the amax reads (32 windows of a row)
    and the stores (32 rows of a window) are 128-byte lines; one thread per output element
    read the amaxes 4 bytes per row instead (8.6 us at 8192 x 128 windows on the H200)."""

    def __init__(self, e4m3_max: int):
        self.e4m3_max = float(e4m3_max)

    @cute.jit
    def __call__(self, mAmax: cute.Tensor, mOut: cute.Tensor, stream):
        self.shared_storage = padded_tile_storage(cutlass.Float32, WINDOW_TILE, WINDOW_TILE)
        grid = (cute.ceil_div(mOut.shape[1], WINDOW_TILE),
                cute.ceil_div(mOut.shape[0], WINDOW_TILE), 1)
        self.kernel(mAmax, mOut).launch(grid=grid, block=(WINDOW_TILE, WINDOW_TILE_ROWS, 1),
                                        stream=stream)

    @cute.kernel
    def kernel(self, mAmax: cute.Tensor, mOut: cute.Tensor):
        tx, ty, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        tile = padded_tile(smem.allocate(self.shared_storage), WINDOW_TILE, WINDOW_TILE)
        r0, w0 = bx * WINDOW_TILE, by * WINDOW_TILE
        for j in cutlass.range_constexpr(WINDOW_TILE // WINDOW_TILE_ROWS):
            rr = ty + j * WINDOW_TILE_ROWS
            v = cutlass.Float32(0.0)
            if r0 + rr < mAmax.shape[0] and w0 + tx < mAmax.shape[1]:
                v = decode_outer_scale(mAmax[r0 + rr, w0 + tx], self.e4m3_max)
            tile[rr, tx] = v
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(WINDOW_TILE // WINDOW_TILE_ROWS):
            ww = ty + j * WINDOW_TILE_ROWS
            if w0 + ww < mOut.shape[0] and r0 + tx < mOut.shape[1]:
                mOut[w0 + ww, r0 + tx] = tile[tx, ww]


def window_factors(amax: torch.Tensor, e4m3_max: int, arch: str) -> torch.Tensor:
    """S_dec per 1x64 window (FP32 amax [rows, W] on a CUDA device, contiguous) as the
    [rows padded to 4, W] FP32 view with contiguous rows that the window64 GEMMs read (padding
    rows 0), in one launch (`WindowFactors`)."""
    rows, windows = amax.shape
    rows_pad = -(-rows // 4) * 4
    out = torch.empty((windows, rows_pad), dtype=torch.float32, device=amax.device)
    if out.numel():
        def build():
            op = WindowFactors(e4m3_max)
            args = (fake_tensor(cutlass.Float32, (dyn(), dyn()), align=4),
                    fake_tensor(cutlass.Float32, (dyn(), dyn(4)), align=16), env_stream())
            return compile_kernel(op, *args, arch=arch)

        KERNELS.ffi(("window_factors", e4m3_max, arch), build)(amax, out)
    return out.t()


def amax_roles(a_kind: Optional[str], b_kind: Optional[str]):
    """Which operand's outer amaxes ("a", "b" or None) the GEMM kernels take as alpha, row and
    col for factor kinds a_kind / b_kind (`factor_kind`), decoding them to 1 / S_enc
    themselves: a per-token side gives row (a) or col (b), the one per-tensor side alpha.
    None when both sides are per tensor: alpha is then a product of two decode scales, which
    the factors kernel makes (`epilogue_factors`)."""
    if a_kind == "tensor" and b_kind == "tensor":
        return None
    roles = [None, None, None]
    for side, kind in (("a", a_kind), ("b", b_kind)):
        if kind == "tensor":
            roles[0] = side
        elif kind == "token":
            roles[1 if side == "a" else 2] = side
    return tuple(roles)


def epilogue_operands(a_scaling: str, a_amax: Optional[torch.Tensor], a_e4m3_max: int,
                      b_scaling: str, b_amax: torch.Tensor, b_e4m3_max: int, arch: str):
    """(alpha, row, col) for the CUDA GEMMs, equal to `ref.gemm.epilogue_factors` once
    decoded: where one operand makes a factor on its own (`amax_roles`) it is its amaxes as an
    `operands.OuterAmax`, decoded by the GEMM kernel itself (no launch here); only two
    per-tensor operands take the factors kernel (`epilogue_factors`, one launch)."""
    roles = amax_roles(factor_kind(a_scaling), factor_kind(b_scaling))
    if roles is None:
        return epilogue_factors(a_scaling, a_amax, a_e4m3_max, b_scaling, b_amax, b_e4m3_max,
                                arch)
    sides = {"a": (a_amax, a_e4m3_max), "b": (b_amax, b_e4m3_max)}
    return tuple(None if side is None else OuterAmax(*sides[side]) for side in roles)
