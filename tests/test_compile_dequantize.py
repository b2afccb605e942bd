"""Compile tests (CPU, no GPU needed): the dequantize kernels build for sm_90a and sm_100a and
use the instructions we rely on."""

import os
import re
import time

import pytest
import torch

from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.quant.dequantize import BLOCKS_PER_THREAD, mxfp8_kernel, nvfp4_kernel

ARCHS = ["sm_90a", "sm_100a"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("swizzled", [False, True])
def test_nvfp4_dequantize_ptx(arch, swizzled):
    ptx = compile_ptx(*nvfp4_kernel(torch.bfloat16, "token", swizzled, 448), arch=arch)
    assert ptx_target(ptx) == arch
    # IEEE division by S_enc (bit-exact with the reference), 8-byte read-only loads of a
    # block's codes, BLOCKS_PER_THREAD of them per thread, 16-byte stores of 8 bf16 values.
    assert missing_instructions(ptx, [r"div\.rn\.f32", r"st\.global\.v4\.b32",
                                      r"ld\.global\.nc\.v2\.b32"]) == []
    assert "div.approx" not in ptx and "div.full" not in ptx
    assert len(re.findall(r"ld\.global\.nc\.v2\.b32", ptx)) == BLOCKS_PER_THREAD[16]


@pytest.mark.parametrize("dtype,lut", [(torch.bfloat16, "bf16"), (torch.float16, "f16"),
                                       (torch.float32, None)])
def test_nvfp4_dequantize_lut_ptx(dtype, lut):
    """Every output dtype loads BLOCKS_PER_THREAD blocks' codes first (8-byte read-only
    loads); bf16 / fp16 decode a block in its fast path by table look-ups: out(q1) and
    out(q15) converted once per block, 8 prmt look-ups, 8 interleaves and 8 sign spreads
    (sign-replicate selectors) per 16 values; fp32 has no table."""
    ptx = compile_ptx(*nvfp4_kernel(dtype, "tensor", False, 448), arch="sm_90a")
    blocks = BLOCKS_PER_THREAD[torch.finfo(dtype).bits]
    loads = len(re.findall(r"ld\.global\.nc\.v2\.b32", ptx))
    spreads = len(re.findall(r"prmt\.b32 sg, se, ", ptx))
    assert loads == blocks
    if lut is None:
        assert spreads == 0
        return
    assert spreads == 8 * blocks
    assert len(re.findall(rf"cvt\.rn\.{lut}\.f32", ptx)) >= 2 * blocks


def _kernel_args(fmt, dtype):
    if fmt == "nvfp4":
        return nvfp4_kernel(dtype, "token", False, 448), 16, BLOCKS_PER_THREAD[
            torch.finfo(dtype).bits]
    return mxfp8_kernel(torch.float8_e4m3fn, dtype, True), 32, 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_warp_linear_stores(fmt, dtype):
    """Each block goes out through shared memory (warp_linear_store): per 16 output bytes one
    16-byte shared store, one 16-byte shared load and one 16-byte global store (no other global
    stores); the warp syncs between a block's writes and reads and before a buffer is reused;
    each global store is predicated on its block index (the grid's tail)."""
    args, values, blocks = _kernel_args(fmt, dtype)
    ptx = compile_ptx(*args, arch="sm_90a")
    chunks = blocks * values * torch.finfo(dtype).bits // 8 // 16
    assert len(re.findall(r"st\.shared\.v4\.b32", ptx)) == chunks
    assert len(re.findall(r"ld\.shared\.v4\.b32", ptx)) == chunks
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == chunks
    assert len(re.findall(r"st\.global", ptx)) == chunks
    assert len(re.findall(r"bar\.warp\.sync", ptx)) == 2 * blocks - 1
    assert len(re.findall(r"setp\.\w+\.s64[^\n]*\n\s*@%p\d+ bra", ptx)) == chunks


@pytest.mark.parametrize("arch", ARCHS)
def test_mxfp8_dequantize_ptx(arch):
    ptx = compile_ptx(*mxfp8_kernel(torch.float8_e4m3fn, torch.bfloat16, True), arch=arch)
    assert ptx_target(ptx) == arch
    # Hardware FP8 -> wider conversion on both architectures.
    assert missing_instructions(ptx, [r"cvt\.rn\.f16x2\.e4m3x2", r"st\.global\.v4"]) == []


def test_kernel_disk_cache_round_trip(tmp_path, monkeypatch):
    """The disk cache (common.jit): a compiled kernel is exported once and a later cache loads
    its TVM-FFI function instead of compiling; a damaged file warns and is compiled and
    written again; CUTE_FP4_KERNEL_CACHE=0 writes nothing; the default directory is under
    XDG_CACHE_HOME; other code versions' directories unused for 30 days are removed."""
    import tvm_ffi

    from cute_fp4.common import jit
    from cute_fp4.quant.dequantize import nvfp4_kernel

    def build():
        return jit.compile_kernel(*nvfp4_kernel(torch.bfloat16, "tensor", True, 448),
                                  arch="sm_90a")

    def no_build():
        raise AssertionError("compiled although the kernel is on disk")

    key = ("test_kernel_disk_cache", 1)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(jit, "_current_arch", lambda: "sm_90a")
    monkeypatch.setenv("CUTE_FP4_KERNEL_CACHE", "0")
    assert jit.kernel_cache_root() is None
    jit.KernelCache().get(key, build)
    monkeypatch.delenv("CUTE_FP4_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit.kernel_cache_root() == tmp_path / "xdg" / "cute_fp4" / "kernels"
    root = tmp_path / "kernels"
    stale, recent = root / "stale_version", root / "recent_version"
    for old in (stale, recent):
        old.mkdir(parents=True)
    os.utime(stale, (time.time() - 31 * 24 * 3600,) * 2)
    monkeypatch.setenv("CUTE_FP4_KERNEL_CACHE", str(root))
    jit.KernelCache().get(key, build)
    assert not stale.exists() and recent.is_dir()
    files = list(root.glob("*/*.o"))
    assert len(files) == 1 and files[0].stat().st_size > 1000
    loaded = jit.KernelCache().get(key, no_build)
    assert isinstance(loaded, tvm_ffi.Function) and jit.ffi_function(loaded) is loaded
    with pytest.raises(AssertionError, match="compiled although"):
        jit.KernelCache().get(("test_kernel_disk_cache", 2), no_build)
    files[0].write_bytes(b"damaged")
    with pytest.warns(RuntimeWarning, match="could not load the cached kernel"):
        jit.KernelCache().get(key, build)
    assert files[0].read_bytes() != b"damaged"
    assert isinstance(jit.KernelCache().get(key, no_build), tvm_ffi.Function)
