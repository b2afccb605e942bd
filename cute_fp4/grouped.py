"""`GroupedNVFP4Tensor`: the result of `quantize_grouped`, every group's fields back to back in
flat buffers, and the groups' `NVFP4Tensor` views made on first access.

A grouped call's host time was mostly its per-group views (6-8 tensors per group, ~1-2.5 us
each: 8 groups ~2x one single-tensor call, 64 groups ~8x; notes/quant_recipes.md "Session
50"); a consumer of the flat buffers (a grouped GEMM) does not need them."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import List, Optional, Tuple

import torch

from .recipe import Recipe
from .ref.swizzle import scale_shape
from .tensor import FIELD_DTYPES, FIELDS, NVFP4Tensor, present_fields


def group_lengths(rows: int, cols: int, recipe: Recipe) -> Tuple[int, ...]:
    """The elements of each field (FIELDS order) of the NVFP4Tensor of a [rows, cols] group,
    as a GroupedNVFP4Tensor lays them back to back: packed data bytes, scales (padded when
    swizzled), amaxes (one, one per row / column, one per 64-wide window of a row / column)."""
    sr, sc = scale_shape(rows, cols // 16, recipe.swizzle)
    tr, tc = scale_shape(cols, rows // 16, recipe.swizzle)
    if recipe.scaling == "tensor":
        a, at = 1, 1
    elif recipe.scaling == "token":
        a, at = rows, cols
    else:
        a, at = rows * (cols // 64), cols * (rows // 64)
    return rows * cols // 2, sr * sc, a, cols * rows // 2, tr * tc, at


def _piece_lens(sizes: Tuple[int, ...], cols: int, recipe: Recipe) -> Tuple[Tuple[int, ...], ...]:
    """Per field (FIELDS order), the lengths of the groups' pieces of the flat field along its
    first dimension (data and scales: rows, the others: elements). Cached in eager calls (a
    grouped call's split sizes often repeat); torch.compile traces it."""
    lens = list(zip(*(group_lengths(mg, cols, recipe) for mg in sizes))) or [()] * 6
    lens[0] = sizes
    lens[1] = tuple(scale_shape(mg, cols // 16, recipe.swizzle)[0] for mg in sizes)
    return tuple(lens)


_piece_lens_cached = functools.lru_cache(maxsize=256)(_piece_lens)


def piece_lens(sizes: Tuple[int, ...], cols: int, recipe: Recipe) -> Tuple[Tuple[int, ...], ...]:
    """_piece_lens, from its cache outside torch.compile."""
    if torch.compiler.is_compiling():
        return _piece_lens(sizes, cols, recipe)
    return _piece_lens_cached(sizes, cols, recipe)


def check_split_sizes(x: torch.Tensor, split_sizes) -> List[int]:
    """The split sizes of a grouped quantize of x as ints, from a sequence of ints or a 1D
    integer tensor (one device-to-host copy for a CUDA one, e.g. an MoE router's token counts;
    it waits for the GPU); ValueError: x not 2D, a negative size, sizes not summing to x's
    rows."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("quantize_grouped expects a 2D [sum(M_i), K] tensor")
    if isinstance(split_sizes, torch.Tensor):
        if split_sizes.dim() != 1 or split_sizes.is_floating_point() or split_sizes.is_complex():
            raise ValueError("split_sizes as a tensor must be a 1D integer tensor, got "
                             f"{split_sizes.dtype} of shape {tuple(split_sizes.shape)}")
        split_sizes = split_sizes.tolist()
    sizes = [int(v) for v in split_sizes]
    if any(v < 0 for v in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(f"split_sizes {sizes} must be non-negative and sum to {x.shape[0]}")
    return sizes


def flat_shapes(sizes: Sequence[int], cols: int, recipe: Recipe) -> Tuple[tuple, ...]:
    """The shapes of a GroupedNVFP4Tensor's flat fields (FIELDS order; absent outputs too)."""
    lens = piece_lens(tuple(sizes), cols, recipe)
    scale_cols = scale_shape(0, cols // 16, recipe.swizzle)[1]
    return ((sum(sizes), cols // 2), (sum(lens[1]), scale_cols)) + tuple(
        (sum(n),) for n in lens[2:])


def split_groups(flat: Tuple[Optional[torch.Tensor], ...], sizes: Sequence[int], cols: int,
                 recipe: Recipe, dtype: torch.dtype,
                 shapes: Optional[Sequence[tuple]] = None) -> List[NVFP4Tensor]:
    """Each group's NVFP4Tensor of flat fields laid out as GroupedNVFP4Tensor's (absent ones
    None); shapes: the groups' original shapes ([M_g, cols] by default). One group takes its
    fields' views without splitting them (a single-tensor quantize)."""
    swz, window = recipe.swizzle, recipe.scaling == "window64"
    if shapes is None:
        shapes = [(mg, cols) for mg in sizes]
    if len(sizes) == 1:
        parts = [None if t is None else (t,) for t in flat]
    else:
        parts = [None if t is None else t.split_with_sizes(lens)
                 for t, lens in zip(flat, piece_lens(tuple(sizes), cols, recipe))]
    none = (None,) * len(sizes)
    d, sc, a, dt, st, at = (none if p is None else p for p in parts)
    if flat[3] is not None:
        dt = [t.view(cols, mg // 2) for t, mg in zip(dt, sizes)]
    if flat[4] is not None:
        st = [t.view(scale_shape(cols, mg // 16, swz)) for t, mg in zip(st, sizes)]
    if window:
        if flat[2] is not None:
            a = [t.view(mg, cols // 64) for t, mg in zip(a, sizes)]
        if flat[5] is not None:
            at = [t.view(cols, mg // 64) for t, mg in zip(at, sizes)]
    return [NVFP4Tensor(*f, recipe=recipe, shape=tuple(shape), dtype=dtype)
            for f, shape in zip(zip(d, sc, a, dt, st, at), shapes)]


class GroupedNVFP4Tensor(Sequence):
    """The row groups of a [sum(M_g), K] input quantized independently (`quantize_grouped`):
    a sequence of the groups' NVFP4Tensor (`result[g]`, iteration, len), and their fields
    back to back in group order, for consumers of flat buffers (grouped GEMMs):

    data: uint8 [sum(M_g), K/2]; scales: float8_e4m3fn [sum of the groups' scale rows, scale
    columns] (swizzled: each group's padded to 128 rows); amax: float32, each group's amaxes
    flattened; data_t, scales_t, amax_t: 1D, each group's twin flattened (group g's data_t is
    [K, M_g / 2]). Absent outputs are None. `offsets(name)`: where each group's piece starts.
    The groups' NVFP4Tensor views of these buffers are made on first access (host time: 6-8
    tensors per group)."""

    def __init__(self, data, scales, amax, data_t, scales_t, amax_t, *,
                 split_sizes: Sequence[int], cols: int, recipe: Recipe, dtype: torch.dtype):
        self.data, self.scales, self.amax = data, scales, amax
        self.data_t, self.scales_t, self.amax_t = data_t, scales_t, amax_t
        self.split_sizes = tuple(split_sizes)
        self.cols, self.recipe, self.dtype = cols, recipe, dtype
        self._groups = None

    @classmethod
    def from_groups(cls, groups: List[NVFP4Tensor], split_sizes: Sequence[int], cols: int,
                    recipe: Recipe, dtype: torch.dtype) -> "GroupedNVFP4Tensor":
        """The grouped tensor of per-group results (the CPU reference): their fields
        concatenated (its groups are then views of those, as on the GPU)."""
        flat = []
        for name, on, shape, dt in zip(FIELDS, present_fields(recipe),
                                       flat_shapes(split_sizes, cols, recipe), FIELD_DTYPES):
            if not on:
                flat.append(None)
            elif not groups:
                flat.append(torch.empty(shape, dtype=dt))
            elif name in ("data", "scales"):
                flat.append(torch.cat([getattr(t, name) for t in groups]))
            else:
                flat.append(torch.cat([getattr(t, name).reshape(-1) for t in groups]))
        return cls(*flat, split_sizes=split_sizes, cols=cols, recipe=recipe, dtype=dtype)

    def groups(self) -> List[NVFP4Tensor]:
        """Every group's NVFP4Tensor (views of the flat fields, made once)."""
        if self._groups is None:
            flat = tuple(getattr(self, name) for name in FIELDS)
            self._groups = split_groups(flat, self.split_sizes, self.cols, self.recipe,
                                        self.dtype)
        return self._groups

    def __len__(self) -> int:
        return len(self.split_sizes)

    def __getitem__(self, g):
        return self.groups()[g]

    def __iter__(self):
        return iter(self.groups())

    def to(self, device) -> "GroupedNVFP4Tensor":
        """The same grouped tensor with every present flat field on `device`."""
        return GroupedNVFP4Tensor(
            *(None if getattr(self, f) is None else getattr(self, f).to(device) for f in FIELDS),
            split_sizes=self.split_sizes, cols=self.cols, recipe=self.recipe, dtype=self.dtype)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Every group's rowwise data back in high precision (`dtype`, default the input's),
        one group after another: [sum(M_g), K] (one dequantize per nonempty group, into its
        rows)."""
        if self.data is None:
            raise ValueError("this GroupedNVFP4Tensor has no rowwise data")
        dtype = dtype or self.dtype
        out = torch.empty((self.data.shape[0], self.cols), dtype=dtype, device=self.data.device)
        offs = self.offsets("data")
        for g, t in enumerate(self):
            if offs[g + 1] > offs[g]:
                t.dequantize(dtype, out=out[offs[g]:offs[g + 1]])
        return out

    def offsets(self, name: str) -> List[int]:
        """The element offset of each group's piece of flat field `name` (one of FIELDS),
        and the field's length last (data and scales: their rows)."""
        lens = piece_lens(self.split_sizes, self.cols, self.recipe)[FIELDS.index(name)]
        return list(itertools.accumulate(lens, initial=0))

    def __repr__(self) -> str:
        return (f"GroupedNVFP4Tensor(split_sizes={list(self.split_sizes)}, cols={self.cols}, "
                f"recipe={self.recipe}, dtype={self.dtype})")
