"""GPU tests of the sm_90 W4A16 GEMM (cute_fp4.gemm.sm90_w4a16.gemm_w4a16_sm90) against a
float64 matmul of the dequantized weights and against cute_fp4.ref.gemm(a, None, b, scales).

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

from gemm_bounds import rand_fp4, values64, expected64, check

pytestmark = pytest.mark.gpu


def rand_act(m, k, dtype, gen):
    return (torch.randn(m, k, generator=gen) * 2).to(dtype)


def expected(a, b, sb, alpha=None, col=None, bias=None):
    return expected64(a.double(), values64(b, sb), alpha, None, col, bias)


def run(a, b, sb, *, alpha=None, col=None, bias=None, out_dtype=torch.bfloat16,
        swizzled=False, **kw):
    from cute_fp4.gemm.sm90_w4a16 import gemm_w4a16_sm90

    dev = "cuda"
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev)
    if swizzled:
        sb = swizzle_scales(sb)
    cu = lambda t: None if t is None else t.to(dev)  # noqa: E731
    res = gemm_w4a16_sm90(a.to(dev), b.to(dev), sb.to(dev), alpha=cu(alpha), col=cu(col),
                          bias=cu(bias), out_dtype=out_dtype, scales_swizzled=swizzled,
                          out=out, **kw)
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
