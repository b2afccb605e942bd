"""The public API on CUDA tensors end to end: GEMM dispatch (W4A4, W4A16 decode and prefill,
window64 operands, twins) against the reference on the same quantized operands."""

import dataclasses

import pytest
import torch

from quant_checks import check, rht_exact_blocks

import cute_fp4
from cute_fp4 import Recipe, api, ref

pytestmark = pytest.mark.gpu


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# 16-bit outputs: the result is rounded once to bf16/fp16 (2^-9 / 2^-11 relative), the W4A16
# prefill path rounds its dense GEMM once more; fp32 outputs differ only in summation order.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("m", [1, 16, 64, 65, 300])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensor", "token", "window64"])
def test_w4a16_decode_and_prefill(m, out_dtype, scaling):
    w = cute_fp4.quantize(torch.randn(256, 512, device="cuda"), Recipe(scaling=scaling))
    a = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda")
    got = cute_fp4.gemm(a, w, bias=bias, out_dtype=out_dtype)
    want = cute_fp4.gemm(a.cpu(), w.to("cpu"), bias=bias.cpu(), out_dtype=torch.float32)
    assert got.shape == (m, 256) and got.dtype == out_dtype
    assert _rel(got.cpu(), want) < TOL[out_dtype]


@pytest.mark.parametrize("a_scaling,b_scaling", [("tensor", "tensor"), ("token", "tensor"),
                                                 ("window64", "tensor"), ("token", "window64"),
                                                 ("window64", "window64")])
@pytest.mark.parametrize("swizzle", [(False, False), (True, False), (True, True)])
def test_w4a4_operand_kinds(a_scaling, b_scaling, swizzle):
    x = torch.randn(192, 256, device="cuda") * torch.logspace(-2, 2, 192, device="cuda")[:, None]
    a = cute_fp4.quantize(x, Recipe(scaling=a_scaling, swizzle=swizzle[0]))
    b = cute_fp4.quantize(torch.randn(128, 256, device="cuda"),
                          Recipe(scaling=b_scaling, swizzle=swizzle[1]))
    got = cute_fp4.gemm(a, b, out_dtype=torch.float32)
    want = cute_fp4.gemm(a.to("cpu"), b.to("cpu"), out_dtype=torch.float32)
    assert _rel(got.cpu(), want) < TOL[torch.float32]


def test_training_gemms_from_twins():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    xq = cute_fp4.quantize(x, Recipe(scaling="token", columnwise=True))
    wq = cute_fp4.quantize(w, Recipe(columnwise=True))
    dyq = cute_fp4.quantize(dy, Recipe(scaling="token", columnwise=True))
    for a, b in ((xq, wq), (dyq, wq.t()), (dyq.t(), xq.t())):
        got = cute_fp4.gemm(a, b, out_dtype=torch.float32)
        want = cute_fp4.gemm(a.to("cpu"), b.to("cpu"), out_dtype=torch.float32)
        assert _rel(got.cpu(), want) < TOL[torch.float32]


@pytest.mark.parametrize("recipe", [
    Recipe(scaling="token", columnwise=True, swizzle=True),
    Recipe(block=(16, 16), columnwise=True),
    Recipe(rht=True, columnwise=True, stochastic_rounding=True),
    Recipe(scaling="window64", columnwise=True),
    Recipe(four_over_six="mse", columnwise=True),
    Recipe(four_over_six="mae", e4m3_max=256, block=(16, 16), columnwise=True),
    Recipe(four_over_six="mse", fast_math=True, scaling="token", columnwise=True),
], ids=lambda r: f"{r.scaling}-{r.block[0]}-{r.four_over_six}-{r.rht}-{r.stochastic_rounding}")
def test_reference_is_device_independent(recipe):
    """The reference gives the same bytes on CPU and CUDA (every division is IEEE on both)."""
    x = torch.randn(128, 256) * torch.logspace(-3, 3, 256)
    cpu = ref.quantize(x, recipe, seed=3, offset=5)
    gpu = ref.quantize(x.cuda(), recipe, seed=3, offset=5)
    for name in ("data", "scales", "amax", "data_t", "scales_t", "amax_t"):
        a, b = getattr(cpu, name), getattr(gpu, name).cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [
    Recipe(scaling="token", columnwise=True, rht=True, stochastic_rounding=True, swizzle=True),
    Recipe(scaling="tensor", columnwise=True, rht=True, stochastic_rounding=True),
    Recipe(scaling="tensor", rowwise=True, stochastic_rounding=True),  # rowwise only: no RHT
    Recipe(scaling="token", columnwise=True, four_over_six="mse"),
    Recipe(scaling="tensor", columnwise=True),  # the plain cast: a torch sum
    Recipe(scaling="window64", columnwise=True),  # no amax pass: a torch sum
], ids=["token_rht_sr", "tensor_rht_sr", "tensor_row_sr", "token_4over6", "plain", "window64"])
@pytest.mark.parametrize("shape", [(64, 16), (1088, 2064), (4160, 768)])
def test_quantize_dbias(recipe, dtype, shape):
    """The column sums next to the quantization: the NVFP4 outputs are the bytes of quantize()
    with the same Philox state, the sums are within FP32 summation-order error of the float64
    column sums (a bound of 1e-5 x sum |x| per column: at most ~100 FP32 roundings along any
    path of the fixed-order reduction), and repeated calls give identical sums."""
    torch.manual_seed(torch.randint(0, 2**31, (1,)).item())
    m, k = shape
    if recipe.scaling == "window64" and k % 64:
        k += 64 - k % 64
    dy = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, k, device="cuda")
          + 0.5).to(dtype)
    rng = torch.tensor([11, 5], dtype=torch.int64, device="cuda")
    t, sums = cute_fp4.quantize_dbias(dy, recipe, rng_state=rng)
    again = cute_fp4.quantize_dbias(dy, recipe, rng_state=rng)[1]
    check(t, cute_fp4.quantize(dy, recipe, rng_state=rng), recipe)
    exact = dy.double().sum(0)
    assert sums.dtype == torch.float32 and sums.shape == (k,)
    assert ((sums.double() - exact).abs() <= 1e-5 * dy.double().abs().sum(0)).all()
    assert torch.equal(sums, again)
    assert not torch.equal(sums, torch.zeros_like(sums))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("options", [dict(), dict(swizzle=True), dict(stochastic_rounding=True),
                                     dict(four_over_six="mse")], ids=["rn", "swizzle", "sr", "4over6"])
def test_rowwise_rht_runs_without_it(dtype, scaling, options):
    """A rowwise-only recipe's rht changes no byte (Recipe.twin_rht): cute_fp4.quantize gives
    the reference's bytes through the kernels of the recipe without it (the plain cast, at the
    same speed, for RN: it took the recipe kernel before) and keeps the caller's recipe."""
    x = (torch.randn(1040, 2064, device="cuda") * torch.logspace(-3, 3, 2064, device="cuda")
         ).to(dtype)
    recipe = Recipe(scaling=scaling, rht=True, **options)
    rng = torch.tensor([torch.randint(0, 2**62, (1,)).item(), 9], dtype=torch.int64,
                       device="cuda")
    got = cute_fp4.quantize(x, recipe, rng_state=rng)
    assert got.recipe == recipe
    check(got, ref.quantize(x, recipe, seed=rng[0].item(), offset=9), recipe)
    plain = recipe.replace(rht=False)
    check(got, cute_fp4.quantize(x, plain, rng_state=rng), plain)
    rn = set(options) <= {"swizzle"}  # the plain cast's recipes
    assert (api.ops.plain_cast_plan(x, recipe) is not None) == rn


OUT_FIELDS = ("data", "scales", "amax", "data_t", "scales_t", "amax_t")


def _poison(t):
    for name in OUT_FIELDS:
        f = getattr(t, name)
        if f is not None:
            f.view(torch.uint8).fill_(0xFF)


@pytest.mark.parametrize("shape,recipe,path", [
    ((16, 64), Recipe(), "fused"),
    ((128, 128), Recipe(columnwise=True), "fused"),
    ((128, 128), Recipe(scaling="token", columnwise=True), "fused"),
    ((16, 64), Recipe(scaling="token", rowwise=False, columnwise=True), "fused"),
    ((16, 64), Recipe(scaling="token"), "rows"),
    ((2, 512, 1024), Recipe(scaling="token", swizzle=True), "rows"),
    ((1008, 2048), Recipe(columnwise=True), "two launches"),
    ((1008, 2000), Recipe(scaling="token", columnwise=True, swizzle=True), "two launches"),
    ((1008, 2048), Recipe(scaling="token", rowwise=False, columnwise=True), "two launches"),
    ((2, 512, 1024), Recipe(swizzle=True), "two launches"),
    ((128, 128), Recipe(block=(16, 16), columnwise=True), "fused"),
    ((1008, 2048), Recipe(block=(16, 16), columnwise=True, swizzle=True), "two launches"),
    ((512, 1024), Recipe(rht=True, stochastic_rounding=True, columnwise=True), "recipe"),
    ((512, 1024), Recipe(scaling="window64", columnwise=True, swizzle=True), "recipe"),
    ((512, 1024), Recipe(block=(16, 16), four_over_six="mse", columnwise=True), "recipe"),
    ((512, 1024), Recipe(scaling="token", rht=True, columnwise=True), "recipe"),
    ((2, 520, 1040), Recipe(scaling="token", stochastic_rounding=True, swizzle=True), "recipe"),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("distinct_amax", [False, True])
def test_quantize_out_in_place(shape, recipe, path, distinct_amax):
    """quantize(x, out=t) returns t itself, its (poisoned) field tensors holding the bytes of a
    fresh quantize(x); also when t's amax and amax_t are separate tensors (the plain per-tensor
    cast returns one [1] for both) and from inside a CUDA graph, replayed on new data."""
    from cute_fp4.quant import dispatch

    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, (1,)).item())
    x = (torch.randn(shape, generator=gen) * torch.logspace(-2, 2, shape[-1])).cuda()
    x = x.to(torch.bfloat16)
    if path != "recipe":
        plan = dispatch.plan_for(x, recipe)
        assert plan.fused == (path == "fused")
        assert (plan.token_rows is not None) == (path == "rows")
    out = cute_fp4.quantize(torch.randn_like(x), recipe, seed=4)
    if distinct_amax:
        out = dataclasses.replace(out, **{n: getattr(out, n).clone() for n in ("amax", "amax_t")
                                          if getattr(out, n) is not None})
    fields = {n: getattr(out, n) for n in OUT_FIELDS}
    _poison(out)
    assert cute_fp4.quantize(x, recipe, seed=4, out=out) is out
    check(out, cute_fp4.quantize(x, recipe, seed=4), recipe)
    assert all(getattr(out, n) is fields[n] for n in OUT_FIELDS)
    # the next call with this out runs the remembered plan directly (plain cast)
    assert (api._last_out.plan is not None) == (path != "recipe")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_fp4.quantize(x, recipe, seed=4, out=out)
    x.copy_(x.flip(0) * 3)
    _poison(out)
    graph.replay()
    torch.cuda.synchronize()
    check(out, cute_fp4.quantize(x, recipe, seed=4), recipe)


@pytest.mark.parametrize("recipe", [Recipe(stochastic_rounding=True, columnwise=True),
                                    Recipe(scaling="token", rht=True, columnwise=True),
                                    Recipe(scaling="window64", columnwise=True)],
                         ids=["sr", "token_rht", "window64"])
def test_recipe_quantize_layout_errors(recipe):
    """The recipe kernels' own layout requirements hold through the public API, which
    validates everything else once: a misaligned input and rows of less than 16 bytes are
    refused with their errors, and a valid input of the same shape still quantizes."""
    base = torch.randn(128 * 64 + 1, device="cuda")
    with pytest.raises(ValueError, match=r"x must be 16-byte aligned"):
        cute_fp4.quantize(base[1:].view(128, 64), recipe)
    with pytest.raises(ValueError, match=r"rows of 4 elements are not a multiple of 16 bytes"):
        cute_fp4.quantize(torch.randn(128, 4, device="cuda", dtype=torch.bfloat16),
                          recipe.replace(rowwise=False))
    x = base[:-1].view(128, 64)
    rht = {"twin_agree": 0.999, "twin_exact": rht_exact_blocks(x)} if recipe.rht else {}
    check(cute_fp4.quantize(x, recipe), ref.quantize(x, recipe), recipe, **rht)


def test_quantize_out_alignment():
    """The kernels store data and scales with 16-byte vectors: a misaligned out is refused;
    the remembered out's direct path still checks the input's layout."""
    r = Recipe()
    x = torch.randn(64, 64, device="cuda")
    out = cute_fp4.quantize(x, r)
    cute_fp4.quantize(x, r, out=out)
    assert api._out_hit(out, x.t(), r) is not None
    with pytest.raises(ValueError, match=r"x must be contiguous"):
        cute_fp4.quantize(x.t(), r, out=out)
    with pytest.raises(ValueError, match=r"x must be 16-byte aligned"):
        cute_fp4.quantize(torch.randn(64 * 64 + 1, device="cuda")[1:].view(64, 64), r, out=out)
    bad = torch.empty(64 * 32 + 8, dtype=torch.uint8, device="cuda")[8:].view(64, 32)
    with pytest.raises(ValueError, match=r"out.data must be a contiguous, 16-byte aligned"):
        cute_fp4.quantize(x, Recipe(), out=dataclasses.replace(out, data=bad))
    with pytest.raises(ValueError, match=r"out.data must be .* on cuda:0"):
        cute_fp4.quantize(x, Recipe(), out=out.to("cpu"))


def _w4a16_general(a, w, out_dtype, bias=None):
    """The W4A16 GEMM through the general dispatch with the factors kernel's alpha / col (what
    cute_fp4.gemm ran before its remembered-weights path)."""
    from cute_fp4.common.jit import device_arch
    from cute_fp4.gemm.dispatch import gemm_w4a16
    from cute_fp4.gemm.factors import epilogue_factors

    alpha, _, col = epilogue_factors("dense", None, 448, w.recipe.scaling, w.amax,
                                     w.recipe.e4m3_max, device_arch())
    d = gemm_w4a16(a.reshape(-1, w.cols), w.data, w.scales, alpha=alpha, col=col, bias=bias,
                   out_dtype=out_dtype, scales_swizzled=w.recipe.swizzle)
    return d.view(a.shape[:-1] + (w.rows,))


def _prepared_calls(monkeypatch):
    """The argument tuples of the PreparedWeights.w4a16 calls from now on (they still run)."""
    from cute_fp4.gemm import dispatch

    calls = []
    fast = dispatch.PreparedWeights.w4a16

    def counted(self, *args):
        calls.append(args)
        return fast(self, *args)

    monkeypatch.setattr(dispatch.PreparedWeights, "w4a16", counted)
    return calls


def _bits_equal(x, y):
    assert x.shape == y.shape and x.dtype == y.dtype
    assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x.view(torch.int32),
                       y.view(torch.uint8) if y.dtype != torch.float32 else y.view(torch.int32))


@pytest.mark.parametrize("m", [1, 16, 40, 200])
@pytest.mark.parametrize("scaling,swizzle,e4m3_max", [("tensor", True, 448),
                                                      ("token", False, 256),  # 4over6
                                                      ("token", True, 448),
                                                      ("tensor", False, 448)])
@pytest.mark.parametrize("act_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float32)])
@pytest.mark.parametrize("bias_dtype", [None, "out", torch.float32])
def test_w4a16_remembered_weights_bit_equal(m, scaling, swizzle, e4m3_max, act_dtype,
                                            out_dtype, bias_dtype, monkeypatch):
    """cute_fp4.gemm(a, w, bias=) through the remembered PreparedWeights of w (no factors
    kernel; the weight checks done once) gives the bits of the general dispatch with the
    factors kernel, for the streaming and the mixed kernels, both scale layouts, a bias of
    the output dtype, an FP32 bias or none, and a 3-D activation."""
    # > 32 x 132 rows: the mixed kernel from 17 tokens
    w, a, bias, got, got_2d = _remembered_gemms(monkeypatch, scaling, 4400, 256, m, swizzle,
                                                e4m3_max, act_dtype, out_dtype, bias_dtype)
    _bits_equal(got, _w4a16_general(a, w, out_dtype, bias))
    _bits_equal(got_2d, _w4a16_general(a[0], w, out_dtype, bias))


def _remembered_gemms(monkeypatch, scaling, n, k, m, swizzle, e4m3_max, act_dtype, out_dtype,
                      bias_dtype):
    """W4A16 weights [n, k] of `scaling`, a 3-D activation [2, m, k] and a bias ("out": of
    the output dtype): cute_fp4.gemm of the activation and of its first 2-D slice, both
    through the remembered PreparedWeights. Returns (w, a, bias, got, got_2d)."""
    from cute_fp4.gemm import dispatch

    w = cute_fp4.quantize(torch.randn(n, k, device="cuda"),
                          Recipe(scaling=scaling, swizzle=swizzle, e4m3_max=e4m3_max,
                                 four_over_six="mae" if e4m3_max == 256 else None,
                                 columnwise=False))
    a = torch.randn(2, m, k, device="cuda").to(act_dtype)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(
        out_dtype if bias_dtype == "out" else bias_dtype)
    calls = _prepared_calls(monkeypatch)
    got = cute_fp4.gemm(a, w, bias=bias, out_dtype=out_dtype)
    got_2d = cute_fp4.gemm(a[0], w, bias=bias, out_dtype=out_dtype)
    assert len(calls) == 2 and dispatch.prepared_weights(w) is not None
    return w, a, bias, got, got_2d


@pytest.mark.parametrize("m", [1, 16, 40, 200])
@pytest.mark.parametrize("swizzle,e4m3_max", [(True, 448), (False, 256)])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.bfloat16, None),
                                                  (torch.bfloat16, "out"),
                                                  (torch.float32, torch.float32)])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_w4a16_remembered_window64_bit_equal(m, swizzle, e4m3_max, out_dtype, bias_dtype,
                                             act_dtype, monkeypatch):
    """Window64 weights through the remembered PreparedWeights (the streaming kernel up to 16
    tokens, the mixed kernel beyond) give the bits of gemm_w4a16 with b_window_amax, for a
    2-D and a 3-D activation, BF16 and FP16."""
    from cute_fp4.gemm import dispatch

    n, k = 300, 320
    w, a, bias, got, got_2d = _remembered_gemms(monkeypatch, "window64", n, k, m, swizzle,
                                                e4m3_max, act_dtype, out_dtype, bias_dtype)
    assert dispatch.prepared_weights(w).window
    for x, y in ((a, got), (a[0], got_2d)):
        want = dispatch.gemm_w4a16(x.reshape(-1, k), w.data, w.scales, bias=bias,
                                   out_dtype=out_dtype, scales_swizzled=swizzle,
                                   b_window_amax=w.amax, e4m3_max=e4m3_max)
        _bits_equal(y, want.view(x.shape[:-1] + (n,)))
    assert got.abs().max() > 0


def test_w4a16_remembered_weights_follow_the_tensor():
    """The remembered weights read the tensor's current values: in-place changes of data /
    scales / amax are seen, replaced fields are re-checked (a wrong one still raises), and the
    memo goes when the NVFP4Tensor does."""
    from cute_fp4.gemm import dispatch

    w = cute_fp4.quantize(torch.randn(512, 256, device="cuda"), Recipe(columnwise=False))
    a = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    first = cute_fp4.gemm(a, w)
    prepared = dispatch.prepared_weights(w)
    other = cute_fp4.quantize(torch.randn(512, 256, device="cuda"), Recipe(columnwise=False))
    w.data.copy_(other.data)
    w.scales.copy_(other.scales)
    w.amax.copy_(other.amax)
    _bits_equal(cute_fp4.gemm(a, w), _w4a16_general(a, other, torch.bfloat16))
    assert dispatch.prepared_weights(w) is prepared
    w.data = torch.zeros_like(w.data)
    assert float(cute_fp4.gemm(a, w).abs().max()) == 0.0
    assert dispatch.prepared_weights(w) is not prepared
    w.scales = w.scales[:, :8]
    with pytest.raises(ValueError, match="b_scales must be"):
        cute_fp4.gemm(a, w)
    assert not torch.equal(first, torch.zeros_like(first))
    key = id(w)
    del w
    assert key not in dispatch._PREPARED_WEIGHTS


def test_w4a16_remembered_weights_input_errors():
    """Activations and biases the fast path does not take go the general way, with its errors."""
    w = cute_fp4.quantize(torch.randn(256, 128, device="cuda"), Recipe(columnwise=False))
    a = torch.randn(128, 8, device="cuda", dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match="a must be contiguous"):
        cute_fp4.gemm(a, w)
    with pytest.raises(ValueError, match="K mismatch"):
        cute_fp4.gemm(torch.randn(4, 64, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        cute_fp4.gemm(torch.randn(4, 128, device="cuda"), w)
    good = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bias must be 1D of length N=256"):
        cute_fp4.gemm(good, w, bias=torch.zeros(128, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bias must be torch.bfloat16 or float32"):
        cute_fp4.gemm(good, w, bias=torch.zeros(256, device="cuda", dtype=torch.float16))


def _w4a4_general(a, b, bias, out_dtype, path="auto"):
    """a @ b.T through gemm_nvfp4 with the factors kernel's alpha / row / col (what
    cute_fp4.gemm ran before its plans), in a's leading shape."""
    from cute_fp4.common.jit import device_arch
    from cute_fp4.gemm.dispatch import gemm_nvfp4
    from cute_fp4.gemm.factors import epilogue_factors

    ra, rb = a.recipe, b.recipe
    alpha, row, col = epilogue_factors(ra.scaling, a.amax, ra.e4m3_max, rb.scaling, b.amax,
                                       rb.e4m3_max, device_arch())
    windows = [t.amax if t.recipe.scaling == "window64" else None for t in (a, b)]
    d = gemm_nvfp4(a.data, a.scales, b.data, b.scales, alpha=alpha, row=row, col=col,
                   bias=bias, out_dtype=out_dtype, scales_swizzled=rb.swizzle, path=path,
                   a_window_amax=windows[0], b_window_amax=windows[1],
                   e4m3_max=ra.e4m3_max if windows[0] is not None else rb.e4m3_max)
    return d.view(tuple(a.shape[:-1]) + (b.rows,))


def _check_plan_calls(m, n, k, path, a_scaling, b_scaling, e4m3_max, bias_dtype, out_dtype,
                      swizzle=True):
    """Three cute_fp4.gemm calls of one configuration with fresh operands (a 3-D activation):
    the first runs the general path and makes the plan, the others run the plan on `path`;
    each gives the bits of gemm_nvfp4 with the factors kernel (`_w4a4_general`)."""
    from cute_fp4.gemm import plan as plans

    ra = Recipe(scaling=a_scaling, swizzle=swizzle, e4m3_max=e4m3_max,
                four_over_six="mse" if e4m3_max == 256 else None)
    rb = Recipe(scaling=b_scaling, swizzle=swizzle)
    for call in range(3):
        a = cute_fp4.quantize(torch.randn(1, m, k, device="cuda"), ra)
        b = cute_fp4.quantize(torch.randn(n, k, device="cuda"), rb)
        bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype)
        got = cute_fp4.gemm(a, b, bias=bias, out_dtype=out_dtype)
        _bits_equal(got, _w4a4_general(a, b, bias, out_dtype))
        assert float(got.abs().max()) > 0
        plan = plans._PLANS[plans.gemm_key(a, b, bias, out_dtype)]
        assert isinstance(plan, plans.GemmPlan) and plan.path == path


# (a rows, b rows, K): the predecode path with B decoded (a larger) and with A decoded (the
# kernel writes D^T), the weight_stream path with A streamed as tokens and with B
@pytest.mark.parametrize("m,n,k,path", [(272, 160, 256, "predecode"), (48, 400, 384, "predecode"),
                                        (5, 1000, 512, "weight_stream"),
                                        (700, 16, 160, "weight_stream")])
@pytest.mark.parametrize("a_scaling,b_scaling,e4m3_max", [
    ("tensor", "tensor", 448), ("token", "tensor", 256),  # 4over6 activations
    ("tensor", "token", 448), ("token", "token", 448)])
@pytest.mark.parametrize("bias_dtype,out_dtype", [(None, torch.bfloat16),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
def test_gemm_plan_bit_equal(m, n, k, path, a_scaling, b_scaling, e4m3_max, bias_dtype,
                             out_dtype):
    """cute_fp4.gemm of two NVFP4 operands through its configuration's plan (gemm.plan): the
    first call runs the general path and makes the plan, later calls with new operands of the
    same configuration run it; every call gives the bits of gemm_nvfp4 with the factors
    kernel, for both paths, both operand orders, every pair of outer scalings, a bias or none
    and a 3-D activation."""
    _check_plan_calls(m, n, k, path, a_scaling, b_scaling, e4m3_max, bias_dtype, out_dtype)


@pytest.mark.parametrize("m,n,k", [(272, 160, 256), (48, 400, 320)])
@pytest.mark.parametrize("a_scaling,b_scaling,e4m3_max", [
    ("window64", "window64", 448), ("window64", "tensor", 256), ("token", "window64", 448),
    ("tensor", "window64", 448)])
@pytest.mark.parametrize("bias_dtype,out_dtype", [(None, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
def test_gemm_plan_window_bit_equal(m, n, k, a_scaling, b_scaling, e4m3_max, bias_dtype,
                                    out_dtype):
    """window64 operands through their configuration's plan: every call gives the bits of
    gemm_nvfp4 with the factors kernel, both operands window64 (the "window" path: both
    decoded, the window factors by one launch each) or one (the "predecode" path: the
    window64 operand in the mixed kernel's registers with its factors, the smaller or the
    larger), the other's outer scale decoded in the epilogue, a bias or none, a 3-D
    activation, an odd k-tile count (K = 320)."""
    path = "window" if a_scaling == b_scaling == "window64" else "predecode"
    _check_plan_calls(m, n, k, path, a_scaling, b_scaling, e4m3_max, bias_dtype,
                      out_dtype)


@pytest.mark.parametrize("m,n,k,a_scaling,b_scaling,path", [
    (272, 160, 256, "token", "tensor", "predecode"),
    (48, 400, 384, "tensor", "token", "predecode"),
    (272, 160, 320, "token", "window64", "predecode"),
    (48, 400, 256, "window64", "window64", "window"),
    (5, 1000, 512, "token", "tensor", "weight_stream")])
def test_gemm_plan_compact_scales(m, n, k, a_scaling, b_scaling, path):
    """Compact scales (the Recipe default) through the plans: on the predecode and window paths
    the swizzle kernel brings them to the layout the TMA kernels read on every call (the
    weight_stream kernels read them as they are); the bits of gemm_nvfp4."""
    _check_plan_calls(m, n, k, path, a_scaling, b_scaling, 448, torch.float32, torch.bfloat16,
                      swizzle=False)


@pytest.mark.parametrize("m,n,a_scaling,b_scaling", [(5, 1000, "token", "window64"),
                                                     (5, 1000, "tensor", "window64"),
                                                     (700, 16, "window64", "tensor")])
@pytest.mark.parametrize("bias_dtype,out_dtype", [(None, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
def test_gemm_plan_window_weights_stream(m, n, a_scaling, b_scaling, bias_dtype, out_dtype):
    """Decode sizes with only the larger operand window64 (W4A4 inference with window64
    weights): the plan takes the weight_stream path, the streaming kernel reading the
    weights' window amaxes, with the bits of gemm_nvfp4; both operand orders."""
    _check_plan_calls(m, n, 320, "weight_stream", a_scaling, b_scaling, 448, bias_dtype,
                      out_dtype)


def test_gemm_plan_only_where_it_applies():
    """Configurations a plan does not take keep the general path at every call (their key maps
    to None), with the reference's results: scale layouts that differ (per-tensor and
    window64 operands), K % 64 != 0 on the predecode path, a misaligned field. (Compact scales
    on both sides take a plan since session 56: test_gemm_plan_compact_scales.)"""
    from cute_fp4.gemm import plan as plans

    def operands(m, n, k, ra, rb, misalign=False):
        a = cute_fp4.quantize(torch.randn(m, k, device="cuda"), ra)
        b = cute_fp4.quantize(torch.randn(n, k, device="cuda"), rb)
        if misalign:  # b's data at an address 8 bytes past 16-byte alignment
            buf = torch.empty(b.data.numel() + 8, dtype=torch.uint8, device="cuda")
            b.data = buf[8:].view(b.data.shape).copy_(b.data)
        return a, b

    swz, cmp = Recipe(swizzle=True), Recipe()
    cases = [(64, 96, 256, swz, cmp, False), (64, 96, 160, swz, swz, False),
             (64, 96, 256, swz, swz, True),
             (64, 96, 256, Recipe(scaling="window64", swizzle=True), cmp, False)]
    for m, n, k, ra, rb, misalign in cases:
        for _ in range(2):
            a, b = operands(m, n, k, ra, rb, misalign)
            got = cute_fp4.gemm(a, b)
            want = cute_fp4.gemm(a.to("cpu"), b.to("cpu"), out_dtype=torch.float32)
            assert _rel(got.cpu(), want) < TOL[torch.bfloat16]
            key = plans.gemm_key(a, b, None, torch.bfloat16)
            assert key in plans._PLANS and plans._PLANS[key] is None


def test_gemm_plan_keeps_the_general_checks():
    """A planned configuration does not hide bad operands: a field that differs from the
    planned one (shape, dtype) changes the key, and the general path raises its error."""
    r = Recipe(swizzle=True)
    a = cute_fp4.quantize(torch.randn(64, 256, device="cuda"), r)
    b = cute_fp4.quantize(torch.randn(128, 256, device="cuda"), r)
    for _ in range(2):
        cute_fp4.gemm(a, b)
    with pytest.raises(ValueError, match="bias must be 1D of length N=128"):
        cute_fp4.gemm(a, b, bias=torch.zeros(64, device="cuda", dtype=torch.bfloat16))
    bad = dataclasses.replace(b, scales=b.scales[:64])
    with pytest.raises(ValueError, match="b_scales"):
        cute_fp4.gemm(a, bad)
    bad = dataclasses.replace(b, data=b.data.view(torch.int8))
    with pytest.raises(TypeError, match="uint8"):
        cute_fp4.gemm(a, bad)
    with pytest.raises(ValueError, match="K mismatch"):
        cute_fp4.gemm(cute_fp4.quantize(torch.randn(64, 128, device="cuda"), r), b)


@pytest.mark.parametrize("recipe", [
    Recipe(columnwise=True, swizzle=True),  # the row-group cast
    Recipe(scaling="token", stochastic_rounding=True, columnwise=True),  # the recipe kernel
])
def test_quantize_grouped_torch_compile_gpu(recipe):
    """quantize_grouped inside torch.compile(fullgraph=True) (inductor; the custom op
    cute_fp4::quantize_grouped) gives eager's bytes in every flat field, and so the
    reference's groups; a CUDA graph of the compiled function replays them."""
    g = torch.Generator(device="cuda").manual_seed(50)
    x = torch.randn(272, 128, device="cuda", generator=g).to(torch.bfloat16)
    sizes = [64, 0, 176, 32]
    rng = torch.tensor([3, 4], dtype=torch.int64, device="cuda")
    step = torch.compile(lambda x: cute_fp4.quantize_grouped(x, sizes, recipe, rng_state=rng),
                         fullgraph=True)
    got = step(x)
    want = cute_fp4.quantize_grouped(x, sizes, recipe, seed=3, offset=4)
    for name in ("data", "scales", "amax", "data_t", "scales_t", "amax_t"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for t, w in zip(got, ref.quantize_grouped(x, sizes, recipe, seed=3, offset=4)):
        check(t, w, recipe)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step(x)
    for name in ("data", "scales_t"):
        getattr(replayed, name).view(torch.uint8).fill_(0x7F)
    graph.replay()
    torch.cuda.synchronize()
    for name in ("data", "scales_t"):
        assert torch.equal(getattr(replayed, name).view(torch.uint8),
                           getattr(want, name).view(torch.uint8)), name


def test_grouped_tensor_dequantize_gpu():
    """GroupedNVFP4Tensor.dequantize on the GPU: every group's rows, equal to the reference's
    dequantize of the reference's groups (the quantized bytes are equal); .to("cpu") keeps
    them; split sizes in a CUDA tensor give the same groups."""
    g = torch.Generator(device="cuda").manual_seed(51)
    x = torch.randn(208, 256, device="cuda", generator=g).to(torch.bfloat16)
    sizes = [16, 0, 128, 64]
    recipe = Recipe(scaling="token", columnwise=True, swizzle=True)
    got = cute_fp4.quantize_grouped(x, sizes, recipe)
    deq = got.dequantize(torch.float32)
    want = torch.cat([ref.dequantize(t, torch.float32)
                      for t in ref.quantize_grouped(x, sizes, recipe)])
    assert deq.shape == (208, 256) and torch.equal(deq, want)
    assert torch.equal(got.to("cpu").dequantize(torch.float32), want.cpu())
    on_device = cute_fp4.quantize_grouped(x, torch.tensor(sizes, device="cuda"), recipe)
    assert on_device.split_sizes == tuple(sizes) and torch.equal(on_device.data, got.data)
