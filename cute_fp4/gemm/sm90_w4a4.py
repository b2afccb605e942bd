"""sm_90a NVFP4 x NVFP4 GEMM: decode to BF16 in shared memory, BF16 wgmma, FP32 accumulation.

D[m, n] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]), a and b the
E2M1 * E4M3 block values (SPEC section 3).

Per CTA (tile 128 x tile_n, K in steps of 64 = 4 NVFP4 blocks), 3 warpgroups that advance
one k-tile per step in lockstep (one named barrier over all 384 threads per step):
- warpgroup 0: warp 0 issues the TMA loads (`PipelineTmaAsync`, `stages` deep; each stage holds
  the packed FP4 bytes of A [128, 32] and B [tile_n, 32] and their swizzled scale tiles, 512
  bytes per 128 rows x 4 blocks: one tile of the SPEC 1 layout, contiguous in memory); all
  four warps decode B into BF16 (their share below).
- warpgroups 1-2 (256 threads): RS wgmma (A from registers, B from the BF16 smem buffer). While
  the wgmmas of k-tile i run on buffer i % 3, these threads decode the A fragment of k-tile
  i + 1 into registers and, with tile_n 256, half of its B rows; warpgroup 0 decodes the rest
  of B into buffer (i + 1) % 3. The wgmmas of k-tile i stay in flight across the barrier (wait
  depth 1), so the tensor cores do not drain between k-tiles; three buffers make the buffer
  being decoded one that no running wgmma reads.
K order: inside a k-tile each packed row is 8 words of 8 codes (word j = k 8j..8j+7, block
j // 2). Word j contributes the pairs (v_i, v_i+4), i = 0..3, of `decode_e2m1x8`; pair i of
word j sits at k16 step i, positions 8 (j // 4) + 2 (j % 4) + {0, 1}. So a wgmma A-fragment
thread (lane % 4 = c) needs words c and 4 + c of its two rows, and a 16-byte half h of a B row
(words 4h..4h+3) fills the 16-byte chunks 2i + h of its BF16 row. A and B share the
permutation, which leaves every dot product unchanged. Decoded values carry a factor 2**-7
each, removed exactly in the FP32 epilogue (2**14).
Epilogue (`sm90_mixed.Sm90Epilogue`): FP32 alpha, row, col, bias, then the cast and predicated
global stores (any M, N).

1x64 local-encode operands (window64): each k-tile of 64 is one window, so the per-window
FP32 decode factors (S_dec of A per row, of B per column; [rows, K/64], delivered by TMA with
the k-tile as [rows] vectors) scale whole k-tiles: the wgmmas of a k-tile accumulate into a
second register tile `part` (zeroed after each use), then acc += (wa[m] * wb[n]) * part.
The MMA warpgroups release the stage holding the factors after that update (wait depth 0
here). Register budget: tile_n 128.
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.decode import DECODE_EXP_SHIFT, decode_e2m1x8, e4m3_to_bf16x2_scale
from ..common.ptx import ld_shared, st_shared
from .parts import prefetch_tma, tma_slices, window_slices, window_update
from .sm90_mixed import (SF_TILE_BYTES, TILE_K, TILE_M, Sm90Gemm, a_fragment_offsets,
                         decode_a_fragment, extents, packed_stages, rs_tiled_mma, scale_stages,
                         scale_tiles, smem_array, tma_load)

BUFFERS = 3  # decoded k-tiles: one in the wgmmas still running, one in the next, one decoding


class Sm90GemmNVFP4(Sm90Gemm):
    """Compile-time config: tile_n (128 or 256), pipeline stages, output dtype and which epilogue
    operands exist. `__call__` takes packed A [M, K/2], B [N, K/2] (uint8), swizzled scales of A
    and B as flat uint8 tensors, D [M, N] and the optional alpha [1], row [M], col [N],
    bias [N] tensors."""

    def __init__(self, out_dtype: Type[cutlass.Numeric], *, tile_n: int = 256, stages: int = 6,
                 has_alpha: bool = False, has_row: bool = False, has_col: bool = False,
                 has_bias: bool = False, has_a_window: bool = False,
                 has_b_window: bool = False, decode=(None, None, None)):
        if tile_n not in (128, 256):
            raise ValueError(f"tile_n must be 128 or 256, got {tile_n}")
        # 72 * 128 + 216 * 256 <= 168 * 384
        super().__init__(out_dtype, tile_n, stages,
                         (has_alpha, has_row, has_col, has_bias, decode), producer_regs=72, consumer_regs=216)
        self.windowed = has_a_window or has_b_window
        if self.windowed and tile_n != 128:
            raise ValueError("window64 operands need tile_n 128 (two accumulator tiles)")
        self.has_a_window = has_a_window
        self.has_b_window = has_b_window
        self.transposed = False
        self.unscale_exp = 2 * DECODE_EXP_SHIFT
        self.bar_decode = 1  # named barrier id of the per-k-tile step (all threads)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor,
                 mD: cute.Tensor, mAlpha: Optional[cute.Tensor], mRow: Optional[cute.Tensor],
                 mCol: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                 mAWin: Optional[cute.Tensor], mBWin: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        tile_n = self.tile_n
        m_rows, n_rows, k_tiles = extents(mA, mB)
        sfa = scale_tiles(mSFA, m_rows, k_tiles)
        sfb = scale_tiles(mSFB, n_rows, k_tiles)
        pk_a_layout = packed_stages(TILE_M, self.stages)
        pk_b_layout = packed_stages(tile_n, self.stages)
        sf_a_layout = scale_stages(self.stages)
        sf_b_layout = scale_stages(self.stages * (tile_n // 128))
        b16_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (TILE_M, tile_n, TILE_K), cutlass.BFloat16, BUFFERS)
        tma_a, tma_mA = tma_load(mA, pk_a_layout, (TILE_M, TILE_K // 2))
        tma_b, tma_mB = tma_load(mB, pk_b_layout, (tile_n, TILE_K // 2))
        tma_sfa, tma_mSFA = tma_load(sfa, sf_a_layout, (128, 4))
        tma_sfb, tma_mSFB = tma_load(sfb, sf_b_layout, (128, 4))
        tx_bytes = (TILE_M + tile_n) * (TILE_K // 2) + SF_TILE_BYTES * (1 + tile_n // 128)
        # window64 decode factors: [rows, K/64] FP32 views (rows contiguous), one [rows] box
        # per (tile, k-tile)
        wa_layout = cute.make_layout((TILE_M, 1, self.stages), stride=(1, TILE_M, TILE_M))
        wb_layout = cute.make_layout((tile_n, 1, self.stages), stride=(1, tile_n, tile_n))
        tma_wa = tma_mWA = tma_wb = tma_mWB = None
        if const_expr(self.has_a_window):
            tma_wa, tma_mWA = tma_load(mAWin, wa_layout, (TILE_M, 1))
            tx_bytes += TILE_M * 4
        if const_expr(self.has_b_window):
            tma_wb, tma_mWB = tma_load(mBWin, wb_layout, (tile_n, 1))
            tx_bytes += tile_n * 4
        tiled_mma = rs_tiled_mma(tile_n)
        self.set_shared_storage(
            sB16=smem_array(cutlass.BFloat16, cute.cosize(b16_layout), 1024),
            sApk=smem_array(cutlass.Uint8, cute.cosize(pk_a_layout)),
            sBpk=smem_array(cutlass.Uint8, cute.cosize(pk_b_layout)),
            sSFA=smem_array(cutlass.Uint8, cute.cosize(sf_a_layout)),
            sSFB=smem_array(cutlass.Uint8, cute.cosize(sf_b_layout)),
            sWA=smem_array(Float32, cute.cosize(wa_layout)),
            sWB=smem_array(Float32, cute.cosize(wb_layout)),
        )

        grid = (cute.ceil_div(m_rows, TILE_M), cute.ceil_div(n_rows, tile_n), 1)
        self.kernel(
            tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
            mD, (mAlpha, mRow, mCol, mBias), tma_wa, tma_mWA, tma_wb, tma_mWB, tiled_mma,
            (pk_a_layout, pk_b_layout, sf_a_layout, sf_b_layout, b16_layout, wa_layout,
             wb_layout), tx_bytes,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor,
               tma_sfb: cute.CopyAtom, mSFB: cute.Tensor, mD: cute.Tensor, epi: tuple,
               tma_wa: Optional[cute.CopyAtom], mAWin: Optional[cute.Tensor],
               tma_wb: Optional[cute.CopyAtom], mBWin: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, layouts: tuple, tx_bytes: cutlass.Constexpr[int]):
        tile_n = self.tile_n
        (pk_a_layout, pk_b_layout, sf_a_layout, sf_b_layout, b16_layout, wa_layout,
         wb_layout) = layouts
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            prefetch_tma(tma_a, tma_b, tma_sfa, tma_sfb, tma_wa, tma_wb)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = self.make_mainloop(storage, self.threads // 32, tx_bytes)

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

        bases = (sApk.iterator.toint(), sBpk.iterator.toint(), sSFA.iterator.toint(),
                 sSFB.iterator.toint(), sB16.iterator.toint())
        if wg_idx == 0:
            # TMA producer (warp 0) and B decoder (all four warps), in step with the MMA
            # warpgroups: the load of k-tile kt + stages - 1 is issued while k-tile kt runs,
            # into the stage that k-tile kt - 1 released one step earlier (never blocks)
            cute.arch.setmaxregister_decrease(self.producer_regs)
            gA = cute.local_tile(mA, (TILE_M, TILE_K // 2), (None, None))
            gB = cute.local_tile(mB, (tile_n, TILE_K // 2), (None, None))
            gSFA = cute.local_tile(mSFA, (128, 4), (0, None))
            gSFB = cute.local_tile(mSFB, (128, 4), (0, None))
            tAsA, tAgA = tma_slices(tma_a, sApk, gA)
            tBsB, tBgB = tma_slices(tma_b, sBpk, gB)
            tAsSF, tAgSF = tma_slices(tma_sfa, sSFA, gSFA)
            tBsSF, tBgSF = tma_slices(tma_sfb, sSFB, gSFB)
            tWsA, tWgA = window_slices(tma_wa, sWA, mAWin, TILE_M)
            tWsB, tWgB = window_slices(tma_wb, sWB, mBWin, tile_n)
            loads = (tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, tma_sfa, tAgSF, tAsSF, tma_sfb,
                     tBgSF, tBsSF, tma_wa, tWgA, tWsA, tma_wb, tWgB, tWsB)
            if warp_idx == 0:
                for kt in cutlass.range_constexpr(self.stages - 1):
                    if kt < k_tiles:
                        self.load_tile(mainloop, loads, Int32(kt), m_tile, n_tile, k_tiles)
            # this thread's B units: the other half of each of its rows (tile_n 256: rows
            # tidx and tidx + 128, the MMA threads decode the first halves); tile_n 128: both
            # halves of row tidx
            units = []
            for i in cutlass.range_constexpr(tile_n // 128):
                row = tidx + 128 * i
                first = (row >> 2) & 1
                halves = [first ^ 1] if tile_n == 256 else [first, first ^ 1]
                units.append((row, halves))
            self.decode_b(mainloop, self.consumer_state(0), bases, 0, units)
            mainloop.consumer_release(self.consumer_state(0))
            self.sync_decoders()
            for kq in cutlass.range(cute.ceil_div(k_tiles, BUFFERS), unroll=1):
                for j in cutlass.range_constexpr(BUFFERS):
                    kt = kq * BUFFERS + j
                    if kt < k_tiles:
                        if warp_idx == 0:
                            if kt + self.stages - 1 < k_tiles:
                                self.load_tile(mainloop, loads, kt + self.stages - 1, m_tile,
                                               n_tile, k_tiles)
                        if kt + 1 < k_tiles:
                            nxt_state = self.consumer_state(kt + 1)
                            self.decode_b(mainloop, nxt_state, bases, (j + 1) % BUFFERS,
                                          units)
                            mainloop.consumer_release(nxt_state)
                        self.sync_decoders()
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            mma_wg = wg_idx - 1
            # A lives in registers (RS wgmma): one k-tile buffer per B buffer, selected
            # statically
            thr_mma, tCrB, rA = self.mma_operands(tiled_mma, ctid, mma_wg, sB16, BUFFERS)

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

            # this thread's A fragment (a_fragment_offsets); its B unit (tile_n 256): the
            # first half of row ctid, where the first half alternates every 4 rows so that a
            # warp's 16-byte loads are conflict-free
            a_offs = a_fragment_offsets(ctid)
            units = []
            if const_expr(tile_n == 256):
                units.append((ctid, [(ctid >> 2) & 1]))

            self.decode_stage(mainloop, 0, bases, 0, rA[0], a_offs, units)
            self.sync_decoders()
            # k-tile kt uses buffer kt % 3; its wgmmas stay in flight while k-tile kt + 1 is
            # decoded into the next buffer and, with window64 operands, until its window update
            for kq in cutlass.range(cute.ceil_div(k_tiles, BUFFERS), unroll=1):
                for j in cutlass.range_constexpr(BUFFERS):
                    kt = kq * BUFFERS + j
                    if kt < k_tiles:
                        self.mma_ktile(tiled_mma, part, rA[j], tCrB, j)
                        if kt + 1 < k_tiles:
                            nxt = (j + 1) % BUFFERS
                            self.decode_stage(mainloop, kt + 1, bases, nxt, rA[nxt], a_offs,
                                              units)
                        if const_expr(self.windowed):
                            warpgroup.wait_group(0)
                            win_state = self.consumer_state(kt)
                            self.window_update(acc, part, tCcT, sWA, sWB, win_state.index)
                            mainloop.consumer_release(win_state)
                        else:
                            warpgroup.wait_group(1)
                        self.sync_decoders()
            warpgroup.wait_group(0)

            # the accumulator fragment is per thread: partition D by the consumer thread index
            self.epilogue(acc, tiled_mma.get_slice(ctid), mD, epi, m_tile, n_tile)

    @cute.jit
    def sync_decoders(self):
        """Decoded BF16 stores -> visible to wgmma (async proxy), across both consumer
        warpgroups."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=self.bar_decode, number_of_threads=self.threads)

    @cute.jit
    def mma_ktile(self, tiled_mma, acc, rA, tCrB, buf: cutlass.Constexpr[int]):
        """The four k16 wgmmas of a k-tile, accumulating into `acc`."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(TILE_K // 16):
            cute.gemm(tiled_mma, acc, rA[(None, None, kb)], tCrB[(None, None, kb, buf)], acc)
        warpgroup.commit_group()

    def window_update(self, acc, part, tCcT, sWA, sWB, s):
        """acc += (wa[m] * wb[n]) * part with the window factors of pipeline stage `s`
        (`parts.window_update`); part = 0. Plain Python at trace time."""
        window_update(acc, part, tCcT, sWA, sWB, s, self.has_a_window, self.has_b_window)
        part.fill(0.0)

    @cute.jit
    def load_tile(self, mainloop, loads, kt, m_tile, n_tile, k_tiles):
        """TMA loads of k-tile kt (packed A, B, their scale tiles, window factors) into its
        pipeline stage."""
        tile_n = self.tile_n
        (tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, tma_sfa, tAgSF, tAsSF, tma_sfb, tBgSF, tBsSF,
         tma_wa, tWgA, tWsA, tma_wb, tWgB, tWsB) = loads
        state = pipeline.PipelineState(self.stages, kt, kt % self.stages,
                                       ((kt // self.stages) & 1) ^ 1)
        mainloop.producer_acquire(state)
        bar = mainloop.producer_get_barrier(state)
        s = state.index
        cute.copy(tma_a, tAgA[(None, m_tile, kt)], tAsA[(None, s)], tma_bar_ptr=bar)
        cute.copy(tma_b, tBgB[(None, n_tile, kt)], tBsB[(None, s)], tma_bar_ptr=bar)
        cute.copy(tma_sfa, tAgSF[(None, m_tile * k_tiles + kt)], tAsSF[(None, s)],
                  tma_bar_ptr=bar)
        for h in cutlass.range_constexpr(tile_n // 128):
            cute.copy(tma_sfb, tBgSF[(None, (n_tile * (tile_n // 128) + h) * k_tiles + kt)],
                      tBsSF[(None, s * (tile_n // 128) + h)], tma_bar_ptr=bar)
        if const_expr(self.has_a_window):
            cute.copy(tma_wa, tWgA[(None, m_tile, kt)], tWsA[(None, s)], tma_bar_ptr=bar)
        if const_expr(self.has_b_window):
            cute.copy(tma_wb, tWgB[(None, n_tile, kt)], tWsB[(None, s)], tma_bar_ptr=bar)
        mainloop.producer_commit(state)

    @cute.jit
    def decode_stage(self, mainloop, kt, bases, buf: cutlass.Constexpr[int], rA, a_offs,
                     units):
        """MMA threads: decode k-tile kt's A fragment of this thread into the registers `rA`
        (K order: see the module docstring) and its B units into BF16 buffer `buf`. Releases
        the stage unless windowed (its window factors are read after the MMAs)."""
        apk_base, bpk_base, sfa_base, sfb_base, b16_base = bases
        a_pk_off, a_sf_off, a_sf_shift = a_offs
        state = self.consumer_state(kt)
        mainloop.consumer_wait(state)
        s = state.index
        decode_a_fragment(rA, apk_base + s * (TILE_M * TILE_K // 2) + a_pk_off,
                          sfa_base + s * SF_TILE_BYTES + a_sf_off, a_sf_shift)
        self.decode_b(mainloop, state, bases, buf, units)
        if const_expr(not self.windowed):
            mainloop.consumer_release(state)

    @cute.jit
    def decode_b(self, mainloop, state, bases, buf: cutlass.Constexpr[int], units):
        """Decode B units (row, [16-byte halves]) of pipeline stage `state` into BF16 buffer
        `buf` (waits for the stage; does not release it). A half h is words 4h..4h+3
        (blocks 2h, 2h + 1) and goes to the 16-byte chunks 2kb + h of the 128B-swizzled
        K-major BF16 row."""
        tile_n = self.tile_n
        apk_base, bpk_base, sfa_base, sfb_base, b16_base = bases
        if const_expr(len(units) > 0):
            mainloop.consumer_wait(state)
        s = state.index
        for row, halves in units:
            r = row & 127
            sf = ld_shared(sfb_base + (s * (tile_n // 128) + (row >> 7)) * SF_TILE_BYTES
                           + (r & 31) * 16 + (r >> 5) * 4, clobber=True)
            pk_addr = bpk_base + s * (tile_n * TILE_K // 2) + row * (TILE_K // 2)
            row_addr = b16_base + buf * (tile_n * TILE_K * 2) + row * (TILE_K * 2)
            sw = row & 7
            for half in halves:
                w0, w1, w2, w3 = ld_shared(pk_addr + half * 16, 4, clobber=True)
                sf_half = sf >> (half * 16)
                s0 = e4m3_to_bf16x2_scale(sf_half)
                s1 = e4m3_to_bf16x2_scale(sf_half >> 8)
                p0 = decode_e2m1x8(w0, s0)
                p1 = decode_e2m1x8(w1, s0)
                p2 = decode_e2m1x8(w2, s1)
                p3 = decode_e2m1x8(w3, s1)
                for kb in cutlass.range_constexpr(TILE_K // 16):
                    st_shared(row_addr + (((kb * 2 + half) ^ sw) << 4), p0[kb], p1[kb],
                              p2[kb], p3[kb], clobber=True)
