"""The public ops as `torch.library` custom ops with fake (meta) implementations, so
`torch.compile(fullgraph=True)` traces through them and CUDA graphs capture them.

Each op takes tensors and primitives only (an `NVFP4Tensor` travels as its fields, a `Recipe`
as its options) and dispatches on the device: CUDA runs the CuTe DSL kernels, CPU the torch
references. Eager calls skip the dispatcher (`torch.compiler.is_compiling()` is False) and call
the same implementations directly, which keeps per-call host overhead low.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from . import ref
from .grouped import GroupedNVFP4Tensor, check_split_sizes, flat_shapes
from .recipe import Recipe
from .ref.formats import decode_scale
from .ref.quantize import block_outer_amax
from .ref.swizzle import scale_shape, unswizzle_scales
from .tensor import FIELD_DTYPES, FIELDS, NVFP4Tensor, present_fields


def recipe_args(recipe: Recipe) -> tuple:
    return (recipe.scaling, recipe.block[0], recipe.rht, recipe.stochastic_rounding,
            recipe.four_over_six or "", recipe.e4m3_max, recipe.fast_math, recipe.rowwise,
            recipe.columnwise, recipe.swizzle)


def recipe_from_args(scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math, rowwise,
                     columnwise, swizzle) -> Recipe:
    return Recipe(scaling=scaling, block=(block_rows, 16), rht=rht, stochastic_rounding=sr,
                  four_over_six=four_over_six or None, e4m3_max=e4m3_max, fast_math=fast_math,
                  rowwise=rowwise, columnwise=columnwise, swizzle=swizzle)


def _or_empty(t: Optional[Tensor], like: Tensor, dtype) -> Tensor:
    """Absent outputs travel through the op as empty tensors."""
    return t if t is not None else like.new_empty((0,), dtype=dtype)


def plain_cast(recipe: Recipe) -> bool:
    """Recipes of the bandwidth-tuned cast (quant/cast.py: 1x16 blocks per tensor or per token,
    16x16 blocks per tensor); the others run the recipe kernels (quant/cast_recipes.py: RHT,
    stochastic rounding, 4over6, window64; recipes_dispatch sends its RHT ones back to the
    plain cast's walk). A rowwise-only recipe's rht changes nothing (Recipe.twin_rht): such a
    recipe runs as without it."""
    return (recipe.scaling in ("tensor", "token")
            and not (recipe.twin_rht or recipe.stochastic_rounding or recipe.four_over_six))


def plain_cast_plan(x: Tensor, recipe: Recipe):
    """The CUDA dispatch plan of quantize(x, recipe) without amax reduction (x of any rank:
    the plan flattens it) when the plain cast runs it (`quant.dispatch.plan_for`), else
    None."""
    return _cuda().plan_for(x, recipe) if plain_cast(recipe) else None


def amax_reducer(group) -> Optional[Callable[[Tensor], object]]:
    """The in-place MAX all-reduce over `group` (a ProcessGroup, or None for no reduction)
    that the quantizers apply to the amaxes spanning a sequence-parallel input's rows."""
    if group is None:
        return None
    import torch.distributed as dist

    return lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


@functools.lru_cache(maxsize=None)
def _cuda():
    """The CUDA entry points, imported on first CUDA use (the DSL is heavy to import) and then
    looked up without the import machinery's per-call cost (~1 us each)."""
    from types import SimpleNamespace

    from .common.jit import device_arch
    from .gemm.dispatch import gemm_nvfp4, gemm_w4a16, prepared_weights
    from .gemm.factors import epilogue_operands
    from .gemm.plan import gemm as planned_gemm, gemm_key
    from .quant.dequantize import dequantize
    from .quant.dispatch import plan_for, quantize
    from .quant.recipes_dispatch import quantize_grouped, quantize_recipe
    from .quant.swizzle import swizzle_scales

    return SimpleNamespace(quantize=quantize, plan_for=plan_for, quantize_recipe=quantize_recipe,
                           quantize_grouped=quantize_grouped,
                           dequantize=dequantize, gemm_nvfp4=gemm_nvfp4, gemm_w4a16=gemm_w4a16,
                           epilogue_operands=epilogue_operands, device_arch=device_arch,
                           prepared_weights=prepared_weights, gemm_key=gemm_key,
                           planned_gemm=planned_gemm, swizzle_scales=swizzle_scales)


def quantize_impl(x2: Tensor, recipe: Recipe, seed: int, offset: int, amax_group=None,
                  rng_device: Optional[Tensor] = None, separate: bool = False,
                  column_sum: Optional[Tensor] = None,
                  out: Optional[NVFP4Tensor] = None) -> NVFP4Tensor:
    """rng_device: an int64 [seed, offset] on x2's CUDA device replacing seed / offset (read by
    the kernel on the device: CUDA-graph safe). separate: outputs in their own allocations
    (the plain cast otherwise carves them out of one). column_sum: a float32 [K] tensor that
    receives x2's column sums: read by the recipe kernels' amax pass on CUDA (scaling tensor /
    token), else a torch sum (one more read of x2). out: a checked NVFP4Tensor to quantize
    into (returned)."""
    reduce = amax_reducer(amax_group)
    if column_sum is not None and not (x2.is_cuda and not plain_cast(recipe)
                                       and recipe.scaling != "window64"):
        torch.sum(x2, 0, dtype=torch.float32, out=column_sum)
        column_sum = None
    if x2.is_cuda:
        if plain_cast(recipe):
            return _cuda().quantize(x2, recipe, amax_reduce=reduce, separate=separate, out=out)
        return _cuda().quantize_recipe(x2, recipe, seed=seed, offset=offset, amax_reduce=reduce,
                                       rng_state=rng_device, column_sum=column_sum, out=out)
    t = ref.quantize(x2, recipe, seed=seed, offset=offset, amax_reduce=reduce)
    return t if out is None else copy_fields(out, t)


def copy_fields(dst: NVFP4Tensor, src: NVFP4Tensor, names=FIELDS) -> NVFP4Tensor:
    """Copy the present tensors `names` of src into dst's (same recipe and shapes); returns
    dst."""
    for name in names:
        t = getattr(src, name)
        if t is not None:
            getattr(dst, name).copy_(t)
    return dst


def _group_from_name(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def rng_args(rng_state: Tensor):
    """(seed, offset, rng_device) from an int64 [seed, offset] tensor: a CPU one is read on
    the host (offset taken mod 2**32), a CUDA one goes to the kernel as it is."""
    if rng_state.is_cuda:
        return 0, 0, rng_state
    seed, offset = rng_state.tolist()
    return seed, offset % 2**32, None


@torch.library.custom_op("cute_fp4::quantize", mutates_args=())
def quantize_op(x: Tensor, scaling: str, block_rows: int, rht: bool, sr: bool,
                four_over_six: str, e4m3_max: int, fast_math: bool, rowwise: bool,
                columnwise: bool, swizzle: bool, rng_state: Tensor, amax_group: str,
                column_sum: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                           Tensor]:
    recipe = recipe_from_args(scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
                              rowwise, columnwise, swizzle)
    seed, offset, rng_device = rng_args(rng_state)
    sums = x.new_empty((x.shape[1] if column_sum else 0,), dtype=torch.float32)
    t = quantize_impl(x, recipe, seed, offset, _group_from_name(amax_group), rng_device,
                      separate=True, column_sum=sums if column_sum else None)
    return _unaliased(
        (_or_empty(t.data, x, torch.uint8), _or_empty(t.scales, x, torch.float8_e4m3fn),
         _or_empty(t.amax, x, torch.float32), _or_empty(t.data_t, x, torch.uint8),
         _or_empty(t.scales_t, x, torch.float8_e4m3fn), _or_empty(t.amax_t, x, torch.float32),
         sums))


def _unaliased(outs: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """Custom-op outputs may not share memory: an output in the memory of an earlier one (the
    amaxes: the columnwise one can be the rowwise one, or sit in its buffer) is cloned."""
    seen, res = set(), []
    for o in outs:
        ptr = o.untyped_storage().data_ptr()
        if o.numel() and ptr in seen:
            o = o.clone()
        seen.add(ptr)
        res.append(o)
    return tuple(res)


def output_shapes(rows: int, cols: int, recipe: Recipe):
    scales = scale_shape(rows, cols // 16, recipe.swizzle)
    amax = {"tensor": (1,), "token": (rows,), "window64": (rows, cols // 64)}[recipe.scaling]
    return (rows, cols // 2), scales, amax


@quantize_op.register_fake
def _(x, scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math, rowwise, columnwise,
      swizzle, rng_state, amax_group, column_sum):
    recipe = recipe_from_args(scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
                              rowwise, columnwise, swizzle)
    m, k = x.shape
    outs: List[Tensor] = []
    for present, (r, c) in ((rowwise, (m, k)), (columnwise, (k, m))):
        if present:
            d, s, a = output_shapes(r, c, recipe)
            outs += [x.new_empty(d, dtype=torch.uint8), x.new_empty(s, dtype=torch.float8_e4m3fn),
                     x.new_empty(a, dtype=torch.float32)]
        else:
            outs += [x.new_empty((0,), dtype=dt)
                     for dt in (torch.uint8, torch.float8_e4m3fn, torch.float32)]
    outs.append(x.new_empty((k if column_sum else 0,), dtype=torch.float32))
    return tuple(outs)


def quantize(x2: Tensor, recipe: Recipe, shape, dtype, seed: int, offset: int,
             rng_state: Optional[Tensor] = None, amax_group=None, column_sum: bool = False,
             out: Optional[NVFP4Tensor] = None):
    """Quantize a validated 2D input; through the custom op while torch.compile traces.
    rng_state (int64 [seed, offset], on the CPU or x's device), when given, replaces seed and
    offset; amax_group (a ProcessGroup) all-reduces the amaxes that span the rows (sequence
    parallelism). With column_sum: (the NVFP4Tensor, x2's column sums as float32 [K]).
    out: a checked NVFP4Tensor (same recipe, shape and dtype) that receives the result."""
    if not torch.compiler.is_compiling():
        rng_device = None
        if rng_state is not None:
            seed, offset, rng_device = rng_args(rng_state)
        sums = (torch.empty(x2.shape[1], dtype=torch.float32, device=x2.device)
                if column_sum else None)
        t = quantize_impl(x2, recipe, seed, offset, amax_group, rng_device, column_sum=sums,
                          out=out)
        if out is None:
            t.shape, t.dtype = tuple(shape), dtype
        return (t, sums) if column_sum else t
    if rng_state is None:
        rng_state = torch.tensor([seed, offset], dtype=torch.int64)
    outs = quantize_op(x2, *recipe_args(recipe), rng_state,
                       "" if amax_group is None else amax_group.group_name, column_sum)
    data, scales, amax, data_t, scales_t, amax_t = (o if p else None for o, p in
                                                     zip(outs, present_fields(recipe)))
    t = NVFP4Tensor(data, scales, amax, data_t, scales_t, amax_t, recipe, tuple(shape), dtype)
    if out is not None:
        t = copy_fields(out, t)
    return (t, outs[6]) if column_sum else t


def quantize_grouped_impl(x: Tensor, sizes: List[int], recipe: Recipe, seed: int, offset: int,
                          rng_device: Optional[Tensor] = None) -> GroupedNVFP4Tensor:
    """rng_device: as quantize_impl's."""
    if x.is_cuda:
        return _cuda().quantize_grouped(x, sizes, recipe, seed=seed, offset=offset,
                                        rng_state=rng_device)
    groups = ref.quantize_grouped(x, sizes, recipe, seed=seed, offset=offset)
    return GroupedNVFP4Tensor.from_groups(groups, sizes, x.shape[1], recipe, x.dtype)


@torch.library.custom_op("cute_fp4::quantize_grouped", mutates_args=())
def quantize_grouped_op(x: Tensor, split_sizes: List[int], scaling: str, block_rows: int,
                        rht: bool, sr: bool, four_over_six: str, e4m3_max: int, fast_math: bool,
                        rowwise: bool, columnwise: bool, swizzle: bool,
                        rng_state: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                    Tensor]:
    recipe = recipe_from_args(scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
                              rowwise, columnwise, swizzle)
    seed, offset, rng_device = rng_args(rng_state)
    g = quantize_grouped_impl(x, split_sizes, recipe, seed, offset, rng_device)
    return _unaliased(tuple(_or_empty(getattr(g, f), x, dt)
                            for f, dt in zip(FIELDS, FIELD_DTYPES)))


@quantize_grouped_op.register_fake
def _(x, split_sizes, scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
      rowwise, columnwise, swizzle, rng_state):
    recipe = recipe_from_args(scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
                              rowwise, columnwise, swizzle)
    return tuple(x.new_empty(shape if p else (0,), dtype=dt) for shape, p, dt in
                 zip(flat_shapes(split_sizes, x.shape[1], recipe), present_fields(recipe),
                     FIELD_DTYPES))


def quantize_grouped(x: Tensor, split_sizes, recipe: Recipe, seed: int, offset: int,
                     rng_state: Optional[Tensor] = None) -> GroupedNVFP4Tensor:
    """Quantize the row groups of a contiguous 2D input (split_sizes: ints or a 1D integer
    tensor, grouped.check_split_sizes); through the custom op while torch.compile traces (the
    split sizes are constants of the traced graph: new sizes trace again). rng_state: as
    quantize's."""
    sizes = check_split_sizes(x, split_sizes)
    if not torch.compiler.is_compiling():
        rng_device = None
        if rng_state is not None:
            seed, offset, rng_device = rng_args(rng_state)
        return quantize_grouped_impl(x, sizes, recipe, seed, offset, rng_device)
    if rng_state is None:
        rng_state = torch.tensor([seed, offset], dtype=torch.int64)
    outs = quantize_grouped_op(x, sizes, *recipe_args(recipe), rng_state)
    return GroupedNVFP4Tensor(*(o if p else None for o, p in zip(outs, present_fields(recipe))),
                              split_sizes=sizes, cols=x.shape[1], recipe=recipe, dtype=x.dtype)


def dequantize_impl(t: NVFP4Tensor, dtype, out: Optional[Tensor] = None) -> Tensor:
    """out: None, or a contiguous `dtype` tensor of t's shape (checked by the caller)."""
    if t.data.is_cuda and t.data.numel():
        if out is None:
            return _cuda().dequantize(t, dtype)
        _cuda().dequantize(t, dtype, out.view(t.data.shape[0], t.cols))
        return out
    result = ref.dequantize(t, dtype)
    return result if out is None else out.copy_(result)


@torch.library.custom_op("cute_fp4::dequantize", mutates_args=())
def dequantize_op(data: Tensor, scales: Tensor, amax: Tensor, scaling: str, block_rows: int,
                  rht: bool, sr: bool, four_over_six: str, e4m3_max: int, fast_math: bool,
                  rowwise: bool, columnwise: bool, swizzle: bool, cols: int,
                  dtype: torch.dtype) -> Tensor:
    recipe = recipe_from_args(scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
                              rowwise, columnwise, swizzle)
    t = NVFP4Tensor(data, scales, amax, None, None, None, recipe, (data.shape[0], cols),
                    torch.float32)
    return dequantize_impl(t, dtype)


@dequantize_op.register_fake
def _(data, scales, amax, scaling, block_rows, rht, sr, four_over_six, e4m3_max, fast_math,
      rowwise, columnwise, swizzle, cols, dtype):
    return data.new_empty((data.shape[0], cols), dtype=dtype)


def gemm_key(a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[Tensor], out_dtype: torch.dtype):
    """The GEMM plan key of two NVFP4 operands on a CUDA device (gemm.plan.gemm_key), else
    None (CPU operands, absent rowwise data: the general path)."""
    if a.data is None or not a.data.is_cuda:
        return None
    return _cuda().gemm_key(a, b, bias, out_dtype)


def planned_gemm(key: tuple, a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[Tensor],
                 out_dtype: torch.dtype, general) -> Tensor:
    """cute_fp4.gemm through its configuration's plan (gemm.plan.gemm)."""
    return _cuda().planned_gemm(key, a, b, bias, out_dtype, general)


def prepared_weights(t: NVFP4Tensor):
    """The remembered PreparedWeights of a weight NVFP4Tensor (gemm.dispatch.prepared_weights) on
    CUDA, None elsewhere."""
    return _cuda().prepared_weights(t) if t.data is not None and t.data.is_cuda else None


def dequantize(t: NVFP4Tensor, dtype, out: Optional[Tensor] = None) -> Tensor:
    if not torch.compiler.is_compiling():
        return dequantize_impl(t, dtype, out)
    result = dequantize_op(t.data, t.scales, t.amax, *recipe_args(t.recipe), t.cols,
                           dtype).view(t.shape)
    return result if out is None else out.copy_(result)


def gemm_impl(a: Tensor, a_scales: Optional[Tensor], a_amax: Optional[Tensor], a_scaling: str,
              a_e4m3_max: int, b: Tensor, b_scales: Tensor, b_amax: Tensor, b_scaling: str,
              b_e4m3_max: int, bias: Optional[Tensor], out_dtype: torch.dtype,
              a_swizzled: bool, b_swizzled: bool) -> Tensor:
    """One 2D GEMM. a: packed E2M1 [M, K/2] with E4M3 scales (compact or swizzled) and its
    outer amax, or a dense bf16/fp16 [M, K] (a_scaling "dense", no scales or amax; W4A16);
    b: packed E2M1 [N, K/2] with E4M3 scales and its outer amax."""
    n, k = b.shape[0], b.shape[1] * 2
    a_win = a_amax if a_scaling == "window64" else None
    b_win = b_amax if b_scaling == "window64" else None
    if a_win is not None and b_win is not None and a_e4m3_max != b_e4m3_max:
        raise ValueError("window64 operands of one GEMM must share e4m3_max")
    win_e4m3_max = a_e4m3_max if a_win is not None else b_e4m3_max
    factors_args = (a_scaling, a_amax, a_e4m3_max, b_scaling, b_amax, b_e4m3_max)
    if a.is_cuda:
        gemm_nvfp4, gemm_w4a16 = _cuda().gemm_nvfp4, _cuda().gemm_w4a16
        alpha, row, col = _cuda().epilogue_operands(*factors_args,
                                                    _cuda().device_arch(a.device))
        if a_scales is None:
            return gemm_w4a16(a, b, b_scales, alpha=alpha, col=col, bias=bias,
                              out_dtype=out_dtype, scales_swizzled=b_swizzled,
                              b_window_amax=b_win, e4m3_max=win_e4m3_max)
        if a_swizzled != b_swizzled:  # bring a's scales to b's layout
            a_scales = (_cuda().swizzle_scales(a_scales) if b_swizzled
                        else unswizzle_scales(a_scales, a.shape[0], k // 16))
        return gemm_nvfp4(a, a_scales, b, b_scales, alpha=alpha, row=row, col=col, bias=bias,
                          out_dtype=out_dtype, scales_swizzled=b_swizzled,
                          a_window_amax=a_win, b_window_amax=b_win, e4m3_max=win_e4m3_max)

    alpha, row, col = ref.epilogue_factors(*factors_args)

    def factors(rows, scales, swizzled, window_amax):
        f = (unswizzle_scales(scales, rows, k // 16) if swizzled else scales).to(torch.float32)
        if window_amax is None:
            return f
        return f * decode_scale(block_outer_amax(window_amax, "window64", rows), win_e4m3_max)

    a_factors = None if a_scales is None else factors(a.shape[0], a_scales, a_swizzled, a_win)
    return ref.gemm(a, a_factors, b, factors(n, b_scales, b_swizzled, b_win),
                    alpha=alpha, row=row, col=col, bias=bias, out_dtype=out_dtype)


@torch.library.custom_op("cute_fp4::gemm", mutates_args=())
def gemm_op(a: Tensor, a_scales: Optional[Tensor], a_amax: Optional[Tensor], a_scaling: str,
            a_e4m3_max: int, b: Tensor, b_scales: Tensor, b_amax: Tensor, b_scaling: str,
            b_e4m3_max: int, bias: Optional[Tensor], out_dtype: torch.dtype, a_swizzled: bool,
            b_swizzled: bool) -> Tensor:
    return gemm_impl(a, a_scales, a_amax, a_scaling, a_e4m3_max, b, b_scales, b_amax,
                     b_scaling, b_e4m3_max, bias, out_dtype, a_swizzled, b_swizzled)


@gemm_op.register_fake
def _(a, a_scales, a_amax, a_scaling, a_e4m3_max, b, b_scales, b_amax, b_scaling, b_e4m3_max,
      bias, out_dtype, a_swizzled, b_swizzled):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def gemm(*args) -> Tensor:
    if not torch.compiler.is_compiling():
        return gemm_impl(*args)
    return gemm_op(*args)
