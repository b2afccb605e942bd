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

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cute_fp4.common import encode as E
from cute_fp4.common.ptx import l2_policy, ld_global

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


def vec_values(words, dtype_name):
    """The FP32 values of one 16-byte vector (four 32-bit words): 4 fp32 or 8 bf16/fp16
    elements, in memory order (exact conversions)."""
    if dtype_name == "fp32":
        return [E.bits_f32(w) for w in words]
    vals = []
    for w in words:
        vals += [E.unpack_lo(w, dtype_name), E.unpack_hi(w, dtype_name)]
    return vals


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
    """amax[1 + cta] = max |x| over the grid-stride share of CTA ``cta`` (see the module doc)."""

    def __init__(self, dtype: str, num_sms: int, l2_keep: int = 0):
        if dtype not in DTYPES:
            raise TypeError(f"AmaxTensor: unsupported input dtype {dtype!r}")
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.num_sms = num_sms
        self.l2_keep = l2_keep

    @cute.jit
    def __call__(self, x: cute.Tensor, amax: cute.Tensor, stream):
        nvec = x.shape[0] * (x.shape[1] * self.esize // 16)
        blocks = cutlass.max(cutlass.min((nvec + THREADS - 1) // THREADS,
                                         max_tensor_partials(self.num_sms)), 1)
        self.kernel(x, amax, nvec).launch(grid=(blocks, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, amax: cute.Tensor, nvec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        base = x.iterator.toint()
        acc = Float32(0.0)
        start = bidx * THREADS + tidx
        step = gdim * THREADS
        policies = keep_policies(self.l2_keep, Int64(nvec) * 16)
        for i in cutlass.range(start, nvec, step, unroll=2):
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


class AmaxToken:
    """K1: amax_r[m] = max_k |x[m, k]| and amax_c[k] = max_m |x[m, k]| in one pass.

    CTA tile: rows_per_cta rows (64 by default) x (32 lanes * one 16-byte vector) columns; warp
    w reads rows w, w+8, ... Row maxima: warp shuffle reduction, one atomic per (row, CTA).
    Column maxima: registers across the CTA's rows, then smem across warps, one atomic per
    (column, CTA): more rows per CTA mean fewer column atomics and fewer CTAs."""

    warps = 8

    def __init__(self, dtype: str, l2_keep: int = 0, rows_per_cta: int = 64):
        if dtype not in DTYPES:
            raise TypeError(f"AmaxToken: unsupported input dtype {dtype!r}")
        if rows_per_cta <= 0 or rows_per_cta % self.warps:
            raise ValueError(f"AmaxToken: rows_per_cta must be a positive multiple of "
                             f"{self.warps}, got {rows_per_cta}")
        self.rows_per_cta = rows_per_cta
        self.dtype_name = dtype
        self.esize = DTYPES[dtype].width // 8
        self.l2_keep = l2_keep
        self.vec = 16 // self.esize  # elements per 16-byte vector
        self.cols_per_cta = 32 * self.vec

    @cute.jit
    def __call__(self, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor, stream):
        M = x.shape[0]
        K = x.shape[1]
        grid = ((K + self.cols_per_cta - 1) // self.cols_per_cta,
                (M + self.rows_per_cta - 1) // self.rows_per_cta, 1)
        self.kernel(x, amax_r, amax_c, M, K).launch(grid=grid, block=(32 * self.warps, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, amax_r: cute.Tensor, amax_c: cute.Tensor, M: Int32, K: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        base = x.iterator.toint()
        ar = amax_r.iterator.toint()
        ac = amax_c.iterator.toint()
        col0 = bx * self.cols_per_cta + lane * self.vec
        col_ok = col0 < K
        cols = [Float32(0.0)] * self.vec
        policies = keep_policies(self.l2_keep, Int64(M) * Int64(K) * self.esize)
        for i in cutlass.range_constexpr(self.rows_per_cta // self.warps):
            r = by * self.rows_per_cta + warp + i * self.warps
            row_ok = r < M
            ok = row_ok & col_ok
            rc = cutlass.min(r, M - 1)
            cc = cutlass.min(col0, K - self.vec)
            words = keep_load(base, (Int64(rc) * Int64(K) + Int64(cc)) * self.esize, policies)
            vals = vec_values([Uint32(cutlass.select_(ok, w, Uint32(0))) for w in words],
                              self.dtype_name)
            rmax = Float32(0.0)
            for j in cutlass.range_constexpr(self.vec):
                rmax = E.abs_max_nan(rmax, vals[j])
                cols[j] = E.abs_max_nan(cols[j], vals[j])
            rmax = E.warp_max_nan(rmax)
            if row_ok & (lane == 0):
                E.red_max_u32(ar + Int64(r) * 4, E.canonical_nan_bits(rmax))
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout((self.warps, self.cols_per_cta), stride=(self.cols_per_cta, 1)))
        for j in cutlass.range_constexpr(self.vec):
            red[warp, lane * self.vec + j] = cols[j]
        cute.arch.barrier()
        for c in cutlass.range(tidx, self.cols_per_cta, 32 * self.warps, unroll=1):
            v = Float32(0.0)
            for wi in cutlass.range_constexpr(self.warps):
                v = E.fmax_nan(v, red[wi, c])
            gc = bx * self.cols_per_cta + c
            if gc < K:
                E.red_max_u32(ac + Int64(gc) * 4, E.canonical_nan_bits(v))
