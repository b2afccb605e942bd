"""sm_90a mixed-input GEMM: an NVFP4 operand decoded into wgmma A-fragment registers x a BF16
(or FP16) operand loaded by TMA into the 128B-swizzled K-major smem stage the wgmma reads.

C[p, q] = sum_k x[p, k] * y[q, k], x = e2m1 * e4m3 (NVFP4, packed [P, K/2] + swizzled scales),
y BF16 (or FP16) [Q, K] in the kernel's K order (below). D [M, N] receives
cast(alpha * row[m] * col[n] * C * 2**unscale_exp + bias[n]) with (m, n) = (p, q), or
(m, n) = (q, p) when `transposed` (D^T = Y X^T: the W4A4 dispatch uses that to keep the larger
operand in registers, W4A16 prefill to keep the weights there).

Two users:
- W4A4 (`dispatch.gemm_nvfp4`): the smaller NVFP4 operand is decoded once by
  `Sm90PredecodeNVFP4` into BF16 (e2m1 * scale * 2**-7, the K order below), the larger one is
  decoded per k-tile in the kernel: one third of the in-kernel decode of the both-decode kernel
  (`sm90_w4a4`) per 128 x 256 tile, and no thread writes shared memory. unscale_exp 14.
- W4A16 prefill (`gemm_mixed_sm90`): weights as x, activations as y (a K-permuted copy,
  `permute_k`), unscale_exp 7; FP16 activations (`fp16`) make y and the decoded x FP16
  (e2m1 * scale * 2**-14, the same K order; FP16 wgmma), unscale_exp 14.

K order (shared with `sm90_w4a4`): inside a k-tile of 64 each packed row is 8 words of 8 codes
(word j = k 8j..8j+7); `decode_e2m1x8` gives the pairs (v_i, v_{i+4}), and pair i of word j sits
at k16 step i, positions 8 (j // 4) + 2 (j % 4) + {0, 1}. So position 16 i + 8 (j // 4) +
2 (j % 4) + t of a k-tile holds k = 8 j + i + 4 t. A wgmma A-fragment thread (lane % 4 = c)
then needs exactly words c and 4 + c of its two rows.

Persistent: min(tiles, SMs) CTAs, CTA b runs the tiles b, b + grid, ... (tile t = (p_tile,
q_tile) = (t % p_tiles, t // p_tiles)). Per tile (128 x tile_n x 64 k-tiles): warpgroup 0
warp 0 issues the TMA loads (`PipelineTmaAsync`, `stages` deep: packed x [128, 32] bytes, its
512-byte swizzled scale tile, y [tile_n, 64] BF16) and runs on into the next tile's k-tiles
while the consumers are in the epilogue; warpgroups 1-2 each own 64 rows: the wgmmas of k-tile
i run while the thread decodes the A fragment of k-tile i + 1 into the other of two register
buffers (wait depth 1). No named barrier in the mainloop: each consumer thread only reads smem
and its own registers.
Epilogue (`Sm90Epilogue.epilogue_staged`): FP32 scale, row, col, bias (the order of
`ref.gemm`), cast, staged through a shared-memory buffer of its own (the pipeline stages are
being refilled meanwhile), coalesced predicated stores.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Type

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.decode import (DECODE_EXP_SHIFT, FP16_DECODE_EXP_SHIFT, decode_e2m1x8,
                             decode_e2m1x8_f16, e4m3_to_bf16x2_scale, e4m3_to_f16x2_scale)
from ..common.jit import (KERNELS, compile_kernel, dyn, env_stream, fake_tensor, num_sms,
                          torch_to_cutlass)
from ..common.ptx import ld_global, ld_shared, ld_shared_cluster, prmt, st_global
from ..common.stores import warp_buffer, warp_linear_store
from ..ref.dequantize import check_out_tensor
from .parts import (EpilogueOperands, epilogue_fakes, part_positions, prefetch_tma, tma_slices,
                    window_fake, window_slices, window_update)

TILE_M = 128
TILE_K = 64  # elements per k-tile: 4 NVFP4 blocks, 32 packed bytes, 128 BF16 bytes per row
SF_TILE_BYTES = 512  # one 128-row x 4-block tile of swizzled scales
SMEM_BYTES = 220 * 1024  # pipeline stages + epilogue staging (227 KB per CTA, barriers aside)
# wgmma widths of the mixed kernel: the narrow ones serve decode-sized token counts (the
# MMA work of a 64-token activation tile padded to 128 is half wasted)
MIXED_TILE_NS = (16, 32, 64, 128, 256)
# CTAs per SM -> (producer, consumer registers, widest tile_n that fits them without spills):
# producer * 128 + consumer * 256 <= the launch allocation * 384 (168 / 80 / 56 per thread)
MIXED_REGS = {1: (40, 232, 256), 2: (24, 104, 64), 3: (24, 72, 16)}
# x_window (a part tile next to the accumulators): CTAs per SM -> the widest tile_n that fits
MIXED_WINDOW_TILE_NS = {1: 256, 2: 32, 3: 16}
# x_window at tile_n 256: the window products in column slices of this width through two
# part tiles, with these (producer, consumer) registers (224 of the 240 hold the
# accumulators, two part tiles and two A buffers). Narrower tiles take one part tile as
# wide as the tile (H200: 64-wide slices at tile_n 128 took 8% longer)
WINDOW_PART_N = 64
WINDOW_WIDE_REGS = (24, 240)
# beyond decode sizes: time per FLOP at tile_n 64 / 128 relative to 256 (the register decode
# is per tile row, so narrower tiles decode more per FLOP; `pick_mixed_config`)
MIXED_TILE_COST = {64: 1.7, 128: 1.17, 256: 1.0}
# k_slices: CTAs per cluster, each a slice of a 64-row tile's k-tiles
K_SLICES = (1, 2, 4)
# named barriers of the k_split accumulator hand-over (the staged epilogue uses 2 and 3)
BAR_RED_FULL, BAR_RED_FREE = 4, 5
# NVFP4 x predecoded NVFP4: both carry 2**-7; NVFP4 x raw BF16: one factor
UNSCALE_W4A4 = 2 * DECODE_EXP_SHIFT
UNSCALE_W4A16 = DECODE_EXP_SHIFT
UNSCALE_W4A16_FP16 = FP16_DECODE_EXP_SHIFT  # FP16 activations: the FP16 decode's 2**-14


def kperm64() -> torch.Tensor:
    """The kernel's K order inside a k-tile of 64: position p holds k = kperm64()[p]."""
    perm = torch.empty(TILE_K, dtype=torch.long)
    for j in range(8):
        for i in range(4):
            for t in range(2):
                perm[16 * i + 8 * (j // 4) + 2 * (j % 4) + t] = 8 * j + i + 4 * t
    return perm


@cute.jit
def a_fragment_offsets(ctid: Int32):
    """Byte offsets inside one pipeline stage of the packed A rows and the swizzled scales an
    A-fragment thread (consumer thread index `ctid`, 0..255) decodes, and the bit shift of its
    blocks inside the scale word: rows a_row0 and a_row0 + 8 (wgmma m64 layout), words c and
    4 + c of each."""
    mma_wg = ctid // 128
    t = ctid % 128
    lane = t % 32
    c = lane % 4
    a_row0 = mma_wg * 64 + (t // 32) * 16 + lane // 4
    return (a_row0 * (TILE_K // 2) + c * 4, (a_row0 & 31) * 16 + (a_row0 >> 5) * 4,
            (c >> 1) * 8)


@cute.jit
def decode_a_fragment(rA: cute.Tensor, a_pk: Int32, a_sf: Int32, a_sf_shift: Int32,
                      fp16: cutlass.Constexpr[bool] = False):
    """Decode this thread's wgmma A fragment of one k-tile into the registers `rA` from the
    packed rows at shared address `a_pk` and their scales at `a_sf` (see a_fragment_offsets):
    BF16 e2m1 * scale * 2**-7, or with fp16 FP16 e2m1 * scale * 2**-14 (same K order)."""
    rA32 = cute.recast_tensor(rA, Int32)
    for h in cutlass.range_constexpr(2):
        w_lo = ld_shared(a_pk + h * 8 * (TILE_K // 2), clobber=True)
        w_hi = ld_shared(a_pk + h * 8 * (TILE_K // 2) + 16, clobber=True)
        sf = ld_shared(a_sf + h * 8 * 16, clobber=True)
        if const_expr(fp16):
            p = decode_e2m1x8_f16(w_lo, e4m3_to_f16x2_scale(sf >> a_sf_shift), False)
            q = decode_e2m1x8_f16(w_hi, e4m3_to_f16x2_scale(sf >> (a_sf_shift + 16)), False)
        else:
            p = decode_e2m1x8(w_lo, e4m3_to_bf16x2_scale(sf >> a_sf_shift))
            q = decode_e2m1x8(w_hi, e4m3_to_bf16x2_scale(sf >> (a_sf_shift + 16)))
        for kb in cutlass.range_constexpr(TILE_K // 16):
            rA32[kb * 4 + h] = p[kb]
            rA32[kb * 4 + 2 + h] = q[kb]


def extents(mX: cute.Tensor, mY: cute.Tensor):
    """(rows of the packed register operand mX, rows of the other operand mY, k-tiles)."""
    return mX.shape[0], mY.shape[0], cute.ceil_div(mX.shape[1], TILE_K // 2)


def scale_tiles(mSF: cute.Tensor, rows, k_tiles) -> cute.Tensor:
    """Flat swizzled scales of `rows` rows (one 512-byte tile per (128 rows, k-tile), row-tile
    major) as a [128, 4 * tiles] byte matrix: one TMA box (128, 4) is one tile."""
    return cute.make_tensor(
        mSF.iterator,
        cute.make_layout((128, 4 * k_tiles * cute.ceil_div(rows, 128)), stride=(1, 128)),
    )


def packed_stages(rows: int, stages: int) -> cute.Layout:
    """Shared memory of `stages` k-tiles of `rows` packed rows (TILE_K // 2 bytes each)."""
    return cute.make_layout((rows, TILE_K // 2, stages),
                            stride=(TILE_K // 2, 1, rows * TILE_K // 2))


def scale_stages(tiles: int) -> cute.Layout:
    """Shared memory of `tiles` swizzled scale tiles (128 x 4 bytes)."""
    return cute.make_layout((128, 4, tiles), stride=(1, 128, SF_TILE_BYTES))


def tma_load(tensor: cute.Tensor, stages, box):
    """(TMA atom, TMA tensor) loading `tensor` in boxes `box` into one stage of the staged
    shared-memory layout `stages` (its last mode: modes 0, 1 of a plain layout, the first
    slice of a swizzled one)."""
    if isinstance(stages, cute.ComposedLayout):
        stage = cute.slice_(stages, (None, None, 0))
    else:
        stage = cute.select(stages, mode=[0, 1])
    atom, tma_tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), tensor,
                                                   stage, box)
    return atom, tma_tensor


def smem_array(dtype, count, align: int = 128):
    """A shared-storage field of `count` elements of `dtype`, aligned to `align` bytes."""
    return cute.struct.Align[cute.struct.MemRange[dtype, count], align]


def rs_tiled_mma(tile_n: int, warpgroups: int = 2, ab_dtype=cutlass.BFloat16) -> cute.TiledMma:
    """BF16 (or FP16) wgmma with FP32 accumulation, A from registers, `warpgroups` warpgroups
    of 64 x tile_n stacked along M."""
    return sm90_utils.make_trivial_tiled_mma(
        ab_dtype, ab_dtype,
        LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
        LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
        Float32, (warpgroups, 1, 1), tiler_mn=(64, tile_n),
        a_source=warpgroup.OperandSource.RMEM)


class Sm90Epilogue(EpilogueOperands):
    """The FP32 epilogue of the sm_90 GEMMs: D[m, n] = cast(acc * 2**unscale_exp * alpha *
    row[m] * col[n] + bias[n]), predicated stores (`epilogue`: straight from the accumulator
    fragment; `epilogue_staged`: through shared memory, coalesced). Needs tile_n, out_dtype,
    unscale_exp, transposed, vec_store (staged only) and the epilogue flags on self."""

    @cute.jit
    def epilogue(self, acc, thr_mma, mD, epi, p_tile, q_tile):
        tile_n = self.tile_n
        # the kernel's (p, q) coordinate space: D itself or its transposed view
        gD = mD
        if const_expr(self.transposed):
            gD = cute.make_tensor(mD.iterator, cute.select(mD.layout, mode=[1, 0]))
        p_rows, q_cols = gD.shape
        cD = cute.make_identity_tensor(gD.shape)
        tCcD = thr_mma.partition_C(cute.local_tile(cD, (self.tile_m, tile_n), (p_tile, q_tile)))
        tCgD = thr_mma.partition_C(cute.local_tile(gD, (self.tile_m, tile_n), (p_tile, q_tile)))
        scale = self.acc_scale(2.0 ** self.unscale_exp, epi)
        cache = {}
        for i in cutlass.range_constexpr(cute.size(acc)):
            p, q = tCcD[i]
            m, n, vals = self.element_operands(cache, tCcD, i, p, q, mD, epi)
            if p < p_rows and q < q_cols:
                tCgD[i] = self.apply_operands(acc[i] * scale, m, n, epi,
                                              vals).to(self.out_dtype)

    def element_operands(self, cache: dict, coords, i: int, p, q, mD, epi):
        """(m, n, the epilogue operand values) of accumulator element i at kernel coordinate
        (p, q): D's coordinate (swapped when transposed) and `load_operands` keyed by i's
        trace-time offsets within the thread's fragment (the layout of its partition `coords`
        of the identity tensor)."""
        kp, kq = coords.layout(i)
        m, n, km, kn = p, q, kp, kq
        if const_expr(self.transposed):
            m, n, km, kn = q, p, kq, kp
        return m, n, self.load_operands(cache, km, kn, m, n, mD.shape[0], mD.shape[1], epi)

    def staging_bytes(self) -> int:
        """Shared memory of `epilogue_staged`."""
        return staging_bytes(self.tile_n, self.out_dtype.width // 8, self.transposed)

    @cute.jit
    def epilogue_staged(self, acc, thr_mma, mD, epi, p_tile, q_tile, stage_ptr, mma_wg,
                        wg_tid):
        """The epilogue math of `epilogue`, staged through shared memory (`stage_ptr`, a buffer
        of `staging_bytes` of its own) so that the global stores are coalesced: 16-byte vectors
        when `vec_store` (D's base and row pitch 16-byte aligned), else one element per thread
        with consecutive threads on consecutive columns. Each MMA warpgroup (thread `wg_tid` of
        128) stages and stores its own 64 kernel rows."""
        tile_n = self.tile_n
        elt = self.out_dtype.width // 8
        rows, cols = 64, tile_n
        if const_expr(self.transposed):
            rows, cols = tile_n, 64
        pitch = cols + 16 // elt
        m_rows, n_cols = mD.shape
        p_rows, q_cols = m_rows, n_cols
        if const_expr(self.transposed):
            p_rows, q_cols = n_cols, m_rows
        sD = cute.make_tensor(cute.recast_ptr(stage_ptr, dtype=self.out_dtype)
                              + mma_wg * rows * pitch,
                              cute.make_layout((rows, cols), stride=(pitch, 1)))
        tCcT = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, tile_n)))
        scale = self.acc_scale(2.0 ** self.unscale_exp, epi)
        # this warpgroup's stores of the previous tile have read the staging buffer
        cute.arch.barrier(barrier_id=2 + mma_wg, number_of_threads=128)
        cache = {}
        for i in cutlass.range_constexpr(cute.size(acc)):
            pl, ql = tCcT[i]
            p = p_tile * self.tile_m + pl
            q = q_tile * tile_n + ql
            m, n, vals = self.element_operands(cache, tCcT, i, p, q, mD, epi)
            r, c = pl - mma_wg * 64, ql
            if const_expr(self.transposed):
                r, c = ql, pl - mma_wg * 64
            if p < p_rows and q < q_cols:
                sD[r, c] = self.apply_operands(acc[i] * scale, m, n, epi,
                                               vals).to(self.out_dtype)
        cute.arch.barrier(barrier_id=2 + mma_wg, number_of_threads=128)
        m0 = p_tile * self.tile_m + mma_wg * 64
        n0 = q_tile * tile_n
        if const_expr(self.transposed):
            m0 = q_tile * tile_n
            n0 = p_tile * self.tile_m + mma_wg * 64
        if const_expr(self.vec_store):
            vec = 16 // elt
            per_row = cols // vec
            s_base = sD.iterator.toint()
            for it in cutlass.range_constexpr(rows * per_row // 128):
                idx = it * 128 + wg_tid
                r = idx // per_row
                c = (idx % per_row) * vec
                if m0 + r < m_rows and n0 + c < n_cols:
                    w0, w1, w2, w3 = ld_shared(s_base + (r * pitch + c) * elt, 4,
                                               clobber=True)
                    dst = mD.iterator + ((m0 + r) * mD.layout.stride[0] + n0 + c)
                    st_global(dst.toint(), w0, w1, w2, w3, clobber=True)
        else:
            for it in cutlass.range_constexpr(rows * cols // 128):
                idx = it * 128 + wg_tid
                r = idx // cols
                c = idx % cols
                if m0 + r < m_rows and n0 + c < n_cols:
                    mD[m0 + r, n0 + c] = sD[r, c]


class Sm90Gemm(Sm90Epilogue):
    """What the sm_90 wgmma GEMMs share: 384 threads, a TMA mainloop pipeline of `stages`
    stages feeding two MMA warpgroups (threads 128..383) that run RS wgmmas on decoded A
    fragments, tiles of tile_m (128) x tile_n, the FP32 epilogue."""

    def __init__(self, out_dtype: Type[cutlass.Numeric], tile_n: int, stages: int, flags,
                 producer_regs: int, consumer_regs: int):
        self.out_dtype = out_dtype
        self.tile_m = TILE_M
        self.tile_n = tile_n
        self.stages = stages
        self.set_epilogue_flags(*flags)
        self.threads = 384
        # the wgmma operands (Sm90GemmMixed: FP16 with FP16 activations)
        self.ab_dtype = cutlass.BFloat16
        # setmaxnreg only moves registers inside the CTA's launch allocation (168 per thread
        # at 384 threads and one CTA per SM, 80 at two): producer_regs * 128 +
        # consumer_regs * 256 <= that * 384, or the increase never returns
        self.producer_regs = producer_regs
        self.consumer_regs = consumer_regs

    def set_shared_storage(self, **arrays):
        """The kernel's shared storage (a cute.struct): the mainloop pipeline's barriers (two
        per stage), then `arrays` (name=smem_array(...)) in order."""
        fields = {"mbar": cute.struct.MemRange[cutlass.Int64, self.stages * 2], **arrays}
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def make_mainloop(self, storage, consumer_warps: int, tx_bytes: int):
        """The mainloop pipeline in `storage.mbar`: one producer thread (TMA), `consumer_warps`
        consumer warps, tx_bytes per stage."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

    @staticmethod
    def tile_coords(t, p_tiles):
        """(p_tile, q_tile) of the t-th tile of a persistent walk, p fastest (measured against
        bands of 4, 8 and 16 p-tiles: no consistent difference, notes/gemm.md)."""
        return t % p_tiles, t // p_tiles

    def consumer_state(self, kt):
        """The mainloop pipeline's consumer state of the CTA's kt-th k-tile."""
        kt = Int32(kt)
        return pipeline.PipelineState(self.stages, kt, kt % self.stages,
                                      (kt // self.stages) & 1)

    def mma_operands(self, tiled_mma, ctid, mma_wg, sB, buffers: int):
        """For MMA thread `ctid` of warpgroup `mma_wg` (indices within `tiled_mma`): the
        warpgroup's wgmma slice, the B fragments of the staged shared-memory operand sB and
        `buffers` register tiles of the thread's A fragment."""
        thr_mma = tiled_mma.get_slice(mma_wg * 128)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        a_shape = tiled_mma.get_slice(ctid).partition_A(
            cute.make_identity_tensor((self.tile_m, TILE_K))).shape
        return thr_mma, tCrB, [cute.make_rmem_tensor(a_shape, self.ab_dtype)
                               for _ in range(buffers)]


class Sm90GemmMixed(Sm90Gemm):
    """Compile-time config: tile_n (MIXED_TILE_NS), pipeline stages, output dtype, the epilogue
    operands present, `transposed` (D[q, p]), unscale_exp, vec_store (D 16-byte aligned:
    base and row pitch), num_ctas (the SM count) and ctas_per_sm (MIXED_REGS: more warps to
    hide the per-k-tile decode latency of narrow tiles, a share of the registers and shared
    memory each; the persistent grid is num_ctas * ctas_per_sm CTAs at most) and k_split
    (tile_n <= 64: a tile is 64 rows and its two MMA warpgroups take the even and the odd
    k-tiles, then add their accumulators, the even ones' first, through shared memory: twice
    the tiles at half the k-loop each, for weights with fewer 128-row tiles than SMs),
    k_slices (with k_split: a cluster of k_slices CTAs per 64-row tile, CTA r of it the r-th
    slice of the k-tiles; the CTAs of rank > 0 leave their sums in shared memory and rank 0
    adds them in rank order (DSMEM) and runs the epilogue: deterministic, not persistent, one
    tile per cluster; for weights with fewer 64-row tiles than CTA slots), fp16 (y FP16
    and x decoded to FP16: W4A16 with FP16 activations, unscale_exp 14) and x_window (x is a
    1x64 local-encode operand: W4A16 with window64 weights; each k-tile, one window, goes to a
    register tile of its own, added to the accumulators with x's FP32 window factors:
    acc += wx[p] * part, `parts.window_update`).
    `__call__` takes packed x [P, K/2] (uint8, K/2 a multiple of 16), its swizzled scales (flat
    uint8), y [Q, >= K] BF16 or FP16 (row pitch a multiple of 16 bytes), D [M, N], the
    optional alpha [1], row [M], col [N], bias [N] and, with x_window, x's window factors
    ([P padded to 4, K/64] FP32 with the rows contiguous, `dispatch._window_factors`)."""

    def __init__(self, out_dtype: Type[cutlass.Numeric], *, tile_n: int = 256, stages: int = 5,
                 has_alpha: bool = False, has_row: bool = False, has_col: bool = False,
                 has_bias: bool = False, transposed: bool = False,
                 unscale_exp: int = UNSCALE_W4A4, vec_store: bool = False,
                 num_ctas: int = 132, ctas_per_sm: int = 1, k_split: bool = False,
                 k_slices: int = 1, fp16: bool = False, decode=(None, None, None),
                 x_window: bool = False):
        if tile_n not in MIXED_TILE_NS:
            raise ValueError(f"tile_n must be one of {MIXED_TILE_NS}, got {tile_n}")
        if ctas_per_sm not in MIXED_REGS or tile_n > MIXED_REGS[ctas_per_sm][2]:
            raise ValueError(f"ctas_per_sm must be 1, 2 with tile_n <= 64 or 3 with tile_n "
                             f"16; got {ctas_per_sm} with tile_n {tile_n}")
        producer_regs, consumer_regs, _ = MIXED_REGS[ctas_per_sm]
        if x_window and tile_n > 128:
            producer_regs, consumer_regs = WINDOW_WIDE_REGS
        super().__init__(out_dtype, tile_n, stages,
                         (has_alpha, has_row, has_col, has_bias, decode),
                         producer_regs=producer_regs, consumer_regs=consumer_regs)
        most = max_stages(tile_n, out_dtype.width // 8, transposed, ctas_per_sm,
                          x_window=x_window)
        if stages < 2 or stages > most:
            raise ValueError(f"stages must be 2..{most} for tile_n {tile_n}, "
                             f"{out_dtype.__name__} output, transposed={transposed}, "
                             f"{ctas_per_sm} CTA(s) per SM; got {stages}")
        if k_split and tile_n > 64:
            raise ValueError(f"k_split needs tile_n <= 64, got {tile_n}")
        if k_slices not in K_SLICES or (k_slices > 1 and not k_split):
            raise ValueError(f"k_slices must be one of {K_SLICES}, and 1 without k_split; got "
                             f"{k_slices} with k_split={k_split}")
        if fp16 and unscale_exp != UNSCALE_W4A16_FP16:
            raise ValueError(f"fp16 (FP16 activations, FP16 decode) needs unscale_exp "
                             f"{UNSCALE_W4A16_FP16}, got {unscale_exp}")
        if x_window and tile_n > MIXED_WINDOW_TILE_NS[ctas_per_sm]:
            raise ValueError(f"x_window needs tile_n <= {MIXED_WINDOW_TILE_NS[ctas_per_sm]} at "
                             f"{ctas_per_sm} CTA(s) per SM (a second accumulator tile); got "
                             f"tile_n {tile_n}")
        self.x_window = x_window
        # FP16 activations: y and the decoded weights are FP16 (FP16 wgmma)
        self.fp16 = fp16
        self.ab_dtype = cutlass.Float16 if fp16 else cutlass.BFloat16
        self.ctas_per_sm = ctas_per_sm
        self.k_split = k_split
        self.k_slices = k_slices
        self.tile_m = 64 if k_split else TILE_M
        self.transposed = transposed
        self.unscale_exp = unscale_exp
        self.vec_store = vec_store
        self.num_ctas = num_ctas
        # warps that consume (release) each pipeline stage
        self.consumer_warps = 4 if k_split else 8

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSFX: cute.Tensor, mY: cute.Tensor, mD: cute.Tensor,
                 mAlpha: Optional[cute.Tensor], mRow: Optional[cute.Tensor],
                 mCol: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                 mXWin: Optional[cute.Tensor], stream: cuda.CUstream):
        tile_n = self.tile_n
        p_rows, q_rows, k_tiles = extents(mX, mY)
        tile_m = self.tile_m
        tiles = cute.ceil_div(p_rows, tile_m) * cute.ceil_div(q_rows, tile_n)
        sfx = scale_tiles(mSFX, p_rows, k_tiles)
        pk_layout = packed_stages(tile_m, self.stages)
        sf_layout = scale_stages(self.stages)
        y_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (tile_m, tile_n, TILE_K), self.ab_dtype, self.stages)
        tma_x, tma_mX = tma_load(mX, pk_layout, (tile_m, TILE_K // 2))
        tma_sf, tma_mSF = tma_load(sfx, sf_layout, (128, 4))
        tma_y, tma_mY = tma_load(mY, y_layout, (tile_n, TILE_K))
        tx_bytes = tile_m * TILE_K // 2 + SF_TILE_BYTES + tile_n * TILE_K * 2
        tiled_mma = rs_tiled_mma(tile_n, 1 if self.k_split else 2, self.ab_dtype)
        arrays = dict(sY=smem_array(self.ab_dtype, cute.cosize(y_layout), 1024),
                      sX=smem_array(cutlass.Uint8, cute.cosize(pk_layout)),
                      sSF=smem_array(cutlass.Uint8, cute.cosize(sf_layout)),
                      sD=smem_array(cutlass.Uint8, self.staging_bytes()))
        if const_expr(self.k_split):
            # the odd k-tiles' accumulators (one 64 x tile_n tile)
            arrays["sRed"] = smem_array(Float32, 64 * tile_n)
        # x_window: the tile's [tile_m] window factors of each k-tile, with its stage
        wx_layout = cute.make_layout((tile_m, 1, self.stages), stride=(1, tile_m, tile_m))
        tma_wx = tma_mWX = None
        if const_expr(self.x_window):
            tma_wx, tma_mWX = tma_load(mXWin, wx_layout, (tile_m, 1))
            tx_bytes += tile_m * 4
            arrays["sWX"] = smem_array(Float32, cute.cosize(wx_layout))
        self.set_shared_storage(**arrays)

        grid = (cutlass.min(tiles, self.num_ctas * self.ctas_per_sm), 1, 1)
        cluster = None
        if const_expr(self.k_slices > 1):
            grid = (tiles * self.k_slices, 1, 1)
            cluster = (self.k_slices, 1, 1)
        self.kernel(
            tma_x, tma_mX, tma_sf, tma_mSF, tma_y, tma_mY, mD, (mAlpha, mRow, mCol, mBias),
            tma_wx, tma_mWX, tiled_mma, (pk_layout, sf_layout, y_layout, wx_layout), tx_bytes,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=cluster, stream=stream,
                 min_blocks_per_mp=self.ctas_per_sm,
                 preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None)

    @cute.kernel
    def kernel(self, tma_x: cute.CopyAtom, mX: cute.Tensor, tma_sf: cute.CopyAtom,
               mSF: cute.Tensor, tma_y: cute.CopyAtom, mY: cute.Tensor, mD: cute.Tensor,
               epi: tuple, tma_wx: Optional[cute.CopyAtom], mWX: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, layouts: tuple, tx_bytes: cutlass.Constexpr[int]):
        tile_n = self.tile_n
        pk_layout, sf_layout, y_layout, wx_layout = layouts
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            prefetch_tma(tma_x, tma_sf, tma_y, tma_wx)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = self.make_mainloop(storage, self.consumer_warps, tx_bytes)
        sX = storage.sX.get_tensor(pk_layout)
        sSF = storage.sSF.get_tensor(sf_layout)
        sY = storage.sY.get_tensor(y_layout.outer, swizzle=y_layout.inner)
        sWX = storage.sWX.get_tensor(wx_layout) if const_expr(self.x_window) else None
        k_tiles = cute.size(cute.ceil_div(mX.shape[1], TILE_K // 2))
        tile_m = self.tile_m
        p_tiles = cute.ceil_div(mX.shape[0], tile_m)
        tiles = p_tiles * cute.ceil_div(mY.shape[0], tile_n)
        # k_slices: cluster `unit` (tile unit, one per cluster) and this CTA's k-tiles
        # kt0 .. kt0 + k_count - 1; else the persistent walk over every k-tile
        unit, units, kt0, k_count = bid, n_ctas, Int32(0), k_tiles
        if const_expr(self.k_slices > 1):
            per_slice = cute.ceil_div(k_tiles, self.k_slices)
            unit, units = bid // self.k_slices, n_ctas // self.k_slices
            kt0 = (bid % self.k_slices) * per_slice
            k_count = cutlass.max(cutlass.min(per_slice, k_tiles - kt0), 0)
        my_tiles = (tiles - unit + units - 1) // units

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                tSsS, tSgS = tma_slices(tma_sf, sSF, cute.local_tile(mSF, (128, 4), (0, None)))
                tWsX, tWgX = window_slices(tma_wx, sWX, mWX, tile_m)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.stages)
                for i in cutlass.range(my_tiles, unroll=1):
                    p_tile, q_tile = self.tile_coords(unit + i * units, p_tiles)
                    gX = cute.local_tile(mX, (tile_m, TILE_K // 2), (p_tile, None))
                    # scales come in tiles of 128 rows
                    sf_tile = p_tile // (TILE_M // tile_m)
                    gY = cute.local_tile(mY, (tile_n, TILE_K), (q_tile, None))
                    tXsX, tXgX = tma_slices(tma_x, sX, gX)
                    tYsY, tYgY = tma_slices(tma_y, sY, gY)
                    for kl in cutlass.range(k_count, unroll=1):
                        kt = kt0 + kl
                        mainloop.producer_acquire(state)
                        bar = mainloop.producer_get_barrier(state)
                        s = state.index
                        cute.copy(tma_x, tXgX[(None, kt)], tXsX[(None, s)], tma_bar_ptr=bar)
                        cute.copy(tma_sf, tSgS[(None, sf_tile * k_tiles + kt)],
                                  tSsS[(None, s)], tma_bar_ptr=bar)
                        cute.copy(tma_y, tYgY[(None, kt)], tYsY[(None, s)], tma_bar_ptr=bar)
                        if const_expr(self.x_window):
                            cute.copy(tma_wx, tWgX[(None, p_tile, kt)], tWsX[(None, s)],
                                      tma_bar_ptr=bar)
                        mainloop.producer_commit(state)
                        state.advance()
                mainloop.producer_tail(state)
            if const_expr(self.k_slices > 1):
                # the consumers' two cluster barriers (reduce_slices), once: one tile per CTA
                for _ in cutlass.range_constexpr(2):
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            mma_wg = wg_idx - 1
            # k_split: both warpgroups cover the tile's 64 rows, warpgroup w the k-tiles
            # w, w + 2, ...; else warpgroup w rows 64 w.., every k-tile
            mma_tid, k_first, k_step = ctid, 0, 1
            if const_expr(self.k_split):
                mma_tid, k_first, k_step = ctid % 128, mma_wg, 2
            # two A register buffers, selected statically (the k-loop is unrolled by 2)
            thr_mma, tCrY, rA = self.mma_operands(tiled_mma, mma_tid, mma_tid // 128, sY, 2)
            acc = cute.make_rmem_tensor(
                thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))).shape, Float32)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            # x_window: each own k-tile's wgmmas go to a part tile, then window_update adds
            # it to acc with the k-tile's factors; at tile_n 256 in column slices of
            # WINDOW_PART_N through two part tiles, each slice's update while the next
            # slice's wgmmas run
            parts = coords = part_mmas = tCrY_parts = acc_of = None
            part_n = WINDOW_PART_N if tile_n > 128 else tile_n
            slices = tile_n // part_n
            if const_expr(self.x_window):
                # a part tile's first k16 wgmma overwrites it, the others add
                part_first = rs_tiled_mma(part_n, 1 if self.k_split else 2, self.ab_dtype)
                part_first.set(warpgroup.Field.ACCUMULATE, False)
                part_mma, tCrY_parts, acc_of = tiled_mma, [tCrY], [None]
                if const_expr(slices > 1):
                    part_mma = rs_tiled_mma(part_n, 1 if self.k_split else 2, self.ab_dtype)
                    part_mma.set(warpgroup.Field.ACCUMULATE, True)
                    acc_coords = tiled_mma.get_slice(mma_tid).partition_C(
                        cute.make_identity_tensor((tile_m, tile_n)))
                    part_coords = part_mma.get_slice(mma_tid).partition_C(
                        cute.make_identity_tensor((tile_m, part_n)))
                    tCrY_parts = [
                        part_mma.make_fragment_B(part_mma.get_slice(mma_tid // 128 * 128)
                                                 .partition_B(cute.local_tile(
                                                     sY, (part_n, TILE_K), (h, 0, None))))
                        for h in range(slices)]
                    acc_of = [part_positions(acc_coords, part_coords, h * part_n)
                              for h in range(slices)]
                coords = part_mma.get_slice(mma_tid).partition_C(
                    cute.make_identity_tensor((tile_m, part_n)))
                parts = [cute.make_rmem_tensor(coords.shape, Float32)
                         for _ in range(min(slices, 2))]
                part_mmas = (part_first, part_mma)

            pk_off, sf_off, sf_shift = a_fragment_offsets(mma_tid)
            x_base = sX.iterator.toint() + pk_off
            n_own = (k_count - k_first + k_step - 1) // k_step

            for i in cutlass.range(my_tiles, unroll=1):
                p_tile, q_tile = self.tile_coords(unit + i * units, p_tiles)
                # a 64-row tile's rows sit at row 64 (p_tile % 2) of their 128-row scale tile
                sf_base = sSF.iterator.toint() + sf_off
                if const_expr(self.k_split):
                    sf_base = sf_base + (p_tile % 2) * 8
                # pipeline position of this tile's first k-tile
                g0 = i * k_count + k_first
                acc.fill(0.0)
                if n_own > 0:
                    self.decode_stage(mainloop, g0, x_base, sf_base, sf_shift, rA[0])
                for kq in cutlass.range(cute.ceil_div(n_own, 2), unroll=1):
                    for j in cutlass.range_constexpr(2):
                        kl = kq * 2 + j
                        if kl < n_own:
                            s = (g0 + kl * k_step) % self.stages
                            if const_expr(self.x_window):
                                # per column slice, this k-tile's products into a part
                                # tile; the next own k-tile decoded while the first two
                                # slices run; each slice's acc += wx * part once its wgmmas
                                # are done (wait depth 1, the last at depth 0); then the
                                # stage released
                                factors = {}
                                for h in cutlass.range_constexpr(slices):
                                    part = parts[h % 2]
                                    warpgroup.fence()
                                    for kb in cutlass.range_constexpr(TILE_K // 16):
                                        cute.gemm(part_mmas[min(kb, 1)], part,
                                                  rA[j][(None, None, kb)],
                                                  tCrY_parts[h][(None, None, kb, s)], part)
                                    warpgroup.commit_group()
                                    if const_expr(h == min(1, slices - 1)):
                                        if kl + 1 < n_own:
                                            self.decode_stage(
                                                mainloop, g0 + (kl + 1) * k_step, x_base,
                                                sf_base, sf_shift, rA[1 - j])
                                    if const_expr(h > 0):
                                        warpgroup.wait_group(1)
                                        window_update(acc, parts[(h - 1) % 2], coords, sWX,
                                                      None, s, True, False, acc_of[h - 1],
                                                      factors)
                                warpgroup.wait_group(0)
                                window_update(acc, parts[(slices - 1) % 2], coords, sWX, None,
                                              s, True, False, acc_of[slices - 1], factors)
                                mainloop.consumer_release(self.consumer_state(g0 + kl * k_step))
                            else:
                                warpgroup.fence()
                                for kb in cutlass.range_constexpr(TILE_K // 16):
                                    cute.gemm(tiled_mma, acc, rA[j][(None, None, kb)],
                                              tCrY[(None, None, kb, s)], acc)
                                warpgroup.commit_group()
                                # the previous own k-tile is done: its stage and A buffer
                                # (1 - j) are free
                                warpgroup.wait_group(1)
                                if kl > 0:
                                    mainloop.consumer_release(
                                        self.consumer_state(g0 + (kl - 1) * k_step))
                                if kl + 1 < n_own:
                                    self.decode_stage(mainloop, g0 + (kl + 1) * k_step,
                                                      x_base, sf_base, sf_shift, rA[1 - j])
                if const_expr(not self.x_window):
                    warpgroup.wait_group(0)
                    if n_own > 0:
                        mainloop.consumer_release(
                            self.consumer_state(g0 + (n_own - 1) * k_step))
                if const_expr(self.k_split):
                    self.add_partials(acc, storage.sRed.data_ptr(), mma_wg, mma_tid, i,
                                      my_tiles)
                    runs_epilogue = mma_wg == 0
                    if const_expr(self.k_slices > 1):
                        runs_epilogue = runs_epilogue & self.reduce_slices(
                            acc, storage.sRed.data_ptr(), mma_wg, mma_tid, bid % self.k_slices)
                    if runs_epilogue:
                        self.epilogue_staged(acc, tiled_mma.get_slice(mma_tid), mD, epi,
                                             p_tile, q_tile, storage.sD.data_ptr(), 0,
                                             mma_tid)
                    if const_expr(self.k_slices > 1):
                        # rank 0 has read every peer's shared memory: they may exit
                        cute.arch.cluster_arrive()
                        cute.arch.cluster_wait()
                else:
                    self.epilogue_staged(acc, tiled_mma.get_slice(ctid), mD, epi, p_tile,
                                         q_tile, storage.sD.data_ptr(), mma_wg, ctid % 128)

    @cute.jit
    def add_partials(self, acc, red_ptr, mma_wg, t, i, my_tiles):
        """k_split: warpgroup 1 hands its accumulators of the CTA's i-th tile to warpgroup 0
        through shared memory (thread t's element j at j * 128 + t: conflict-free), which adds
        them to its own (even k-tiles + odd k-tiles, a fixed order). Named barriers:
        BAR_RED_FULL (the partials are written), BAR_RED_FREE (warpgroup 0 has read the
        previous tile's, so they may be overwritten)."""
        red = cute.make_tensor(cute.recast_ptr(red_ptr, dtype=Float32),
                               cute.make_layout((cute.size(acc), 128), stride=(128, 1)))
        if mma_wg == 1:
            if i > 0:
                cute.arch.barrier(barrier_id=BAR_RED_FREE, number_of_threads=256)
            for j in cutlass.range_constexpr(cute.size(acc)):
                red[j, t] = acc[j]
            cute.arch.barrier_arrive(barrier_id=BAR_RED_FULL, number_of_threads=256)
        else:
            cute.arch.barrier(barrier_id=BAR_RED_FULL, number_of_threads=256)
            for j in cutlass.range_constexpr(cute.size(acc)):
                acc[j] = acc[j] + red[j, t]
            if i + 1 < my_tiles:
                cute.arch.barrier_arrive(barrier_id=BAR_RED_FREE, number_of_threads=256)

    @cute.jit
    def reduce_slices(self, acc, red_ptr, mma_wg, t, rank):
        """k_slices: the cluster's sum of the tile, in rank order, into the accumulators of
        rank 0's warpgroup 0. The other ranks' warpgroup 0 threads put theirs in their own
        k_split buffer (thread t's element j at j * 128 + t, where add_partials has just read
        it), a cluster barrier publishes them (release / acquire), and rank 0 adds them through
        DSMEM. Returns whether this CTA is rank 0; every thread of the cluster passes the
        barrier (the producer warpgroup too)."""
        red = cute.make_tensor(cute.recast_ptr(red_ptr, dtype=Float32),
                               cute.make_layout((cute.size(acc), 128), stride=(128, 1)))
        if (mma_wg == 0) & (rank > 0):
            for j in cutlass.range_constexpr(cute.size(acc)):
                red[j, t] = acc[j]
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if (mma_wg == 0) & (rank == 0):
            base = red.iterator.toint()
            for r in cutlass.range_constexpr(1, self.k_slices):
                for j in cutlass.range_constexpr(cute.size(acc)):
                    acc[j] = acc[j] + ld_shared_cluster(base + (j * 128 + t) * 4, Int32(r))
        return rank == 0

    @cute.jit
    def decode_stage(self, mainloop, kt, x_base, sf_base, sf_shift, rA):
        """Wait for the CTA's kt-th k-tile and decode this thread's A fragment of it into `rA`."""
        state = self.consumer_state(kt)
        mainloop.consumer_wait(state)
        s = state.index
        decode_a_fragment(rA, x_base + s * (self.tile_m * TILE_K // 2),
                          sf_base + s * SF_TILE_BYTES, sf_shift, self.fp16)


class Sm90PredecodeNVFP4:
    """NVFP4 [Q, K/2] (+ swizzled E4M3 scales) -> BF16 [Q, K] holding e2m1 * scale * 2**-7 in
    the K order of `Sm90GemmMixed` (the outer scales stay with the GEMM's epilogue). One thread
    per 16 packed bytes (words 4h..4h+3 of a k-tile: blocks 2h, 2h + 1), which fill the 16-byte
    chunks 2i + h of the k-tile's 128-byte BF16 row, i = 0..3. `__call__` takes the packed data
    and the scales as int32 views ([Q, K/8] with K/2 a multiple of 16; flat) and the output as
    an int32 view [Q, K/2]; K a multiple of 64 (the host pads the packed rows to whole
    k-tiles with zero codes)."""

    def __init__(self, threads: int = 256):
        self.threads = threads

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSF: cute.Tensor, mOut: cute.Tensor,
                 stream: cuda.CUstream):
        units = mX.shape[0] * (mX.shape[1] // 4)
        self.kernel(mX, mSF, mOut).launch(grid=(cute.ceil_div(units, self.threads), 1, 1),
                                          block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSF: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        rows = mX.shape[0]
        per_row = mX.shape[1] // 4
        k_tiles = per_row // 2
        total = rows * per_row
        u = bidx * self.threads + tidx
        uc = cutlass.min(u, total - 1)  # past the end: the last unit (the warp stores)
        row = uc // per_row
        h16 = uc - row * per_row
        kt = h16 >> 1
        half = h16 & 1
        # swizzled scales as words: tile (row // 128, kt), word (row % 32) * 4 + row // 32 % 4
        sf = mSF[((row >> 7) * k_tiles + kt) * 128 + (row & 31) * 4 + ((row >> 5) & 3)]
        sf_half = sf >> (half * 16)
        s0 = e4m3_to_bf16x2_scale(sf_half)
        s1 = e4m3_to_bf16x2_scale(sf_half >> 8)
        src = mX.iterator + (row * mX.layout.stride[0] + h16 * 4)
        w0, w1, w2, w3 = ld_global(src.toint(), 4, volatile=False)
        p0 = decode_e2m1x8(w0, s0)
        p1 = decode_e2m1x8(w1, s0)
        p2 = decode_e2m1x8(w2, s1)
        p3 = decode_e2m1x8(w3, s1)
        store_unit_chunks(self.threads, mOut, [[p0[i], p1[i], p2[i], p3[i]] for i in range(4)],
                          u, total, lane)


@cute.jit
def store_unit_chunks(threads: cutlass.Constexpr[int], out: cute.Tensor, chunks, u: Int32,
                      total: Int32, lane: Int32):
    """Sm90PredecodeNVFP4's and PermuteK's stores: unit u (of `total`, one per thread, units
    in order along the contiguous `out`) owns 64 output bytes, chunks 2 i + (u % 2) (i = 0..3,
    16 bytes each: `chunks`) of the 128-byte k-tile row of units u & ~1 and u | 1 (K order
    kperm64); the warp stores its 32 units' 2 KB as whole lines (warp_linear_store)."""
    tidx, _, _ = cute.arch.thread_idx()
    first = u - lane  # even: the warps' units start at multiples of 32
    pair, odd = lane - (lane & 1), lane & 1
    warp_linear_store(warp_buffer(threads, 64, tidx, lane),
                      out.iterator.toint() + Int64(first) * 64,
                      [(pair * 4 + 2 * i + odd, chunks[i]) for i in range(4)], lane,
                      Int64(total - first) * 64, False)


class PermuteK:
    """16-bit y [Q, K] -> [Q, k_pad] in the kernel's K order (`kperm64`), zero past K (k_pad a
    multiple of 64 >= K): the activation operand of the W4A16 mixed GEMM. k = 32 jh + 8 jl +
    4 t + i goes to position 16 i + 8 jh + 2 jl + t, so output chunk 2 i + jh (8 positions,
    16 bytes) takes elements i and i + 4 of input chunks 4 jh + jl, jl = 0..3: one thread per
    (row, k-tile, jh) loads those 4 chunks (64 contiguous bytes) and writes its 4 output chunks
    with one byte permute per output word. `__call__` takes int32 views: y [Q, K/2] (K a
    multiple of 8, rows and base 16-byte aligned; chunks past K read as zero) and the output
    [Q, k_pad/2]."""

    def __init__(self, threads: int = 256):
        self.threads = threads

    @cute.jit
    def __call__(self, mY: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
        units = mOut.shape[0] * (mOut.shape[1] // 16)
        self.kernel(mY, mOut).launch(grid=(cute.ceil_div(units, self.threads), 1, 1),
                                     block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows = mOut.shape[0]
        per_row = mOut.shape[1] // 16  # (k-tile, jh) units of a row
        chunks = mY.shape[1] // 4  # 16-byte input chunks of a row
        total = rows * per_row
        u = bidx * self.threads + tidx
        uc = cutlass.min(u, total - 1)  # past the end: the last unit (the warp stores)
        row = uc // per_row
        h = uc - row * per_row  # 2 * k-tile + jh: input chunks 4 h .. 4 h + 3
        src = mY.iterator + row * mY.layout.stride[0]
        w = []
        for jl in cutlass.range_constexpr(4):
            c = h * 4 + jl
            w.append(ld_global((src + cutlass.min(c, chunks - 1) * 4).toint(), 4,
                               volatile=False, pred=Int32(c < chunks)))
        out_chunks = []
        for i in cutlass.range_constexpr(4):
            sel = 0x5410 if i % 2 == 0 else 0x7632
            out_chunks.append([prmt(w[jl][i // 2], w[jl][2 + i // 2], sel) for jl in range(4)])
        store_unit_chunks(self.threads, mOut, out_chunks, u, total, tidx % 32)


# ---- host side ----

def _stage_bytes(tile_n: int, tile_m: int = TILE_M) -> int:
    return tile_n * TILE_K * 2 + tile_m * TILE_K // 2 + SF_TILE_BYTES


def staging_bytes(tile_n: int, out_elt: int, transposed: bool) -> int:
    """Shared memory of the staged epilogue: per MMA warpgroup its 64 x tile_n block of D
    (tile_n x 64 when transposed) with rows padded by 16 bytes (conflict-free writes)."""
    rows, cols = (tile_n, 64) if transposed else (64, tile_n)
    return 2 * rows * (cols * out_elt + 16)


@functools.lru_cache(maxsize=None)
def max_stages(tile_n: int, out_elt: int, transposed: bool, ctas_per_sm: int = 1,
               k_split: bool = False, x_window: bool = False) -> int:
    """The deepest pipeline (at most 8) that fits a CTA's share of shared memory next to the
    epilogue buffer (and k_split's accumulator buffer); x_window: each stage also holds the
    tile's FP32 window factors."""
    free = SMEM_BYTES // ctas_per_sm - staging_bytes(tile_n, out_elt, transposed)
    tile_m = 64 if k_split else TILE_M
    window = tile_m * 4 if x_window else 0
    if k_split:
        return min(8, (free - 64 * tile_n * 4) // (_stage_bytes(tile_n, 64) + window))
    return min(8, free // (_stage_bytes(tile_n) + window))


class MixedConfig(NamedTuple):
    tile_n: int
    stages: int
    ctas_per_sm: int = 1
    k_split: bool = False
    k_slices: int = 1


@functools.lru_cache(maxsize=4096)
def pick_mixed_config(p: int, q: int, sms: int = 132, out_elt: int = 2,
                      transposed: bool = False, x_window: bool = False) -> MixedConfig:
    """MixedConfig(tile_n, stages, ctas_per_sm, k_split, k_slices) for P register-operand rows
    x Q TMA-operand rows and out_elt-byte outputs; x_window (window64 x, a part tile next to
    the accumulators): the same picks within MIXED_WINDOW_TILE_NS (one CTA per SM where the
    width does not fit more), with the window factors' stage bytes.

    Q <= 64 (decode sizes): a tile costs about the same at any width up to 64 (the register
    decode of its 128 x K weights and the wgmma chain of each k-tile bound it: H100, K = 8192,
    44-49 us per tile at widths 16-64), so the narrowest power of two >= Q, and the tiles are
    cut so that one wave fills the SMs (H100, graphs, K = 8192, notes/gemm_w4a16.md sessions 7
    and 19): k_split (64-row tiles, half the k-loop each) with k_slices 2 (clusters of 2 CTAs
    on halves of the k-tiles) at one CTA per SM while those fit (4096 rows: 18.6-19.9 us
    against 26.5-29.2 without slices); then, while the 64-row tiles fit one per SM, k_slices 2
    at two CTAs per SM for tile_n <= 32 (8192 rows: 24.5-26.0 against 28.6-29.8) and plain
    k_split for tile_n 64 (31.1; 32.0 with slices); then, while they fit two per SM, k_split
    at two CTAs per SM for tile_n <= 32 (16384 rows: 39.7-42.6 against 46.3); else 128-row
    tiles, two CTAs per SM when they outnumber the SMs. tile_n 64 at two CTAs per SM is
    register-bound (104 per thread for 32 accumulators and the decode).
    Wider Q: the tile width with the least time per SM, counted as waves (ceil(tiles / sms))
    x tile_n x MIXED_TILE_COST, the cost per FLOP relative to tile_n 256: 1.17 at 128 (twice
    the register decode per FLOP; H100, 2048^3: 482 vs 412 TFLOP/s; 1024x2048x2048, 64 tiles
    of 256: 262 vs 332 for 128), 1.7 at 64 (H200, W4A16 x 8192 x 8192: 200 tokens 90.5 us at
    64 in two waves against 61.9 at 128 in one); so 64 where it doubles the CTAs of a single
    wave (H200, 80-128 tokens x 8192 x 8192: 46.0-46.5 us against 55.9-56.2 at 128; with
    x_window 55.5 against 70.7) - unless the 256-wide epilogue buffer leaves fewer than 3
    stages (FP32 outputs). The deepest pipeline that fits."""
    picked = _pick_plain_config(p, q, sms, out_elt, transposed)
    if not x_window:
        return picked
    tile_n = picked.tile_n
    ctas = picked.ctas_per_sm if tile_n <= MIXED_WINDOW_TILE_NS[picked.ctas_per_sm] else 1
    return MixedConfig(tile_n, max_stages(tile_n, out_elt, transposed, ctas, picked.k_split,
                                          True), ctas, picked.k_split, picked.k_slices)


def _pick_plain_config(p: int, q: int, sms: int, out_elt: int, transposed: bool) -> MixedConfig:
    """pick_mixed_config without window factors."""
    p_tiles = -(-p // TILE_M)
    if q <= 64:
        tile_n = max(16, 1 << (q - 1).bit_length())
        tiles = p_tiles * -(-q // tile_n)
        split_tiles = 2 * tiles  # 64-row tiles
        for ctas_per_sm, k_slices, fits in ((1, 2, 2 * split_tiles <= sms),
                                            (2, 2, split_tiles <= sms and tile_n <= 32),
                                            (1, 1, split_tiles <= sms),
                                            (2, 1, split_tiles <= 2 * sms and tile_n <= 32)):
            if fits:
                return MixedConfig(tile_n, max_stages(tile_n, out_elt, transposed, ctas_per_sm,
                                                      True), ctas_per_sm, True, k_slices)
        ctas_per_sm = 2 if tiles > sms else 1
        return MixedConfig(tile_n, max_stages(tile_n, out_elt, transposed, ctas_per_sm),
                           ctas_per_sm)

    def cost(tile_n):
        waves = -(-(p_tiles * -(-q // tile_n)) // sms)
        return waves * tile_n * MIXED_TILE_COST[tile_n]

    tile_n = min(MIXED_TILE_COST, key=lambda t: (cost(t), -t))
    if max_stages(tile_n, out_elt, transposed) < 3:
        tile_n = 128
    return MixedConfig(tile_n, max_stages(tile_n, out_elt, transposed))


def mixed_kernel(out_dtype, tile_n, stages, flags, bias_dtype, transposed, unscale_exp,
                 vec_store, num_ctas=132, ctas_per_sm=1, k_split=False, fp16=False,
                 decode=(None, None, None), k_slices=1, x_window=False):
    """The compile-time op and fake arguments of one Sm90GemmMixed configuration."""
    import cutlass

    has_alpha, has_row, has_col, has_bias = flags
    op = Sm90GemmMixed(torch_to_cutlass(out_dtype), tile_n=tile_n, stages=stages,
                       has_alpha=has_alpha, has_row=has_row, has_col=has_col, has_bias=has_bias,
                       transposed=transposed, unscale_exp=unscale_exp, vec_store=vec_store,
                       num_ctas=num_ctas, ctas_per_sm=ctas_per_sm, k_split=k_split,
                       k_slices=k_slices, fp16=fp16, decode=decode, x_window=x_window)
    elt = torch.empty((), dtype=out_dtype).element_size()
    p, q = dyn(), dyn()
    m, n = (q, p) if transposed else (p, q)
    if vec_store:
        # D's row pitch (N) is a multiple of 16 bytes
        n = dyn(16 // elt)
        p, q = (n, m) if transposed else (m, n)
    args = (
        fake_tensor(cutlass.Uint8, (p, dyn(16))),
        fake_tensor(cutlass.Uint8, (dyn(512),)),
        fake_tensor(cutlass.Float16 if fp16 else cutlass.BFloat16, (q, dyn(8))),
        fake_tensor(torch_to_cutlass(out_dtype), (m, n), align=16 if vec_store else elt),
        *epilogue_fakes(flags, bias_dtype, m, n),
        window_fake(x_window),
        env_stream(),
    )
    return op, args


def predecode_kernel():
    """The op and fake arguments of Sm90PredecodeNVFP4."""
    import cutlass

    q = dyn()
    return Sm90PredecodeNVFP4(), (
        fake_tensor(cutlass.Int32, (q, dyn(8))),
        fake_tensor(cutlass.Int32, (dyn(128),)),
        fake_tensor(cutlass.Int32, (q, dyn(32))),
        env_stream(),
    )


def permute_kernel():
    """The op and fake arguments of PermuteK."""
    import cutlass

    q = dyn()
    return PermuteK(), (
        fake_tensor(cutlass.Int32, (q, dyn(4))),
        fake_tensor(cutlass.Int32, (q, dyn(32))),
        env_stream(),
    )


def permute_k(y: torch.Tensor, k_pad: int, arch: str,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A copy of the 16-bit y [Q, K] (CUDA, BF16 or FP16, K % 8 == 0) in the kernel's K order,
    zero-padded to k_pad columns (a multiple of 64 >= K): the activation operand of
    `gemm_mixed_sm90` (PermuteK), written to `out` (contiguous [Q, k_pad] of y's dtype) when
    given.
    A strided or misaligned y is copied first (the kernel reads 16-byte chunks of dense
    rows)."""
    q = y.shape[0]
    if not y.is_contiguous() or y.data_ptr() % 16:
        y = y.clone(memory_format=torch.contiguous_format)
    if out is None:
        out = torch.empty((q, k_pad), dtype=y.dtype, device=y.device)
    else:
        check_out_tensor(out, (q, k_pad), y.dtype, y.device)
    if q:
        def build():
            op, args = permute_kernel()
            return compile_kernel(op, *args, arch=arch)

        KERNELS.ffi(("permute_k", arch), build)(y.view(torch.int32), out.view(torch.int32))
    return out


def k_pad(kh: int) -> int:
    """K rounded up to whole k-tiles, for packed rows of kh bytes."""
    return -(-kh // (TILE_K // 2)) * TILE_K


def predecode_nvfp4(data: torch.Tensor, sf_flat: torch.Tensor, arch: str) -> torch.Tensor:
    """BF16 [rows, k_pad] = e2m1 * scale * 2**-7 in the kernel's K order (zero past K) from
    packed data [rows, K/2] (contiguous) and its flat swizzled scales."""
    rows, kh = data.shape
    kp = k_pad(kh)
    if kh * 2 != kp or data.data_ptr() % 16:
        padded = torch.zeros((rows, kp // 2), dtype=torch.uint8, device=data.device)
        padded[:, :kh] = data
        data = padded
    out = torch.empty((rows, kp), dtype=torch.bfloat16, device=data.device)
    if rows:
        predecode_launcher(arch)(data.view(torch.int32), sf_flat.view(torch.int32),
                                 out.view(torch.int32))
    return out


def predecode_launcher(arch: str):
    """The compiled Sm90PredecodeNVFP4 (its TVM-FFI function): called with int32 views of the
    packed data [rows, K/2] (K % 128 == 0), its flat swizzled scales and the BF16 output
    [rows, K]."""
    def build():
        op, args = predecode_kernel()
        return compile_kernel(op, *args, arch=arch)

    return KERNELS.ffi(("predecode_nvfp4_sm90", arch), build)


def launch_mixed(x_data, sfx, y, out, alpha, row, col, bias, *, transposed: bool,
                 unscale_exp: int, arch: str, tile_n: Optional[int] = None,
                 stages: Optional[int] = None, ctas_per_sm: Optional[int] = None,
                 k_split: Optional[bool] = None, k_slices: Optional[int] = None,
                 decode=(None, None, None), x_window: Optional[torch.Tensor] = None):
    """Run Sm90GemmMixed on prepared operands: x_data [P, K/2] uint8 with 16-byte rows and
    base, sfx its flat swizzled scales, y [Q, >= K] BF16 (FP16: W4A16 with FP16 activations,
    unscale_exp UNSCALE_W4A16_FP16) in the kernel's K order with 16-byte
    row pitch, out [M, N] contiguous, the epilogue operands and `decode` as
    `operands._epilogue` returns them, and x's window64 factors where x is a 1x64
    local-encode operand (`dispatch._window_factors`)."""
    flags = (alpha is not None, row is not None, col is not None, bias is not None)
    vec_store = (out.shape[1] * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
    fn = mixed_launcher(x_data.shape[0], y.shape[0], out.dtype, flags,
                        bias.dtype if bias is not None else None, transposed=transposed,
                        unscale_exp=unscale_exp, vec_store=vec_store,
                        fp16=y.dtype == torch.float16, sms=num_sms(out.device), arch=arch,
                        tile_n=tile_n, stages=stages, ctas_per_sm=ctas_per_sm, k_split=k_split,
                        k_slices=k_slices, decode=decode, x_window=x_window is not None)
    fn(x_data, sfx, y, out, alpha, row, col, bias, x_window)
    return out


def mixed_launcher(p: int, q: int, out_dtype: torch.dtype, flags, bias_dtype, *,
                   transposed: bool, unscale_exp: int, vec_store: bool, fp16: bool, sms: int,
                   arch: str, tile_n: Optional[int] = None, stages: Optional[int] = None,
                   ctas_per_sm: Optional[int] = None, k_split: Optional[bool] = None,
                   k_slices: Optional[int] = None, decode=(None, None, None),
                   x_window: bool = False):
    """The compiled Sm90GemmMixed (its TVM-FFI function) that `launch_mixed` calls for P
    register-operand rows x Q TMA-operand rows: the configuration `pick_mixed_config` picks
    unless tile_n (and the options after it) are given. flags: which of alpha, row, col,
    bias exist; vec_store: D's rows are 16-byte aligned; x_window: x has window64 factors.
    Called with (x, sfx, y, out, alpha, row, col, bias, x's window factors or None)."""
    elt = out_dtype.itemsize
    x_window = bool(x_window)
    if tile_n is None:
        picked = pick_mixed_config(p, q, sms, elt, transposed, x_window)
        tile_n = picked.tile_n
        ctas_per_sm = ctas_per_sm or picked.ctas_per_sm
        k_split = picked.k_split if k_split is None else k_split
        k_slices = k_slices or picked.k_slices
    ctas_per_sm = ctas_per_sm or 1
    k_split = bool(k_split)
    k_slices = k_slices or 1
    stages = stages or max_stages(tile_n, elt, transposed, ctas_per_sm, k_split, x_window)
    key = ("gemm_mixed_sm90", out_dtype, tile_n, stages, flags, bias_dtype, transposed,
           unscale_exp, vec_store, sms, ctas_per_sm, k_split, fp16, decode, k_slices, x_window)

    def build():
        op, args = mixed_kernel(out_dtype, tile_n, stages, flags, bias_dtype, transposed,
                                unscale_exp, vec_store, sms, ctas_per_sm, k_split, fp16,
                                decode, k_slices, x_window)
        return compile_kernel(op, *args, arch=arch)

    return KERNELS.ffi(key, build)


def gemm_mixed_sm90(w_data: torch.Tensor, w_scales: torch.Tensor, a: torch.Tensor, *,
                    alpha: Optional[torch.Tensor] = None, row: Optional[torch.Tensor] = None,
                    col: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                    out_dtype: torch.dtype = torch.bfloat16, scales_swizzled: bool = False,
                    out: Optional[torch.Tensor] = None, tile_n: Optional[int] = None,
                    stages: Optional[int] = None, ctas_per_sm: Optional[int] = None,
                    k_split: Optional[bool] = None, k_slices: Optional[int] = None
                    ) -> torch.Tensor:
    """W4A16 for any M (prefill): D[m, n] = cast(alpha * row[m] * col[n] *
    sum_k a[m, k] * w[n, k] + bias[n]) with BF16 or FP16 activations a [M, K] (natural K
    order) and NVFP4 weights w [N, K/2] (E4M3 scales, compact or swizzled), FP32 accumulation.
    The weights are decoded in registers (to the activations' dtype: e2m1 * e4m3 is exact in
    both), the activations go through a K-permuted copy (`permute_k`, one kernel reading and
    writing 2 * M * K bytes) loaded by TMA; BF16 or FP16 wgmma. alpha / row / col: FP32
    factors or `operands.OuterAmax` (decoded in the epilogue). sm_90a only."""
    from ..common.jit import device_arch
    from .operands import _check_operand, _epilogue, _prepare_data

    if a.dtype not in (torch.bfloat16, torch.float16) or a.dim() != 2:
        raise TypeError(f"a must be a 2D bfloat16 or float16 tensor [M, K], got {a.dtype} "
                        f"{tuple(a.shape)}")
    sfw = _check_operand(w_data, w_scales, "w", scales_swizzled)
    m, n, k = a.shape[0], w_data.shape[0], w_data.shape[1] * 2
    if a.shape[1] != k:
        raise ValueError(f"a must be [M, {k}], got {tuple(a.shape)}")
    if not a.is_cuda or w_data.device != a.device:
        raise ValueError("gemm_mixed_sm90 needs a and w_data on one CUDA device")
    arch = device_arch(a.device)
    if arch != "sm_90a":
        raise NotImplementedError(f"gemm_mixed_sm90 runs on sm_90a (device is {arch})")
    alpha, row, col, bias, decode = _epilogue(alpha, row, col, bias, m, n, out_dtype, a.device)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif out.dtype != out_dtype or tuple(out.shape) != (m, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] {out_dtype} tensor")
    if m == 0 or n == 0:
        return out
    return launch_w4a16_mixed(_prepare_data(w_data), sfw, a, out, alpha, row, col, bias,
                              arch=arch, tile_n=tile_n, stages=stages, ctas_per_sm=ctas_per_sm,
                              k_split=k_split, k_slices=k_slices, decode=decode)


def launch_w4a16_mixed(w, sfw, a, out, alpha, row, col, bias, *, arch: str, **config):
    """W4A16 on Sm90GemmMixed: weights w [N, K/2] as `launch_mixed` takes x (16-byte rows and
    base) with their flat swizzled scales, activations a [M, K] BF16 / FP16 (K-permuted here,
    `permute_k`), D = out [M, N] from the kernel's transposed tiles, the unscale exponent of
    a's dtype; `config`: launch_mixed's options (tile_n ..., decode, x_window)."""
    unscale = UNSCALE_W4A16_FP16 if a.dtype == torch.float16 else UNSCALE_W4A16
    return launch_mixed(w, sfw, permute_k(a, k_pad(w.shape[1]), arch), out, alpha, row, col,
                        bias, transposed=True, unscale_exp=unscale, arch=arch, **config)
