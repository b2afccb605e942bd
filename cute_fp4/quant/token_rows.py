"""Per-token rowwise cast in the amax pass: each CTA owns whole rows, so it finds a row's amax
and quantizes the row in ONE read of the input (SPEC section 1, per-token scaling).

The per-token rowwise output needs only its own row's amax, which the two-kernel path (K1
``AmaxToken``, then the K2 cast) reads the input twice for. Here a CTA loads a strip of whole
rows into registers, reduces each row's amax across its threads, writes ``amax_r`` and the
rowwise data and scales (compact or 128x4 swizzled, padding zeroed) from the same registers.
Per-token row+col keeps K1 + K2: folding the column maxima into this pass costs one atomic per
(CTA, column), a burst at the end that the L2 serialises (notes/quant.md "Session 20").

Work split: a unit is one 16-element block (32 bytes of bf16/fp16, 64 of fp32: two or four
16-byte loads that cover whole 32-byte sectors). ``tpr`` threads (32..256, a power of two) share
a row, thread t taking units t % tpr + tpr * v, v < ``units``; 256 // tpr rows per pass,
``passes`` passes per strip. A row's amax: ``redux.sync`` per warp (non-negative FP32 orders
like its bits, NaN above +Inf), smem across the row's warps (double-buffered: one barrier per
strip), lanes r < rows-per-strip compute row r's outer scale, shuffled to the row's threads.
Values and NaN policy as ``ref.quantize`` / ``ref.amax_per_token``.

Fast copy (``_cast_strip``): a strip whose rows' outer scales all pass ``E.fast_outer_ok``
(every row's amax 0, +Inf (S_enc = 1) or from ~2^-105 up to ~98k for 16-bit inputs, any finite
one above ~2^-105 for fp32; none NaN) casts its blocks with the reciprocal without its
slow-path branch and, for 16-bit inputs with the software encoder, the codes' signs from the
products' sign bits; other strips take the IEEE copy.

``stochastic``: stochastic rounding (SPEC section 2) from Philox4x32-10 keyed by the int64
[seed, offset] device tensor ``rng``, as CastKernel's rowwise output: one Philox call per block
(stream 0, call = the block's row-major index), encoded by E.sr_encode16; in the fast copy of
16-bit inputs with the signs from the inputs (E.sr_encode16_signed, the same enc >= 2^-14
guarantee). A per-token rowwise-only SR cast (e.g. dy without a weight gradient) otherwise reads
its input twice (K1 + the plain SR cast). ``grouped`` (with stochastic rounding): a grouped
input's rows (ref.quantize_grouped: group g draws stream 2g, its blocks indexed from the group's
first row) from an int32 table of (stream, group's first row) per row.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_fp4.common import encode as E
from cute_fp4.common.philox import philox_call, rng_round_keys
from cute_fp4.common.scales import outer_block_scales, swizzled_scale_offset
from cute_fp4.quant.amax import vec_amax, vec_values

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
THREADS = 256
UNIT = 16  # elements per thread and unit (one block)
MAX_UNITS = 4  # units per thread and row: K <= 256 * 4 * 16 = 16384
STRIP_WORDS = 32  # input words per thread and strip held in registers
MAX_STRIP_ROWS = 32  # lanes r < strip rows compute the rows' outer scales
# CTAs per SM the registers are capped for (64 per thread): ptxas gives the cast 80-102
# registers otherwise, two or three CTAs per SM. Measured (H200, bf16, graphs; 3 / 4 CTAs):
# 4096x8192 29.3 -> 26.7 / 26.0 us, 16384x8192 103.2 -> 92.4 / 89.6, 32768x2048 57.6 -> 51.7
# / 48.8 (notes/quant.md "Session 35").
MIN_CTAS_PER_SM = 4
# The grouped SR kernel's cap (80 registers): 4 CTAs' 64 spilled 40 bytes at K = 2048 and
# 8192. Measured (H200, bf16 grouped N=8 vs one single-tensor SR cast, graphs; 4 / 3 CTAs):
# 4096x2048 1.07 / 0.96x, 8192x2048 1.05 / 1.00, 16384x8192 1.08 / 1.05, 32768x8192 1.04 /
# 1.05 (perf/results/logs/quant_session45_h200.md section 1).
GROUPED_MIN_CTAS_PER_SM = 3


def token_rows_config(k: int, esize: int, swizzle: bool):
    """(threads per row, units per thread and row, passes per strip) of an input with k
    columns of esize bytes, or None when a row does not fit (k > 16384)."""
    units = k // UNIT
    if swizzle:  # the units of the zeroed padding scale columns (up to a multiple of 4)
        units = (k // 16 + 3) // 4 * 4
    per_thread = -(-units // THREADS)
    if per_thread > MAX_UNITS:
        return None
    tpr = THREADS
    if per_thread == 1:
        tpr = 32
        while tpr < units:
            tpr *= 2
    words = per_thread * UNIT * esize // 4
    passes = max(1, STRIP_WORDS // words)
    passes = min(passes, MAX_STRIP_ROWS * tpr // THREADS)
    return tpr, per_thread, passes


class TokenRowCast:
    """Compile-time config: input dtype name, scale layout, the work split (token_rows_config)
    and the grid: ctas_per_sm > 0 is persistent (that many CTAs per SM walk the strips), 0
    launches one CTA per strip."""

    def __init__(self, dtype: str, swizzle: bool, tpr: int, units: int, passes: int,
                 num_sms: int, ctas_per_sm: int = 0, stochastic: bool = False,
                 grouped: bool = False):
        if dtype not in DTYPES:
            raise TypeError(f"TokenRowCast: unsupported input dtype {dtype!r} (bf16, fp16, fp32)")
        if tpr not in (32, 64, 128, 256) or not 1 <= units <= MAX_UNITS or passes < 1:
            raise ValueError(f"TokenRowCast: bad work split tpr={tpr} units={units} "
                             f"passes={passes} (token_rows_config)")
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.swizzle = swizzle
        self.tpr = tpr
        self.units = units
        self.passes = passes
        self.rows_per_pass = THREADS // tpr
        self.strip_rows = passes * self.rows_per_pass
        if self.strip_rows > MAX_STRIP_ROWS:
            raise ValueError(f"TokenRowCast: {self.strip_rows} rows per strip > {MAX_STRIP_ROWS}")
        self.num_sms = num_sms
        self.ctas_per_sm = ctas_per_sm
        self.stochastic = stochastic
        if grouped and not stochastic:
            raise ValueError("TokenRowCast: grouped needs stochastic rounding (the groups' "
                             "Philox streams; rounding to nearest ignores the groups)")
        self.grouped = grouped
        self.words = UNIT * self.esize // 4  # input words per unit
        # registers for MIN_CTAS_PER_SM (grouped GROUPED_MIN_CTAS_PER_SM) CTAs per SM where a
        # thread holds at most STRIP_WORDS input words (the fp32 rows of 3-4 units per thread
        # would spill)
        fits = units * passes * self.words <= STRIP_WORDS
        self.min_ctas = (GROUPED_MIN_CTAS_PER_SM if grouped else MIN_CTAS_PER_SM) if fits else 0

    @cute.jit
    def __call__(self, x: cute.Tensor, amax_r: cute.Tensor, q: cute.Tensor, s: cute.Tensor,
                 rng: Optional[cute.Tensor], row_streams: Optional[cute.Tensor], stream):
        """rng: int64 [seed, offset] of stochastic rounding (None without it); row_streams
        (grouped): int32 [M * 2], row r's Philox stream and its group's first row at 2r, 2r + 1
        (None without grouped)."""
        self.hw = E.has_hw_e2m1()
        # the fast copy's signs in bulk (16-bit inputs): from the inputs for stochastic
        # rounding (software on every arch), else from the products' sign bits with the
        # software encoder
        self.bulk_signs = self.esize == 2 and (self.stochastic or not self.hw)
        M = x.shape[0]
        K = x.shape[1]
        rows = M
        if cutlass.const_expr(self.swizzle):
            rows = (M + 127) // 128 * 128
        n_strips = (rows + self.strip_rows - 1) // self.strip_rows
        grid = n_strips
        if cutlass.const_expr(self.ctas_per_sm > 0):
            grid = cutlass.min(n_strips, self.num_sms * self.ctas_per_sm)
        launch = {}
        if cutlass.const_expr(self.min_ctas > 0):
            launch = {"min_blocks_per_mp": self.min_ctas, "preferred_smem_carveout": 100}
        self.kernel(x, amax_r, q, s, rng, row_streams, M, K, n_strips).launch(
            grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, **launch)

    @cute.kernel
    def kernel(self, x: cute.Tensor, amax_r: cute.Tensor, q: cute.Tensor, s: cute.Tensor,
               rng: Optional[cute.Tensor], row_streams: Optional[cute.Tensor], M: Int32,
               K: Int32, n_strips: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = tidx // 32
        lane = tidx % 32
        tpr = self.tpr
        P = self.rows_per_pass
        R = self.strip_rows
        nw = self.words
        x_base = x.iterator.toint()
        ar_base = amax_r.iterator.toint()
        q_base = q.iterator.toint()
        s_base = s.iterator.toint()
        n_units = K // UNIT
        half_k = Int64(K // 2)
        rows_cover = M
        units_cover = n_units
        if cutlass.const_expr(self.swizzle):
            rows_cover = (M + 127) // 128 * 128
            units_cover = (n_units + 3) // 4 * 4  # the padding scale columns
        prow = tidx // tpr
        tu = tidx % tpr

        smem = cutlass.memory.SmemAllocator()
        # per strip parity, pass and warp: the warp's max of its row in that pass
        red = smem.allocate_tensor(Uint32, cute.make_layout(2 * self.passes * (THREADS // 32)))
        red_base = red.iterator.toint()
        sr = None  # stochastic rounding: (round keys, offset)
        if cutlass.const_expr(self.stochastic):
            sr = rng_round_keys(rng)

        parity = Int32(0)
        for strip in cutlass.range(bidx, n_strips, gdim, unroll=1):
            row0 = strip * R
            data = []  # [pass][unit] -> (words, ok)
            for p in cutlass.range_constexpr(self.passes):
                row = row0 + p * P + prow
                rc = cutlass.min(row, M - 1)
                per_unit = []
                for v in cutlass.range_constexpr(self.units):
                    u = tu + tpr * v
                    ok = (row < M) & (u < n_units)
                    x_off = (Int64(rc) * Int64(K) + Int64(cutlass.min(u, n_units - 1)) * UNIT) \
                        * self.esize
                    words = []
                    for h in cutlass.range_constexpr(nw // 4):
                        words += list(E.ld_global_nc_v4(x_base + x_off + h * 16))
                    words = [Uint32(cutlass.select_(ok, w, Uint32(0))) for w in words]
                    per_unit.append((words, ok))
                data.append(per_unit)

            # grouped: lane l < R loads row l's (Philox stream, group's first row) with the
            # strip's data (its latency hidden by the amax barrier), shuffled per pass like
            # the rows' outer scales (rows past M: the last row's, unused)
            streams_l = None
            if cutlass.const_expr(self.grouped):
                l_rc = cutlass.min(row0 + cutlass.min(lane, R - 1), M - 1)
                streams_l = E.ld_global_v2_s32(row_streams.iterator.toint() + Int64(l_rc) * 8)

            # unit amaxes and the passes' row partials
            uamax = []
            for p in cutlass.range_constexpr(self.passes):
                part = Float32(0.0)
                ua_p = []
                for v in cutlass.range_constexpr(self.units):
                    ua = vec_amax(data[p][v][0], self.dtype_name)
                    ua_p.append(ua)
                    part = E.fmax_nan(part, ua)
                uamax.append(ua_p)
                wmax = E.redux_max_u32(E.f32_bits(part))
                if lane == 0:
                    E.st_shared_u32(red_base + ((parity * self.passes + p) * (THREADS // 32)
                                                + warp) * 4, wmax)
            cute.arch.barrier()

            # lane l < R: row l of the strip (its warps' maxima), its amax and outer scale
            l_row = cutlass.min(lane, R - 1)
            wpr = tpr // 32  # warps per row
            w0 = (parity * self.passes + l_row // P) * (THREADS // 32) + (l_row % P) * wpr
            mx = Uint32(0)
            for i in cutlass.range_constexpr(wpr):
                mx = E.max_u32(mx, E.ld_shared_u32(red_base + (w0 + i) * 4))
            amax_row = E.bits_f32(E.canonical_nan_bits(E.bits_f32(mx)))
            if (warp == 0) & (lane < R) & (row0 + lane < M):
                E.st_global_u32(ar_base + Int64(row0 + lane) * 4, E.f32_bits(amax_row))
            s6_l, sdec_l = outer_block_scales(amax_row, E.E4M3_MAX)
            # the strip's rows (every warp holds all of them) decide the copy for the CTA
            strip = (data, uamax, s6_l, sdec_l, row0 + prow, tu, warp, rows_cover,
                     units_cover, q_base, half_k, s_base, n_units, sr, streams_l)
            if cute.arch.vote_all_sync(E.fast_outer_ok(sdec_l, self.bulk_signs, True)):
                self._cast_strip(*strip, fast=True)
            else:
                self._cast_strip(*strip, fast=False)
            parity = 1 - parity

    @cute.jit
    def _cast_strip(self, data, uamax, s6_l, sdec_l, row_p, tu, warp, rows_cover,
                    units_cover, q_base, half_k, s_base, nsc, sr, streams_l,
                    fast: cutlass.Constexpr):
        """The rowwise data and scales of the strip's loaded units (data: [pass][unit] ->
        (words, in range), uamax their amaxes) with the outer scales of lane r's row r (s6_l,
        sdec_l); row_p: the thread's row in pass 0. fast: every row's sdec passed
        E.fast_outer_ok, so the blocks' enc come from the reciprocal without its slow-path
        branch (whose branch region around every unit kept ptxas from interleaving them) and,
        with bulk_signs, the codes' signs from the products' sign bits, 8 at a time; no enc is
        NaN there (a NaN row amax fails the check; an infinite one has S_enc = 1). sr:
        stochastic rounding's (round keys, offset), or None; streams_l (grouped): lane r's
        row r's (Philox stream, group's first row)."""
        tpr = self.tpr
        P = self.rows_per_pass
        for p in cutlass.range_constexpr(self.passes):
            src = p * P + (warp * 32) // tpr  # the warp's row in pass p
            s6 = cute.arch.shuffle_sync(s6_l, src)
            sdec = cute.arch.shuffle_sync(sdec_l, src)
            row = row_p + p * P
            stream, brow = 0, row  # the row's Philox stream, its blocks' row index
            if cutlass.const_expr(self.grouped):
                stream = cute.arch.shuffle_sync(streams_l[0], src)
                brow = row - cute.arch.shuffle_sync(streams_l[1], src)
            for v in cutlass.range_constexpr(self.units):
                words, ok = data[p][v]
                u = tu + tpr * v
                code, enc = E.block_scale(uamax[p][v], s6, sdec, fast)
                xs = vec_values(words, self.dtype_name)
                if cutlass.const_expr(sr is not None):
                    rnd = philox_call(Int64(brow) * nsc + Int64(u), sr[1], stream, sr[0])
                    if cutlass.const_expr(fast and self.bulk_signs):
                        w0, w1 = E.sr_encode16_signed(xs, enc, rnd,
                                                      *E.input_signs16(words, self.dtype_name))
                    else:
                        w0, w1 = E.sr_encode16(xs, enc, rnd)
                elif cutlass.const_expr(fast and self.bulk_signs):
                    w0 = E.encode8_nonzero_products(xs[:8], enc)
                    w1 = E.encode8_nonzero_products(xs[8:], enc)
                else:
                    w0, w1 = E.encode16(xs, enc, self.hw)
                if ok:
                    E.st_global_v2(q_base + Int64(row) * half_k + Int64(u) * 8, w0, w1)
                if cutlass.const_expr(self.swizzle):
                    if (row < rows_cover) & (u < units_cover):
                        sw = swizzled_scale_offset(row, u, Int32(nsc))
                        E.st_global_u8(s_base + Int64(sw), cutlass.select_(ok, code, Uint32(0)))
                else:
                    if ok:
                        E.st_global_u8(s_base + Int64(row) * nsc + Int64(u), code)
