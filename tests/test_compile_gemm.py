"""Compile tests (CPU, no GPU needed): the GEMM kernels build and use the instructions they rely
on (sm_90a: TMA loads, BF16 wgmma with FP32 accumulation, the BF16x2 scale multiply of the
decode and of the E4M3 scale (no conversion instructions), register reallocation between the
producer and the consumers; window64 factors by TMA and FP32 FMAs)."""

import re

import pytest
import torch

from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.gemm.dispatch import _w4a4_kernel
from cute_fp4.gemm.sm90_w4a4 import BUFFERS


# registers per thread that a 384-thread CTA gets at launch with 1, 2, 3 CTAs per SM
LAUNCH_REGS = {1: 168, 2: 80, 3: 56}


def _sm90_gemm_ptx(op, args, tile_n: int, extra=(), ctas_per_sm: int = 1,
                   ab: str = "bf16") -> str:
    """Compile an sm_90 wgmma GEMM and check what every one relies on: BF16 (or `ab`) wgmma
    with FP32 accumulation 64 x tile_n, TMA loads, the decode multiplies of that type,
    register reallocation inside the launch allocation (LAUNCH_REGS per thread at 384 threads:
    one producer warpgroup, two MMA warpgroups; asking for more makes the increase wait
    forever), and the `extra` instruction patterns. Returns the PTX."""
    ptx = compile_ptx(op, *args, arch="sm_90a")
    assert ptx_target(ptx) == "sm_90a"
    assert missing_instructions(ptx, [
        rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.{ab}\.{ab}",
        r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global",
        rf"mul\.rn\.{ab}x2",
        r"setmaxnreg\.inc",
        *extra,
    ]) == []
    dec = int(re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx).group(1))
    inc = int(re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx).group(1))
    assert dec * 128 + inc * 256 <= LAUNCH_REGS[ctas_per_sm] * 384
    return ptx


@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("out_dtype,flags,bias_dtype", [
    (torch.bfloat16, (False, False, False, False), None),
    (torch.float16, (True, True, True, True), torch.float16),
    (torch.float32, (True, False, True, True), torch.float32),
])
def test_w4a4_sm90_ptx(tile_n, out_dtype, flags, bias_dtype):
    op, args = _w4a4_kernel(out_dtype, tile_n, 4, flags, bias_dtype)
    ptx = _sm90_gemm_ptx(op, args, tile_n, [r"mul\.lo\.u32 [^;]*, 0x00100010;",
                                            r"st\.shared\.v4\.b32", r"setmaxnreg\.dec"])
    assert "cvt.rn.f16x2.e4m3x2" not in ptx


@pytest.mark.parametrize("windows", [(True, False), (False, True), (True, True)])
def test_w4a4_sm90_window64_ptx(windows):
    op, args = _w4a4_kernel(torch.bfloat16, 128, 6, (True, False, False, True), torch.float32,
                            windows)
    ptx = compile_ptx(op, *args, arch="sm_90a")
    tma_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx))
    # A, B, their scales and the window factors, at the stages - 1 prologue and BUFFERS
    # unrolled in-loop load sites
    assert tma_loads == (6 - 1 + BUFFERS) * (4 + sum(windows))
    # acc += f * part and the four k16 wgmmas at each of the BUFFERS unrolled k-tile sites
    assert len(re.findall(r"fma\.rn\.f32", ptx)) >= 64 * BUFFERS
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16", ptx)) == 4 * BUFFERS


@pytest.mark.parametrize("tile_n,windows,out_dtype", [
    (128, (True, True), torch.bfloat16), (128, (True, False), torch.float32),
    (64, (False, True), torch.float16)])
def test_window_sm90_ptx(tile_n, windows, out_dtype):
    """The window64 GEMM (sm90_window): SS wgmma (both operands from shared memory by TMA, no
    decode in the kernel), the window factors by TMA with the stage, each k-tile's wgmmas into
    one of two part tiles (the first overwrites: scale-d from a predicate) while the update of
    the previous k-tile (wait depth 1) adds it to the accumulators in FP32; register
    reallocation inside the launch bound of one CTA per SM."""
    from cute_fp4.gemm.sm90_window import window_kernel, window_max_stages

    stages = window_max_stages(tile_n, torch.empty((), dtype=out_dtype).element_size())
    op, args = window_kernel(out_dtype, tile_n, stages, (True, True, False, True),
                             torch.float32, True, 132, windows)
    ptx = compile_ptx(op, *args, arch="sm_90a")
    assert ptx_target(ptx) == "sm_90a"
    wgmma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.bf16\.bf16"
                       r" \{[^}]*\}, (\S+), (\S+),", ptx)
    # k-tile 0, the loop's pair, the even tail: 4 sites of four k16 wgmmas, A and B both
    # shared-memory descriptors (64-bit registers), none from registers
    assert len(wgmma) == 16 and all(a.startswith("%rd") and b.startswith("%rd") for a, b in wgmma)
    assert "mul.rn.bf16x2" not in ptx  # nothing decoded here
    # x, y and the window factors: one TMA load site
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 2 + sum(windows)
    per_thread = 64 * tile_n // 128
    # the update at 6 sites (two in the loop, three in the tails, ...): acc += f * part
    assert len(re.findall(r"fma\.rn\.f32", ptx)) >= 5 * per_thread
    assert (len(re.findall(r"mul(\.rn)?\.f32", ptx)) >= 5 * per_thread) == all(windows)
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == 3
    dec = int(re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx).group(1))
    inc = int(re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx).group(1))
    assert dec * 128 + inc * 256 <= LAUNCH_REGS[1] * 384
    assert int(re.search(r"\.minnctapersm\s+(\d+)", ptx).group(1)) == 1
    # the epilogue's unscale factor 2**14 (two decoded operands' 2**-7 each) as an FP32
    # immediate
    assert "0f46800000" in ptx


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_window_factors_ptx(arch):
    """The window64 factors kernel: the reference's IEEE division and reciprocal
    (ref.formats.decode_scale); a 32 x 32 tile transposed through shared memory, 4 elements
    per thread: 4 amax loads, 4 shared stores, one barrier, 4 shared loads, 4 global
    stores."""
    import cutlass

    from cute_fp4.common.jit import dyn, env_stream, fake_tensor
    from cute_fp4.gemm.factors import WindowFactors

    ptx = compile_ptx(WindowFactors(256), fake_tensor(cutlass.Float32, (dyn(), dyn()), align=4),
                      fake_tensor(cutlass.Float32, (dyn(), dyn(4))), env_stream(), arch=arch)
    assert ptx_target(ptx) == arch
    assert missing_instructions(ptx, [r"div\.rn\.f32", r"rcp\.rn\.f32"]) == []
    counts = [len(re.findall(pat, ptx)) for pat in (r"ld\.global", r"st\.shared", r"bar\.sync",
                                                   r"ld\.shared", r"st\.global")]
    assert counts == [4, 4, 1, 4, 4]


def test_window_sm90_config_errors():
    import cutlass

    from cute_fp4.gemm.sm90_window import Sm90GemmWindow

    with pytest.raises(ValueError, match="tile_n must be one of"):
        Sm90GemmWindow(cutlass.BFloat16, tile_n=256)
    with pytest.raises(ValueError, match="at least one window64 operand"):
        Sm90GemmWindow(cutlass.BFloat16, windows=(False, False))
    with pytest.raises(ValueError, match="stages must be 2.."):
        Sm90GemmWindow(cutlass.BFloat16, stages=9)


def test_window64_needs_tile_n_128():
    from cute_fp4.gemm.sm90_w4a4 import Sm90GemmNVFP4
    import cutlass

    with pytest.raises(ValueError, match="tile_n 128"):
        Sm90GemmNVFP4(cutlass.BFloat16, tile_n=256, has_a_window=True)


@pytest.mark.parametrize("tile_n,transposed,vec_store", [(256, False, True), (128, True, True),
                                                        (256, True, False)])
def test_mixed_sm90_ptx(tile_n, transposed, vec_store):
    """The predecode path's GEMM: persistent, RS wgmma (A from registers) on a TMA-loaded BF16
    stage, no per-k-tile barrier; shared memory is written only by the staged epilogue
    (16-byte global stores with vec_store)."""
    from cute_fp4.gemm.sm90_mixed import UNSCALE_W4A4, mixed_kernel

    op, args = mixed_kernel(torch.bfloat16, tile_n, 4, (True, True, True, True), torch.float32,
                            transposed, UNSCALE_W4A4, vec_store)
    ptx = _sm90_gemm_ptx(op, args, tile_n)
    assert "st.shared.v4" not in ptx
    assert ("st.global.v4.b32" in ptx) == vec_store
    # the barrier after the mbarrier initialisation and the epilogue's two per warpgroup
    # (its previous stores done before staging, staging done before its stores)
    assert len(re.findall(r"\bbar(rier)?\.sync", ptx)) == 3
    # persistent: the grid size comes from the launch, the tile loop from %nctaid
    assert "%nctaid.x" in ptx
    # x, its scales and y: one TMA load site
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 3
    # two unrolled k-tile sites of four k16 wgmmas
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 8


@pytest.mark.parametrize("tile_n,ctas_per_sm,k_split", [(16, 3, False), (32, 2, False),
                                                        (64, 2, True), (64, 1, True)])
def test_mixed_sm90_narrow_ptx(tile_n, ctas_per_sm, k_split):
    """Decode-sized tiles: a 64 x tile_n wgmma, with several CTAs per SM the launch bound that
    makes ptxas fit them (.minnctapersm) and a register split inside it; k_split's hand-over
    of the accumulators (two named barriers: one arrive and one wait each side)."""
    from cute_fp4.gemm.sm90_mixed import UNSCALE_W4A16, max_stages, mixed_kernel

    stages = max_stages(tile_n, 2, True, ctas_per_sm, k_split)
    op, args = mixed_kernel(torch.bfloat16, tile_n, stages, (True, False, True, True),
                            torch.float32, True, UNSCALE_W4A16, True, 132, ctas_per_sm,
                            k_split)
    ptx = _sm90_gemm_ptx(op, args, tile_n, ctas_per_sm=ctas_per_sm)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 8
    minctas = re.search(r"\.minnctapersm\s+(\d+)", ptx)
    assert (int(minctas.group(1)) if minctas else 1) == ctas_per_sm
    assert len(re.findall(r"\bbar(rier)?\.arrive", ptx)) == (2 if k_split else 0)


@pytest.mark.parametrize("k_slices", [2, 4])
def test_mixed_sm90_k_slices_ptx(k_slices):
    """k_slices: each thread passes two cluster barriers (release / acquire), rank 0 reads the
    other ranks' sums through DSMEM (mapa + ld.shared::cluster: 32 accumulators of a 64 x 64
    tile per thread and peer rank); k_slices needs k_split."""
    import cutlass

    from cute_fp4.gemm.sm90_mixed import (UNSCALE_W4A16, Sm90GemmMixed, max_stages,
                                          mixed_kernel)

    stages = max_stages(64, 2, True, 2, True)
    op, args = mixed_kernel(torch.bfloat16, 64, stages, (True, False, True, True),
                            torch.float32, True, UNSCALE_W4A16, True, 132, 2, True,
                            k_slices=k_slices)
    ptx = _sm90_gemm_ptx(op, args, 64, ctas_per_sm=2)
    assert len(re.findall(r"barrier\.cluster\.arrive;", ptx)) == 4  # producers + consumers
    assert len(re.findall(r"barrier\.cluster\.wait;", ptx)) == 4
    assert len(re.findall(r"ld\.shared::cluster\.f32", ptx)) == 32 * (k_slices - 1)
    assert len(re.findall(r"mapa\.shared::cluster", ptx)) == 32 * (k_slices - 1)
    with pytest.raises(ValueError, match="k_slices"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=64, stages=4, k_slices=2)
    with pytest.raises(ValueError, match="k_slices"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=64, stages=4, k_split=True, k_slices=3)


@pytest.mark.parametrize("tile_n,ctas_per_sm,k_split", [(256, 1, False), (32, 2, True)])
def test_mixed_sm90_fp16_ptx(tile_n, ctas_per_sm, k_split):
    """FP16 activations (W4A16): FP16 wgmma, the weights decoded to FP16 (FP16x2 multiplies,
    scales by the E4M3 converter), no BF16 arithmetic; a wrong unscale exponent is refused."""
    import cutlass

    from cute_fp4.gemm.sm90_mixed import (UNSCALE_W4A16, UNSCALE_W4A16_FP16, Sm90GemmMixed,
                                          max_stages, mixed_kernel)

    stages = max_stages(tile_n, 2, True, ctas_per_sm, k_split)
    op, args = mixed_kernel(torch.float16, tile_n, stages, (True, False, True, True),
                            torch.float16, True, UNSCALE_W4A16_FP16, True, 132, ctas_per_sm,
                            k_split, fp16=True)
    ptx = _sm90_gemm_ptx(op, args, tile_n, [r"cvt\.rn\.f16x2\.e4m3x2"], ctas_per_sm, "f16")
    assert "bf16" not in ptx
    with pytest.raises(ValueError, match="unscale_exp"):
        Sm90GemmMixed(cutlass.Float16, tile_n=128, stages=4, unscale_exp=UNSCALE_W4A16,
                      fp16=True)


@pytest.mark.parametrize("tile_n,ctas_per_sm,k_split,k_slices,w4a4", [
    (128, 1, False, 1, False), (32, 2, True, 2, False), (16, 3, True, 1, False),
    (128, 1, False, 1, True), (256, 1, False, 1, False), (256, 1, False, 1, True)])
def test_mixed_sm90_x_window_ptx(tile_n, ctas_per_sm, k_split, k_slices, w4a4):
    """x_window (W4A16 with window64 weights, transposed; w4a4: gemm_nvfp4's predecode path
    with the window64 operand as A, D not transposed): a fourth TMA load per stage (the
    tile's window factors), each k-tile's wgmmas into a part tile, waited for at depth 0 (the
    plain kernel keeps one k-tile in flight), then one FP32 fma per accumulator element (the
    factor of the element's row times the part); the same 8 wgmmas per two k-tiles. At
    tile_n 256: 64-wide wgmmas, one set per column slice, each slice waited for at depth 1
    (its update while the next slice runs), the last at depth 0."""
    from cute_fp4.gemm.sm90_mixed import (UNSCALE_W4A4, UNSCALE_W4A16, WINDOW_PART_N,
                                          max_stages, mixed_kernel)

    counts = {}
    transposed = not w4a4
    slices = tile_n // WINDOW_PART_N if tile_n > 128 else 1
    for x_window in (False, True):
        stages = max_stages(tile_n, 2, transposed, ctas_per_sm, k_split, x_window)
        op, args = mixed_kernel(torch.bfloat16, tile_n, stages, (False, False, True, False),
                                None, transposed, UNSCALE_W4A4 if w4a4 else UNSCALE_W4A16,
                                True, 132, ctas_per_sm, k_split, k_slices=k_slices,
                                x_window=x_window)
        ptx = _sm90_gemm_ptx(op, args, tile_n // slices if x_window else tile_n,
                             ctas_per_sm=ctas_per_sm)
        counts[x_window] = {name: len(re.findall(pat, ptx)) for name, pat in (
            ("tma", r"cp\.async\.bulk\.tensor\.2d"), ("wgmma", r"wgmma\.mma_async"),
            ("wait0", r"wgmma\.wait_group\.sync\.aligned\s+0;"),
            ("wait1", r"wgmma\.wait_group\.sync\.aligned\s+1;"), ("fma", r"fma\.rn\.f32"))}
    rows = 64 if k_split else 128
    per_thread = rows * tile_n // (128 if k_split else 256)  # accumulators per MMA thread
    plain, window = counts[False], counts[True]
    assert window == {"tma": plain["tma"] + 1, "wgmma": 8 * slices, "wait0": 2,
                      "wait1": 2 * (slices - 1), "fma": plain["fma"] + 2 * per_thread}
    assert plain["wait1"] == 2


def test_mixed_sm90_x_window_config():
    """x_window: tile_n within MIXED_WINDOW_TILE_NS (a part tile next to the accumulators);
    pick_mixed_config keeps its picks inside those limits, and beyond decode sizes weighs
    waves against WINDOW_TILE_COST."""
    import cutlass

    from cute_fp4.gemm.sm90_mixed import MIXED_WINDOW_TILE_NS, Sm90GemmMixed, pick_mixed_config

    with pytest.raises(ValueError, match="x_window"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=64, stages=3, ctas_per_sm=2, x_window=True)
    for p, q in ((8192, 1), (8192, 40), (28672, 64), (16384, 64), (8192, 512), (8192, 4096)):
        cfg = pick_mixed_config(p, q, x_window=True)
        assert cfg.tile_n <= MIXED_WINDOW_TILE_NS[cfg.ctas_per_sm], (p, q, cfg)
        plain = pick_mixed_config(p, q)
        assert (cfg.k_split, cfg.k_slices) == (plain.k_split, plain.k_slices)
    assert pick_mixed_config(8192, 4096, x_window=True).tile_n == 256
    # 128 tokens: 64-wide tiles fill twice the SMs in one wave
    assert pick_mixed_config(8192, 128, x_window=True).tile_n == 64
    assert pick_mixed_config(8192, 200, x_window=True).tile_n == 128


def test_pick_sm90_path_window64():
    """gemm_nvfp4's automatic path with window64 operands: weight_stream at decode sizes where
    only the larger operand is window64, predecode (the mixed kernel with the window64
    operand in registers, whichever is larger) with one, window with two."""
    from cute_fp4.gemm.dispatch import pick_sm90_path, predecode_swap

    assert pick_sm90_path("auto", 16, 8192, (False, True)) == "weight_stream"
    assert pick_sm90_path("auto", 8192, 1, (True, False)) == "weight_stream"
    assert pick_sm90_path("auto", 64, 8192, (False, True)) == "predecode"
    assert pick_sm90_path("auto", 16, 8192, (True, False)) == "predecode"
    assert pick_sm90_path("auto", 8192, 8192, (True, True)) == "window"
    assert pick_sm90_path("auto", 16, 8192, (True, True)) == "window"
    assert pick_sm90_path("auto", 64, 8192) == "predecode"
    assert predecode_swap(64, 8192) and not predecode_swap(8192, 64)
    assert not predecode_swap(8192, 8192)  # ties: B decoded
    assert not predecode_swap(64, 8192, (True, False))  # A window64: kept in registers
    assert predecode_swap(8192, 64, (False, True))
    with pytest.raises(NotImplementedError, match="at most one window64 operand"):
        pick_sm90_path("predecode", 64, 64, (True, True))


def test_predecode_sm90_ptx():
    """The pre-pass: 16-byte global loads and stores, the stores through shared memory as
    whole lines (common.stores.warp_linear_store), the BF16x2 decode multiplies."""
    from cute_fp4.gemm.sm90_mixed import predecode_kernel

    op, args = predecode_kernel()
    ptx = compile_ptx(op, *args, arch="sm_90a")
    assert ptx_target(ptx) == "sm_90a"
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 1
    for op in (r"st\.global\.v4\.b32", r"st\.shared\.v4\.b32", r"ld\.shared\.v4\.b32"):
        assert len(re.findall(op, ptx)) == 4
    assert len(re.findall(r"bar\.warp\.sync", ptx)) == 1
    # 4 words x 4 pairs, plus two multiplies per scale conversion
    assert len(re.findall(r"mul\.rn\.bf16x2", ptx)) == 16 + 2 * 2


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("a_scaling,b_scaling,stores", [
    ("tensor", "tensor", 1), ("token", "tensor", 2), ("token", "token", 2), ("dense", "token", 1)])
def test_epilogue_factors_ptx(arch, a_scaling, b_scaling, stores):
    """The epilogue factors: IEEE division and reciprocal without flush-to-zero (a subnormal
    decode scale stays subnormal), one store per factor vector."""
    from cute_fp4.gemm.factors import factors_kernel

    op, args = factors_kernel(a_scaling, b_scaling, 448, 256)
    ptx = compile_ptx(op, *args, arch=arch)
    assert ptx_target(ptx) == arch
    assert missing_instructions(ptx, [r"div\.rn\.f32", r"rcp\.rn\.f32"]) == []
    assert ".ftz" not in ptx
    assert len(re.findall(r"st\.global\.b32", ptx)) == stores


def test_mixed_config_errors():
    import cutlass
    from cute_fp4.gemm.sm90_mixed import Sm90GemmMixed

    with pytest.raises(ValueError, match="tile_n must be one of"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=48)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=128, ctas_per_sm=2)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=32, ctas_per_sm=3)
    with pytest.raises(ValueError, match="k_split needs tile_n <= 64"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=128, k_split=True)
    with pytest.raises(ValueError, match="stages must be 2..4"):
        Sm90GemmMixed(cutlass.BFloat16, tile_n=256, stages=5)
    # the epilogue buffer of a 256-wide FP32 tile leaves room for 2 stages
    with pytest.raises(ValueError, match="stages must be 2..2 .*Float32"):
        Sm90GemmMixed(cutlass.Float32, tile_n=256, stages=3, transposed=True)


def test_kperm64_is_a_permutation():
    from cute_fp4.gemm.sm90_mixed import kperm64

    assert sorted(kperm64().tolist()) == list(range(64))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_permute_k_ptx(arch):
    """PermuteK: per thread 4 predicated 16-byte loads (the 4 input chunks), 16 byte permutes
    (one per output word) and 4 16-byte stores, through shared memory as whole lines."""
    from cute_fp4.gemm.sm90_mixed import permute_kernel

    op, args = permute_kernel()
    ptx = compile_ptx(op, *args, arch=arch)
    assert ptx_target(ptx) == arch
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 4
    assert len(re.findall(r"prmt\.b32", ptx)) == 16
    for op in (r"st\.global\.v4\.b32", r"st\.shared\.v4\.b32", r"ld\.shared\.v4\.b32"):
        assert len(re.findall(op, ptx)) == 4


def test_pick_mixed_config():
    """Tile width by waves per SM and cost per FLOP (the shapes measured in notes/gemm.md);
    decode sizes (Q <= 64): the narrowest width, k_split / k_slices / two CTAs per SM so that
    one wave fills the SMs (notes/gemm_w4a16.md, sessions 7 and 19); stages: what shared memory holds next
    to the epilogue buffer."""
    from cute_fp4.gemm.sm90_mixed import pick_mixed_config

    assert pick_mixed_config(2048, 2048) == (256, 4, 1, False, 1)  # 1 wave of 256 = 2 of 128
    assert pick_mixed_config(4096, 1024, transposed=True) == (256, 4, 1, False, 1)
    assert pick_mixed_config(2048, 1024) == (128, 8, 1, False, 1)  # 64 tiles of 256
    assert pick_mixed_config(8192, 8192) == (256, 4, 1, False, 1)
    # 64 tiles of 128 (one wave, half the SMs) -> 128 of 64 (H200: 46.5 against 56.2 us)
    assert pick_mixed_config(8192, 100) == (64, 8, 1, False, 1)
    assert pick_mixed_config(8192, 200) == (128, 8, 1, False, 1)  # 64 would take 2 waves
    assert pick_mixed_config(28672, 128) == (128, 8, 1, False, 1)  # 224 tiles: 2 waves
    # many waves: 2% fewer SM-waves at 128 do not pay for its decode (16384x7168x2048 dgrad)
    assert pick_mixed_config(16384, 7168) == (256, 4, 1, False, 1)
    # FP32 output: a 256-wide epilogue buffer would leave 2 stages
    assert pick_mixed_config(8192, 8192, out_elt=4) == (128, 7, 1, False, 1)
    # decode sizes, W4A16 (transposed), the tiles cut to fill one wave (session 19):
    # 32 weight tiles of 128 rows -> 64 k_split tiles -> 128 CTAs in clusters of 2
    assert pick_mixed_config(4096, 64, transposed=True) == (64, 8, 1, True, 2)
    # 128 k_split tiles: in clusters of 2 at two CTAs per SM up to tile_n 32, else one each
    assert pick_mixed_config(8192, 3, transposed=True) == (16, 8, 2, True, 2)
    assert pick_mixed_config(8192, 64, transposed=True) == (64, 8, 1, True, 1)
    # 256 k_split tiles: two per SM up to tile_n 32, else 128 tiles of 128 rows
    assert pick_mixed_config(16384, 32, transposed=True) == (32, 8, 2, True, 1)
    assert pick_mixed_config(16384, 64, transposed=True) == (64, 8, 1, False, 1)
    # 224 tiles > 132 SMs: two CTAs per SM, each with half the shared memory
    assert pick_mixed_config(28672, 64, transposed=True) == (64, 7, 2, False, 1)
    assert pick_mixed_config(28672, 64, out_elt=4, transposed=True) == (64, 6, 2, False, 1)


def _decode_ptx(kind, decode, arch):
    """PTX of one GEMM kernel of each kind with alpha, row and col present and `decode`."""
    from cute_fp4.gemm.sm100_blockscaled import sm100_gemm_kernel
    from cute_fp4.gemm.sm90_mixed import UNSCALE_W4A4, mixed_kernel
    from cute_fp4.gemm.sm90_w4a16 import w4a16_kernel

    flags = (True, True, True, False)
    if kind == "w4a16":
        op, args = w4a16_kernel(torch.bfloat16, torch.bfloat16, flags=(True, True, False),
                                has_row=True, decode=decode)
    elif kind == "mixed":
        op, args = mixed_kernel(torch.bfloat16, 64, 4, flags, None, False, UNSCALE_W4A4, False,
                                decode=decode)
    elif kind == "w4a4":
        op, args = _w4a4_kernel(torch.bfloat16, 128, 4, flags, None, decode=decode)
    else:
        op, *args = sm100_gemm_kernel(torch.bfloat16, 128, flags, decode=decode)
    return compile_ptx(op, *args, arch=arch)


@pytest.mark.parametrize("kind,arch", [("w4a16", "sm_90a"), ("mixed", "sm_90a"),
                                       ("w4a4", "sm_90a"), ("sm100", "sm_100a")])
def test_epilogue_decodes_outer_amaxes_ptx(kind, arch):
    """Every GEMM kernel's epilogue turns outer amaxes into decode scales itself (decode):
    the factors kernel's IEEE division and reciprocal (no flush-to-zero) appear in its PTX,
    and a kernel given the factors has neither."""
    plain = _decode_ptx(kind, (None, None, None), arch)
    assert re.search(r"div\.rn\.f32|rcp\.rn\.f32", plain) is None
    for decode in ((448, None, None), (None, 256, None), (None, None, 448), (448, 448, 256)):
        ptx = _decode_ptx(kind, decode, arch)
        assert missing_instructions(ptx, [r"div\.rn\.f32", r"rcp\.rn\.f32"]) == [], decode
        assert ".ftz.f32" not in ptx


def test_epilogue_decode_config_errors():
    from cute_fp4.gemm.operands import OuterAmax
    from cute_fp4.gemm.sm90_w4a16 import w4a16_kernel

    with pytest.raises(ValueError, match="decode must be 3 entries"):
        w4a16_kernel(torch.bfloat16, torch.bfloat16, decode=(448, None))
    with pytest.raises(ValueError, match="decode must be 3 entries"):
        w4a16_kernel(torch.bfloat16, torch.bfloat16, decode=(300, None, None))
    with pytest.raises(ValueError, match="e4m3_max must be 448 or 256"):
        OuterAmax(torch.ones(1), 300)
    with pytest.raises(TypeError, match="must be a tensor"):
        OuterAmax(1.0)


def test_epilogue_operands_cpu_semantics():
    """epilogue_operands: one operand's amaxes go to the kernel as OuterAmax (decoded there),
    and decoding them as ref.formats.decode_scale gives ref.gemm.epilogue_factors exactly."""
    from cute_fp4 import ref
    from cute_fp4.gemm.factors import epilogue_operands
    from cute_fp4.gemm.operands import OuterAmax
    from cute_fp4.ref.formats import decode_scale

    gen = torch.Generator().manual_seed(3)
    for a_s, b_s in (("dense", "tensor"), ("dense", "token"), ("token", "tensor"),
                     ("tensor", "token"), ("token", "token"), ("window64", "tensor")):
        a_amax = torch.rand(5 if a_s == "token" else 1, generator=gen) * 100
        b_amax = torch.rand(7 if b_s == "token" else 1, generator=gen) * 100
        got = epilogue_operands(a_s, a_amax, 448, b_s, b_amax, 256, "sm_90a")
        want = ref.epilogue_factors(a_s, a_amax, 448, b_s, b_amax, 256)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert isinstance(g, OuterAmax)
                assert torch.equal(decode_scale(g.amax, g.e4m3_max), w)


def test_epilogue_operands_take_outer_amaxes():
    """operands._epilogue: OuterAmax vectors become their amax tensors plus the decode entry
    the kernels compile for; plain factors decode nothing; the amaxes are checked like
    factors (length, device)."""
    from cute_fp4.gemm.operands import OuterAmax, _epilogue

    dev = torch.device("cpu")
    amax_row, amax_col, alpha = torch.rand(5), torch.rand(7), torch.rand(1)
    a, r, c, b, decode = _epilogue(OuterAmax(alpha, 256), OuterAmax(amax_row), amax_col, None,
                                   5, 7, torch.bfloat16, dev)
    assert a is alpha and r is amax_row and c is amax_col and b is None
    assert decode == (256, 448, None)
    assert _epilogue(None, None, None, None, 5, 7, torch.bfloat16, dev)[4] == (None,) * 3
    with pytest.raises(ValueError, match="row must have 5 elements"):
        _epilogue(None, OuterAmax(torch.rand(6)), None, None, 5, 7, torch.bfloat16, dev)


def test_permute_k_out_checks():
    """permute_k's out must be the contiguous [Q, k_pad] tensor of y's dtype (the kernel
    stores it as one flat array): checked before any launch."""
    from cute_fp4.gemm.sm90_mixed import permute_k

    y = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be contiguous"):
        permute_k(y, 64, "sm_90a", out=torch.empty(2, 128, dtype=torch.bfloat16)[:, :64])
    with pytest.raises(ValueError, match=r"shape \(2, 64\) on cpu, got torch.bfloat16 \(2, 128\)"):
        permute_k(y, 64, "sm_90a", out=torch.empty(2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be a torch.bfloat16 tensor"):
        permute_k(y, 64, "sm_90a", out=torch.empty(2, 64, dtype=torch.float16))
