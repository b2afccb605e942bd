"""Zeroing the padding of 128x4 swizzled scales that no cast tile covers (SPEC section 4:
the padding is zero). CastKernel runs these in its epilogue or padding warp; for row groups
with padding the amax pass before the cast (per token K1, AmaxToken padding; per tensor the
chunked AmaxTensor, padding_tiles) zeroes it instead, so that the row-group cast compiles no
padding code, whose code alone cost the cast's walk 1-8 us at its register cap
(notes/quant_recipes.md "Session 45"); they zero whole tiles (zero_tile) and words holding
padding, real scales included, which the cast overwrites. Work item i of a pass goes to thread
me = i mod nthr (i = me, me + nthr, ...) of the nthr threads of the launch."""

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Int32, Int64, Uint32

from cute_fp4.common import encode as E
from cute_fp4.common.scales import swizzled_scale_offset
from cute_fp4.quant.tables import arith_runs

# row groups: the groups' int32 tables (CastKernel.__call__'s `starts`, G + 1 entries each): the
# first 16-row block row, the first AmaxTensor partial (recipes_dispatch.group_chunks),
# swizzled the first block row of the rowwise scales in the groups' padded rows and the first
# byte / 512 of the twin's scales
GROUP_FIRST, GROUP_PARTIALS, GROUP_ROW_SW, GROUP_TWIN_SW = range(4)


def padding_tiles(sizes, k: int, rowwise: bool, columnwise: bool) -> np.ndarray:
    """The 512-byte tiles of the row groups' swizzled scales that hold padding (SPEC section
    4), for the chunked AmaxTensor to zero whole before the row-group cast writes the real
    scales in them (AmaxTensor padding), int64: v >= 0 tile v of the flat rowwise scales,
    v < 0 tile -1 - v of the flat twin scales (the groups' padded scales one after another, as
    recipes_dispatch lays them out). Rowwise, group g's last tile row when M_g is not a
    multiple of 128 and every tile row's last tile when k / 16 is not a multiple of 4; of
    its twin ([k, M_g / 16] scales) the last tile column when M_g / 16 is not a multiple of 4
    and the last tile row when k is not a multiple of 128. Four arithmetic runs per group,
    in group order (numpy: a plan for new split sizes builds this on every MoE step)."""
    nsc = k // 16
    row_tiles, k_tiles = -(-nsc // 4), -(-k // 128)
    mg = np.asarray(sizes, dtype=np.int64)
    rt, nblk = -(-mg // 128), mg // 16
    twin_tiles = -(-nblk // 4)
    r0 = np.cumsum(rt) - rt  # the group's first rowwise tile row
    unit = np.cumsum(k_tiles * twin_tiles) - k_tiles * twin_tiles  # its twin's first tile
    padded = mg % 128 != 0
    starts, counts, steps = (np.zeros((mg.size, 4), dtype=np.int64) for _ in range(3))
    if rowwise:
        if nsc % 4:  # the last tiles of the tile rows before a padded last one
            starts[:, 0] = (r0 + 1) * row_tiles - 1
            counts[:, 0] = rt - padded
            steps[:, 0] = row_tiles
        starts[:, 1] = (r0 + rt - 1) * row_tiles  # a padded last tile row
        counts[:, 1] = padded * row_tiles
        steps[:, 1] = 1
    if columnwise:  # twin tiles unit .. unit + k_tiles * twin_tiles, as -1 - tile
        starts[:, 2] = -unit - twin_tiles  # the last tile of each of the tile rows before a
        counts[:, 2] = (nblk % 4 != 0) * (k_tiles - bool(k % 128))  # padded last one
        steps[:, 2] = -twin_tiles
        if k % 128:
            starts[:, 3] = -1 - unit - (k_tiles - 1) * twin_tiles
            counts[:, 3] = twin_tiles
            steps[:, 3] = -1
    return arith_runs(starts.reshape(-1), counts.reshape(-1), steps.reshape(-1))


def zero_tile(addr):
    """A warp zeroes one 512-byte tile of swizzled scales (addr: the tile's address plus
    4 * lane): four coalesced 128-byte stores."""
    for i in range(4):
        E.st_global_u32(addr + Int64(128 * i), Uint32(0))


@cute.jit
def zero_scale_columns(s_base, rows, c0, pad_c, cols, me, nthr):
    """Zero columns c0 .. pad_c of rows 0 .. rows of the swizzled scales at s_base (a matrix of
    `cols` columns)."""
    ncols = Int32(pad_c) - c0
    for i in cutlass.range(me, rows * ncols, nthr, unroll=1):
        off = Int64(swizzled_scale_offset(i // ncols, c0 + i % ncols, Int32(cols)))
        E.st_global_u8(s_base + off, Uint32(0))


@cute.jit
def zero_twin_rows(base, r0, K, cols, pcc, me, nthr):
    """Zero rows r0 .. of the 128-row padding of the swizzled twin scales at base (of a
    [K, cols] scale matrix, pcc = its columns padded to 4), every padded column."""
    nrows = (K + 127) // 128 * 128 - r0
    for i in cutlass.range(me, nrows * pcc, nthr, unroll=1):
        off = Int64(swizzled_scale_offset(r0 + i // pcc, i % pcc, Int32(cols)))
        E.st_global_u8(base + off, Uint32(0))


@cute.jit
def zero_group_padding(entry, n_groups, K, nsc_r, pad_c_r, s_base, st_base, me, nthr,
                       rowwise: cutlass.Constexpr, columnwise: cutlass.Constexpr):
    """Zero the padding of each row group's swizzled scales (entry(table, g): entry g of the
    GROUP_* table): rowwise its rows M_g .. up to its 128-row padding (nsc_r scale columns,
    pad_c_r padded), of the twin (group g's [K, M_g / 16] scales) its padding columns and
    rows. (Measured: one work item of a warp per group instead, the twin's casts took 1-3%
    longer from 8192^2 in graphs; notes/quant_recipes.md "Session 41".)"""
    zero = Uint32(0)
    tpr = Int32(pad_c_r) // 4  # 4-byte words of a rowwise scale row
    for g in cutlass.range(n_groups, unroll=1):
        blk0 = entry(GROUP_FIRST, g)
        nblk = entry(GROUP_FIRST, g + 1) - blk0
        if cutlass.const_expr(rowwise):  # rows M_g .. the group's 128-row padding
            v0 = (entry(GROUP_ROW_SW, g) + nblk) * 16
            v1 = entry(GROUP_ROW_SW, g + 1) * 16
            for i in cutlass.range(me, (v1 - v0) * tpr, nthr, unroll=1):
                off = swizzled_scale_offset(v0 + i // tpr, i % tpr * 4, Int32(nsc_r))
                E.st_global_u32(s_base + Int64(off), zero)
        if cutlass.const_expr(columnwise):  # rows K .., columns nblk ..
            base = st_base + Int64(entry(GROUP_TWIN_SW, g)) * 512
            pcc = (nblk + 3) // 4 * 4
            zero_twin_rows(base, K, K, nblk, pcc, me, nthr)
            tail = pcc - nblk
            for i in cutlass.range(me, K * tail, nthr, unroll=1):
                off = swizzled_scale_offset(i // tail, nblk + i % tail, nblk)
                E.st_global_u8(base + Int64(off), zero)
