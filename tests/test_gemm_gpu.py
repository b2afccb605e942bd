"""GPU tests of the NVFP4 GEMM (cute_fp4.gemm.dispatch.gemm_nvfp4, its sm_90a paths:
"predecode" = sm90_mixed with the smaller operand predecoded, roles swapped when M < N;
"decode_both" = sm90_w4a4; "window" = sm90_window for window64 operands) and of the mixed-input W4A16 entry (sm90_mixed.gemm_mixed_sm90)
against a float64 dequantize-and-matmul and against cute_fp4.ref.gemm.

Error bound. Every product a*b is exact (BF16 wgmma inputs hold e2m1 * e4m3 exactly); the
only differences are FP32 summation order/rounding inside the tensor cores and the final cast:
    |D - D64| <= 2 * eps(out) * |D64| + K * 2**-22 * |alpha row col| * sum_k |a_k b_k| + tiny
(eps(out) = 2**-8 bf16, 2**-11 fp16, 2**-24 fp32), checked elementwise.
"""

import itertools

import pytest
import torch

from cute_fp4 import ref
from cute_fp4.ref.swizzle import swizzle_scales

from gemm_bounds import check, expected64, rand_fp4, values64, window_amax, window_factors

pytestmark = pytest.mark.gpu


def expected(a, sa, b, sb, alpha, row, col, bias):
    return expected64(values64(a, sa), values64(b, sb), alpha, row, col, bias)


def run(a, sa, b, sb, *, alpha=None, row=None, col=None, bias=None,
        out_dtype=torch.bfloat16, swizzled=False, **kw):
    from cute_fp4.gemm.dispatch import gemm_nvfp4

    dev = "cuda"
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev)
    if swizzled:
        sa, sb = swizzle_scales(sa), swizzle_scales(sb)
    cu = lambda t: None if t is None else t.to(dev)  # noqa: E731
    res = gemm_nvfp4(a.to(dev), sa.to(dev), b.to(dev), sb.to(dev), alpha=cu(alpha),
                     row=cu(row), col=cu(col), bias=cu(bias), out_dtype=out_dtype,
                     scales_swizzled=swizzled, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return out


SHAPES = [(1, 256, 128), (200, 300, 512), (128, 256, 16), (130, 64, 4096), (257, 1000, 160),
          (77, 520, 176), (1024, 512, 1024), (300, 129, 8192)]


SHAPES = SHAPES + [(n, m, k) for m, n, k in SHAPES if m != n] + [(256, 1, 64), (1, 1, 16)]


@pytest.mark.parametrize("path", ["predecode", "decode_both"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_shapes_vs_float64(m, n, k, path, gen):
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    out = run(a, sa, b, sb, path=path)
    d64, mag = expected(a, sa, b, sb, None, None, None, None)
    check(out, d64, mag, k, torch.bfloat16)


@pytest.mark.parametrize("path,tile_n", [("predecode", 64), ("predecode", 128),
                                         ("predecode", 256), ("decode_both", 128),
                                         ("decode_both", 256)])
@pytest.mark.parametrize("m,n", [(384, 640), (640, 384)])
def test_tile_configs(tile_n, m, n, path, gen):
    k = 1024
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    out = run(a, sa, b, sb, tile_n=tile_n, out_dtype=torch.float32, path=path)
    d64, mag = expected(a, sa, b, sb, None, None, None, None)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("m,n,k", [(2000, 2100, 320), (1100, 4100, 64), (4100, 1100, 1040)])
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_persistent_many_tiles(m, n, k, tile_n, out_dtype, gen):
    """More tiles than SMs: each CTA of the persistent predecode kernel runs several tiles
    (partial ones at both edges; K = 64: one k-tile per tile, so the pipeline phase moves on
    every tile; 17 k-tiles: odd, the two A buffers alternate across tiles)."""
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    col = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    out = run(a, sa, b, sb, col=col, bias=bias, tile_n=tile_n, out_dtype=out_dtype,
              path="predecode")
    d64, mag = expected(a, sa, b, sb, None, None, col, bias)
    check(out, d64, mag, k, out_dtype)


@pytest.mark.parametrize("m,n", [(160, 272), (272, 160)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=4)))
def test_epilogue(flags, out_dtype, m, n, gen):
    """Every epilogue combination, with B predecoded (M > N) and with the roles swapped
    (M < N: the kernel computes D^T, row/col/bias swap axes)."""
    has_alpha, has_row, has_col, has_bias = flags
    k = 320
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    alpha = torch.rand(1, generator=gen) * 0.5 + 0.25 if has_alpha else None
    row = torch.rand(m, generator=gen) + 0.5 if has_row else None
    col = torch.rand(n, generator=gen) + 0.5 if has_col else None
    bias = None
    if has_bias:
        bias_dtype = torch.float32 if out_dtype == torch.bfloat16 else out_dtype
        bias = (torch.randn(n, generator=gen) * 8).to(bias_dtype)
    out = run(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype)
    d64, mag = expected(a, sa, b, sb, alpha, row, col, bias)
    check(out, d64, mag, k, out_dtype)
    # the lead's torch reference (FP32, block order) agrees within the same bound
    r = ref.gemm(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype)
    check(r, d64, mag, k, out_dtype)


@pytest.mark.parametrize("path", ["predecode", "decode_both"])
@pytest.mark.parametrize("m,n", [(256, 384), (384, 256)])
def test_full_scale_range(m, n, path, gen):
    """E4M3 scales over the whole positive range, subnormals included, FP32 output."""
    k = 2048
    a, sa = rand_fp4(m, k, gen, lo=-9.0, hi=8.8)
    b, sb = rand_fp4(n, k, gen, lo=-9.0, hi=8.8)
    out = run(a, sa, b, sb, out_dtype=torch.float32, path=path)
    d64, mag = expected(a, sa, b, sb, None, None, None, None)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("m,n,k", [(200, 300, 512), (1, 256, 128), (333, 520, 176),
                                   (520, 333, 176)])
def test_swizzled_equals_compact(m, n, k, gen):
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    c = run(a, sa, b, sb, out_dtype=torch.float32)
    s = run(a, sa, b, sb, out_dtype=torch.float32, swizzled=True)
    assert torch.equal(c, s)


@pytest.mark.parametrize("path", ["predecode", "decode_both"])
@pytest.mark.parametrize("m,n", [(192, 320), (320, 192)])
def test_exact_small_sums(m, n, path, gen):
    """Integers small enough that FP32 sums are exact: the result must be bit-exact."""
    k = 256
    a, _ = rand_fp4(m, k, gen)
    b, _ = rand_fp4(n, k, gen)
    sa = torch.ones(m, k // 16).to(torch.float8_e4m3fn)
    sb = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    out = run(a, sa, b, sb, out_dtype=torch.float32, path=path)
    d64, _ = expected(a, sa, b, sb, None, None, None, None)
    assert torch.equal(out.double().cpu(), d64)


@pytest.mark.parametrize("rows,k", [(1, 16), (200, 96), (300, 4096), (129, 176)])
def test_predecode_bit_exact(rows, k, gen):
    """The pre-pass: e2m1 * scale * 2**-7 in the kernel's K order (sm90_mixed.kperm64),
    zero-padded to whole k-tiles, byte-equal to a torch decode."""
    from cute_fp4.gemm.operands import _check_operand
    from cute_fp4.gemm.sm90_mixed import k_pad, kperm64, predecode_nvfp4

    data, sc = rand_fp4(rows, k, gen, lo=-9.0, hi=8.8)
    flat = _check_operand(data.cuda(), sc.cuda(), "b", False)
    got = predecode_nvfp4(data.cuda(), flat, "sm_90a").cpu()
    kp = k_pad(data.shape[1])
    want = torch.zeros(rows, kp, dtype=torch.float64)
    want[:, :k] = values64(data, sc) * 2.0**-7
    idx = (torch.arange(0, kp, 64).view(-1, 1) + kperm64().view(1, -1)).view(-1)
    assert torch.equal(got, want[:, idx].to(torch.bfloat16))


@pytest.mark.parametrize("q,k", [(1, 16), (3, 64), (5, 176), (2, 8), (300, 1000), (64, 8192),
                                 (1031, 4096)])
def test_permute_k(q, k, gen):
    """PermuteK: the BF16 operand of the W4A16 mixed GEMM, k = kperm64()[p] at position p of
    every k-tile, zero past K (a poisoned output, the head of a larger poisoned buffer whose
    tail must stay untouched; misaligned and strided input views, ragged rows)."""
    from cute_fp4.gemm.sm90_mixed import k_pad, kperm64, permute_k

    base = torch.randn(q * k + 1, generator=gen).to(torch.bfloat16).cuda()
    y = (base[1:] if q % 2 else base[:-1]).view(q, k)  # odd q: a misaligned view
    if q == 300:  # a strided view: the columns of a wider tensor
        y = torch.cat([y, y[:, :8]], 1)[:, 8:]
    kp = k_pad(k // 2)
    buf = torch.full((q + 2, kp), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[:q]
    assert permute_k(y, kp, "sm_90a", out=out) is out
    assert torch.isnan(buf[q:]).all()
    padded = torch.zeros(q, kp, dtype=torch.bfloat16)
    padded[:, :k] = y.cpu()
    idx = (torch.arange(0, kp, 64).view(-1, 1) + kperm64().view(1, -1)).view(-1)
    assert torch.equal(out.cpu().view(torch.int16), padded[:, idx].view(torch.int16))


@pytest.mark.parametrize("m,n,k", [(1, 256, 64), (200, 300, 512), (512, 1024, 2048),
                                   (77, 130, 176)])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_mixed_w4a16(m, n, k, swizzled, act_dtype, gen):
    """gemm_mixed_sm90 (W4A16 for any M): BF16 or FP16 activations x NVFP4 weights (decoded
    to the activations' dtype: BF16 or FP16 wgmma), epilogue, FP32 out. a * w products are
    exact in FP32, so the GEMM bound holds."""
    from cute_fp4.gemm.sm90_mixed import gemm_mixed_sm90

    a = torch.randn(m, k, generator=gen).to(act_dtype)
    w, sw = rand_fp4(n, k, gen)
    alpha = torch.rand(1, generator=gen) + 0.5
    col = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    out = torch.full((m, n), float("nan"), device="cuda")
    ws = swizzle_scales(sw) if swizzled else sw
    res = gemm_mixed_sm90(w.cuda(), ws.cuda(), a.cuda(), alpha=alpha.cuda(), col=col.cuda(),
                          bias=bias.cuda(), out_dtype=torch.float32, scales_swizzled=swizzled,
                          out=out)
    assert res.data_ptr() == out.data_ptr()
    d64, mag = expected64(a.double(), values64(w, sw), alpha, None, col, bias)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [40, 300])
def test_mixed_w4a16_full_scale_range(m, act_dtype, gen):
    """E4M3 scales over the whole positive range, subnormals included (the FP16 decode's
    e2m1 * scale * 2**-14 reaches FP16 subnormals), and small-integer activations with scale 2:
    the sums are exact in FP32, so the result is bit-exact; then random activations within
    the GEMM bound."""
    from cute_fp4.gemm.sm90_mixed import gemm_mixed_sm90

    n, k = 384, 2048
    w, _ = rand_fp4(n, k, gen)
    ints = torch.randint(-8, 9, (m, k), generator=gen).to(act_dtype)
    two = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    out = gemm_mixed_sm90(w.cuda(), two.cuda(), ints.cuda(), out_dtype=torch.float32)
    d64, _ = expected64(ints.double(), values64(w, two))
    assert torch.equal(out.double().cpu(), d64)
    w, sw = rand_fp4(n, k, gen, lo=-9.0, hi=8.8)
    a = torch.randn(m, k, generator=gen).to(act_dtype)
    out = gemm_mixed_sm90(w.cuda(), sw.cuda(), a.cuda(), out_dtype=torch.float32)
    d64, mag = expected64(a.double(), values64(w, sw))
    check(out, d64, mag, k, torch.float32)


def _check_mixed_config(m, n, k, gen, config, same_order):
    """gemm_mixed_sm90 with `config` (keyword arguments) on fresh BF16 activations [m, k] and
    NVFP4 weights [n, k], FP32 out (NaN-poisoned) with alpha, col and bias: a second run is
    bit-equal (deterministic), so is the `same_order` configuration (the same sums in the same
    order), and the result is within the GEMM bound of float64."""
    from cute_fp4.gemm.sm90_mixed import gemm_mixed_sm90

    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w, sw = rand_fp4(n, k, gen)
    alpha = torch.rand(1, generator=gen) + 0.5
    col = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    args = (w.cuda(), sw.cuda(), a.cuda())
    kw = dict(alpha=alpha.cuda(), col=col.cuda(), bias=bias.cuda(), out_dtype=torch.float32)
    out = torch.full((m, n), float("nan"), device="cuda")
    gemm_mixed_sm90(*args, **kw, out=out, **config)
    assert torch.equal(out, gemm_mixed_sm90(*args, **kw, **config))
    assert torch.equal(out, gemm_mixed_sm90(*args, **kw, **same_order))
    d64, mag = expected64(a.double(), values64(w, sw), alpha, None, col, bias)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("tile_n,ctas_per_sm,k_split", [
    (16, 1, False), (16, 3, False), (32, 2, False), (64, 1, False), (64, 2, False),
    (16, 1, True), (32, 2, True), (64, 1, True), (64, 2, True)])
@pytest.mark.parametrize("m,n,k", [(1, 300, 192), (17, 136, 64), (40, 34000, 192),
                                   (64, 257, 320), (100, 520, 192)])
def test_mixed_narrow_tiles(tile_n, ctas_per_sm, k_split, m, n, k, gen):
    """The decode-sized configurations of the mixed kernel (64 x tile_n wgmma, several CTAs
    per SM, k_split): tokens past one tile (m > tile_n), partial weight tiles, more tiles than
    CTAs (n = 34000: 266 weight tiles of 128 rows), one k-tile (k_split's second warpgroup
    idle) and odd k-tile counts. Deterministic; bit-equal to the 128-wide tile without
    k_split (the same k16 sums in the same order), with k_split to the narrowest k_split tile
    (its even-then-odd order), and within the GEMM bound of float64; FP32 out with alpha,
    col, bias."""
    same_order = (dict(tile_n=16, ctas_per_sm=1, k_split=True) if k_split else
                  dict(tile_n=128, k_split=False))
    _check_mixed_config(m, n, k, gen, dict(tile_n=tile_n, ctas_per_sm=ctas_per_sm,
                                           k_split=k_split), same_order)


@pytest.mark.parametrize("tile_n,ctas_per_sm,k_slices", [
    (16, 1, 2), (64, 2, 2), (32, 2, 4), (64, 1, 4)])
@pytest.mark.parametrize("m,n,k", [(1, 300, 192), (17, 136, 64), (40, 34000, 192),
                                   (64, 257, 320), (100, 520, 1088)])
def test_mixed_k_slices(tile_n, ctas_per_sm, k_slices, m, n, k, gen):
    """k_slices (clusters of CTAs splitting a 64-row tile's k-tiles, DSMEM reduction in rank
    order): slices without k-tiles (k = 64 / 192 with 4 slices), uneven slices (17 k-tiles),
    more clusters than fit at once (n = 34000), tokens past a tile. Deterministic (a second
    run is bit-equal), bit-equal to the narrowest tile with the same k_slices (the same sums
    in the same order), within the GEMM bound of float64; poisoned FP32 out."""
    _check_mixed_config(m, n, k, gen,
                        dict(tile_n=tile_n, ctas_per_sm=ctas_per_sm, k_split=True,
                             k_slices=k_slices),
                        dict(tile_n=16, ctas_per_sm=1, k_split=True, k_slices=k_slices))


def test_w4a16_dispatch(monkeypatch, gen):
    """cute_fp4.gemm's W4A16 choice: BF16 and FP16 activations stream the weights where
    `stream_weights` says so and run the mixed kernel otherwise (decode-size configurations
    from 17 tokens on this many weight rows). Results within the GEMM bound."""
    from cute_fp4.gemm import dispatch

    calls = []
    for name in ("gemm_mixed_sm90", "gemm_w4a16_sm90"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name,
                            lambda *a, _real=real, _name=name, **kw:
                            calls.append(_name) or _real(*a, **kw))
    k = 128
    n = 32 * torch.cuda.get_device_properties(0).multi_processor_count + 8
    w, sw = rand_fp4(n, k, gen)
    for m, dtype, want in ((16, torch.bfloat16, "gemm_w4a16_sm90"),
                           (17, torch.bfloat16, "gemm_mixed_sm90"),
                           (64, torch.bfloat16, "gemm_mixed_sm90"),
                           (65, torch.bfloat16, "gemm_mixed_sm90"),
                           (16, torch.float16, "gemm_w4a16_sm90"),
                           (64, torch.float16, "gemm_mixed_sm90"),
                           (300, torch.float16, "gemm_mixed_sm90")):
        calls.clear()
        a = torch.randn(m, k, generator=gen).to(dtype)
        out = dispatch.gemm_w4a16(a.cuda(), w.cuda(), sw.cuda(), out_dtype=torch.float32)
        assert calls == [want]
        d64, mag = expected64(a.double(), values64(w, sw))
        check(out, d64, mag, k, torch.float32)


# ---- 1x64 local-encode (window64) operands ----

def run_windowed(a, sa, b, sb, a_amax, b_amax, e4m3_max, **kw):
    cu = lambda t: None if t is None else t.to("cuda")  # noqa: E731
    return run(a, sa, b, sb, a_window_amax=cu(a_amax), b_window_amax=cu(b_amax),
               e4m3_max=e4m3_max, **kw)


WINDOW_SHAPES = [(200, 300, 512, 448), (130, 136, 1024, 256), (1, 64, 64, 448),
                 (384, 520, 2048, 448), (1000, 20, 320, 448), (40, 700, 192, 256),
                 (2000, 2100, 320, 448), (300, 260, 128, 448)]


@pytest.mark.parametrize("path", ["window", "decode_both", "weight_stream", "predecode"])
@pytest.mark.parametrize("which", ["a", "b", "both"])
@pytest.mark.parametrize("m,n,k,e4m3_max", WINDOW_SHAPES)
def test_window64_vs_float64_and_ref(which, m, n, k, e4m3_max, path, gen):
    """The kernels that take window64 operands, within the bound of the float64 result and
    within FP32 summation-order noise of ref.gemm; shapes: one, two, three and five k-tiles
    of 64 (the window kernel's odd and even tails), 20 columns (tile_n 64), more tiles than
    SMs (2000 x 2100: several tiles per persistent CTA), e4m3_max 448 and 256. weight_stream
    (the streaming kernel with the larger operand's window factors) where the smaller operand
    (A on ties), which it decodes to BF16, is not window64; predecode (the mixed kernel with
    the window64 operand in registers, x_window, whether it is the larger or the smaller:
    D^T when it is B) with one window64 operand."""
    if path in ("decode_both", "weight_stream") and m * n > 10**6:
        pytest.skip(f"{path}: covered by the smaller shapes")
    if path == "weight_stream" and which in ("both", "b" if n < m else "a"):
        pytest.skip("weight_stream: the smaller operand must not be window64")
    if path == "predecode" and which == "both":
        pytest.skip("predecode: one window64 operand")
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    a_amax = window_amax(m, k, gen) if which in ("a", "both") else None
    b_amax = window_amax(n, k, gen) if which in ("b", "both") else None
    fa = sa.to(torch.float32) if a_amax is None else window_factors(sa, a_amax, e4m3_max)
    fb = sb.to(torch.float32) if b_amax is None else window_factors(sb, b_amax, e4m3_max)
    out = run_windowed(a, sa, b, sb, a_amax, b_amax, e4m3_max, out_dtype=torch.float32,
                       path=path)
    d64, mag = expected(a, fa, b, fb, None, None, None, None)
    check(out, d64, mag, k, torch.float32)
    r = ref.gemm(a, fa, b, fb, out_dtype=torch.float32)
    check(r, d64, mag, k, torch.float32)
    # FP32 summation-order noise only: relative to the magnitude sum
    assert float(((out.cpu().double() - r.double()).abs() / (mag + 1e-30)).max()) < k * 2.0**-22


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("m,n,k", [(640, 600, 320), (300, 1100, 1088), (1000, 1000, 64)])
def test_window64_predecode_wide_tiles(which, m, n, k, gen):
    """The predecode path's mixed kernel with one window64 operand at tile_n 256 (its window
    products in four 64-column slices through two part tiles) and 128: within the float64
    bound, with the epilogue vectors and a bias, and bit-equal to each other (the same FP32
    sums in the same order); odd and even k-tile counts, several tiles per CTA, partial edge
    tiles."""
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    a_amax = window_amax(m, k, gen) if which == "a" else None
    b_amax = window_amax(n, k, gen) if which == "b" else None
    fa = sa.to(torch.float32) if a_amax is None else window_factors(sa, a_amax, 448)
    fb = sb.to(torch.float32) if b_amax is None else window_factors(sb, b_amax, 448)
    row = torch.rand(m, generator=gen) + 0.5
    col = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    outs = [run_windowed(a, sa, b, sb, a_amax, b_amax, 448, row=row, col=col, bias=bias,
                         out_dtype=torch.float32, path="predecode", tile_n=tile_n)
            for tile_n in (256, 128)]
    d64, mag = expected(a, fa, b, fb, None, row, col, bias)
    check(outs[0], d64, mag, k, torch.float32)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("path", ["window", "decode_both"])
@pytest.mark.parametrize("m,n,out_dtype", [(160, 272, torch.bfloat16), (272, 160, torch.float16),
                                           (130, 196, torch.bfloat16), (130, 200, torch.float32)])
def test_window64_epilogue_and_swizzled(m, n, out_dtype, path, gen):
    """window64 with alpha / row / col / bias, 16-bit and FP32 outputs (N = 196 BF16: rows
    not 16-byte aligned, the staged epilogue's element stores), swizzled scales. FP16: no
    outlier windows and a small alpha, so that D stays in its range."""
    k = 512
    fp16 = out_dtype == torch.float16
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    a_amax, b_amax = window_amax(m, k, gen, not fp16), window_amax(n, k, gen, not fp16)
    alpha = (torch.rand(1, generator=gen) + 0.5) * (2.0**-6 if fp16 else 1.0)
    row = torch.rand(m, generator=gen) + 0.5
    col = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen) * 8
    out = run_windowed(a, sa, b, sb, a_amax, b_amax, 448, alpha=alpha, row=row, col=col,
                       bias=bias, swizzled=True, out_dtype=out_dtype, path=path)
    d64, mag = expected(a, window_factors(sa, a_amax, 448), b, window_factors(sb, b_amax, 448),
                        alpha, row, col, bias)
    if fp16:
        assert float(d64.abs().max()) < 60000
    check(out, d64, mag, k, out_dtype)


@pytest.mark.parametrize("path", ["window", "decode_both"])
@pytest.mark.parametrize("m,n", [(192, 320), (320, 192), (300, 48)])
def test_window64_exact_small_sums(m, n, path, gen):
    """Power-of-two window factors (amax = 2688 * 2**j -> S_dec = 2**j) and small integer
    values: every FP32 sum is exact, so the result is bit-exact."""
    k = 512
    a, _ = rand_fp4(m, k, gen)
    b, _ = rand_fp4(n, k, gen)
    sa = torch.ones(m, k // 16).to(torch.float8_e4m3fn)
    sb = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    a_amax = 2688.0 * torch.exp2(torch.randint(-2, 3, (m, k // 64), generator=gen).float())
    b_amax = 2688.0 * torch.exp2(torch.randint(-2, 3, (n, k // 64), generator=gen).float())
    out = run_windowed(a, sa, b, sb, a_amax, b_amax, 448, out_dtype=torch.float32, path=path)
    d64, _ = expected(a, window_factors(sa, a_amax, 448), b, window_factors(sb, b_amax, 448),
                      None, None, None, None)
    assert torch.equal(out.double().cpu(), d64)


def test_window64_argument_errors(gen):
    from cute_fp4.gemm.dispatch import gemm_nvfp4

    a, sa = rand_fp4(64, 96, gen)
    with pytest.raises(ValueError, match="K % 64"):
        gemm_nvfp4(a.cuda(), sa.cuda(), a.cuda(), sa.cuda(),
                   a_window_amax=torch.ones(64, 1, device="cuda"))
    a, sa = rand_fp4(64, 128, gen)
    with pytest.raises(ValueError, match="a_window_amax must be float32"):
        gemm_nvfp4(a.cuda(), sa.cuda(), a.cuda(), sa.cuda(),
                   a_window_amax=torch.ones(64, 3, device="cuda"))
    win = torch.ones(64, 2, device="cuda")
    with pytest.raises(NotImplementedError, match="at most one window64 operand"):
        gemm_nvfp4(a.cuda(), sa.cuda(), a.cuda(), sa.cuda(), path="predecode",
                   a_window_amax=win, b_window_amax=win)
    with pytest.raises(NotImplementedError, match="cannot be window64"):  # A: the smaller on ties
        gemm_nvfp4(a.cuda(), sa.cuda(), a.cuda(), sa.cuda(), path="weight_stream",
                   a_window_amax=win)
    with pytest.raises(ValueError, match="path 'window' is for window64 operands"):
        gemm_nvfp4(a.cuda(), sa.cuda(), a.cuda(), sa.cuda(), path="window")
    with pytest.raises(ValueError, match="not the window path"):
        gemm_nvfp4(a.cuda(), sa.cuda(), a.cuda(), sa.cuda(), path="window", tile_n=128,
                   a_window_amax=win)


@pytest.mark.parametrize("rows,windows", [(1, 1), (37, 5), (256, 128), (1001, 3)])
@pytest.mark.parametrize("e4m3_max", [448, 256])
def test_window_factors_bit_equal(rows, windows, e4m3_max, gen):
    """gemm_nvfp4's window64 factors (one launch) are the reference's decode scales bit for
    bit, special amaxes included (0, subnormals, S_enc overflow / underflow, Inf, NaN),
    transposed with zero padding rows up to a multiple of 4."""
    from cute_fp4.gemm.factors import window_factors
    from cute_fp4.ref.formats import decode_scale

    amax = _amax_values(rows * windows, gen)[torch.randperm(rows * windows, generator=gen)]
    amax = amax.view(rows, windows).cuda()
    got = window_factors(amax, e4m3_max, "sm_90a")
    pad = -(-rows // 4) * 4
    assert tuple(got.shape) == (pad, windows) and got.stride() == (1, pad)
    want, got_rows = decode_scale(amax, e4m3_max), got[:rows]
    assert torch.equal(got_rows.isnan(), want.isnan())  # NaN payloads aside, bit for bit
    assert torch.equal(got_rows.nan_to_num(0.0).view(torch.int32),
                       want.nan_to_num(0.0).view(torch.int32))
    assert torch.equal(got[rows:], torch.zeros(pad - rows, windows, device="cuda"))


def _amax_values(count, gen):
    """FP32 amaxes: the special cases of the outer-scale formula (0, subnormals, values whose
    S_enc overflows or underflows, Inf, NaN) then random magnitudes over 60 decades."""
    special = torch.tensor([0.0, 1e-45, 1e-40, 1e-38, 1e-30, 1.0, 2688.0, 6.0, 3e38,
                            float("inf"), float("nan"), 448.0 * 6 * 2**100])
    rand = 10.0 ** (torch.rand(count, generator=gen) * 60 - 30)
    return torch.cat([special, rand])[:count].to(torch.float32)


@pytest.mark.parametrize("a_scaling", ["tensor", "token", "window64", "dense"])
@pytest.mark.parametrize("b_scaling", ["tensor", "token", "window64"])
@pytest.mark.parametrize("a_e4m3_max,b_e4m3_max", [(448, 448), (256, 448), (448, 256)])
def test_epilogue_factors_bit_exact(a_scaling, b_scaling, a_e4m3_max, b_e4m3_max, gen):
    """The one-launch epilogue factors (gemm.factors) equal ref.epilogue_factors (run on the
    CPU) bit for bit, NaN for NaN, on every special amax and random ones; absent factors are
    None on both sides."""
    from cute_fp4.common.jit import device_arch
    from cute_fp4.gemm.factors import epilogue_factors

    m, n = 300, 1030
    a_amax = _amax_values(m if a_scaling == "token" else 1, gen)
    b_amax = _amax_values(n if b_scaling == "token" else 1, gen).flip(0)
    if a_scaling == "dense":
        a_amax = None
    got = epilogue_factors(a_scaling, None if a_amax is None else a_amax.cuda(), a_e4m3_max,
                           b_scaling, b_amax.cuda(), b_e4m3_max, device_arch())
    want = ref.epilogue_factors(a_scaling, a_amax, a_e4m3_max, b_scaling, b_amax, b_e4m3_max)
    for name, g, w in zip(("alpha", "row", "col"), got, want):
        assert (g is None) == (w is None), name
        if w is None:
            continue
        g = g.cpu()
        assert g.shape == w.shape and g.dtype == torch.float32, name
        assert torch.equal(g.isnan(), w.isnan()), name
        keep = ~w.isnan()
        assert torch.equal(g[keep].view(torch.int32), w[keep].view(torch.int32)), name


# (path, a_scaling, b_scaling, M, N, K): every kernel that takes OuterAmax epilogue vectors
OUTER_AMAX_CASES = [
    ("w4a16", "dense", "tensor", 3, 300, 256), ("w4a16", "dense", "token", 16, 520, 512),
    ("w4a16", "dense", "token", 40, 4500, 256), ("w4a16", "dense", "tensor", 200, 300, 512),
    ("weight_stream", "token", "tensor", 5, 300, 256),
    ("weight_stream", "tensor", "token", 300, 7, 256),
    ("predecode", "token", "token", 200, 130, 512), ("predecode", "tensor", "token", 40, 300, 256),
    ("decode_both", "token", "tensor", 130, 256, 256),
    ("decode_both", "token", "token", 64, 200, 512),
]


@pytest.mark.parametrize("path,a_scaling,b_scaling,m,n,k", OUTER_AMAX_CASES)
def test_outer_amax_epilogue_bit_equal(path, a_scaling, b_scaling, m, n, k, gen):
    """alpha / row / col given as OuterAmax (decoded in the GEMM kernel's epilogue, what
    cute_fp4.gemm passes) give the same bits as the factors of the factors kernel, NaN for
    NaN, on special amaxes (0, subnormal, Inf, NaN, overflowing S_enc) and random ones; a bias
    rides along."""
    from cute_fp4.common.jit import device_arch
    from cute_fp4.gemm.dispatch import gemm_nvfp4, gemm_w4a16
    from cute_fp4.gemm.factors import epilogue_factors, epilogue_operands

    dev = "cuda"
    b, sb = rand_fp4(n, k, gen)
    b, sb = b.to(dev), swizzle_scales(sb).to(dev)

    def amaxes(scaling, rows):  # per token the special values first, per tensor a random one
        if scaling == "dense":
            return None
        values = _amax_values(rows, gen) if scaling == "token" else _amax_values(13, gen)[12:]
        return values.to(dev)

    a_amax, b_amax = amaxes(a_scaling, m), amaxes(b_scaling, n)
    b_amax = b_amax.flip(0)
    bias = torch.randn(n, generator=gen).to(dev)
    if path == "w4a16":
        a = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
    else:
        a, sa = rand_fp4(m, k, gen)
        a, sa = a.to(dev), swizzle_scales(sa).to(dev)
    arch = device_arch()
    outs = []
    for make in (epilogue_factors, epilogue_operands):
        alpha, row, col = make(a_scaling, a_amax, 448, b_scaling, b_amax, 256, arch)
        if path == "w4a16":
            outs.append(gemm_w4a16(a, b, sb, alpha=alpha, col=col, bias=bias,
                                   scales_swizzled=True, out_dtype=torch.float32))
        else:
            outs.append(gemm_nvfp4(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias,
                                   scales_swizzled=True, out_dtype=torch.float32, path=path))
    want, got = outs
    assert torch.equal(want.isnan(), got.isnan())
    keep = ~want.isnan()
    assert torch.equal(want[keep].view(torch.int32), got[keep].view(torch.int32))
    assert keep.float().mean() > 0.5  # most of D is finite: the test compares values
