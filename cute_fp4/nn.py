"""`Linear`: a drop-in `torch.nn.Linear` whose three GEMMs run in NVFP4, and `convert` for
inference.

Forward: y = Q(x) @ Q(w).T (+ bias). Backward: dgrad = Q(dy) @ Q(w)ᵀ-twin, wgrad =
Q(dy)ᵀ-twin @ Q(x)ᵀ-twin. Every GEMM contracts K-major operands, so dgrad uses the weight's
columnwise twin and wgrad the columnwise twins of dy and x (with the RHT on both when the recipe
asks for it: the transform is orthogonal along the contracted dimension, so it cancels).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Callable, Dict, Optional, Union

import torch

from . import api
from .recipe import Recipe
from .tensor import NVFP4Tensor


@dataclasses.dataclass(frozen=True)
class LinearRecipe:
    """The quantization of each Linear operand.

    activation: x (rowwise for fprop, columnwise twin for wgrad).
    weight: w (rowwise for fprop, columnwise twin for dgrad).
    grad: dy (rowwise for dgrad, columnwise twin for wgrad).
    The columnwise / rowwise flags of these recipes are set per use; rht must agree between
    activation and grad (both wgrad operands are transformed, or neither).
    """

    activation: Recipe
    weight: Recipe
    grad: Recipe

    def __post_init__(self):
        if self.activation.rht != self.grad.rht:
            raise ValueError("LinearRecipe: activation.rht and grad.rht must agree (the wgrad "
                             "GEMM contracts both columnwise twins)")
        if self.weight.rht:
            raise ValueError("LinearRecipe: the weight is not Hadamard-transformed (rht=False)")

    @classmethod
    def per_tensor(cls, *, rht: bool = True, stochastic_rounding: bool = True,
                   weight_2d: bool = True, four_over_six: Optional[str] = None,
                   swizzle: bool = True) -> "LinearRecipe":
        """TransformerEngine's NVFP4 training recipe: 16x16 weight blocks, RHT on the wgrad
        inputs, stochastic rounding of gradients."""
        return cls._make("tensor", rht, stochastic_rounding, weight_2d, four_over_six, swizzle)

    @classmethod
    def per_token(cls, *, rht: bool = True, stochastic_rounding: bool = True,
                  weight_2d: bool = True, four_over_six: Optional[str] = None,
                  swizzle: bool = True) -> "LinearRecipe":
        """Per-token outer scales for activations and gradients (per row of each output);
        per-tensor weights."""
        return cls._make("token", rht, stochastic_rounding, weight_2d, four_over_six, swizzle)

    @classmethod
    def window64(cls, *, rht: bool = False, stochastic_rounding: bool = False,
                 four_over_six: Optional[str] = None, swizzle: bool = True) -> "LinearRecipe":
        """1x64 local encoding of activations and gradients; per-tensor 1x16 weights."""
        return cls._make("window64", rht, stochastic_rounding, False, four_over_six, swizzle)

    @classmethod
    def _make(cls, scaling, rht, sr, weight_2d, four_over_six, swizzle):
        act = Recipe(scaling=scaling, rht=rht, four_over_six=four_over_six, swizzle=swizzle)
        weight = Recipe(block=(16, 16) if weight_2d else (1, 16), four_over_six=four_over_six,
                        swizzle=swizzle)
        # Stochastic rounding and 4over6 exclude each other; gradients keep SR when asked.
        grad = Recipe(scaling=scaling, rht=rht, stochastic_rounding=sr,
                      four_over_six=None if sr else four_over_six, swizzle=swizzle)
        return cls(act, weight, grad)


@functools.lru_cache(maxsize=None)
def _with_outputs(recipe: Recipe, rowwise: bool, columnwise: bool) -> Recipe:
    # cached: Recipe.replace validates the new recipe (~10 us a call, three calls a step)
    # The RHT only touches the columnwise twin; without a twin it has nothing to do.
    return recipe.replace(rowwise=rowwise, columnwise=columnwise, rht=recipe.rht and columnwise)


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x as torch.nn.Linear takes it under torch.autocast: a floating x in the autocast dtype
    where autocast is on for its device, so that the output has that dtype (the weight is
    quantized from its own dtype: no rounding to the autocast dtype first)."""
    kind = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(kind):
        return x.to(torch.get_autocast_dtype(kind))
    return x


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, recipe: LinearRecipe):
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x2 = x.reshape(-1, x.shape[-1])
        xq = api.quantize(x2, _with_outputs(recipe.activation, True, need_wgrad),
                          amax_group=module.amax_group)
        wq = module.quantized_weight(columnwise=need_dgrad)
        y = api.gemm(xq, wq, bias=bias, out_dtype=x.dtype)
        ctx.recipe, ctx.module = recipe, module
        ctx.x_twin = xq.t() if need_wgrad else None
        ctx.w_twin = wq.t() if need_dgrad else None
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Fresh stochastic-rounding bits every step: advance the module's Philox offset (on
        # the module's device, so a captured CUDA graph advances it at every replay).
        ctx.module.rng_state[1:].add_(1)
        grad_recipe = _with_outputs(ctx.recipe.grad, need_dgrad, need_wgrad)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:  # the bias gradient from the same pass
            dyq, db = api.quantize_dbias(dy2, grad_recipe, rng_state=ctx.module.rng_state,
                                         amax_group=ctx.module.amax_group)
            db = db.to(ctx.module.bias.dtype)
        else:
            dyq = api.quantize(dy2, grad_recipe, rng_state=ctx.module.rng_state,
                               amax_group=ctx.module.amax_group)
        dx = dw = None
        if need_dgrad:
            dx = api.gemm(dyq, ctx.w_twin, out_dtype=dy.dtype).view(ctx.shape)
        if need_wgrad:
            dw = api.gemm(dyq.t(), ctx.x_twin, out_dtype=ctx.module.weight.dtype)
        return dx, dw, db, None, None


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` with NVFP4 GEMMs in forward and backward.

    recipe: a `LinearRecipe` (default `LinearRecipe.per_tensor()`). The weight and its twin
    are quantized at every forward (as TransformerEngine casts its weights without
    `is_first_microbatch`). weight_cache=True (or setting the attribute) keeps the quantized
    weight while the weight's version counter and storage stay (gradient accumulation, eval
    loops): in-place updates by torch.optim and by in-place ops bump the counter, but writes
    through `weight.data` (`p.data.copy_(...)` of some mixed-precision optimizers) do not and
    would leave a stale quantized weight; CUDA-graph captures and torch.compile quantize it in
    the graph either way. Under
    `torch.no_grad()` only the forward GEMM runs and no twins are made. Stochastic rounding
    of gradients uses Philox keyed by the buffer `rng_state` = [seed, offset] (int64, on the
    module's device, not saved in the state dict); each backward advances the offset.
    amax_group: with sequence parallelism (each rank holds a slice of the tokens of x and dy),
    the `torch.distributed` process group over which the amaxes spanning tokens are
    MAX-all-reduced (see `cute_fp4.quantize`), so all ranks quantize with the scales of the
    whole sequence. Its dgrad and wgrad are then the per-rank slice and the per-rank partial
    sum, as for a BF16 Linear on the same shards.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, recipe: Optional[LinearRecipe] = None, seed: int = 0,
                 amax_group=None, weight_cache: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if in_features % 16 or out_features % 16:
            raise ValueError(f"NVFP4 Linear needs in_features and out_features divisible by "
                             f"16, got {in_features} and {out_features}")
        self.recipe = recipe or LinearRecipe.per_tensor()
        self.register_buffer("rng_state", torch.tensor([seed, 0], dtype=torch.int64,
                                                       device=device), persistent=False)
        self.amax_group = amax_group
        self.weight_cache = weight_cache
        self._kept_weight: Dict[tuple, NVFP4Tensor] = {}

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Optional[LinearRecipe] = None,
                    seed: int = 0, amax_group=None, weight_cache: bool = False) -> "Linear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype, recipe=recipe, seed=seed,
                  amax_group=amax_group, weight_cache=weight_cache)
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        return new

    def quantized_weight(self, columnwise: bool = True) -> NVFP4Tensor:
        """The weight in NVFP4 (rowwise, plus the twin when asked); with weight_cache kept by
        version and storage, except in traced (torch.compile) and captured (CUDA graph) calls:
        a graph replays no Python, so a kept weight would stay the one of the capture after
        in-place updates between replays (an optimizer step)."""
        recipe = _with_outputs(self.recipe.weight, True, columnwise)
        w = self.weight
        if not self.weight_cache or torch.compiler.is_compiling() or (
                w.is_cuda and torch.cuda.is_current_stream_capturing()):
            return api.quantize(w.detach(), recipe)
        key = (w._version, w.data_ptr(), w.dtype, columnwise)
        cached = self._kept_weight.get(key)
        if cached is None:
            cached = api.quantize(w.detach(), recipe)
            self._kept_weight = {key: cached}
        return cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        x = _autocast_input(x)
        if not x.is_contiguous():
            x = x.contiguous()
        return _LinearFunction.apply(x, self.weight, self.bias, self, self.recipe)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", recipe={self.recipe}"


class QuantizedLinear(torch.nn.Module):
    """Inference Linear with a frozen NVFP4 weight. weight_only=True runs W4A16 (bf16/fp16
    activations x NVFP4 weight; fp32 inputs are cast to bf16); otherwise activations are
    quantized per call with `activation` (W4A4). The output has the input's dtype. The quantized
    weight is stored as buffers, so a state_dict round trip keeps the exact NVFP4 bytes."""

    def __init__(self, weight: NVFP4Tensor, bias: Optional[torch.Tensor], *,
                 weight_only: bool, activation: Recipe):
        super().__init__()
        self.out_features, self.in_features = weight.rows, weight.cols
        self.weight_recipe, self.weight_dtype = weight.recipe, weight.dtype
        self.activation, self.weight_only = activation, weight_only
        self.register_buffer("weight_data", weight.data)
        self.register_buffer("weight_scales", weight.scales)
        self.register_buffer("weight_amax", weight.amax)
        self.register_buffer("bias", bias)
        self._weight = None

    @property
    def weight(self) -> NVFP4Tensor:
        """The weight buffers as an NVFP4Tensor: the same object while the buffers stay the
        same tensors (so `cute_fp4.gemm` finds the weights' checks it remembers for it,
        gemm.dispatch.prepared_weights), a new one after `.to()` / `.cuda()` or an assignment
        replaced them (under torch.compile, a new one each time: no module state changes in a
        traced forward)."""
        w = self._weight
        if (w is None or w.data is not self.weight_data or w.scales is not self.weight_scales
                or w.amax is not self.weight_amax or torch.compiler.is_compiling()):
            w = NVFP4Tensor(self.weight_data, self.weight_scales, self.weight_amax, None, None,
                            None, self.weight_recipe, (self.out_features, self.in_features),
                            self.weight_dtype)
            if not torch.compiler.is_compiling():
                self._weight = w
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _autocast_input(x).contiguous()
        if self.weight_only:
            a = x if x.dtype in (torch.bfloat16, torch.float16) else x.to(torch.bfloat16)
        else:
            a = api.quantize(x, self.activation)
        return api.gemm(a, self.weight, bias=self.bias, out_dtype=x.dtype)

    def extra_repr(self) -> str:
        mode = "W4A16" if self.weight_only else f"W4A4, activation={self.activation}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {mode}"


def convert(model: torch.nn.Module, recipe: Union[Recipe, LinearRecipe, None] = None, *,
            weight_only: bool = False, training: bool = False,
            weight_recipe: Optional[Recipe] = None,
            filter: Optional[Callable[[str, torch.nn.Linear], bool]] = None,
            include: Optional[str] = None, exclude: Optional[str] = None) -> torch.nn.Module:
    """Swap the `torch.nn.Linear` modules of `model` in place and return it.

    training=True: each becomes a `cute_fp4.nn.Linear` (recipe: a LinearRecipe, which also
    holds the weights' recipe).
    Otherwise (inference): a `QuantizedLinear` whose weight is quantized once with
    `weight_recipe` (default: per-tensor, 1x16 blocks; e.g. Recipe(scaling="window64") for
    1x64 local-encode weights; only its rowwise output is kept, so its RHT, which transforms
    the columnwise twin, does not apply); recipe is the activation Recipe of W4A4 (default
    per-token), and weight_only=True gives W4A16 instead. Both recipes' scales are stored in
    the 128x4 swizzled layout whatever their `swizzle` (it changes no value): the layout the
    GEMM kernels read, where compact scales would be converted on every call (the swizzle
    kernel on the mixed / pre-pass paths: 3.3 us of GPU time and ~20 us of host time for the
    scales of 8192 x 8192 weights, H200).
    Selection: `include` / `exclude` are fnmatch patterns on the module name; `filter(name,
    module)` decides last. Linears whose in/out features are not multiples of 16 are skipped.
    """
    if weight_recipe is not None:
        if training:
            raise ValueError("convert: weight_recipe is for inference (training=False); a "
                             "LinearRecipe holds the training weights' recipe")
        if not isinstance(weight_recipe, Recipe):
            raise TypeError(f"convert: weight_recipe must be a Recipe, got "
                            f"{type(weight_recipe).__name__}")
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        if include is not None and not fnmatch.fnmatch(name, include):
            continue
        if exclude is not None and fnmatch.fnmatch(name, exclude):
            continue
        if filter is not None and not filter(name, module):
            continue
        if training:
            if recipe is not None and not isinstance(recipe, LinearRecipe):
                raise TypeError("convert(training=True) takes a LinearRecipe")
            new = Linear.from_linear(module, recipe)
        else:
            if recipe is not None and not isinstance(recipe, Recipe):
                raise TypeError("convert(training=False) takes the activation Recipe")
            activation = (recipe or Recipe(scaling="token")).replace(
                rowwise=True, columnwise=False, rht=False, swizzle=True)
            w = module.weight.detach().contiguous()
            bias = None if module.bias is None else module.bias.detach().clone()
            w_recipe = (weight_recipe or Recipe()).replace(rowwise=True, columnwise=False,
                                                           rht=False, swizzle=True)
            new = QuantizedLinear(api.quantize(w, w_recipe), bias, weight_only=weight_only,
                                  activation=activation)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model
