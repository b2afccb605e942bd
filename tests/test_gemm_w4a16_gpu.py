"""GPU tests of the sm_90 W4A16 GEMM (cute_fp4.gemm.sm90_w4a16.gemm_w4a16_sm90) against a
float64 matmul of the dequantized weights and against cute_fp4.ref.gemm(a, None, b, scales),
and of the W4A4 GEMM's "weight_stream" path (cute_fp4.gemm.dispatch.gemm_nvfp4 at decode sizes:
the small NVFP4 operand decoded exactly to BF16, this kernel with the other as its weights).

Error bound. Every product a[m, k] * b[n, k] is exact in FP32 (a is BF16/FP16, b = e2m1 * e4m3
is decoded exactly, times a power of two removed exactly later); the only differences are the
FP32 summation order/rounding inside the tensor cores and across the K-split, and the final
cast, checked elementwise:
    |D - D64| <= 2 * eps(out) * |D64| + K * 2**-22 * |alpha col| * sum_k |a_k b_k| + tiny
(eps(out) = 2**-8 bf16, 2**-11 fp16, 2**-24 fp32). Outputs are poisoned with NaN first.
"""

import itertools

import pytest
import torch

from cute_fp4 import ref
from cute_fp4.ref.swizzle import swizzle_scales

from gemm_bounds import check, expected64, rand_fp4, values64, window_amax, window_factors

pytestmark = pytest.mark.gpu


def rand_act(m, k, dtype, gen):
    return (torch.randn(m, k, generator=gen) * 2).to(dtype)


def expected(a, b, sb, alpha=None, col=None, bias=None):
    return expected64(a.double(), values64(b, sb), alpha, None, col, bias)


def run(a, b, sb, *, alpha=None, row=None, col=None, bias=None, out_dtype=torch.bfloat16,
        swizzled=False, transposed=False, **kw):
    from cute_fp4.gemm.sm90_w4a16 import gemm_w4a16_sm90

    dev = "cuda"
    m, n = a.shape[0], b.shape[0]
    out = torch.full((n, m) if transposed else (m, n), float("nan"), dtype=out_dtype,
                     device=dev)
    if swizzled:
        sb = swizzle_scales(sb)
    cu = lambda t: None if t is None else t.to(dev)  # noqa: E731
    res = gemm_w4a16_sm90(a.to(dev), b.to(dev), sb.to(dev), alpha=cu(alpha), row=cu(row),
                          col=cu(col), bias=cu(bias), out_dtype=out_dtype,
                          scales_swizzled=swizzled, out=out, transposed=transposed, **kw)
    assert res.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return out


NK = [(300, 512), (1000, 16), (129, 8192), (72, 176), (4100, 1056), (200, 2064)]


@pytest.mark.parametrize("n,k", NK)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 200])
def test_shapes_vs_float64(m, n, k, gen):
    a = rand_act(m, k, torch.bfloat16, gen)
    b, sb = rand_fp4(n, k, gen)
    out = run(a, b, sb)
    d64, mag = expected(a, b, sb)
    check(out, d64, mag, k, torch.bfloat16)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_epilogue(flags, out_dtype, act_dtype, gen):
    has_alpha, has_col, has_bias = flags
    m, n, k = 5, 136, 320
    a = rand_act(m, k, act_dtype, gen)
    b, sb = rand_fp4(n, k, gen)
    alpha = torch.rand(1, generator=gen) * 0.5 + 0.25 if has_alpha else None
    col = torch.rand(n, generator=gen) + 0.5 if has_col else None
    bias = None
    if has_bias:
        bias_dtype = torch.float32 if out_dtype == torch.bfloat16 else out_dtype
        bias = (torch.randn(n, generator=gen) * 8).to(bias_dtype)
    out = run(a, b, sb, alpha=alpha, col=col, bias=bias, out_dtype=out_dtype)
    d64, mag = expected(a, b, sb, alpha, col, bias)
    check(out, d64, mag, k, out_dtype)
    # the lead's torch reference (FP32, block order) agrees within the same bound
    r = ref.gemm(a, None, b, sb, alpha=alpha, col=col, bias=bias, out_dtype=out_dtype)
    check(r, d64, mag, k, out_dtype)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_full_scale_range(m, act_dtype, gen):
    """E4M3 scales over the whole positive range, subnormals included, FP32 output."""
    n, k = 384, 2048
    a = rand_act(m, k, act_dtype, gen)
    b, sb = rand_fp4(n, k, gen, lo=-9.0, hi=8.8)
    out = run(a, b, sb, out_dtype=torch.float32)
    d64, mag = expected(a, b, sb)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 300, 512), (64, 520, 176), (3, 129, 4096),
                                   (70, 64, 16)])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_swizzled_equals_compact(m, n, k, act_dtype, gen):
    a = rand_act(m, k, act_dtype, gen)
    b, sb = rand_fp4(n, k, gen)
    c = run(a, b, sb, out_dtype=torch.float32)
    s = run(a, b, sb, out_dtype=torch.float32, swizzled=True)
    assert torch.equal(c, s)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_exact_small_sums(act_dtype, gen):
    """Small-integer activations, scale 2: FP32 sums are exact, so the result is bit-exact."""
    m, n, k = 17, 200, 512
    a = torch.randint(-8, 9, (m, k), generator=gen).to(act_dtype)
    b, _ = rand_fp4(n, k, gen)
    sb = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    out = run(a, b, sb, out_dtype=torch.float32)
    d64, _ = expected(a, b, sb)
    assert torch.equal(out.double().cpu(), d64)


CONFIGS = [(8, 1, 4, 1, 1), (16, 4, 8, 2, 1), (64, 2, 2, 1, 1), (32, 1, 8, 3, 1),
           (8, 2, 8, 2, 1), (16, 2, 4, 1, 2), (64, 2, 4, 1, 2), (8, 1, 2, 2, 4)]


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("config", CONFIGS)
def test_configs(config, swizzled, gen):
    """Other (tile_m, row_tiles, k_warps, unroll, row_warps) configurations give the same
    sums (K = 4160: several pipelined stages, then a partial one; N = 333 rows: a partial
    row block at the end), compact and swizzled scales."""
    m, n, k = 40, 333, 4160
    a = rand_act(m, k, torch.bfloat16, gen)
    b, sb = rand_fp4(n, k, gen)
    out = run(a, b, sb, out_dtype=torch.float32, config=config, swizzled=swizzled)
    d64, mag = expected(a, b, sb)
    check(out, d64, mag, k, torch.float32)


def rand_vectors(rows, cols, out_dtype, gen, flags=(True, True, True, True)):
    """alpha [1], row [rows], col [cols], bias [cols] (of the output dtype, FP32 for BF16
    outputs) for the flags (has_alpha, has_row, has_col, has_bias), None where unset."""
    has_alpha, has_row, has_col, has_bias = flags
    bias_dtype = torch.float32 if out_dtype == torch.bfloat16 else out_dtype
    return (torch.rand(1, generator=gen) * 0.5 + 0.25 if has_alpha else None,
            torch.rand(rows, generator=gen) + 0.5 if has_row else None,
            torch.rand(cols, generator=gen) + 0.5 if has_col else None,
            (torch.randn(cols, generator=gen) * 8).to(bias_dtype) if has_bias else None)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_row", [False, True])
def test_row_and_transposed(has_row, act_dtype, out_dtype, transposed, gen):
    """The per-row factor of D (`row`) with alpha / col / bias, and D written transposed
    (D^T [N, M]: row [N], col and bias [M]), partial row and token tiles, K % 32 != 0."""
    m, n, k = 21, 200, 1040
    a = rand_act(m, k, act_dtype, gen)
    b, sb = rand_fp4(n, k, gen)
    d_rows, d_cols = (n, m) if transposed else (m, n)
    alpha, row, col, bias = rand_vectors(d_rows, d_cols, out_dtype, gen,
                                         (True, has_row, True, True))
    out = run(a, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype,
              transposed=transposed)
    va, vb = a.double(), values64(b, sb)
    d64, mag = expected64(vb, va, alpha, row, col, bias) if transposed else \
        expected64(va, vb, alpha, row, col, bias)
    check(out, d64, mag, k, out_dtype)


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[5], CONFIGS[6], CONFIGS[7]])
def test_configs_transposed(config, gen):
    """The transposed epilogue (tokens are D's columns: consecutive threads take consecutive
    tokens) with other CTA shapes (row_warps 2 and 4, tile_m 8 to 64), swizzled scales,
    row / col / bias."""
    m, n, k = 40, 333, 4160
    a = rand_act(m, k, torch.bfloat16, gen)
    b, sb = rand_fp4(n, k, gen)
    alpha, row, col, bias = rand_vectors(n, m, torch.float32, gen)
    out = run(a, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=torch.float32,
              config=config, swizzled=True, transposed=True)
    d64, mag = expected64(values64(b, sb), a.double(), alpha, row, col, bias)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("graph", [False, True])
def test_chained_launches(graph, gen):
    """Each GEMM reads the previous one's output: a chain of 4 (N = K) launched back to back,
    eager or from a CUDA graph (as the benchmark replays it), equals the same GEMMs with a
    device synchronisation between them, bit for bit."""
    from cute_fp4.gemm.sm90_w4a16 import gemm_w4a16_sm90

    m, n = 3, 1024
    b, sb = (t.cuda() for t in rand_fp4(n, n, gen))
    x0 = rand_act(m, n, torch.bfloat16, gen).cuda()
    alpha = torch.full((1,), 1 / 64, device="cuda")  # keeps the chain in range
    step = lambda x, out: gemm_w4a16_sm90(x, b, sb, alpha=alpha, out=out)  # noqa: E731
    want = [x0]
    for _ in range(4):
        want.append(step(want[-1], None))
        torch.cuda.synchronize()
    outs = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            for _ in range(4)]

    def chain():
        x = x0
        for o in outs:
            x = step(x, o)

    if graph:
        chain()  # compiles outside the capture
        for o in outs:
            o.fill_(float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        g.replay()
    else:
        chain()
    torch.cuda.synchronize()
    for o, w in zip(outs, want[1:]):
        assert torch.equal(o, w)
    assert want[-1].abs().max() > 0


@pytest.mark.parametrize("m,k", [(3, 64), (5, 128), (1, 320), (16, 320), (64, 320), (70, 320),
                                 (300, 320), (1, 2112), (20, 2112), (40, 2112)])
@pytest.mark.parametrize("e4m3_max,swizzled", [(448, False), (256, True)])
@pytest.mark.parametrize("out_dtype,has_bias", [(torch.bfloat16, False), (torch.float32, True)])
def test_window64_weights(m, k, e4m3_max, swizzled, out_dtype, has_bias, gen):
    """W4A16 with window64 weights (gemm_w4a16's "auto" path: up to 16 tokens the streaming
    kernel with its per-window partial tiles, token tiles of 8 and 16, beyond the mixed kernel
    with x_window): within the float64 bound of the reference's
    FP32 block factors scale * S_dec(window amax), outlier and all-zero windows included,
    compact and swizzled scales, K = 64 (one window: half a chunk, the masked tail only), 128
    (one chunk), odd counts of windows (K = 320: a half chunk in the masked tail; K = 2112:
    full stages too)."""
    from cute_fp4.gemm.dispatch import gemm_w4a16

    n = 200
    a = rand_act(m, k, torch.bfloat16, gen)
    b, sb = rand_fp4(n, k, gen)
    amax = window_amax(n, k, gen)
    bias = torch.randn(n, generator=gen) * 4 if has_bias else None
    out = gemm_w4a16(a.cuda(), b.cuda(), (swizzle_scales(sb) if swizzled else sb).cuda(),
                     bias=None if bias is None else bias.cuda(), out_dtype=out_dtype,
                     scales_swizzled=swizzled, b_window_amax=amax.cuda(), e4m3_max=e4m3_max)
    d64, mag = expected64(a.double(), values64(b, window_factors(sb, amax, e4m3_max)), None,
                          None, None, bias)
    check(out, d64, mag, k, out_dtype)


def test_window64_weights_wide_tiles(gen):
    """W4A16 prefill with window64 weights where the mixed kernel takes 256-token tiles (its
    window products in 64-column slices): within the float64 bound (the W4A4
    predecode path checks these tiles against 128-wide ones bit for bit)."""
    from cute_fp4.gemm.dispatch import gemm_w4a16
    from cute_fp4.gemm.sm90_mixed import pick_mixed_config

    m, n, k = 2048, 4096, 320
    assert pick_mixed_config(n, m, x_window=True).tile_n == 256
    a = rand_act(m, k, torch.bfloat16, gen)
    b, sb = rand_fp4(n, k, gen)
    amax = window_amax(n, k, gen)
    out = gemm_w4a16(a.cuda(), b.cuda(), swizzle_scales(sb).cuda(), scales_swizzled=True,
                     b_window_amax=amax.cuda(), out_dtype=torch.float32)
    d64, mag = expected64(a.double(), values64(b, window_factors(sb, amax, 448)), None, None,
                          None, None)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("m", [1, 40])
def test_window64_weights_outside_fast_domain(m, gen):
    """The streaming kernel decodes its window factors without the IEEE slow paths only where a
    warp's amaxes all lie in the fast domain (0 or [2**-100, 2**100]), else with them. Rows 0-31
    (whole CTAs) have only windows of amax 2**-110 and 2**-140 (subnormal: S_enc capped at
    FLT_MAX, S_dec subnormal), rows 32-63 normal windows with some of 2**110, rows 64-95 normal
    ones: each block of rows within the bound of its own magnitude (the result scaled by
    2**100 in float64, so that the tiny rows are not under the bound's absolute floor)."""
    from cute_fp4.gemm.dispatch import gemm_w4a16

    n, k = 96, 2112
    a = rand_act(m, k, torch.bfloat16, gen)
    b, sb = rand_fp4(n, k, gen)
    amax = window_amax(n, k, gen, outliers=False)
    pick = torch.rand(amax.shape, generator=gen)
    amax[:32] = torch.where(pick[:32] < 0.2, 2.0**-140, 2.0**-110)
    amax[32:64] = torch.where(pick[32:64] < 0.1, torch.full_like(amax[32:64], 2.0**110),
                              amax[32:64])
    out = gemm_w4a16(a.cuda(), b.cuda(), sb.cuda(), out_dtype=torch.float32,
                     b_window_amax=amax.cuda())
    d64, mag = expected64(a.double(), values64(b, window_factors(sb, amax, 448)), None, None,
                          None, None)
    check(out.double() * 2.0**100, d64 * 2.0**100, mag * 2.0**100, k, torch.float32)


@pytest.mark.parametrize("m,k", [(1, 320), (20, 2112), (70, 320), (300, 2112)])
@pytest.mark.parametrize("path,act_dtype", [("stream", torch.bfloat16),
                                            ("stream", torch.float16),
                                            ("mixed", torch.bfloat16),
                                            ("mixed", torch.float16)])
def test_window64_weights_paths(m, k, path, act_dtype, gen):
    """Both of gemm_w4a16's kernels for window64 weights at any M (the streaming kernel with
    its per-window partials, token tile 64 and several grid rows included; the mixed kernel
    with x_window at decode and prefill configurations), BF16 and FP16 activations, swizzled
    scales, a bias: within the float64 bound."""
    from cute_fp4.gemm.dispatch import gemm_w4a16

    n = 200
    a = rand_act(m, k, act_dtype, gen)
    b, sb = rand_fp4(n, k, gen)
    amax = window_amax(n, k, gen)
    bias = torch.randn(n, generator=gen)
    out = gemm_w4a16(a.cuda(), b.cuda(), swizzle_scales(sb).cuda(), bias=bias.cuda(),
                     scales_swizzled=True, b_window_amax=amax.cuda(), path=path)
    d64, mag = expected64(a.double(), values64(b, window_factors(sb, amax, 448)), None, None,
                          None, bias)
    check(out, d64, mag, k, torch.bfloat16)


def test_w4a16_path_errors(gen):
    from cute_fp4.gemm.dispatch import gemm_w4a16

    a = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    b, sb = (t.cuda() for t in rand_fp4(64, 128, gen))
    for path in ("tma", "window"):  # the window kernel left W4A16 in session 56
        with pytest.raises(ValueError, match="path must be one of"):
            gemm_w4a16(a, b, sb, path=path)
    want = gemm_w4a16(a, b, sb)
    for path in ("stream", "mixed"):  # plain weights: both kernels, the same sum
        torch.testing.assert_close(gemm_w4a16(a, b, sb, path=path), want, rtol=2e-2, atol=1e-2)
    with pytest.raises(NotImplementedError, match="sm_90a"):
        gemm_w4a16(a.cpu(), b.cpu(), sb.cpu(), path="mixed")


def test_window64_weights_errors(gen):
    from cute_fp4.gemm.dispatch import gemm_w4a16

    b, sb = (t.cuda() for t in rand_fp4(64, 128, gen))
    amax = torch.ones(64, 2, device="cuda")
    a16 = torch.randn(4, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="2D bfloat16 or float16"):
        gemm_w4a16(a16.float(), b, sb, b_window_amax=amax)
    with pytest.raises(ValueError, match="a must be"):
        gemm_w4a16(a16.to(torch.bfloat16)[:, :64], b, sb, b_window_amax=amax)
    with pytest.raises(ValueError, match="b_window_amax must be float32"):
        gemm_w4a16(a16.to(torch.bfloat16), b, sb, b_window_amax=amax[:, :1])
    b, sb = (t.cuda() for t in rand_fp4(64, 96, gen))
    with pytest.raises(ValueError, match="K % 64"):
        gemm_w4a16(torch.randn(4, 96, device="cuda", dtype=torch.bfloat16), b, sb,
                   b_window_amax=torch.ones(64, 1, device="cuda"))


def test_argument_errors(gen):
    from cute_fp4.gemm.sm90_w4a16 import gemm_w4a16_sm90

    a = rand_act(4, 64, torch.bfloat16, gen).cuda()
    b, sb = (t.cuda() for t in rand_fp4(32, 64, gen))
    with pytest.raises(TypeError):
        gemm_w4a16_sm90(a.float(), b, sb)
    with pytest.raises(TypeError):
        gemm_w4a16_sm90(a, b.to(torch.int8), sb)
    with pytest.raises(ValueError):
        gemm_w4a16_sm90(a[:, :48].contiguous(), b, sb)  # K mismatch
    with pytest.raises(ValueError):
        gemm_w4a16_sm90(a, b, sb[:, :3])
    with pytest.raises(ValueError):
        gemm_w4a16_sm90(a, b, sb, scales_swizzled=True)
    with pytest.raises(ValueError):
        gemm_w4a16_sm90(a, b, sb, col=torch.ones(31, device="cuda"))
    with pytest.raises(TypeError):
        gemm_w4a16_sm90(a, b, sb, bias=torch.ones(32, device="cuda", dtype=torch.float16))
    with pytest.raises(TypeError):
        gemm_w4a16_sm90(a, b, sb, out_dtype=torch.int32)


# ---- W4A4 at decode sizes: gemm_nvfp4's "weight_stream" path ----

def run_nvfp4(a, sa, b, sb, *, alpha=None, row=None, col=None, bias=None,
              out_dtype=torch.bfloat16, swizzled=False, path="auto"):
    """gemm_nvfp4 on CUDA copies of the operands into a NaN-poisoned `out`."""
    from cute_fp4.gemm.dispatch import gemm_nvfp4

    dev = "cuda"
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=out_dtype, device=dev)
    if swizzled:
        sa, sb = swizzle_scales(sa), swizzle_scales(sb)
    cu = lambda t: None if t is None else t.to(dev)  # noqa: E731
    res = gemm_nvfp4(a.to(dev), sa.to(dev), b.to(dev), sb.to(dev), alpha=cu(alpha),
                     row=cu(row), col=cu(col), bias=cu(bias), out_dtype=out_dtype,
                     scales_swizzled=swizzled, out=out, path=path)
    assert res.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return out


def expected_nvfp4(a, sa, b, sb, alpha=None, row=None, col=None, bias=None):
    return expected64(values64(a, sa), values64(b, sb), alpha, row, col, bias)


@pytest.fixture
def weight_stream_calls(monkeypatch):
    """The (rows of A, rows of B) of every gemm_nvfp4 call that took the weight_stream path."""
    from cute_fp4.gemm import dispatch

    calls = []
    real = dispatch._gemm_weight_stream

    def spy(a_data, sfa, b_data, *args):
        calls.append((a_data.shape[0], b_data.shape[0]))
        return real(a_data, sfa, b_data, *args)

    monkeypatch.setattr(dispatch, "_gemm_weight_stream", spy)
    return calls


def orient(m, n, small):
    """(M, N) with the small operand (`small` rows of the pair) as A or as B."""
    return (m, n) if small == "a" else (n, m)


WS_SHAPES = [(1, 300, 512), (1, 1001, 16), (3, 129, 8192), (16, 4100, 1056), (64, 77, 2064),
             (64, 520, 176), (3, 3, 64), (1, 8192, 8192)]


@pytest.mark.parametrize("small", ["a", "b"])
@pytest.mark.parametrize("m,n,k", WS_SHAPES)
def test_weight_stream_shapes(m, n, k, small, weight_stream_calls, gen):
    """The weight_stream path (taken by "auto" where `stream_weights` says so, asked for by
    name beyond), with the small operand as A (the activations) or as B (then A's rows are the
    kernel's weight rows, D written from the transposed tile); odd N, K = 16 and 8192,
    K % 32 != 0."""
    from cute_fp4.gemm.dispatch import stream_weights

    m, n = orient(m, n, small)
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    auto = stream_weights(min(m, n))
    out = run_nvfp4(a, sa, b, sb, path="auto" if auto else "weight_stream")
    assert weight_stream_calls == [(m, n)]
    d64, mag = expected_nvfp4(a, sa, b, sb)
    check(out, d64, mag, k, torch.bfloat16)


@pytest.mark.parametrize("small", ["a", "b"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=4)))
def test_weight_stream_epilogue(flags, out_dtype, small, weight_stream_calls, gen):
    """Every epilogue combination (alpha on the device, row [M], col [N], bias [N]) and output
    dtype, against float64 and the reference, in both orientations."""
    m, n = orient(5, 136, small)
    k = 320
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    alpha, row, col, bias = rand_vectors(m, n, out_dtype, gen, flags)
    out = run_nvfp4(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias,
                    out_dtype=out_dtype)
    assert weight_stream_calls == [(m, n)]
    d64, mag = expected_nvfp4(a, sa, b, sb, alpha, row, col, bias)
    check(out, d64, mag, k, out_dtype)
    r = ref.gemm(a, sa, b, sb, alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype)
    check(r, d64, mag, k, out_dtype)


@pytest.mark.parametrize("m,n", [(1, 520), (16, 300), (300, 16)])
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_weight_stream_quantized_operands(scaling, swizzle, m, n, weight_stream_calls):
    """Operands quantized on the GPU (per-tensor: alpha; per-token: row and col factors),
    compact or swizzled scales, through the public cute_fp4.gemm: the weight_stream result is
    within the bound of the float64 sum and of the CPU reference path."""
    import cute_fp4
    from cute_fp4 import Recipe
    from cute_fp4.ref import epilogue_factors
    from cute_fp4.ref.swizzle import unswizzle_scales

    k = 1024
    recipe = Recipe(scaling=scaling, swizzle=swizzle)
    x = torch.randn(m, k, device="cuda") * torch.logspace(-2, 2, m, device="cuda")[:, None]
    qa = cute_fp4.quantize(x, recipe)
    qb = cute_fp4.quantize(torch.randn(n, k, device="cuda"), recipe)
    bias = torch.randn(n, device="cuda")
    got = cute_fp4.gemm(qa, qb, bias=bias, out_dtype=torch.float32)
    assert weight_stream_calls == [(m, n)]
    qa, qb = qa.to("cpu"), qb.to("cpu")
    want = cute_fp4.gemm(qa, qb, bias=bias.cpu(), out_dtype=torch.float32)
    alpha, row, col = epilogue_factors(scaling, qa.amax, 448, scaling, qb.amax, 448)

    def compact(t):
        return unswizzle_scales(t.scales, t.rows, k // 16) if swizzle else t.scales

    d64, mag = expected_nvfp4(qa.data, compact(qa), qb.data, compact(qb), alpha, row, col,
                              bias.cpu())
    check(got, d64, mag, k, torch.float32)
    check(want, d64, mag, k, torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 300, 512), (64, 129, 176), (200, 3, 4096)])
def test_weight_stream_swizzled_equals_compact(m, n, k, gen):
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    c = run_nvfp4(a, sa, b, sb, out_dtype=torch.float32, path="weight_stream")
    s = run_nvfp4(a, sa, b, sb, out_dtype=torch.float32, swizzled=True, path="weight_stream")
    assert torch.equal(c, s)


@pytest.mark.parametrize("small", ["a", "b"])
def test_weight_stream_full_scale_range(small, gen):
    """E4M3 scales over the whole positive range, subnormals included, on both operands (the
    decoded activations hold e2m1 * scale exactly in BF16), FP32 output."""
    m, n = orient(16, 384, small)
    k = 2048
    a, sa = rand_fp4(m, k, gen, lo=-9.0, hi=8.8)
    b, sb = rand_fp4(n, k, gen, lo=-9.0, hi=8.8)
    out = run_nvfp4(a, sa, b, sb, out_dtype=torch.float32, path="weight_stream")
    d64, mag = expected_nvfp4(a, sa, b, sb)
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("small", ["a", "b"])
def test_weight_stream_exact_small_sums(small, gen):
    """Small integers (scales 1 and 2): every FP32 sum is exact, so the result is bit-exact."""
    m, n = orient(17, 200, small)
    k = 512
    a, _ = rand_fp4(m, k, gen)
    b, _ = rand_fp4(n, k, gen)
    sa = torch.ones(m, k // 16).to(torch.float8_e4m3fn)
    sb = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    out = run_nvfp4(a, sa, b, sb, out_dtype=torch.float32, path="weight_stream")
    d64, _ = expected_nvfp4(a, sa, b, sb)
    assert torch.equal(out.double().cpu(), d64)


def test_weight_stream_dispatch(weight_stream_calls, gen):
    """"auto" takes weight_stream exactly when `stream_weights` says so (up to 16 rows) and no
    window64 operand is given (else predecode / window)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = 64
    many = 32 * sms + 1
    for m, n, taken in ((16, 300, True), (300, 16, True), (17, 300, False), (300, 64, False),
                        (65, 300, False), (300, 65, False), (16, many, True),
                        (17, many, False), (many, 17, False)):
        weight_stream_calls.clear()
        a, sa = rand_fp4(m, k, gen)
        b, sb = rand_fp4(n, k, gen)
        out = run_nvfp4(a, sa, b, sb, out_dtype=torch.float32)
        assert weight_stream_calls == ([(m, n)] if taken else [])
        d64, mag = expected_nvfp4(a, sa, b, sb)
        check(out, d64, mag, k, torch.float32)
    weight_stream_calls.clear()
    m, n = 3, 40
    a, sa = rand_fp4(m, k, gen)
    b, sb = rand_fp4(n, k, gen)
    amax = torch.full((m, k // 64), 2688.0)
    from cute_fp4.gemm.dispatch import gemm_nvfp4

    out = gemm_nvfp4(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), a_window_amax=amax.cuda(),
                     out_dtype=torch.float32)
    assert weight_stream_calls == []
    d64, mag = expected_nvfp4(a, sa, b, sb)
    check(out, d64, mag, k, torch.float32)
    out = run_nvfp4(a, sa, b, sb, out_dtype=torch.float32, path="weight_stream")
    assert weight_stream_calls == [(m, n)]
    check(out, d64, mag, k, torch.float32)


@pytest.mark.parametrize("small", ["a", "b"])
def test_weight_stream_cuda_graph(small, monkeypatch, gen):
    """Replayed from a CUDA graph, the weight_stream path gives the eager result bit for bit,
    also when its unit outer scale is first made inside the capture (not cached then)."""
    from cute_fp4.gemm import dispatch

    m, n = orient(3, 1000, small)
    k = 1024
    a, sa, b, sb = (t.cuda() for t in (*rand_fp4(m, k, gen), *rand_fp4(n, k, gen)))
    row = torch.rand(m, generator=gen).cuda() + 0.5
    want = dispatch.gemm_nvfp4(a, sa, b, sb, row=row)  # compiles outside the capture
    monkeypatch.setattr(dispatch, "_UNIT_AMAX", {})
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dispatch.gemm_nvfp4(a, sa, b, sb, row=row, out=out)
    assert dispatch._UNIT_AMAX == {}
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_weight_stream_argument_errors(gen):
    from cute_fp4.gemm.dispatch import gemm_nvfp4

    a, sa = (t.cuda() for t in rand_fp4(3, 128, gen))
    b, sb = (t.cuda() for t in rand_fp4(40, 128, gen))
    with pytest.raises(NotImplementedError, match="cannot be window64"):
        gemm_nvfp4(a, sa, b, sb, a_window_amax=torch.ones(3, 2, device="cuda"),
                   path="weight_stream")
    with pytest.raises(ValueError, match="tile_n and stages"):
        gemm_nvfp4(a, sa, b, sb, tile_n=128)
    with pytest.raises(ValueError, match="path must be one of"):
        gemm_nvfp4(a, sa, b, sb, path="stream")
