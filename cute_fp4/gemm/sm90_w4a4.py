"""sm_90a NVFP4 x NVFP4 GEMM: decode to BF16 in shared memory, BF16 wgmma, FP32 accumulation.

D[m, n] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]), a and b the
E2M1 * E4M3 block values (SPEC section 3).

Per CTA (tile 128 x tile_n, K in steps of 64 = 4 NVFP4 blocks), 3 warpgroups:
- warpgroup 0, warp 0: TMA producer. Each pipeline stage holds the packed FP4 bytes of A
  [128, 32] and B [tile_n, 32] and their swizzled scale tiles (512 bytes per 128 rows x 4
  blocks: one tile of the SPEC 1 layout, contiguous in memory).
- warpgroups 1-2 (256 threads): decode and MMA. While the wgmmas of k-tile i run on BF16
  buffer i % 2, the same threads decode k-tile i + 1 (both operands, scale folded in, exact)
  into buffer (i + 1) % 2 (the 128B-swizzled K-major layout wgmma reads). One named barrier
  per k-tile orders "both warpgroups wrote buffer j" and "both warpgroups' wgmmas on the
  other buffer finished".
The decode permutes K inside each group of 8 identically for A and B (see
cute_fp4.common.decode), which leaves every dot product unchanged. Decoded values carry a
factor 2**-7 each, removed exactly in the FP32 epilogue (2**14).
Epilogue: FP32 alpha, row, col, bias, then the cast and predicated global stores (any M, N).

1x64 local-encode operands (window64): each k-tile of 64 is one window, so the per-window
FP32 decode factors (S_dec of A per row, of B per column; [rows, K/64], delivered by TMA with
the k-tile as [rows] vectors) scale whole k-tiles: the wgmmas of a k-tile accumulate into a
second register tile `part` (zeroed after each use), then acc += (wa[m] * wb[n]) * part.
The stage holding the factors is released after that update. Register budget: tile_n 128.
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.decode import (DECODE_EXP_SHIFT, decode_e2m1_pair, decode_e2m1x8,
                             e4m3_to_bf16x2_scale)
from .smem import ld_shared_u8, ld_shared_v2, st_shared_v4

TILE_M = 128
TILE_K = 64  # elements per k-tile: 4 NVFP4 blocks, 32 packed bytes, 128 BF16 bytes per row
SF_TILE_BYTES = 512  # one 128-row x 4-block tile of swizzled scales
ACC_UNSCALE = float(2 ** (2 * DECODE_EXP_SHIFT))


class Sm90GemmNVFP4:
    """Compile-time config: tile_n (128 or 256), pipeline stages, output dtype and which epilogue
    operands exist. `__call__` takes packed A [M, K/2], B [N, K/2] (uint8), swizzled scales of A
    and B as flat uint8 tensors, D [M, N] and the optional alpha [1], row [M], col [N],
    bias [N] tensors."""

    def __init__(
        self,
        out_dtype: Type[cutlass.Numeric],
        *,
        tile_n: int = 256,
        stages: int = 6,
        has_alpha: bool = False,
        has_row: bool = False,
        has_col: bool = False,
        has_bias: bool = False,
        has_a_window: bool = False,
        has_b_window: bool = False,
    ):
        if tile_n not in (128, 256):
            raise ValueError(f"tile_n must be 128 or 256, got {tile_n}")
        self.windowed = has_a_window or has_b_window
        if self.windowed and tile_n != 128:
            raise ValueError("window64 operands need tile_n 128 (two accumulator tiles)")
        self.out_dtype = out_dtype
        self.tile_n = tile_n
        self.stages = stages
        self.has_alpha = has_alpha
        self.has_row = has_row
        self.has_col = has_col
        self.has_bias = has_bias
        self.has_a_window = has_a_window
        self.has_b_window = has_b_window
        self.threads = 384
        self.producer_regs = 40
        self.consumer_regs = 232
        self.bar_decode = 1  # named barrier id among the 256 consumer threads

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mSFA: cute.Tensor,
        mSFB: cute.Tensor,
        mD: cute.Tensor,
        mAlpha: Optional[cute.Tensor],
        mRow: Optional[cute.Tensor],
        mCol: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],
        mAWin: Optional[cute.Tensor],
        mBWin: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        tile_n = self.tile_n
        m_rows = mA.shape[0]
        n_rows = mB.shape[0]
        k_tiles = cute.ceil_div(mA.shape[1], TILE_K // 2)
        # Swizzled scales: one 512-byte tile per (128 rows, k-tile), row-tile major; view as a
        # [128 bytes, 4 * tiles] matrix so that one TMA box (128, 4) is one tile.
        sfa = cute.make_tensor(
            mSFA.iterator,
            cute.make_layout((128, 4 * k_tiles * cute.ceil_div(m_rows, 128)), stride=(1, 128)),
        )
        sfb = cute.make_tensor(
            mSFB.iterator,
            cute.make_layout((128, 4 * k_tiles * cute.ceil_div(n_rows, 128)), stride=(1, 128)),
        )

        pk_a_layout = cute.make_layout((TILE_M, TILE_K // 2, self.stages),
                                       stride=(TILE_K // 2, 1, TILE_M * TILE_K // 2))
        pk_b_layout = cute.make_layout((tile_n, TILE_K // 2, self.stages),
                                       stride=(TILE_K // 2, 1, tile_n * TILE_K // 2))
        sf_a_layout = cute.make_layout((128, 4, self.stages), stride=(1, 128, SF_TILE_BYTES))
        sf_b_layout = cute.make_layout((128, 4, self.stages * (tile_n // 128)),
                                       stride=(1, 128, SF_TILE_BYTES))
        mma_tiler = (TILE_M, tile_n, TILE_K)
        b16_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, mma_tiler, cutlass.BFloat16, 2)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(
            g2s, mA, cute.select(pk_a_layout, mode=[0, 1]), (TILE_M, TILE_K // 2))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(
            g2s, mB, cute.select(pk_b_layout, mode=[0, 1]), (tile_n, TILE_K // 2))
        tma_sfa, tma_mSFA = cpasync.make_tiled_tma_atom(
            g2s, sfa, cute.select(sf_a_layout, mode=[0, 1]), (128, 4))
        tma_sfb, tma_mSFB = cpasync.make_tiled_tma_atom(
            g2s, sfb, cute.select(sf_b_layout, mode=[0, 1]), (128, 4))
        tx_bytes = (TILE_M + tile_n) * (TILE_K // 2) + SF_TILE_BYTES * (1 + tile_n // 128)
        # window64 decode factors: [rows, K/64] FP32 views (rows contiguous), one [rows] box
        # per (tile, k-tile)
        wa_layout = cute.make_layout((TILE_M, 1, self.stages), stride=(1, TILE_M, TILE_M))
        wb_layout = cute.make_layout((tile_n, 1, self.stages), stride=(1, tile_n, tile_n))
        tma_wa = tma_mWA = tma_wb = tma_mWB = None
        if const_expr(self.has_a_window):
            tma_wa, tma_mWA = cpasync.make_tiled_tma_atom(
                g2s, mAWin, cute.select(wa_layout, mode=[0, 1]), (TILE_M, 1))
            tx_bytes += TILE_M * 4
        if const_expr(self.has_b_window):
            tma_wb, tma_mWB = cpasync.make_tiled_tma_atom(
                g2s, mBWin, cute.select(wb_layout, mode=[0, 1]), (tile_n, 1))
            tx_bytes += tile_n * 4

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16,
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            Float32, (2, 1, 1), tiler_mn=(64, tile_n), a_source=warpgroup.OperandSource.RMEM)

        stages = self.stages

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sB16: cute.struct.Align[
                cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b16_layout)], 1024]
            sApk: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(pk_a_layout)], 128]
            sBpk: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(pk_b_layout)], 128]
            sSFA: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(sf_a_layout)], 128]
            sSFB: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(sf_b_layout)], 128]
            sWA: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(wa_layout)], 128]
            sWB: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(wb_layout)], 128]

        self.shared_storage = SharedStorage

        grid = (cute.ceil_div(m_rows, TILE_M), cute.ceil_div(n_rows, tile_n), 1)
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
            mD, mAlpha, mRow, mCol, mBias, tma_wa, tma_mWA, tma_wb, tma_mWB, tiled_mma,
            pk_a_layout, pk_b_layout, sf_a_layout, sf_b_layout, b16_layout, wa_layout,
            wb_layout, tx_bytes,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        mD: cute.Tensor,
        mAlpha: Optional[cute.Tensor],
        mRow: Optional[cute.Tensor],
        mCol: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],
        tma_wa: Optional[cute.CopyAtom],
        mAWin: Optional[cute.Tensor],
        tma_wb: Optional[cute.CopyAtom],
        mBWin: Optional[cute.Tensor],
        tiled_mma: cute.TiledMma,
        pk_a_layout: cute.Layout,
        pk_b_layout: cute.Layout,
        sf_a_layout: cute.Layout,
        sf_b_layout: cute.Layout,
        b16_layout: cute.ComposedLayout,
        wa_layout: cute.Layout,
        wb_layout: cute.Layout,
        tx_bytes: cutlass.Constexpr[int],
    ):
        tile_n = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_sfa)
            cpasync.prefetch_descriptor(tma_sfb)
            if const_expr(self.has_a_window):
                cpasync.prefetch_descriptor(tma_wa)
            if const_expr(self.has_b_window):
                cpasync.prefetch_descriptor(tma_wb)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        sApk = storage.sApk.get_tensor(pk_a_layout)
        sBpk = storage.sBpk.get_tensor(pk_b_layout)
        sSFA = storage.sSFA.get_tensor(sf_a_layout)
        sSFB = storage.sSFB.get_tensor(sf_b_layout)
        sB16 = storage.sB16.get_tensor(b16_layout.outer, swizzle=b16_layout.inner)
        sWA = storage.sWA.get_tensor(wa_layout)
        sWB = storage.sWB.get_tensor(wb_layout)

        k_tiles = cute.size(cute.ceil_div(mA.shape[1], TILE_K // 2))
        m_tile = bidx
        n_tile = bidy

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                # (TILE_M, 32, Mt, Kt) and friends
                gA = cute.local_tile(mA, (TILE_M, TILE_K // 2), (None, None))
                gB = cute.local_tile(mB, (tile_n, TILE_K // 2), (None, None))
                gSFA = cute.local_tile(mSFA, (128, 4), (0, None))
                gSFB = cute.local_tile(mSFB, (128, 4), (0, None))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_a, 0, cute.make_layout(1),
                    cute.group_modes(sApk, 0, 2), cute.group_modes(gA, 0, 2))
                tBsB, tBgB = cpasync.tma_partition(
                    tma_b, 0, cute.make_layout(1),
                    cute.group_modes(sBpk, 0, 2), cute.group_modes(gB, 0, 2))
                tAsSF, tAgSF = cpasync.tma_partition(
                    tma_sfa, 0, cute.make_layout(1),
                    cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2))
                tBsSF, tBgSF = cpasync.tma_partition(
                    tma_sfb, 0, cute.make_layout(1),
                    cute.group_modes(sSFB, 0, 2), cute.group_modes(gSFB, 0, 2))
                tWsA = tWgA = tWsB = tWgB = None
                if const_expr(self.has_a_window):
                    gWA = cute.local_tile(mAWin, (TILE_M, 1), (None, None))
                    tWsA, tWgA = cpasync.tma_partition(
                        tma_wa, 0, cute.make_layout(1),
                        cute.group_modes(sWA, 0, 2), cute.group_modes(gWA, 0, 2))
                if const_expr(self.has_b_window):
                    gWB = cute.local_tile(mBWin, (tile_n, 1), (None, None))
                    tWsB, tWgB = cpasync.tma_partition(
                        tma_wb, 0, cute.make_layout(1),
                        cute.group_modes(sWB, 0, 2), cute.group_modes(gWB, 0, 2))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.stages)
                for kt in cutlass.range(k_tiles, unroll=1):
                    mainloop.producer_acquire(state)
                    bar = mainloop.producer_get_barrier(state)
                    s = state.index
                    cute.copy(tma_a, tAgA[(None, m_tile, kt)], tAsA[(None, s)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tBgB[(None, n_tile, kt)], tBsB[(None, s)], tma_bar_ptr=bar)
                    cute.copy(tma_sfa, tAgSF[(None, m_tile * k_tiles + kt)], tAsSF[(None, s)],
                              tma_bar_ptr=bar)
                    for h in cutlass.range_constexpr(tile_n // 128):
                        cute.copy(
                            tma_sfb,
                            tBgSF[(None, (n_tile * (tile_n // 128) + h) * k_tiles + kt)],
                            tBsSF[(None, s * (tile_n // 128) + h)],
                            tma_bar_ptr=bar)
                    if const_expr(self.has_a_window):
                        cute.copy(tma_wa, tWgA[(None, m_tile, kt)], tWsA[(None, s)],
                                  tma_bar_ptr=bar)
                    if const_expr(self.has_b_window):
                        cute.copy(tma_wb, tWgB[(None, n_tile, kt)], tWsB[(None, s)],
                                  tma_bar_ptr=bar)
                    mainloop.producer_commit(state)
                    state.advance()
                mainloop.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            mma_wg = wg_idx - 1
            thr_mma = tiled_mma.get_slice(mma_wg * 128)
            tCsB = thr_mma.partition_B(sB16)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            # A lives in registers (RS wgmma): two k-tile buffers, selected statically
            a_shape = tiled_mma.get_slice(ctid).partition_A(
                cute.make_identity_tensor((TILE_M, TILE_K))).shape
            rA0 = cute.make_rmem_tensor(a_shape, cutlass.BFloat16)
            rA1 = cute.make_rmem_tensor(a_shape, cutlass.BFloat16)

            gD = cute.local_tile(mD, (TILE_M, tile_n), (m_tile, n_tile))
            tCgD = thr_mma.partition_C(gD)
            acc = cute.make_rmem_tensor(tCgD.shape, Float32)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            # window64: the wgmmas of one k-tile (= one window) go to `part`
            part = acc
            tCcT = None
            if const_expr(self.windowed):
                part = cute.make_rmem_tensor(tCgD.shape, Float32)
                part.fill(0.0)
                tCcT = tiled_mma.get_slice(ctid).partition_C(
                    cute.make_identity_tensor((TILE_M, tile_n)))

            # this thread's A fragment rows (wgmma m64 layout) and nibble pair
            t = ctid % 128
            lane = t % 32
            a_row0 = mma_wg * 64 + (t // 32) * 16 + lane // 4
            nib_shift = (lane % 4) * 4
            bases = (sApk.iterator.toint(), sBpk.iterator.toint(), sSFA.iterator.toint(),
                     sSFB.iterator.toint(), sB16.iterator.toint())

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            # window64: the stage of k-tile kt is released after its window update
            win_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                     self.stages)
            self.decode_stage(mainloop, state, ctid, bases, 0, rA0, a_row0, nib_shift)
            state.advance()
            self.sync_decoders()

            for kp in cutlass.range(cute.ceil_div(k_tiles, 2), unroll=1):
                kt = kp * 2
                self.mma_ktile(tiled_mma, part, rA0, tCrB, 0)
                if kt + 1 < k_tiles:
                    self.decode_stage(mainloop, state, ctid, bases, 1, rA1, a_row0, nib_shift)
                    state.advance()
                warpgroup.wait_group(0)
                if const_expr(self.windowed):
                    self.window_update(acc, part, tCcT, sWA, sWB, win_state.index)
                    mainloop.consumer_release(win_state)
                    win_state.advance()
                self.sync_decoders()
                if kt + 1 < k_tiles:
                    self.mma_ktile(tiled_mma, part, rA1, tCrB, 1)
                    if kt + 2 < k_tiles:
                        self.decode_stage(mainloop, state, ctid, bases, 0, rA0, a_row0,
                                          nib_shift)
                        state.advance()
                    warpgroup.wait_group(0)
                    if const_expr(self.windowed):
                        self.window_update(acc, part, tCcT, sWA, sWB, win_state.index)
                        mainloop.consumer_release(win_state)
                        win_state.advance()
                    self.sync_decoders()

            # the accumulator fragment is per thread: partition D by the consumer thread index
            self.epilogue(acc, tiled_mma.get_slice(ctid), mD, mAlpha, mRow, mCol, mBias, m_tile,
                          n_tile)

    @cute.jit
    def sync_decoders(self):
        """Decoded BF16 stores -> visible to wgmma (async proxy), across both consumer
        warpgroups."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=self.bar_decode, number_of_threads=256)

    @cute.jit
    def mma_ktile(self, tiled_mma, acc, rA, tCrB, buf: cutlass.Constexpr[int]):
        """The four k16 wgmmas of a k-tile, accumulating into `acc`."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(TILE_K // 16):
            cute.gemm(tiled_mma, acc, rA[(None, None, kb)], tCrB[(None, None, kb, buf)], acc)
        warpgroup.commit_group()

    @cute.jit
    def window_update(self, acc, part, tCcT, sWA, sWB, s):
        """acc += (wa[m] * wb[n]) * part with the window factors of pipeline stage `s`;
        part = 0."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcT[i]
            if const_expr(self.has_a_window and self.has_b_window):
                f = sWA[m, 0, s] * sWB[n, 0, s]
            elif const_expr(self.has_a_window):
                f = sWA[m, 0, s]
            else:
                f = sWB[n, 0, s]
            acc[i] = acc[i] + f * part[i]
            part[i] = Float32(0.0)

    @cute.jit
    def decode_stage(self, mainloop, state, ctid, bases, buf: cutlass.Constexpr[int], rA,
                     a_row0, nib_shift):
        """Decode pipeline stage `state`: B into BF16 smem buffer `buf`, this thread's A
        fragment into the registers `rA`. Releases the stage unless windowed (its window
        factors are read after the MMAs)."""
        tile_n = self.tile_n
        apk_base, bpk_base, sfa_base, sfb_base, b16_base = bases
        mainloop.consumer_wait(state)
        s = state.index
        # A: per k16 block, rows a_row0 and a_row0 + 8, nibble pair (lane % 4) of both words
        rA32 = cute.recast_tensor(rA, Int32)
        a_pk = apk_base + s * (TILE_M * TILE_K // 2)
        a_sf = sfa_base + s * SF_TILE_BYTES
        for kb in cutlass.range_constexpr(TILE_K // 16):
            for h in cutlass.range_constexpr(2):
                row = a_row0 + 8 * h
                w0, w1 = ld_shared_v2(a_pk + row * (TILE_K // 2) + kb * 8)
                sf = ld_shared_u8(a_sf + (row & 31) * 16 + (row >> 5) * 4 + kb)
                scale2 = e4m3_to_bf16x2_scale(sf)
                rA32[kb * 4 + h] = decode_e2m1_pair(w0, nib_shift, scale2)
                rA32[kb * 4 + 2 + h] = decode_e2m1_pair(w1, nib_shift, scale2)
        # B: (row, block) units of 16 values spread over the 256 consumer threads
        for i in cutlass.range_constexpr(tile_n * 4 // 256):
            u = ctid + 256 * i
            row = u >> 2
            blk = u & 3
            r = row & 127
            pk_addr = bpk_base + s * (tile_n * TILE_K // 2)
            sf_addr = sfb_base + (s * (tile_n // 128) + (row >> 7)) * SF_TILE_BYTES
            w0, w1 = ld_shared_v2(pk_addr + row * (TILE_K // 2) + blk * 8)
            sf = ld_shared_u8(sf_addr + (r & 31) * 16 + (r >> 5) * 4 + blk)
            scale2 = e4m3_to_bf16x2_scale(sf)
            p0, p1, p2, p3 = decode_e2m1x8(w0, scale2)
            q0, q1, q2, q3 = decode_e2m1x8(w1, scale2)
            # 128B-swizzled K-major row: 16-byte chunk c of row `row` at chunk c ^ (row % 8)
            row_addr = b16_base + buf * (tile_n * TILE_K * 2) + row * (TILE_K * 2)
            sw = row & 7
            st_shared_v4(row_addr + (((blk * 2) ^ sw) << 4), p0, p1, p2, p3)
            st_shared_v4(row_addr + (((blk * 2 + 1) ^ sw) << 4), q0, q1, q2, q3)
        if const_expr(not self.windowed):
            mainloop.consumer_release(state)

    @cute.jit
    def epilogue(self, acc, thr_mma, mD, mAlpha, mRow, mCol, mBias, m_tile, n_tile):
        tile_n = self.tile_n
        m_rows, n_cols = mD.shape
        cD = cute.make_identity_tensor(mD.shape)
        tCcD = thr_mma.partition_C(cute.local_tile(cD, (TILE_M, tile_n), (m_tile, n_tile)))
        tCgD = thr_mma.partition_C(cute.local_tile(mD, (TILE_M, tile_n), (m_tile, n_tile)))
        scale = Float32(ACC_UNSCALE)
        if const_expr(self.has_alpha):
            scale = scale * mAlpha[0].to(Float32)
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcD[i]
            if m < m_rows and n < n_cols:
                v = acc[i] * scale
                if const_expr(self.has_row):
                    v = v * mRow[m].to(Float32)
                if const_expr(self.has_col):
                    v = v * mCol[n].to(Float32)
                if const_expr(self.has_bias):
                    v = v + mBias[n].to(Float32)
                tCgD[i] = v.to(self.out_dtype)
