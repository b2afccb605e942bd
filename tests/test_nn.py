"""nn.Linear, convert() and torch.compile, on CPU (references) and, marked gpu, on CUDA."""

import pytest
import torch

import cute_fp4
from cute_fp4 import LinearRecipe, Recipe, ref
from cute_fp4.nn import Linear, QuantizedLinear, _with_outputs

RECIPES = {
    "per_tensor": LinearRecipe.per_tensor(),
    "per_token": LinearRecipe.per_token(),
    "window64": LinearRecipe.window64(),
    "per_tensor_4over6": LinearRecipe.per_tensor(four_over_six="mse", stochastic_rounding=False),
}


def _setup(recipe, device="cpu", dtype=torch.float32, bias=True, shape=(2, 32, 128), out=64):
    torch.manual_seed(torch.randint(0, 2**31, (1,)).item())
    lin = torch.nn.Linear(shape[-1], out, bias=bias).to(device=device, dtype=dtype)
    q = Linear.from_linear(lin, recipe, seed=7)
    x = torch.randn(shape, device=device, dtype=dtype)
    g = torch.randn(shape[:-1] + (out,), device=device, dtype=dtype)
    return lin, q, x, g


def _manual_reference(recipe: LinearRecipe, x, w, b, g, seed, offset):
    """The recipe spelled out with the torch references: quantized operands and GEMMs."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    xq = ref.quantize(x2, _with_outputs(recipe.activation, True, True))
    wq = ref.quantize(w, _with_outputs(recipe.weight, True, True))
    gq = ref.quantize(g2, _with_outputs(recipe.grad, True, True), seed=seed, offset=offset)
    y = cute_fp4.gemm(xq, wq, bias=b, out_dtype=x.dtype)
    dx = cute_fp4.gemm(gq, wq.t(), out_dtype=x.dtype)
    dw = cute_fp4.gemm(gq.t(), xq.t(), out_dtype=w.dtype)
    return y.view(g.shape), dx.view(x.shape), dw


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_matches_manual_recipe(name):
    recipe = RECIPES[name]
    lin, q, x, g = _setup(recipe)
    x.requires_grad_()
    y = q(x)
    y.backward(g)
    y_ref, dx_ref, dw_ref = _manual_reference(recipe, x.detach(), lin.weight.detach(),
                                              lin.bias.detach(), g, seed=7, offset=1)
    assert torch.equal(y.detach(), y_ref)
    assert torch.equal(x.grad, dx_ref)
    assert torch.equal(q.weight.grad, dw_ref)
    assert torch.equal(q.bias.grad, g.reshape(-1, g.shape[-1]).sum(0))


# Measured on CPU for N(0,1) inputs and weights of nn.Linear's init (dB, vs fp32 autograd):
# forward ~16.7-17 dB, dgrad ~15-17 dB, wgrad ~15-18 dB. Thresholds leave ~2 dB of margin.
SNR_FLOOR_DB = {"y": 14.5, "dx": 13.0, "dw": 13.0}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_gradients_close_to_high_precision(name, device):
    """Against autograd of the unquantized Linear (fp32 on CPU, BF16 on CUDA)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lin, q, x, g = _setup(RECIPES[name], device=device, dtype=dtype, shape=(4, 64, 256), out=128)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = q(x1), lin(x2)
    y1.backward(g)
    y2.backward(g)
    assert ref.snr_db(y2.detach(), y1.detach()) > SNR_FLOOR_DB["y"]
    assert ref.snr_db(x2.grad, x1.grad) > SNR_FLOOR_DB["dx"]
    assert ref.snr_db(lin.weight.grad, q.weight.grad) > SNR_FLOOR_DB["dw"]


def test_linear_weight_cache_follows_updates():
    lin, q, x, _ = _setup(LinearRecipe.per_tensor())
    q.weight_cache = True
    with torch.no_grad():
        y0 = q(x)
        assert torch.equal(q(x), y0) and len(q._kept_weight) == 1  # kept weight, same result
        q.weight.mul_(2.0)  # in-place update bumps the version counter
        y1 = q(x)
    assert not torch.equal(y1, y0)
    assert torch.allclose(y1 - q.bias, 2 * (y0 - q.bias), rtol=1e-5, atol=1e-5)


def test_linear_weight_quantized_every_forward_by_default():
    """Without weight_cache every forward quantizes the weight: an update through
    `weight.data` (which does not bump the version counter) is seen."""
    lin, q, x, _ = _setup(LinearRecipe.per_tensor())
    assert not q.weight_cache
    with torch.no_grad():
        y0 = q(x)
        v = q.weight._version
        q.weight.data.mul_(2.0)
        assert q.weight._version == v  # what a version-keyed cache would miss
        y1 = q(x)
    assert not q._kept_weight
    assert torch.allclose(y1 - q.bias, 2 * (y0 - q.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_linear_under_autocast_computes_in_the_autocast_dtype(device):
    """Under torch.autocast a Linear of FP32 parameters takes x in the autocast dtype, as
    torch.nn.Linear does: the output is BF16 and equals the Linear applied to x cast to BF16
    outside autocast (the weight quantized from FP32 either way); x.grad stays FP32 and equals
    the explicit cast's; torch.compile traces the same."""
    _, q, x, _ = _setup(LinearRecipe.per_tensor(stochastic_rounding=False), device=device,
                        shape=(2, 32, 128))
    g = torch.randn(x.shape[:-1] + (q.out_features,), dtype=torch.bfloat16, device=device)
    xa = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        ya = q(xa)
    ya.backward(g)
    dw_autocast, q.weight.grad, q.bias.grad = q.weight.grad, None, None
    xb = x.clone().requires_grad_()
    yb = q(xb.to(torch.bfloat16))
    yb.backward(g)
    assert ya.dtype == torch.bfloat16 and torch.equal(ya, yb)
    assert xa.grad.dtype == torch.float32 and torch.equal(xa.grad, xb.grad)
    assert torch.equal(dw_autocast, q.weight.grad) and dw_autocast.dtype == torch.float32
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        compiled = torch.compile(q, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), q(x))
    inference = cute_fp4.convert(torch.nn.Sequential(torch.nn.Linear(128, 64, device=device)))
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        yi = inference(x)
    assert yi.dtype == torch.bfloat16 and torch.equal(yi, inference(x.to(torch.bfloat16)))


def test_linear_no_grad_makes_no_twins():
    _, q, x, _ = _setup(LinearRecipe.per_tensor())
    q.weight_cache = True
    with torch.no_grad():
        q(x)
    (key,) = q._kept_weight
    assert key[-1] is False and q._kept_weight[key].data_t is None


def test_linear_stochastic_rounding_advances_offset():
    _, q, x, g = _setup(LinearRecipe.per_tensor())
    grads = []
    for _ in range(2):
        xr = x.clone().requires_grad_()
        q(xr).backward(g)
        grads.append(xr.grad)
    assert q.rng_state.tolist() == [7, 2]
    assert not torch.equal(grads[0], grads[1])  # fresh random bits every step


def test_linear_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible by 16"):
        Linear(100, 64)
    _, q, _, _ = _setup(LinearRecipe.per_tensor())
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 128\]"):
        q(torch.randn(4, 64))


def test_linear_recipe_validation():
    with pytest.raises(ValueError, match="rht must agree"):
        LinearRecipe(Recipe(rht=True), Recipe(), Recipe())
    with pytest.raises(ValueError, match="weight is not Hadamard"):
        LinearRecipe(Recipe(), Recipe(rht=True), Recipe())


class Block(torch.nn.Module):
    """A small transformer MLP block."""

    def __init__(self, d=128, hidden=256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)
        self.head = torch.nn.Linear(d, 10)  # 10 outputs: not convertible

    def forward(self, x):
        return self.head(x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def test_convert_inference_w4a4_and_w4a16():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 16, 128)
    y_ref = model(x)
    for weight_only in (False, True):
        m = cute_fp4.convert(_copy(model), weight_only=weight_only)
        assert isinstance(m.up, QuantizedLinear) and isinstance(m.down, QuantizedLinear)
        assert type(m.head) is torch.nn.Linear  # 10 outputs: skipped
        # the scale layout the GEMM kernels read, for the weights and the activations
        assert m.up.weight_recipe.swizzle and m.up.activation.swizzle
        with torch.no_grad():
            y = m(x)
        assert y.dtype == x.dtype and y.shape == y_ref.shape
        assert ref.snr_db(y_ref.detach(), y) > 10.0


@pytest.mark.parametrize("weight_only", [False, True], ids=["w4a4", "w4a16"])
def test_convert_weight_recipe(weight_only):
    """convert(weight_recipe=): the weights are quantized with that recipe (rowwise only, its
    RHT dropped), the layer's output is cute_fp4.gemm's with those weights, and the converted
    block stays as close to the float model as with per-tensor weights (Gaussian weights: no
    outlier windows for window64 to isolate; measured 28.8 against 28.9 dB W4A4)."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 16, 128)
    with torch.no_grad():
        y_ref = model(x)
    recipe = Recipe(scaling="window64", rht=True)
    m = cute_fp4.convert(_copy(model), Recipe(scaling="token"), weight_only=weight_only,
                         weight_recipe=recipe)
    # compact recipes given: the layers keep their scales swizzled all the same
    assert m.up.weight_recipe == recipe.replace(columnwise=False, rht=False, swizzle=True)
    assert m.up.activation == Recipe(scaling="token", columnwise=False, swizzle=True)
    want = cute_fp4.quantize(model.up.weight.detach(), m.up.weight_recipe)
    assert torch.equal(m.up.weight_data, want.data) and torch.equal(m.up.weight_amax, want.amax)
    assert torch.equal(m.up.weight_scales.view(torch.uint8), want.scales.view(torch.uint8))
    assert m.up.weight_amax.shape == (256, 2)  # one amax per 1x64 window
    h = torch.randn(3, 128)
    with torch.no_grad():
        a = h.to(torch.bfloat16) if weight_only else cute_fp4.quantize(h, m.up.activation)
        assert torch.equal(m.up(h), cute_fp4.gemm(a, want, bias=model.up.bias.detach(),
                                                  out_dtype=h.dtype))
        y = m(x)
        y_tensor = cute_fp4.convert(_copy(model), weight_only=weight_only)(x)
    assert ref.snr_db(y_ref, y) >= ref.snr_db(y_ref, y_tensor) - 0.5
    with pytest.raises(ValueError, match="weight_recipe is for inference"):
        cute_fp4.convert(Block(), LinearRecipe.per_token(), training=True, weight_recipe=recipe)
    with pytest.raises(TypeError, match="weight_recipe must be a Recipe"):
        cute_fp4.convert(Block(), weight_recipe="window64")


def _copy(model):
    new = Block()
    new.load_state_dict(model.state_dict())
    return new


def test_convert_filters_and_state_dict_round_trip():
    torch.manual_seed(0)
    model = cute_fp4.convert(Block(), include="up")
    assert isinstance(model.up, QuantizedLinear) and type(model.down) is torch.nn.Linear
    model = cute_fp4.convert(Block(), exclude="down")
    assert isinstance(model.up, QuantizedLinear) and type(model.down) is torch.nn.Linear
    model = cute_fp4.convert(Block(), filter=lambda name, mod: mod.out_features == 128)
    assert type(model.up) is torch.nn.Linear and isinstance(model.down, QuantizedLinear)

    src = cute_fp4.convert(Block())
    dst = cute_fp4.convert(Block())
    assert not torch.equal(src.up.weight_data, dst.up.weight_data)
    dst.load_state_dict(src.state_dict())
    for name in ("weight_data", "weight_scales", "weight_amax", "bias"):
        assert torch.equal(getattr(dst.up, name), getattr(src.up, name))
    x = torch.randn(2, 128)
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))


def test_convert_training_swaps_to_nvfp4_linear():
    model = cute_fp4.convert(Block(), LinearRecipe.per_token(), training=True)
    assert isinstance(model.up, Linear) and model.up.recipe.activation.scaling == "token"
    with pytest.raises(TypeError, match="LinearRecipe"):
        cute_fp4.convert(Block(), Recipe(), training=True)


def test_torch_compile_fullgraph_cpu():
    torch.manual_seed(0)
    _, q, x, g = _setup(LinearRecipe.per_token(stochastic_rounding=False), bias=True)
    xe = x.clone().requires_grad_()
    ye = q(xe)
    ye.backward(g)
    q.weight.grad = None
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    yc = compiled(xc)
    yc.backward(g)
    assert torch.equal(yc, ye)
    assert torch.equal(xc.grad, xe.grad)


def test_torch_compile_stochastic_rounding_advances_offset_cpu():
    """The compiled step draws the same bits as eager and advances the module's offset."""
    _, q, x, g = _setup(LinearRecipe.per_token(), bias=False)
    xe = x.clone().requires_grad_()
    q(xe).backward(g)
    assert q.rng_state.tolist() == [7, 1]
    q.rng_state.copy_(torch.tensor([7, 0]))
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    grads = []
    for step in (1, 2):
        xc = x.clone().requires_grad_()
        compiled(xc).backward(g)
        assert q.rng_state.tolist() == [7, step]
        grads.append(xc.grad)
    assert torch.equal(grads[0], xe.grad)
    assert not torch.equal(grads[1], xe.grad)


def test_quantize_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cute_fp4.ops import quantize_op, recipe_args

    recipe = Recipe(scaling="window64", columnwise=True, swizzle=True)
    with FakeTensorMode():
        x = torch.empty(192, 320, dtype=torch.bfloat16)
        outs = quantize_op(x, *recipe_args(recipe), torch.tensor([0, 0]), "", True)
    assert tuple(outs[6].shape) == (320,) and outs[6].dtype == torch.float32
    real = ref.quantize(torch.randn(192, 320), recipe)
    for fake, got in zip(outs, (real.data, real.scales, real.amax, real.data_t, real.scales_t,
                                real.amax_t)):
        assert tuple(fake.shape) == tuple(got.shape) and fake.dtype == got.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["per_tensor", "per_token"])
def test_linear_gpu_matches_reference_recipe(name):
    recipe = RECIPES[name]
    lin, q, x, g = _setup(recipe, device="cuda", dtype=torch.bfloat16, shape=(2, 128, 256),
                          out=128)
    x.requires_grad_()
    y = q(x)
    y.backward(g)
    y_ref, dx_ref, dw_ref = _manual_reference(recipe, x.detach(), lin.weight.detach(),
                                              lin.bias.detach(), g, seed=7, offset=1)
    # Quantized operands are byte-equal; GEMMs differ only in FP32 summation order.
    for got, want in ((y, y_ref), (x.grad, dx_ref), (q.weight.grad, dw_ref)):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 1e-2
    # the bias gradient (fused into dy's amax pass): the float64 sum rounded once to bf16
    g2 = g.double().reshape(-1, g.shape[-1])
    exact = g2.sum(0)
    bound = 2.0**-8 * exact.abs() + 1e-5 * g2.abs().sum(0)
    assert ((q.bias.grad.double() - exact).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [
    LinearRecipe.per_token(stochastic_rounding=False),
    # the plain cast (one buffer for all outputs in eager mode) and its shared per-tensor amax
    LinearRecipe.per_tensor(rht=False, stochastic_rounding=False, weight_2d=False),
    LinearRecipe.per_tensor(rht=False, stochastic_rounding=False, swizzle=False)],
    ids=["per_token", "plain", "per_tensor_compact"])
@pytest.mark.parametrize("shape", [(256, 256), (4096, 512)], ids=["fused", "two_launch"])
def test_linear_gpu_torch_compile_and_cuda_graph(recipe, shape):
    """torch.compile(fullgraph=True) of a Linear equals eager (the custom ops return outputs
    that share no memory), and a captured CUDA graph replays on new inputs."""
    _, q, x, g = _setup(recipe, device="cuda", dtype=torch.bfloat16, shape=shape, out=128)
    with torch.no_grad():
        y_eager = q(x)
        compiled = torch.compile(q, fullgraph=True)
        assert torch.equal(compiled(x), y_eager)
        static_x = x.clone()
        q(static_x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = q(static_x)
        static_x.copy_(x * 2)
        graph.replay()
        assert torch.equal(static_y, q(x * 2))


class TransformerBlock(torch.nn.Module):
    """Pre-norm attention + MLP: the Linears `convert` swaps (qkv, proj, up, down)."""

    def __init__(self, d=256, heads=4, hidden=512):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


@pytest.mark.gpu
@pytest.mark.parametrize("weight_only", [False, True], ids=["w4a4", "w4a16"])
@pytest.mark.parametrize("weight_recipe", [None, Recipe(scaling="window64", columnwise=False)],
                         ids=["tensor", "window64"])
def test_convert_transformer_block_gpu(weight_only, weight_recipe):
    """convert() on CUDA: the stored weights are the reference's bytes, the block's output
    matches the same converted block run by the CPU references, and stays close to BF16; with
    per-tensor and with window64 weights (`weight_recipe`)."""
    torch.manual_seed(torch.randint(0, 2**31, (1,)).item())
    model = TransformerBlock().to(torch.bfloat16)
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    names = ("qkv", "proj", "up", "down")
    weights = {name: getattr(model, name).weight.detach().clone() for name in names}
    with torch.no_grad():
        y_bf16 = model.cuda()(x.cuda()).float().cpu()
    gpu = cute_fp4.convert(model, weight_only=weight_only, weight_recipe=weight_recipe)
    cpu = cute_fp4.convert(TransformerBlock().to(torch.bfloat16), weight_only=weight_only,
                           weight_recipe=weight_recipe)
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    for name in names:
        got = getattr(gpu, name)
        assert isinstance(got, QuantizedLinear) and got.weight_only == weight_only
        assert got.weight_data.is_cuda
        want = ref.quantize(weights[name], (weight_recipe or Recipe()).replace(swizzle=True))
        assert torch.equal(got.weight_data.cpu(), want.data)
        assert torch.equal(got.weight_scales.cpu().view(torch.uint8), want.scales.view(torch.uint8))
        assert torch.equal(got.weight_amax.cpu(), want.amax)
    with torch.no_grad():
        y_gpu = gpu(x.cuda()).float().cpu()
        y_cpu = cpu(x).float()
    err = (y_gpu - y_cpu).norm() / y_cpu.norm()
    assert err < 2e-2, err
    # Measured (CPU references, 3 seeds): 27.4-27.6 dB W4A4, 30.2 dB W4A16 (with residuals).
    assert ref.snr_db(y_bf16, y_gpu) > (28.0 if weight_only else 25.0)


def _captured_step(q, static_x, g):
    """(a CUDA graph of one fwd + bwd step of q on static_x, its output), captured after two
    warm-up steps on a side stream; the grads it writes are the ones set in the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            static_x.grad, q.weight.grad, q.bias.grad = None, None, None
            q(static_x).backward(g)
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad, q.weight.grad, q.bias.grad = None, None, None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = q(static_x)
        static_y.backward(g)
    return graph, static_y


@pytest.mark.gpu
def test_linear_gpu_training_step_cuda_graph_with_stochastic_rounding():
    """A whole fwd+bwd step (RHT + stochastic rounding) captured in a CUDA graph: each replay
    advances the device-side Philox offset and equals the eager step at that offset."""
    _, q, x, g = _setup(LinearRecipe.per_token(), device="cuda", dtype=torch.bfloat16,
                        shape=(256, 256), out=128)
    assert q.rng_state.is_cuda
    static_x = x.clone().requires_grad_()
    graph, _ = _captured_step(q, static_x, g)
    offset = q.rng_state[1].item()
    results = []
    for step in (1, 2):
        graph.replay()
        torch.cuda.synchronize()
        assert q.rng_state.tolist() == [7, offset + step]
        results.append((static_x.grad.clone(), q.weight.grad.clone()))
    assert not torch.equal(results[0][0], results[1][0])  # fresh bits at every replay
    for step, (dx, dw) in zip((1, 2), results):
        q.rng_state[1] = offset + step - 1
        xe = x.clone().requires_grad_()
        q.weight.grad = None
        q(xe).backward(g)
        assert torch.equal(xe.grad, dx) and torch.equal(q.weight.grad, dw)


@pytest.mark.gpu
def test_linear_gpu_cuda_graph_sees_weight_updates():
    """A captured fwd+bwd step quantizes the weight inside the graph: after in-place updates of
    the weight between replays (an optimizer step), each replay equals the eager step with the
    updated weight (a weight quantized before the capture and cached would be replayed)."""
    _, q, x, g = _setup(LinearRecipe.per_tensor(stochastic_rounding=False), device="cuda",
                        dtype=torch.bfloat16, shape=(256, 256), out=128)
    static_x = x.clone().requires_grad_()
    graph, static_y = _captured_step(q, static_x, g)
    static_dx, static_dw = static_x.grad, q.weight.grad
    for _ in range(2):
        with torch.no_grad():
            q.weight.add_(torch.randn_like(q.weight), alpha=0.1)
        graph.replay()
        torch.cuda.synchronize()
        xe = x.clone().requires_grad_()
        q.weight.grad = None
        ye = q(xe)
        ye.backward(g)
        assert torch.equal(static_y, ye) and torch.equal(static_dx, xe.grad)
        assert torch.equal(static_dw, q.weight.grad)


def test_quantized_linear_weight_object_is_kept():
    """QuantizedLinear.weight is one NVFP4Tensor while the buffers stay the same tensors (the
    GEMM remembers its weight checks per NVFP4Tensor), and a new one once `.to()` or an
    assignment replaced a buffer; the bytes are the buffers' either way."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    cute_fp4.convert(model, weight_only=True)
    q = model[0]
    w = q.weight
    assert q.weight is w and w.data is q.weight_data
    q.to("cpu")  # a no-op move keeps the buffers, so the weight object too
    assert q.weight is w
    q.to(torch.float64)  # replaces the floating buffers (the amax)
    assert q.weight is not w and q.weight.amax is q.weight_amax
    w = q.weight
    q.weight_data = q.weight_data.clone()
    w2 = q.weight
    assert w2 is not w and w2.data is q.weight_data and torch.equal(w2.data, w.data)
    assert q.weight is w2
