"""Dequantize kernels: NVFP4 (E2M1 + E4M3 block scales + FP32 outer amax) and MXFP8 (E4M3/E5M2
+ E8M0 per 32) to fp32 / bf16 / fp16, from compact or 128x4 swizzled scales.

A thread decodes whole scale blocks (16 NVFP4 or 32 MXFP8 values; NVFP4: BLOCKS_PER_THREAD of
them, their loads issued first, bf16 / fp16 by table look-ups), and each warp stores its blocks
through shared memory as 512-byte lines (warp_linear_store). References:
`cute_fp4.ref.dequantize` and `cute_fp4.ref.mxfp8_dequantize`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from ..common.ptx import ld_global
from ..common.stores import warp_buffer, warp_linear_store
from ..common.jit import (KERNELS, compile_kernel, device_arch, dyn, env_stream, fake_tensor,
                          torch_to_cutlass)
from ..common.scales import (FLT_MAX, bits_to_f32, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32,
                             f32_to_bits, outer_encode_scale, swizzled_scale_offset)
from ..ref.dequantize import MXFP8_DTYPES, OUT_DTYPES, check_out_tensor
from ..ref.swizzle import scale_shape
from ..tensor import NVFP4Tensor

THREADS = 256
# DequantizeNVFP4: blocks per thread by output width, their loads issued before any is decoded
# (measured, H200, graphs, with warp_linear_store: fp32 1 or 2 equal per tensor, 2 up to 4%
# faster per token; bf16 4 and 2 within 1%, 1 up to 8% slower per token).
BLOCKS_PER_THREAD = {32: 2, 16: 4}

# The NVFP4 block's exact fast path: q1 = RN(s / S_enc) and q15 = RN(1.5 s / S_enc) give every
# value as 2**(e - 1) * q1 or q15. For fp32 outputs DequantizeNVFP4 adds e - 1 to the exponent
# field (scaled_values, exact for q1 >= 2**-125 and q15 <= FLT_MAX / 4); for bf16 / fp16 it looks
# the 8 magnitudes up in a per-block table of bf16 / fp16 bit patterns built from out(q1) and
# out(q15) by exponent-field additions, exact where RN_out(2**k * q) = 2**k * RN_out(q) for k in
# -1 .. 2: q1 / 2 and out(q1) / 2 normal, 4 * out(q15) finite or exactly the overflow
# (TABLE_BOUNDS: smallest q1, largest q15; bf16 has FP32's exponent range, so its bounds are
# scaled_values').
SCALED_BOUNDS = (2.0 ** -125, FLT_MAX / 4)
TABLE_BOUNDS = {"bf16": SCALED_BOUNDS, "fp16": (2.0 ** -13, 16376.0)}


@cute.jit
def scaled_e2m1(code: Uint32, q1_bits: Uint32, q15_bits: Uint32) -> Float32:
    """e2m1(code) * q, given the FP32 bits of q1 = RN(s / S_enc) and q15 = RN(1.5 s / S_enc),
    both normal with room for x4 and x0.5: magnitude code m = (e, mant) is 2**(e-1) times
    (1.5 if mant and e > 0 else 1), so the result is q1 or q15 with e - 1 added to its
    exponent field (code 0 gives a signed zero)."""
    e = (code >> 1) & Uint32(0x3)
    mant = code & Uint32(0x1)
    base = cutlass.select_((mant != Uint32(0)) & (e != Uint32(0)), q15_bits, q1_bits)
    mag = Uint32(base + (e << 23) - Uint32(1 << 23))
    mag = Uint32(cutlass.select_((code & Uint32(0x7)) == Uint32(0), Uint32(0), mag))
    return bits_to_f32(mag | ((code & Uint32(0x8)) << 28))


@cute.jit
def scaled_values(vals: cute.Tensor, words2: cute.Tensor, q1: Float32, q15: Float32):
    """The 16 values of a block (codes: words2[0, 0 .. 1]) into vals [1, 16] from its q1 / q15
    (scaled_e2m1; within the FP32 fast path's bounds)."""
    b1, b15 = f32_to_bits(q1), f32_to_bits(q15)
    for half in cutlass.range_constexpr(2):
        w = words2[0, half]
        for j in cutlass.range_constexpr(8):
            code = (w >> (4 * j)) & Uint32(0xF)
            vals[0, 8 * half + j] = scaled_e2m1(code, b1, b15).to(vals.element_type)


@cute.jit
def divided_values(vals: cute.Tensor, words2: cute.Tensor, s: Float32, s_enc: Float32):
    """The 16 values of a block into vals [1, 16]: e2m1 * s / S_enc, an IEEE division each
    (any scale and outer scale)."""
    for half in cutlass.range_constexpr(2):
        w = words2[0, half]
        for j in cutlass.range_constexpr(8):
            v = e2m1_to_f32((w >> (4 * j)) & Uint32(0xF))
            vals[0, 8 * half + j] = ((v * s) / s_enc).to(vals.element_type)


def _lut_decode16_ptx(fp16: bool) -> str:
    """PTX of lut_decode16: operands r0, r1 the code words, r2 q1, r3 q15; w0..w7 the output."""
    ty, one = ("f16", 0x400) if fp16 else ("bf16", 0x80)  # one: the exponent field's unit
    lines = [
        "{", ".reg .b16 h1, h15;", ".reg .b32 v1, vh, v2, v4, v15, v3, v6, p01, p23, p45, p67;",
        ".reg .b32 tl0, tl1, th0, th1, w, m, mh, la, ha, lb, hb, se, sg;",
        f"cvt.rn.{ty}.f32 h1, {{$r2}};", f"cvt.rn.{ty}.f32 h15, {{$r3}};",
        "cvt.u32.u16 v1, h1;", "cvt.u32.u16 v15, h15;",
        f"sub.u32 vh, v1, {one};", f"add.u32 v2, v1, {one};", f"add.u32 v4, v2, {one};",
        f"add.u32 v3, v15, {one};", f"add.u32 v6, v3, {one};",
        # magnitude codes 0..7: 0, q1 / 2, q1, q15, 2 q1, 2 q15, 4 q1, 4 q15; pairs of 16-bit
        # patterns, then the low bytes (tl) and the high bytes (th) of the 8 entries
        "shl.b32 p01, vh, 16;", "prmt.b32 p23, v1, v15, 0x5410;",
        "prmt.b32 p45, v2, v3, 0x5410;", "prmt.b32 p67, v4, v6, 0x5410;",
        "prmt.b32 tl0, p01, p23, 0x6420;", "prmt.b32 th0, p01, p23, 0x7531;",
        "prmt.b32 tl1, p45, p67, 0x6420;", "prmt.b32 th1, p45, p67, 0x7531;",
    ]
    for k in range(2):
        w = "{$r%d}" % k
        o = ["{$w%d}" % (4 * k + j) for j in range(4)]
        lines += [
            # the magnitudes as prmt selectors (nibble j: byte index of code j, no sign mode)
            f"and.b32 m, {w}, 0x77777777;", "shr.b32 mh, m, 16;",
            "prmt.b32 la, tl0, tl1, m;", "prmt.b32 ha, th0, th1, m;",
            "prmt.b32 lb, tl0, tl1, mh;", "prmt.b32 hb, th0, th1, mh;",
            f"prmt.b32 {o[0]}, la, ha, 0x5140;", f"prmt.b32 {o[1]}, la, ha, 0x7362;",
            f"prmt.b32 {o[2]}, lb, hb, 0x5140;", f"prmt.b32 {o[3]}, lb, hb, 0x7362;",
            # signs: byte i of (w << 4) / w has the sign of code 2i / 2i + 1 in its top bit;
            # prmt's sign-replicate selectors spread them over bytes 1 / 3 of each pair
            f"shl.b32 se, {w}, 4;",
        ]
        for j, sel in enumerate((0xC080, 0xD090, 0xE0A0, 0xF0B0)):
            lines += [f"prmt.b32 sg, se, {w}, {sel:#06x};",
                      f"lop3.b32 {o[j]}, {o[j]}, sg, 0x80008000, 0xF8;"]
    lines.append("}")
    return "\n".join(lines)


_LUT_DECODE16 = {False: _lut_decode16_ptx(False), True: _lut_decode16_ptx(True)}


def lut_decode16(w0, w1, q1, q15, fp16: bool):
    """The 16 values of one NVFP4 block (codes: 8 nibbles per word, element j in nibble j) in
    bf16 / fp16 as 8 words of pairs, from its q1 = RN(s / S_enc) and q15 = RN(1.5 s / S_enc)
    within TABLE_BOUNDS: a table of the 8 magnitudes' bit patterns (out(q1) and out(q15) times
    1/2, 1, 2, 4 by exponent-field additions) looked up by prmt, about 2.4 instructions per
    value with the signs instead of ~8 for scaled_e2m1 and the conversion."""
    return cute.arch.inline_ptx(
        _LUT_DECODE16[fp16], write_only_types=[Uint32] * 8,
        read_only_args=[Uint32(w0), Uint32(w1), Float32(q1), Float32(q15)])


@cute.jit
def block_scale_code(scales: cute.Tensor, i: Int32, r: Int32, b: Int32, blocks: Int32,
                     swizzled: cutlass.Constexpr[bool]) -> Uint32:
    """The scale byte of block (r, b), flat index i = r * blocks + b, from the flat compact or
    128x4 swizzled scale bytes."""
    offset = i
    if cutlass.const_expr(swizzled):
        offset = swizzled_scale_offset(r, b, blocks)
    return Uint32(scales[offset])


def flat_scale_bytes(scales: cute.Tensor) -> cute.Tensor:
    """The E4M3 scales (compact or swizzled, 2D) as one flat byte array."""
    return cute.make_tensor(cute.recast_ptr(scales.iterator, dtype=cutlass.Uint8),
                            cute.make_layout(cute.size(scales)))


@cute.jit
def store_blocks(buf: Int32, out: cute.Tensor, words, first: Int32, total: Int32, lane: Int32,
                 block_bytes: cutlass.Constexpr[int], reused: cutlass.Constexpr[bool]):
    """Stores the warp's 32 consecutive output blocks first .. first + 31 of the contiguous
    `out` (this lane's: block first + lane, its 32-bit `words`) by warp_linear_store; blocks
    >= total are not stored."""
    n = block_bytes // 16
    warp_linear_store(buf, out.iterator.toint() + Int64(first) * block_bytes,
                      [(lane * n + c, words[4 * c:4 * c + 4]) for c in range(n)], lane,
                      Int64(total - first) * block_bytes, reused)


@cute.jit
def block_outer_amax(amax: cute.Tensor, r: Int32, b: Int32, scaling: cutlass.Constexpr):
    """The outer amax of block (r, b): per tensor, per row, or per 1x64 window."""
    if cutlass.const_expr(scaling == "tensor"):
        a = amax[0]
    elif cutlass.const_expr(scaling == "token"):
        a = amax[r]
    else:
        a = amax[r, b // 4]
    return a


@cute.jit
def block_quotients(s_code: Uint32, a: Float32, e4m3_max: cutlass.Constexpr):
    """(s, S_enc, q1, q15) of a block from its scale byte and outer amax. Every E2M1 magnitude
    is 2**k or 1.5 * 2**k, and RN(2**k * y / z) = 2**k * RN(y / z) while both stay normal: the
    two IEEE divisions q1 = s / S_enc and q15 = 1.5 s / S_enc give all 16 values exactly
    within a fast path's bounds."""
    s = e4m3_to_f32(s_code)
    s_enc = outer_encode_scale(a, e4m3_max)
    q1 = s / s_enc
    q15 = (s * Float32(1.5)) / s_enc
    return s, s_enc, q1, q15


class DequantizeNVFP4:
    """out[r, 16*b + j] = e2m1(q[r, 16*b + j]) * e4m3(s[r, b]) / S_enc(amax of (r, b)).
    Each thread takes BLOCKS_PER_THREAD blocks (by output width), issues all their loads
    first, decodes a block within its fast path's bounds from q1 / q15 (fp32: scaled_values;
    bf16 / fp16: lut_decode16) and any other block by IEEE divisions, and stores through
    shared memory (warp_linear_store)."""

    def __init__(self, out_dtype, scaling: str, swizzled: bool, e4m3_max: int):
        self.out_dtype = out_dtype
        self.scaling = scaling
        self.swizzled = swizzled
        self.e4m3_max = float(e4m3_max)
        self.fp32 = out_dtype == cutlass.Float32
        self.fp16 = out_dtype == cutlass.Float16
        self.block_bytes = 16 * out_dtype.width // 8
        self.blocks_per_thread = BLOCKS_PER_THREAD[out_dtype.width]

    @cute.jit
    def __call__(self, data: cute.Tensor, scales: cute.Tensor, amax: cute.Tensor,
                 out: cute.Tensor, stream):
        # The tensors arrive as the NVFP4Tensor holds them (no host-side views, which cost
        # microseconds per call): data uint8 [M, K/2] (contiguous) is read as 8-byte blocks of
        # 16 codes, the E4M3 scales (compact or swizzled, 2D) as one flat byte array.
        flat_scales = flat_scale_bytes(scales)
        rows = cute.size(data, mode=[0])
        blocks = cute.size(data, mode=[1]) // 8
        total = rows * blocks
        self.kernel(data, flat_scales, amax, out, rows, blocks).launch(
            grid=[cute.ceil_div(total, THREADS * self.blocks_per_thread), 1, 1],
            block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, data: cute.Tensor, scales: cute.Tensor, amax: cute.Tensor,
               out: cute.Tensor, rows: Int32, blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        total = rows * blocks
        data_base = data.iterator.toint()
        warp_buf = warp_buffer(THREADS, self.block_bytes, tidx, lane)
        # every block's loads first; past the end, the last block (every lane takes part in
        # the warp's stores)
        loaded = []
        for v in cutlass.range_constexpr(self.blocks_per_thread):
            i = (bidx * self.blocks_per_thread + v) * THREADS + tidx
            ic = cutlass.min(i, total - 1)
            r = ic // blocks
            b = ic - r * blocks
            codes = ld_global(data_base + Int64(ic) * 8, 2, nc=True, volatile=True,
                              dtype=Uint32)
            s_code = block_scale_code(scales, ic, r, b, blocks, self.swizzled)
            loaded.append((i, codes, s_code, block_outer_amax(amax, r, b, self.scaling)))
        for v, (i, codes, s_code, a) in enumerate(loaded):
            words = self._block_words(codes, s_code, a)
            store_blocks(warp_buf, out, [words[0, j] for j in range(self.block_bytes // 4)],
                         i - lane, total, lane, self.block_bytes, v > 0)

    @cute.jit
    def _block_words(self, codes, s_code: Uint32, a: Float32):
        """A block's 16 values from its two code words, scale byte and outer amax, as the
        32-bit words of the output in a register tensor [1, block_bytes / 4]."""
        s, s_enc, q1, q15 = block_quotients(s_code, a, self.e4m3_max)
        lo, hi = SCALED_BOUNDS if self.fp32 else TABLE_BOUNDS["fp16" if self.fp16 else "bf16"]
        fast = (q1 >= Float32(lo)) & (q15 <= Float32(hi))
        words2 = cute.make_rmem_tensor((1, 2), cutlass.Uint32)
        words2[0, 0] = codes[0]
        words2[0, 1] = codes[1]
        vals = cute.make_rmem_tensor((1, 16), self.out_dtype)
        words = cute.recast_tensor(vals, cutlass.Uint32)
        if fast:
            if cutlass.const_expr(self.fp32):
                scaled_values(vals, words2, q1, q15)
            else:
                table = lut_decode16(codes[0], codes[1], q1, q15, self.fp16)
                for j in cutlass.range_constexpr(8):
                    words[0, j] = table[j]
        else:
            divided_values(vals, words2, s, s_enc)
        return words


class DequantizeMXFP8:
    """out[r, 32*b + j] = fp8(q[r, 32*b + j]) * 2**(e8m0(s[r, b]) - 127), one block per
    thread, stored through shared memory (warp_linear_store)."""

    def __init__(self, in_dtype, out_dtype, swizzled: bool):
        self.in_dtype = in_dtype
        self.out_dtype = out_dtype
        self.swizzled = swizzled
        self.block_bytes = 32 * out_dtype.width // 8

    @cute.jit
    def __call__(self, data: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, stream):
        # E8M0 scales (uint8, compact or swizzled, 2D) are read as one flat byte array.
        flat_scales = cute.make_tensor(scales.iterator, cute.make_layout(cute.size(scales)))
        rows = cute.size(data, mode=[0])
        blocks = cute.size(data, mode=[1]) // 32
        total = rows * blocks
        self.kernel(data, flat_scales, out, rows, blocks).launch(
            grid=[cute.ceil_div(total, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, data: cute.Tensor, scales: cute.Tensor, out: cute.Tensor, rows: Int32,
               blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        i = bidx * THREADS + tidx
        total = rows * blocks
        ic = cutlass.min(i, total - 1)  # past the end, the last block (the warp stores)
        r = ic // blocks
        b = ic - r * blocks
        s = e8m0_to_f32(block_scale_code(scales, ic, r, b, blocks, self.swizzled))
        src = cute.make_rmem_tensor((1, 32), self.in_dtype)
        cute.autovec_copy(cute.local_tile(data, (1, 32), (r, b)), src)
        vals = cute.make_rmem_tensor((1, 32), self.out_dtype)
        vals.store((src.load().to(Float32) * s).to(self.out_dtype))
        words = cute.recast_tensor(vals, cutlass.Uint32)
        store_blocks(warp_buffer(THREADS, self.block_bytes, tidx, lane), out,
                     [words[0, j] for j in range(self.block_bytes // 4)], i - lane, total, lane,
                     self.block_bytes, False)


def nvfp4_kernel(out_dtype: torch.dtype, scaling: str, swizzled: bool, e4m3_max: int):
    """(kernel, *fake compile arguments) of the NVFP4 dequantize for a configuration."""
    cdt = torch_to_cutlass(out_dtype)
    op = DequantizeNVFP4(cdt, scaling, swizzled, e4m3_max)
    m = dyn()
    amax_shape = {"tensor": (1,), "token": (m,), "window64": (m, None)}[scaling]
    return (op, fake_tensor(cutlass.Uint8, (m, dyn(8)), align=8),
            fake_tensor(cutlass.Float8E4M3FN, (None, None), align=1),
            fake_tensor(cutlass.Float32, amax_shape, align=4),
            fake_tensor(cdt, (m, dyn(16))), env_stream())


def mxfp8_kernel(in_dtype: torch.dtype, out_dtype: torch.dtype, swizzled: bool):
    """(kernel, *fake compile arguments) of the MXFP8 dequantize for a configuration."""
    op = DequantizeMXFP8(torch_to_cutlass(in_dtype), torch_to_cutlass(out_dtype), swizzled)
    m, k = dyn(), dyn(32)
    return (op, fake_tensor(torch_to_cutlass(in_dtype), (m, k)),
            fake_tensor(cutlass.Uint8, (None, None), align=1),
            fake_tensor(torch_to_cutlass(out_dtype), (m, k)), env_stream())


def dequantize(t: NVFP4Tensor, dtype: torch.dtype, out: torch.Tensor = None) -> torch.Tensor:
    """GPU dequantize of the rowwise data of `t`, into `out` (contiguous [rows, cols] of
    `dtype`) when given; both validated by `cute_fp4.dequantize`."""
    data, recipe = t.data, t.recipe
    device = data.device
    if out is None:
        out = torch.empty((data.shape[0], t.cols), dtype=dtype, device=device)
    nvfp4_launcher(dtype, recipe.scaling, recipe.swizzle, recipe.e4m3_max,
                   device_arch(device))(data, t.scales, t.amax, out)
    return out if len(t.shape) == 2 else out.view(t.shape)


def nvfp4_launcher(dtype: torch.dtype, scaling: str, swizzled: bool, e4m3_max: int, arch: str):
    """The compiled DequantizeNVFP4 (its TVM-FFI function) for one configuration: called with
    the packed data [rows, K/2], its E4M3 scales, its outer amax and the output [rows, K]."""
    key = ("dequantize_nvfp4", dtype, scaling, swizzled, e4m3_max, arch)
    return KERNELS.ffi(key, lambda: compile_kernel(
        *nvfp4_kernel(dtype, scaling, swizzled, e4m3_max), arch=arch))


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     swizzled: bool = False, out: torch.Tensor = None) -> torch.Tensor:
    """MXFP8 [M, K] (K % 32 == 0) with E8M0 scales (uint8 [M, K/32], or swizzled) -> dtype,
    into `out` (contiguous [M, K] of `dtype`) when given."""
    if data.dtype not in MXFP8_DTYPES:
        raise TypeError(f"MXFP8 data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if data.dim() != 2 or data.shape[1] % 32:
        raise ValueError(f"MXFP8 data must be 2D [M, K] with K % 32 == 0, got {tuple(data.shape)}")
    if not data.is_contiguous():
        raise ValueError("MXFP8 data must be contiguous")
    rows, cols = data.shape
    want = scale_shape(rows, cols // 32, swizzled)
    if (scales.element_size() != 1 or tuple(scales.shape) != want
            or scales.device != data.device or not scales.is_contiguous()):
        raise ValueError(f"MXFP8 scales must be a contiguous 1-byte (E8M0) tensor of shape "
                         f"{want} ({'swizzled' if swizzled else 'compact'}) on "
                         f"{data.device}, got {scales.dtype} {tuple(scales.shape)} on "
                         f"{scales.device}")
    if out is not None:
        check_out_tensor(out, (rows, cols), dtype, data.device)
    if not data.is_cuda:
        from ..ref import mxfp8_dequantize as mxfp8_dequantize_ref

        result = mxfp8_dequantize_ref(data, scales, dtype, swizzled)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=data.device)
    if rows == 0:
        return out
    arch = device_arch(data.device)
    key = ("dequantize_mxfp8", data.dtype, dtype, swizzled, arch)
    fn = KERNELS.get(key, lambda: compile_kernel(*mxfp8_kernel(data.dtype, dtype, swizzled),
                                                 arch=arch))
    fn(data, scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales, out)
    return out
