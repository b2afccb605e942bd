"""CUDA quantize for every Recipe option (cast_recipes kernels), single tensors and groups.

`quantize_recipe(x, recipe, seed=, offset=, amax_reduce=)` and `quantize_grouped(x,
split_sizes, recipe, seed=, offset=)` are bit-exact to `ref.quantize` / `ref.quantize_grouped`.
A single tensor is one group: the host builds the tile table (ttab), the group table (gtab) and,
for scaling "tensor" / "token", the amax work table (atab), once per configuration (`_plan`,
cached with the compiled kernels); then each call makes at most two launches:
RecipeAmax (outer amax, after the RHT for the columnwise twin) and RecipeCastKernel (both
outputs; window64 amaxes come out of the cast itself), or for single 1x16 tensors with the RHT
and / or stochastic rounding (`on_plain_cast`) the plain cast (CastKernel with rht /
stochastic) instead of RecipeCastKernel, after the plain cast's own amax passes without column
sums (AmaxTensor per tensor without the RHT; AmaxToken per token with both outputs, with the RHT
its transformed column amaxes, and per tensor with the RHT its maxima over all rows and
columns). Per-token rowwise-only recipes (rows up to 16384 elements, no column sums,
`on_token_rows`) are one launch of TokenRowCast, which reads each row once: single tensors,
and grouped inputs (the whole tensor's rows; stochastic rounding draws each row's group's
Philox stream from a per-row table).
Grouped inputs of 2 .. ROW_GROUPS_MAX groups with per-tensor or per-token 1x16 RN recipes,
compact or swizzled scales, groups of multiples of 16 rows (`on_row_group_cast`), run the
plain cast with row groups (CastKernel row_groups) after AmaxTensor over chunks inside the
groups per tensor (`group_chunks`: per-CTA partials, which the cast reduces per group), per
token the rows' amaxes and each group's column amaxes from K1 with row groups (AmaxToken
groups) with both outputs, else from RecipeAmax.

Tensor parallelism (input sharded along M, sequence parallel): `amax_reduce(t)` reduces a
float32 CUDA amax tensor in place across ranks (e.g. an all-reduce MAX). It is called between
the amax kernel and the cast on the amaxes that span M: scaling "tensor" -> the global amax
(once when the rowwise and columnwise amaxes are one tensor, i.e. without RHT; else the rowwise
amax and the post-RHT columnwise amax); scaling "token" -> the column amax [K] of the twin (the
row amaxes are local). scaling "window64": nothing spans M (a window covers 64 rows of one
shard), so it is never called. Every rank calls it, also with an empty shard.

Stochastic rounding reads the Philox seed and offset from an int64 [seed, offset] device tensor
at run time: one made once per (seed, offset) pair from `seed=` / `offset=` (host integers;
`_rng_table`, cached apart from the plans), or `rng_state=` itself, a tensor on x's device
passed straight to the cast: the call then makes no host-to-device copy, so a CUDA graph can
capture it and each replay uses the values the tensor holds then (a module advances the offset
on the device between steps).
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, List, Optional, Sequence

import cutlass
import numpy as np
import torch

from ..common.jit import (KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor,
                          num_sms)
from ..grouped import GroupedNVFP4Tensor, check_split_sizes, flat_shapes, piece_lens
from ..recipe import Recipe
from ..ref.philox import check_seed_offset
from ..ref.swizzle import scale_shape
from ..tensor import NVFP4Tensor
from .amax import THREADS as AMAX_THREADS, max_tensor_partials, token_tensor_split
from .cast import CastKernel
from .cast_recipes import GTAB_COLS, TILE, RecipeAmax, RecipeCastKernel
from .dispatch import (cast_groups, cast_kernel, cast_walk, l2_keep, row_group_run,
                       run_tensor_amax, tensor_amax_fn, tensor_amax_words, token_amax_fn,
                       token_rows_fn, walk_run)
from .padding import padding_tiles
from .tables import pack, pack_offsets, ragged_table, typed_views
from .token_rows import token_rows_config

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_CUTLASS = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
AMAX_TILES_PER_CTA = 4  # m tiles per RecipeAmax CTA row at most (two strips per warp)


def _cast_config(name: str, recipe: Recipe):
    return (name, recipe.rowwise, recipe.columnwise, recipe.swizzle, recipe.scaling,
            recipe.block_rows, recipe.twin_rht, recipe.stochastic_rounding, recipe.four_over_six,
            recipe.e4m3_max, recipe.fast_math)


def _common_fakes(dtype: str):
    esize = _CUTLASS[dtype].width // 8
    return (fake_tensor(_CUTLASS[dtype], (dyn(), dyn(16 // esize))),
            fake_tensor(cutlass.Int32, (None, 2), align=4),
            fake_tensor(cutlass.Int64, (None, GTAB_COLS), align=8))


def cast_recipe_kernel(dtype: str, recipe: Recipe):
    """(kernel, *fake compile arguments) of the recipe cast for a configuration."""
    op = RecipeCastKernel(*_cast_config(dtype, recipe))
    f32 = [fake_tensor(cutlass.Float32, (None,), align=4) for _ in range(2)]
    u8 = [fake_tensor(cutlass.Uint8, (None,), align=1) for _ in range(4)]
    rng = fake_tensor(cutlass.Int64, (2,), align=8)
    return (op, *_common_fakes(dtype), *f32, *u8, rng, cutlass.Int32(1), env_stream())


def amax_recipe_kernel(dtype: str, per_token: bool, rht: bool, do_row: bool, do_col: bool,
                       col_sum: bool = False, l2_keep: int = 0):
    op = RecipeAmax(dtype, per_token, rht, do_row, do_col, col_sum, l2_keep)
    f32 = [fake_tensor(cutlass.Float32, (None,), align=4) for _ in range(3 if col_sum else 2)]
    return (op, *_common_fakes(dtype), fake_tensor(cutlass.Int32, (None, 2), align=4), *f32,
            *(() if col_sum else (None,)), env_stream())


def on_plain_cast(recipe: Recipe, n_groups: int, dtype: str) -> bool:
    """Whether the plain cast (CastKernel) runs this recipe after an amax pass (RecipeAmax;
    without column sums AmaxTensor per tensor without the RHT, AmaxToken per token with both
    outputs and per tensor with the RHT: _Plan): one tensor, scaling tensor or token, no
    4over6 (so E4M3_MAX 448), with 1x16 blocks the columnwise RHT (bf16 / fp16 with the twin:
    CastKernel rht, the transform on the tensor cores) and / or stochastic rounding
    (CastKernel stochastic), per tensor 16x16 blocks with stochastic rounding (CastKernel
    block2d stochastic, no RHT of a twin). Its persistent TMA walk is faster than the recipe
    kernel (notes/quant_recipes.md "Session 21", "Session 23", "Session 38"); everything else
    (window64, 4over6, groups (except on_row_group_cast's), RHT of fp32 inputs, 16x16 with
    the twin's RHT) runs the recipe kernel. A rowwise-only recipe's rht changes no byte
    (Recipe.twin_rht): it runs as without it."""
    if (n_groups != 1 or recipe.four_over_six is not None
            or recipe.scaling not in ("tensor", "token")):
        return False
    if recipe.block == (16, 16):
        return recipe.scaling == "tensor" and recipe.stochastic_rounding and not recipe.twin_rht
    if recipe.twin_rht:
        return dtype != "fp32"
    return recipe.stochastic_rounding


# The row-group cast keeps an enc table per group in shared memory (ENC_CODES + 2 words each
# with the group's (s6, sdec), and its 2 or 4 table entries, CastKernel GROUP_*): it takes up to
# this many groups (64: 34 KB, two rowwise CTAs of 4 ring stages still fit an SM).
ROW_GROUPS_MAX = 64


def row_group_tables(n_groups: int) -> int:
    """The enc tables of the row-group cast of n_groups groups (CastKernel row_groups): the
    next power of two from 8 (few compiled variants)."""
    return max(8, 1 << (n_groups - 1).bit_length())


def row_group_padding(sizes, k: int, rowwise: bool, columnwise: bool) -> bool:
    """Whether the swizzled scales of a grouped input's row groups have padding to zero
    (CastKernel padding, or the amax pass's zeroing: K1 per token, per tensor the chunked
    AmaxTensor's padding_tiles, which are empty exactly when this is False): rowwise, a group
    of rows not a multiple of 128 or, with any rows, scale columns (k / 16) not a multiple of
    4; the twin (group g's [k, M_g / 16] scales), a group with rows and k not a multiple of
    128 or scale columns not a multiple of 4."""
    return bool((rowwise and any(mg % 128 or (mg and k % 64) for mg in sizes))
                or (columnwise and any(mg and (mg % 64 or k % 128) for mg in sizes)))


def on_row_group_cast(recipe: Recipe, sizes) -> bool:
    """Whether a grouped input of 2 .. ROW_GROUPS_MAX groups runs the plain cast with row
    groups (CastKernel row_groups: per tensor each 16-row block row's group's outer scale and
    enc table, per token each twin block's column amax in its group; the twins and swizzled
    scales at their groups' offsets) after the chunked AmaxTensor (per tensor) or, per token,
    the rows' amaxes and each group's column amaxes (K1 with row groups for both outputs,
    RecipeAmax for one; measured with both, K1 against RecipeAmax: 4096x8192 19.95 vs 23.50
    us, 8192^2 36.0 vs 41.2; notes/quant_recipes.md "Session 43"): scaling tensor or token,
    1x16 blocks, rounding to nearest, no RHT of a twin, no 4over6, every group's rows a
    multiple of 16 (a block row lies in one group). The recipe kernel runs the rest
    (per-token rowwise-only inputs TokenRowCast where on_token_rows says so: _Plan)."""
    return (1 < len(sizes) <= ROW_GROUPS_MAX and recipe.scaling in ("tensor", "token")
            and recipe.block == (1, 16)
            and not (recipe.stochastic_rounding or recipe.twin_rht)
            and recipe.four_over_six is None and all(mg % 16 == 0 for mg in sizes))


def on_token_rows(recipe: Recipe, sizes, col_sum: bool) -> bool:
    """Whether TokenRowCast (each row's amax and its cast in one read of the input) runs a
    per-token rowwise-only recipe with 1x16 blocks, no 4over6 and no column sums: a single
    tensor or a grouped input. A row's outer scale does not depend on its group, so the
    groups' outputs are the whole tensor's rows; swizzled, every group but the last must be a
    multiple of 128 rows, so that the groups' padded scales lie where the whole tensor's do.
    Grouped stochastic rounding draws group g's Philox stream 2g with its blocks indexed from
    the group's first row (TokenRowCast grouped: a per-row table, _Plan.row_streams).
    Measured (H200, bf16, N = 8 groups of multiples of 128 rows, graphs, RN): 1.91-2.30x one
    plain per-token quantize on the recipe kernel, 0.95-1.03x here (notes/quant_recipes.md
    "Session 43")."""
    if not (recipe.scaling == "token" and recipe.rowwise and not recipe.columnwise
            and recipe.block == (1, 16) and recipe.four_over_six is None and not col_sum):
        return False
    return len(sizes) == 1 or not (recipe.swizzle and any(mg % 128 for mg in sizes[:-1]))


def token_row_streams(sizes) -> np.ndarray:
    """TokenRowCast grouped's table (on_token_rows): int32 [M * 2], row r's Philox stream
    (2g for group g, ref.quantize_grouped) at 2r and its group's first row at 2r + 1."""
    first = itertools.accumulate(sizes, initial=0)
    return ragged_table([(2 * g, r0) for g, r0 in zip(range(len(sizes)), first)],
                        sizes).reshape(-1)


def strip_groups(sizes) -> np.ndarray:
    """K1 with row groups' table (AmaxToken groups; groups of multiples of 16 rows): int32,
    the group of each 16-row strip."""
    return ragged_table([(g,) for g in range(len(sizes))],
                        [mg // 16 for mg in sizes]).reshape(-1)


# Tile rows walked together (CastKernel band, at most) by the row-group cast of groups whose
# twin rows (M_g / 2 bytes) are not whole 32-byte sectors (a group not a multiple of 64 rows):
# a tile's 64-byte twin row segments then share sectors with the tiles above and below it,
# which in band order the same wave of CTAs writes (as COMPACT_TWIN_BAND for the compact twin
# scales). Measured (H200, bf16, row+col, groups off multiples of 128 rows by multiples of 16,
# the cast alone, native band -> 64): 32768x8192 per tensor compact 367 -> 285 us (groups of
# multiples of 128 rows 282), swizzled 376 -> 298 (288), per token compact 376 -> 317;
# 16384x8192 159 -> 146 / 161 -> 155 / 172 -> 167; within +-1 us at 2^25 elements. Per token
# with swizzled scales it was slower at every size (+1.6 to +9 us), so it keeps its band
# (notes/quant_recipes.md "Session 46"; bands 2-16 too, session 48) and runs two consumer
# groups instead (row_group_groups).
RAGGED_TWIN_BAND = 64


def row_group_walk(m: int, k: int, esize: int, columnwise: bool, rowwise: bool,
                   swizzle: bool, num_sms: int, per_token: bool = False,
                   ragged_twin: bool = False) -> tuple:
    """The tile walk of the row-group cast (on_row_group_cast). Per token the plain per-token
    cast's (dispatch.cast_walk: its CTAs, reverse walk, amax prefetch and bands) with the run
    of row_group_run and no preload. Per tensor the per-tensor cast's (dispatch.cast_walk)
    with the enc tables at every size (their groups' outer scales), the run of row_group_run
    (the group lookup once per run; measured: swizzled row+col 1.11-1.28x -> 1.03-1.22x one
    plain quantize, notes/quant_recipes.md "Session 40") and no preload;
    rowwise only two CTAs per SM. Measured (H200, bf16, N = 8 groups, compact
    scales, quantize_grouped in graphs; notes/quant_recipes.md "Session 38"): rowwise only,
    two CTAs per SM instead of one of two consumer groups 16384x8192 177 -> 161 us,
    32768x8192 338 -> 308 (before the enc tables; with them 1-3% at 2^24-2^26); preload
    within +-1.5%. ragged_twin (some group not a multiple of 64 rows): the band of
    RAGGED_TWIN_BAND tile rows, or of the most that divides the tile rows, with a columnwise
    output (not per token with swizzled scales)."""
    walk = cast_walk(m, k, esize, per_token, False, columnwise and not swizzle,
                     rowwise and not swizzle, num_sms)
    band = walk[3]
    if ragged_twin and columnwise and not (per_token and swizzle):
        n_tm = -(-m // CastKernel.tile_m)
        band = max(band, min(RAGGED_TWIN_BAND, n_tm & -n_tm))  # a power of two dividing n_tm
    if per_token:
        return walk[:3] + (band, row_group_run(m, k, esize, num_sms), False, False)
    ctas = walk[0] if columnwise else 2
    return (ctas, walk[1], False, band, row_group_run(m, k, esize, num_sms), True, False)


def row_group_groups(dtype: str, rowwise: bool, columnwise: bool, swizzle: bool,
                     per_token: bool, walk: tuple, elements: int, ragged_twin: bool) -> int:
    """Consumer groups of the row-group cast (CastKernel groups) of 16-bit inputs with both
    outputs: two (one CTA per SM of two groups; grouped_walk: per token neither the run nor
    bands) at every size, except per token with swizzled scales whose groups are all
    multiples of 64 rows (not ragged_twin), on cast_groups' rule like everything else.
    cast_groups gives one group below GROUPS_MIN_ELEMENTS per tensor swizzled and per token,
    and per token swizzled below L2_WARM_MAX_BYTES. Measured (H200, bf16, N = 8,
    quantize_grouped in graphs, 3 timings each; notes/quant_recipes.md "Session 48"), us,
    ragged groups (16-row steps) / groups of multiples of 128 rows:
    - per token swizzled: 4096x2048 24.1 -> 23.1 / 21.7 -> 21.9, 2048x4096 24.0 -> 23.4 /
      24.2 -> 23.6, 4096x8192 72.9 -> 68.0 / 65.0 -> 65.2, 16384x2048 69.2 -> 67.0 / 65.0
      both, 8192^2 134.7 -> 123.8 / 118.9 -> 120.5, 16384x8192 241.1 -> 236.9 / 229.3 both,
      8192x2048 39.2 -> 39.1 / 36.6 -> 37.5, 2048^2 14.8 -> 15.0 / 14.8 -> 14.9; one CTA per
      SM (32768x8192, cast_groups two) 454 both. The cast kernel of ragged groups was 11-17%
      slower than of the others (4096x2048 to 8192^2; its tiles whose block rows lie in two
      groups, about 1 tile row in 5 at 4096 rows, take the IEEE copy of the passes); why two
      groups help is not measured. Bands (RAGGED_TWIN_BAND) on one group were no help: bands
      2-16 +0.3 to +9 us, 8192^2 band 16 -2 us;
    - per token compact: 4096x2048 23.2 -> 21.8 / 21.3 -> 20.8, 2048x4096 23.7 -> 22.1 /
      23.7 -> 22.5, 2048^2 14.6 -> 14.4 / 14.7 -> 14.3;
    - per tensor swizzled: 4096x2048 22.7 -> 21.7 / 21.9 -> 22.0, 2048x4096 22.8 -> 21.9 /
      21.7 -> 20.7, 2048^2 14.2 -> 14.1 / 13.9 -> 13.6."""
    if dtype != "fp32" and rowwise and columnwise and not (per_token and swizzle
                                                           and not ragged_twin):
        return 2
    return cast_groups(dtype, rowwise, columnwise, swizzle, per_token, False, walk, False,
                       False, False, elements)


def group_chunks(sizes, k: int, esize: int, num_sms: int) -> tuple:
    """The chunked AmaxTensor's work for the row-group cast: (chunks, an int32 [P, 3] numpy
    array; a list of the first chunk of each group and then their count). The groups share
    max_tensor_partials chunks (one wave of AmaxTensor CTAs; more when there are more
    nonempty groups) in proportion to their 16-byte vectors (largest remainders; each
    nonempty group at least one chunk, no chunk below one CTA's loads);
    CastKernel._fill_group_tables reduces them per group. Chunk i of a group's c is CTA i's
    grid-stride share of the group: (the group's first vector + i * AMAX_THREADS, the group's
    end, c * AMAX_THREADS) (AmaxTensor chunked), so that the group's CTAs read one window of it
    together, as the plain AmaxTensor's grid reads the whole input.
    Measured (H200, bf16, N = 8, the amax kernel alone):
    - against contiguous chunks, rowwise / row+col: 8192x2048 7.31 -> 7.05 / 8.50 -> 8.40 us,
      4096x8192 17.91 -> 17.17 / 17.72 -> 17.18, 8192^2 33.82 -> 33.33 / 34.51 -> 33.45,
      16384x8192 69.58 -> 68.10 / 71.07 -> 70.51, 4096x2048 +-0.15 (notes/quant_recipes.md
      "Session 42");
    - groups off multiples of 128 rows took a few chunks more than one wave with
      ceil(vectors / (total / max_tensor_partials)) chunks each: 4096x8192 20.1 -> 25.3 us,
      16384x8192 69.0 -> 91.1 ("Session 46")."""
    per_row = k * esize // 16
    vecs = [mg * per_row for mg in sizes]
    total = sum(vecs)
    target = max(max_tensor_partials(num_sms), sum(1 for n in vecs if n))
    counts = [max(target * n // total, 1) if n else 0 for n in vecs]
    while sum(counts) > target:  # the ones given to small groups: from the largest counts
        counts[counts.index(max(counts))] -= 1
    by_remainder = sorted((g for g, n in enumerate(vecs) if n),
                          key=lambda g: -(target * vecs[g] % total))
    for g in by_remainder[:target - sum(counts)]:
        counts[g] += 1
    counts = [min(c, -(-n // AMAX_THREADS)) for n, c in zip(vecs, counts)]
    pfirst = list(itertools.accumulate(counts, initial=0))
    first = list(itertools.accumulate(vecs, initial=0))
    # chunk pfirst[g] + i of group g: (first[g] + i * AMAX_THREADS, first[g + 1],
    # counts[g] * AMAX_THREADS); plain Python but the table: numpy's fixed costs are higher
    # for the few groups of a call (8: 34 us against 52 with numpy throughout; 64: 77 / 54)
    rows = [(first[g], first[g + 1], c * AMAX_THREADS) for g, c in enumerate(counts)]
    return ragged_table(rows, counts, (AMAX_THREADS, 0, 0)), pfirst


def plain_cast_walk(m: int, k: int, esize: int, per_token: bool, compact_twin: bool,
                    compact_row: bool, num_sms: int, rht: bool, stochastic: bool) -> tuple:
    """The tile walk of the recipes on the plain cast (on_plain_cast): the plain cast's
    (dispatch.cast_walk: per token with the amax loads one tile ahead at every size) with
    - stochastic rounding alone: one CTA per SM, the run (compact rowwise scales staged over a
      run of tiles) for fp32 only, no preload;
    - the RHT alone: two CTAs per SM, the run per tensor where the plain cast takes it and per
      token wherever the shape allows it (dispatch.walk_run), no preload;
    - RHT + stochastic rounding: two CTAs per SM; per tensor, and per token below
      L2_WARM_MAX_BYTES, no run and preload; per token from there the run (walk_run) and no
      preload.
    Measured (H100, row+col compact, full quantize in graphs):
    - stochastic rounding alone (session 24, after the encoder took the signs from 16-bit
      inputs), per tensor with two CTAs per SM -> one: bf16 8192x8192 142.4 -> 136.5 us
      (1.10x -> 1.05x the plain cast), 4096x8192 75.3 -> 72.6, 16384x8192 296.2 -> 280.2,
      16384x2048 75.4 -> 72.7, fp16 8192x8192 141.6 -> 132.4; the run there +-0.4 (16384x8192
      +6), preload +2 to +4; fp32 8192x8192 318.4 -> 279.8, with the run 232.3 (1.00x). Per
      token (session 26, after session 25's fast copy; two CTAs -> one, with the amax
      prefetch from L2_WARM_MAX_BYTES): bf16 4096x8192 81.3 -> 79.3, 8192x8192 148.7 ->
      146.8, 16384x4096 148.8 -> 146.6, 16384x8192 296.0 -> 279.1, 24576x8192 465.5 -> 411.4,
      32768x8192 647.4 -> 541.4, 65536x4096 638.9 -> 542.1; fp16 8192x8192 146.7 -> 141.0;
      fp32 (one CTA and the run before too) with the prefetch 8192x8192 270.9 -> 232.8;
    - RHT, 8192x8192 bf16, before the amax pass's L2 priorities: per tensor compact 166.5 ->
      145.4 us with two CTAs per SM (the plain cast's one CTA per SM leaves the MMA, shuffle
      and store latencies of _col_pass_rht exposed), swizzled 151.0 -> 141.4; per token
      compact 161.6 -> 156.1, swizzled 156.5 -> 154.3; per tensor without the run: compact
      147.4 vs 142.7 with it (notes/quant_recipes.md "Session 21"). Per token with the run
      (session 26): 4096x8192 83.5 -> 81.4, 8192x8192 153.7 -> 148.2, 16384x2048 82.4 ->
      80.3, fp16 8192x8192 150.8 -> 147.0; with the prefetch from L2_WARM_MAX_BYTES too:
      16384x8192 308.4 -> 289.9, 32768x8192 665.3 -> 565.3 (4096x2048, whose 128 runs are
      too few for walk_run, 29.9 -> 39.5 with it);
    - RHT + stochastic rounding (session 23), without the run and with preload: 170.3 ->
      163.7 (per token 186.6 -> 181.2), 16384x2048 91.6 -> 88.1 (100.2 -> 97.5). Per token
      from L2_WARM_MAX_BYTES (session 26) with the prefetch, the run and no preload:
      16384x8192 347.0 -> 337.3, 32768x8192 673.2 -> 652.6 (the run below the bound: 4096x8192
      95.1 -> 95.8, 8192x8192 175.2 -> 179.0)."""
    walk = cast_walk(m, k, esize, per_token, False, compact_twin, compact_row, num_sms)
    if stochastic and not rht:
        return (1,) + walk[1:4] + (walk[4] if esize == 4 else 1, walk[5], False)
    warm = walk[1]  # the reverse walk: below L2_WARM_MAX_BYTES
    preload = stochastic and (not per_token or warm)  # never with the run
    if preload:
        run = 1
    elif per_token:
        run = walk_run(m, k, esize, compact_row, num_sms)
    else:
        run = walk[4]
    return (2,) + walk[1:4] + (run, walk[5], preload)


def _alloc(shape, device, dtype=torch.uint8) -> torch.Tensor:
    """Output allocation (uninitialised; tests replace it with a poisoning one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _alloc_f32(n: int, device) -> torch.Tensor:
    """Window64 amax outputs (written by the cast kernel; tests poison them)."""
    return torch.empty(n, dtype=torch.float32, device=device)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def amax_tiles_per_cta(tiles: int, k: int, esize: int, num_sms: int) -> int:
    """m tiles per RecipeAmax CTA row (atab) for `tiles` m tiles of K columns: the largest of
    AMAX_TILES_PER_CTA, its halves and 1 whose grid has a CTA for every SM (the CTA row's
    strips are dealt to its warps in turn, so two tiles still keep all 8 warps busy).
    Measured (H200, bf16 row+col, graphs; RHT quantize per token / per tensor, us): 4096x2048
    (8 slabs) 4 tiles (128 CTAs) 25.4 / 24.4, 2 tiles 24.9 / 23.9, 1 tile 26.2 / 25.1; 2048x2048
    2 and 1 tile 15.6 / 15.4, 4 tiles 16.8 / 16.3; from 2^25 elements 4 and 8 tiles within
    +-1 us, 2 tiles 1-4 us slower (notes/quant_recipes.md "Session 29")."""
    slabs = _ceil(k * esize, RecipeAmax.SLAB_BYTES)
    per_cta = AMAX_TILES_PER_CTA
    while per_cta > 1 and slabs * _ceil(tiles, per_cta) < num_sms:
        per_cta //= 2
    return per_cta


def token_amax_k1(recipe: Recipe, col_sum: bool) -> bool:
    """Whether a single-tensor recipe on the plain cast (a grouped one on the row-group cast:
    AmaxToken groups) takes the plain per-token amax pass (AmaxToken, K1) instead of
    RecipeAmax: per token with both outputs, without column sums; with the RHT, K1 takes the
    twin's column amaxes after the transform (AmaxToken rht); per tensor with the RHT, K1's
    maxima over all rows and columns (AmaxToken per_tensor). K1
    alone against RecipeAmax (H200, graphs): bf16 4096x8192 19.3 vs 21.1 us, 8192^2 34.7 vs
    37.6, 16384x8192 63.9 vs 63.5; fp32 4096x8192 34.6 vs 35.8, 8192^2 63.8 vs 65.8
    (notes/quant.md "Session 29"); with the RHT (session 33, torch profiler) 4096x8192 20.5
    vs 22.2, 8192^2 36.7 vs 38.5, 16384x2048 20.2 (notes/quant_recipes.md "Session 33")."""
    if recipe.scaling == "tensor":
        return recipe.twin_rht and not col_sum
    return (recipe.scaling == "token" and not col_sum and recipe.rowwise
            and recipe.columnwise)


def _check(x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a cute_fp4.Recipe, got {type(recipe).__name__}")
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        raise ValueError("cute_fp4 CUDA quantize needs a CUDA tensor")
    if x.dtype not in _DTYPE_NAMES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous() first)")
    x2 = x.reshape(-1, x.shape[-1])
    k = x2.shape[1]
    unit = 64 if recipe.scaling == "window64" else 16
    if recipe.rowwise and k % unit:
        raise ValueError(f"x: the last dimension ({k}) must be a multiple of {unit} for rowwise "
                         f"{recipe.scaling!r} quantization")
    if (k * x.element_size()) % 16:
        raise ValueError(f"x: rows of {k} elements are not a multiple of 16 bytes")
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    return x2


def _check_rows(m: int, recipe: Recipe, what: str):
    unit = 64 if recipe.scaling == "window64" else 16
    if recipe.columnwise and m % unit:
        raise ValueError(f"{what} ({m}) must be a multiple of {unit} for the columnwise "
                         f"{recipe.scaling!r} twin")


def _upload(tables: dict, dev) -> dict:
    """A plan's host tables (numpy arrays, by attribute) on the device without a host-device
    sync, in one copy: packed (tables.pack) into one pinned staging buffer and copied
    asynchronously on the current stream (torch's caching host allocator keeps the staging
    buffer until the copy has run), so that a grouped call with new split sizes does not wait
    for the GPU's queued work; then a view of the device buffer per table. One copy, not one
    per table: a pinned block and a copy took ~20 us of host time each under the profiler on
    the device host (notes/quant_recipes.md "Session 48")."""
    offsets, n = pack_offsets(tables)
    staged = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pack(staged.numpy(), tables, offsets)
    return typed_views(staged.to(dev, non_blocking=True), tables, offsets)


class _Plan:
    """Everything a call computes from its configuration alone, made once per configuration
    (`_plan`): the tile / group / amax tables on the device (_upload), the flat output
    lengths, and the compiled kernels. A call then allocates, launches and builds views."""

    def __init__(self, sizes: tuple, k: int, recipe: Recipe, name: str, dev, col_sum: bool):
        _check_not_capturing("shape, split sizes, recipe or dtype")
        self._tables = {}  # _table's host tables, by attribute, until _upload
        self._build(sizes, k, recipe, name, dev, col_sum)
        if self._tables:
            for attr, t in _upload(self._tables, dev).items():
                setattr(self, attr, t)
        del self._tables

    def _table(self, attr: str, data, dtype):
        """Attribute `attr`: a host table (a list or a numpy array of numpy `dtype`) until
        __init__ uploads it with the others (_upload), then its device copy."""
        t = np.ascontiguousarray(data, dtype=dtype)
        self._tables[attr] = t
        setattr(self, attr, t)

    def _build(self, sizes: tuple, k: int, recipe: Recipe, name: str, dev, col_sum: bool):
        row, col, swz, scaling = recipe.rowwise, recipe.columnwise, recipe.swizzle, recipe.scaling
        esize, sms = _CUTLASS[name].width // 8, num_sms(dev)
        # the groups' fields back to back (GroupedNVFP4Tensor's flat layout, whose piece
        # lengths a call's views share): gtab rows (first row, rows, first data byte, scale
        # byte, twin byte, twin scale byte, amax, twin amax), then the totals
        rows, scale_rows, amaxes, twins, twin_scales, twin_amaxes = piece_lens(
            tuple(sizes), k, recipe)
        self.scales_2d = flat_shapes(sizes, k, recipe)[1]  # the flat rowwise scales
        firsts = [list(itertools.accumulate(n, initial=0)) for n in (
            rows, [mg * k // 2 for mg in rows], [r * self.scales_2d[1] for r in scale_rows],
            twins, twin_scales, amaxes, twin_amaxes)]
        gtab = list(zip(firsts[0], rows, *firsts[1:]))
        row0, _, _, qt_len, st_len, ar_len, ac_len = (f[-1] for f in firsts)
        self.gtab = gtab
        self.twin_lens = (qt_len, st_len)  # the flat twin's data and scales (groups)
        self.ar_len, self.ac_len = ar_len, ac_len  # the amaxes' lengths
        self.alias = scaling == "tensor" and not recipe.twin_rht  # columnwise amax = rowwise amax
        self.launch = row0 > 0 and k > 0
        self.tensor_amax = self.token_amax = None  # AmaxTensor / AmaxToken (see below)
        self.k1_partials = 0  # AmaxToken per_tensor's partials per side
        self.k1_padding = False  # AmaxToken zeroes the row groups' swizzled padding
        self.pad_tiles = None  # the tiles the chunked AmaxTensor zeroes (padding_tiles)
        self.token_rows = self.amax_fn = None  # TokenRowCast / RecipeAmax (see below)
        self.tt = self.gt = self.at = None  # the recipe kernels' tables (recipe_tables)
        if not self.launch:
            return
        # device copies made here, once: repeated calls make no host-to-device copy, so they
        # can be captured in a CUDA graph once warmed up
        self.dummy = torch.empty(1, dtype=torch.uint8, device=dev)  # for absent outputs
        self.dummy2 = self.dummy.view(1, 1)  # the same as a matrix, and as E4M3 scales
        self.dummy2_f8 = self.dummy2.view(torch.float8_e4m3fn)

        def recipe_tables():
            """The recipe kernels' tables (RecipeAmax, RecipeCastKernel): tiles, groups,
            amax CTAs (the plain and row-group casts take none of them)."""
            real = [_ceil(mg, TILE) for mg in sizes]  # the groups' m tiles
            tiles = [2 * _ceil(mg, 128) for mg in sizes] if (swz and row) else real
            per_cta = amax_tiles_per_cta(sum(real), k, esize, sms)
            ctas = [_ceil(r, per_cta) for r in real]
            base = list(itertools.accumulate(tiles, initial=0))  # the groups' first tiles
            # tile i of group g: (g, TILE * i); its amax CTA c: (base[g] + c * per_cta, the
            # tiles left from there, at most per_cta)
            self._table("tt", ragged_table([(g, 0) for g in range(len(sizes))], tiles,
                                           (0, TILE)), np.int32)
            self._table("gt", gtab, np.int64)
            at = ragged_table(list(zip(base, real)), ctas, (per_cta, -per_cta))
            np.minimum(at[:, 1], per_cta, out=at[:, 1])
            self._table("at", at if at.shape[0] else ((0, 0),), np.int32)

        arch = device_arch(dev)
        self.plain = on_plain_cast(recipe, len(sizes), name)
        # TokenRowCast (on_token_rows): one read, where K1 + the plain SR cast or RecipeAmax +
        # the recipe kernel read the input twice; it takes precedence over the row-group cast
        # (on_row_group_cast takes per-token rowwise groups too)
        split = token_rows_config(k, esize, swz)
        token_rows = split is not None and on_token_rows(recipe, sizes, col_sum)
        self.row_groups = not token_rows and on_row_group_cast(recipe, sizes)
        # row_groups: the groups' tables, the amax chunks (per tensor), the strips' groups
        # (per token, K1)
        self.starts = self.chunks = self.strips = None
        self.row_streams = None  # grouped SR on TokenRowCast: each row's (stream, first row)
        if token_rows:
            grouped_sr = recipe.stochastic_rounding and len(sizes) > 1
            self.token_rows = token_rows_fn(name, swz, split, sms, arch,
                                            stochastic=recipe.stochastic_rounding,
                                            grouped=grouped_sr)
            if grouped_sr:
                self._table("row_streams", token_row_streams(sizes), np.int32)
            return
        keep = 0
        plain_cast = self.plain or self.row_groups  # CastKernel casts (the row groups' too)
        if plain_cast:
            m, per_token = row0, scaling == "token"
            rht, sr = recipe.twin_rht, recipe.stochastic_rounding
            block2d = recipe.block == (16, 16)
            tables, padding = 0, True
            if self.row_groups:
                ragged = any(mg % 64 for mg in sizes)
                walk = row_group_walk(m, k, esize, col, row, swz, sms, per_token, ragged)
                groups = row_group_groups(name, row, col, swz, per_token, walk, m * k, ragged)
                tables = row_group_tables(len(sizes))
                # the CastKernel GROUP_* tables: the groups' first block rows, first amax
                # partials (per token none: zeros), swizzled the first block rows of their
                # padded rowwise scales and the first bytes / 512 of their twins' scales
                pfirst = [0] * (len(sizes) + 1)
                if not per_token:
                    chunks, pfirst = group_chunks(sizes, k, esize, sms)
                    self._table("chunks", chunks, np.int32)
                starts = [t[0] // 16 for t in gtab] + [m // 16] + pfirst
                if swz:
                    # the cast compiles no padding code where the amax pass zeroes the
                    # padding first (K1 per token with both outputs, the chunked AmaxTensor per
                    # tensor with a twin) and per token where there is none; per tensor
                    # without padding it keeps the code (CastKernel padding). Measured per
                    # tensor (H200, bf16, ragged groups, graphs): row+col 4096x2048 24.7 ->
                    # 22.6 us, 8192x2048 39.0 -> 35.7, 4096x8192 65.2 -> 62.9, 16384x8192
                    # 224 -> 223; rowwise only (the cast's padding warp is off its path)
                    # -0.1 to +0.5, so not there (notes/quant_recipes.md "Session 47")
                    has_pad = row_group_padding(sizes, k, row, col)
                    self.k1_padding = per_token and has_pad and token_amax_k1(recipe, col_sum)
                    if not per_token and has_pad and col:
                        tiles = padding_tiles(sizes, k, row, col)
                        self._table("pad_tiles", tiles, np.int32)
                    padding = ((not per_token or has_pad) and not self.k1_padding
                               and self.pad_tiles is None)
                    starts += itertools.accumulate((_ceil(mg, 128) * 8 for mg in sizes),
                                                   initial=0)
                    starts += [t[5] // 512 for t in gtab] + [st_len // 512]
                self._table("starts", starts, np.int32)
            else:
                walk = plain_cast_walk(m, k, esize, per_token, col and not swz, row and not swz,
                                       sms, rht, sr)
                groups = cast_groups(name, row, col, swz, per_token, False, walk, rht, block2d,
                                     sr, m * k)
            keep = l2_keep(walk, m * k * esize, col)
        # per tensor on the plain cast without the RHT or column sums: the plain cast's amax
        # pass (AmaxTensor: partials, no zero-fill; ~2 us less than RecipeAmax + the zero-fill
        # of its words at 8192x8192 bf16, notes/quant_recipes.md "Session 24")
        if self.plain and scaling == "tensor" and not recipe.twin_rht and not col_sum:
            self.tensor_amax = tensor_amax_fn(name, sms, keep, arch)
            self.amax_dims = (m, k, esize, sms)
        elif self.row_groups and scaling == "tensor":  # the same per group: chunks inside
            # the groups (group_chunks)
            self.tensor_amax = tensor_amax_fn(name, sms, keep, arch, chunked=True,
                                              padding=self.pad_tiles is not None)
        elif self.plain and token_amax_k1(recipe, col_sum):
            per_cta = 1
            if scaling == "tensor":  # its partials per side (AmaxToken per_tensor)
                per_cta, self.k1_partials = token_tensor_split(m, k, esize, sms)
            self.token_amax = token_amax_fn(name, keep, arch, recipe.twin_rht,
                                            scaling == "tensor", tiles_per_cta=per_cta)
        elif self.row_groups and token_amax_k1(recipe, col_sum):
            # per token with both outputs: K1 with each group's column amaxes (AmaxToken
            # groups), the group of each 16-row strip in a table
            self.token_amax = token_amax_fn(name, keep, arch, groups=True,
                                            padding=self.k1_padding)
            self._table("strips", strip_groups(sizes), np.int32)
        elif scaling != "window64":
            recipe_tables()
            do_row, do_col = row or self.alias, col and not self.alias
            akey = ("amax_recipe", name, scaling == "token", recipe.twin_rht, do_row, do_col,
                    col_sum, keep, arch)
            self.amax_fn = KERNELS.get(akey, lambda: compile_kernel(
                *amax_recipe_kernel(name, scaling == "token", recipe.twin_rht, do_row, do_col,
                                    col_sum, keep), arch=arch))
        if plain_cast:
            ckey = ("cast", name, row, col, swz, per_token, sms, False, walk, "recipe", rht, sr,
                    groups, block2d, tables, padding, arch)
            self.cast_fn = KERNELS.get(ckey, lambda: compile_kernel(
                *cast_kernel(name, row, col, swz, per_token, sms, False, walk, rht=rht,
                             block2d=block2d, stochastic=sr, groups=groups, row_groups=tables,
                             padding=padding),
                arch=arch))
            # the twin's scales as the cast takes them: swizzled row groups' padded scales one
            # after another, [padded K, their columns]
            self.twin_scales_2d = scale_shape(k, m // 16, swz)
            if self.row_groups and swz:
                self.twin_scales_2d = (self.twin_scales_2d[0], st_len // self.twin_scales_2d[0])
            return
        if self.amax_fn is None:
            recipe_tables()
        self.n_kt = 2 * _ceil(k, 128) if swz and col else _ceil(k, TILE)
        ckey = ("cast_recipe",) + _cast_config(name, recipe) + (arch,)
        self.cast_fn = KERNELS.get(ckey, lambda: compile_kernel(
            *cast_recipe_kernel(name, recipe), arch=arch))


@functools.lru_cache(maxsize=256)
def _plan(sizes: tuple, k: int, recipe: Recipe, name: str, dev, col_sum: bool) -> _Plan:
    return _Plan(sizes, k, recipe, name, dev, col_sum)


def _check_not_capturing(what: str):
    """A host table cannot be copied to the GPU while a CUDA graph is being captured."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cute_fp4 quantize: a new configuration ({what}) while a CUDA graph is being "
            "captured: its tables must be copied to the GPU first; run the same call once "
            "before the capture")


# The plans and seed tables of calls captured in CUDA graphs: a graph replays their device
# tables' addresses, so they outlive the LRU caches that would free them for reuse (a replay
# after 256 newer configurations, e.g. MoE split sizes in eager steps, read freed memory)
_CAPTURED = {}


def _kept(held, capturing: bool):
    """`held` (a plan, a seed table), kept for good when the call is being captured."""
    if capturing:
        _CAPTURED[id(held)] = held
    return held


@functools.lru_cache(maxsize=256)
def _rng_table(seed: int, offset: int, dev) -> torch.Tensor:
    """The int64 [seed, offset] on the device that the casts read when no rng_state is given.
    Cached apart from the plans: a caller drawing new bits each step by a new offset makes one
    16-byte copy per step, not a whole plan, and pushes no plan out of _plan's cache."""
    _check_not_capturing("stochastic rounding's seed or offset")
    seed_i64 = seed - (1 << 64) if seed >= 1 << 63 else seed
    return _upload({"rng": np.array([seed_i64, offset], dtype=np.int64)}, dev)["rng"]


def _flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(-1)


def _exact(t: torch.Tensor, n: int) -> torch.Tensor:
    """t's first n elements (t itself when it has n: a slice is a tensor object, ~1-2 us)."""
    return t if t.shape[0] == n else t[:n]


def _run(x2: torch.Tensor, sizes: List[int], recipe: Recipe, seed: int, offset: int,
         amax_reduce=None, rng_state: Optional[torch.Tensor] = None,
         column_sum: Optional[torch.Tensor] = None, into: Optional[NVFP4Tensor] = None,
         single: bool = False):
    """The groups' fields (FIELDS order, absent ones None): flat, in
    grouped.GroupedNVFP4Tensor's layout, or with `single` (one group) in the NVFP4Tensor's
    shapes. The outputs are allocated in those shapes and handed to the kernels as they are
    where the kernels take them so (each view or slice a tensor object: ~1-2 us of host time
    on the device host). into (one group): a checked NVFP4Tensor whose data and scales the
    cast writes; the amaxes (kernel-side buffers have another layout: zeroed or partials,
    shared) are copied into it; returns None."""
    check_seed_offset(seed, offset)
    dev = x2.device
    m, k = x2.shape
    row, col, scaling = recipe.rowwise, recipe.columnwise, recipe.scaling
    plan = _plan(tuple(sizes), k, recipe, _DTYPE_NAMES[x2.dtype], dev, column_sum is not None)
    capturing = torch.cuda.is_current_stream_capturing()
    _kept(plan, capturing)
    qt_len, st_len = plan.twin_lens
    f8 = torch.float8_e4m3fn
    single = single or into is not None
    if into is not None:
        q, s, qt, st = into.data, into.scales, into.data_t, into.scales_t
    else:  # the twin flat for groups, [K, M / 2] and its scale matrix for a single tensor
        q = _alloc((m, k // 2), dev) if row else None
        s = _alloc(plan.scales_2d, dev, f8) if row else None
        qt = _alloc((k, m // 2) if single else (qt_len,), dev) if col else None
        st = _alloc(scale_shape(k, m // 16, recipe.swizzle) if single else (st_len,), dev,
                    f8) if col else None
    ar_len, ac_len = max(plan.ar_len, 1), max(plan.ac_len, 1)
    arg_r = arg_c = None  # per tensor on the plain cast: its [amax, partial] words per side
    if plan.launch and plan.row_groups and scaling == "tensor":
        # [the group amaxes, the chunks' partials]
        g = len(sizes)
        words = torch.empty(g + plan.chunks.shape[0], dtype=torch.float32, device=dev)
        pad = (None, None, None)
        if plan.pad_tiles is not None:  # the tiles holding the groups' padding, zeroed
            pad = (_flat_u8(s) if row else plan.dummy, _flat_u8(st) if col else plan.dummy,
                   plan.pad_tiles)
        plan.tensor_amax(x2, words[g - 1:], plan.chunks, *pad)  # partial c to words[g + c]
        arg_r = arg_c = words
        amax_r = amax_c = words[:g]
    elif plan.launch and plan.tensor_amax is not None:
        words = torch.empty(tensor_amax_words(*plan.amax_dims, amax_reduce is not None),
                            dtype=torch.float32, device=dev)
        arg_r = arg_c = run_tensor_amax(plan.tensor_amax, x2, words, amax_reduce)
        amax_r = amax_c = words[:1]
    elif plan.launch and plan.k1_partials:
        # K1 per tensor (the RHT): [amax, (with amax_reduce: the reduced local amax,) its P
        # partials] per side, no zero-fill; the cast reduces the partials, writes amax[0]
        p, red = plan.k1_partials, int(amax_reduce is not None)
        side_r, side_c = torch.empty((2, 1 + red + p), dtype=torch.float32,
                                     device=dev).unbind(0)
        plan.token_amax(x2, side_r[red:] if red else side_r, side_c[red:] if red else side_c,
                        None, None, None, None)
        if red:
            for side in (side_r, side_c):
                torch.amax(side[2:], dim=0, keepdim=True, out=side[1:2])
            _reduce_amaxes(amax_reduce, recipe, side_r[1:2], side_c[1:2], False)
            side_r, side_c = side_r[:2], side_c[:2]
        arg_r, arg_c = side_r, side_c
        amax_r, amax_c = side_r[:1], side_c[:1]
    elif plan.launch and plan.plain and scaling == "tensor":
        # RecipeAmax (column sums) reduces into the partials, the cast reads them (and writes
        # the amaxes); without the RHT both sides share one pair
        words = torch.zeros(2 if plan.alias else 4, dtype=torch.float32, device=dev)
        arg_r, arg_c = words[0:2], words[-2:]
        amax_r, amax_c = words[1:2], words[-1:]
    elif scaling == "window64":
        amax_r, amax_c = _alloc_f32(ar_len, dev), _alloc_f32(ac_len, dev)
    elif plan.token_rows is not None:  # the row amaxes, each written by TokenRowCast
        amax_r = amax_c = _alloc_f32(ar_len, dev)
    elif plan.alias:  # zeroed first (reduced with red.global.max); one amax serves both
        amax_r = amax_c = torch.zeros(ar_len, dtype=torch.float32, device=dev)
    else:  # zeroed first, one buffer for both
        both = torch.zeros(ar_len + ac_len, dtype=torch.float32, device=dev)
        amax_r, amax_c = both[:ar_len], both[ar_len:]

    if plan.launch:
        if plan.amax_fn is not None:
            psum = None
            if column_sum is not None:
                # one row of partials per amax CTA row
                psum = torch.empty((plan.at.shape[0], k), dtype=torch.float32, device=dev)
            plan.amax_fn(x2, plan.tt, plan.gt, plan.at, amax_r, amax_c,
                         None if psum is None else psum.view(-1))
            if psum is not None:
                torch.sum(psum, 0, out=column_sum)
        elif plan.token_amax is not None and not plan.k1_partials:
            pad = ((_flat_u8(s), _flat_u8(st), plan.starts) if plan.k1_padding
                   else (None, None, None))
            plan.token_amax(x2, amax_r, amax_c, plan.strips, *pad)
    if column_sum is not None and plan.amax_fn is None:  # nothing to sum (no rows or columns)
        column_sum.zero_()
    if amax_reduce is not None and plan.tensor_amax is None and not plan.k1_partials:
        _reduce_amaxes(amax_reduce, recipe, amax_r, amax_c, plan.alias)
    if plan.launch:
        on_cast = plan.plain or plan.row_groups or plan.token_rows is not None
        rng = None  # the seed table: with stochastic rounding; the recipe kernel takes one always
        if recipe.stochastic_rounding or not on_cast:
            rng = rng_state.contiguous() if rng_state is not None else _kept(_rng_table(
                *((seed, offset) if recipe.stochastic_rounding else (0, 0)), dev), capturing)
        if plan.token_rows is not None:  # q, s: [M, K / 2] and the flat scales' matrix
            plan.token_rows(x2, amax_r, q, s, rng, plan.row_streams)
        elif on_cast:  # the twin's data and scales as matrices (a group's: one after another)
            if arg_r is None:
                arg_r, arg_c = amax_r, amax_c
            if col and not single:
                qt, st = qt.view(k, m // 2), st.view(plan.twin_scales_2d)
            plan.cast_fn(x2, arg_r, arg_c, q if row else plan.dummy2,
                         s if row else plan.dummy2_f8, qt if col else plan.dummy2,
                         st if col else plan.dummy2_f8, rng, plan.starts)
            if col and not single:
                qt, st = qt.view(-1), st.view(-1)
        else:
            dummy = plan.dummy
            plan.cast_fn(x2, plan.tt, plan.gt, amax_r, amax_c, _flat_u8(q) if row else dummy,
                         _flat_u8(s) if row else dummy, _flat_u8(qt) if col else dummy,
                         _flat_u8(st) if col else dummy, rng, plan.n_kt)

    if into is not None:  # its data and scales written; the amaxes copied in
        for t, a, n in ((into.amax, amax_r, plan.ar_len), (into.amax_t, amax_c, plan.ac_len)):
            if t is not None:
                t.view(-1).copy_(a[:n])
        return None
    amax_r, amax_c = _exact(amax_r, plan.ar_len), _exact(amax_c, plan.ac_len)
    if single and scaling == "window64":  # one amax per 64-wide window of a row / column
        amax_r, amax_c = amax_r.view(m, k // 64), amax_c.view(k, m // 64)
    return (q, s, amax_r if row else None, qt, st, amax_c if col else None)


def _reduce_amaxes(amax_reduce, recipe: Recipe, amax_r: torch.Tensor, amax_c: torch.Tensor,
                   alias: bool):
    """Call `amax_reduce` on the amaxes that span M (single tensor; see the module doc)."""
    if recipe.scaling == "tensor":
        if recipe.rowwise or alias:
            amax_reduce(amax_r)
        if recipe.columnwise and not alias:
            amax_reduce(amax_c)
    elif recipe.scaling == "token" and recipe.columnwise:
        amax_reduce(amax_c)


def quantize_recipe(x: torch.Tensor, recipe: Recipe = Recipe(), *, seed: int = 0,
                    offset: int = 0, amax_reduce: Optional[Callable[[torch.Tensor], object]] = None,
                    rng_state: Optional[torch.Tensor] = None,
                    column_sum: Optional[torch.Tensor] = None,
                    out: Optional[NVFP4Tensor] = None) -> NVFP4Tensor:
    """NVFP4 quantize of a CUDA tensor [..., K] (flattened to [M, K]) with any Recipe.
    `amax_reduce`: in-place cross-rank reduction of the amaxes that span M; `rng_state`: a
    device int64 [seed, offset] replacing seed / offset (module doc); `column_sum`: a float32
    [K] tensor on x's device that receives the sums over M of x's columns (a Linear's bias
    gradient), read by the amax pass (scaling "tensor" / "token"): FP32 partials per amax CTA
    row in a fixed order, then a torch sum over them - deterministic. `out`: an NVFP4Tensor
    checked by the public API (`cute_fp4.quantize(..., out=)`) to write into and return."""
    x2 = _check(x, recipe)
    if column_sum is not None:
        if recipe.scaling == "window64":
            raise ValueError("column_sum needs scaling 'tensor' or 'token' (window64 has no "
                             "amax pass to read it in)")
        if (column_sum.dtype != torch.float32 or column_sum.device != x.device
                or tuple(column_sum.shape) != (x2.shape[1],)):
            raise ValueError(f"column_sum must be a float32 [{x2.shape[1]}] tensor on "
                             f"{x.device}")
    _check_rows(x2.shape[0], recipe, "x: the flattened leading dimensions")
    if amax_reduce is not None and not callable(amax_reduce):
        raise TypeError("amax_reduce must be a callable reducing a float32 tensor in place")
    seed, offset = _rng_seed_offset(x, seed, offset, rng_state)
    fields = _run(x2, [x2.shape[0]], recipe, seed, offset, amax_reduce, rng_state, column_sum,
                  out, single=True)
    if out is not None:
        return out
    return NVFP4Tensor(*fields, recipe=recipe, shape=tuple(x.shape), dtype=x.dtype)


def _rng_seed_offset(x: torch.Tensor, seed: int, offset: int,
                     rng_state: Optional[torch.Tensor]):
    """The call's (seed, offset): the given ones, or (0, 0) when the cast reads rng_state (an
    int64 [seed, offset] on x's device)."""
    if rng_state is None:
        return int(seed), int(offset)
    if rng_state.device != x.device or rng_state.dtype != torch.int64 or tuple(
            rng_state.shape) != (2,):
        raise ValueError(f"rng_state must be an int64 tensor [seed, offset] on {x.device}")
    return 0, 0


def quantize_grouped(x: torch.Tensor, split_sizes: Sequence[int], recipe: Recipe = Recipe(), *,
                     seed: int = 0, offset: int = 0, amax_reduce=None,
                     rng_state: Optional[torch.Tensor] = None) -> GroupedNVFP4Tensor:
    """Quantize the row groups of a CUDA [sum(M_i), K] tensor independently, in one launch
    (plus one amax launch for scaling "tensor" / "token"); equals per-group `quantize`
    (GroupedNVFP4Tensor: the groups' fields back to back, and their NVFP4Tensor views).
    Tensor-parallel amax reduction is not supported for grouped inputs (ValueError).
    rng_state: as quantize_recipe's."""
    if amax_reduce is not None:
        raise ValueError("quantize_grouped does not support amax_reduce (tensor-parallel amax "
                         "reduction of grouped inputs)")
    sizes = check_split_sizes(x, split_sizes)
    x2 = _check(x, recipe)
    for i, mg in enumerate(sizes):
        _check_rows(mg, recipe, f"split_sizes[{i}]")
    seed, offset = _rng_seed_offset(x, seed, offset, rng_state)
    flat = _run(x2, sizes, recipe, seed, offset, rng_state=rng_state)
    return GroupedNVFP4Tensor(*flat, split_sizes=sizes, cols=x2.shape[1], recipe=recipe,
                              dtype=x.dtype)
