"""K2: TMA-pipelined NVFP4 cast of a [M, K] bf16/fp16/fp32 tensor (SPEC section 1).

One pass over the input writes any of
  * rowwise:    data [M, K/2] uint8 (even element in the low nibble), E4M3 scales [M, K/16];
  * columnwise: the transposed twin data [K, M/2], scales [K, M/16];
scales either compact or directly in the 128x4 swizzled layout (padded, padding zeroed).
The outer scale is per tensor (amax_r = amax_c = [1 + P]: the P AmaxTensor partials in [1:],
reduced by every CTA at its start; CTA 0 writes the amax to [0]) or per token (row amax [M] for
the rowwise output, column amax [K] for the twin); amaxes are read from device memory.

Fused amax (``fused_amax=True``, for tiny inputs: one launch instead of amax kernel + cast):
ONE CTA; before the tile loop its consumer warps read the whole input from global memory and
compute the amaxes themselves (no other kernel, no atomics, no zero-fill): per tensor the CTA
max written to amax_r[0] (amax_r = amax_c = [1]); per token the row amax into amax_r [M] and
the column amax into amax_c [K] (plain stores; a named barrier orders them before the cast
reads them). The producer warp's TMA loads of the first tiles overlap this pre-pass.

Design: persistent grid; each CTA walks 128-row x 128-byte input tiles (128 x 64 for
16-bit inputs, 128 x 32 for fp32). A producer warp streams tiles into a multi-stage smem ring
with TMA (SWIZZLE_128B, PipelineTmaAsync = full/empty mbarriers); 8 consumer warps read each
tile twice from smem: rowwise (lanes on consecutive blocks of consecutive rows, 16-byte loads,
conflict-free thanks to the swizzle) and columnwise (lane = (block row, 4-byte column word),
16 conflict-free 4-byte loads per lane, see _col_offsets). Packed bytes go out with 8-byte
vector stores that together cover whole sectors (32 bytes per row, 64 bytes per column).

Tile walk (compile-time, chosen per input by dispatch.cast_walk): `ctas_per_sm` resident CTAs;
`reverse` walks from the last tile down, so the cast first reads the end of the input, which
the amax pass read last and L2 still holds (inputs up to a few times L2); `prefetch_amax` (per
token) loads the lane's amax one tile ahead instead of at the tile; `band` orders the tiles by
bands of that many tile rows (the tiles sharing compact twin scale sectors in one wave); `run`
(compact rowwise scales) makes the walk's unit a run of tiles along K whose rowwise scales fill
one 32-byte sector per row: they are staged in smem and stored whole at the end of the run.
`enc_table` (per tensor): the CTA computes the element multiplier enc of each of the 128 scale
bytes once and the blocks load theirs from smem (no per-block conversion and IEEE reciprocal).
`preload`: a tile's smem words for both passes are read before its first smem store (the run's
scales), instead of by each pass (each rowwise step) where it starts.

`groups` (2, from dispatch.cast_groups): the CTA has two consumer groups of 8 warps that take
the CTA's tiles in turn from one ring (8 stages): group g casts walk units g, g + 2, ... (with
a run, the run's tiles g, g + 2, ..., its scales flushed by both groups after a CTA barrier).
Two CTAs per SM on equal work do not finish together (measured: the SM's first CTA ends ~25%
before the second, which then casts alone, notes/quant.md "Session 31"); two groups fed by
one in-order ring stay within a ring of each other. dispatch.cast_kernel runs such a CTA one
per SM, in place of one CTA of 8 consumer warps or (some RHT walks) of two.

`rht` (bf16 / fp16 inputs, with the twin): the twin quantizes the 16-point Random Hadamard
Transform of each 16-row column block (SPEC section 2, the recipe option): the transform is two
tensor-core MMAs per block row and 16 columns (`_rht_transform`), whose outputs the lanes of a
column exchange through smem so that each lane quantizes whole blocks (`_col_pass_rht`), and
the twin's outer scale is the post-RHT amax (per tensor amax_c holds its own partials; per
token amax_c is the post-RHT column amax), from the amax pass (AmaxToken rht; RecipeAmax
with column sums or per token with the twin alone).

`stochastic`: stochastic rounding of both outputs (SPEC section 2) from Philox4x32-10 keyed by
the int64 [seed, offset] device tensor `rng`: one Philox call per 1x16 block gives its 16
random bytes (common/philox.py: stream 0 the rowwise output, 1 the twin), encoded by
E.sr_encode16. With 16-bit inputs the fast copy of the passes (below) takes the signs from
the inputs (E.sr_encode16_signed: one HSET2 + LOP3 per pair of elements instead of a compare
and an add per element; the RHT twin's 8 at a time from its products' sign bits), exact where
every block has enc >= 2^-14; rounding to nearest on sm_90, the per-token fast copy takes
them 8 at a time from the products' sign bits in both passes (rn_signs). The column pass
reads its blocks in a rotated order (_col_offsets): the block's random bytes are rotated alike
(two prmt per half block).

The fast copy (`input_signs` or `fast_rcp`): the passes are compiled twice behind a
warp-uniform branch, and tiles whose outer scales allow it (_fast_blocks_ok: per tensor all
tiles or none, per token decided per tile and warp by a vote) take the copy with the signs
from the inputs (input_signs; the RHT twin's from its products' sign bits) and, per token and
for stochastic rounding without the enc table (fast_rcp), each block's enc from the
reciprocal without its slow-path branch
(E.enc_from_code(fast=True), exact for outer scales >= 2^-117) and, per token, the tile's
outer scales from the division and reciprocal without theirs (outer_block_scales fast, exact
for amaxes 0 and in [2^-100, 2^100]); the other copy is the general one.

`row_groups` (no RHT / SR / 16x16): the row groups of a grouped input
(recipes_dispatch.on_row_group_cast), per tensor each with its own outer amax (amax_r = amax_c
= the G group amaxes, then the chunked AmaxTensor's partials, each inside one group), per token
with the rows' amaxes (amax_r [M]) and each group's column amaxes (amax_c [G, K]); the twins one
group after another (group g's [K, M_g / 2] data and [K, M_g / 16] scales; the rowwise data
is the single tensor's; swizzled, every group's scales padded on their own). Groups are
multiples of 16 rows, so a 16-row block row lies in one group: the prologue reduces each
group's partials and fills an enc table and (s6, sdec) per group and the groups' tables in
shared memory (_fill_group_tables), and once per unit of the walk (a run of tiles along K:
recipes_dispatch.row_group_run) lane l finds block row l / 4's group by a binary search of
those (_lane_row_group), whose s6 and table the rowwise pass's warp w takes from lane 4 w and
the columnwise pass's lane uses itself, with the twin addresses of its group; the twin's
stores are predicated, and swizzled the rowwise scale stores. Each thread reduces consecutive
partials, so that a warp's lanes of one group meet in one shuffle reduction. Per token the
prologue only fills the groups' tables; the rowwise pass takes its rows' outer scales as the
plain per-token cast does, and the twin one lane per column as well where the tile's block
rows lie in one group (its column's amax in that group), else each thread its own columns'
(_cast_tile). Swizzled, the groups' padding is zeroed (_zero_padding) by a padding warp after
the producer per token and per tensor for rowwise outputs only (pad_warp), else by the
consumers after their walk; per token without any padding code where the groups have none
(padding=False).

`block2d` (per tensor, no RHT): 16x16 blocks (SPEC section 1, the recipe's block=(16, 16)): one
scale per 16x16 tile, shared by its 16 rowwise blocks and its 16 twin blocks (with stochastic
rounding each of those 1x16 blocks draws its own Philox call, as with 1x16 blocks). The
rowwise pass's warp w holds block row w of the tile, so the tile amaxes are a shuffle reduction
of its block amaxes (_tile_scales); with the twin, lanes 0 .. bpr - 1 leave each tile's (scale
byte, enc) in smem for the columnwise pass, after a consumer barrier.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync

from cute_fp4.common import encode as E
from cute_fp4.common.philox import philox_call, rng_round_keys
from cute_fp4.common.ptx import ldmatrix_x4_trans, mma_16816, prmt
from cute_fp4.common.scales import outer_block_scales, outer_fast_ok, swizzled_scale_offset
from cute_fp4.quant.amax import max_tensor_partials, vec_abs_max, vec_values
from cute_fp4.quant.padding import (GROUP_FIRST, GROUP_PARTIALS, GROUP_ROW_SW, GROUP_TWIN_SW,
                                    zero_group_padding, zero_scale_columns, zero_twin_rows)
from cute_fp4.ref.quantize import RHT_SIGNS

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
FUSED_BATCH = 4  # 16-byte loads in flight per thread in the fused amax pre-pass
RUN_SCALE_BYTES = 32  # a run's compact rowwise scales per row: one whole 32-byte sector
ENC_CODES = 128  # scale bytes of a block amax >= 0: 0 .. 0x7E, NaN 0x7F
RHT_NEG = sum(1 << k for k, sign in enumerate(RHT_SIGNS) if sign < 0)  # rows with sign -1
# 16-bit patterns of +0.25 / -0.25 (the RHT matrix entries, exact in both formats)
RHT_QUARTER = {"bf16": (0x3E80, 0xBE80), "fp16": (0x3400, 0xB400)}
# the named barrier (1: the consumers') at which the padding warp (CastKernel pad_warp) waits
# for the consumers' prologue to fill the group tables
TABLES_BARRIER = 2


class CastKernel:
    """Compile-time config: input dtype name, which outputs, scale layout, scaling mode."""

    num_consumer_warps = 8
    XCH_COL_BYTES = 8 * 16 * 16  # _rht_exchange: 8 columns x 16 slots of 16 bytes
    tile_m = 128
    tile_bytes = 128  # bytes of one tile row (one SWIZZLE_128B atom row)

    def __init__(self, dtype: str, rowwise: bool, columnwise: bool, swizzle: bool,
                 per_token: bool, num_sms: int, stages: int = 4, ctas_per_sm: int = 2,
                 fused_amax: bool = False, reverse: bool = False, prefetch_amax: bool = False,
                 band: int = 1, run: int = 1, enc_table: bool = False, preload: bool = False,
                 rht: bool = False, block2d: bool = False, stochastic: bool = False,
                 groups: int = 1, row_groups: int = 0, padding: bool = True):
        if dtype not in DTYPES:
            raise TypeError(f"CastKernel: unsupported input dtype {dtype!r} (bf16, fp16, fp32)")
        if not (rowwise or columnwise):
            raise ValueError("CastKernel: at least one of rowwise/columnwise is required")
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.esize = self.dtype.width // 8
        self.tile_k = self.tile_bytes // self.esize
        self.bpr = self.tile_k // 16  # 1x16 blocks (16x16 tiles) per tile row
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.swizzle = swizzle
        self.per_token = per_token
        self.num_sms = num_sms
        self.stages = stages
        self.ctas_per_sm = ctas_per_sm
        self.fused_amax = fused_amax
        self.reverse = reverse
        self.prefetch_amax = prefetch_amax
        if band & (band - 1) or band < 1:
            raise ValueError(f"CastKernel: band must be a power of two, got {band}")
        self.band = band
        full_run = self.run_tiles(self.esize)
        if (run & (run - 1) or not 1 <= run <= full_run or (run > 1 and fused_amax)
                or (not row_groups and (run not in (1, full_run)
                                        or (run > 1 and (not rowwise or swizzle))))):
            raise ValueError(f"CastKernel: run must be 1 or {full_run} ({dtype}), and 1 unless "
                             f"the kernel writes compact rowwise scales; with row_groups a "
                             f"power of two up to {full_run}; got {run}")
        self.run = run
        # a full run's compact rowwise scales are staged in smem and stored as whole sectors;
        # with row_groups a run also makes the lanes' group lookup once per run of tiles
        self.run_scales = run == full_run and rowwise and not swizzle
        if enc_table and per_token:
            raise ValueError("CastKernel: enc_table needs a per-tensor outer scale")
        self.enc_table = enc_table
        self.preload = preload
        if rht and (not columnwise or dtype == "fp32" or fused_amax):
            raise ValueError("CastKernel: rht needs the columnwise output, a bf16 / fp16 input "
                             "(the MMA takes 16-bit operands) and an amax pass (not fused_amax)")
        self.rht = rht
        if block2d and (per_token or rht):
            raise ValueError("CastKernel: block2d (16x16 blocks) needs a per-tensor outer scale "
                             "and no rht")
        self.block2d = block2d
        if stochastic and fused_amax:
            raise ValueError("CastKernel: stochastic rounding needs an amax pass (not fused_amax)")
        self.stochastic = stochastic
        if row_groups and (fused_amax or not (enc_table or per_token) or rht or block2d
                           or stochastic):
            raise ValueError("CastKernel: row_groups needs an amax pass, per tensor the enc "
                             "table and none of rht, block2d, stochastic")
        self.row_groups = row_groups
        # row groups with swizzled scales (per tensor of rowwise outputs only, per token of
        # every output set): a padding warp (kernel) zeroes the groups' padding. Measured
        # (H200, bf16, N = 8, cast kernel times, the consumers' epilogue and the padding warp
        # in separate runs): rowwise 4096x2048 9.64 -> 8.50 us, 8192x2048 14.52 -> 13.11,
        # 4096x8192 23.87 -> 21.99, 8192^2 44.27 -> 43.08; per tensor with the twin 14.7 ->
        # 14.2 at 4096x2048 but 77.4 -> 80.1 at 8192^2 (the producer warp after its loads:
        # 82.5), so not there (notes/quant_recipes.md "Session 41"; below 2^25 elements only,
        # it equalled the consumers' loop in graphs, session 42); per token with the twin
        # 4096x2048 16.1 -> 14.5, 4096x8192 48.2 -> 45.4, 8192^2 92.6 -> 88.1, 16384x8192
        # 183.6 -> 172.9 (the consumers' epilogue cost their walk 3-5 us: without any padding
        # code 13.3 / 42.7; session 44)
        self.pad_warp = bool(row_groups and swizzle and padding
                             and (per_token or not columnwise))
        # padding (swizzled): whether the kernel zeroes the padding no tile covers; False only
        # for row groups: per token where the groups have none (recipes_dispatch.
        # row_group_padding), where they have some, after the amax pass that zeroes it (K1
        # per token, the chunked AmaxTensor per tensor: padding.padding_tiles).
        # The padding code alone, never run, cost the walk (ptxas allocates the kernel as a
        # whole): per token row+col with the padding warp 4096x2048 14.4 -> 13.3 us, 4096x8192
        # 45.3 -> 42.7, 8192^2 88.2 -> 83.6, 16384x8192 172.8 -> 165.0 (H200, bf16, N = 8
        # groups of multiples of 128 rows, cast kernel times). Per tensor it did not pay
        # (grouped quantize row+col 16384x8192 216 -> 221 us, 32768x8192 421 -> 432; rowwise
        # +-0.4), nor for single tensors (without their padding epilogue's code the plain casts
        # moved -2.6% to +3.2%); perf/results/logs/quant_session45_h200.md section 2.
        if not padding and not (row_groups and swizzle):
            raise ValueError("CastKernel: padding=False is for row groups with swizzled "
                             "scales")
        self.padding = padding
        # per token, and for stochastic rounding without the enc table: the blocks' enc from
        # the reciprocal without its slow-path branch, whose branch region splits ptxas'
        # scheduling of the tile, and per token the tile's outer scales from the division and
        # reciprocal without theirs (measured: per token 1-3% faster up to 2^27 elements, 1%
        # slower at 2^28, then the outer scales 0-1.4% more; SR per tensor 4% at 2^27; the RN
        # per-tensor casts without the table (from ENC_TABLE_COMPACT_TWIN_MAX_BYTES) 0 to 1%
        # slower: not there); not for the fused cast of tiny inputs
        self.fast_rcp = (per_token or stochastic) and not (enc_table or fused_amax)
        # stochastic rounding of 16-bit inputs: the signs from the inputs where it is exact,
        # with the RHT the twin's from its products' sign bits, 8 at a time; with the RHT only
        # where fast_rcp compiles the passes twice anyway (measured, H200, bf16 row+col: RHT +
        # SR per token 1-3% faster, per tensor without the table 16384x8192 280 -> 268-271
        # us; per tensor with the table, whose passes it alone would copy, 1-3% slower)
        self.input_signs = stochastic and self.esize == 2 and (self.fast_rcp or not rht)
        # rounding to nearest of 16-bit inputs with the software encoder (sm_90, _bulk_signs):
        # the signs from the products' sign bits, 8 at a time, where fast_rcp copies the
        # passes anyway (per token), under input_signs' guard (measured, H200, bf16 row+col:
        # 4096x8192 60.3 -> 59.6 us, 8192^2 112 -> 110, 16384x8192 220 -> 221; RHT per token
        # 68.3 -> 67.3, 126 -> 124)
        self.rn_signs = not stochastic and self.esize == 2 and self.fast_rcp
        # (a run, 8 or 16 tiles, splits evenly between two groups)
        if groups not in (1, 2) or (groups == 2 and (fused_amax or block2d or stages % 2)):
            raise ValueError("CastKernel: groups must be 1 or 2, and 1 with fused_amax, block2d "
                             f"or an odd number of stages, got {groups}")
        self.groups = groups
        # consumer warps of the CTA: `groups` groups of num_consumer_warps, group g casting the
        # tiles at positions g, g + groups, ... of the CTA's walk (ring stages g, g + groups, ...)
        self.consumer_warps = self.num_consumer_warps * groups
        # the RHT twin: per warp and output column of a lane (2), an exchange buffer
        self.xch_words = self.consumer_warps * 2 * self.XCH_COL_BYTES // 4 if rht else 4
        self.stage_bytes = self.tile_m * self.tile_bytes
        self.threads = 32 * (self.consumer_warps + 1 + int(self.pad_warp))
        # rows of a tile per consumer warp (both passes); per token the warp's lanes compute
        # the outer scales of these rows and of the warp's columns (_lane_amax): 16 / esize
        # in the column pass, 16 with the RHT (_col_pass_rht)
        self.warp_rows = self.tile_m // self.num_consumer_warps
        self.warp_cols = 16 if rht else 16 // self.esize
        assert self.warp_rows + self.warp_cols <= 32
        self.group_threads = 32 * self.num_consumer_warps
        self.consumer_threads = 32 * self.consumer_warps
        # blocks per consumer thread in each pass
        # rowwise pass: each warp step covers 32 // (tile_k / 16) rows
        self.row_steps = self.tile_m // (32 // self.bpr * self.num_consumer_warps)
        # fused per-token column amax: one 32-vector chunk of columns per step, reduced over
        # the consumer warps in smem
        self.vec = 16 // self.esize  # elements per 16-byte vector
        self.chunk_cols = 32 * self.vec
        fused_cols = fused_amax and per_token and columnwise
        self.colred_words = self.num_consumer_warps * self.chunk_cols if fused_cols else 1
        self.runsc_bytes = 2 * self.tile_m * RUN_SCALE_BYTES if self.run_scales else 16
        # the twin's own table after the rowwise one with the RHT (its outer amax differs)
        self.enc_tab_words = ENC_CODES * (1 + int(rht)) if enc_table else 1
        # row_groups: the int32 tables of G + 1 entries of the groups (GROUP_*)
        self.group_tables = 4 if swizzle else 2
        if row_groups:  # per tensor an enc table and (s6, sdec) per group; the groups' tables
            self.enc_tab_words = (self.group_tables * (row_groups + 1)
                                  + (0 if per_token else (ENC_CODES + 2) * row_groups))
        self.red_words = self.consumer_warps * (1 + int(rht))
        # block2d with the twin: (scale byte, enc) words of each 16x16 tile of a stage, one
        # buffer per ring stage (a warp rewrites one only after the barrier of a later tile)
        self.tile_scale_bytes = 8 * (self.tile_m // 16) * self.bpr  # per stage
        self.tile_scale_words = stages * self.tile_scale_bytes // 4
        if not (block2d and columnwise):
            self.tile_scale_words = 2
        assert not block2d or self.row_steps * 32 // self.bpr == 16  # a warp's rows: 16
        # _flush_run_scales: each thread of group 0 stores 16 bytes of the run's scales
        assert run == 1 or self.group_threads * 16 == self.tile_m * RUN_SCALE_BYTES

    @classmethod
    def run_tiles(cls, esize: int) -> int:
        """Tiles of a run: those whose rowwise scales fill one RUN_SCALE_BYTES sector per row
        (8 for 2-byte inputs, 16 for fp32)."""
        return RUN_SCALE_BYTES * 16 * esize // cls.tile_bytes

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor,
                 q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
                 rng: Optional[cute.Tensor], starts: Optional[cute.Tensor], stream):
        """rng: int64 [seed, offset] of stochastic rounding (None without it). row_groups: per
        tensor amax_r = amax_c = the G <= row_groups group amaxes (written by CTA 0), then the
        P <= max_tensor_partials + row_groups partials of the chunked AmaxTensor, per token
        amax_r the M row amaxes and amax_c the G groups' K column amaxes; starts int32
        [group_tables (G + 1)]: the GROUP_* tables (each with the value past the last group:
        M / 16, P, ...), qt / st the groups' twins one after another (group g's [K, M_g / 2]
        data and [K, M_g / 16] scales from K * its first row / 2 and / 16); swizzled, the
        scales of group g are padded to 128 rows and 4 columns each (its rowwise
        [ceil(M_g / 128) * 128, ceil(K / 64) * 4], its twin's [ceil(K / 128) * 128,
        ceil(M_g / 64) * 4]); else None."""
        self.hw = E.has_hw_e2m1()
        smem_layout = sm90_utils.make_smem_layout_a(
            cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, (self.tile_m, 8, self.tile_k), self.dtype, self.stages
        )
        one_stage = cute.slice_(smem_layout, (None, None, 0))
        tma_atom, tma_x = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, one_stage, (self.tile_m, self.tile_k)
        )
        M = x.shape[0]
        K = x.shape[1]
        n_tm = (M + self.tile_m - 1) // self.tile_m
        n_tk = (K + self.tile_k - 1) // self.tile_k
        n_tiles = n_tm * n_tk
        grid = 1 if self.fused_amax else cutlass.min(n_tiles, self.num_sms * self.ctas_per_sm)

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            red: cute.struct.MemRange[Float32, self.red_words]
            colred: cute.struct.MemRange[Float32, self.colred_words]
            # run > 1: the compact rowwise scales of a run (tile_m rows x 32 bytes), two buffers
            runsc: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.runsc_bytes], 16]
            # enc_table: enc of every scale byte (_fill_enc_tables)
            enc_tab: cute.struct.Align[cute.struct.MemRange[Float32, self.enc_tab_words], 16]
            # block2d with the twin: the tiles' (scale byte, enc) (_tile_scales)
            tile_sc: cute.struct.Align[cute.struct.MemRange[Uint32, self.tile_scale_words], 8]
            # the RHT twin's exchange buffers (_rht_exchange)
            rht_x: cute.struct.Align[cute.struct.MemRange[Uint32, self.xch_words], 16]
            sx: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(smem_layout)], 1024]

        self.storage = Storage
        launch = {}
        if cutlass.const_expr(self.row_groups and self.per_token and self.columnwise):
            # ptxas otherwise took up to 126 registers per thread in two-CTA walks (two CTAs of
            # 9 warps per SM need <= 96: 5 warps on one of the 4 register partitions); with
            # min_blocks_per_mp alone the DSL asks the driver for the device at compile time
            launch = {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": 100}
        if cutlass.const_expr(self.stochastic):
            # ptxas otherwise spends registers on the round keys beyond what ctas_per_sm CTAs
            # per SM leave (116 per thread per token with the RHT: one CTA per SM)
            launch = {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": 100}
        self.kernel(tma_atom, tma_x, smem_layout, M, K, x, amax_r, amax_c, q, s, qt, st,
                    rng, starts).launch(grid=(grid, 1, 1), block=(self.threads, 1, 1),
                                      stream=stream, **launch)

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def _tensor_amaxes(self, arrays, tidx, bidx, red_addr):
        """Per-tensor amaxes, one per (amax base, partial count) of `arrays`, from the amax
        pass's partials amax[1:]; CTA 0 writes each to its amax[0]. Every load of a thread,
        of every array, is issued before the first max (one L2 round trip per CTA start
        instead of one per array and 256 partials): indices past the last partial re-read it."""
        loads = -(-max_tensor_partials(self.num_sms) // self.consumer_threads)
        loaded = [[E.ld_global_f32(base + Int64(1 + cutlass.min(
            tidx + u * self.consumer_threads, n_partials - 1)) * 4) for u in range(loads)]
            for base, n_partials in arrays]
        accs = []
        for vals in loaded:
            acc = Float32(0.0)
            for v in vals:
                acc = E.fmax_nan(acc, v)
            accs.append(acc)
        return self._cta_amaxes(accs, tidx, bidx, red_addr, [base for base, _ in arrays])

    @cute.jit
    def _fused_tensor_amax(self, x_base, M, K, tidx, red_addr, ar_base):
        """Fused per-tensor amax: the (single) CTA's max over the whole input -> amax[0]."""
        nvec = M * (K // self.vec)
        n = self.consumer_threads
        acc = Float32(0.0)
        for i0 in cutlass.range(tidx, nvec, n * FUSED_BATCH, unroll=1):
            # FUSED_BATCH loads in flight; indices past the end re-read the last vector
            batch = [E.ld_global_nc_v4(x_base + Int64(cutlass.min(i0 + u * n, nvec - 1)) * 16)
                     for u in range(FUSED_BATCH)]
            for words in batch:
                acc = vec_abs_max(acc, words, self.dtype_name)
        return self._cta_amaxes([acc], tidx, Int32(0), red_addr, [ar_base])[0]

    @cute.jit
    def _cta_amaxes(self, accs, tidx, bidx, red_addr, bases):
        """Max of the consumer threads' accs[a] for each a (warp shuffles, then smem, one
        barrier for all); CTA 0 writes each to its amax[0] at bases[a]."""
        warp_maxes = [E.warp_max_nan(acc) for acc in accs]
        if tidx % 32 == 0:
            for a in cutlass.range_constexpr(len(accs)):
                E.st_shared_u32(red_addr + (a * self.consumer_warps + tidx // 32) * 4,
                                E.f32_bits(warp_maxes[a]))
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        amaxes = []
        for a in cutlass.range_constexpr(len(accs)):
            amax = Float32(0.0)
            for w in cutlass.range_constexpr(self.consumer_warps):
                amax = E.fmax_nan(amax, E.bits_f32(E.ld_shared_u32(
                    red_addr + (a * self.consumer_warps + w) * 4)))
            if (bidx == 0) & (tidx == 0):
                E.st_global_u32(bases[a], E.canonical_nan_bits(amax))
            amaxes.append(amax)
        return amaxes

    @cute.jit
    def _fused_token_amax(self, x_base, M, K, tidx, ar_base, ac_base, colred_addr):
        """Fused per-token amax of the (single) CTA: row amax -> amax_r[M] (rowwise), column
        amax -> amax_c[K] (columnwise). Columns go in chunks of 32 16-byte vectors: lane =
        vector, warp w takes rows w, w + 8, ...; a row's maximum over a chunk is a warp
        reduction, folded into amax_r[r] by the same thread for every chunk (no atomics);
        a column's maximum over the warps goes through smem. Ends with a consumer barrier."""
        warp = tidx // 32
        lane = tidx % 32
        nw = self.num_consumer_warps
        vpr = K // self.vec  # vectors per row
        for c0 in cutlass.range(0, vpr, 32, unroll=1):
            v = c0 + lane
            ok = v < vpr
            vc = cutlass.min(v, vpr - 1)
            cols = [Float32(0.0)] * self.vec
            for r0 in cutlass.range(warp, M, nw * FUSED_BATCH, unroll=1):
                # FUSED_BATCH rows in flight; rows past the end re-read the last row (their
                # column values change no maximum, their row maximum is not stored)
                rows = [Int64(cutlass.min(r0 + u * nw, M - 1)) for u in range(FUSED_BATCH)]
                batch = [E.ld_global_nc_v4(x_base + (rc * Int64(vpr) + Int64(vc)) * 16)
                         for rc in rows]
                for u in cutlass.range_constexpr(FUSED_BATCH):
                    words = [Uint32(cutlass.select_(ok, w, Uint32(0))) for w in batch[u]]
                    vals = vec_values(words, self.dtype_name)
                    if cutlass.const_expr(self.columnwise):
                        for j in cutlass.range_constexpr(self.vec):
                            cols[j] = E.abs_max_nan(cols[j], vals[j])
                    if cutlass.const_expr(self.rowwise):
                        r = r0 + u * nw
                        rmax = E.warp_max_nan(E.block_amax(vals))
                        if (lane == 0) & (r < M):
                            addr = ar_base + Int64(r) * 4
                            prev = Float32(0.0)
                            if c0 > 0:
                                prev = E.ld_global_f32(addr)
                            E.st_global_u32(addr, E.canonical_nan_bits(E.fmax_nan(prev, rmax)))
            if cutlass.const_expr(self.columnwise):
                mine = colred_addr + (warp * self.chunk_cols + lane * self.vec) * 4
                for j in cutlass.range_constexpr(self.vec):
                    E.st_shared_u32(mine + j * 4, E.f32_bits(cols[j]))
                cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
                for c in cutlass.range(tidx, self.chunk_cols, self.consumer_threads, unroll=1):
                    m = Float32(0.0)
                    for w in cutlass.range_constexpr(nw):
                        m = E.fmax_nan(m, E.bits_f32(E.ld_shared_u32(
                            colred_addr + (w * self.chunk_cols + c) * 4)))
                    gc = c0 * self.vec + c
                    if gc < K:
                        E.st_global_u32(ac_base + Int64(gc) * 4, E.canonical_nan_bits(m))
                cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)

    @cute.jit
    def _fill_enc_tables(self, enc_tab, tidx, sdecs):
        """enc_table (per tensor): enc of every scale byte once per CTA (E.enc_from_code), one
        table of ENC_CODES words per outer scale of `sdecs` (the consumer threads fill them
        side by side, one barrier); a block then loads its enc from smem instead of converting
        its scale and taking the IEEE reciprocal, whose slow-path branch region splits ptxas'
        scheduling of the tile."""
        assert len(sdecs) * ENC_CODES <= self.consumer_threads
        sdec = sdecs[0]
        for a in cutlass.range_constexpr(1, len(sdecs)):
            sdec = cutlass.select_(tidx >= a * ENC_CODES, sdecs[a], sdec)
        if tidx < len(sdecs) * ENC_CODES:
            E.st_shared_u32(enc_tab + tidx * 4,
                            E.f32_bits(E.enc_from_code(Uint32(tidx % ENC_CODES), sdec)))
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)

    def _block_scale(self, amax, s6, sdec, enc_tab, fast=False):
        """(scale byte, enc) of a block amax: converted (fast: the reciprocal without its
        slow path, _fast_blocks_ok held), or with enc_table looked up in the table at
        enc_tab."""
        if cutlass.const_expr(not self.enc_table):
            return E.block_scale(amax, s6, sdec, fast)
        code = E.block_scale_byte(amax, s6)
        return code, E.bits_f32(E.ld_shared_u32(enc_tab + Int32(code) * 4))

    def _quantize16(self, xs, amax, s6, sdec, enc_tab, rnd, signs=None, fast=False):
        """16 FP32 values with their block amax -> (scale byte, word0, word1); enc NaN (NaN
        block amax or outer scale) zeroes the words. rnd: the block's 4 random words
        (stochastic rounding, element i: byte i % 4 of rnd[i // 4]) or None (RN). signs:
        (sign words, halves) of the elements (E.sr_encode16_signed) or None; fast: the
        passes' fast copy (_passes)."""
        code, enc = self._block_scale(amax, s6, sdec, enc_tab, fast and self.fast_rcp)
        return (code, *self._encode16(xs, enc, rnd, signs, fast))

    def _bulk_signs(self) -> bool:
        """Whether the fast copy's encoders set the signs of the codes in bulk (from sign
        words of the inputs, or 8 at a time from the products' sign bits), which needs every
        block's enc >= 2^-14 (_fast_outer_ok)."""
        return self.input_signs or (self.rn_signs and not self.hw)

    def _encode16(self, xs, enc, rnd, signs=None, fast=False):
        """The two code words of 16 FP32 values with their block's enc (_quantize16); fast:
        the passes' fast copy."""
        if cutlass.const_expr(signs is not None):
            return E.sr_encode16_signed(xs, enc, rnd, *signs)
        if cutlass.const_expr(fast and self._bulk_signs()):
            return E.encode16_nonzero_products(xs, enc, rnd)
        if cutlass.const_expr(rnd is None):
            return E.encode16(xs, enc, self.hw)
        return E.sr_encode16(xs, enc, rnd)

    def _fast_blocks_ok(self, sdec, col_outer, amax):
        """Whether every block quantized with outer scale sdec (per token: every lane's of
        the warp, from its amax; per tensor with the RHT also the twin's, col_outer) allows
        the passes' fast copy (_passes with fast); per token with row_groups and the twin not
        in tiles whose block rows span groups (col_outer: uni, _cast_tile):
        - per token with fast_rcp: amax 0 or in [OUTER_FAST_MIN, OUTER_FAST_MAX], where
          outer_block_scales(fast=True) gave the IEEE outer scales;
        - the outer scale's bounds for the fast encoders (E.fast_outer_ok: _bulk_signs,
          fast_rcp)."""
        ok = self._fast_outer_ok(sdec)
        if cutlass.const_expr(self.per_token and self.fast_rcp):
            ok = ok & outer_fast_ok(amax)
        if cutlass.const_expr(self.rht and not self.per_token):
            ok = ok & self._fast_outer_ok(col_outer[1])
        if cutlass.const_expr(self.row_groups and self.per_token and self.columnwise):
            ok = ok & col_outer[0]
        if cutlass.const_expr(self.per_token):
            ok = cute.arch.vote_all_sync(ok)
        return ok

    def _fast_outer_ok(self, sdec):
        """_fast_blocks_ok for one outer scale."""
        return E.fast_outer_ok(sdec, self._bulk_signs(), self.fast_rcp)

    # ------------------------------------------------------------------ stochastic rounding
    def _sr_state(self, tidx, rng):
        """(round keys, offset, column-pass selectors) of stochastic rounding. Selectors (not
        with the RHT): the column pass's lane rb holds element (i + rb) % 8 of a half block at
        position i (_col_offsets), so its random bytes are the half block's 8 bytes rotated by
        rb: prmt with nibble j = (j + rb) % 8 (low word) / (j + 4 + rb) % 8 (high word)."""
        keys, offset = rng_round_keys(rng)
        sels = None
        if not self.rht:
            rot = E.rotl_nibbles(Uint32(0x76543210), 8 - tidx % 32 // 4)
            sels = (rot, rot >> 16)
        return keys, offset, sels

    def _philox(self, call, stream: int, sr):
        """The 4 random words of a block: Philox call `call` (Int64: the block's index in
        its output, row-major) of a stream (0 rowwise, 1 the twin)."""
        return philox_call(call, sr[1], stream, sr[0])

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, tma_x: cute.Tensor, smem_layout: cute.ComposedLayout,
               M: Int32, K: Int32, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor,
               q: cute.Tensor, s: cute.Tensor, qt: cute.Tensor, st: cute.Tensor,
               rng: Optional[cute.Tensor], starts: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        sx = storage.sx.get_tensor(smem_layout.outer, swizzle=smem_layout.inner)
        sbase = storage.sx.data_ptr().toint()

        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_warps),
            tx_count=self.stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        n_tm = (M + self.tile_m - 1) // self.tile_m
        n_tk = (K + self.tile_k - 1) // self.tile_k
        # the walk's units: tiles, or with run > 1 runs of `run` tiles along K (n_tk a
        # multiple of run); n_uk units per tile row
        n_uk = n_tk
        if cutlass.const_expr(self.run > 1):
            n_uk = n_tk // self.run
        n_units = n_tm * n_uk
        # a CTA's i-th unit is bidx + i * gdim, or with reverse n_units - 1 - (bidx + i * gdim)
        # (the amax pass read the end of the input last: those lines are still in L2), in the
        # band order of _next_tile (n_tm a multiple of band), stepped without divisions
        first = n_units - 1 - bidx
        if cutlass.const_expr(not self.reverse):
            first = bidx
        steps = self._walk_steps(gdim, n_uk)
        first_tm, first_uk = first // n_uk, first % n_uk
        if cutlass.const_expr(self.band > 1):
            span = self.band * n_uk  # units per band of tile rows
            first_tm = first // span * self.band + first % self.band
            first_uk = first % span // self.band

        # pad_warp: a warp after the producer zeroes the swizzled padding (_zero_padding) as
        # soon as the consumers' prologue filled the group tables it reads, off their path
        is_producer = warp == self.consumer_warps
        if cutlass.const_expr(self.pad_warp):
            is_producer = warp >= self.consumer_warps
        if is_producer:
            if cutlass.const_expr(self.pad_warp):
                if warp == self.consumer_warps:
                    self._producer_loop(tma_atom, tma_x, sx, pipe, bidx, gdim, n_units, n_uk,
                                        steps, first_tm, first_uk)
                else:
                    cute.arch.barrier(barrier_id=TABLES_BARRIER,
                                      number_of_threads=self.consumer_threads + 32)
                    nsc_r = Int64(K) // 16
                    self._zero_padding(tidx % 32, 32, bidx, gdim, M, K, n_tk, nsc_r,
                                       (nsc_r + 3) // 4 * 4, (Int64(M) // 16 + 3) // 4 * 4,
                                       s.iterator.toint(), st.iterator.toint(),
                                       self._group_tables(storage.enc_tab.data_ptr().toint()),
                                       self._n_groups(starts))
            else:
                self._producer_loop(tma_atom, tma_x, sx, pipe, bidx, gdim, n_units, n_uk, steps,
                                    first_tm, first_uk)
        else:
            # ---------------- consumers
            Kl = Int64(K)
            Ml = Int64(M)
            half_k = Kl // 2
            half_m = Ml // 2
            nsc_r = Kl // 16  # rowwise scale columns
            nsc_c = Ml // 16  # columnwise scale columns
            pad_c_r = (nsc_r + 3) // 4 * 4
            pad_c_c = (nsc_c + 3) // 4 * 4
            q_base = q.iterator.toint()
            s_base = s.iterator.toint()
            qt_base = qt.iterator.toint()
            st_base = st.iterator.toint()
            ar_base = amax_r.iterator.toint()
            ac_base = amax_c.iterator.toint()
            tables = None  # row_groups: the groups' tables in smem
            if cutlass.const_expr(self.row_groups):
                tables = self._fill_group_tables(storage.enc_tab.data_ptr().toint(), tidx,
                                                 bidx, amax_r, starts)
                if cutlass.const_expr(self.pad_warp):  # the tables are filled
                    cute.arch.barrier_arrive(barrier_id=TABLES_BARRIER,
                                             number_of_threads=self.consumer_threads + 32)

            # per tensor: the outer scale (S_enc / 6, 1 / S_enc) and with enc_table the enc of
            # each scale byte; per token: the outer scale of the lane's row or column
            # (_lane_amax), recomputed per tile
            enc_tab = storage.enc_tab.data_ptr().toint()
            s6 = Float32(0.0)
            sdec = Float32(0.0)
            col_outer = None  # per tensor with the RHT: the twin's (s6, sdec)
            if cutlass.const_expr(self.fused_amax and self.per_token):
                self._fused_token_amax(x.iterator.toint(), M, K, tidx, ar_base, ac_base,
                                       storage.colred.data_ptr().toint())
            if cutlass.const_expr(not (self.per_token or self.row_groups)):
                if cutlass.const_expr(self.fused_amax):
                    amax_t = self._fused_tensor_amax(x.iterator.toint(), M, K, tidx,
                                                     storage.red.data_ptr().toint(), ar_base)
                else:  # with the RHT the twin's outer amax is the RHT output's
                    arrays = [(ar_base, amax_r.shape[0] - 1)]
                    if cutlass.const_expr(self.rht):
                        arrays.append((ac_base, amax_c.shape[0] - 1))
                    amaxes = self._tensor_amaxes(arrays, tidx, bidx,
                                                 storage.red.data_ptr().toint())
                    amax_t = amaxes[0]
                    if cutlass.const_expr(self.rht):
                        col_outer = outer_block_scales(amaxes[1], E.E4M3_MAX)
                s6, sdec = outer_block_scales(amax_t, E.E4M3_MAX)
                if cutlass.const_expr(self.enc_table):
                    sdecs = [sdec]
                    if cutlass.const_expr(self.rht):
                        sdecs.append(col_outer[1])
                    self._fill_enc_tables(enc_tab, tidx, sdecs)

            # the consumer group (groups > 1) and the thread's index in it: a group's warps
            # take the roles of a one-group CTA's consumers (the exchange buffers are per warp
            # of the CTA, the prologue's reductions over all consumers)
            grp = 0
            gtid = tidx
            if cutlass.const_expr(self.groups > 1):
                grp = tidx // self.group_threads
                gtid = tidx % self.group_threads
            offs = self._col_offsets(gtid)
            rht_b = None
            if cutlass.const_expr(self.rht):
                rht_b = (self._rht_fragments(gtid),
                         self._rht_exchange(tidx, storage.rht_x.data_ptr().toint()))
            sr = None
            if cutlass.const_expr(self.stochastic):
                sr = self._sr_state(gtid, rng)
            row_thr = self._row_thread_offsets(gtid, half_k, nsc_r)
            col_thr = self._col_thread_offsets(gtid, half_m, nsc_c)
            # groups > 1: group g casts the tiles at positions g, g + groups, ... of the CTA's
            # walk (ring stages g, g + groups, ...): run == 1 its units g, g + groups, ...,
            # with runs the tiles g, g + groups, ... of every run (the run's scales flushed by
            # all groups together)
            cstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            tm, uk = first_tm, first_uk
            g_steps = steps
            t0 = bidx
            stride = gdim
            if cutlass.const_expr(self.groups > 1):
                cstate = pipeline.PipelineState(self.stages, Int32(0), Int32(grp), Int32(0))
                if cutlass.const_expr(self.run == 1):
                    g_steps = self._walk_steps(self.groups * gdim, n_uk)
                    tm_1, uk_1 = self._next_tile(tm, uk, steps, n_uk)
                    tm = cutlass.select_(grp == 1, tm_1, tm)
                    uk = cutlass.select_(grp == 1, uk_1, uk)
                    t0 = bidx + grp * gdim
                    stride = gdim * self.groups
            first_tk = uk * self.run  # the group's first tile: its tile grp of a run
            if cutlass.const_expr(self.groups > 1 and self.run > 1):
                first_tk = first_tk + grp
            # per token: the lane's amax of the next tile with prefetch_amax (loaded one tile
            # ahead, its latency hides behind a tile's work), else of the current one
            amax_next = Float32(0.0)
            if cutlass.const_expr(self.prefetch_amax):
                g = None  # per token with row_groups and the twin: the lane's block row's group
                if cutlass.const_expr(self.row_groups and self.per_token and self.columnwise):
                    g = self._lane_block_group(tm, M, gtid, tables)[1]
                amax_next = self._lane_amax(tm, first_tk, M, K, gtid, ar_base, ac_base, g)
            runsc = storage.runsc.data_ptr().toint()
            tile_sc = storage.tile_sc.data_ptr().toint()
            # the run's buffer: runs alternate between the two (two groups: a group reaches
            # run r + 2 only once the in-order ring has loaded the other's first tile of
            # run r + 1, i.e. after that group left run r's flush)
            run_off = Int32(0)
            for t in cutlass.range(t0, n_units, stride, unroll=1):
                tm_n, uk_n = self._next_tile(tm, uk, g_steps, n_uk)
                # row_groups: the lane's block row's group, once per unit (a run's tiles share
                # their tile row)
                lane_grp = None
                if cutlass.const_expr(self.row_groups):
                    lane_grp = self._lane_row_group(tm, tm_n, M, K, gtid, tables, enc_tab)
                if cutlass.const_expr(self.run == 1):
                    amax_next, s6, sdec = self._cast_tile(
                        pipe, cstate, sbase, gtid, tm, uk, tm_n, uk_n, M, K, half_k, half_m,
                        nsc_r, nsc_c, pad_c_c, row_thr, col_thr, offs, q_base, s_base, qt_base,
                        st_base, ar_base, ac_base, amax_next, s6, sdec, enc_tab, runsc, col_outer,
                        rht_b, tile_sc, sr, lane_grp)
                    cstate.advance(self.groups)
                else:
                    # run_scales: the run's rowwise scales go to smem (buffer runsc), then
                    # out as whole sectors (_flush_run_scales)
                    for i in cutlass.range(grp, self.run, self.groups, unroll=1):
                        # the group's last tile of the run: its next is in the next unit
                        last = i >= self.run - self.groups
                        next_tk = uk_n * self.run + grp
                        tk = uk * self.run + i
                        amax_next, s6, sdec = self._cast_tile(
                            pipe, cstate, sbase, gtid, tm, tk, cutlass.select_(last, tm_n, tm),
                            cutlass.select_(last, next_tk, tk + self.groups), M, K,
                            half_k, half_m, nsc_r, nsc_c, pad_c_c, row_thr, col_thr, offs,
                            q_base, s_base, qt_base, st_base, ar_base, ac_base, amax_next, s6,
                            sdec, enc_tab, runsc + run_off + i * self.bpr, col_outer, rht_b,
                            tile_sc, sr, lane_grp)
                        cstate.advance(self.groups)
                    if cutlass.const_expr(self.run_scales):
                        self._flush_run_scales(runsc + run_off, tidx, tm, uk, M, nsc_r, s_base)
                        run_off = self.tile_m * RUN_SCALE_BYTES - run_off
                tm, uk = tm_n, uk_n

            if cutlass.const_expr(self.swizzle and self.padding and not self.pad_warp):
                n_groups = 0
                if cutlass.const_expr(self.row_groups):
                    n_groups = self._n_groups(starts)
                self._zero_padding(tidx, self.consumer_threads, bidx, gdim, M, K, n_tk, nsc_r,
                                   pad_c_r, pad_c_c, s_base, st_base, tables, n_groups)

    @cute.jit
    def _producer_loop(self, tma_atom, tma_x, sx, pipe, bidx, gdim, n_units, n_uk, steps,
                       first_tm, first_uk):
        """The producer warp: TMA loads of the CTA's walk into the ring."""
        gx = cute.local_tile(tma_x, (self.tile_m, self.tile_k), (None, None))
        tsx, tgx = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sx, 0, 2), cute.group_modes(gx, 0, 2)
        )
        pstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tm, uk = first_tm, first_uk
        for t in cutlass.range(bidx, n_units, gdim, unroll=1):
            # (the pipeline states advance in the loop bodies themselves: the DSL carries
            # them through its loops only where they are seen changing)
            if cutlass.const_expr(self.run == 1):
                self._produce(pipe, pstate, tma_atom, tgx, tsx, tm, uk)
                pstate.advance()
            else:
                for i in cutlass.range(self.run, unroll=1):
                    self._produce(pipe, pstate, tma_atom, tgx, tsx, tm, uk * self.run + i)
                    pstate.advance()
            tm, uk = self._next_tile(tm, uk, steps, n_uk)

    @cute.jit
    def _produce(self, pipe, pstate, tma_atom, tgx, tsx, tm, tk):
        """Producer: TMA load of tile (tm, tk) into stage pstate of the ring."""
        pipe.producer_acquire(pstate)
        cute.copy(tma_atom, tgx[(None, tm, tk)], tsx[(None, pstate.index)],
                  tma_bar_ptr=pipe.producer_get_barrier(pstate))
        pipe.producer_commit(pstate)

    @cute.jit
    def _cast_tile(self, pipe, cstate, sbase, tidx, tm, tk, tm_n, tk_n, M, K, half_k, half_m,
                   nsc_r, nsc_c, pad_c_c, row_thr, col_thr, offs, q_base, s_base, qt_base,
                   st_base, ar_base, ac_base, amax_next, s6, sdec, enc_tab, run_sc, col_outer,
                   rht_b, tile_sc, sr, lane_grp):
        """Consumers: both passes over tile (tm, tk) in stage cstate of the ring; (tm_n,
        tk_n) is the CTA's next tile. Returns (amax_next, s6, sdec): per token the lane's
        _lane_amax of the next tile (prefetch_amax) and this tile's outer scale. col_outer,
        rht_b: see _col_pass_rht (per token with row_groups and the twin col_outer is (uni:
        the tile's block rows lie in one group, the groups' column amaxes), _passes);
        tile_sc: the block2d tile scales' smem buffers; sr: _sr_state; lane_grp: row_groups'
        _lane_row_group (per tensor the lane's s6 and enc table then take s6's and enc_tab's
        place), else None."""
        g, g_n = None, None  # per token with row_groups and the twin: the lane's block row's
        if cutlass.const_expr(self.row_groups and self.per_token and self.columnwise):
            # group in tile rows tm and tm_n. A tile inside one group (uni): the plain
            # per-token cast's lane per column, its column's amax in the group loaded one
            # tile ahead with the rows'; else the IEEE copy (_fast_blocks_ok), whose column
            # pass takes each thread's own columns' (measured against each thread's own
            # columns in every tile, H200, bf16, N = 8, the cast kernel, compact / swizzled:
            # 4096x2048 14.3 -> 13.2 / 16.1 -> 16.0 us, 4096x8192 42.4 -> 40.4 / 52.3 ->
            # 48.1, 8192^2 82.1 -> 78.8 / 100.6 -> 91.7, 16384x8192 171.1 -> 158.8 / 179.8
            # -> 183.0; notes/quant_recipes.md "Session 44")
            g = lane_grp[0]
            g_n = cutlass.select_(tm_n == tm, g, lane_grp[4])
            col_outer = (lane_grp[1], ac_base)
        if cutlass.const_expr(self.prefetch_amax):
            amax_cur = amax_next
            amax_next = self._lane_amax(tm_n, tk_n, M, K, tidx, ar_base, ac_base, g_n)
        else:
            amax_cur = self._lane_amax(tm, tk, M, K, tidx, ar_base, ac_base, g)
        if cutlass.const_expr(self.row_groups and not self.per_token):
            s6, enc_tab = lane_grp[0], lane_grp[1]
        if cutlass.const_expr(self.per_token and self.fast_rcp):
            # the fast copy's (exact there: _fast_blocks_ok); the other copy takes the IEEE ones
            s6, sdec = outer_block_scales(amax_cur, E.E4M3_MAX, True)
        elif cutlass.const_expr(self.per_token):
            s6, sdec = outer_block_scales(amax_cur, E.E4M3_MAX)
        pipe.consumer_wait(cstate)
        stage_addr = sbase + cstate.index * self.stage_bytes

        # preload: every smem read of the tile before its first store (ptxas does not move a
        # load across a store that may alias it); else each pass (row step) reads its words
        row_words = col_words = None
        if cutlass.const_expr(self.preload):
            if cutlass.const_expr(self.rowwise or self.block2d):
                row_words = self._row_words(stage_addr, tidx, row_thr)
            if cutlass.const_expr(self.columnwise):
                col_words = self._col_words(stage_addr, offs)
        # block2d: the scale of each 16x16 tile from the rowwise blocks' words
        tile_scale = sc_buf = None
        if cutlass.const_expr(self.block2d):
            sc_buf = tile_sc + cstate.index * self.tile_scale_bytes
            if cutlass.const_expr(row_words is None):
                row_words = self._row_words(stage_addr, tidx, row_thr)
            tile_scale = self._tile_scales(row_words, tidx, s6, sdec, enc_tab, sc_buf)
        head = (stage_addr, row_words, col_words, tidx, tm, tk, M, K, half_k, half_m, nsc_r,
                nsc_c, pad_c_c, row_thr, col_thr, offs, q_base, s_base, qt_base, st_base)
        tail = (enc_tab, run_sc, col_outer, rht_b, tile_scale, sc_buf, sr, lane_grp)
        if cutlass.const_expr(self.input_signs or self.fast_rcp):
            if self._fast_blocks_ok(sdec, col_outer, amax_cur):
                self._passes(*head, s6, sdec, *tail, True)
            else:
                s6_i, sdec_i = s6, sdec
                if cutlass.const_expr(self.per_token and self.fast_rcp):  # the IEEE ones
                    s6_i, sdec_i = outer_block_scales(amax_cur, E.E4M3_MAX)
                self._passes(*head, s6_i, sdec_i, *tail, False)
        else:
            self._passes(*head, s6, sdec, *tail, False)

        cute.arch.sync_warp()
        pipe.consumer_release(cstate)
        return amax_next, s6, sdec

    @cute.jit
    def _passes(self, stage_addr, row_words, col_words, tidx, tm, tk, M, K, half_k, half_m,
                nsc_r, nsc_c, pad_c_c, row_thr, col_thr, offs, q_base, s_base, qt_base, st_base,
                s6, sdec, enc_tab, run_sc, col_outer, rht_b, tile_scale, sc_buf, sr, lane_grp,
                fast: cutlass.Constexpr):
        """_cast_tile's rowwise and columnwise passes (lane_grp: _lane_row_group's); fast: the
        copy for tiles where _fast_blocks_ok holds (input_signs: the stochastic encoder takes
        the signs from the 16-bit inputs; fast_rcp: the blocks' enc from the fast
        reciprocal)."""
        if cutlass.const_expr(self.rht and self.stochastic):
            if cutlass.const_expr(not self.preload):
                col_words = self._col_words(stage_addr, offs)
            self._rht_transform(col_words, rht_b)
        if cutlass.const_expr(self.rowwise):
            s6_r, enc_tab_r, row_sw = s6, enc_tab, None
            if cutlass.const_expr(self.row_groups):  # the warp's rows' (block row `warp`)
                if cutlass.const_expr(not self.per_token):
                    s6_r, enc_tab_r = lane_grp[4], lane_grp[5]
                if cutlass.const_expr(self.swizzle):
                    row_sw = lane_grp[6]
            self._row_pass(stage_addr, row_words, tidx, tm, tk, M, K, half_k, nsc_r, row_thr,
                           q_base, s_base, s6_r, sdec, enc_tab_r, run_sc, tile_scale, sr,
                           row_sw, fast)
        if cutlass.const_expr(self.rht):
            if cutlass.const_expr(not self.stochastic):
                if cutlass.const_expr(not self.preload):
                    col_words = self._col_words(stage_addr, offs)
                self._rht_transform(col_words, rht_b)
            self._col_pass_rht(tidx, tm, tk, M, K, half_m, nsc_c, pad_c_c, qt_base, st_base,
                               s6, sdec, col_outer, enc_tab, rht_b, sr, fast)
        elif cutlass.const_expr(self.columnwise):
            if cutlass.const_expr(not self.preload):
                col_words = self._col_words(stage_addr, offs)
            if cutlass.const_expr(self.block2d):  # the tile scales of the column blocks
                cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
                tile_scale = self._col_tile_scale(tidx, sc_buf)
            own = None  # per token with row_groups the IEEE copy: each thread's own columns'
            # outer scales (tiles spanning groups: _cast_tile)
            if cutlass.const_expr(self.row_groups and self.per_token and not fast):
                own = col_outer[1]
            self._col_pass(col_words, tidx, tm, tk, M, K, half_m, nsc_c, pad_c_c, col_thr,
                           qt_base, st_base, s6, sdec, enc_tab, tile_scale, sr, lane_grp, own,
                           fast)

    @cute.jit
    def _flush_run_scales(self, buf, tidx, tm, uk, M, nsc_r, s_base):
        """Run walk: the rowwise scales of the run (unit uk of tile row tm), staged in smem
        buffer `buf` by every consumer warp, go out as 16-byte stores, two per row, i.e. whole
        32-byte sectors (the compact scales of one tile are 4-byte pieces of 128 rows: written
        from the tile they cost one L2 write request each, which with the twin's 8-byte pieces
        bounds the cast at 2^27+ elements; notes/quant.md "Session 12"); the threads of
        group 0 store them."""
        cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        r = tidx // 2
        half = tidx % 2
        gr = tm * self.tile_m + r
        ok = gr < M
        if cutlass.const_expr(self.groups > 1):
            ok = ok & (tidx < self.group_threads)
        if ok:
            E.st_global_v4(s_base + Int64(gr) * nsc_r + Int64(uk) * RUN_SCALE_BYTES + half * 16,
                           E.ld_shared_v4(buf + r * RUN_SCALE_BYTES + half * 16))

    # ------------------------------------------------------------------ tile walk
    def _walk_steps(self, stride, n_uk):
        """_next_tile's steps for a walk `stride` units at a time (n_uk units per tile row)."""
        if cutlass.const_expr(self.band > 1):
            span = self.band * n_uk
            return (stride // span, (stride // self.band) % n_uk, stride % self.band)
        return (stride // n_uk, stride % n_uk, 0)

    @cute.jit
    def _next_tile(self, tm, tk, steps, n_tk):
        """The tile gdim after (tm, tk), or before it with reverse (tm then negative past the
        first tile: _lane_amax clamps it). Tiles are ordered by band of `band` tile rows, then
        tk, then tm within the band: tile t is (t // span * band + t % band, t % span // band)
        with span = band * n_tk, and gdim = (bands, tk, rows) steps = (gdim // span,
        gdim // band % n_tk, gdim % band). Band order puts the tiles sharing a 32-byte sector
        of the compact twin's scales (band 4: 4 x 8 bytes along M) in one wave of CTAs."""
        step_b, step_k, step_r = steps
        one, zero = Int32(1), Int32(0)
        band = self.band
        r = tm & (band - 1)
        if cutlass.const_expr(self.reverse):
            r2 = r - step_r
            carry = r2 < 0
            tk = tk - step_k - cutlass.select_(carry, one, zero)
            wrap = tk < 0
            return (tm - r - (step_b + cutlass.select_(wrap, one, zero)) * band
                    + cutlass.select_(carry, r2 + band, r2),
                    cutlass.select_(wrap, tk + n_tk, tk))
        r2 = r + step_r
        carry = r2 >= band
        tk = tk + step_k + cutlass.select_(carry, one, zero)
        wrap = tk >= n_tk
        return (tm - r + (step_b + cutlass.select_(wrap, one, zero)) * band
                + cutlass.select_(carry, r2 - band, r2),
                cutlass.select_(wrap, tk - n_tk, tk))

    @cute.jit
    def _lane_amax(self, tm, tk, M, K, tidx, ar_base, ac_base, g=None):
        """Per token: the amax whose outer scale this lane computes for its warp in tile
        (tm, tk), once per tile instead of once per thread and block: lanes 0 .. warp_rows - 1
        take the warp's rows (the rowwise pass's lanes of row r read lane r % warp_rows), the
        next warp_cols lanes its columns (the columnwise pass's; with row_groups in group g,
        the lane's block row's, used where the tile's block rows lie in one group:
        _cast_tile); indices clamped into the tensor (tail rows / columns, spare lanes). Per
        tensor (row_groups too): 0, unused."""
        amax = Float32(0.0)
        if cutlass.const_expr(self.per_token):
            warp = tidx // 32
            lane = tidx % 32
            wr = self.warp_rows
            row = cutlass.min(cutlass.max(tm, 0) * self.tile_m + warp * wr + lane, M - 1)
            col = self._lane_col(tk, K, warp, lane)
            addr = ar_base + Int64(row) * 4
            if cutlass.const_expr(self.columnwise):
                col_off = Int64(col)
                if cutlass.const_expr(g is not None):
                    col_off = Int64(g) * Int64(K) + col_off
                col_addr = ac_base + col_off * 4
                if cutlass.const_expr(self.rowwise):
                    addr = cutlass.select_(lane < wr, addr, col_addr)
                else:
                    addr = col_addr
            amax = E.ld_global_f32(addr)
        return amax

    def _lane_col(self, tk, K, warp, lane):
        """Per token: the column of tile column tk whose outer scale lane (warp_rows ..
        warp_rows + warp_cols - 1) computes for its warp's column pass (_lane_amax; clamped
        into the tensor, the other lanes' one of them)."""
        wr = self.warp_rows
        return cutlass.min(tk * self.tile_k + self._warp_col0(warp)
                           + cutlass.min(cutlass.max(lane - wr, 0), self.warp_cols - 1), K - 1)

    def _n_groups(self, starts):
        """row_groups: the number G of groups of the `starts` tables (group_tables of G + 1
        entries)."""
        return starts.shape[0] // self.group_tables - 1

    def _group_tables(self, enc_tab):
        """row_groups: the smem address of the GROUP_* tables (per tensor after the enc tables
        and the groups' outer scales, _fill_group_tables)."""
        if self.per_token:
            return enc_tab
        return enc_tab + self.row_groups * (ENC_CODES * 4 + 8)

    def _group_entry(self, starts, table, g):
        """Entry g of row_groups table `table` (GROUP_*) in smem (_fill_group_tables)."""
        return Int32(E.ld_shared_u32(starts + (table * (self.row_groups + 1) + g) * 4))

    @cute.jit
    def _find_group(self, starts, table, key):
        """(g, entry g) for the last group g whose entry of `table` (ascending; those past the
        G groups at least every key) is at most key: a binary search in smem."""
        g = Int32(0)
        start = Int32(0)
        step = self.row_groups
        for _ in cutlass.range_constexpr(self.row_groups.bit_length() - 1):
            step //= 2
            entry = self._group_entry(starts, table, g + step)
            found = entry <= key
            g = cutlass.select_(found, g + step, g)
            start = cutlass.select_(found, entry, start)
        return g, start

    @cute.jit
    def _lane_block_group(self, tm, M, tidx, starts):
        """row_groups: (lane l's block row l / 4 of tile row tm, clamped into the tensor, its
        group g and g's first block row: _find_group)."""
        blk = cutlass.min(cutlass.max(tm, 0) * (self.tile_m // 16) + tidx % 32 // 4,
                          M // 16 - 1)
        return (blk,) + self._find_group(starts, GROUP_FIRST, blk)

    @cute.jit
    def _lane_row_group(self, tm, tm_n, M, K, tidx, starts, enc_tab):
        """row_groups: lane l's block row l / 4 of tile row tm (clamped into the tensor) and
        its group g (_find_group in the first block rows, those past the G groups M / 16).
        Returns (g's s6, g's enc table, the twin unit of the block in input column 0, g's
        block rows, and the s6 and enc table of block row `warp`, the rowwise pass's (lane
        4 warp's); per token g, with the twin uni (whether the warp's lanes' block rows, all
        8 of the tile row, lie in one group) and the lane's group in tile row tm_n (the
        walk's next unit's), and None); a twin unit is 8 data bytes and 1 scale byte
        (compact). Swizzled, three more: the swizzled offset of row 0 column 0 of block row
        `warp`'s rowwise scales, that of the block's twin scale in input column 0, and the
        twin scales' bytes per 128 input columns. Called once per unit of
        the walk. Measured against a [M / 16, 4] global table read per tile (one tile ahead
        where the walk prefetches), both with predicated twin stores (H200, bf16, N = 8,
        quantize_grouped in graphs): row+col 4096x8192 63.8 -> 61.4 us, 16384x2048 64.8 ->
        61.8, 8192^2 117.0 -> 111.8; below 2^25 elements, where units were single tiles, 0.1-1
        us slower (4096x2048 22.1 -> 23.0, rowwise 17.2 -> 18.1; notes/quant_recipes.md
        "Session 39")."""
        blk, g, blk0 = self._lane_block_group(tm, M, tidx, starts)
        nblk = self._group_entry(starts, GROUP_FIRST, g + 1) - blk0
        unit = Int64(K) * Int64(blk0) + Int64(blk - blk0)
        src = tidx // 32 * 4
        if cutlass.const_expr(self.per_token):
            # the lanes' outer scales are their rows' and their columns' in group g
            uni = g_n = None
            if cutlass.const_expr(self.columnwise):
                uni = cute.arch.vote_all_sync(g == cute.arch.shuffle_sync(g, 0))
                g_n = self._lane_block_group(tm_n, M, tidx, starts)[1]
            out = (g, uni, unit, Int64(nblk), g_n, None)
        else:
            s6 = E.bits_f32(E.ld_shared_u32(enc_tab + (self.row_groups * ENC_CODES + 2 * g) * 4))
            tab = enc_tab + g * (ENC_CODES * 4)
            out = (s6, tab, unit, Int64(nblk), cute.arch.shuffle_sync(s6, src),
                   cute.arch.shuffle_sync(tab, src))
        if cutlass.const_expr(self.swizzle):
            # the rowwise scales: block row vb of the groups' padded rows (that of block row
            # `warp`); the twin's: its scale column blk - blk0 of the group's [K, nblk] scales
            vb = self._group_entry(starts, GROUP_ROW_SW, g) + blk - blk0
            vb = cute.arch.shuffle_sync(vb, src)
            bl = blk - blk0
            tfirst = self._group_entry(starts, GROUP_TWIN_SW, g)
            out += (Int64(vb // 8) * Int64((K + 63) // 64 * 512)
                    + Int64(vb % 2 * 256 + vb % 8 // 2 * 4),
                    (Int64(tfirst) + Int64(bl // 4)) * 512 + Int64(bl % 4),
                    Int64((nblk + 3) // 4 * 512))
        return out

    @cute.jit
    def _fill_group_tables(self, enc_tab, tidx, bidx, amax, starts):
        """row_groups: the groups' tables (starts: group_tables tables of G + 1 entries, in
        smem row_groups + 1 entries each, those past G equal to entry G; GROUP_*), the group
        amaxes, reduced from the AmaxTensor partials after the G amax words (the partials of
        group g from its GROUP_PARTIALS entry on: red.shared.max on the bits, whose order is
        max.NaN's for amaxes; CTA 0 writes them to amax[:G]), each group's outer scales (s6,
        sdec) after row_groups enc tables, then those tables (_fill_enc_tables per group);
        a lane then finds its block row's group, table and s6 (_lane_row_group,
        _cast_tile). Per token only the tables (amax unused). Returns the smem tables."""
        n_groups = self._n_groups(starts)
        first = self._group_tables(enc_tab)
        if cutlass.const_expr(not self.per_token):
            outer = enc_tab + self.row_groups * ENC_CODES * 4  # the groups' (s6, sdec)
            if tidx < self.row_groups:  # the group amaxes' accumulators
                E.st_shared_v2(outer + tidx * 8, Uint32(0), Uint32(0))
        if tidx <= self.row_groups:
            for t in cutlass.range_constexpr(self.group_tables):
                E.st_shared_u32(first + (t * (self.row_groups + 1) + tidx) * 4,
                                starts[t * (n_groups + 1) + cutlass.min(tidx, n_groups)])
        if cutlass.const_expr(self.per_token):
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        else:
            n_partials = amax.shape[0] - n_groups
            ar_base = amax.iterator.toint()
            # a thread's partials are `loads` consecutive ones (every load issued before the
            # reduction; indices past the last re-read it), at most max_tensor_partials +
            # row_groups in all (group_chunks); in group order, so mostly of one group
            loads = -(-(max_tensor_partials(self.num_sms) + self.row_groups)
                      // self.consumer_threads)
            parts = [cutlass.min(tidx * loads + u, n_partials - 1) for u in range(loads)]
            bits = [Uint32(E.f32_bits(E.ld_global_f32(ar_base + Int64(n_groups + p) * 4)))
                    for p in parts]
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
            # the thread's maximum per group (a shared atomic when its partials pass into a later
            # group), then the warp's per group: a segmented reduction over the lanes (a group's
            # lanes are consecutive) towards the group's first lane, whose shared atomic is the
            # only one of the group in the warp. Measured against a search and an atomic per
            # partial, the partials strided (H200, bf16, N = 8, 1064 partials, rowwise compact
            # cast kernel times): 4096x2048 10.05 -> 8.69 us, 8192x2048 14.80 -> 13.44, 4096x8192
            # 23.48 -> 22.31, 8192^2 42.71 -> 41.41 (notes/quant_recipes.md "Session 41")
            g, _ = self._find_group(first, GROUP_PARTIALS, parts[0])
            nxt = self._group_entry(first, GROUP_PARTIALS, g + 1)
            acc = bits[0]  # (the search began at parts[0]: it lies in group g)
            for u in cutlass.range_constexpr(1, loads):
                if parts[u] >= nxt:
                    E.red_shared_max_u32(outer + g * 8, acc)
                    g, _ = self._find_group(first, GROUP_PARTIALS, parts[u])
                    nxt = self._group_entry(first, GROUP_PARTIALS, g + 1)
                    acc = Uint32(0)
                acc = Uint32(cutlass.select_(bits[u] > acc, bits[u], acc))
            lane = tidx % 32
            for off in (1, 2, 4, 8, 16):
                acc_up = cute.arch.shuffle_sync_down(acc, off)
                g_up = cute.arch.shuffle_sync_down(g, off)
                acc = cutlass.select_((lane + off < 32) & (g_up == g) & (acc_up > acc), acc_up, acc)
            if (lane == 0) | (cute.arch.shuffle_sync_up(g, 1) != g):
                E.red_shared_max_u32(outer + g * 8, acc)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
            if tidx < n_groups:
                amax_g = E.ld_shared_u32(outer + tidx * 8)
                if bidx == 0:
                    E.st_global_u32(ar_base + Int64(tidx) * 4, amax_g)
                s6, sdec = outer_block_scales(E.bits_f32(amax_g), E.E4M3_MAX)
                E.st_shared_v2(outer + tidx * 8, E.f32_bits(s6), E.f32_bits(sdec))
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
            for i in cutlass.range(tidx, n_groups * ENC_CODES, self.consumer_threads, unroll=1):
                sdec = E.bits_f32(E.ld_shared_v2(outer + i // ENC_CODES * 8)[1])
                E.st_shared_u32(enc_tab + i * 4,
                                E.f32_bits(E.enc_from_code(Uint32(i % ENC_CODES), sdec)))
            cute.arch.barrier(barrier_id=1, number_of_threads=self.consumer_threads)
        return first

    def _warp_col0(self, warp):
        """First tile column of the warp in the column pass: 16 / esize columns per warp, or
        with the RHT 16 columns of one half of the tile rows (_col_offsets)."""
        if self.rht:
            return (warp % 4) * 16
        return warp * self.warp_cols

    # ------------------------------------------------------------------ rowwise pass
    @cute.jit
    def _row_thread_offsets(self, tidx, half_k, nsc_r):
        """Per rowwise step j: (row r in the tile, data byte offset r * K/2 + b * 8, compact
        scale offset r * K/16 + b, swizzled scale offset) of the thread's block b; a tile adds
        a uniform base. Swizzled: a tile's scales (128 rows from a multiple of 128, tile_k / 16
        <= 4 columns from a multiple of tile_k / 16) lie in one 128x4 scale tile, so
        swizzled_scale_offset(row0 + r, c0 + b, n) = swizzled_scale_offset(row0, c0, n)
        + swizzled_scale_offset(r, b, 4): the divisions are per tile, not per block."""
        bpr = self.bpr
        rows_per_step = 32 // bpr
        warp = tidx // 32
        lane = tidx % 32
        b = lane % bpr
        out = []
        for j in cutlass.range_constexpr(self.row_steps):
            r = (warp * self.row_steps + j) * rows_per_step + lane // bpr
            out.append((r, Int64(r) * half_k + Int64(b) * 8, Int64(r) * nsc_r + Int64(b),
                        swizzled_scale_offset(r, b, Int32(4))))
        return out

    def _words_amax(self, words, xs):
        """max.NaN of |x| over the input words of rowwise blocks: fp32 from their values xs,
        16-bit types on the packed pairs (E.amax_pairs; xs unused)."""
        if self.esize == 4:
            return E.block_amax(xs)
        return E.amax_fold(E.amax_pairs(words, self.dtype_name), self.dtype_name)

    def _row_words(self, stage_addr, tidx, row_thr):
        """The words of the thread's rowwise blocks, per step (_row_step_words)."""
        return [self._row_step_words(stage_addr, tidx, row_thr[j][0])
                for j in range(self.row_steps)]

    @cute.jit
    def _tile_scales(self, row_words, tidx, s6, sdec, enc_tab, sc_buf):
        """block2d: (scale byte, enc) of the thread's 16x16 tile. Warp w's rowwise steps cover
        the tile rows 16 w .. 16 w + 15 (row_steps * 32 / bpr of them) and lane % bpr is the
        block column, so the tile amax is the max over the thread's steps and the lanes
        sharing lane % bpr. With the twin, lanes 0 .. bpr - 1 store the (byte, enc) of tile
        (w, lane) at sc_buf for the columnwise pass (_col_tile_scale)."""
        words = [w for step in row_words for w in step]
        xs = [E.bits_f32(v) for v in words] if self.esize == 4 else None
        amax = self._words_amax(words, xs)
        for m in (16, 8, 4, 2, 1):
            if cutlass.const_expr(m >= self.bpr):
                amax = E.shfl_xor_max_nan(amax, m)
        code, enc = self._block_scale(amax, s6, sdec, enc_tab)
        if cutlass.const_expr(self.columnwise):
            lane = tidx % 32
            if lane < self.bpr:
                E.st_shared_v2(sc_buf + (tidx // 32 * self.bpr + lane) * 8, code, E.f32_bits(enc))
        return code, enc

    @cute.jit
    def _col_tile_scale(self, tidx, sc_buf):
        """block2d: (scale byte, enc) of the columnwise thread's tile (block row lane / 4,
        the column block of the warp's 16 / esize columns), from _tile_scales."""
        rb = tidx % 32 // 4
        code, enc = E.ld_shared_v2(sc_buf + (rb * self.bpr + tidx // 32 // self.esize) * 8)
        return code, E.bits_f32(enc)

    def _row_step_words(self, stage_addr, tidx, r):
        """The words of the thread's rowwise block in tile row r of the stage at stage_addr:
        16-byte loads of swizzled chunks (conflict-free)."""
        b = tidx % 32 % self.bpr
        row_addr = stage_addr + r * self.tile_bytes
        words = []
        for u in range(self.esize):  # 16-byte chunks per block
            words += list(E.ld_shared_v4(row_addr + (((b * self.esize + u) ^ (r % 8)) * 16)))
        return words

    @cute.jit
    def _row_pass(self, stage_addr, row_words, tidx, tm, tk, M, K, half_k, nsc_r, row_thr,
                  q_base, s_base, s6, sdec, enc_tab, run_sc, tile_scale, sr, row_sw,
                  fast: cutlass.Constexpr = False):
        """Lanes of a warp take consecutive 16-element blocks of consecutive rows, so one warp
        store covers whole 32-byte sectors (bpr blocks of 8 bytes per row). Per token, s6 /
        sdec are the lane's (_lane_amax). row_words: the steps' words (preload, block2d), or
        None: each step reads its own. run_scales: the compact scales go to the run's smem
        buffer at run_sc (this tile's column there) instead of global memory. tile_scale
        (block2d): the (scale byte, enc) of every step's block. sr: stochastic rounding
        (_sr_state); row_sw: row groups with swizzled scales, the warp's block row's
        (_lane_row_group), else None; fast: the passes' fast copy (_passes)."""
        bpr = self.bpr
        lane = tidx % 32
        b = lane % bpr
        gcol_blk = tk * bpr + b  # global scale column
        col_ok = gcol_blk * 16 < K
        row0 = tm * self.tile_m
        q_tile = q_base + Int64(row0) * half_k + Int64(tk * bpr) * 8
        s_tile = s_base + Int64(row0) * nsc_r + Int64(tk * bpr)
        sw_tile = s_base
        if cutlass.const_expr(self.swizzle and row_sw is not None):
            sw_tile = s_base + row_sw + Int64(swizzled_scale_offset(Int32(0), tk * bpr,
                                                                    Int32(nsc_r)))
        elif cutlass.const_expr(self.swizzle):
            sw_tile = s_base + Int64(swizzled_scale_offset(row0, tk * bpr, Int32(nsc_r)))
        for j in cutlass.range_constexpr(self.row_steps):
            r, q_off, s_off, sw_off = row_thr[j]
            gr = row0 + r
            s6_r, sdec_r = s6, sdec
            if cutlass.const_expr(self.per_token):
                src = j * (32 // bpr) + lane // bpr  # row r - warp_rows * warp
                s6_r = cute.arch.shuffle_sync(s6, src)
                sdec_r = cute.arch.shuffle_sync(sdec, src)
            if cutlass.const_expr(row_words is not None):
                words = row_words[j]
            else:
                words = self._row_step_words(stage_addr, tidx, r)
            xs = []
            if cutlass.const_expr(self.esize == 4):
                xs = [E.bits_f32(v) for v in words]
            else:
                for v in words:
                    xs += [E.unpack_lo(v, self.dtype_name), E.unpack_hi(v, self.dtype_name)]
            rnd = sgn = None
            if cutlass.const_expr(sr is not None):
                rnd = self._philox(Int64(gr) * nsc_r + Int64(gcol_blk), 0, sr)
            if cutlass.const_expr(fast and self.input_signs):
                sgn = E.input_signs16(words, self.dtype_name)
            if cutlass.const_expr(tile_scale is not None):
                code = tile_scale[0]
                w0, w1 = self._encode16(xs, tile_scale[1], rnd, sgn, fast)
            else:
                code, w0, w1 = self._quantize16(xs, self._words_amax(words, xs), s6_r, sdec_r,
                                                enc_tab, rnd, sgn, fast)
            valid = (gr < M) & col_ok
            if valid:
                E.st_global_v2(q_tile + q_off, w0, w1)
            if cutlass.const_expr(self.swizzle and row_sw is not None):
                # row groups: the warp's block row's scales from row_sw (rows past M have
                # none; the groups' padding rows: _zero_padding)
                E.st_global_u8(sw_tile + Int64(r % 16 * 16 + b),
                               cutlass.select_(col_ok, code, Uint32(0)), pred=Int32(gr < M))
            elif cutlass.const_expr(self.swizzle):
                # padding entries (rows >= M, blocks >= K/16) must be 0 whatever the outer scale
                E.st_global_u8(sw_tile + Int64(sw_off), cutlass.select_(valid, code, Uint32(0)))
            else:
                if cutlass.const_expr(self.run_scales):
                    E.st_shared_u8(run_sc + r * RUN_SCALE_BYTES + b, code)
                else:
                    if valid:
                        E.st_global_u8(s_tile + s_off, code)

    # ------------------------------------------------------------------ columnwise pass
    @cute.jit
    def _col_offsets(self, tidx):
        """Per-thread smem byte offsets (within a stage) of the columnwise pass: the thread's
        4-byte word in block rows 0..7 of its step order.

        Warp w reads the 16-byte column chunk w of the tile; lane = (rb, cp): block row rb of 16
        rows, 4-byte word cp of the chunk. At step i lane rb reads row rb*16 + ((i + rb) % 8)
        (and + 8 for the second half), so the 8 block rows hit 8 different swizzled chunks:
        conflict-free. The value read at step i is element (i + rb) % 8 of its half block: the
        encoded word is rotated left by rb nibbles (_col_pass)."""
        warp = tidx // 32
        lane = tidx % 32
        if cutlass.const_expr(self.rht):
            return self._rht_offsets(warp, lane)
        rb = lane // 4
        cp = lane % 4
        offs = []
        for i in cutlass.range_constexpr(8):
            ii = (Int32(i) + rb) % 8
            offs.append((rb * 16 + ii) * self.tile_bytes + ((warp ^ ii) * 16) + cp * 4)
        return offs

    @cute.jit
    def _col_thread_offsets(self, tidx, half_m, nsc_c):
        """Per input column cc of the thread's word: (column c in the tile, data byte offset
        c * M/2 + rb * 8, compact scale offset c * M/16 + rb, swizzled scale offset); a tile
        adds a uniform base. Swizzled: the twin's scale rows col0 + c (col0 a multiple of
        tile_k >= 32, c < tile_k) stay in one 128-row scale tile and its scale columns
        blk0 + rb (blk0 a multiple of 8) in two 4-column ones, so swizzled_scale_offset(col0 + c,
        blk0 + rb, n) = swizzled_scale_offset(col0, blk0, n) + swizzled_scale_offset(c, rb, 8)."""
        warp = tidx // 32
        lane = tidx % 32
        rb = lane // 4
        cols = 4 // self.esize  # input columns per 4-byte word
        out = []
        for cc in cutlass.range_constexpr(cols):
            c = warp * (16 // self.esize) + (lane % 4) * cols + cc
            out.append((c, Int64(c) * half_m + Int64(rb) * 8, Int64(c) * nsc_c + Int64(rb),
                        swizzled_scale_offset(c, rb, Int32(8))))
        return out

    def _col_words(self, stage_addr, offs):
        """The 16 words of the thread's columnwise blocks in the stage at stage_addr (the
        rotated order of _col_offsets); with the RHT its 4 MMA A fragments (_rht_offsets)."""
        if self.rht:
            return [ldmatrix_x4_trans(stage_addr + o) for o in offs]
        return [E.ld_shared_u32(stage_addr + offs[i % 8] + (i // 8) * 8 * self.tile_bytes)
                for i in range(16)]

    @cute.jit
    def _col_pass(self, words, tidx, tm, tk, M, K, half_m, nsc_c, pad_c_c, col_thr,
                  qt_base, st_base, s6, sdec, enc_tab, tile_scale, sr, lane_grp,
                  own=None, fast: cutlass.Constexpr = False):
        """Lanes with consecutive block rows store consecutive 8-byte pieces of one output row
        (64 bytes per input column and tile) from the thread's 16 words (_col_words). Per
        token, s6 / sdec are the lane's (_lane_amax), or with own (row_groups: the groups' K
        column amaxes one after another, amax_c) those of the thread's own column's amax in
        its block row's group; per tensor with row_groups s6 / enc_tab those of the lane's
        block row, lane_grp _lane_row_group's (the twin unit in input column 0 and the
        group's block rows). tile_scale (block2d): the (scale byte, enc) of the thread's
        blocks (one 16x16 tile). sr: stochastic rounding (_sr_state); fast: the passes' fast copy
        (_passes)."""
        lane = tidx % 32
        rb = lane // 4
        cols = 4 // self.esize  # input columns per 4-byte word
        if cutlass.const_expr(self.esize == 2 and tile_scale is None):
            # block amax of both columns of the words at once (low / high halves)
            pair = E.amax_pairs(words, self.dtype_name)
            amax2 = (E.unpack_lo(pair, self.dtype_name), E.unpack_hi(pair, self.dtype_name))
        sws = None  # with the signs: both columns' (element i of column cc: half cc of i)
        if cutlass.const_expr(fast and self.input_signs):
            sws = [E.sign_word(v, self.dtype_name) for v in words]
        blk0 = tm * (self.tile_m // 16)
        gblk = blk0 + rb  # global block index along M
        row_ok = gblk * 16 < M
        col0 = tk * self.tile_k
        qt_tile = qt_base + Int64(col0) * half_m + Int64(blk0) * 8
        st_tile = st_base + Int64(col0) * nsc_c + Int64(blk0)
        sw_tile = st_base
        if cutlass.const_expr(self.swizzle):
            sw_tile = st_base + Int64(swizzled_scale_offset(col0, blk0, Int32(nsc_c)))
        unit = None  # row_groups: the twin unit of the thread's block in column cc
        tsw = None  # row_groups, swizzled: its twin scale's offset in column col0 + c (+ c's)
        if cutlass.const_expr(self.row_groups):
            unit = lane_grp[2] + Int64(col0 + col_thr[0][0]) * lane_grp[3]
            if cutlass.const_expr(self.swizzle):
                tsw = (st_base + lane_grp[7] + Int64(col0 // 128) * lane_grp[8]
                       + Int64(col0 % 128 // 32 * 4))
        for cc in cutlass.range_constexpr(cols):
            c, q_off, s_off, sw_off = col_thr[cc]
            gk = col0 + c
            s6_c, sdec_c = s6, sdec
            if cutlass.const_expr(own is not None):
                col = Int64(lane_grp[0]) * Int64(K) + Int64(cutlass.min(gk, K - 1))
                s6_c, sdec_c = outer_block_scales(E.ld_global_f32(own + col * 4), E.E4M3_MAX)
            elif cutlass.const_expr(self.per_token):
                src = self.warp_rows + (lane % 4) * cols + cc  # column c - warp * 16 / esize
                s6_c = cute.arch.shuffle_sync(s6, src)
                sdec_c = cute.arch.shuffle_sync(sdec, src)
            xs = []
            for i in cutlass.range_constexpr(16):
                if cutlass.const_expr(self.esize == 4):
                    xs.append(E.bits_f32(words[i]))
                elif cutlass.const_expr(cc == 0):
                    xs.append(E.unpack_lo(words[i], self.dtype_name))
                else:
                    xs.append(E.unpack_hi(words[i], self.dtype_name))
            sgn = None if sws is None else (sws, [cc] * 16)
            if cutlass.const_expr(tile_scale is not None):
                code = tile_scale[0]
                w0, w1 = self._encode16(xs, tile_scale[1], self._col_rnd(gk, gblk, nsc_c, sr),
                                        sgn, fast)
            else:
                if cutlass.const_expr(self.esize == 4):
                    amax = E.block_amax(xs)
                else:
                    amax = amax2[cc]
                rnd = self._col_rnd(gk, gblk, nsc_c, sr)
                code, w0, w1 = self._quantize16(xs, amax, s6_c, sdec_c, enc_tab, rnd, sgn, fast)
            w0 = E.rotl_nibbles(w0, rb)
            w1 = E.rotl_nibbles(w1, rb)
            valid = (gk < K) & row_ok
            if cutlass.const_expr(self.row_groups):
                # predicated stores: under an `if`, ptxas branched around them (the per-lane
                # addresses), cutting the tile's schedule into regions (measured, H200, bf16
                # row+col, the cast alone: 4096x8192 46.2 -> 44.8 us, 8192^2 82.9 -> 80.0)
                if cutlass.const_expr(cc > 0):
                    unit = unit + lane_grp[3]
                ok = Int32(valid)
                E.st_global_v2(qt_base + unit * 8, w0, w1, pred=ok)
                if cutlass.const_expr(self.swizzle):  # (c < 128: one row of a 128x4 tile)
                    E.st_global_u8(tsw + Int64(c % 32 * 16 + c // 32 * 4), code, pred=ok)
                else:
                    E.st_global_u8(st_base + unit, code, pred=ok)
            else:
                if valid:
                    E.st_global_v2(qt_tile + q_off, w0, w1)
                if cutlass.const_expr(self.swizzle):
                    if Int64(gblk) < pad_c_c:
                        E.st_global_u8(sw_tile + Int64(sw_off),
                                       cutlass.select_(valid, code, Uint32(0)))
                else:
                    if valid:
                        E.st_global_u8(st_tile + s_off, code)

    def _col_rnd(self, gk, gblk, nsc_c, sr):
        """The 4 random words of the twin block (gk, gblk) rotated like the column pass's
        values (_sr_state), or None without stochastic rounding."""
        if cutlass.const_expr(sr is None):
            return None
        p = self._philox(Int64(gk) * nsc_c + Int64(gblk), 1, sr)
        lo, hi = sr[2]
        return [Uint32(prmt(p[h], p[h + 1], sel)) for h in (0, 2) for sel in (lo, hi)]

    # ------------------------------------------------------------------ columnwise RHT pass
    # Warp w takes the 16 tile columns 16 * (w % 4) .. + 15 (two 16-byte chunks) in the tile
    # rows 64 * (w // 4) .. + 63: 4 block rows i of 16 rows. Per block row, two MMAs
    # m16n8k16 D = A B give the transform of the warp's 16 columns: A[j][k] = x[16 i + k][j]
    # (the block transposed: ldmatrix .trans of the row-major smem tile, conflict-free with
    # its 128-byte swizzle) and B = the RHT matrix 0.25 * diag(sign) H16 with its 16 output
    # columns in the order RHT_OUT (constant fragments, _rht_fragments), so that lane
    # (g = lane / 4, q = lane % 4) holds outputs 4q .. 4q + 3 of columns g and g + 8, one
    # 16-byte exchange slot (_rht_exchange). Products of 16-bit values and +-0.25 are exact and
    # the 16 terms add in FP32 on the tensor core: the same values as the reference's FP32
    # butterflies wherever no partial sum rounds (a block's nonzero magnitudes within 2^12 of
    # each other for bf16), else within the SPEC's RHT tolerance.
    RHT_OUT = (0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)

    @cute.jit
    def _rht_offsets(self, warp, lane):
        """Per block row i of the warp: the smem byte offset (within a stage) of the row this
        lane gives ldmatrix: matrix j = lane / 8 is rows 8 (j / 2) .. + 7 of the block and the
        warp's chunk j % 2; lane % 8 is the row in it (so row % 8 = lane % 8)."""
        row = (warp // 4) * 64 + (lane // 16) * 8 + lane % 8
        chunk = 2 * (warp % 4) + (lane // 8) % 2
        off = row * self.tile_bytes + ((chunk ^ (lane % 8)) * 16)
        return [off + i * 16 * self.tile_bytes for i in range(4)]

    @cute.jit
    def _rht_fragments(self, tidx):
        """The lane's B fragments of the two RHT MMAs (output columns RHT_OUT[8h .. 8h + 7]):
        (b0, b1) with b0 = rows 2q, 2q + 1 and b1 = rows 2q + 8, 2q + 9 of output column
        n = g; entry (k, o) = +-0.25, negative where sign[k] * (-1)^popcount(k & o) is."""
        lane = tidx % 32
        g = Uint32(lane // 4)
        q = Uint32(lane % 4)
        pos, neg = RHT_QUARTER[self.dtype_name]
        frags = []
        for h in cutlass.range_constexpr(2):
            o = ((g >> 1) << 2) | Uint32(2 * h) | (g & 1)  # RHT_OUT[8h + g]
            regs = []
            for k_lo in cutlass.range_constexpr(0, 16, 8):
                halves = []
                for k_off in cutlass.range_constexpr(2):
                    k = q * 2 + Uint32(k_lo + k_off)
                    p = k & o
                    p = p ^ (p >> 2)
                    p = p ^ (p >> 1)
                    minus = (p ^ (Uint32(RHT_NEG) >> k)) & 1
                    halves.append(cutlass.select_(minus == 1, Uint32(neg), Uint32(pos)))
                regs.append(Int32(halves[0] | (halves[1] << 16)))
            frags.append(tuple(regs))
        return frags

    def _rht_exchange(self, tidx, xch_base):
        """The lane's smem addresses of the twin's exchange (_col_pass_rht): per output column
        cc, the 16-byte slots where lane (g, q) stores its 4 values of block rows i = 0 .. 3
        and those it loads, outputs 4 j .. 4 j + 3 of block row q for j = 0 .. 3 (stored by
        lane (g, j)). A column's buffer holds 8 x 16 slots; the slot of (g, block row i,
        values of lane q) is g * 16 + 8 * (i % 2) + ((i + q) % 4 + 4 * ((g + i / 2) % 2)), so
        the 8 lanes of a quarter warp (g and g + 1, q = 0 .. 3) hit 8 distinct 16-byte bank
        groups in both directions."""
        lane = tidx % 32
        g = lane // 4
        q = lane % 4
        base = xch_base + (tidx // 32) * 2 * self.XCH_COL_BYTES

        def slot(i, j):
            return (g * 16 + 8 * (i % 2) + ((i + j) % 4 + 4 * ((g + i // 2) % 2))) * 16

        xch = []
        for cc in range(2):
            buf = base + cc * self.XCH_COL_BYTES
            xch.append(([buf + slot(i, q) for i in range(4)],
                        [buf + slot(q, j) for j in range(4)]))
        return xch

    @cute.jit
    def _rht_transform(self, frags, rht_b):
        """The RHT of the warp's tile columns from its A fragments (_col_words) on the tensor
        cores, into the exchange buffers (_rht_exchange): per output column (g, g + 8) and
        block row i, lane q stores its 4 of the block's 16 values (outputs 4q .. 4q + 3).
        With stochastic rounding _passes runs it before the rowwise pass (measured, H200,
        bf16 row+col: RHT + SR 2^25-2^27 elements 1-5% faster than after it, per tensor and
        per token; the RN cast 1-4% slower: there it runs after the rowwise pass)."""
        b_frags, xch = rht_b
        fp16 = self.dtype_name == "fp16"
        zero = (Float32(0.0),) * 4
        for i in cutlass.range_constexpr(4):
            d0 = mma_16816(frags[i], b_frags[0], zero, fp16=fp16)
            d1 = mma_16816(frags[i], b_frags[1], zero, fp16=fp16)
            E.st_shared_v4(xch[0][0][i], [E.f32_bits(v) for v in (d0[0], d0[1], d1[0], d1[1])])
            E.st_shared_v4(xch[1][0][i], [E.f32_bits(v) for v in (d0[2], d0[3], d1[2], d1[3])])

    @cute.jit
    def _col_pass_rht(self, tidx, tm, tk, M, K, half_m, nsc_c, pad_c_c, qt_base, st_base, s6,
                      sdec, col_outer, enc_tab, rht_b, sr, fast: cutlass.Constexpr = False):
        """The twin of the RHT'd tile (_rht_transform): lane q loads block row q's 16 values
        of its output columns g and g + 8 from the exchange buffers, quantizes each block on
        its own (amax, scale, encode) and stores its 8 bytes (a column's 4 block rows: one
        32-byte sector). Scale outer operands: col_outer (per tensor: the twin's own) or the
        lane's per-token s6 / sdec of the column. rht_b: (B fragments, exchange addresses).
        sr: stochastic rounding (_sr_state), block row q's Philox call. fast: the passes' fast
        copy (_passes)."""
        lane = tidx % 32
        warp = tidx // 32
        g = lane // 4
        q = lane % 4
        xch = rht_b[1]
        cute.arch.sync_warp()
        row_blk = (warp // 4) * 4  # the warp's first block row of the tile
        blk0 = tm * (self.tile_m // 16)
        gblk = blk0 + row_blk + q  # lane q's block row along M
        row_ok = gblk * 16 < M
        col0 = tk * self.tile_k
        sw_tile = st_base
        if cutlass.const_expr(self.swizzle):  # per tile + per thread, as in _col_thread_offsets
            sw_tile = st_base + Int64(swizzled_scale_offset(col0, blk0, Int32(nsc_c)))
        enc_tab_c = enc_tab
        if cutlass.const_expr(not self.per_token):
            enc_tab_c = enc_tab + ENC_CODES * 4  # the twin's table (per tensor, enc_table)
        # both columns' blocks to their enc before either is encoded (measured against one
        # column at a time, H200: per token 2-3% faster, per tensor -2% to +2%)
        cols = []
        for cc in cutlass.range_constexpr(2):
            c = (warp % 4) * 16 + g + 8 * cc  # tile column
            gk = col0 + c
            if cutlass.const_expr(self.per_token):
                src = self.warp_rows + g + 8 * cc
                s6_c = cute.arch.shuffle_sync(s6, src)
                sdec_c = cute.arch.shuffle_sync(sdec, src)
            else:
                s6_c, sdec_c = col_outer
            ys = []
            for j in cutlass.range_constexpr(4):
                ys += [E.bits_f32(w) for w in E.ld_shared_v4(xch[cc][1][j])]
            rnd = None
            if cutlass.const_expr(sr is not None):
                rnd = self._philox(Int64(gk) * nsc_c + Int64(gblk), 1, sr)
            code, enc = self._block_scale(E.block_amax(ys, tree=True), s6_c, sdec_c, enc_tab_c,
                                          fast and self.fast_rcp)
            cols.append((c, gk, ys, rnd, code, enc))
        for c, gk, ys, rnd, code, enc in cols:
            w0, w1 = self._encode16(ys, enc, rnd, fast=fast)
            valid = (gk < K) & row_ok
            if valid:
                E.st_global_v2(qt_base + Int64(gk) * half_m + Int64(gblk) * 8, w0, w1)
            if cutlass.const_expr(self.swizzle):
                if Int64(gblk) < pad_c_c:
                    E.st_global_u8(sw_tile + Int64(swizzled_scale_offset(c, row_blk + q, Int32(8))),
                                   cutlass.select_(valid, code, Uint32(0)))
            else:
                if valid:
                    E.st_global_u8(st_base + Int64(gk) * nsc_c + Int64(gblk), code)

    # ------------------------------------------------------------------ swizzle padding
    @cute.jit
    def _zero_padding(self, tidx, threads, bidx, gdim, M, K, n_tk, nsc_r, pad_c_r, pad_c_c,
                      s_base, st_base, starts, n_groups):
        """Zero the parts of the padded swizzled scale buffers that no tile covers, by the
        `threads` threads of every CTA (tidx: the thread's index among them); with row_groups
        (starts: _fill_group_tables' smem tables of the n_groups groups) those of every group:
        the rowwise padding rows and the twin's padding columns and rows (the tiles store the
        groups' scales only)."""
        nthr = gdim * threads
        me = bidx * threads + tidx
        if cutlass.const_expr(self.rowwise):
            # scale columns beyond the last K tile (only when a tile holds < 4 scale columns)
            # of every scale row (with row groups their padded rows)
            rows = (M + 127) // 128 * 128
            if cutlass.const_expr(self.row_groups):
                rows = self._group_entry(starts, GROUP_ROW_SW, n_groups) * 16
            zero_scale_columns(s_base, rows, n_tk * self.bpr, pad_c_r, nsc_r, me, nthr)
        if cutlass.const_expr(self.columnwise and not self.row_groups):
            # scale rows (input columns) beyond the last K tile (tiles zero those before it)
            zero_twin_rows(st_base, n_tk * self.tile_k, K, M // 16, Int32(pad_c_c), me, nthr)
        if cutlass.const_expr(self.row_groups):
            zero_group_padding(lambda table, g: self._group_entry(starts, table, g), n_groups,
                               K, nsc_r, pad_c_r, s_base, st_base, me, nthr, self.rowwise,
                               self.columnwise)
