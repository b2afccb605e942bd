"""CUDA quantize: amax kernel(s) then the K2 cast kernel, compiled once per configuration and
called through TVM-FFI (torch tensors passed directly, launched on torch's current stream).
All outputs (amax, data, scales and their twins) are views of ONE uint8 allocation laid out by
a per-shape cached plan; per-tensor scaling needs no zero-fill (partial maxima, see amax.py).

Tiny inputs (at most FUSED_MAX_TILES cast tiles, no amax_reduce) take ONE launch: the cast
with its fused amax (one CTA computes the amaxes before it casts; cast.py), instead of the
amax kernel, per token a zero-fill, and the cast. Per-token rowwise-only calls of any size take
one launch of TokenRowCast (token_rows.py), which finds each row's amax and casts the row in one
read (rows up to 16384 elements).

Supported: recipe.scaling in {"tensor", "token"}, 1x16 blocks or (per tensor) 16x16 blocks
(CastKernel block2d), no RHT of a twin (Recipe.twin_rht: a rowwise-only recipe's rht changes
nothing and runs here) / stochastic rounding / 4over6: the recipe kernels
(`recipes_dispatch.quantize_recipe`) run those, and the public `cute_fp4.quantize` routes each
recipe to its kernel (`ops.plain_cast`); called directly, this module raises
NotImplementedError naming the option.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import cutlass
import torch

from ..common.jit import (KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor,
                          ffi_function, num_sms)
from ..recipe import Recipe
from ..ref.swizzle import scale_shape
from ..tensor import NVFP4Tensor
from .amax import AmaxTensor, AmaxToken, tensor_partials
from .cast import RUN_SCALE_BYTES, CastKernel
from .token_rows import TokenRowCast, token_rows_config

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_CUTLASS = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}


def _u8_2d():
    return fake_tensor(cutlass.Uint8, (None, None), align=1)


def _f8_2d():
    return fake_tensor(cutlass.Float8E4M3FN, (None, None), align=1)


def _padding_args(padding: bool) -> list:
    """An amax pass's padding arguments (AmaxTensor / AmaxToken padding): the flat uint8
    rowwise and twin scales and an int32 table, else three None. Two scale fakes: one would tie
    the two lengths."""
    if not padding:
        return [None] * 3
    return [fake_tensor(cutlass.Uint8, (None,), align=4) for _ in range(2)] + [
        fake_tensor(cutlass.Int32, (None,), align=4)]


def cast_kernel(dtype: str, rowwise: bool, columnwise: bool, swizzle: bool, per_token: bool,
                num_sms: int = 132, fused_amax: bool = False,
                walk: tuple = None, rht: bool = False, block2d: bool = False,
                stochastic: bool = False, groups: int = 1, row_groups: int = 0,
                padding: bool = True):
    """(kernel, *fake compile arguments) of the K2 cast for a configuration; walk =
    (CTAs per SM, reverse tile walk, per-token amax prefetch, band, run, enc table, preload),
    see cast_walk (default: plain_walk); groups: consumer groups (cast_groups), 2 making the
    SM's one CTA (walk[0] CTAs per SM: 1 or 2) of two groups and 8 ring stages, the walk
    then grouped_walk's; rht: the twin of the RHT'd input, stochastic: stochastic rounding
    (both from recipes_dispatch; the compiled function then takes the int64 [seed, offset]
    tensor after the outputs, else None); block2d: 16x16 blocks; row_groups: the enc tables
    of a grouped input's row groups (recipes_dispatch; the function then takes the groups'
    int32 tables after rng, CastKernel GROUP_*, else None); padding: False where row groups'
    swizzled scales have none to zero (recipes_dispatch.row_group_padding)."""
    if walk is None:
        walk = plain_walk(per_token)
    walk = grouped_walk(walk, groups, per_token)
    ctas_per_sm, reverse, prefetch_amax, band, run, enc_table, preload = walk
    if groups == 2:
        ctas_per_sm = 1
    op = CastKernel(dtype, rowwise, columnwise, swizzle, per_token, num_sms,
                    stages=4 * groups, ctas_per_sm=ctas_per_sm, fused_amax=fused_amax,
                    reverse=reverse, prefetch_amax=prefetch_amax, band=band, run=run,
                    enc_table=enc_table, preload=preload, rht=rht, block2d=block2d,
                    stochastic=stochastic, groups=groups, row_groups=row_groups,
                    padding=padding)
    esize = _CUTLASS[dtype].width // 8
    m, k = dyn(), dyn(16 // esize)
    return (op, fake_tensor(_CUTLASS[dtype], (m, k)),
            fake_tensor(cutlass.Float32, (None,), align=4),
            fake_tensor(cutlass.Float32, (None,), align=4),
            _u8_2d(), _f8_2d(), _u8_2d(), _f8_2d(),
            fake_tensor(cutlass.Int64, (2,), align=8) if stochastic else None,
            fake_tensor(cutlass.Int32, (None,), align=4) if row_groups else None, env_stream())


def token_rows_kernel(dtype: str, swizzle: bool, split: tuple, num_sms: int = 132,
                      ctas_per_sm: int = 0, stochastic: bool = False, grouped: bool = False):
    """(kernel, *fake compile arguments) of the per-token rowwise cast in the amax pass;
    split = token_rows_config(k, esize, swizzle); grouped (stochastic rounding): the function
    then takes the int32 per-row (Philox stream, group's first row) table after rng, else
    None."""
    esize = _CUTLASS[dtype].width // 8
    return (TokenRowCast(dtype, swizzle, *split, num_sms, ctas_per_sm, stochastic, grouped),
            fake_tensor(_CUTLASS[dtype], (dyn(), dyn(16 // esize))),
            fake_tensor(cutlass.Float32, (None,), align=4), _u8_2d(), _f8_2d(),
            fake_tensor(cutlass.Int64, (2,), align=8) if stochastic else None,
            fake_tensor(cutlass.Int32, (None,), align=8) if grouped else None, env_stream())


def token_rows_fn(name: str, swizzle: bool, split: tuple, num_sms: int, arch: str,
                  stochastic: bool = False, grouped: bool = False):
    """The compiled TokenRowCast of a configuration (TVM-FFI function, cached), called as
    (x, amax_r, data, scales, rng or None, row_streams or None)."""
    ctas = TOKEN_ROWS_CTAS_PER_SM
    return ffi_function(KERNELS.get(
        ("token_rows", name, swizzle, split, num_sms, ctas, stochastic, grouped, arch),
        lambda: compile_kernel(*token_rows_kernel(name, swizzle, split, num_sms, ctas,
                                                  stochastic, grouped), arch=arch)))


def amax_tensor_kernel(dtype: str, num_sms: int = 132, l2_keep: int = 0,
                       chunked: bool = False, padding: bool = False):
    """chunked: the function then takes the int32 [P, 3] chunks after the amax words (the row
    groups' partials, recipes_dispatch.group_chunks), else None; padding: then the flat uint8
    rowwise and twin scales and the int32 tiles to zero (padding.padding_tiles), else None x
    3."""
    esize = _CUTLASS[dtype].width // 8
    return (AmaxTensor(dtype, num_sms, l2_keep, chunked, padding),
            fake_tensor(_CUTLASS[dtype], (dyn(), dyn(16 // esize))),
            fake_tensor(cutlass.Float32, (None,), align=4),
            fake_tensor(cutlass.Int32, (None, 3), align=4) if chunked else None,
            *_padding_args(padding), env_stream())


def amax_token_kernel(dtype: str, l2_keep: int = 0, rht: bool = False,
                      per_tensor: bool = False, groups: bool = False, padding: bool = False,
                      tiles_per_cta: int = 1):
    esize = _CUTLASS[dtype].width // 8
    return (AmaxToken(dtype, l2_keep, rht, per_tensor, groups, padding, tiles_per_cta),
            fake_tensor(_CUTLASS[dtype], (dyn(), dyn(16 // esize))),
            fake_tensor(cutlass.Float32, (None,), align=4),
            fake_tensor(cutlass.Float32, (None,), align=4),
            fake_tensor(cutlass.Int32, (None,), align=4) if groups else None,
            *_padding_args(padding), env_stream())


def tensor_amax_fn(name: str, num_sms: int, l2_keep: int, arch: str, chunked: bool = False,
                   padding: bool = False):
    """The compiled AmaxTensor of a configuration (TVM-FFI function, cached), called as
    (x, words, chunks, s, st, tiles) (amax_tensor_kernel)."""
    return ffi_function(KERNELS.get(
        ("amax_tensor", name, num_sms, l2_keep, chunked, padding, arch),
        lambda: compile_kernel(*amax_tensor_kernel(name, num_sms, l2_keep, chunked, padding),
                               arch=arch)))


def token_amax_fn(name: str, l2_keep: int, arch: str, rht: bool = False,
                  per_tensor: bool = False, groups: bool = False, padding: bool = False,
                  tiles_per_cta: int = 1):
    """The compiled AmaxToken (K1) of a configuration (TVM-FFI function, cached), called as
    (x, amax_r, amax_c, strip_groups or None, s, st, starts or None x 3); rht: the column
    amaxes of the RHT'd input; per_tensor: the two maxima over all rows / columns, as
    partials (tiles_per_cta: amax.token_tensor_split); groups:
    each row group's column amaxes (strip_groups: the group of each 16-row strip); padding:
    it zeroes the groups' swizzled scale padding (s, st: the flat scale buffers, starts: the
    row-group cast's GROUP_* tables)."""
    return ffi_function(KERNELS.get(
        ("amax_token", name, l2_keep, rht, per_tensor, groups, padding, tiles_per_cta, arch),
        lambda: compile_kernel(*amax_token_kernel(name, l2_keep, rht, per_tensor, groups,
                                                  padding, tiles_per_cta), arch=arch)))


def tensor_amax_words(m: int, k: int, esize: int, num_sms: int, reduced: bool) -> int:
    """Length of the per-tensor amax words: [amax, (with a cross-rank reduction: the local
    amax,) partial 1..P] (run_tensor_amax)."""
    return 1 + int(reduced) + tensor_partials(m, k, esize, num_sms)


def run_tensor_amax(amax, x: torch.Tensor, words: torch.Tensor, amax_reduce) -> torch.Tensor:
    """AmaxTensor `amax` of x into its words (tensor_amax_words; no zero-fill: one partial per
    CTA) and the cross-rank reduction. Returns the words the cast reads (it reduces their
    partials and writes words[0]): all of them, or with amax_reduce [amax, the reduced local
    amax as the single partial]."""
    if amax_reduce is None:
        amax(x, words, None, None, None, None)
        return words
    amax(x, words[1:], None, None, None, None)
    torch.amax(words[2:], dim=0, keepdim=True, out=words[1:2])
    amax_reduce(words[1:2])
    return words[:2]


_RECIPE_KERNELS = ("is not a plain-cast option: quant.recipes_dispatch.quantize_recipe (or "
                   "cute_fp4.quantize) runs it")


def _check_recipe(recipe: Recipe):
    if recipe.twin_rht:
        raise NotImplementedError(f"cute_fp4 plain CUDA cast: Recipe.rht {_RECIPE_KERNELS}")
    if recipe.stochastic_rounding:
        raise NotImplementedError(
            f"cute_fp4 plain CUDA cast: Recipe.stochastic_rounding {_RECIPE_KERNELS}")
    if recipe.four_over_six is not None:
        raise NotImplementedError(
            f"cute_fp4 plain CUDA cast: Recipe.four_over_six {_RECIPE_KERNELS}")
    if recipe.scaling not in ("tensor", "token"):
        raise NotImplementedError(
            f"cute_fp4 plain CUDA cast: Recipe.scaling={recipe.scaling!r} {_RECIPE_KERNELS}")


def _check_shape(m: int, k: int, esize: int, recipe: Recipe):
    if m == 0 or k == 0:
        raise ValueError(f"x must be non-empty, got the 2D shape {(m, k)}")
    if recipe.rowwise and k % 16:
        raise ValueError(f"x: the last dimension ({k}) must be a multiple of 16 for rowwise output")
    if recipe.columnwise and m % 16:
        raise ValueError(f"x: the flattened leading dimensions ({m}) must be a multiple of 16 "
                         "for the columnwise twin")
    if (k * esize) % 16:
        raise ValueError(f"x: rows of {k} elements are not a multiple of 16 bytes (TMA needs it)")


def _alloc(nbytes: int, device) -> torch.Tensor:
    """The one output allocation of a call (uninitialised; tests replace it with a poisoning
    one)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# Largest input, in cast tiles (128 rows x 128 bytes), quantized by the one-launch fused path
# (one CTA walks every tile; notes/quant.md "Host time: single launch" has the measurement).
FUSED_MAX_TILES = 2


def cast_tiles(m: int, k: int, esize: int) -> int:
    """Number of cast tiles of an [m, k] input with esize-byte elements."""
    tile_k = CastKernel.tile_bytes // esize
    return -(-m // CastKernel.tile_m) * -(-k // tile_k)


# Inputs below this many bytes are cast walking the tiles backwards (the amax pass read the
# end of the input last: up to ~40 MB of it is still in L2), larger ones walk forwards
# (notes/quant.md "Session 9": both measured better for each side of the threshold); per
# token the larger ones run one CTA per SM instead of two (cast_walk).
L2_WARM_MAX_BYTES = 256 << 20

# Before a backwards cast, the amax pass reads all but the last L2_KEEP_BYTES[columnwise] of an
# input with the L2 evict_first priority (amax.py l2_keep): more of the input's end is still in
# L2 when the cast starts there. Measured (bf16, graphs over 3 inputs; notes/quant.md "Session
# 16"): row+col -2 to -3.5 us per quantize at 2^25-2^26 elements (8 / 16 MB alike, 32 MB less);
# quantize + a GEMM of its output -1.6 to -3 us; quantize + an unrelated kernel re-reading 32 MB
# -1.9 to +1 us (the gain is not taken from the kernel after). Rowwise only, whose cast writes
# less and leaves more of L2 to the input: 32 MB -0.1 to -1.8 us (per tensor at 2^26 +0.1 to
# +0.4), 16 MB +-1, 8 MB slower.
L2_KEEP_BYTES = {True: 16 << 20, False: 32 << 20}


def l2_keep(walk: tuple, nbytes: int, columnwise: bool) -> int:
    """The amax pass's l2_keep before the cast of an input of nbytes with `walk`:
    L2_KEEP_BYTES[columnwise] before a backwards cast (walk[1]), else 0 (also when the whole
    input fits in the kept part)."""
    keep = L2_KEEP_BYTES[columnwise]
    return keep if walk[1] and nbytes > keep else 0


# Tile rows walked together (CastKernel band) when the cast writes the twin with compact
# scales: a 32-byte sector of a twin scale row spans 4 tile rows (4 x 8 bytes along M). In
# row-major tile order those tiles are n_tk tiles apart and at 2^27+ elements L2 evicts
# sectors before all four are written (ncu: ~30 MB of extra DRAM reads and writes at
# 32768x8192); in band order one wave writes them whole (notes/quant.md "Session 11").
COMPACT_TWIN_BAND = 4

# Compact rowwise scales are written a run of tiles along K at a time (CastKernel run: the
# tiles whose scales fill a 32-byte sector of each row, staged in smem and stored whole,
# instead of 4-byte pieces per tile: one L2 write request per row and run instead of per
# row and tile), from RUN_MIN_UNITS_PER_SM runs per SM (the walk's unit of work is then a
# run: fewer units balance worse over the SMs) and for the input sizes of RUN_BYTES[(per
# token, compact twin)] = [min, max) bytes, where it measured faster (notes/quant.md
# "Session 12"): per tensor always (with the twin from 2^27 bf16 elements until session 13's
# enc table made it faster at 2^25 too); per token with the twin (whose 8-byte scale pieces
# add their own requests) from 2^26 bf16 elements, rowwise only below 2^26 (2-5% slower from
# 2^27).
RUN_MIN_UNITS_PER_SM = 3

RUN_BYTES = {(False, False): (0, 1 << 62), (True, False): (0, 128 << 20),
             (True, True): (128 << 20, 1 << 62), (False, True): (0, 1 << 62)}

# Per tensor the cast looks each block's enc up in a per-CTA table (CastKernel enc_table),
# except with the compact twin from this many input bytes: there the table measured 3% slower
# (2^27-2^28 bf16 elements; faster everywhere else, swizzled twins included; notes/quant.md
# "Session 13").
ENC_TABLE_COMPACT_TWIN_MAX_BYTES = 256 << 20


# Per token, rowwise only (no twin): TokenRowCast reads each row once, finding its amax and
# casting it (rows of up to 16384 elements; longer ones take K1 + K2 or the fused cast), one
# CTA per strip of rows (TOKEN_ROWS_CTAS_PER_SM = 0; > 0: a persistent grid of that many per
# SM). Measured (H100, bf16, graphs; notes/quant.md "Session 20"): 57.7 -> 33.3 us at 2^25
# (one CTA per strip; persistent 2 / 3 per SM 37.1 / 35.0); host time of the bare call on a
# 16x64 input 4.3-4.4 us vs 4.8-4.9 for the fused cast's (perf/results/quant_host_h100.md).
TOKEN_ROWS = True
TOKEN_ROWS_CTAS_PER_SM = 0


# Two consumer groups (cast_groups) where they measured faster only from some size: swizzled
# row+col casts, the two-CTA walks of two_cta_groups, and (below GROUPS_ROWWISE_MAX_ELEMENTS)
# rowwise-only casts, from GROUPS_MIN_ELEMENTS input elements.
GROUPS_MIN_ELEMENTS = 1 << 24
GROUPS_ROWWISE_MAX_ELEMENTS = 1 << 27


def two_cta_groups(per_token: bool, swizzle: bool, rowwise: bool, columnwise: bool, rht: bool,
                   stochastic: bool, elements: int) -> bool:
    """Whether a row+col cast of `elements` 16-bit values whose walk runs two CTAs per SM (the
    RHT, with or without stochastic rounding; per token below L2_WARM_MAX_BYTES) runs one CTA
    per SM of two consumer groups instead, from GROUPS_MIN_ELEMENTS: per token with compact
    scales, plain or RHT (its walk then without the run or bands: grouped_walk), RHT +
    stochastic rounding only from L2_WARM_MAX_BYTES; the RHT per tensor with swizzled
    scales."""
    if not (rowwise and columnwise) or elements < GROUPS_MIN_ELEMENTS:
        return False
    if stochastic:
        return rht and per_token and not swizzle and 2 * elements >= L2_WARM_MAX_BYTES
    return not swizzle if per_token else rht and swizzle


def grouped_walk(walk: tuple, groups: int, per_token: bool) -> tuple:
    """The walk a cast runs with its consumer groups: per token, where two groups replace two
    CTAs per SM, neither the run nor bands (measured, H200, bf16 row+col compact: the RHT
    4096x8192 71.5 -> 69.9 us, 8192^2 131.8 -> 128.0, 16384x2048 71.8 -> 70.1; with them,
    two groups were within +-1% or slower; notes/quant.md "Session 32"); else the walk
    itself."""
    if groups == 2 and walk[0] == 2 and per_token:
        return walk[:3] + (1, 1) + walk[5:]
    return walk


def cast_groups(dtype: str, rowwise: bool, columnwise: bool, swizzle: bool, per_token: bool,
                fused: bool, walk: tuple, rht: bool, block2d: bool, stochastic: bool,
                elements: int) -> int:
    """Consumer groups of a cast CTA (CastKernel groups; 2: 16 consumer warps in two groups
    taking the CTA's tiles in turn from one ring of 8 stages, one CTA per SM; cast_kernel)
    of an input of `elements` 16-bit values, without 16x16 blocks (stochastic rounding only
    with the RHT):
    - walks of one CTA per SM (per tensor, per token from L2_WARM_MAX_BYTES) of row+col
      casts: compact at every size, swizzled from GROUPS_MIN_ELEMENTS; rowwise-only casts
      from GROUPS_MIN_ELEMENTS below GROUPS_ROWWISE_MAX_ELEMENTS; not columnwise-only;
    - walks of two CTAs per SM (two_cta_groups): row+col from GROUPS_MIN_ELEMENTS, per token
      with compact scales (plain, RHT, RHT + stochastic rounding from L2_WARM_MAX_BYTES), the
      RHT per tensor with swizzled ones; the two CTAs become one of two groups (per token
      without the run or bands: grouped_walk);
    else 1. Measured (H200, bf16, quantize in graphs, two runs; notes/quant.md "Session 31",
    "Session 32", notes/quant_recipes.md "Session 33"), us:
    - row+col compact: per tensor 4096x8192 58.4 -> 57.2, 8192^2 110.5 -> 107.9, 16384x8192
      228-230 -> 217-220, 4096x2048 19.7 -> 18.9, 16384x2048 58.6 -> 57.5, 2048^2 11.7 both;
      per token from L2_WARM_MAX_BYTES 16384x8192 235 -> 220-228;
    - row+col swizzled: per tensor 4096x8192 60.8 -> 58.7, 8192^2 114.1 -> 109.5, 16384x8192
      220.9 -> 210.5, 32768x8192 428 -> 406, 16384x2048 60.8 -> 58.7, 4096x2048 19.3 -> 19.2,
      2048^2 11.6 -> 11.9, 8192x2048 / 4096x4096 34.0 -> 32.6 / 33.8 -> 32.9; per token
      16384x8192 226.3 -> 218.3, 32768x8192 435.8 -> 420.4;
    - rowwise only, per tensor compact / swizzled: 4096x8192 43.6 -> 41.6 / 43.3 -> 41.9,
      8192^2 80.5 -> 78.4 / 79.7 -> 78.5, 16384x2048 43.6 -> 41.8 / 43.4 -> 41.9, 16384x8192
      152.4 -> 152.6 / 150.1 -> 151.6, 32768x8192 292.5 -> 291.7 / 288.5 -> 293.0, 8192x2048
      25.5 -> 24.6 / 24.8 -> 24.1, 4096x2048 15.0 both / 14.6 -> 14.7, 2048^2 9.4 -> 9.7 /
      9.1 -> 9.5; columnwise only 0-4% slower;
    - RHT per tensor swizzled: 4096x8192 69.6 -> 67.9, 8192^2 126.5 -> 123.6, 16384x8192
      242 -> 234, 32768x8192 466.3 -> 449.6, 16384x2048 69.8 -> 68.2, 8192x2048 39.7 -> 39.2,
      4096x2048 24.1 -> 24.2, 2048^2 15.4 -> 15.5;
    - RHT per token compact, with neither the run nor bands: 4096x8192 71.5 -> 69.9, 8192^2
      131.8 -> 128.0, 16384x8192 250.9 -> 244.6, 16384x2048 71.8 -> 70.1, 4096x2048 24.2 ->
      24.0 (with the run 1-3% slower, with per-group run flushes +2%, with bands +-1%); the
      plain per-token cast alike (two CTAs per SM, below L2_WARM_MAX_BYTES): 4096x8192 61.5
      -> 60.5, 8192^2 114.9 -> 112.1, 16384x2048 61.5 -> 60.5, 4096x2048 20.1 -> 19.7;
    - RHT + stochastic rounding per token compact (session 33): 16384x8192 297.5 -> 283.0,
      32768x8192 576.0 -> 544.3, 8192^2 149.3 -> 148.9 (below L2_WARM_MAX_BYTES +-0.5%).
    Not taken (1-5% slower or within +-1%): the RHT per tensor with compact scales (with or
    without the run and bands), per token with swizzled scales (plain and RHT), RHT +
    stochastic rounding per tensor; stochastic rounding alone (66.1 -> 69.4 at 4096x8192:
    its Philox keys in 120 registers per thread)."""
    if dtype == "fp32" or fused or block2d or (stochastic and not rht):
        return 1
    big = elements >= GROUPS_MIN_ELEMENTS
    if rht or walk[0] != 1:
        return 2 if two_cta_groups(per_token, swizzle, rowwise, columnwise, rht, stochastic,
                                   elements) else 1
    if rowwise and columnwise:
        return 2 if big or not swizzle else 1
    if rowwise and big and elements < GROUPS_ROWWISE_MAX_ELEMENTS:
        return 2
    return 1


def plain_walk(per_token: bool) -> tuple:
    """The walk without any option (two CTAs per SM, forwards; the enc table per tensor): the
    fused cast's, and cast_kernel's default."""
    return (2, False, False, 1, 1, not per_token, False)


def walk_run(m: int, k: int, esize: int, compact_row: bool, num_sms: int = 132) -> int:
    """The run (CastKernel run) of an [m, k] input's cast at any size: when the cast writes
    compact rowwise scales, K divides into runs and there are RUN_MIN_UNITS_PER_SM runs per
    SM, else 1 (cast_walk limits it to the sizes of RUN_BYTES)."""
    run_cols = RUN_SCALE_BYTES * 16  # input columns of a run (any dtype)
    n_tm = -(-m // CastKernel.tile_m)
    if (compact_row and k % run_cols == 0
            and n_tm * (k // run_cols) >= RUN_MIN_UNITS_PER_SM * num_sms):
        return CastKernel.run_tiles(esize)
    return 1


def row_group_run(m: int, k: int, esize: int, num_sms: int) -> int:
    """The run of the row-group cast (CastKernel run): the lanes look their groups up once
    per run of tiles along K, so the longest run (a power of two up to the full run, whose
    compact rowwise scales fill a sector) that divides the tile row and leaves
    RUN_MIN_UNITS_PER_SM runs per SM, else 1 (walk_run's rule)."""
    n_tm = -(-m // CastKernel.tile_m)
    n_tk = -(-k // (CastKernel.tile_bytes // esize))
    run = CastKernel.run_tiles(esize)
    while run > 1 and (n_tk % run or n_tm * (n_tk // run) < RUN_MIN_UNITS_PER_SM * num_sms):
        run //= 2
    return run


def cast_walk(m: int, k: int, esize: int, per_token: bool, fused: bool,
              compact_twin: bool = False, compact_row: bool = False,
              num_sms: int = 132) -> tuple:
    """(CTAs per SM, reverse walk, amax prefetch, band, run, enc table, preload) of the cast
    of an [m, k] input:
    per tensor one CTA per SM (8 consumer warps: measured 1.1-1.2x faster from 2^26 elements
    than two); per token the amax loads one tile ahead (prefetch) at every size, and two CTAs
    per SM below L2_WARM_MAX_BYTES (its per-row amax loads need the warps to hide their
    latency), one from there (measured, bf16 row+col compact, graphs, session 26, two CTAs
    without prefetch -> one with it: 16384x8192 274.5 -> 269.7 us, 32768x8192 547.0 ->
    522.7, 65536x4096 544.7 -> 520.2, 8192x16384 and 24576x8192 +-0.4, fp32 8192x8192 272.2
    -> 245.8, swizzled and columnwise-only outputs faster or equal; below the bound one
    CTA is slower: 4096x8192 69.2 -> 72.3; notes/quant.md "Session 26");
    band COMPACT_TWIN_BAND with compact_twin (a columnwise output with compact scales) when
    the tile rows divide into bands, else 1; run (compact_row: a rowwise output with compact
    scales) when K divides into runs and there are enough of them, else 1; the enc table per
    tensor, see ENC_TABLE_COMPACT_TWIN_MAX_BYTES; preload per tensor with the reverse walk
    and a run (measured: 4096x8192 bf16 row+col 70.6 -> 68.9 us, 2^26 elements -0.3 to -1.3
    us, rowwise only and fp32 unchanged; per token 2-4 us slower; swizzled fp16 1 us slower,
    so not without the run's smem scale stores, which are what keeps ptxas from hoisting the
    column pass's reads; notes/quant.md "Session 14")."""
    if fused:
        return plain_walk(per_token)
    warm = m * k * esize < L2_WARM_MAX_BYTES
    band = 1
    if compact_twin and -(-m // CastKernel.tile_m) % COMPACT_TWIN_BAND == 0:
        band = COMPACT_TWIN_BAND
    lo, hi = RUN_BYTES[(per_token, compact_twin)]
    run = walk_run(m, k, esize, compact_row, num_sms) if lo <= m * k * esize < hi else 1
    if per_token:
        return (2 if warm else 1, warm, True, band, run, False, False)
    table = not (compact_twin and m * k * esize >= ENC_TABLE_COMPACT_TWIN_MAX_BYTES)
    return (1, warm, False, band, run, table, warm and run > 1)


class _Plan:
    """Per-(shape, dtype, device, recipe, amax_reduce given) constants of a call, validated
    once: compiled kernels (their TVM-FFI functions) and the byte layout of the single output
    buffer. Pieces start on 256-byte boundaries: a misaligned data piece splits every 32-byte
    row segment of a tile over two sectors (measured: the per-tensor cast ran 2x slower with
    16-byte alignment).

    Amax words. Fused (one launch): per tensor [amax]; per token [row amax (M), column amax
    (K)]. Two launches, per tensor: [amax, partial 1..P]; with a cross-rank reduction
    (``reduced``) [amax, local amax, partial 1..P]: the local amax is reduced in place and the
    cast reads it as its single partial. Per token: [row amax (M), column amax (K)], zeroed per
    call (the token amax kernel reduces across CTAs with atomics)."""

    def __init__(self, shape, dtype, dev, recipe, reduced):
        if dev.type != "cuda":
            raise ValueError("cute_fp4.quant.dispatch.quantize needs a CUDA tensor")
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            raise TypeError(f"x must be float32, bfloat16 or float16, got {dtype}")
        if len(shape) < 2:
            raise ValueError(f"x must have at least 2 dimensions, got shape {tuple(shape)}")
        k = shape[-1]
        m = 1
        for d in shape[:-1]:
            m *= d
        _check_recipe(recipe)
        esize = _CUTLASS[name].width // 8
        _check_shape(m, k, esize, recipe)
        arch = device_arch(dev)
        sms = num_sms(dev)
        row, col, swz = recipe.rowwise, recipe.columnwise, recipe.swizzle
        self.per_token = per_token = recipe.scaling == "token"
        # per token, rowwise only: TokenRowCast finds the row amaxes and casts the rows in one
        # read, at any size (on tiny inputs too: its call takes 4 arguments and no TMA
        # descriptor, 4.3-4.4 us against the fused cast's 4.8-4.9 in the same run)
        split = token_rows_config(k, esize, swz) if TOKEN_ROWS else None
        rows_only = per_token and row and not col and split is not None
        self.fused = fused = (not reduced and not rows_only
                              and cast_tiles(m, k, esize) <= FUSED_MAX_TILES)
        self.recipe, self.shape, self.dtype, self.dev = recipe, tuple(shape), dtype, dev
        self.flat = (m, k) if len(shape) != 2 else None
        self.reduced = reduced
        self.row, self.col = row, col
        self.amax = None
        self.token_rows = None
        if rows_only:
            self.token_rows = token_rows_fn(name, swz, split, sms, arch)
        walk = cast_walk(m, k, esize, per_token, fused, col and not swz, row and not swz, sms)
        block2d = recipe.block == (16, 16)
        groups = cast_groups(name, row, col, swz, per_token, fused, walk, False, block2d, False,
                             m * k)
        keep = self.l2_keep = l2_keep(walk, m * k * esize, col)
        if per_token:
            n_amax = m if self.token_rows is not None else m + k  # TokenRowCast: rows only
            if not fused and self.token_rows is None:
                self.amax = token_amax_fn(name, keep, arch)
        elif fused:
            n_amax = 1
        else:
            n_amax = tensor_amax_words(m, k, esize, sms, reduced)
            self.amax = tensor_amax_fn(name, sms, keep, arch)
        # one launch writes every output, amaxes included (out= needs no scratch words)
        self.one_launch = fused or self.token_rows is not None
        self.cast = None
        if self.token_rows is None:
            self.cast = ffi_function(KERNELS.get(
                ("cast", name, row, col, swz, per_token, sms, fused, walk, block2d, groups, arch),
                lambda: compile_kernel(*cast_kernel(name, row, col, swz, per_token, sms, fused,
                                                    walk, block2d=block2d, groups=groups),
                                       arch=arch)))
        off = self.amax_bytes = (4 * n_amax + 255) // 256 * 256
        self.m, self.k, self.n_amax = m, k, n_amax
        # (shape, strides, byte offset) of each present output; absent ones are None
        self.data = self.scales = self.data_t = self.scales_t = None
        shapes = {}
        if row:
            shapes["data"], shapes["scales"] = (m, k // 2), scale_shape(m, k // 16, swz)
        if col:
            shapes["data_t"], shapes["scales_t"] = (k, m // 2), scale_shape(k, m // 16, swz)
        for key, piece in shapes.items():
            setattr(self, key, (piece, (piece[1], 1), off))
            off += (piece[0] * piece[1] + 255) // 256 * 256
        self.nbytes = off
        self.dummy = torch.empty((1, 1), dtype=torch.uint8, device=dev)
        self.dummy_f8 = self.dummy.view(torch.float8_e4m3fn)

    def _own(self, spec) -> torch.Tensor:
        """One uint8 output (shape, strides, offset) in its own allocation."""
        shape = spec[0]
        return _alloc(shape[0] * shape[1], self.dev).view(shape)

    def run(self, x: torch.Tensor, amax_reduce, separate: bool = False,
            out: Optional[NVFP4Tensor] = None) -> NVFP4Tensor:
        """One call on an input of the plan's shape, dtype and device: its per-call checks,
        the allocation, the output views, the launch(es). separate: the data and scale
        outputs get their own allocations instead of views of one (custom-op outputs must not
        share memory). out: a checked NVFP4Tensor (api's _check_out) the call writes into and
        returns: the fused launch writes its amaxes too (no allocation at all); two launches
        reduce into scratch words and copy them."""
        if not x.is_contiguous():
            raise ValueError("x must be contiguous (call .contiguous() first)")
        if x.data_ptr() % 16:
            raise ValueError("x must be 16-byte aligned")
        if self.flat is not None:
            x = x.view(self.flat)
        data = scales = data_t = scales_t = None
        words = None
        if out is not None:
            data, scales, data_t, scales_t = out.data, out.scales, out.data_t, out.scales_t
            if not self.one_launch:
                words = _alloc(self.amax_bytes, self.dev).view(torch.float32)
        elif separate:
            buf = _alloc(self.amax_bytes, self.dev)
            if self.row:
                data = self._own(self.data)
                scales = self._own(self.scales).view(torch.float8_e4m3fn)
            if self.col:
                data_t = self._own(self.data_t)
                scales_t = self._own(self.scales_t).view(torch.float8_e4m3fn)
            words = buf.view(torch.float32)
        else:
            buf = _alloc(self.nbytes, self.dev)
            if self.row:
                data = buf.as_strided(*self.data)
            if self.col:
                data_t = buf.as_strided(*self.data_t)
            f8 = buf.view(torch.float8_e4m3fn)
            if self.row:
                scales = f8.as_strided(*self.scales)
            if self.col:
                scales_t = f8.as_strided(*self.scales_t)
            words = buf.view(torch.float32)
        m, k = self.m, self.k
        # amax_r / amax_c: the outputs; arg_r / arg_c: what the cast reads
        if self.fused:
            if out is not None:
                amax_r, amax_c = out.amax, out.amax_t
            elif self.per_token:
                amax_r = words[:m] if self.row else None
                amax_c = words[m:m + k] if self.col else None
            else:
                amax_r = amax_c = words[:1]
            if self.per_token:
                # the fused cast touches only the amaxes of the outputs it writes
                arg_r = amax_c if amax_r is None else amax_r
                arg_c = amax_r if amax_c is None else amax_c
            else:  # it writes the one amax to arg_r
                arg_r = arg_c = amax_c if amax_r is None else amax_r
        elif self.token_rows is not None:
            amax_r = out.amax if out is not None else words[:m]
            amax_c = None
            self.token_rows(x, amax_r, data, scales, None, None)
        elif self.per_token:
            amax_all = words[:m + k]
            amax_r = arg_r = amax_all[:m]
            amax_c = arg_c = amax_all[m:]
            amax_all.zero_()
            self.amax(x, amax_r, amax_c, None, None, None, None)
            if amax_reduce is not None:
                amax_reduce(amax_c)
        else:
            arg_r = arg_c = run_tensor_amax(self.amax, x, words[:self.n_amax], amax_reduce)
            amax_r = amax_c = words[:1]
        dummy, dummy_f8 = self.dummy, self.dummy_f8
        if self.cast is not None:
            self.cast(x, arg_r, arg_c, dummy if data is None else data,
                      dummy_f8 if scales is None else scales, dummy if data_t is None else data_t,
                      dummy_f8 if scales_t is None else scales_t, None, None)
        if out is None:
            return NVFP4Tensor(data, scales, amax_r if self.row else None, data_t, scales_t,
                               amax_c if self.col else None, self.recipe, self.shape,
                               self.dtype)
        if not self.one_launch:
            for dst, src in ((out.amax, amax_r), (out.amax_t, amax_c)):
                if dst is not None:
                    dst.copy_(src)
        elif (not self.per_token and self.row and self.col
              and out.amax_t.data_ptr() != out.amax.data_ptr()):
            out.amax_t.copy_(out.amax)  # the fused cast wrote the amax to out.amax only
        return out


@functools.lru_cache(maxsize=4096)
def _plan(shape, dtype, dev, recipe, reduced) -> _Plan:
    return _Plan(shape, dtype, dev, recipe, reduced)


def plan_for(x: torch.Tensor, recipe: Recipe, reduced: bool = False) -> _Plan:
    """The cached plan of a call (tests and benchmarks inspect it: ``.fused``, ``.cast``)."""
    return _plan(x.shape, x.dtype, x.device, recipe, reduced)


def quantize(x: torch.Tensor, recipe: Recipe = Recipe(), *, seed: int = 0,
             offset: int = 0, amax_reduce: Optional[Callable[[torch.Tensor], None]] = None,
             separate: bool = False, out: Optional[NVFP4Tensor] = None) -> NVFP4Tensor:
    """NVFP4 quantize of a CUDA tensor [..., K] (flattened to [M, K]); see the module doc.
    seed/offset are accepted for API symmetry (the plain cast rounds to nearest; stochastic
    rounding runs in the recipe kernels).

    amax_reduce (tensor / sequence parallelism, input sharded along M): called between the
    amax kernel and the cast on the float32 amaxes that span M, which it must reduce in place
    across ranks (e.g. ``lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)``):
    the one global amax [1] for per-tensor scaling, the column amax [K] for per-token (the
    per-row amaxes are local). The cast then quantizes with the reduced values.

    Per call (the plan, cached by shape, dtype, device, recipe and whether amax_reduce is
    given, holds everything else): the contiguity and alignment checks, one allocation, the
    views of the outputs and one launch (fused, tiny inputs) or the amax kernel (per token
    after a zero-fill of the amax words) and the cast. separate: the data and scale outputs
    are allocated one by one (the custom op's outputs must not share memory). out: an
    NVFP4Tensor checked by the public API (`cute_fp4.quantize(..., out=)`) to write into."""
    plan = _plan(x.shape, x.dtype, x.device, recipe, amax_reduce is not None)
    return plan.run(x, amax_reduce, separate, out)
