"""Compile tests (CPU, no GPU needed): the recipe cast and amax kernels build for sm_90a and
sm_100a with IEEE division/reciprocal only; Philox (mul.wide.u32) and a conversion-free
stochastic encode with stochastic rounding; the 4over6 fast path uses cvt.rn.f16x2.e2m1x2 /
e4m3x2 products on sm_100a only."""

import pytest

from cute_fp4 import Recipe
from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.quant.recipes_dispatch import amax_recipe_kernel, cast_recipe_kernel

ARCHS = ["sm_90a", "sm_100a"]
RECIPES = [
    ("bf16", Recipe(block=(16, 16), columnwise=True, swizzle=True)),
    ("fp16", Recipe(rht=True, columnwise=True, scaling="token")),
    ("bf16", Recipe(stochastic_rounding=True, columnwise=True)),
    ("fp32", Recipe(scaling="window64", columnwise=True, rht=True)),
    ("bf16", Recipe(four_over_six="mse", block=(16, 16), columnwise=True)),
    ("bf16", Recipe(four_over_six="mae", fast_math=True, e4m3_max=256, scaling="token")),
]


def _ieee_only(ptx):
    assert "div.approx" not in ptx and "rcp.approx" not in ptx and "div.full" not in ptx
    assert ".ftz" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,recipe", RECIPES)
def test_cast_recipe_ptx(arch, dtype, recipe):
    ptx = compile_ptx(*cast_recipe_kernel(dtype, recipe), arch=arch)
    assert ptx_target(ptx) == arch
    need = [r"div\.rn\.f32", r"rcp\.rn\.f32", r"cvt\.rn\.satfinite\.e4m3x2\.f32",
            r"st\.global\.v2\.b32", r"ld\.global\.nc\.v4"]
    if recipe.stochastic_rounding:
        need += [r"mul\.wide\.u32", r"add\.rz\.f32"]
        # the stochastic encode needs no float <-> int conversion (slow pipe)
        assert "cvt.rmi" not in ptx and "cvt.rzi" not in ptx and "cvt.rn.f32.u32" not in ptx
    if recipe.rht:
        need += [r"sub\.rn\.f32", r"add\.rn\.f32"]
    if recipe.scaling == "window64":
        need += [r"shfl\.sync\.bfly"]
    assert missing_instructions(ptx, need) == []
    _ieee_only(ptx)
    fast = recipe.four_over_six is not None and recipe.fast_math
    assert ("cvt.rn.f16x2.e2m1x2" in ptx) == (fast and arch == "sm_100a")
    if fast and arch == "sm_100a":
        assert "mul.rn.f16x2" in ptx
    if arch == "sm_100a" and not recipe.stochastic_rounding:
        assert "cvt.rn.satfinite.e2m1x2.f32" in ptx
    if arch == "sm_90a":
        assert "e2m1" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,per_token,rht", [("bf16", False, True), ("fp32", True, True),
                                                 ("fp16", True, False)])
def test_amax_recipe_ptx(arch, dtype, per_token, rht):
    ptx = compile_ptx(*amax_recipe_kernel(dtype, per_token, rht, True, True), arch=arch)
    assert missing_instructions(ptx, [r"red\..*global\.max\.u32", r"ld\.global\.nc\.v4",
                                      r"max\.NaN\.f32"]) == []
    _ieee_only(ptx)
