"""Compile tests (CPU, no GPU needed) of the sm_100a NVFP4 block-scaled GEMM. The kernel has
never run (no Blackwell GPU): these tests are all the checking it gets. They assert the
instructions it is built on: TMA loads of A/B and their scale tiles, tcgen05.cp of the scales
to tensor memory, the block-scaled tcgen05.mma (mxf4nvf4, 16-element E4M3 scale blocks),
tcgen05.ld of the accumulator, the TMA store, and the compile-time epilogue options."""

import re

import pytest
import torch

from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.gemm.sm100_blockscaled import (Sm100GemmNVFP4, compile_sm100_gemm,
                                             gemm_nvfp4_sm100, sm100_gemm_kernel)

CVT = {torch.bfloat16: r"cvt\.rn\.bf16x2\.f32", torch.float16: r"cvt\.rn\.f16x2\.f32"}


def count(ptx, pattern):
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("out_dtype,tile_n,flags,bias_dtype", [
    (torch.bfloat16, 256, (True, True, True, True), torch.bfloat16),
    (torch.float16, 128, (True, False, True, True), torch.float32),
    (torch.float32, 128, (False, False, False, False), None),
    (torch.float32, 256, (False, True, False, False), None),
])
def test_sm100_gemm_ptx(out_dtype, tile_n, flags, bias_dtype):
    ptx = compile_ptx(*sm100_gemm_kernel(out_dtype, tile_n, flags, bias_dtype), arch="sm_100a")
    assert ptx_target(ptx) == "sm_100a"
    mma = r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale\.block16"
    assert missing_instructions(ptx, [
        mma,
        r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4",
        r"tcgen05\.ld\.sync\.aligned\.32x32b",
        r"tcgen05\.wait::ld",
        r"tcgen05\.commit\.cta_group::1\.mbarrier::arrive",
        r"tcgen05\.alloc\.cta_group::1",
        r"tcgen05\.dealloc\.cta_group::1",
        r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes",
        r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.tile\.bulk_group",
    ]) == []
    # One k-tile of 256 per stage: four MMAs of K=64, unrolled; one tcgen05.cp per 128x4
    # scale atom (A: 4 atoms, B: 4 per 128 rows of the tile).
    assert count(ptx, mma) == 4
    assert count(ptx, r"tcgen05\.cp\.") == 4 * (1 + tile_n // 128)
    # Four TMA loads per stage (A, B, SFA, SFB) and one TMA store.
    assert count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global") == 4
    assert count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta") == 1
    if out_dtype in CVT:
        assert re.search(CVT[out_dtype], ptx)
    # The epilogue reads only the operands it was compiled with.
    if not any(flags):
        assert "ld.global" not in ptx
    else:
        assert "ld.global" in ptx
    has_bias = flags[3]
    assert bool(re.search(r"ld\.global(\.\w+)*\.b16", ptx)) == (has_bias and
                                                                 bias_dtype != torch.float32)


def test_sm100_gemm_rejects_sm90():
    with pytest.raises(ValueError, match="sm_100a"):
        compile_sm100_gemm("sm_90a", out_dtype=torch.bfloat16, tile_n=128)
    # Compiling the kernel object itself for sm_90a fails at trace time with the same message.
    with pytest.raises(ValueError, match="sm_100a"):
        compile_ptx(*sm100_gemm_kernel(torch.bfloat16, 128), arch="sm_90a")


def test_sm100_gemm_config_errors():
    import cutlass

    with pytest.raises(ValueError, match="tile_n"):
        Sm100GemmNVFP4(cutlass.BFloat16, tile_n=192)
    with pytest.raises(TypeError, match="out_dtype"):
        sm100_gemm_kernel(torch.int32)
    with pytest.raises(TypeError, match="bias_dtype"):
        sm100_gemm_kernel(torch.bfloat16, 128, (False, False, False, True), torch.int8)


def test_sm100_wrapper_validation():
    a = torch.randint(0, 256, (64, 64), dtype=torch.uint8)
    b = torch.randint(0, 256, (32, 64), dtype=torch.uint8)
    sfa = torch.zeros(128 * 8, dtype=torch.uint8)
    sfb = torch.zeros(128 * 8, dtype=torch.uint8)
    with pytest.raises(TypeError, match="a_data"):
        gemm_nvfp4_sm100(a.to(torch.int16), sfa, b, sfb)
    with pytest.raises(ValueError, match="swizzled b_scales"):
        gemm_nvfp4_sm100(a, sfa, b, sfb[:100])
    with pytest.raises(ValueError, match="K mismatch"):
        gemm_nvfp4_sm100(a, sfa, b[:, :32].contiguous(), torch.zeros(128 * 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_nvfp4_sm100(a, sfa, b, sfb, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="CUDA"):
        gemm_nvfp4_sm100(a, sfa, b, sfb)
