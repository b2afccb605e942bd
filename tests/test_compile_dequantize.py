"""Compile tests (CPU, no GPU needed): the dequantize kernels build for sm_90a and sm_100a and
use the instructions we rely on."""

import pytest
import torch

from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.quant.dequantize import mxfp8_kernel, nvfp4_kernel

ARCHS = ["sm_90a", "sm_100a"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("swizzled", [False, True])
def test_nvfp4_dequantize_ptx(arch, swizzled):
    ptx = compile_ptx(*nvfp4_kernel(torch.bfloat16, "token", swizzled, 448), arch=arch)
    assert ptx_target(ptx) == arch
    # IEEE division by S_enc (bit-exact with the reference), 16-byte stores of 8 bf16 values.
    assert missing_instructions(ptx, [r"div\.rn\.f32", r"st\.global\.v4\.b32"]) == []
    assert "div.approx" not in ptx and "div.full" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
def test_mxfp8_dequantize_ptx(arch):
    ptx = compile_ptx(*mxfp8_kernel(torch.float8_e4m3fn, torch.bfloat16, True), arch=arch)
    assert ptx_target(ptx) == arch
    # Hardware FP8 -> wider conversion on both architectures.
    assert missing_instructions(ptx, [r"cvt\.rn\.f16x2\.e4m3x2", r"st\.global\.v4"]) == []
