"""Compact E4M3 block scales -> the 128x4 swizzled layout on the GPU (`ref.swizzle`
`swizzle_scales`, bit for bit).

Why a kernel: the TMA GEMM paths read swizzled scales only, and compact ones (the Recipe
default) were converted per call by the reference's torch ops: ~100 us of host time and
15-20 us of GPU time for 8192 x 8192 weights (H200, notes/gemm.md session 56)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint32

from ..common.jit import KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor
from ..common.ptx import st_global
from ..ref.swizzle import swizzle_scales as ref_swizzle_scales
from ..ref.swizzle import swizzled_shape

# a CTA: 8 warps on 8 neighbouring 4-column groups of one 128-row tile
GROUPS_PER_CTA = 8


class SwizzleScales:
    """Scales [rows, cols] (uint8, row-major) -> out: the [pr * pc / 4] 32-bit words of the
    padded swizzled buffer (`swizzled_shape`, padding 0). A 512-byte atom holds rows r0 ..
    r0 + 127 x columns c0 .. c0 + 3; its 16-byte line l holds rows l, l + 32, l + 64, l + 96
    (one word each, the 4 columns little-endian). One warp per atom, lane l writes line l
    with one 16-byte store; the 8 warps of a CTA take neighbouring column groups, so their
    byte loads of a row share 32-byte sectors."""

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, stream):
        groups = cute.ceil_div(mIn.shape[1], 4)
        grid = (cute.ceil_div(groups, GROUPS_PER_CTA), cute.ceil_div(mIn.shape[0], 128), 1)
        self.kernel(mIn, mOut).launch(grid=grid, block=(32, GROUPS_PER_CTA, 1), stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor):
        lane, wy, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        rows, cols = mIn.shape
        groups = (cols + 3) // 4
        group = bx * GROUPS_PER_CTA + wy
        if group < groups:
            words = []
            for j in cutlass.range_constexpr(4):
                r = by * 128 + j * 32 + lane
                word = Uint32(0)
                for c in cutlass.range_constexpr(4):
                    col = group * 4 + c
                    b = Uint32(0)
                    if r < rows and col < cols:
                        b = Uint32(mIn[r, col])
                    word = word | (b << (8 * c))
                words.append(word)
            line = (by * groups + group) * 32 + lane
            st_global((mOut.iterator + line * 4).toint(), *words, clobber=False)


def swizzle_kernel():
    """The compile-time op and fake arguments of SwizzleScales."""
    return SwizzleScales(), (
        fake_tensor(cutlass.Uint8, (dyn(), dyn()), align=1),
        fake_tensor(cutlass.Int32, (dyn(4),)),
        env_stream(),
    )


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """`ref.swizzle.swizzle_scales` on the GPU for CUDA scales ([rows, cols], 1-byte dtype),
    the reference itself elsewhere: the padded swizzled [R, C] of the same dtype."""
    if scales.dim() != 2 or scales.element_size() != 1:
        raise ValueError(f"swizzle_scales expects a 2D scale matrix of a 1-byte dtype, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if not scales.is_cuda:
        return ref_swizzle_scales(scales)
    pr, pc = swizzled_shape(*scales.shape)
    out = torch.empty((pr, pc), dtype=torch.uint8, device=scales.device)
    if out.numel():
        arch = device_arch(scales.device)

        def build():
            op, args = swizzle_kernel()
            return compile_kernel(op, *args, arch=arch)

        KERNELS.ffi(("swizzle_scales", arch), build)(
            scales.contiguous().view(torch.uint8), out.view(-1).view(torch.int32))
    return out.view(scales.dtype)
