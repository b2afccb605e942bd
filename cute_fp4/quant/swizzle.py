"""Compact E4M3 block scales -> the 128x4 swizzled layout on the GPU (`ref.swizzle`
`swizzle_scales`, bit for bit).

Why a kernel: the TMA GEMM paths read swizzled scales only, and compact ones (the Recipe
default) were converted per call by the reference's torch ops: 35-65 us of host time and
18.5 us of GPU time for the scales of 8192 x 8192 weights, against 3.3 us of GPU time here
(H200, perf/results/logs/swizzle_session56_h200.md)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from ..common.jit import KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor
from ..common.ptx import st_global
from ..common.smem import padded_tile, padded_tile_storage
from ..ref.swizzle import swizzle_scales as ref_swizzle_scales
from ..ref.swizzle import swizzled_shape

# a CTA transposes 128 rows x 32 words (4 scales each) through shared memory
TILE_ROWS, TILE_WORDS, WARPS = 128, 32, 8


class SwizzleScales:
    """Scales [rows, cols] (cols % 4 == 0), read as 32-bit words [rows, W = cols / 4] -> out:
    the [pr * cols / 4] words of the padded swizzled buffer (`swizzled_shape`, padding rows
    0). A 512-byte atom holds rows r0 .. r0 + 127 x word w (4 scales); its 16-byte line l
    holds rows l, l + 32, l + 64, l + 96. A CTA reads 128 rows x 32 words (each warp
    instruction one 128-byte row segment) into shared memory, then writes its 32 atoms (each
    warp instruction one 512-byte atom, one 16-byte store per lane). Reading the lines
    directly, one instruction touched 32 rows: 21 us for 8192 x 512 scales (H200)."""

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, stream):
        self.shared_storage = padded_tile_storage(cutlass.Int32, TILE_ROWS, TILE_WORDS)
        grid = (cute.ceil_div(mIn.shape[1], TILE_WORDS), cute.ceil_div(mIn.shape[0], TILE_ROWS),
                1)
        self.kernel(mIn, mOut).launch(grid=grid, block=(32, WARPS, 1), stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor):
        lane, warp, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, words = mIn.shape
        smem = cutlass.memory.SmemAllocator()
        # the line reads (32 rows of one word): the padded pitch spans the 32 banks
        tile = padded_tile(smem.allocate(self.shared_storage), TILE_ROWS, TILE_WORDS)
        r0, w0 = by * TILE_ROWS, bx * TILE_WORDS
        for j in cutlass.range_constexpr(TILE_ROWS // WARPS):
            rr = j * WARPS + warp
            v = Int32(0)
            if r0 + rr < rows and w0 + lane < words:
                v = mIn[r0 + rr, w0 + lane]
            tile[rr, lane] = v
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(TILE_WORDS // WARPS):
            ww = j * WARPS + warp
            if w0 + ww < words:
                line = (by * words + w0 + ww) * 32 + lane
                st_global((mOut.iterator + line * 4).toint(),
                          *[tile[lane + 32 * q, ww] for q in range(4)], clobber=False)


def swizzle_kernel():
    """The compile-time op and fake arguments of SwizzleScales."""
    return SwizzleScales(), (
        fake_tensor(cutlass.Int32, (dyn(), dyn()), align=4),
        fake_tensor(cutlass.Int32, (dyn(4),)),
        env_stream(),
    )


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """`ref.swizzle.swizzle_scales` on the GPU for CUDA scales ([rows, cols], 1-byte dtype,
    cols % 4 == 0, i.e. K % 64 == 0 for E4M3 block scales), the reference itself elsewhere
    (CPU tensors, and cols % 4 != 0, which the kernel's 4-byte reads do not take): the padded
    swizzled [R, C] of the same dtype."""
    if scales.dim() != 2 or scales.element_size() != 1:
        raise ValueError(f"swizzle_scales expects a 2D scale matrix of a 1-byte dtype, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    rows, cols = scales.shape
    if not scales.is_cuda or cols % 4:
        return ref_swizzle_scales(scales)
    if not scales.is_contiguous() or scales.data_ptr() % 4:
        scales = scales.clone(memory_format=torch.contiguous_format)
    out = torch.empty(swizzled_shape(rows, cols), dtype=torch.uint8, device=scales.device)
    if out.numel():
        arch = device_arch(scales.device)

        def build():
            op, args = swizzle_kernel()
            return compile_kernel(op, *args, arch=arch)

        KERNELS.ffi(("swizzle_scales", arch), build)(
            scales.view(torch.uint8).view(torch.int32), out.view(-1).view(torch.int32))
    return out.view(scales.dtype)
