"""`Recipe`: every NVFP4 quantization option of SPEC section 2, validated once at construction."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

SCALINGS = ("tensor", "token", "window64")
BLOCKS = ((1, 16), (16, 16))
FOUR_OVER_SIX = (None, "mae", "mse")
E4M3_MAXES = (448, 256)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a tensor is quantized to NVFP4.

    scaling: outer (FP32) scale granularity: "tensor" (one amax), "token" (one amax per row of
        each output: per input row for the rowwise data, per input column for the columnwise
        twin) or "window64" (one amax per 64-element window along each output row).
    block: (1, 16) blocks along the row, or (16, 16) tiles (weights; every row of a tile stores
        the tile's scale).
    rht: 16-point Random Hadamard Transform of the columnwise input (amax taken after it).
    stochastic_rounding: E2M1 rounding from Philox random bits keyed by (seed, offset).
    four_over_six: None, "mae" or "mse": per block keep the map-to-4 scale where its error is
        strictly lower than the map-to-6 scale's.
    e4m3_max: 448 or 256 (256 only with four_over_six), the E4M3_MAX of the outer scale.
    fast_math: 4over6 error in the FP16 product domain instead of the input domain.
    rowwise / columnwise: which outputs to produce. swizzle: scales in the 128x4 layout.
    """

    scaling: str = "tensor"
    block: Tuple[int, int] = (1, 16)
    rht: bool = False
    stochastic_rounding: bool = False
    four_over_six: Optional[str] = None
    e4m3_max: int = 448
    fast_math: bool = False
    rowwise: bool = True
    columnwise: bool = False
    swizzle: bool = False

    def __post_init__(self):
        object.__setattr__(self, "block", tuple(self.block))
        if self.scaling not in SCALINGS:
            raise ValueError(f"Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.block not in BLOCKS:
            raise ValueError(f"Recipe.block must be one of {BLOCKS}, got {self.block!r}")
        if self.four_over_six not in FOUR_OVER_SIX:
            raise ValueError(
                f"Recipe.four_over_six must be one of {FOUR_OVER_SIX}, got {self.four_over_six!r}"
            )
        if self.e4m3_max not in E4M3_MAXES:
            raise ValueError(f"Recipe.e4m3_max must be 448 or 256, got {self.e4m3_max!r}")
        if self.e4m3_max != 448 and self.four_over_six is None:
            raise ValueError("Recipe.e4m3_max=256 is only defined with four_over_six")
        if self.fast_math and self.four_over_six is None:
            raise ValueError("Recipe.fast_math selects the 4over6 error path: set four_over_six")
        if not (self.rowwise or self.columnwise):
            raise ValueError("Recipe needs rowwise=True or columnwise=True (or both)")
        if self.block == (16, 16) and self.scaling != "tensor":
            raise ValueError(
                "Recipe.block=(16, 16) needs scaling='tensor': a per-row outer scale would give "
                "the rows of one 16x16 tile different block scales"
            )
        if self.rht and self.block != (1, 16):
            raise ValueError("Recipe.rht applies to 1x16 blocks only (RHT is for activations "
                             "and gradients; weights use 16x16 blocks without it)")
        if self.stochastic_rounding and self.four_over_six is not None:
            raise ValueError("Recipe.stochastic_rounding cannot be combined with four_over_six")

    @property
    def twin_rht(self) -> bool:
        """Whether the RHT changes an output: it transforms the columnwise twin's input only,
        so a rowwise-only recipe with rht=True gives the bytes of the same recipe without it
        (and runs its kernels)."""
        return self.rht and self.columnwise

    @property
    def block_rows(self) -> int:
        return self.block[0]

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)
