"""`NVFP4Tensor`: quantized data, block scales and outer amax, for the rowwise output and its
columnwise (transposed) twin."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from .recipe import Recipe


# the tensor fields of an NVFP4Tensor, rowwise then columnwise, and their dtypes
FIELDS = ("data", "scales", "amax", "data_t", "scales_t", "amax_t")
FIELD_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float32) * 2


def present_fields(recipe: Recipe) -> Tuple[bool, ...]:
    """Which FIELDS a quantize with `recipe` produces: the rowwise three and / or the twin's."""
    return (recipe.rowwise,) * 3 + (recipe.columnwise,) * 3


@functools.lru_cache(maxsize=None)
def _transposed(recipe: Recipe) -> Recipe:
    """The recipe of a transposed NVFP4Tensor (rowwise and columnwise swapped). Cached: a
    Recipe validates itself when made (~10-30 us of host time) and a Linear training step
    transposes three tensors."""
    return recipe.replace(rowwise=recipe.columnwise, columnwise=recipe.rowwise)


@dataclasses.dataclass
class NVFP4Tensor:
    """An NVFP4-quantized 2D matrix [M, K] (the input flattened to 2D) and its twin.

    data: uint8 [M, K/2] packed E2M1 (even element in the low nibble), or None.
    scales: float8_e4m3fn [M, K/16] compact, or the padded swizzled [ceil(M/128)*128,
        ceil(K/64)*4] when recipe.swizzle.
    amax: FP32 outer amax: [1] (scaling="tensor"), [M] ("token") or [M, K/64] ("window64").
    data_t, scales_t, amax_t: the same for the columnwise twin, quantized from the [K, M]
        transposed input (after the RHT when recipe.rht).
    recipe: how it was quantized; shape: the original (unflattened) shape; dtype: its dtype.
    """

    data: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    amax: Optional[torch.Tensor]
    data_t: Optional[torch.Tensor]
    scales_t: Optional[torch.Tensor]
    amax_t: Optional[torch.Tensor]
    recipe: Recipe
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        """M: the flattened leading dimensions of the original shape."""
        m = 1
        for d in self.shape[:-1]:
            m *= d
        return m

    @property
    def cols(self) -> int:
        """K: the last dimension of the original shape."""
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        present = self.data if self.data is not None else self.data_t
        return present.device

    def t(self) -> "NVFP4Tensor":
        """The transposed matrix [K, M]: the columnwise twin becomes the rowwise data.

        GEMMs contract over the last dimension of both operands, so dgrad uses `w.t()` and
        wgrad uses `dy.t()` and `x.t()`."""
        return NVFP4Tensor(
            data=self.data_t, scales=self.scales_t, amax=self.amax_t,
            data_t=self.data, scales_t=self.scales, amax_t=self.amax,
            recipe=_transposed(self.recipe),
            shape=(self.cols, self.rows), dtype=self.dtype,
        )

    def to(self, device) -> "NVFP4Tensor":
        """The same quantized tensor with every present field on `device`."""
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in FIELDS
                                            if getattr(self, f) is not None})

    def dequantize(self, dtype: Optional[torch.dtype] = None, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rowwise data back in high precision, in the original shape (into `out`: see
        `cute_fp4.dequantize`)."""
        from .api import dequantize

        return dequantize(self, dtype or self.dtype, out=out)
