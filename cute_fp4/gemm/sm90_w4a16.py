"""sm_90 W4A16 GEMM for decode sizes: BF16/FP16 activations x NVFP4 weights, a weight-streaming
kernel on mma.sync tensor cores.

D[m, n] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]), b = e2m1 * e4m3 block
values (SPEC section 3), FP32 accumulation; `transposed` writes D^T instead (D[n, m], the weights'
rows as D's rows: the W4A4 weight-streaming path of `dispatch.gemm_nvfp4` when its B operand is
the small one), with row / col / bias along D's own axes.

Decomposition. The weights [N, K] are the MMA's M side (m16n8k16, 16 weight rows per
fragment), the tokens its N side (8 per fragment). A CTA owns `row_tiles * 16` weight rows for
the whole K and `tile_m` tokens; its `k_warps` warps split K in chunks of 128 (warp w takes
chunks w, w + k_warps, ...), so no global split-K workspace exists: the per-warp FP32 partials
are summed in shared memory and the CTA writes finished outputs. Small CTAs (32 rows) give
N/32 CTAs (256 / 896 for N = 8192 / 28672), several resident per SM, each thread keeping
`unroll` chunks of loads in flight.

Per chunk a thread (quad position t, group g) loads, with 16-byte non-caching loads, the 16
packed bytes (32 values, K range [32t, 32t + 32) of the chunk) of weight rows g and g + 8 of
each row tile, the 2 block scales of each, and 64 bytes of activations of its token(s). The
decode (exact: e2m1 * e4m3 fits BF16 and FP16) produces natural-order K pairs, so MMA step j
uses K values 32t + 4j .. 32t + 4j + 3 on both operands: A regs (row g, pair 2j), (row g + 8,
pair 2j), (row g, pair 2j + 1), (row g + 8, pair 2j + 1); B regs the activation pairs 2j, 2j + 1
(one 8-byte slice of the thread's 64 activation bytes). Rows past N and tokens past M are
clamped (their results are dropped); K past the end is masked to zero on both operands.
BF16 activations use `common.decode` (values * 2**-7); FP16 activations use the FP16 decode
below (e2m1 * e4m3 * 2**-14 is exact in FP16, subnormals included); the epilogue removes the
power of two exactly.

Window64 weights (`window`, K % 64 == 0): b[n, k] also carries the FP32 factor S_dec of its 1x64
window, not exact in a 16-bit operand, so each window's products get accumulators of their own.
A chunk (128 K) is two windows; quad position t then takes K [16t, 16t + 16) of each (one block
per window: two 8-byte weight loads, two scale bytes), so MMA steps 0-3 sum window 0 and steps
4-7 window 1 into two partial tiles, added to the accumulators with the rows' factors in FP32
after the chunk: acc += f0[n] * P0 + f1[n] * P1. The kernel reads the window amaxes and
decodes the factors itself (`decode_outer_scale`, bit-exact; a factors kernel before each call
cost 8.6 us at N = K = 8192 on the H200): quad position t decodes the two windows of row half
t (of 4: 16-row tile t // 2, rows g or g + 8), the quad shares them by shuffles; without the
IEEE slow paths where a warp's vote finds all its amaxes in their fast domain.
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..common.decode import (DECODE_EXP_SHIFT, FP16_DECODE_EXP_SHIFT, decode_e2m1x8,
                             decode_e2m1x8_f16, e4m3_to_bf16x2_scale, e4m3_to_f16x2_scale)
from ..common.jit import KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor, \
    torch_to_cutlass
from ..common.ptx import ld_global, mma_16816, prmt
from ..common.scales import bits_to_f32, decode_outer_scale, outer_fast_ok
from ..ref.formats import FLOAT_DTYPES as OUT_DTYPES
from ..ref.swizzle import swizzled_shape
from .operands import _epilogue
from .parts import EpilogueOperands

CHUNK_K = 128  # K values per warp step: 4 threads x 32


class Sm90GemmW4A16(EpilogueOperands):
    """Compile-time config: activation and output dtypes, tile_m tokens per CTA (8/16/32/64),
    row_tiles (16 weight rows each) per warp, k_warps (warps splitting K), row_warps (warps
    side by side along N: a CTA owns row_warps * row_tiles * 16 weight rows and reads each
    activation chunk once for all of them), unroll (chunks per pipeline stage), wide (K % 32
    == 0: 16-byte weight loads and 2-byte scale loads; else per-block 8-byte / 1-byte loads),
    swizzled scales, which epilogue operands exist, transposed (D^T), window (window64
    weights). `__call__` takes a [M, K], packed b [N, K/2] uint8, scales as a flat uint8 tensor
    (compact [N, K/16] or swizzled), d [M, N] ([N, M] when transposed), optional alpha [1],
    row [rows of d], col [columns of d], bias [columns of d] and, with `window`, the weights'
    window amaxes (FP32 [N, K/64], contiguous); `window` is their recipe's e4m3_max (448 or
    256), 0 for other weights."""

    def __init__(self, act_dtype: Type[cutlass.Numeric], out_dtype: Type[cutlass.Numeric], *,
                 tile_m: int = 8, row_tiles: int = 2, k_warps: int = 8, unroll: int = 1,
                 row_warps: int = 1, wide: bool = True, swizzled: bool = False,
                 has_alpha: bool = False, has_row: bool = False, has_col: bool = False,
                 has_bias: bool = False, transposed: bool = False, decode=(None, None, None),
                 window: int = 0):
        if act_dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"activations must be BFloat16 or Float16, got {act_dtype}")
        if tile_m not in (8, 16, 32, 64):
            raise ValueError(f"tile_m must be 8, 16, 32 or 64, got {tile_m}")
        if row_tiles < 1 or k_warps < 1 or unroll < 1 or row_warps < 1:
            raise ValueError("row_tiles, k_warps, unroll and row_warps must be positive")
        if k_warps * row_warps > 32:
            raise ValueError(f"k_warps * row_warps must be at most 32 (1024 threads), got "
                             f"{k_warps} * {row_warps}")
        self.fp16 = act_dtype is cutlass.Float16
        self.out_dtype = out_dtype
        self.tile_m = tile_m
        self.row_tiles = row_tiles
        self.k_warps = k_warps
        self.row_warps = row_warps
        self.unroll = unroll
        self.wide = wide
        self.swizzled = swizzled
        self.set_epilogue_flags(has_alpha, has_row, has_col, has_bias, decode)
        self.transposed = transposed
        if window not in (0, 448, 256):
            raise ValueError(f"window must be 0 or a window64 e4m3_max (448, 256), got {window}")
        if window and not wide:
            raise ValueError("window64 weights need K % 64 == 0 (wide)")
        if window and row_tiles > 2:
            raise ValueError(f"window64 weights take row_tiles 1 or 2 (one row half of amaxes "
                             f"per quad position), got {row_tiles}")
        self.window = window
        # up to 16 tokens the decode keeps its cheap K order (v_i, v_{i+4}) and the
        # activations are permuted to match (4 byte permutes per 8 activations of a token
        # tile instead of 4 per 8 weights); beyond, permuting the weights is cheaper
        self.natural_order = tile_m > 16
        # Loading the next stage's weights before decoding the current one holds 10 more
        # registers per 16 rows and chunk: a gain at tile_m 8, a loss (spills, fewer resident
        # warps) with the larger activation fragments (H100 sweep, notes/gemm_w4a16.md).
        self.prefetch = tile_m == 8 and not window
        # Register budget: two CTAs of up to 256 threads per SM (ptxas then keeps at most 128
        # registers) where the accumulators are small; otherwise ptxas chooses (tile_m 64
        # needs 64 accumulator registers alone).
        threads = 32 * k_warps * row_warps
        self.min_blocks = 2 if tile_m <= 16 and threads <= 256 else 1
        red_bytes = (row_warps * row_tiles * 16 + 1) * tile_m * k_warps * 4
        # shared memory carveout (percent of the SM's 228 KiB) for min_blocks CTAs, the rest
        # stays L1 for the activations
        self.smem_carveout = min(
            100, -(-100 * self.min_blocks * (red_bytes + 1024) // (228 * 1024)))
        shift = FP16_DECODE_EXP_SHIFT if self.fp16 else DECODE_EXP_SHIFT
        self.acc_unscale = float(2 ** shift)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mSF: cute.Tensor, mD: cute.Tensor,
                 mAlpha: Optional[cute.Tensor], mRow: Optional[cute.Tensor],
                 mCol: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                 mWin: Optional[cute.Tensor], stream: cuda.CUstream):
        rows = self.row_warps * self.row_tiles * 16
        # token stride rows + 1 (odd): a warp reading 32 tokens of one row (the transposed
        # epilogue) hits 32 banks, one reading 32 rows of one token too
        red_layout = cute.make_layout((rows, self.tile_m, self.k_warps),
                                      stride=(1, rows + 1, (rows + 1) * self.tile_m))

        @cute.struct
        class SharedStorage:
            red: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(red_layout)], 16]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(mB.shape[0], rows), cute.ceil_div(mA.shape[0], self.tile_m), 1)
        self.kernel(mA, mB, mSF, mD, (mAlpha, mRow, mCol, mBias), mWin, red_layout).launch(
            grid=grid, block=[32 * self.k_warps * self.row_warps, 1, 1], stream=stream,
            min_blocks_per_mp=self.min_blocks, preferred_smem_carveout=self.smem_carveout)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mSF: cute.Tensor, mD: cute.Tensor,
               epi: tuple, mWin: Optional[cute.Tensor], red_layout: cute.Layout):
        RT = self.row_tiles
        NT = self.tile_m // 8
        KW = self.k_warps
        UNR = self.unroll
        tidx, _, _ = cute.arch.thread_idx()
        bn, bm, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        wk = warp % KW
        wr = warp // KW
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        m_rows = mA.shape[0]
        k = mA.shape[1]
        n_rows = mB.shape[0]
        kh = k // 2
        ks = k // 16
        rows = self.row_warps * RT * 16
        n0 = bn * rows + wr * (RT * 16)
        m0 = bm * self.tile_m

        # per-thread row / token base addresses (clamped rows and tokens: results dropped)
        b_base = mB.iterator.toint()
        a_base = mA.iterator.toint()
        sf_base = mSF.iterator.toint()
        tiles_per_row = (ks + 3) // 4
        # a thread's first weight byte and activation of a chunk: 32 values at 32t, or with
        # `window` 16 at 16t (and 16 more one window later)
        span = 16 if const_expr(self.window) else 32
        b_addr = []
        sf_addr = []
        for rt in cutlass.range_constexpr(RT):
            for h in cutlass.range_constexpr(2):
                row = cutlass.min(n0 + rt * 16 + h * 8 + g, n_rows - 1)
                b_addr.append(b_base + Int64(row) * Int64(kh) + Int64(t * (span // 2)))
                if const_expr(self.swizzled):
                    rr = row % 128
                    part = ((row // 128) * tiles_per_row * 512 + (rr % 32) * 16
                            + (rr // 32) * 4)
                    sf_addr.append(sf_base + Int64(part))
                else:
                    sf_addr.append(sf_base + Int64(row) * Int64(ks))
        # the window amax row this thread decodes: row half t (the last one where fewer exist)
        win_addr = None
        if const_expr(self.window):
            i = cutlass.min(t, 2 * RT - 1)
            row = cutlass.min(n0 + (i // 2) * 16 + (i % 2) * 8 + g, n_rows - 1)
            win_addr = mWin.iterator.toint() + Int64(row) * Int64(k // 64 * 4)
        a_addr = []
        for nt in cutlass.range_constexpr(NT):
            tok = cutlass.min(m0 + nt * 8 + g, m_rows - 1)
            a_addr.append(a_base + Int64(tok) * Int64(k * 2) + Int64(t * span * 2))

        acc = cute.make_rmem_tensor((4, NT, RT), Float32)
        acc.fill(0.0)
        # Stages of UNR chunks per warp (chunk c = (stage * UNR + u) * KW + wk). Stages whose
        # chunks are all complete run unpredicated (with `prefetch`, the next stage's weights
        # and scales are loaded before this one is decoded); the last, partial stage (if any)
        # is masked.
        words = self._words()
        stage_chunks = KW * UNR
        full_stages = (k // CHUNK_K) // stage_chunks
        buf = cute.make_rmem_tensor((words * UNR,), Int32)
        addrs = (b_addr, sf_addr, win_addr)
        if const_expr(self.prefetch):
            if full_stages > 0:
                self._load_stage(buf, addrs, 0, wk, t, k, False)
                for st in cutlass.range(full_stages - 1, unroll=1):
                    cur = [buf[i] for i in range(words * UNR)]
                    self._load_stage(buf, addrs, st + 1, wk, t, k, False)
                    self._compute_stage(acc, cur, a_addr, st, wk, t, k, False)
                cur = [buf[i] for i in range(words * UNR)]
                self._compute_stage(acc, cur, a_addr, full_stages - 1, wk, t, k, False)
        else:
            for st in cutlass.range(full_stages, unroll=1):
                self._load_stage(buf, addrs, st, wk, t, k, False)
                cur = [buf[i] for i in range(words * UNR)]
                self._compute_stage(acc, cur, a_addr, st, wk, t, k, False)
        if full_stages * stage_chunks * CHUNK_K < k:
            self._load_stage(buf, addrs, full_stages, wk, t, k, True)
            cur = [buf[i] for i in range(words * UNR)]
            self._compute_stage(acc, cur, a_addr, full_stages, wk, t, k, True)

        # sum the k_warps partials in shared memory, then the epilogue
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        red = storage.red.get_tensor(red_layout)
        for rt in cutlass.range_constexpr(RT):
            for nt in cutlass.range_constexpr(NT):
                for e in cutlass.range_constexpr(4):
                    r = wr * (RT * 16) + rt * 16 + g + 8 * (e // 2)
                    tok = nt * 8 + t * 2 + e % 2
                    red[r, tok, wk] = acc[e, nt, rt]
        cute.arch.sync_threads()
        scale = self.acc_scale(self.acc_unscale, epi)
        n_cta = bn * rows
        for idx in cutlass.range(tidx, rows * self.tile_m, KW * self.row_warps * 32, unroll=1):
            # consecutive threads take consecutive columns of D: weight rows, or tokens when
            # D is transposed
            if const_expr(self.transposed):
                tok = idx % self.tile_m
                r = idx // self.tile_m
            else:
                r = idx % rows
                tok = idx // rows
            n = n_cta + r
            m = m0 + tok
            if n < n_rows and m < m_rows:
                v = red[r, tok, 0]
                for wi in cutlass.range_constexpr(1, KW):
                    v = v + red[r, tok, wi]
                # ref.gemm's order: ((acc * alpha) * row) * col + bias, along D's axes
                d_row, d_col = (n, m) if self.transposed else (m, n)
                mD[d_row, d_col] = self.apply_operands(v * scale, d_row, d_col,
                                                       epi).to(self.out_dtype)

    def _words(self):
        """Words per chunk in a stage buffer: per row half 4 packed words and a scale pair,
        with `window` then the two window amaxes (FP32 bits) of the row half it decodes."""
        return 5 * 2 * self.row_tiles + (2 if self.window else 0)

    def _chunk_preds(self, c, t, k, predicated):
        """K-valid predicates of the two 16-value blocks of chunk c of quad position t (K
        32t + 16j, or with `window` 16t + 64j), or (None, None) for a complete chunk."""
        if not predicated:
            return None, None
        if const_expr(self.window):  # K % 64 == 0: a chunk holds 0, 1 or 2 whole windows
            kk = c * CHUNK_K
            return Int32(kk + 64 <= k), Int32(kk + 128 <= k)
        kk = c * CHUNK_K + t * 32
        return Int32(kk + 16 <= k), Int32(kk + 32 <= k)

    def _load_stage(self, buf, addrs, stage, wk, t, k, predicated):
        """Weights and block-scale pairs of the stage's UNR chunks into buf (per chunk: 4
        words per row half, then one scale pair per row half, then with `window` the two
        window amaxes of the row half this thread decodes). addrs: the per-row-half weight
        and scale addresses and the window amax row address."""
        b_addr, sf_addr, win_addr = addrs
        RT2 = 2 * self.row_tiles
        words = self._words()
        for u in range(self.unroll):
            c = (stage * self.unroll + u) * self.k_warps + wk
            v0, v1 = self._chunk_preds(c, t, k, predicated)
            # this thread's two blocks: adjacent, or with `window` one per window
            kb = c * 8 + t if const_expr(self.window) else c * 8 + t * 2
            for i in range(RT2):
                off = Int64(c * (CHUNK_K // 2))
                # weights are read once: not allocated in L1; L2 fetches 256 bytes around
                # each access (the warp reads 64 bytes of a row, the next warps the rest)
                if const_expr(self.window):
                    lo = ld_global(b_addr[i] + off, 2, ty="u32", nc=True, no_allocate=True,
                                   l2_prefetch=256, pred=v0, volatile=False)
                    hi = ld_global(b_addr[i] + off + Int64(CHUNK_K // 4), 2, ty="u32",
                                   nc=True, no_allocate=True, l2_prefetch=256, pred=v1,
                                   volatile=False)
                    w = (lo[0], lo[1], hi[0], hi[1])
                elif const_expr(self.wide):
                    w = ld_global(b_addr[i] + off, 4, ty="u32", nc=True, no_allocate=True,
                                  l2_prefetch=256, pred=v0, volatile=False)
                else:
                    lo = ld_global(b_addr[i] + off, 2, ty="u32", nc=True, no_allocate=True,
                                   l2_prefetch=256, pred=v0, volatile=False)
                    hi = ld_global(b_addr[i] + off + Int64(8), 2, ty="u32", nc=True,
                                   no_allocate=True, l2_prefetch=256, pred=v1,
                                   volatile=False)
                    w = (lo[0], lo[1], hi[0], hi[1])
                for q in range(4):
                    buf[u * words + 4 * i + q] = w[q]
                if const_expr(self.swizzled):
                    sfo = sf_addr[i] + Int64((kb // 4) * 512 + kb % 4)
                else:
                    sfo = sf_addr[i] + Int64(kb)
                if const_expr(self.wide and not self.window):
                    sf = ld_global(sfo, ty="u16", nc=True, pred=v0, volatile=False)
                else:
                    # the second block: the next byte, or with `window` the same position one
                    # 4-block group later (kb + 4)
                    step = (512 if self.swizzled else 4) if self.window else 1
                    sf = (ld_global(sfo, ty="u8", nc=True, pred=v0, volatile=False)
                          | (ld_global(sfo + Int64(step), ty="u8", nc=True, pred=v1,
                                       volatile=False) << 8))
                buf[u * words + 4 * RT2 + i] = sf
            if const_expr(self.window):
                wo = win_addr + Int64(c * 8)  # windows 2c, 2c + 1
                buf[u * words + 5 * RT2] = ld_global(wo, ty="u32", nc=True, pred=v0,
                                                     volatile=False)
                buf[u * words + 5 * RT2 + 1] = ld_global(wo + Int64(4), ty="u32", nc=True,
                                                         pred=v1, volatile=False)

    def _activations(self, a_addr, c, t, k, predicated):
        """This thread's 16 activation words (K 32t .. 32t + 31 of chunk c, or with `window`
        16t .. 16t + 15 and 64 + 16t .. 64 + 16t + 15) per token tile, in the decode's K
        order: natural, or per 8 values (x0, x4), (x1, x5), (x2, x6), (x3, x7)."""
        v0, v1 = self._chunk_preds(c, t, k, predicated)
        # the second block's activations: the next 16, or with `window` one window later
        second = CHUNK_K if const_expr(self.window) else 32
        x = []
        for nt in range(len(a_addr)):
            base = a_addr[nt] + Int64(c * (CHUNK_K * 2))
            xs = []
            for q in range(4):
                xs += list(ld_global(base + Int64((q // 2) * second + (q % 2) * 16), 4,
                                     ty="u32", nc=True, pred=v0 if q < 2 else v1,
                                     volatile=False))
            if const_expr(not self.natural_order):
                perm = []
                for q in range(4):
                    perm += [prmt(xs[4 * q], xs[4 * q + 2], sel=0x5410),
                             prmt(xs[4 * q], xs[4 * q + 2], sel=0x7632),
                             prmt(xs[4 * q + 1], xs[4 * q + 3], sel=0x5410),
                             prmt(xs[4 * q + 1], xs[4 * q + 3], sel=0x7632)]
                xs = perm
            x.append(xs)
        return x

    def _compute_stage(self, acc, cur, a_addr, stage, wk, t, k, predicated):
        """Decode the stage's weights (from `cur`, the values `_load_stage` stored), load the
        activations, and accumulate the MMAs."""
        RT = self.row_tiles
        RT2 = 2 * RT
        words = self._words()
        for u in range(self.unroll):
            c = (stage * self.unroll + u) * self.k_warps + wk
            x = self._activations(a_addr, c, t, k, predicated)
            if const_expr(self.window):
                factors = self._window_factors(cur[u * words + 5 * RT2],
                                               cur[u * words + 5 * RT2 + 1], t)
            for rt in range(RT):
                dec = []
                for h in range(2):
                    i = rt * 2 + h
                    w = cur[u * words + 4 * i:u * words + 4 * i + 4]
                    sf = cur[u * words + 4 * RT2 + i]
                    pairs = []
                    for blk in range(2):
                        byte = (sf >> (8 * blk)) & 0xFF
                        if const_expr(self.fp16):
                            sc = e4m3_to_f16x2_scale(byte)
                            pairs += list(decode_e2m1x8_f16(w[2 * blk], sc,
                                                            self.natural_order))
                            pairs += list(decode_e2m1x8_f16(w[2 * blk + 1], sc,
                                                            self.natural_order))
                        else:
                            sc = e4m3_to_bf16x2_scale(byte)
                            pairs += list(decode_e2m1x8(w[2 * blk], sc, self.natural_order))
                            pairs += list(decode_e2m1x8(w[2 * blk + 1], sc,
                                                        self.natural_order))
                    dec.append(pairs)
                if const_expr(self.window):
                    for nt in range(len(a_addr)):
                        for blk in range(2):  # MMA steps 4 blk .. 4 blk + 3: window blk
                            part = (Float32(0.0),) * 4
                            for j in range(4 * blk, 4 * blk + 4):
                                part = mma_16816(self._a_frag(dec, j),
                                                 (x[nt][2 * j], x[nt][2 * j + 1]), part,
                                                 fp16=self.fp16)
                            for e in range(4):
                                f = factors[2 * (rt * 2 + e // 2) + blk]
                                acc[e, nt, rt] = acc[e, nt, rt] + f * part[e]
                else:
                    for j in range(8):
                        for nt in range(len(a_addr)):
                            b_frag = (x[nt][2 * j], x[nt][2 * j + 1])
                            cur_acc = (acc[0, nt, rt], acc[1, nt, rt], acc[2, nt, rt],
                                       acc[3, nt, rt])
                            d = mma_16816(self._a_frag(dec, j), b_frag, cur_acc,
                                          fp16=self.fp16)
                            for e in range(4):
                                acc[e, nt, rt] = d[e]

    @cute.jit
    def _window_factors(self, bits0: Int32, bits1: Int32, t: Int32):
        """The chunk's window factors S_dec of every row half i and window w at index 2 i + w,
        from the window amaxes of row half t this thread loaded (`_load_stage`): each quad
        position decodes its two, the quad shares them. The decode without the IEEE
        division's and reciprocal's slow-path branches where the warp's amaxes allow it
        (bit-exact there, `outer_fast_ok`), else with them (a branch each)."""
        a0, a1 = bits_to_f32(bits0), bits_to_f32(bits1)
        f0 = decode_outer_scale(a0, self.window, True)
        f1 = decode_outer_scale(a1, self.window, True)
        if not cute.arch.vote_all_sync(outer_fast_ok(a0) & outer_fast_ok(a1)):
            f0 = decode_outer_scale(a0, self.window)
            f1 = decode_outer_scale(a1, self.window)
        quad = cute.arch.lane_idx() - t  # lane of quad position 0
        return [cute.arch.shuffle_sync(f0 if w == 0 else f1, quad + i)
                for i in range(2 * self.row_tiles) for w in range(2)]

    @staticmethod
    def _a_frag(dec, j):
        """The A fragment of MMA step j from the decoded pairs of the two row halves."""
        return dec[0][2 * j], dec[1][2 * j], dec[0][2 * j + 1], dec[1][2 * j + 1]


ACT_DTYPES = (torch.bfloat16, torch.float16)


def pick_w4a16_config(m: int, n: int, window: bool = False):
    """(tile_m, row_tiles, k_warps, unroll, row_warps) for M tokens and N weight rows: the
    smallest token tile that holds M (64 for larger M, one grid row per 64 tokens), 32 weight
    rows x 8 K-warps per CTA, one chunk per stage; up to 16 tokens and N > 16384, 4 K-warps
    (H100 sweep with the L2 prefetch hint, notes/gemm_w4a16.md session 8: 1 x 28672 x 8192
    50.2-50.6 us vs 51.8-53.7 for the other configurations, 16 x 28672 66.4-67.2 vs 68-70).
    Window64 weights (H200 sweep, perf/results/logs/w4a16_window_session55_h200.md): 8
    K-warps at every N; at 64 tokens 16 weight rows x 4 K-warps (64.7 / 209 us at N = 8192 /
    28672 against 74.6 / 251 for 32 x 8; 32 rows spill)."""
    tile_m = next((tm for tm in (8, 16, 32) if m <= tm), 64)
    if window:
        return (64, 1, 4, 1, 1) if tile_m == 64 else (tile_m, 2, 8, 1, 1)
    if tile_m <= 16 and n > 16384:
        return tile_m, 2, 4, 1, 1
    return tile_m, 2, 8, 1, 1


def w4a16_kernel(act_dtype=torch.bfloat16, out_dtype=torch.bfloat16, *, tile_m=8, row_tiles=2,
                 k_warps=8, unroll=1, row_warps=1, wide=True, swizzled=False,
                 flags=(False, False, False), bias_dtype=None, has_row=False,
                 transposed=False, decode=(None, None, None), window=0):
    """(op, *fake_args) of one W4A16 configuration, for compiling (host calls and tests).
    flags = (has_alpha, has_col, has_bias); has_row adds the per-row vector of D,
    transposed makes D [N, M] (row [N], col and bias [M]); decode: which of alpha, row, col
    hold outer amaxes (parts.EpilogueOperands); window: the e4m3_max of window64 weights
    (their window amaxes the last tensor argument), 0 for others."""
    import cutlass

    has_alpha, has_col, has_bias = flags
    op = Sm90GemmW4A16(torch_to_cutlass(act_dtype), torch_to_cutlass(out_dtype), tile_m=tile_m,
                       row_tiles=row_tiles, k_warps=k_warps, unroll=unroll,
                       row_warps=row_warps, wide=wide, swizzled=swizzled,
                       has_alpha=has_alpha, has_row=has_row, has_col=has_col,
                       has_bias=has_bias, transposed=transposed, decode=decode, window=window)
    m, n = dyn(), dyn()
    d_rows, d_cols = (n, m) if transposed else (m, n)
    args = (
        fake_tensor(torch_to_cutlass(act_dtype), (m, dyn(32 if wide else 16))),
        fake_tensor(cutlass.Uint8, (n, dyn(16 if wide else 8))),
        fake_tensor(cutlass.Uint8, (dyn(),), align=2 if (wide or swizzled) else 1),
        fake_tensor(torch_to_cutlass(out_dtype), (d_rows, d_cols),
                    align=4 if out_dtype == torch.float32 else 2),
        fake_tensor(cutlass.Float32, (1,), align=4) if has_alpha else None,
        fake_tensor(cutlass.Float32, (d_rows,), align=4) if has_row else None,
        fake_tensor(cutlass.Float32, (d_cols,), align=4) if has_col else None,
        fake_tensor(torch_to_cutlass(bias_dtype), (d_cols,), align=2) if has_bias else None,
        fake_tensor(cutlass.Float32, (n, dyn()), align=4) if window else None,
        env_stream(),
    )
    return op, args


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


def gemm_w4a16_sm90(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor, *,
                    alpha: Optional[torch.Tensor] = None, row: Optional[torch.Tensor] = None,
                    col: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                    out_dtype: torch.dtype = torch.bfloat16, scales_swizzled: bool = False,
                    out: Optional[torch.Tensor] = None, config: Optional[tuple] = None,
                    transposed: bool = False) -> torch.Tensor:
    """D[M, N] = cast(alpha * row[m] * col[n] * sum_k a[m, k] * b[n, k] + bias[n]) on sm_90a.

    a: BF16/FP16 activations [M, K], contiguous. b_data: packed E2M1 weights uint8 [N, K/2]
    (even element in the low nibble), contiguous. b_scales: E4M3 block scales, compact
    [N, K/16] or swizzled (SPEC 1) when scales_swizzled. alpha: FP32 [1] device tensor; row:
    [M]; col: [N] (alpha / row / col may be `operands.OuterAmax`: outer amaxes the kernel
    turns into their decode scales); bias: [N] of out_dtype or float32. FP32 accumulation and epilogue, in
    ref.gemm's order. `transposed` computes D^T [N, M] instead (D^T[n, m] = cast(alpha *
    row[n] * col[m] * sum_k a[m, k] * b[n, k] + bias[m]): row / col / bias follow the output's
    rows and columns). `out` (contiguous, of the output's shape and out_dtype) receives the
    result; `config` = (tile_m, row_tiles, k_warps, unroll, row_warps) overrides
    `pick_w4a16_config` (benchmarks). Built for decode sizes (M <= 64); larger M runs one grid
    row per 64 tokens, re-reading the weights for each (correct, not fast)."""
    if not isinstance(a, torch.Tensor) or a.dtype not in ACT_DTYPES or a.dim() != 2:
        raise TypeError(f"a must be a 2D bfloat16/float16 tensor, got "
                        f"{getattr(a, 'dtype', type(a))} {tuple(getattr(a, 'shape', ()))}")
    if b_data.dtype != torch.uint8 or b_data.dim() != 2:
        raise TypeError(f"b_data must be a 2D uint8 tensor [N, K/2], got {b_data.dtype} "
                        f"{tuple(b_data.shape)}")
    if b_scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"b_scales must be float8_e4m3fn, got {b_scales.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if not a.is_contiguous() or not b_data.is_contiguous():
        raise ValueError("a and b_data must be contiguous")
    m, k = a.shape
    n = b_data.shape[0]
    if k != 2 * b_data.shape[1]:
        raise ValueError(f"K mismatch: a is {tuple(a.shape)}, b_data is {tuple(b_data.shape)}")
    if k % 16 or k == 0:
        raise ValueError(f"K must be a positive multiple of 16, got {k}")
    device = a.device
    if device.type != "cuda" or b_data.device != device or b_scales.device != device:
        raise ValueError("a, b_data and b_scales must be on one CUDA device")
    if scales_swizzled:
        pr, pc = swizzled_shape(n, k // 16)
        if b_scales.numel() != pr * pc:
            raise ValueError(f"swizzled b_scales for [{n}, {k // 16}] need {pr * pc} bytes "
                             f"([{pr}, {pc}]), got {tuple(b_scales.shape)}")
    elif tuple(b_scales.shape) != (n, k // 16):
        raise ValueError(f"b_scales must be [{n}, {k // 16}], got {tuple(b_scales.shape)}")
    sf = b_scales.contiguous().view(torch.uint8).reshape(-1)
    if alpha is not None and isinstance(alpha, torch.Tensor) and alpha.dtype != torch.float32:
        raise TypeError(f"alpha must be float32, got {alpha.dtype}")
    d_rows, d_cols = (n, m) if transposed else (m, n)
    alpha, row, col, bias, decode = _epilogue(alpha, row, col, bias, d_rows, d_cols, out_dtype,
                                              device)
    if out is None:
        out = torch.empty((d_rows, d_cols), dtype=out_dtype, device=device)
    elif (out.dtype != out_dtype or tuple(out.shape) != (d_rows, d_cols)
          or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{d_rows}, {d_cols}] {out_dtype} tensor")
    if m == 0 or n == 0:
        return out
    arch = device_arch(device)
    if arch != "sm_90a":
        raise NotImplementedError(f"gemm_w4a16_sm90 needs an sm_90a device (device is {arch})")
    return launch_w4a16(a, b_data, sf, out, alpha, row, col, bias, swizzled=scales_swizzled,
                        transposed=transposed, arch=arch, config=config, decode=decode)


def launch_w4a16(a, b_data, sf, out, alpha, row, col, bias, *, swizzled: bool,
                 transposed: bool, arch: str, config: Optional[tuple] = None,
                 decode=(None, None, None), window_amax: Optional[torch.Tensor] = None,
                 e4m3_max: int = 448) -> torch.Tensor:
    """The launch behind `gemm_w4a16_sm90`, for operands it (or `dispatch.gemm_nvfp4`) has
    checked: contiguous a [M, K] and b_data [N, K/2] (realigned here when needed), flat uint8
    scales `sf`, out of the output's shape, epilogue vectors and `decode` as
    `operands._epilogue` returns them, window64 weights' window amaxes (FP32 [N, K/64],
    contiguous; K % 64 == 0) with their e4m3_max, or None; M, N > 0."""
    flags = (alpha is not None, col is not None, bias is not None)
    fn = w4a16_launcher(a.dtype, out.dtype, a.shape[0], b_data.shape[0], a.shape[1], flags,
                        bias.dtype if bias is not None else None, has_row=row is not None,
                        transposed=transposed, swizzled=swizzled, arch=arch, config=config,
                        decode=decode, window=0 if window_amax is None else e4m3_max)
    fn(_aligned(a), _aligned(b_data), sf, out, alpha, row, col, bias, window_amax)
    return out


def w4a16_launcher(act_dtype: torch.dtype, out_dtype: torch.dtype, m: int, n: int, k: int,
                   flags, bias_dtype, *, has_row: bool, transposed: bool, swizzled: bool,
                   arch: str, config: Optional[tuple] = None, decode=(None, None, None),
                   window: int = 0):
    """The compiled Sm90GemmW4A16 (its TVM-FFI function) that `launch_w4a16` calls for M
    tokens x N weight rows x K: `pick_w4a16_config`'s configuration unless `config` is given.
    flags = (has_alpha, has_col, has_bias); window: the e4m3_max of window64 weights, 0 for
    others. Called with (a, b_data, sf, out, alpha, row, col, bias, window amaxes or None)."""
    tile_m, row_tiles, k_warps, unroll, row_warps = config or pick_w4a16_config(m, n,
                                                                                bool(window))
    wide = k % 32 == 0
    has_row, transposed, swizzled = bool(has_row), bool(transposed), bool(swizzled)
    key = ("gemm_w4a16_sm90", act_dtype, out_dtype, tile_m, row_tiles, k_warps, unroll,
           row_warps, wide, swizzled, flags, bias_dtype, has_row, transposed, decode,
           window)

    def build():
        op, args = w4a16_kernel(act_dtype, out_dtype, tile_m=tile_m, row_tiles=row_tiles,
                                k_warps=k_warps, unroll=unroll, row_warps=row_warps,
                                wide=wide, swizzled=swizzled, flags=flags,
                                bias_dtype=bias_dtype, has_row=has_row, transposed=transposed,
                                decode=decode, window=window)
        return compile_kernel(op, *args, arch=arch)

    return KERNELS.ffi(key, build)
