"""sm_100a NVFP4 x NVFP4 GEMM on tcgen05 block-scaled MMA (`kind::mxf4nvf4.block_scale`).

COMPILED, NEVER RUN: no Blackwell GPU was available while this kernel was written. It is
compiled for sm_100a and its PTX inspected (tests/test_compile_gemm_sm100.py); its numbers have
never been checked on hardware. See notes/gemm_sm100.md for what still has to be verified.

D[m, n] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]) (SPEC section 3),
a and b the E2M1 * E4M3 block values, FP32 accumulation in tensor memory.

Operands: A [M, K] and B [N, K] K-major packed E2M1 (uint8 [rows, K/2], even element in the
low nibble), read as Float4E2M1FN through a recast; their E4M3 scales (one per 16 elements) in
the 128x4 swizzled layout of SPEC 1, which is the layout `tile_atom_to_shape_SF` describes, so
TMA loads them as they are. One tcgen05.mma instruction is 128 x tile_n x 64 (four 16-blocks);
a pipeline stage holds a k-tile of 256 (A, B and their scale tiles).

Persistent, warp-specialized CTA (192 threads, one CTA per SM, cluster 1x1, 1-CTA MMA), tiles
of 128 x tile_n handed out by the static persistent tile scheduler:
- warp 5, TMA: A, B, SFA, SFB of each k-tile into a multi-stage smem ring (PipelineTmaUmma).
- warp 4, MMA: per k-tile, tcgen05.cp of the SFA/SFB tiles smem -> tensor memory, then four
  block-scaled tcgen05.mma into the tile's accumulator (PipelineUmmaAsync towards the epilogue;
  two accumulator buffers when tile_n = 128, one when tile_n = 256).
- warps 0-3, epilogue: tcgen05.ld of an accumulator sub-tile to registers, FP32 alpha, row[m],
  col[n], bias[n] (each a compile-time option), the cast, registers -> smem, TMA store (the
  TMA store clips rows/columns past M/N).

Tensor memory (512 columns): accumulators at column 0, then the SFA and SFB columns.
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Float32, Int32, const_expr
from cutlass.base_dsl import Arch, BaseDSL
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import TmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..common.jit import KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor, \
    num_sms, torch_to_cutlass
from ..ref.formats import FLOAT_DTYPES as OUT_DTYPES
from .parts import EpilogueOperands, epilogue_fakes, prefetch_tma, tma_slices

ARCH = "sm_100a"
TILE_M = 128
TILE_NS = (128, 256)
MMA_K = 64  # K of one block-scaled tcgen05.mma with FP4 operands
K_TILE = 4 * MMA_K  # K per pipeline stage
SF_VEC = 16  # NVFP4: one E4M3 scale per 16 elements
BIAS_DTYPES = OUT_DTYPES
DEFAULT_SM_COUNT = 148  # B200; the host wrapper passes the device's count

EPI_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5
THREADS = 32 * (len(EPI_WARPS) + 2)
TMEM_COLS = 512
SMEM_RESERVED = 1024  # mbarriers and the tensor memory address


class Sm100GemmNVFP4(EpilogueOperands):
    """Compile-time config: output dtype, tile_n (128 or 256), which epilogue operands exist
    (alpha [1], row [M], col [N] as FP32; bias [N] of bias_dtype) and the SM count the persistent
    grid is sized for. `__call__` takes packed A [M, K/2], B [N, K/2] (uint8), the swizzled
    scales of A and B as flat uint8 tensors, D [M, N] and the optional epilogue tensors."""

    def __init__(self, out_dtype: Type[cutlass.Numeric], *, tile_n: int = 256,
                 has_alpha: bool = False, has_row: bool = False, has_col: bool = False,
                 has_bias: bool = False, sm_count: int = DEFAULT_SM_COUNT,
                 decode=(None, None, None)):
        if tile_n not in TILE_NS:
            raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n}")
        if sm_count < 1:
            raise ValueError(f"sm_count must be positive, got {sm_count}")
        self.out_dtype = out_dtype
        self.tile_n = tile_n
        self.set_epilogue_flags(has_alpha, has_row, has_col, has_bias, decode)
        self.sm_count = sm_count
        self.mma_tiler = (TILE_M, tile_n, K_TILE)
        # Two accumulator buffers fit next to the scale columns only for 128-wide tiles.
        self.acc_stages = 2 if tile_n == 128 else 1
        self.sfa_tmem_cols = (TILE_M // 32) * (K_TILE // MMA_K)
        self.sfb_tmem_cols = (tile_n // 32) * (K_TILE // MMA_K)
        self.acc_tmem_cols = tile_n * self.acc_stages
        assert self.acc_tmem_cols + self.sfa_tmem_cols + self.sfb_tmem_cols <= TMEM_COLS
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(EPI_WARPS))
        self.tmem_barrier = pipeline.NamedBarrier(
            barrier_id=2, num_threads=32 * (len(EPI_WARPS) + 1))

    def _stage_counts(self, tiled_mma, epi_tile):
        """(A/B pipeline stages, C stages): as many A/B stages as fit beside two C buffers."""
        one = (
            cute.size_in_bytes(cutlass.Float4E2M1FN, sm100_utils.make_smem_layout_a(
                tiled_mma, self.mma_tiler, cutlass.Float4E2M1FN, 1))
            + cute.size_in_bytes(cutlass.Float4E2M1FN, sm100_utils.make_smem_layout_b(
                tiled_mma, self.mma_tiler, cutlass.Float4E2M1FN, 1))
            + cute.size_in_bytes(cutlass.Float8E4M3FN, blockscaled_utils.make_smem_layout_sfa(
                tiled_mma, self.mma_tiler, SF_VEC, 1))
            + cute.size_in_bytes(cutlass.Float8E4M3FN, blockscaled_utils.make_smem_layout_sfb(
                tiled_mma, self.mma_tiler, SF_VEC, 1))
        )
        c_one = cute.size_in_bytes(self.out_dtype, sm100_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, epi_tile, 1))
        capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_100")
        c_stages = 2
        ab_stages = (capacity - SMEM_RESERVED - c_stages * c_one) // one
        if ab_stages < 2:
            raise ValueError(f"tile_n={self.tile_n}: {one} bytes per stage leave room for "
                             f"{ab_stages} pipeline stages (need 2)")
        return ab_stages, c_stages

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor,
                 mD: cute.Tensor, mAlpha: Optional[cute.Tensor], mRow: Optional[cute.Tensor],
                 mCol: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        arch = BaseDSL._get_dsl().get_arch_enum()
        if const_expr(not arch.is_family_of(Arch.sm_100f)):
            raise ValueError(f"the NVFP4 block-scaled GEMM needs sm_100a, compiling for {arch}")
        m, n, k = mA.shape[0], mB.shape[0], cute.assume(mA.shape[1] * 2, 32)
        # Packed bytes -> FP4 elements, with a unit batch mode (the layout helpers expect one).
        a = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=cutlass.Float4E2M1FN),
                             cute.make_ordered_layout((m, k, 1), order=(1, 0, 2)))
        b = cute.make_tensor(cute.recast_ptr(mB.iterator, dtype=cutlass.Float4E2M1FN),
                             cute.make_ordered_layout((n, k, 1), order=(1, 0, 2)))
        d = cute.make_tensor(mD.iterator, cute.make_ordered_layout((m, n, 1), order=(1, 0, 2)))
        # The swizzled scale buffers, viewed through the MMA's scale-factor atom layout.
        sfa = cute.make_tensor(cute.recast_ptr(mSFA.iterator, dtype=cutlass.Float8E4M3FN),
                               blockscaled_utils.tile_atom_to_shape_SF(a.shape, SF_VEC))
        sfb = cute.make_tensor(cute.recast_ptr(mSFB.iterator, dtype=cutlass.Float8E4M3FN),
                               blockscaled_utils.tile_atom_to_shape_SF(b.shape, SF_VEC))

        tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float8E4M3FN, SF_VEC, tcgen05.CtaGroup.ONE, (TILE_M, self.tile_n))
        cta_tile = (TILE_M, self.tile_n, K_TILE)
        epi_tile = sm100_utils.compute_epilogue_tile_shape(
            cta_tile, False, LayoutEnum.ROW_MAJOR, self.out_dtype)
        ab_stages, c_stages = self._stage_counts(tiled_mma, epi_tile)

        a_smem = sm100_utils.make_smem_layout_a(
            tiled_mma, self.mma_tiler, cutlass.Float4E2M1FN, ab_stages)
        b_smem = sm100_utils.make_smem_layout_b(
            tiled_mma, self.mma_tiler, cutlass.Float4E2M1FN, ab_stages)
        sfa_smem = blockscaled_utils.make_smem_layout_sfa(
            tiled_mma, self.mma_tiler, SF_VEC, ab_stages)
        sfb_smem = blockscaled_utils.make_smem_layout_sfb(
            tiled_mma, self.mma_tiler, SF_VEC, ab_stages)
        c_smem = sm100_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, epi_tile, c_stages)

        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        stage0 = (None, None, None, 0)
        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, a, cute.slice_(a_smem, stage0), self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, b, cute.slice_(b_smem, stage0), self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        # Scale tiles move as 16-bit elements (the TMA box of a 128x4 atom row is 4 bytes).
        tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, sfa, cute.slice_(sfa_smem, stage0), self.mma_tiler, tiled_mma,
            cluster_vmnk.shape, internal_type=cutlass.Int16)
        tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, sfb, cute.slice_(sfb_smem, stage0), self.mma_tiler, tiled_mma,
            cluster_vmnk.shape, internal_type=cutlass.Int16)
        tx_bytes = (
            cute.size_in_bytes(cutlass.Float4E2M1FN, cute.slice_(a_smem, stage0))
            + cute.size_in_bytes(cutlass.Float4E2M1FN, cute.slice_(b_smem, stage0))
            + cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sfa_smem, stage0))
            + cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sfb_smem, stage0))
        )
        tma_d, tma_mD = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(c_smem, (None, None, 0)), epi_tile)

        tiles = cute.zipped_divide(d, tiler=(TILE_M, self.tile_n))[(0, (None, None, None))].shape
        sched = utils.PersistentTileSchedulerParams(tiles, (1, 1, 1))
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, self.sm_count)

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, ab_stages]
            ab_empty: cute.struct.MemRange[cutlass.Int64, ab_stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            tmem_addr: Int32
            sC: cute.struct.Align[
                cute.struct.MemRange[self.out_dtype, cute.cosize(c_smem.outer)], 1024]
            sA: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float4E2M1FN, cute.cosize(a_smem.outer)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float4E2M1FN, cute.cosize(b_smem.outer)], 1024]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(sfa_smem)], 128]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(sfb_smem)], 128]

        self.shared_storage = SharedStorage
        self.ab_stages = ab_stages
        self.c_stages = c_stages

        self.kernel(
            tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
            tma_d, tma_mD, (mAlpha, mRow, mCol, mBias),
            (a_smem, b_smem, sfa_smem, sfb_smem, c_smem), epi_tile, sched, tx_bytes,
        ).launch(grid=grid, block=[THREADS, 1, 1], cluster=(1, 1, 1), stream=stream,
                 min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
               tma_b: cute.CopyAtom, mB: cute.Tensor, tma_sfa: cute.CopyAtom, mSFA: cute.Tensor,
               tma_sfb: cute.CopyAtom, mSFB: cute.Tensor, tma_d: cute.CopyAtom,
               mD: cute.Tensor, epi: tuple, smem_layouts: tuple, epi_tile: cute.Tile,
               sched: utils.PersistentTileSchedulerParams, tx_bytes: cutlass.Constexpr[int]):
        # smem layouts of A, B, their scales and C, stages last
        a_smem, b_smem, sfa_smem, sfb_smem, c_smem = smem_layouts
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        if warp_idx == TMA_WARP:
            prefetch_tma(tma_a, tma_b, tma_sfa, tma_sfb, tma_d)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=tx_bytes,
            defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(),
            num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * len(EPI_WARPS)),
            defer_sync=True,
        )
        tmem = TmemAllocator(storage.tmem_addr.ptr, barrier_for_retrieve=self.tmem_barrier,
                             allocator_warp_id=EPI_WARPS[0])
        pipeline.pipeline_init_arrive()

        sC = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem)
        sSFB = storage.sSFB.get_tensor(sfb_smem)

        # Global tiles: (bM|bN, bK, RestM|RestN, RestK, RestL), D: (bM, bN, RestM, RestN, RestL).
        tile_mk = cute.slice_(self.mma_tiler, (None, 0, None))
        tile_nk = cute.slice_(self.mma_tiler, (0, None, None))
        tile_mn = cute.slice_(self.mma_tiler, (None, None, 0))
        every = (None, None, None)
        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(cute.local_tile(mA, tile_mk, every))
        tCgB = thr_mma.partition_B(cute.local_tile(mB, tile_nk, every))
        tCgSFA = thr_mma.partition_A(cute.local_tile(mSFA, tile_mk, every))
        tCgSFB = thr_mma.partition_B(cute.local_tile(mSFB, tile_nk, every))
        tCgD = thr_mma.partition_C(cute.local_tile(mD, tile_mn, every))
        tCcD = thr_mma.partition_C(
            cute.local_tile(cute.make_identity_tensor(mD.shape), tile_mn, every))
        k_tiles = cute.size(tCgA, mode=[4])

        tAsA, tAgA = tma_slices(tma_a, sA, tCgA, modes=3)
        tBsB, tBgB = tma_slices(tma_b, sB, tCgB, modes=3)
        tAsSFA, tAgSFA = tma_slices(tma_sfa, sSFA, tCgSFA, modes=3)
        tBsSFB, tBgSFB = tma_slices(tma_sfb, sSFB, tCgSFB, modes=3)
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        # (MMA, MMA_M, MMA_N, ACC_STAGE)
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stages))

        pipeline.pipeline_init_wait()

        if warp_idx == TMA_WARP:
            self.load_warp(sched, ab_pipe, k_tiles, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB,
                           tma_sfa, tAgSFA, tAsSFA, tma_sfb, tBgSFB, tBsSFB)
        if warp_idx == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            self.mma_warp(sched, ab_pipe, acc_pipe, k_tiles, tiled_mma, tCrA, tCrB,
                          cute.make_tensor(acc_ptr, tCtAcc_fake.layout), acc_ptr, sSFA, sSFB,
                          sfa_smem, sfb_smem)
        if warp_idx < MMA_WARP:
            tmem.allocate(TMEM_COLS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            self.epilogue_warps(sched, acc_pipe, tidx, warp_idx,
                                cute.make_tensor(acc_ptr, tCtAcc_fake.layout), tCgD, tCcD,
                                sC, tma_d, epi_tile, mD, epi)
            tmem.relinquish_alloc_permit()
            self.epi_barrier.arrive_and_wait()
            tmem.free(acc_ptr)

    @cute.jit
    def load_warp(self, sched, ab_pipe, k_tiles, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB,
                  tma_sfa, tAgSFA, tAsSFA, tma_sfb, tBgSFB, tBsSFB):
        """TMA producer: every k-tile of every tile this CTA owns, into the smem ring."""
        tile_sched = utils.StaticPersistentTileScheduler.create(
            sched, cute.arch.block_idx(), cute.arch.grid_dim())
        work = tile_sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        while work.is_valid_tile:
            tm, tn, tl = work.tile_idx
            gA = tAgA[(None, tm, None, tl)]
            gB = tBgB[(None, tn, None, tl)]
            gSFA = tAgSFA[(None, tm, None, tl)]
            gSFB = tBgSFB[(None, tn, None, tl)]
            state.reset_count()
            for _ in cutlass.range(k_tiles, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                kt, s = state.count, state.index
                cute.copy(tma_a, gA[(None, kt)], tAsA[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_b, gB[(None, kt)], tBsB[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_sfa, gSFA[(None, kt)], tAsSFA[(None, s)], tma_bar_ptr=bar)
                cute.copy(tma_sfb, gSFB[(None, kt)], tBsSFB[(None, s)], tma_bar_ptr=bar)
                state.advance()
            tile_sched.advance_to_next_work()
            work = tile_sched.get_current_work()
        ab_pipe.producer_tail(state)

    @cute.jit
    def mma_warp(self, sched, ab_pipe, acc_pipe, k_tiles, tiled_mma, tCrA, tCrB, tCtAcc,
                 acc_ptr, sSFA, sSFB, sfa_smem, sfb_smem):
        """Scale tiles smem -> tensor memory (tcgen05.cp), then the block-scaled MMAs."""
        sfa_ptr = cute.recast_ptr(acc_ptr + self.acc_tmem_cols, dtype=cutlass.Float8E4M3FN)
        sfb_ptr = cute.recast_ptr(acc_ptr + self.acc_tmem_cols + self.sfa_tmem_cols,
                                  dtype=cutlass.Float8E4M3FN)
        stage0 = (None, None, None, 0)
        # (MMA, MMA_M|MMA_N, MMA_K)
        tCtSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem, stage0)))
        tCtSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem, stage0)))
        cp_sfa, src_sfa, dst_sfa = self.scale_copy(sSFA, tCtSFA)
        cp_sfb, src_sfb, dst_sfb = self.scale_copy(sSFB, tCtSFB)

        tile_sched = utils.StaticPersistentTileScheduler.create(
            sched, cute.arch.block_idx(), cute.arch.grid_dim())
        work = tile_sched.initial_work_tile_info()
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.ab_stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.acc_stages)
        while work.is_valid_tile:
            acc = tCtAcc[(None, None, None, acc_state.index)]
            acc_pipe.producer_acquire(acc_state)
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipe.consumer_wait(ab_state)
                s = ab_state.index
                cute.copy(cp_sfa, src_sfa[(None, None, None, None, s)], dst_sfa)
                cute.copy(cp_sfb, src_sfb[(None, None, None, None, s)], dst_sfb)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                stage = (None, None, None, s)
                cute.gemm(tiled_mma, acc, [tCrA[stage], tCtSFA], [tCrB[stage], tCtSFB], acc)
                ab_pipe.consumer_release(ab_state)
                ab_state.advance()
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            tile_sched.advance_to_next_work()
            work = tile_sched.get_current_work()
        acc_pipe.producer_tail(acc_state)

    @cute.jit
    def scale_copy(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """tcgen05.cp (4x32x128b) of one stage's scale tile to its tensor-memory columns:
        (tiled copy, staged smem descriptors, tensor-memory destination)."""
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
                                   cutlass.Float8E4M3FN)
        tSF_compact = cute.filter_zeros(tSF)
        tiled = tcgen05.make_s2t_copy(atom, tSF_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(sSF)))
        return tiled, src, thr.partition_D(tSF_compact)

    @cute.jit
    def epilogue_warps(self, sched, acc_pipe, tidx, warp_idx, tCtAcc, tCgD, tCcD, sC, tma_d,
                       epi_tile, mD, epi):
        """Accumulator sub-tiles: tensor memory -> registers -> FP32 epilogue -> cast -> smem ->
        TMA store."""
        layout_d = LayoutEnum.ROW_MAJOR
        cta_tile = (TILE_M, self.tile_n, K_TILE)
        t2r_atom = sm100_utils.get_tmem_load_op(
            cta_tile, layout_d, self.out_dtype, Float32, epi_tile, False)
        # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, ACC_STAGE)
        tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], epi_tile)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, ACC_STAGE)
        tTR_tAcc = thr_t2r.partition_S(tAcc_epi)
        # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, RestM, RestN, RestL)
        tTR_cD = thr_t2r.partition_D(
            cute.flat_divide(tCcD[((None, None), 0, 0, None, None, None)], epi_tile))
        gD_epi = cute.flat_divide(tCgD[((None, None), 0, 0, None, None, None)], epi_tile)
        tTR_gD = thr_t2r.partition_D(gD_epi)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gD[(None, None, None, 0, 0, 0, 0, 0)].shape,
                                         Float32)
        tTR_rD = cute.make_rmem_tensor(tTR_rAcc.shape, self.out_dtype)

        r2s = cute.make_tiled_copy_D(
            sm100_utils.get_smem_store_op(layout_d, self.out_dtype, Float32, t2r), t2r)
        tRS_sD = r2s.get_slice(tidx).partition_D(sC)
        tRS_rD = r2s.retile(tTR_rD)
        # ((ATOM_V, REST_V), C_STAGE), ((ATOM_V, REST_V), EPI_M, EPI_N, RestM, RestN, RestL)
        bSG_sD, bSG_gD = tma_slices(tma_d, sC, gD_epi)

        m_last = mD.shape[0] - 1
        n_last = mD.shape[1] - 1
        alpha = self.acc_scale(1.0, epi)

        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.c_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * len(EPI_WARPS)))
        tile_sched = utils.StaticPersistentTileScheduler.create(
            sched, cute.arch.block_idx(), cute.arch.grid_dim())
        work = tile_sched.initial_work_tile_info()
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.acc_stages)
        while work.is_valid_tile:
            tile = work.tile_idx
            # (T2R, T2R_M, T2R_N, EPI)
            acc = cute.group_modes(tTR_tAcc[(None, None, None, None, None, acc_state.index)],
                                   3, 5)
            coords = cute.group_modes(tTR_cD[(None, None, None, None, None, *tile)], 3, 5)
            # ((ATOM_V, REST_V), EPI)
            gD = cute.group_modes(bSG_gD[(None, None, None, *tile)], 1, 3)
            acc_pipe.consumer_wait(acc_state)
            subtiles = cute.size(acc, mode=[3])
            done = tile_sched.num_tiles_executed * subtiles
            for sub in cutlass.range(subtiles):
                cute.copy(t2r, acc[(None, None, None, sub)], tTR_rAcc)
                self.apply_epilogue(tTR_rAcc, coords[(None, None, None, sub)], alpha,
                                    m_last, n_last, epi)
                tTR_rD.store(tTR_rAcc.load().to(self.out_dtype))
                buf = (done + sub) % self.c_stages
                cute.copy(r2s, tRS_rD, tRS_sD[(None, None, None, buf)])
                cute.arch.fence_proxy("async.shared", space="cta")
                self.epi_barrier.arrive_and_wait()
                if warp_idx == EPI_WARPS[0]:
                    cute.copy(tma_d, bSG_sD[(None, buf)], gD[(None, sub)])
                    store_pipe.producer_commit()
                    store_pipe.producer_acquire()
                self.epi_barrier.arrive_and_wait()
            # Every epilogue thread has read this accumulator buffer: hand it back to the MMA.
            cute.arch.fence_view_async_tmem_load()
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            tile_sched.advance_to_next_work()
            work = tile_sched.get_current_work()
        store_pipe.producer_tail()

    @cute.jit
    def apply_epilogue(self, acc: cute.Tensor, coords: cute.Tensor, alpha: Float32,
                       m_last: Int32, n_last: Int32, epi: tuple):
        """acc = ((acc * alpha) * row[m]) * col[n] + bias[n] in FP32 (the reference order).
        Indices past M / N are clamped: those elements are clipped by the TMA store."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            mi = cutlass.min(coords[i][0], m_last)
            ni = cutlass.min(coords[i][1], n_last)
            v = acc[i]
            if const_expr(self.has_alpha):
                v = v * alpha
            acc[i] = self.apply_operands(v, mi, ni, epi)


def check_arch(arch: str) -> None:
    """The kernel is built on tcgen05 (Blackwell): any other target is a configuration error."""
    if arch != ARCH:
        raise ValueError(f"the NVFP4 block-scaled GEMM (tcgen05) compiles for {ARCH} only, "
                         f"got {arch!r}")


def sm100_gemm_kernel(out_dtype: torch.dtype = torch.bfloat16, tile_n: int = 256,
                      flags=(False, False, False, False), bias_dtype: Optional[torch.dtype] = None,
                      sm_count: int = DEFAULT_SM_COUNT, decode=(None, None, None)):
    """(kernel, *fake compile arguments) of the sm_100a GEMM for a configuration; flags are
    (has_alpha, has_row, has_col, has_bias); decode: which of alpha, row, col hold outer
    amaxes (parts.EpilogueOperands)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    has_alpha, has_row, has_col, has_bias = flags
    if has_bias and bias_dtype not in BIAS_DTYPES:
        raise TypeError(f"bias_dtype must be float32, bfloat16 or float16, got {bias_dtype}")
    out = torch_to_cutlass(out_dtype)
    op = Sm100GemmNVFP4(out, tile_n=tile_n, has_alpha=has_alpha, has_row=has_row,
                        has_col=has_col, has_bias=has_bias, sm_count=sm_count, decode=decode)
    # TMA: 16-byte aligned rows of A/B (K % 32 == 0) and D (N a multiple of 16 bytes).
    n_align = 16 // (out.width // 8)
    m, n, kh = dyn(), dyn(n_align), dyn(16)
    return (
        op,
        fake_tensor(cutlass.Uint8, (m, kh)),
        fake_tensor(cutlass.Uint8, (n, kh)),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(out, (m, n)),
        *epilogue_fakes(flags, bias_dtype, m, n),
        env_stream(),
    )


def compile_sm100_gemm(arch: str, **config):
    """Compile the GEMM for `arch` (which must be sm_100a) through the KERNELS cache."""
    check_arch(arch)
    key = ("gemm_nvfp4_sm100",) + tuple(sorted(config.items()))
    return KERNELS.get(key, lambda: compile_kernel(*sm100_gemm_kernel(**config), arch=arch))


def gemm_nvfp4_sm100(a_data: torch.Tensor, a_scales_swizzled: torch.Tensor,
                     b_data: torch.Tensor, b_scales_swizzled: torch.Tensor, *,
                     alpha: Optional[torch.Tensor] = None, row: Optional[torch.Tensor] = None,
                     col: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                     out_dtype: torch.dtype = torch.bfloat16,
                     tile_n: Optional[int] = None) -> torch.Tensor:
    """D[M, N] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]) on sm_100a.

    a_data [M, K/2], b_data [N, K/2]: packed E2M1 uint8, K-major, K % 16 == 0 (rows are
    zero-padded to 16 bytes for TMA when K % 32 != 0, which leaves the swizzled scale layout
    unchanged); their E4M3 scales in the swizzled layout (SPEC 1), uint8 or float8_e4m3fn.
    N must keep D's rows 16-byte aligned (a multiple of 8 for bf16/fp16 output, 4 for fp32).
    COMPILED FOR sm_100a BUT NEVER RUN (see the module docstring): its results are unverified
    until it runs on a Blackwell GPU."""
    from .operands import _check_operands, _epilogue, _prepare_data

    sfa, sfb, m, n, k, device = _check_operands(a_data, a_scales_swizzled, b_data,
                                                b_scales_swizzled, True, out_dtype,
                                                "gemm_nvfp4_sm100")
    if k == 0:
        raise ValueError("K must be positive")
    # TMA reads the scale buffers from 16-byte aligned addresses: realign a misaligned view.
    sfa = sfa.clone() if sfa.data_ptr() % 16 else sfa
    sfb = sfb.clone() if sfb.data_ptr() % 16 else sfb
    elem = torch.empty((), dtype=out_dtype).element_size()
    if (n * elem) % 16:
        raise ValueError(f"N={n} must make output rows a multiple of 16 bytes "
                         f"(N % {16 // elem} == 0 for {out_dtype})")
    alpha, row, col, bias, decode = _epilogue(alpha, row, col, bias, m, n, out_dtype, device)
    if tile_n is not None and tile_n not in TILE_NS:
        raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n}")
    arch = device_arch(device)
    check_arch(arch)
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    sm_count = num_sms(device)
    if tile_n is None:
        # 128-wide tiles when 256-wide ones would leave SMs idle.
        tiles_256 = -(-m // TILE_M) * -(-n // 256)
        tile_n = 128 if n <= 128 or tiles_256 < sm_count else 256
    fn = compile_sm100_gemm(
        arch, out_dtype=out_dtype, tile_n=tile_n,
        flags=(alpha is not None, row is not None, col is not None, bias is not None),
        bias_dtype=bias.dtype if bias is not None else None, sm_count=sm_count, decode=decode)
    fn(_prepare_data(a_data), _prepare_data(b_data), sfa, sfb, out, alpha, row, col, bias)
    return out
