"""sm_90a GEMM of 1x64 local-encode (window64) NVFP4 operands: both operands decoded once to
BF16 block values, SS wgmma, FP32 window factors applied per k-tile.

D[m, n] = cast(alpha * row[m] * col[n] * sum_w wa[m, w] * wb[n, w] * P_w[m, n] + bias[n]),
P_w = sum over window w (64 K values = one k-tile) of a[m, k] * b[n, k] with a, b the e2m1 * e4m3
block values, wa / wb the FP32 window decode factors S_dec (absent ones 1). The factors are not
exact in BF16, so they cannot be folded into a wgmma operand: each k-tile's wgmmas write a
register tile of their own (`part`), which is then added to the accumulator with its factors.

Why both operands predecoded: with an operand decoded in registers (`sm90_mixed`) each warp
spends its issue slots on that decode and on the window update, one after the other, behind a
wgmma.wait of depth 0 per k-tile (H200, 8192^3: 0.47x cuBLAS BF16). Here the MMA warps only
issue wgmmas and update: the wgmmas of k-tile i go to part buffer i % 2 while the update of
k-tile i - 1 reads the other one (wait depth 1), so the FP32 update overlaps the tensor cores.
Cost: a pre-pass decoding both operands (`predecode_nvfp4`, 2 bytes per element written and
read back) and BF16 operand traffic in the GEMM, as cuBLAS BF16 has.

Per CTA (persistent, tiles of 128 x tile_n, p fastest): warpgroup 0 warp 0 issues the TMA
loads of a stage (x [128, 64] and y [tile_n, 64] BF16, 128B-swizzled K-major, and the [128] /
[tile_n] window factor vectors of the k-tile); warpgroups 1-2 own 64 rows each. Both operands
are in the kernel K order of `sm90_mixed` (`kperm64`): the same permutation on both sides
leaves every dot product unchanged. Decoded values carry 2**-7 each, removed in the epilogue
(`Sm90Epilogue.epilogue_staged`: alpha, row, col, bias, cast, coalesced stores).
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.jit import KERNELS, compile_kernel, dyn, env_stream, fake_tensor, num_sms, \
    torch_to_cutlass
from .parts import (epilogue_fakes, prefetch_tma, tma_slices, window_fake, window_slices,
                    window_update)
from .sm90_mixed import (SMEM_BYTES, TILE_K, TILE_M, UNSCALE_W4A4, Sm90Gemm, predecode_nvfp4,
                         smem_array, staging_bytes, tma_load)

WINDOW_TILE_NS = (64, 128)


class Sm90GemmWindow(Sm90Gemm):
    """Compile-time config: tile_n (WINDOW_TILE_NS), stages, output dtype, the epilogue operands
    present, vec_store (D 16-byte aligned), num_ctas (the SM count), windows (whether x and y
    have window factors; at least one).
    `__call__` takes x [P, K'] and y [Q, K'] BF16 block values in the kernel K order
    (`predecode_nvfp4`; K' = K rounded up to 64), D [M, N] = [P, Q], the optional alpha [1], row [M], col [N], bias [N] and the window factors of x and y
    ([rows padded to 4, K/64] FP32 with the rows contiguous, `dispatch._window_factors`)."""

    def __init__(self, out_dtype: Type[cutlass.Numeric], *, tile_n: int = 128, stages: int = 4,
                 has_alpha: bool = False, has_row: bool = False, has_col: bool = False,
                 has_bias: bool = False, vec_store: bool = False, num_ctas: int = 132,
                 windows=(True, True), decode=(None, None, None)):
        if tile_n not in WINDOW_TILE_NS:
            raise ValueError(f"tile_n must be one of {WINDOW_TILE_NS}, got {tile_n}")
        if not any(windows):
            raise ValueError("Sm90GemmWindow needs at least one window64 operand")
        most = window_max_stages(tile_n, out_dtype.width // 8)
        if stages < 2 or stages > most:
            raise ValueError(f"stages must be 2..{most} for tile_n {tile_n} and "
                             f"{out_dtype.__name__} output, got {stages}")
        # consumers: acc + two part tiles (3 x 64 FP32 at tile_n 128)
        super().__init__(out_dtype, tile_n, stages,
                         (has_alpha, has_row, has_col, has_bias, decode),
                         producer_regs=40, consumer_regs=232)
        self.x_window, self.y_window = (bool(w) for w in windows)
        self.transposed = False
        self.unscale_exp = UNSCALE_W4A4  # both operands are decoded NVFP4 block values
        self.vec_store = vec_store
        self.num_ctas = num_ctas

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mD: cute.Tensor,
                 mAlpha: Optional[cute.Tensor], mRow: Optional[cute.Tensor],
                 mCol: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                 mXWin: Optional[cute.Tensor], mYWin: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        tile_n = self.tile_n
        tiles = cute.ceil_div(mX.shape[0], TILE_M) * cute.ceil_div(mY.shape[0], tile_n)
        mma_tile = (TILE_M, tile_n, TILE_K)
        x_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, mma_tile,
                                                 cutlass.BFloat16, self.stages)
        y_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, mma_tile,
                                                 cutlass.BFloat16, self.stages)
        tma_x, tma_mX = tma_load(mX, x_layout, (TILE_M, TILE_K))
        tma_y, tma_mY = tma_load(mY, y_layout, (tile_n, TILE_K))
        tx_bytes = (TILE_M + tile_n) * TILE_K * 2
        # the window factors: one [rows] box per (tile, k-tile), with the stage
        wx_layout = cute.make_layout((TILE_M, 1, self.stages), stride=(1, TILE_M, TILE_M))
        wy_layout = cute.make_layout((tile_n, 1, self.stages), stride=(1, tile_n, tile_n))
        arrays = dict(sX=smem_array(cutlass.BFloat16, cute.cosize(x_layout), 1024),
                      sY=smem_array(cutlass.BFloat16, cute.cosize(y_layout), 1024),
                      sD=smem_array(cutlass.Uint8, self.staging_bytes()))
        tma_wx = tma_mWX = tma_wy = tma_mWY = None
        if const_expr(self.x_window):
            tma_wx, tma_mWX = tma_load(mXWin, wx_layout, (TILE_M, 1))
            tx_bytes += TILE_M * 4
            arrays["sWX"] = smem_array(Float32, cute.cosize(wx_layout))
        if const_expr(self.y_window):
            tma_wy, tma_mWY = tma_load(mYWin, wy_layout, (tile_n, 1))
            tx_bytes += tile_n * 4
            arrays["sWY"] = smem_array(Float32, cute.cosize(wy_layout))
        self.set_shared_storage(**arrays)
        # two copies: one that overwrites its accumulators (a k-tile's first wgmma), one that
        # adds (set once in the kernel: a field set inside the k-loop would flow out of it)
        tiled_mmas = tuple(sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(), Float32, (2, 1, 1),
            tiler_mn=(64, tile_n)) for _ in range(2))
        self.kernel(
            tma_x, tma_mX, tma_y, tma_mY, mD, (mAlpha, mRow, mCol, mBias), tma_wx, tma_mWX,
            tma_wy, tma_mWY, tiled_mmas[0], tiled_mmas[1],
            (x_layout, y_layout, wx_layout, wy_layout), tx_bytes,
        ).launch(grid=(cutlass.min(tiles, self.num_ctas), 1, 1), block=[self.threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_y: cute.CopyAtom,
               mY: cute.Tensor, mD: cute.Tensor, epi: tuple,
               tma_wx: Optional[cute.CopyAtom], mWX: Optional[cute.Tensor],
               tma_wy: Optional[cute.CopyAtom], mWY: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, mma_first: cute.TiledMma, layouts: tuple,
               tx_bytes: cutlass.Constexpr[int]):
        tile_n = self.tile_n
        x_layout, y_layout, wx_layout, wy_layout = layouts
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            prefetch_tma(tma_x, tma_y, tma_wx, tma_wy)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = self.make_mainloop(storage, 8, tx_bytes)
        sX = storage.sX.get_tensor(x_layout.outer, swizzle=x_layout.inner)
        sY = storage.sY.get_tensor(y_layout.outer, swizzle=y_layout.inner)
        sWX = sWY = None
        if const_expr(self.x_window):
            sWX = storage.sWX.get_tensor(wx_layout)
        if const_expr(self.y_window):
            sWY = storage.sWY.get_tensor(wy_layout)
        k_tiles = cute.size(cute.ceil_div(mX.shape[1], TILE_K))
        p_tiles = cute.ceil_div(mX.shape[0], TILE_M)
        tiles = p_tiles * cute.ceil_div(mY.shape[0], tile_n)
        my_tiles = (tiles - bid + n_ctas - 1) // n_ctas

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                tWsX, tWgX = window_slices(tma_wx, sWX, mWX, TILE_M)
                tWsY, tWgY = window_slices(tma_wy, sWY, mWY, tile_n)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.stages)
                for i in cutlass.range(my_tiles, unroll=1):
                    p_tile, q_tile = self.tile_coords(bid + i * n_ctas, p_tiles)
                    tXsX, tXgX = tma_slices(
                        tma_x, sX, cute.local_tile(mX, (TILE_M, TILE_K), (p_tile, None)))
                    tYsY, tYgY = tma_slices(
                        tma_y, sY, cute.local_tile(mY, (tile_n, TILE_K), (q_tile, None)))
                    for kt in cutlass.range(k_tiles, unroll=1):
                        mainloop.producer_acquire(state)
                        bar = mainloop.producer_get_barrier(state)
                        s = state.index
                        cute.copy(tma_x, tXgX[(None, kt)], tXsX[(None, s)], tma_bar_ptr=bar)
                        cute.copy(tma_y, tYgY[(None, kt)], tYsY[(None, s)], tma_bar_ptr=bar)
                        if const_expr(self.x_window):
                            cute.copy(tma_wx, tWgX[(None, p_tile, kt)], tWsX[(None, s)],
                                      tma_bar_ptr=bar)
                        if const_expr(self.y_window):
                            cute.copy(tma_wy, tWgY[(None, q_tile, kt)], tWsY[(None, s)],
                                      tma_bar_ptr=bar)
                        mainloop.producer_commit(state)
                        state.advance()
                mainloop.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            mma_wg = wg_idx - 1
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            mma_first.set(warpgroup.Field.ACCUMULATE, False)
            mmas = (mma_first, tiled_mma)
            thr_mma = tiled_mma.get_slice(mma_wg * 128)
            tCrX = tiled_mma.make_fragment_A(thr_mma.partition_A(sX))
            tCrY = tiled_mma.make_fragment_B(thr_mma.partition_B(sY))
            tCcT = tiled_mma.get_slice(ctid).partition_C(
                cute.make_identity_tensor((TILE_M, tile_n)))
            acc = cute.make_rmem_tensor(tCcT.shape, Float32)
            # k-tile kl's wgmmas write parts[kl % 2] (the first of them overwrites it)
            parts = [cute.make_rmem_tensor(tCcT.shape, Float32) for _ in range(2)]
            windows = (sWX, sWY)
            for i in cutlass.range(my_tiles, unroll=1):
                p_tile, q_tile = self.tile_coords(bid + i * n_ctas, p_tiles)
                g0 = i * k_tiles  # pipeline position of this tile's first k-tile
                acc.fill(0.0)
                # uniform control flow between a wgmma and the update that reads its part
                # (ptxas serializes the wgmmas where it cannot prove the wait): k-tile 0, then
                # pairs (2q + 1, 2q + 2), then the last one when k_tiles is even
                self.mma_ktile(mmas, mainloop, g0, parts[0], tCrX, tCrY)
                for kq in cutlass.range((k_tiles - 1) // 2, unroll=1):
                    kl = g0 + 2 * kq
                    self.mma_ktile(mmas, mainloop, kl + 1, parts[1], tCrX, tCrY)
                    warpgroup.wait_group(1)
                    self.finish_ktile(mainloop, kl, acc, parts[0], tCcT, windows)
                    self.mma_ktile(mmas, mainloop, kl + 2, parts[0], tCrX, tCrY)
                    warpgroup.wait_group(1)
                    self.finish_ktile(mainloop, kl + 1, acc, parts[1], tCcT, windows)
                last = g0 + k_tiles - 1
                if k_tiles % 2 == 0:
                    self.mma_ktile(mmas, mainloop, last, parts[1], tCrX, tCrY)
                    warpgroup.wait_group(1)
                    self.finish_ktile(mainloop, last - 1, acc, parts[0], tCcT, windows)
                    warpgroup.wait_group(0)
                    self.finish_ktile(mainloop, last, acc, parts[1], tCcT, windows)
                else:
                    warpgroup.wait_group(0)
                    self.finish_ktile(mainloop, last, acc, parts[0], tCcT, windows)
                self.epilogue_staged(acc, tiled_mma.get_slice(ctid), mD, epi, p_tile, q_tile,
                                     storage.sD.data_ptr(), mma_wg, ctid % 128)

    def mma_ktile(self, mmas, mainloop, kt, part, tCrX, tCrY):
        """Wait for the CTA's kt-th k-tile and issue its four k16 wgmmas into `part`: the first
        with mmas[0] (overwrites), the others with mmas[1] (adds). Plain Python at trace
        time."""
        state = self.consumer_state(kt)
        mainloop.consumer_wait(state)
        s = state.index
        warpgroup.fence()
        for kb in range(TILE_K // 16):
            cute.gemm(mmas[min(kb, 1)], part, tCrX[(None, None, kb, s)], tCrY[(None, None, kb, s)],
                      part)
        warpgroup.commit_group()

    def finish_ktile(self, mainloop, kt, acc, part, coords, windows):
        """acc += the window-scaled products of the CTA's kt-th k-tile (`part`, complete),
        then release its stage (which holds its window factors). Plain Python at trace
        time."""
        sWX, sWY = windows
        state = self.consumer_state(kt)
        window_update(acc, part, coords, sWX, sWY, state.index, self.x_window, self.y_window)
        mainloop.consumer_release(state)


def window_max_stages(tile_n: int, out_elt: int) -> int:
    """The deepest pipeline (at most 8) that fits next to the epilogue's staging buffer."""
    stage = (TILE_M + tile_n) * (TILE_K * 2 + 4)
    return min(8, (SMEM_BYTES - staging_bytes(tile_n, out_elt, False)) // stage)


def window_kernel(out_dtype, tile_n, stages, flags, bias_dtype, vec_store, num_ctas, windows,
                  decode=(None, None, None)):
    """The compile-time op and fake arguments of one Sm90GemmWindow configuration."""
    has_alpha, has_row, has_col, has_bias = flags
    op = Sm90GemmWindow(torch_to_cutlass(out_dtype), tile_n=tile_n, stages=stages,
                        has_alpha=has_alpha, has_row=has_row, has_col=has_col,
                        has_bias=has_bias, vec_store=vec_store, num_ctas=num_ctas,
                        windows=windows, decode=decode)
    elt = torch.empty((), dtype=out_dtype).element_size()
    m, n = dyn(), dyn(16 // elt) if vec_store else dyn()
    args = (
        fake_tensor(cutlass.BFloat16, (m, dyn(64))),
        fake_tensor(cutlass.BFloat16, (n, dyn(64))),
        fake_tensor(torch_to_cutlass(out_dtype), (m, n), align=16 if vec_store else elt),
        *epilogue_fakes(flags, bias_dtype, m, n),
        *(window_fake(present) for present in windows),
        env_stream(),
    )
    return op, args


def gemm_window_sm90(a_data: torch.Tensor, sfa: torch.Tensor, b_data: torch.Tensor,
                     sfb: torch.Tensor, a_win: Optional[torch.Tensor],
                     b_win: Optional[torch.Tensor], alpha, row, col, bias, out: torch.Tensor,
                     decode, arch: str) -> torch.Tensor:
    """D = out [M, N] for packed operands a_data [M, K/2], b_data [N, K/2] with flat swizzled
    scales, their window factors (`dispatch._window_factors`, at least one) and the epilogue
    operands as `operands._epilogue` returns them: both operands decoded to BF16 block values
    (two temporaries of (M + N) x K BF16), then Sm90GemmWindow."""
    flags = (alpha is not None, row is not None, col is not None, bias is not None)
    vec_store = (out.shape[1] * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
    fn = window_launcher(out.shape[1], out.dtype, flags, bias.dtype if bias is not None else None,
                         vec_store, (a_win is not None, b_win is not None), decode,
                         num_sms(out.device), arch)
    fn(predecode_nvfp4(a_data, sfa, arch), predecode_nvfp4(b_data, sfb, arch), out, alpha, row,
       col, bias, a_win, b_win)
    return out


def window_launcher(n: int, out_dtype: torch.dtype, flags, bias_dtype, vec_store: bool,
                    windows, decode, sms: int, arch: str):
    """The compiled Sm90GemmWindow (its TVM-FFI function) for N columns of D: tile_n 64 up to
    64 columns, else 128, the deepest pipeline that fits. flags: which of alpha, row, col,
    bias exist; windows: whether x / y have window factors. Called with (x, y, out, alpha,
    row, col, bias, x_window, y_window)."""
    tile_n = 64 if n <= 64 else 128
    stages = window_max_stages(tile_n, out_dtype.itemsize)
    windows = tuple(bool(w) for w in windows)
    key = ("gemm_window_sm90", out_dtype, tile_n, stages, flags, bias_dtype, vec_store, sms,
           windows, decode)

    def build():
        op, args = window_kernel(out_dtype, tile_n, stages, flags, bias_dtype, vec_store, sms,
                                 windows, decode)
        return compile_kernel(op, *args, arch=arch)

    return KERNELS.ffi(key, build)
