"""Amax kernels (SPEC section 1, outer scale): per-tensor amax and the per-token "K1" kernel
that produces the per-row AND per-column amax of [M, K] in one pass over the input.

Values are |x| in FP32, NaN-propagating like ``torch.amax`` (``max.NaN``); a NaN result is
written as torch's quiet NaN 0x7FC00000.

Per tensor: ``AmaxTensor`` writes one partial maximum per CTA to ``amax[1 + cta]`` (no atomics,
so the buffer needs no zeroing); the cast kernel reduces the partials and writes ``amax[0]``.
``tensor_partials`` gives the number of CTAs (the host sizes the buffer with it).
Per token: cross-CTA reduction with ``red.global.max.u32`` on the bit pattern (non-negative FP32
orders like its bits; NaN 0x7FC00000 is above +Inf), so those outputs are zeroed before the launch.

Input reads are 16-byte vector loads (8 bf16/fp16 or 4 fp32 elements per thread), which needs
K * element_size % 16 == 0 (checked by the dispatcher).

``l2_keep`` (bytes, compile-time): the input's last l2_keep bytes are read with the normal L2
eviction priority and the rest with evict_first, so that L2 gives up the start of the input
before its end, which the cast walking backwards reads first (notes/quant.md "Session 16").
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_fp4.common import encode as E
from cute_fp4.common.encode import add_rn, block_amax, sub_rn
from cute_fp4.common.ptx import l2_policy, ld_global
from cute_fp4.common.scales import swizzled_scale_offset
from cute_fp4.quant.padding import GROUP_FIRST, GROUP_ROW_SW, GROUP_TWIN_SW, zero_tile
from cute_fp4.ref.quantize import RHT_SIGNS

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
THREADS = 256
CTAS_PER_SM = 8


def max_tensor_partials(num_sms: int) -> int:
    """The most CTAs (= partial maxima) AmaxTensor launches on a GPU with num_sms SMs."""
    return num_sms * CTAS_PER_SM


def tensor_partials(m: int, k: int, esize: int, num_sms: int) -> int:
    """Number of CTAs (= partial maxima) of AmaxTensor for an [m, k] input."""
    nvec = m * (k * esize // 16)
    return max(1, min((nvec + THREADS - 1) // THREADS, max_tensor_partials(num_sms)))


def token_tensor_split(m: int, k: int, esize: int, num_sms: int) -> tuple:
    """(tiles per CTA, CTAs = partial maxima per side) of AmaxToken per_tensor for an [m, k]
    input of 128-row x 512-byte tiles: the fewest tiles per CTA, a power of two, that keep the
    CTAs within max_tensor_partials (the cast reduces that many)."""
    tiles = max(1, -(-k * esize // 512) * -(-m // AmaxToken.ROWS))
    per_cta = 1
    while -(-tiles // per_cta) > max_tensor_partials(num_sms):
        per_cta *= 2
    return per_cta, -(-tiles // per_cta)


def vec_value(words, j, dtype_name):
    """Element j of one 16-byte vector (four 32-bit words) as FP32 (exact)."""
    if dtype_name == "fp32":
        return E.bits_f32(words[j])
    if j % 2 == 0:
        return E.unpack_lo(words[j // 2], dtype_name)
    return E.unpack_hi(words[j // 2], dtype_name)


def vec_values(words, dtype_name):
    """The FP32 values of 32-bit words (one 16-byte vector: 4 fp32 or 8 bf16/fp16 elements),
    in memory order (exact conversions)."""
    per_word = 32 // DTYPES[dtype_name].width
    return [vec_value(words, j, dtype_name) for j in range(len(words) * per_word)]


def vec_abs_max(acc, words, dtype_name):
    """Fold the elements of one 16-byte vector (four 32-bit words) into the running
    NaN-propagating amax (also the fused amax of the cast, quant/cast.py)."""
    for v in vec_values(words, dtype_name):
        acc = E.abs_max_nan(acc, v)
    return acc


def keep_policies(l2_keep: int, nbytes: Int64):
    """l2_keep > 0: (evict_first policy, evict_normal policy, first byte offset kept) of an input
    of nbytes bytes, for keep_load; else None."""
    if l2_keep == 0:
        return None
    return l2_policy("evict_first"), l2_policy("evict_normal"), nbytes - l2_keep


def keep_load(base, off: Int64, policies):
    """The 16 input bytes at byte offset off: a read-only load, with the L2 priority of its
    place (keep_policies) unless policies is None."""
    if policies is None:
        return E.ld_global_nc_v4(base + off)
    first, normal, keep_from = policies
    pol = Int64(cutlass.select_(off < keep_from, first, normal))
    return ld_global(base + off, 4, nc=True, volatile=True, cache_policy=pol, dtype=Uint32)


class AmaxTensor:
    """amax[1 + cta] = max |x| over the grid-stride share of CTA ``cta`` (see the module doc);
    ``chunked``: over chunk ``cta`` of ``chunks``, one CTA per chunk (int32 [P, 3] rows
    (first, end, step): thread t loads the 16-byte vectors first + t, first + t + step, ...
    below end; the row groups' chunks of recipes_dispatch.group_chunks, each a CTA's
    grid-stride share of one group). ``padding`` (chunked): before its loads warp w of CTA b
    also zeroes the 512-byte tiles b * 8 + w, + 8P, ... of the int32 table ``tiles``
    (padding.padding_tiles: the row groups' swizzled scale tiles holding padding, v >= 0 in
    the flat rowwise scales ``s``, v < 0 tile -1 - v of the flat twin scales ``st``), so
    that the row-group cast after this pass compiles no padding code (CastKernel padding)."""

    def __init__(self, dtype: str, num_sms: int, l2_keep: int = 0, chunked: bool = False,
                 padding: bool = False):
        if dtype not in DTYPES:
            raise TypeError(f"AmaxTensor: unsupported input dtype {dtype!r}")
        if padding and not chunked:
            raise ValueError("AmaxTensor: padding (the row groups' swizzled scales) needs "
                             "chunked")
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.num_sms = num_sms
        self.l2_keep = l2_keep
        self.chunked = chunked
        self.padding = padding

    @cute.jit
    def __call__(self, x: cute.Tensor, amax: cute.Tensor, chunks: Optional[cute.Tensor],
                 s: Optional[cute.Tensor], st: Optional[cute.Tensor],
                 tiles: Optional[cute.Tensor], stream):
        """chunks: chunked, else None; s, st, tiles: with padding, else None."""
        nvec = x.shape[0] * (x.shape[1] * self.esize // 16)
        blocks = cutlass.max(cutlass.min((nvec + THREADS - 1) // THREADS,
                                         max_tensor_partials(self.num_sms)), 1)
        if cutlass.const_expr(self.chunked):
            blocks = chunks.shape[0]
        self.kernel(x, amax, chunks, s, st, tiles, nvec).launch(
            grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, amax: cute.Tensor, chunks: Optional[cute.Tensor],
               s: Optional[cute.Tensor], st: Optional[cute.Tensor],
               tiles: Optional[cute.Tensor], nvec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        base = x.iterator.toint()
        if cutlass.const_expr(self.padding):
            lane4 = Int64(tidx % 32 * 4)  # zero_tile's per-lane addresses
            s_lane = s.iterator.toint() + lane4
            st_lane = st.iterator.toint() + lane4
            warps = THREADS // 32
            for i in cutlass.range(bidx * warps + tidx // 32, tiles.shape[0], gdim * warps,
                                   unroll=1):
                v = tiles[i]
                zero_tile(cutlass.select_(v >= 0, s_lane + Int64(v) * 512,
                                          st_lane + Int64(-1 - v) * 512))
        acc = Float32(0.0)
        start = bidx * THREADS + tidx
        end = nvec
        step = gdim * THREADS
        if cutlass.const_expr(self.chunked):
            start = chunks[bidx, 0] + tidx
            end = chunks[bidx, 1]
            step = chunks[bidx, 2]
        policies = keep_policies(self.l2_keep, Int64(nvec) * 16)
        for i in cutlass.range(start, end, step, unroll=2):
            acc = vec_abs_max(acc, keep_load(base, Int64(i) * 16, policies), self.dtype_name)
        acc = E.warp_max_nan(acc)
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32))
        lane = tidx % 32
        warp = tidx // 32
        if lane == 0:
            red[warp] = acc
        cute.arch.barrier()
        if warp == 0:
            v = Float32(0.0)
            if lane < THREADS // 32:
                v = red[lane]
            v = E.warp_max_nan(v)
            if lane == 0:
                E.st_global_u32(amax.iterator.toint() + Int64(1 + bidx) * 4, E.canonical_nan_bits(v))


def vec_amax(words, dtype_name):
    """max.NaN |x| over one 16-byte vector (four 32-bit words) as FP32: packed bf16x2 / f16x2
    maxima for 16-bit inputs, then their two halves (exact)."""
    if dtype_name == "fp32":
        return E.block_amax([E.bits_f32(w) for w in words])
    return E.amax_fold(E.amax_pairs(words, dtype_name), dtype_name)


@cute.jit
def fold_slab_columns(buf, vals, warps: cutlass.Constexpr, warp, lane, tidx, c0, K, fold, store,
                      groups=None):
    """Fold each lane's column values `vals` (its len(vals) consecutive columns of a slab of
    32 * len(vals) columns starting at column c0) over the CTA's warps through the shared
    [warps, slab] buffer `buf`, in warp order (`fold(acc, next)`); then thread c of the slab
    calls `store(c0 + c, value)` for the columns inside K. groups: a group id per warp (equal
    ids consecutive), the fold restarting at each new id and `store(c0 + c, value, id)` called
    once per id. (Column maxima fold amaxes, >= 0 or NaN, so starting from warp 0's value is
    max(0, ...).)"""
    epv = len(vals)
    for j in cutlass.range_constexpr(epv):
        buf[warp, lane * epv + j] = vals[j]
    cute.arch.barrier()
    c = c0 + tidx
    if (tidx < 32 * epv) & (c < K):
        v = buf[0, tidx]
        if cutlass.const_expr(groups is None):
            for w in cutlass.range_constexpr(1, warps):
                v = fold(v, buf[w, tidx])
            store(c, v)
        else:
            g = groups[0]
            for w in cutlass.range_constexpr(1, warps):
                new = groups[w] != g
                if new:
                    store(c, v, g)
                v = cutlass.select_(new, buf[w, tidx], fold(v, buf[w, tidx]))
                g = groups[w]
            store(c, v, g)


@cute.jit
def fold_cta_maxima(buf, row_max, col_max, warps: cutlass.Constexpr, warp, lane, tidx, ar, ac,
                    do_row: cutlass.Constexpr = True, do_col: cutlass.Constexpr = True,
                    atomic: cutlass.Constexpr = True):
    """The per-tensor end of a strip walk: the CTA's maxima of its lanes' row maximum row_max
    and column maximum col_max (over the warp by shuffles, then over the warps through the
    shared [warps, >= 2] buffer buf, in warp order), one red.max each into the zeroed amax
    words at byte addresses ar and ac (do_row / do_col: which of the two), or with
    atomic=False one store each (the CTA's partials). The folds start from warp 0's value
    (amaxes are >= 0 or NaN)."""
    rw = E.warp_max_nan(row_max)
    cw = E.warp_max_nan(col_max)
    if lane == 0:
        buf[warp, 0] = rw
        buf[warp, 1] = cw
    cute.arch.barrier()
    if tidx < 2:
        v = buf[0, tidx]
        for w in cutlass.range_constexpr(1, warps):
            v = E.fmax_nan(v, buf[w, tidx])
        bits = E.canonical_nan_bits(v)
        if cutlass.const_expr(not atomic):
            E.st_global_u32(cutlass.select_(tidx == 0, ar, ac), bits)
        elif cutlass.const_expr(do_row and do_col):
            E.red_max_u32(cutlass.select_(tidx == 0, ar, ac), bits)
        elif cutlass.const_expr(do_row):
            if tidx == 0:
                E.red_max_u32(ar, bits)
        else:
            if tidx == 1:
                E.red_max_u32(ac, bits)


def rht16(xs, scale: bool = True, strides=(1, 2, 4, 8)):
    """ref.quantize.rht of 16 values: sign flips, butterflies at strides 1, 2, 4, 8, x 0.25
    (scale=False leaves out the x 0.25: amax(|y| * 0.25) = amax(|y|) * 0.25, RN is monotone;
    strides: the butterflies done, the first ones of the four)."""
    ys = [E.neg(x) if s < 0 else x for x, s in zip(xs, RHT_SIGNS)]
    for h in strides:
        nxt = list(ys)
        for j in range(16):
            if not j & h:
                nxt[j] = add_rn(ys[j], ys[j + h])
                nxt[j + h] = sub_rn(ys[j], ys[j + h])
        ys = nxt
    if not scale:
        return ys
    return [E.mul_rn(y, Float32(0.25)) for y in ys]


def rht16_amax_fast(xs):
    """block_amax(rht16(xs, scale=False)) with the last butterfly folded into the amax: in
    round-to-nearest max(|a + b|, |a - b|) = |a| + |b| (one of the two has that magnitude,
    the other one not more), so 8 adds and 8 maxima replace 16 add / sub and 16 maxima. Exact
    except where a and b are both infinite: +Inf here, NaN (Inf - Inf) in the transform; so a
    +Inf result must be recomputed with rht16."""
    ys = rht16(xs, scale=False, strides=(1, 2, 4))
    return block_amax([add_rn(E.fabs(ys[j]), E.fabs(ys[j + 8])) for j in range(8)])


# K1 with the groups' padding (AmaxToken padding): the CTAs per SM its registers are capped
# for, the plain K1's (80 registers: 3 CTAs of 8 warps; the first version's padding code took
# it to 90, 2 CTAs)
PADDING_CTAS_PER_SM = 3


class AmaxToken:
    """K1: amax_r[m] = max_k |x[m, k]| and amax_c[k] = max_m |x[m, k]| in one pass.

    CTA tile: 128 rows x one slab of 32 lanes x one 16-byte vector (256 bf16 / 128 fp32
    columns); warp w reads the tile's 16-row strip w (16 loads in flight per thread). Row
    maxima: each lane's 16 vector maxima reduced over the warp by a transpose-reduction (16
    shuffles for 16 rows), one atomic per row. Column maxima: packed bf16x2 / f16x2 maxima for
    16-bit inputs (FP32 for fp32) over the strip, then smem across warps, one atomic per
    (column, CTA). Reads outside the input are clamped onto its last row / last vector:
    duplicates leave every maximum unchanged, and rows >= M and columns >= K are never written.
    Measured against the kernel before (one row per warp and load, a shuffle reduction per row,
    64 rows per CTA; H200, graphs): bf16 4096x8192 24.3 -> 19.3 us, 8192^2 43.8 -> 34.7, fp32
    8192^2 90.9 -> 63.8. 256 or 512 rows per CTA (two or four strips per warp: fewer column
    atomics) gained at most 0.5 us (bf16, 2^24 to 2^26), lost up to 4 us on fp32 and at
    4096x2048 and 16384x8192 (notes/quant.md "Session 29").

    `groups` (per-token row groups of a grouped input, recipes_dispatch.on_row_group_cast):
    amax_c holds each group's K column amaxes one after another; `strip_groups` (int32, one
    entry per 16-row strip: groups are multiples of 16 rows, so a warp's strip lies in one)
    gives each strip's group, and the CTA's fold over its warps restarts at each new group
    (fold_slab_columns groups: one atomic per (column, group) of the CTA). `padding` (with
    groups, swizzled scales): after the fold the warps near the padding also zero it, in the
    flat rowwise and twin scale buffers `s`, `st` with the row-group cast's GROUP_* tables
    `starts` (_zero_padding: the warp whose strip ends a group, per column slab; in the last
    slab every warp for its strip), so that the row-group cast after this pass compiles none
    (CastKernel padding). The warps zero whole tiles and words around the padding, real
    scales included, which the cast writes after this pass. Two earlier versions zeroed
    exactly the padding bytes: every thread taking grid-stride shares of all the groups'
    padding, then the warps near it with byte and word loops; they cost K1 5.5-10 us and
    2.5-5.7 us (perf/results/logs/quant_session45_h200.md section 4,
    quant_session46_h200.md).

    `rht`: amax_c[k] is the column amax of the 16-point RHT of x's 16-row column blocks (the
    twin's outer amax, SPEC section 2; M a multiple of 16): each lane's strip is one block
    row of its columns, transformed in FP32 as ref.quantize.rht does (_rht_column_maxima);
    strips past M (clamped copies of the last row) count nothing. `per_tensor`: the maxima of
    all rows and columns instead, as partials like AmaxTensor's (no atomics, no zero-fill):
    amax_r and amax_c hold [amax, P partials], P = amax_r.shape[0] - 1 CTAs (1-D grid) each
    take tiles b, b + P, ... (`tiles_per_cta` of them, compile-time: the host's
    token_tensor_split) and store their maxima to amax_r[1 + b] and amax_c[1 + b]; the cast
    reduces them and writes amax[0]. Against one red.max per CTA into zeroed words: no
    zero-fill kernel, ~1.1 us per call in graphs (H200; notes/quant_recipes.md "Session
    49"). A run-time tile loop instead took ptxas to 176-182 registers with l2_keep (one CTA
    per SM; with the bound of two, spills): 0.5-2 us slower from 2^24 elements."""

    warps = 8
    STRIP = 16
    ROWS = STRIP * warps

    def __init__(self, dtype: str, l2_keep: int = 0, rht: bool = False,
                 per_tensor: bool = False, groups: bool = False, padding: bool = False,
                 tiles_per_cta: int = 1):
        if dtype not in DTYPES:
            raise TypeError(f"AmaxToken: unsupported input dtype {dtype!r}")
        if groups and (rht or per_tensor):
            raise ValueError("AmaxToken: groups takes neither rht nor per_tensor")
        if per_tensor and not rht:
            raise ValueError("AmaxToken: per_tensor needs rht (AmaxTensor takes the plain "
                             "per-tensor amax)")
        if tiles_per_cta < 1 or (tiles_per_cta != 1 and not per_tensor):
            raise ValueError("AmaxToken: tiles_per_cta (>= 1) is per_tensor's; the other "
                             "passes take one tile per CTA")
        if padding and not groups:
            raise ValueError("AmaxToken: padding (the row groups' swizzled scales) needs groups")
        self.groups = groups
        self.padding = padding
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.l2_keep = l2_keep
        self.rht = rht
        self.per_tensor = per_tensor
        self.tiles_per_cta = tiles_per_cta
        self.vec = 16 // self.esize  # elements per 16-byte vector
        self.cols_per_cta = 32 * self.vec

    @cute.jit
    def __call__(self, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor,
                 strip_groups: Optional[cute.Tensor], s: Optional[cute.Tensor],
                 st: Optional[cute.Tensor], starts: Optional[cute.Tensor], stream):
        """strip_groups: with groups the int32 group of each 16-row strip, else None; s, st,
        starts: with padding the flat uint8 rowwise and twin scales and the int32 GROUP_*
        tables (four of G + 1 entries), else None."""
        M = x.shape[0]
        K = x.shape[1]
        if cutlass.const_expr(self.per_tensor):
            self.tensor_kernel(x, amax_r, amax_c, M, K).launch(
                grid=(amax_r.shape[0] - 1, 1, 1), block=(32 * self.warps, 1, 1), stream=stream)
            return
        grid = ((K + self.cols_per_cta - 1) // self.cols_per_cta, (M + self.ROWS - 1) // self.ROWS, 1)
        launch = {}
        if cutlass.const_expr(self.padding):
            # the plain K1's 3 CTAs per SM (<= 80 registers); the carveout because with
            # min_blocks_per_mp alone the DSL asks the driver for the device at compile time
            launch = {"min_blocks_per_mp": PADDING_CTAS_PER_SM, "preferred_smem_carveout": 100}
        self.kernel(x, amax_r, amax_c, strip_groups, s, st, starts, M, K).launch(
            grid=grid, block=(32 * self.warps, 1, 1), stream=stream, **launch)

    def _strip(self, xbase, M, K, bx, by, warp, lane, keep: bool = True):
        """The warp's 16-row strip of tile (bx, by): its first row r0 and its rows' 16-byte
        vectors (reads past M / K clamped onto the last row / vector; keep=False: plain
        loads, without l2_keep's priorities)."""
        rbytes = Int64(K) * self.esize
        col_off = Int64(cutlass.min(bx * self.cols_per_cta + lane * self.vec,
                                    K - self.vec)) * self.esize
        policies = keep_policies(self.l2_keep if keep else 0, Int64(M) * rbytes)
        r0 = by * self.ROWS + warp * self.STRIP
        rows = []
        for i in range(self.STRIP):
            off = Int64(cutlass.min(r0 + i, M - 1)) * rbytes + col_off
            rows.append(list(keep_load(xbase, off, policies)))
        return r0, rows

    def _strip_columns(self, rows, r0, M):
        """The lane's column maxima over its strip (with rht of the transformed columns; a
        strip past M, clamped copies of the last row, counts nothing)."""
        if self.rht:
            return [cutlass.select_(r0 < M, c, Float32(0.0))
                    for c in self._rht_column_maxima(rows)]
        return self._column_maxima(rows)

    def _strip_max(self, rows):
        """max.NaN |x| over the lane's strip (FP32; packed maxima for 16-bit inputs)."""
        if self.esize == 4:
            return E.block_amax([E.bits_f32(w) for r in rows for w in r])
        return E.amax_fold(E.amax_pairs([w for r in rows for w in r], self.dtype_name),
                           self.dtype_name)

    @cute.jit
    def _rht_strip_max(self, rows, reread):
        """The per-tensor fold of _rht_column_maxima: the maximum over the lane's columns of
        |rht(x)| (FP32, x 0.25). Where the fast maxima give +Inf every column is transformed
        again, one at a time in a loop from the strip read again (reread(); plain loads: with
        l2_keep's priorities there ptxas took the kernel to 176-179 registers). With the
        unrolled recomputation on the live rows, it took a tile loop to 198-210 registers
        (128 with this)."""
        m = block_amax([rht16_amax_fast([vec_value(w, j, self.dtype_name) for w in rows])
                        for j in range(self.vec)])
        if m == Float32(float("inf")):
            m = Float32(0.0)
            for j in cutlass.range(self.vec, unroll=1):
                col = [self._dyn_value(w, j) for w in reread()]
                m = E.fmax_nan(m, block_amax(rht16(col, scale=False)))
        return E.mul_rn(m, Float32(0.25))

    def _dyn_value(self, words, j):
        """Element j (run-time) of one 16-byte vector as FP32: selects, no indexed registers."""
        per_word = 4 // self.esize
        w = words[0]
        for i in range(1, 4):
            w = cutlass.select_(j // per_word == i, words[i], w)
        if self.esize == 4:
            return E.bits_f32(w)
        return E.unpack_lo(Uint32(w) >> Uint32(16 * (j % 2)), self.dtype_name)

    def _column_maxima(self, rows):
        """The lane's vec column maxima (FP32) over its strip's row vectors: packed bf16x2 /
        f16x2 maxima for 16-bit inputs (word k: columns 2k and 2k + 1), then unpacked."""
        if self.esize == 4:
            return [E.block_amax([E.bits_f32(w[j]) for w in rows]) for j in range(self.vec)]
        cols = []
        for k in range(4):
            pair = E.amax_pairs([w[k] for w in rows], self.dtype_name)
            cols += [E.unpack_lo(pair, self.dtype_name), E.unpack_hi(pair, self.dtype_name)]
        return cols

    @cute.jit
    def _rht_column_maxima(self, rows):
        """The lane's column maxima of |rht(x)| (FP32) over its strip, one 16-row block per
        column: the last butterfly folded into the maxima (rht16_amax_fast); where that gives
        +Inf (a NaN of Inf - Inf in the transform, or an overflow) the lane takes its columns
        again with the whole transform (RecipeAmax's rule); x 0.25 last (RN is monotone)."""
        acc = cute.make_rmem_tensor((self.vec,), Float32)
        for j in cutlass.range_constexpr(self.vec):  # a column at a time: fewer registers
            acc[j] = rht16_amax_fast([vec_value(w, j, self.dtype_name) for w in rows])
        inf = acc[0] == Float32(float("inf"))
        for j in cutlass.range_constexpr(1, self.vec):
            inf = inf | (acc[j] == Float32(float("inf")))
        if inf:
            for j in cutlass.range_constexpr(self.vec):
                acc[j] = block_amax(rht16([vec_value(w, j, self.dtype_name) for w in rows],
                                          scale=False))
        return [E.mul_rn(acc[j], Float32(0.25)) for j in range(self.vec)]

    @cute.jit
    def _zero_padding(self, s, st, table, K, strip, last, ends, bx, gx, lane):
        """The warp's share of the groups' swizzled padding (padding), near the strips. It
        zeroes whole 512-byte tiles and 4-byte words holding padding, real scales included:
        the row-group cast writes those after this pass. The warp whose strip ends a group
        zeroes, in the CTA's column slab, the group's last rowwise row tile (rows past the
        group) and its twin's last column tile (columns past M_g / 16); in the last slab every
        warp zeroes its strip rows' words of the last rowwise column tile (columns past
        K / 16), and the strip that starts a twin column tile that tile in the twin's last row
        tile (rows past K). table: the group's first block row, block rows, first block row
        of its padded rowwise scales and its twin's first 512-byte unit."""
        first, nblk, rsw, twin_unit = table
        nsc_r = K // 16
        row_tiles = (nsc_r + 3) // 4  # tiles per 128-row tile row of the rowwise scales
        twin_tiles = (nblk + 3) // 4  # tiles per 128-row tile row of the group's twin
        k_tiles = (K + 127) // 128
        s_base = s.iterator.toint()
        s_lane = s_base + Int64(lane * 4)  # zero_tile's per-lane addresses
        tw = st.iterator.toint() + Int64(twin_unit) * 512 + Int64(lane * 4)
        tail = bx == gx - 1
        if (strip <= last) & ends:
            if nblk % 8 != 0:
                t = (rsw + nblk - 1) // 8
                for i in cutlass.range_constexpr(self.cols_per_cta // 64):
                    c = bx * (self.cols_per_cta // 64) + i
                    if c < row_tiles:
                        zero_tile(s_lane + Int64(t * row_tiles + c) * 512)
            if nblk % 4 != 0:
                for i in cutlass.range_constexpr(self.cols_per_cta // 128):
                    r = bx * (self.cols_per_cta // 128) + i
                    if r < k_tiles:
                        zero_tile(tw + Int64(r * twin_tiles + twin_tiles - 1) * 512)
        if (strip <= last) & tail:
            j = strip - first  # the strip's block row in its group: its twin column
            if (nsc_r % 4 != 0) & (lane < 16):
                off = swizzled_scale_offset((rsw + j) * 16 + lane, row_tiles * 4 - 4, nsc_r)
                E.st_global_u32(s_base + Int64(off), Uint32(0))
            if (K % 128 != 0) & (j % 4 == 0):
                zero_tile(tw + Int64((k_tiles - 1) * twin_tiles + j // 4) * 512)

    @cute.kernel
    def kernel(self, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor,
               strip_groups: Optional[cute.Tensor], s: Optional[cute.Tensor],
               st: Optional[cute.Tensor], starts: Optional[cute.Tensor], M: Int32, K: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        xbase = x.iterator.toint()
        ar = amax_r.iterator.toint()
        ac = amax_c.iterator.toint()
        c0 = bx * self.cols_per_cta
        r0, rows = self._strip(xbase, M, K, bx, by, warp, lane)
        rm = E.lanes_transpose_max16([vec_amax(w, self.dtype_name) for w in rows], lane)
        r = r0 + lane // 2  # the row whose maximum this lane now holds
        if (lane % 2 == 0) & (r < M):
            E.red_max_u32(ar + Int64(r) * 4, E.canonical_nan_bits(rm))
        cols = self._strip_columns(rows, r0, M)
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(
            (self.warps, self.cols_per_cta), stride=(self.cols_per_cta, 1)), 16)
        if cutlass.const_expr(self.groups):
            # the groups of the CTA's strips (those past M: the last strip's, whose rows the
            # clamped reads repeat)
            last = strip_groups.shape[0] - 1
            groups = [strip_groups[cutlass.min(by * self.warps + w, last)]
                      for w in range(self.warps)]
            if cutlass.const_expr(self.padding):
                # the warp's strip's group, whether the strip ends it (the next strip is
                # another group's, or it is the last) and the group's table entries, loaded
                # before the fold so that their latency overlaps it
                strip = by * self.warps + warp
                g = strip_groups[cutlass.min(strip, last)]
                ends = (strip == last) | (strip_groups[cutlass.min(strip + 1, last)] != g)
                n = starts.shape[0] // 4  # G + 1 entries per table
                first = Int32(starts[GROUP_FIRST * n + g])
                table = (first, Int32(starts[GROUP_FIRST * n + g + 1]) - first,
                         Int32(starts[GROUP_ROW_SW * n + g]), Int32(starts[GROUP_TWIN_SW * n + g]))

            def store_group_max(c, v, g):
                E.red_max_u32(ac + (Int64(g) * Int64(K) + Int64(c)) * 4, E.canonical_nan_bits(v))
            fold_slab_columns(red, cols, self.warps, warp, lane, tidx, c0, K, E.fmax_nan,
                              store_group_max, groups)
            if cutlass.const_expr(self.padding):
                gx, _, _ = cute.arch.grid_dim()
                self._zero_padding(s, st, table, K, strip, last, ends, bx, gx, lane)
        else:
            def store_max(c, v):
                E.red_max_u32(ac + Int64(c) * 4, E.canonical_nan_bits(v))
            fold_slab_columns(red, cols, self.warps, warp, lane, tidx, c0, K, E.fmax_nan,
                              store_max)

    @cute.kernel
    def tensor_kernel(self, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor, M: Int32,
                      K: Int32):
        """per_tensor: CTA b folds the maxima of tiles b + i P, i < tiles_per_cta (P CTAs), and
        stores its partials amax_r[1 + b], amax_c[1 + b]."""
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        lane = tidx % 32
        warp = tidx // 32
        xbase = x.iterator.toint()
        gx = (K + self.cols_per_cta - 1) // self.cols_per_cta
        tiles = gx * ((M + self.ROWS - 1) // self.ROWS)
        row_max = Float32(0.0)
        col_max = Float32(0.0)
        for i in cutlass.range_constexpr(self.tiles_per_cta):
            t = b + i * n_ctas
            if t < tiles:
                bx, by = t % gx, t // gx
                r0, rows = self._strip(xbase, M, K, bx, by, warp, lane)
                row_max = E.fmax_nan(row_max, self._strip_max(rows))
                cols = self._rht_strip_max(rows, lambda: self._strip(xbase, M, K, bx, by, warp,
                                                                     lane, keep=False)[1])
                col_max = E.fmax_nan(col_max, cutlass.select_(r0 < M, cols, Float32(0.0)))
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((self.warps, 2), stride=(2, 1)), 16)
        part = Int64(1 + b) * 4
        fold_cta_maxima(red, row_max, col_max, self.warps, warp, lane, tidx,
                        amax_r.iterator.toint() + part, amax_c.iterator.toint() + part,
                        atomic=False)
