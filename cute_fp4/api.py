"""Public operations. CUDA tensors run the CuTe DSL kernels; CPU tensors run the torch
references (same results, slower)."""

from __future__ import annotations

import weakref
from typing import Optional, Sequence, Tuple, Union

import torch

from . import ops
from .grouped import GroupedNVFP4Tensor
from .recipe import Recipe
from .ref.formats import FLOAT_DTYPES as OUT_DTYPES
from .ref.dequantize import check_out_tensor
from .ref.quantize import check_quantize_input
from .tensor import NVFP4Tensor



def _check_rng_state(rng_state: Optional[torch.Tensor], x: torch.Tensor):
    if rng_state is not None and (not isinstance(rng_state, torch.Tensor)
                                  or rng_state.dtype != torch.int64 or rng_state.shape != (2,)
                                  or (rng_state.is_cuda and rng_state.device != x.device)):
        raise ValueError(f"rng_state must be an int64 tensor of shape [2] (seed, offset) on "
                         f"the CPU or on x's device ({x.device})")


def _check_contiguous(x: torch.Tensor, name: str):
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def quantize(x: torch.Tensor, recipe: Recipe = Recipe(), *, seed: int = 0, offset: int = 0,
             rng_state: Optional[torch.Tensor] = None, amax_group=None,
             out: Optional[NVFP4Tensor] = None) -> NVFP4Tensor:
    """Quantize `x` ([..., K], bf16/fp16/fp32) to NVFP4 per `recipe`.

    seed/offset key the Philox generator of stochastic rounding (ignored otherwise);
    rng_state, an int64 tensor [seed, offset] on the CPU or on x's device, replaces them (a
    module can advance it in place, which torch.compile traces). On x's CUDA device the kernel
    reads it there: no host sync, and a CUDA graph replays with the values it holds then.
    amax_group: a `torch.distributed` process group whose ranks each hold a slice of the rows
    of one tensor (sequence parallelism). The amaxes that span rows (per-tensor amaxes, the
    per-token column amax of the twin) are MAX-all-reduced over it before use, so every rank
    produces exactly its slice of the unsharded tensor's quantization (stochastic rounding
    aside: its bits are indexed by local position). Per-row and per-window (window64; slices
    of whole 64-row windows) amaxes are local and not reduced.
    out: an NVFP4Tensor of an earlier quantize with the same recipe, shape and dtype (its
    fields contiguous, data and scales 16-byte aligned): quantize into its buffers and return
    it, with no allocation (a weight re-quantized every step, buffers a CUDA graph captured).
    The plain cast writes every output in place; the recipe kernels (and the two-launch plain
    cast) write data and scales in place and copy the amaxes from a scratch buffer.
    """
    hit = None if out is None else _out_hit(out, x, recipe)
    if hit is not None and hit.plan is not None and rng_state is None and amax_group is None:
        return hit.plan.run(x, None, False, out)
    x2 = _check_quantize_args(x, recipe, rng_state, amax_group, out, hit)
    return ops.quantize(x2, recipe, x.shape, x.dtype, seed, offset, rng_state, amax_group,
                        out=out)


def quantize_dbias(dy: torch.Tensor, recipe: Recipe = Recipe(), *, seed: int = 0,
                   offset: int = 0, rng_state: Optional[torch.Tensor] = None,
                   amax_group=None, out: Optional[NVFP4Tensor] = None
                   ) -> Tuple[NVFP4Tensor, torch.Tensor]:
    """`quantize(dy, recipe, ...)` and the sums of dy's columns over all leading dimensions,
    float32 [K]: a Linear's bias gradient (local to the rank under `amax_group`, like a BF16
    Linear's). On CUDA the recipe kernels (RHT, stochastic rounding, 4over6 with scaling
    "tensor" / "token") read it in their amax pass: per-CTA FP32 partials in a fixed order,
    then one small sum, so no extra read of dy and a deterministic result; the plain cast (1x16
    blocks, and 16x16 per tensor) and window64 take a torch sum (one more read of dy). out: as
    in `quantize`."""
    hit = None if out is None else _out_hit(out, dy, recipe)
    x2 = _check_quantize_args(dy, recipe, rng_state, amax_group, out, hit)
    return ops.quantize(x2, recipe, dy.shape, dy.dtype, seed, offset, rng_state, amax_group,
                        column_sum=True, out=out)


def _check_quantize_args(x, recipe, rng_state, amax_group, out, hit) -> torch.Tensor:
    """quantize's checks; x as 2D [M, K]. hit: `_out_hit(out, x, recipe)`, the remembered
    out, checked with an x of this shape and dtype, which passed check_quantize_input then."""
    if hit is not None:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    else:
        x2 = check_quantize_input(x, recipe)
        if out is not None:
            _check_out(out, x, x2, recipe)
    _check_contiguous(x, "x")
    _check_rng_state(rng_state, x)
    if amax_group is not None:
        import torch.distributed as dist

        if not isinstance(amax_group, dist.ProcessGroup):
            raise TypeError(f"amax_group must be a torch.distributed.ProcessGroup, got "
                            f"{type(amax_group).__name__}")
    return x2


_OUT_FIELDS = ((("data", torch.uint8), ("scales", torch.float8_e4m3fn), ("amax", torch.float32)),
               (("data_t", torch.uint8), ("scales_t", torch.float8_e4m3fn),
                ("amax_t", torch.float32)))


class _RememberedOut:
    """The last `out` _check_out accepted (eager calls only): a loop that quantizes into one
    NVFP4Tensor again and again would otherwise re-check its six tensors on every call, which
    costs more host time than the allocation out= saves (~4 us). Weak references keep nothing
    alive. A hit needs the same NVFP4Tensor holding the same recipe, shape, dtype and field
    tensor objects at the same addresses, and an input of that shape and dtype on the same
    device, with the same (or an equal) recipe as then. plan: for a CUDA input and a plain-cast
    recipe, the cast's dispatch plan, which a hit without rng_state / amax_group runs
    directly (the layers between only re-derive it: ~3 us of host time)."""

    __slots__ = ("ref", "recipe", "arg_recipe", "shape", "dtype", "device", "fields", "plan")

    def __init__(self, out: NVFP4Tensor, x: torch.Tensor, recipe: Recipe, checked):
        self.ref, self.recipe, self.arg_recipe = weakref.ref(out), out.recipe, recipe
        self.shape, self.dtype, self.device = out.shape, out.dtype, x.get_device()
        self.fields = tuple((name, weakref.ref(t), t.data_ptr()) for name, t in checked)
        self.plan = ops.plain_cast_plan(x, recipe) if x.is_cuda else None


_last_out: Optional[_RememberedOut] = None


def _out_hit(out, x, recipe: Recipe) -> Optional[_RememberedOut]:
    """The remembered out when `out` and this call match it, else None."""
    last = _last_out
    if last is None or torch.compiler.is_compiling() or not isinstance(x, torch.Tensor):
        return None
    if (last.ref() is not out or out.recipe is not last.recipe
            or (recipe is not last.arg_recipe and recipe != last.arg_recipe)
            or out.shape is not last.shape or out.dtype is not last.dtype
            or x.dtype is not last.dtype or x.shape != last.shape
            or x.get_device() != last.device):
        return None
    for name, tref, ptr in last.fields:
        t = getattr(out, name)
        if t is not tref() or t.data_ptr() != ptr:
            return None
    return last


def _check_out(out, x: torch.Tensor, x2: torch.Tensor, recipe: Recipe):
    """`out` must hold exactly the fields quantize(x, recipe) returns, on x's device."""
    global _last_out
    if not isinstance(out, NVFP4Tensor):
        raise TypeError(f"out must be an NVFP4Tensor, got {type(out).__name__}")
    if out.recipe != recipe:
        raise ValueError(f"out was quantized with another recipe ({out.recipe}); it must be "
                         f"{recipe}")
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise ValueError(f"out must come from a quantize of the same shape and dtype (out: "
                         f"{tuple(out.shape)} {out.dtype}, x: {tuple(x.shape)} {x.dtype})")
    m, k = x2.shape
    dev = x.device
    # the CUDA kernels store data and scales with 16-byte vectors; other paths copy into out
    compiling = torch.compiler.is_compiling()
    aligned = x.is_cuda and not compiling
    checked = []
    for present, fields, (rows, cols) in ((recipe.rowwise, _OUT_FIELDS[0], (m, k)),
                                          (recipe.columnwise, _OUT_FIELDS[1], (k, m))):
        if not present:
            continue
        for (name, dtype), shape in zip(fields, ops.output_shapes(rows, cols, recipe)):
            t = getattr(out, name)
            if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != dev
                    or t.shape != shape or not t.is_contiguous()
                    or (aligned and dtype != torch.float32 and t.data_ptr() % 16)):
                align = ", 16-byte aligned" if aligned and dtype != torch.float32 else ""
                raise ValueError(f"out.{name} must be a contiguous{align} {dtype} tensor of "
                                 f"shape {shape} on {dev}")
            checked.append((name, t))
    if not compiling:
        _last_out = _RememberedOut(out, x, recipe, checked)


def quantize_grouped(x: torch.Tensor, split_sizes: Union[Sequence[int], torch.Tensor],
                     recipe: Recipe = Recipe(), *, seed: int = 0, offset: int = 0,
                     rng_state: Optional[torch.Tensor] = None) -> GroupedNVFP4Tensor:
    """Quantize the row groups of a [sum(M_i), K] tensor, each with its own outer scales: a
    GroupedNVFP4Tensor (the groups' NVFP4Tensor as a sequence, and their fields back to back).
    split_sizes: ints, or a 1D integer tensor (a CUDA one is copied to the host once, which
    waits for the GPU; under torch.compile pass ints).
    rng_state: as quantize's, an int64 [seed, offset] on the CPU or on x's device replacing
    seed / offset (on the device: read by the kernel, so a CUDA graph of an MoE step advances
    its stochastic rounding with the tensor). Under torch.compile it is a custom op whose split
    sizes are constants of the graph (new sizes trace again)."""
    _check_contiguous(x, "x")
    _check_rng_state(rng_state, x)
    return ops.quantize_grouped(x, split_sizes, recipe, seed, offset, rng_state)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rowwise data of `t` in `dtype` (float32/bfloat16/float16), in the original shape.
    For the columnwise twin use `dequantize(t.t())`. out: a contiguous tensor of that dtype
    and shape on t's device, written and returned (no allocation)."""
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"dequantize expects an NVFP4Tensor, got {type(t).__name__}")
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if t.data is None:
        raise ValueError("this NVFP4Tensor has no rowwise data; use dequantize(t.t()) for "
                         "the columnwise twin")
    if out is not None:
        check_out_tensor(out, t.shape, dtype, t.device)
    return ops.dequantize(t, dtype, out)


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16, swizzled: bool = False, *,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MXFP8 data [M, K] (float8_e4m3fn / float8_e5m2, K % 32 == 0) with E8M0 scales (uint8
    [M, K/32], or the padded 128x4 swizzled layout) -> `dtype` (into `out`, a contiguous
    [M, K] tensor of that dtype on data's device, when given)."""
    from .quant.dequantize import mxfp8_dequantize as mxfp8_dequantize_any_device

    return mxfp8_dequantize_any_device(data, scales, dtype, swizzled, out)


def _check_operand(t: NVFP4Tensor, name: str):
    if t.data is None:
        raise ValueError(f"{name} has no rowwise data: quantize it with rowwise=True, or pass "
                         f"{name}.t() to use its columnwise twin")


def _prepared_fast(a, b: NVFP4Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype):
    """A W4A16 GEMM through the weights' remembered PreparedWeights
    (gemm.dispatch.prepared_weights: the weight checks done once) for a CUDA activation and
    bias the kernels take as they are; else None (the general path, with its errors)."""
    if not isinstance(a, torch.Tensor):
        return None
    w = ops.prepared_weights(b)
    if w is None:
        return None
    if (a.dtype not in (torch.bfloat16, torch.float16) or a.dim() < 2 or a.shape[-1] != w.k
            or not a.is_cuda or not a.is_contiguous() or a.get_device() != w.device.index):
        return None
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or bias.dtype not in (out_dtype, torch.float32) or bias.dim() != 1
                             or bias.shape[0] != w.n or not bias.is_contiguous()
                             or bias.get_device() != w.device.index):
        return None
    if a.dim() == 2:
        return w.w4a16(a, out_dtype, bias)
    return w.w4a16(a.view(-1, w.k), out_dtype, bias).view(a.shape[:-1] + (w.n,))


def gemm(a: Union[NVFP4Tensor, torch.Tensor], b: NVFP4Tensor, *,
         bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16
         ) -> torch.Tensor:
    """D = a @ b.T with NVFP4 `b` [N, K] and NVFP4 (W4A4) or bf16/fp16 dense (W4A16) `a`
    [..., K]; outer scales become the epilogue's alpha / per-row / per-column factors (window64
    ones the per-block factors). Returns [..., N] in out_dtype. Use `x.t()` to multiply by a
    columnwise twin."""
    if not isinstance(b, NVFP4Tensor):
        raise TypeError(f"b must be an NVFP4Tensor, got {type(b).__name__}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if not torch.compiler.is_compiling():
        if isinstance(a, NVFP4Tensor):
            key = ops.gemm_key(a, b, bias, out_dtype)
            if key is not None:
                return ops.planned_gemm(key, a, b, bias, out_dtype, _gemm)
        else:
            out = _prepared_fast(a, b, bias, out_dtype)
            if out is not None:
                return out
    return _gemm(a, b, bias, out_dtype)


def _gemm(a: Union[NVFP4Tensor, torch.Tensor], b: NVFP4Tensor, bias: Optional[torch.Tensor],
          out_dtype: torch.dtype) -> torch.Tensor:
    """gemm's general path: every check, then ops.gemm."""
    _check_operand(b, "b")
    n, k = b.rows, b.cols
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must be 1D of length N={n}, got shape {tuple(bias.shape)}")
    if isinstance(a, NVFP4Tensor):
        _check_operand(a, "a")
        if a.cols != k:
            raise ValueError(f"K mismatch: a is [{a.rows}, {a.cols}], b is [{n}, {k}]")
        a_args = (a.data, a.scales, a.amax, a.recipe.scaling, a.recipe.e4m3_max)
        a_swizzled, lead = a.recipe.swizzle, tuple(a.shape[:-1])
    elif isinstance(a, torch.Tensor):
        if a.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"a dense activation must be bfloat16 or float16, got {a.dtype}")
        if a.shape[-1] != k:
            raise ValueError(f"K mismatch: a has last dimension {a.shape[-1]}, b has K={k}")
        _check_contiguous(a, "a")
        a_args = (a.reshape(-1, k), None, None, "dense", 448)
        a_swizzled, lead = False, tuple(a.shape[:-1])
    else:
        raise TypeError(f"a must be an NVFP4Tensor or a torch.Tensor, got {type(a).__name__}")
    if a_args[0].device != b.device or (bias is not None and bias.device != b.device):
        raise ValueError(f"a, b and bias must be on one device (a: {a_args[0].device}, "
                         f"b: {b.device})")
    out = ops.gemm(*a_args, b.data, b.scales, b.amax, b.recipe.scaling, b.recipe.e4m3_max,
                   bias, out_dtype, a_swizzled, b.recipe.swizzle)
    return out.view(lead + (n,))
