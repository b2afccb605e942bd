"""Compile tests (CPU, no GPU needed) of the sm_90 W4A16 GEMM (cute_fp4.gemm.sm90_w4a16): the
kernel builds for sm_90a and sm_100a in every variant and uses the instructions it relies on:
mma.sync m16n8k16 with FP32 accumulation (BF16 or FP16 operands), 16-byte non-allocating weight
loads with the L2 256-byte prefetch hint (8-byte ones when K % 32 != 0), unpredicated in the
main loop, the BF16x2 / FP16x2 decode multiply (FP16: E4M3 scales through
cvt.rn.f16x2.e4m3x2), and the byte permutes of the K order (activations up to 16 tokens,
weights beyond)."""

import re

import pytest
import torch

from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.gemm.sm90_w4a16 import w4a16_kernel

CASES = [
    # act, out, tile_m, unroll, row_warps, wide, swizzled, flags, bias dtype
    (torch.bfloat16, torch.bfloat16, 8, 2, 1, True, False, (False, False, False), None),
    (torch.bfloat16, torch.float32, 16, 2, 2, True, True, (True, True, True), torch.float32),
    (torch.float16, torch.float16, 32, 1, 1, False, False, (True, False, True), torch.float16),
    (torch.float16, torch.bfloat16, 64, 1, 2, True, True, (False, True, False), None),
    (torch.bfloat16, torch.float16, 64, 1, 1, False, True, (True, True, False), None),
    (torch.float16, torch.float16, 8, 1, 1, True, True, (False, False, True), torch.float16),
]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("act,out,tile_m,unroll,row_warps,wide,swizzled,flags,bias_dtype", CASES)
def test_w4a16_ptx(arch, act, out, tile_m, unroll, row_warps, wide, swizzled, flags,
                   bias_dtype):
    op, args = w4a16_kernel(act, out, tile_m=tile_m, unroll=unroll, row_warps=row_warps,
                            wide=wide, swizzled=swizzled, flags=flags, bias_dtype=bias_dtype)
    ptx = compile_ptx(op, *args, arch=arch)
    assert ptx_target(ptx) == arch
    ty = "f16" if act == torch.float16 else "bf16"
    weight_load = (r"ld\.global\.nc\.L1::no_allocate\.L2::256B\.v4\.u32" if wide
                   else r"ld\.global\.nc\.L1::no_allocate\.L2::256B\.v2\.u32")
    assert missing_instructions(ptx, [
        rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ty}\.{ty}\.f32",
        weight_load,
        r"ld\.global\.nc\.v4\.u32",
        rf"mul\.rn\.{ty}x2",
        r"prmt\.b32",
    ]) == []
    if act == torch.float16:  # the FP16 path converts scales with the E4M3 converter
        assert missing_instructions(ptx, [r"cvt\.rn\.f16x2\.e4m3x2"]) == []
    # complete stages load without predicates
    assert missing_instructions(ptx, [r"(?m)^\s*" + weight_load]) == []
    # the stage body is emitted three times at tile_m 8 (pipelined loop, last complete stage,
    # masked tail), twice otherwise (loop, masked tail): one MMA per (chunk of the stage,
    # 16-row tile, k16 step, 8-token tile) in each
    copies = 3 if tile_m == 8 else 2
    assert ptx.count("mma.sync.aligned") == copies * unroll * 2 * 8 * (tile_m // 8)
    # byte permutes of the K order: 4 per 8 activations of each token tile up to 16 tokens
    # (the decode keeps (v_i, v_{i+4}) pairs), 4 per 8 weights beyond
    per_chunk = 16 * (tile_m // 8) if tile_m <= 16 else 64
    assert len(re.findall(r"prmt\.b32", ptx)) == copies * unroll * per_chunk


def test_config_errors():
    with pytest.raises(ValueError):
        w4a16_kernel(tile_m=12)
    with pytest.raises(ValueError):
        w4a16_kernel(k_warps=8, row_warps=8)
    with pytest.raises(TypeError):
        w4a16_kernel(torch.float32)
    with pytest.raises(ValueError, match="K % 64"):
        w4a16_kernel(wide=False, window=448)
    with pytest.raises(ValueError, match="e4m3_max"):
        w4a16_kernel(window=300)
    with pytest.raises(ValueError, match="row_tiles"):
        w4a16_kernel(row_tiles=4, window=448)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("transposed", [False, True])
def test_w4a16_row_vector_ptx(arch, transposed):
    """The per-row factor of D (`row`, used by gemm_nvfp4's weight_stream path for per-token
    A operands) costs one more FP32 global load and multiply in the epilogue, in both output
    orientations; the main loop is unchanged."""
    counts = {}
    for has_row in (False, True):
        op, args = w4a16_kernel(torch.bfloat16, torch.bfloat16, tile_m=16, swizzled=True,
                                flags=(True, True, True), bias_dtype=torch.float32,
                                has_row=has_row, transposed=transposed)
        ptx = compile_ptx(op, *args, arch=arch)
        assert ptx_target(ptx) == arch
        counts[has_row] = [len(re.findall(p, ptx)) for p in
                           (r"ld\.global\.b32", r"mul\.f32", r"mma\.sync\.aligned",
                            r"st\.global\.b16")]
    assert counts[True] == [counts[False][0] + 1, counts[False][1] + 1] + counts[False][2:]
    assert counts[True][2] == 2 * 8 * 2 * 2  # loop + masked tail, k16 steps, row tiles, tokens


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("tile_m,swizzled,act", [(8, False, torch.bfloat16),
                                                 (16, True, torch.float16)])
def test_w4a16_window_ptx(arch, tile_m, swizzled, act):
    """Window64 weights: a thread's two blocks of a chunk lie one window apart, so the weights
    come in two 8-byte loads (no 16-byte ones), and each chunk adds its two windows' partial
    tiles to the accumulators with one FP32 fma per element and window (the plain kernel has
    none). Per chunk a thread loads the two window amaxes of one row half and decodes them
    (fast where the warp's amaxes allow, by a vote, else IEEE), and 8 more shuffles share the
    quad's 4 row halves x 2 windows; as many MMAs as the plain kernel, in the loop and the
    masked tail (no next-stage prefetch: its extra registers spilled)."""
    counts = {}
    for window in (0, 448):
        op, args = w4a16_kernel(act, torch.bfloat16, tile_m=tile_m, swizzled=swizzled,
                                flags=(True, True, False), window=window)
        ptx = compile_ptx(op, *args, arch=arch)
        assert ptx_target(ptx) == arch
        counts[window] = {name: len(re.findall(p, ptx)) for name, p in (
            ("mma", r"mma\.sync\.aligned\.m16n8k16"),
            ("w8", r"ld\.global\.nc\.L1::no_allocate\.L2::256B\.v2\.u32"),
            ("w16", r"ld\.global\.nc\.L1::no_allocate\.L2::256B\.v4\.u32"),
            ("fma", r"fma\.rn\.f32"),
            ("amax", r"ld\.global\.nc\.u32"),
            ("div", r"div\.rn\.f32"),
            ("rcp", r"rcp\.rn\.f32"),
            ("rcp_approx", r"rcp\.approx\.ftz\.f32"),
            ("vote", r"vote\.sync\.all"),
            ("shfl", r"shfl\.sync\.idx"))}
    copies, tokens, row_halves = 2, tile_m // 8, 4
    plain = counts[0]
    # per factor the fast decode has 2 approximate reciprocals and 6 fma (division and
    # reciprocal with their corrections), the IEEE one (taken when a warp's amaxes leave the
    # fast domain) a div.rn and an rcp.rn
    assert counts[448] == {"mma": copies * 8 * 2 * tokens, "w8": copies * row_halves * 2,
                           "w16": 0, "fma": copies * (2 * tokens * 2 * 4 + 2 * 6),
                           "amax": copies * 2, "div": copies * 2, "rcp": copies * 2,
                           "rcp_approx": copies * 2 * 2, "vote": copies,
                           "shfl": plain["shfl"] + copies * 8}  # the plain: warp-uniform indices
    assert plain["fma"] == plain["amax"] == plain["div"] == plain["vote"] == 0
    assert plain["mma"] == (3 if tile_m == 8 else 2) * 8 * 2 * tokens


def test_pick_w4a16_config():
    """The streaming configurations of the H100 sweep (notes/gemm_w4a16.md, session 8): the
    smallest token tile holding M, 32 weight rows per CTA, 8 K-warps, or 4 up to 16 tokens on
    weight matrices of more than 16384 rows."""
    from cute_fp4.gemm.sm90_w4a16 import pick_w4a16_config

    assert pick_w4a16_config(1, 8192) == (8, 2, 8, 1, 1)
    assert pick_w4a16_config(1, 28672) == (8, 2, 4, 1, 1)
    assert pick_w4a16_config(9, 16384) == (16, 2, 8, 1, 1)
    assert pick_w4a16_config(16, 16385) == (16, 2, 4, 1, 1)
    assert pick_w4a16_config(17, 28672) == (32, 2, 8, 1, 1)
    assert pick_w4a16_config(100, 28672) == (64, 2, 8, 1, 1)
    # window64 weights (H200 sweep, session 55)
    assert pick_w4a16_config(1, 28672, window=True) == (8, 2, 8, 1, 1)
    assert pick_w4a16_config(32, 8192, window=True) == (32, 2, 8, 1, 1)
    assert pick_w4a16_config(33, 8192, window=True) == (64, 1, 4, 1, 1)
