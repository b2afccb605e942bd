"""Compile tests (CPU, no GPU needed): the quantize kernels (amax, K2 cast) build for sm_90a and
sm_100a and use the instructions they rely on: TMA bulk-tensor loads in the cast, IEEE division
and reciprocal, hardware E2M1 conversion on sm_100a only (software encode on sm_90a)."""

import re

import pytest

from cute_fp4.common.compile_check import compile_ptx, missing_instructions, ptx_target
from cute_fp4.quant.cast import CastKernel
from cute_fp4.quant.dispatch import (ENC_TABLE_COMPACT_TWIN_MAX_BYTES, GROUPS_MIN_ELEMENTS,
                                     GROUPS_ROWWISE_MAX_ELEMENTS, L2_WARM_MAX_BYTES,
                                     amax_tensor_kernel, amax_token_kernel, cast_groups,
                                     cast_kernel, cast_walk, grouped_walk, token_rows_kernel)
from cute_fp4.quant.recipes_dispatch import plain_cast_walk
from cute_fp4.quant.token_rows import token_rows_config
from cute_fp4.ref.philox import PHILOX_M0, PHILOX_M1

ARCHS = ["sm_90a", "sm_100a"]
E2M1_CVT = "cvt.rn.satfinite.e2m1x2.f32"


def check_e2m1(ptx, arch):
    """E2M1 encode: the hardware cvt on sm_100a, software (no e2m1 instruction) on sm_90a."""
    if arch == "sm_100a":
        assert E2M1_CVT in ptx
    else:
        assert "e2m1" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fused_amax", [False, True])
@pytest.mark.parametrize("dtype,row,col,swizzle,per_token", [
    ("bf16", True, True, False, False),
    ("bf16", True, True, True, True),
    ("bf16", True, True, True, False),
    ("bf16", True, True, False, True),
    ("fp16", False, True, True, False),
    ("fp16", False, True, True, True),
    ("fp32", True, False, False, True),
    ("fp32", True, True, True, True),
])
def test_cast_ptx(arch, fused_amax, dtype, row, col, swizzle, per_token):
    """The cast, and its single-launch variant for tiny inputs (`fused_amax`), whose amax
    pre-pass reads the input with 16-byte read-only loads and reduces the tensor / row maxima
    with warp shuffles (column maxima of the twin go through shared memory), without atomics
    (so no zero-fill)."""
    ptx = compile_ptx(*cast_kernel(dtype, row, col, swizzle, per_token, fused_amax=fused_amax),
                      arch=arch)
    assert ptx_target(ptx) == arch
    need = [r"cp\.async\.bulk\.tensor", r"mbarrier", r"div\.rn\.f32", r"rcp\.rn\.f32",
            r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"st\.global\.v2\.b32"]
    if fused_amax:
        need += [r"ld\.global\.nc\.v4", r"max\.NaN\.f32"]
        assert ("shfl.sync.bfly" in ptx) == (row or not per_token)
        assert not re.search(r"\s(red|atom)\.", ptx)
    assert missing_instructions(ptx, need) == []
    assert "div.approx" not in ptx and "div.full" not in ptx
    # per token (no enc table) the cast's fast copy takes each block's enc from the
    # reciprocal without its slow path, and the tile's outer scale from the division and the
    # reciprocal without theirs (one rcp.approx each; CastKernel._fast_blocks_ok); not the
    # fused cast
    op = CastKernel(dtype, row, col, swizzle, per_token, 132)
    blocks = op.row_steps * row + 4 // op.esize * col
    fast = blocks + 2 if per_token and not fused_amax else 0
    assert ptx.count("rcp.approx.ftz.f32") == ptx.count("rcp.approx") == fast
    # with 16-bit inputs on sm_90 that copy's software encoder takes the codes' signs from
    # the products' sign bits, 8 at a time (one mask of the even nibbles' per 8 elements)
    bulk = fast and op.esize == 2 and arch == "sm_90a"
    assert ptx.count("0x08080808") == (2 * blocks if bulk else 0)
    if not per_token:
        # the blocks look their enc up in the CTA's table: IEEE reciprocals only for the
        # outer scale and the table fill (per token: one per outer scale and per block)
        assert ptx.count("rcp.rn.f32") == 2
    check_e2m1(ptx, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,k,swizzle,ctas", [
    ("bf16", 8192, False, 0), ("bf16", 2048, True, 3), ("fp16", 272, False, 0),
    ("bf16", 784, False, 0), ("bf16", 10240, True, 0), ("fp32", 16384, True, 0),
    ("fp32", 48, False, 2)])
def test_token_rows_ptx(arch, dtype, k, swizzle, ctas):
    """The per-token rowwise cast in the amax pass: 16-byte read-only loads, row maxima by
    redux.sync (no atomics: each CTA owns its rows), IEEE outer scales, a whole block per
    thread and unit (no shuffles between the lanes of a block), 8-byte data stores;
    the hardware E2M1 conversion on sm_100a only. Two copies of the strip's cast chosen by a
    warp vote: the blocks' IEEE reciprocals, and the fast reciprocal (rcp.approx + one
    correction) with, for 16-bit inputs on sm_90a, the codes' signs from the products' sign
    bits (prmt's sign-replicate selectors) instead of a compare per element."""
    esize = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    split = token_rows_config(k, esize, swizzle)
    ptx = compile_ptx(*token_rows_kernel(dtype, swizzle, split, ctas_per_sm=ctas), arch=arch)
    assert ptx_target(ptx) == arch
    need = [r"ld\.global\.nc\.v4", r"redux\.sync\.max\.u32", r"div\.rn\.f32", r"rcp\.rn\.f32",
            r"rcp\.approx\.ftz\.f32", r"vote\.sync\.all\.pred",
            r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"st\.global\.v2\.b32", r"shfl\.sync\.idx",
            r"bar\.sync"]
    assert missing_instructions(ptx, need) == []
    assert "div.approx" not in ptx
    assert not re.search(r"\s(red|atom)\.", ptx) and "shfl.sync.bfly" not in ptx
    signs = len(re.findall(r"prmt\.b32 \w+, \S+, \S+, 0xFB;", ptx))
    blocks = split[1] * split[2]  # per copy: one sign prmt pair per 8 elements
    assert signs == (blocks * 4 if esize == 2 and arch == "sm_90a" else 0)
    # registers capped for 4 CTAs per SM unless a thread holds more than 32 input words
    # (fp32 rows of 16384 elements: 4 blocks of 16 words)
    assert (".minnctapersm 4" in ptx) == (split[1] * split[2] * 4 * esize <= 32)
    check_e2m1(ptx, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,k,swizzle", [("bf16", 8192, False), ("fp16", 272, True),
                                             ("fp32", 16384, True), ("bf16", 2048, True)])
def test_token_rows_sr_ptx(arch, dtype, k, swizzle):
    """TokenRowCast with stochastic rounding, against the same kernel rounding to nearest:
    one Philox4x32-10 call per block in each copy of the strip's cast, the software stochastic
    encode on both archs (16 mul.rz.f32 per block, no e2m1 instruction); for 16-bit inputs
    the fast copy's signs from the inputs (one set.lt.u32 per input word) instead of the
    products' sign bits; the same loads, stores, reductions and register cap."""
    esize = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    split = token_rows_config(k, esize, swizzle)
    ptx = compile_ptx(*token_rows_kernel(dtype, swizzle, split, stochastic=True), arch=arch)
    rn = compile_ptx(*token_rows_kernel(dtype, swizzle, split), arch=arch)
    assert ptx_target(ptx) == arch
    calls = 2 * split[1] * split[2]  # blocks per thread and strip, in both copies
    assert ptx.count(f"mul.wide.u32 p0, c0, {PHILOX_M0:#010x}") == 10 * calls
    assert ptx.count(f"mul.wide.u32 p1, c2, {PHILOX_M1:#010x}") == 10 * calls
    assert f"{PHILOX_M0:#010x}" not in rn
    assert ptx.count("mul.rz.f32") == 16 * calls
    assert "e2m1" not in ptx
    ty = "bf16x2" if dtype == "bf16" else "f16x2"
    assert ptx.count(f"set.lt.u32.{ty}") == (8 * calls // 2 if esize == 2 else 0)
    assert not re.search(r"prmt\.b32 \w+, \S+, \S+, 0xFB;", ptx)  # no product sign bits
    for op in ("ld.global.nc.v4", "st.global.v2.b32", "redux.sync.max.u32", "vote.sync.all",
               "rcp.approx.ftz.f32", ".minnctapersm"):
        assert ptx.count(op) == rn.count(op), op


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,k,swizzle", [("bf16", 8192, False), ("fp16", 272, True),
                                             ("fp32", 2048, True)])
def test_token_rows_grouped_sr_ptx(arch, dtype, k, swizzle):
    """TokenRowCast of a grouped input with stochastic rounding, against the single tensor's:
    lane r loads strip row r's (Philox stream, group's first row) once per strip
    (ld.global.nc.v2), shuffled to each pass of each copy (two more shfl per pass and copy);
    the same Philox calls, loads, stores and reductions; 3 CTAs per SM instead of 4 (these
    strips fit in the registers). Rounding to nearest ignores the groups and has no grouped
    kernel."""
    esize = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    split = token_rows_config(k, esize, swizzle)
    ptx = compile_ptx(*token_rows_kernel(dtype, swizzle, split, stochastic=True, grouped=True),
                      arch=arch)
    one = compile_ptx(*token_rows_kernel(dtype, swizzle, split, stochastic=True), arch=arch)
    assert ptx.count("ld.global.nc.v2.b32") == 1
    assert "ld.global.nc.v2" not in one
    assert ptx.count("shfl.sync") == one.count("shfl.sync") + 2 * 2 * split[2]
    for op in (f"mul.wide.u32 p0, c0, {PHILOX_M0:#010x}", "ld.global.nc.v4", "st.global.v2.b32",
               "redux.sync.max.u32", "vote.sync.all", "mul.rz.f32"):
        assert ptx.count(op) == one.count(op), op
    assert [re.findall(r"\.minnctapersm (\d+)", p) for p in (ptx, one)] == [["3"], ["4"]]
    with pytest.raises(ValueError, match="grouped needs stochastic"):
        token_rows_kernel(dtype, swizzle, split, grouped=True)


def test_token_rows_config():
    """Work splits: one 16-element block per unit; threads per row a power of two covering
    the row's units (one unit each) up to 256, then up to 4 units per thread; 32 input words
    per thread and strip; None beyond 16384 columns; swizzled rows cover their padding scale
    columns."""
    assert token_rows_config(16, 2, False) == (32, 1, 4)
    assert token_rows_config(272, 2, False) == (32, 1, 4)
    assert token_rows_config(784, 2, False) == (64, 1, 4)
    assert token_rows_config(2048, 2, False) == (128, 1, 4)
    assert token_rows_config(2064, 2, False) == (256, 1, 4)
    assert token_rows_config(8192, 2, False) == (256, 2, 2)
    assert token_rows_config(8192, 4, False) == (256, 2, 1)
    assert token_rows_config(10240, 2, True) == (256, 3, 1)
    assert token_rows_config(12304, 2, True) == (256, 4, 1)
    assert token_rows_config(16384, 4, True) == (256, 4, 1)
    assert token_rows_config(16400, 2, False) is None
    assert token_rows_config(2000, 2, True) == (128, 1, 4)  # 125 -> 128 scale columns
    assert token_rows_config(2000, 2, False) == (128, 1, 4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("per_token", [False, True])
def test_cast_walks_ptx(arch, per_token):
    """Every tile walk dispatch.cast_walk picks compiles; the reverse walk, the amax
    prefetch, the band, the run, the enc table and the preload change the code (one PTX per
    walk). The run walk stages the rowwise scales in smem (byte stores) and writes them with
    16-byte stores; with preload every smem read of a tile (both rowwise steps' 16-byte loads,
    the column pass's 16 words) comes before its first scale byte store, without it only the
    first rowwise step's."""
    walks = {(2, False, False, 1, 1), (1, True, False, 1, 1), (2, True, True, 1, 1),
             (1, False, False, 1, 1), (1, True, False, 4, 1), (2, False, False, 4, 1),
             (1, True, False, 4, 8), (2, False, False, 1, 8)}
    walks = {w + (not per_token, False) for w in walks}
    if per_token:
        walks.add((1, False, True, 4, 8, False, False))  # from L2_WARM_MAX_BYTES
    else:
        walks.add((1, False, False, 4, 8, False, False))  # compact twins from 256 MiB: no table
        walks.add((1, True, False, 4, 8, True, True))  # preload
    def groups_of(walk):
        return cast_groups("bf16", True, True, False, per_token, False, walk, False, False, False,
                           1 << 20)

    ptxs = set()
    for walk in walks:
        groups = groups_of(walk)
        assert groups == (2 if walk[0] == 1 else 1)
        ptx = compile_ptx(*cast_kernel("bf16", True, True, False, per_token, walk=walk,
                                       groups=groups), arch=arch)
        assert missing_instructions(ptx, [r"cp\.async\.bulk\.tensor", r"mbarrier"]) == []
        run_stores = [r"st\.shared\.b8", r"st\.global\.v4\.b32"]
        assert (missing_instructions(ptx, run_stores) == []) == (walk[4] > 1)
        # the enc table: IEEE reciprocals for the outer scale and the table fill only
        assert (ptx.count("rcp.rn.f32") == 2) == walk[5]
        assert f".reqntid {32 * (8 * groups + 1)}, 1, 1" in ptx
        if walk[4] > 1 and groups == 1:
            before_store = ptx.split("st.shared.b8", 1)[0]
            assert before_store.count("ld.shared.v4.b32") == (4 if walk[6] else 2)
            assert (before_store.count("ld.shared.b32") >= 16) == walk[6]
        ptxs.add(ptx.split(".entry", 1)[1].split("(", 1)[1])
    # the CTA count is a launch parameter only, through the consumer groups it sets: walks
    # alike but for it share their PTX where their groups are alike; the prefetch exists per
    # token only, the preload per tensor only
    kinds = {(groups_of(w), w[1],
              w[2] and per_token, w[3], w[4], w[5], w[6] and not per_token) for w in walks}
    assert len(ptxs) == len(kinds) == (9 if per_token else 10)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,row,swizzle,per_token,walk,groups", [
    ("bf16", True, False, False, (2, True, False, 4, 8, True, False), 1),
    ("bf16", True, True, True, (2, True, True, 1, 1, False, False), 1),
    ("fp16", False, False, True, (2, False, False, 4, 1, False, True), 1),
    ("fp16", True, True, False, (1, False, False, 1, 1, False, False), 1),
    ("bf16", True, True, False, (2, False, False, 1, 1, True, False), 2),
])
def test_cast_rht_ptx(arch, dtype, row, swizzle, per_token, walk, groups):
    """The RHT cast transforms the twin on the tensor cores: per 16-row block row one
    ldmatrix .x4 .trans of the smem tile and two m16n8k16 MMAs of the input's 16-bit type with
    FP32 accumulators, whose outputs the lanes of a column exchange through smem (per block
    row and output column one 16-byte store, per output column four 16-byte loads, one warp
    barrier in between; no shuffles of the outputs); per tensor the twin's own outer amax and
    enc table (IEEE reciprocals for two outer scales, and one in the code that fills both
    tables side by side), the rest as the plain cast. With two consumer groups (the RHT per
    tensor, swizzled, from GROUPS_MIN_ELEMENTS) one CTA of 17 warps, the same code per tile."""
    ptx = compile_ptx(*cast_kernel(dtype, row, True, swizzle, per_token, walk=walk, rht=True,
                                   groups=groups), arch=arch)
    assert f".reqntid {32 * (8 * groups + 1)}, 1, 1" in ptx
    assert ptx_target(ptx) == arch
    ty = "bf16" if dtype == "bf16" else "f16"
    # per token the passes are compiled twice, the fast copy with each block's enc from the
    # reciprocal without its slow path (the row steps' and 2 per lane of the twin) and the
    # outer scale's division and reciprocal without theirs (2); preload (walk[6]) reads the
    # fragments before the copies branch
    copies = 2 if per_token else 1
    op = CastKernel(dtype, row, True, swizzle, per_token, 132, rht=True)
    fast = op.row_steps * row + 4 if per_token else 0
    # per token the fast copy's signs from the products' sign bits on sm_90 (test_cast_ptx):
    # the row steps' blocks and the twin's two per lane
    bulk = per_token and arch == "sm_90a"
    assert ptx.count("0x08080808") == (2 * (op.row_steps * row + 2) if bulk else 0)
    assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32") == 8 * copies
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == (
        4 if walk[6] else 4 * copies)
    need = [r"cp\.async\.bulk\.tensor", r"st\.global\.v2\.b32",
            r"cvt\.rn\.satfinite\.e4m3x2\.f32"]
    assert missing_instructions(ptx, need) == []
    plain = compile_ptx(*cast_kernel(dtype, row, True, swizzle, per_token, walk=walk,
                                     groups=groups), arch=arch)
    assert ptx.count("st.shared.v4.b32") - plain.count("st.shared.v4.b32") == 8 * copies
    assert ptx.count("ld.shared.v4.b32") - plain.count("ld.shared.v4.b32") == 8 * copies
    # per token the plain column pass shuffles its columns' outer scales (2 per lane), the
    # RHT twin its two output columns'; per tensor the twin's own amax reduction (5 xor steps)
    assert ptx.count("shfl.sync") == plain.count("shfl.sync") + (0 if per_token else 5)
    assert ptx.count("bar.warp.sync") == plain.count("bar.warp.sync") + copies
    assert "div.approx" not in ptx
    assert ptx.count("rcp.approx.ftz.f32") == ptx.count(".ftz") == fast
    if not per_token and walk[5]:
        assert ptx.count("rcp.rn.f32") == 3
    check_e2m1(ptx, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,row,col,swizzle,per_token,rht,walk", [
    ("bf16", True, True, False, False, False, (2, True, False, 4, 8, True, False)),
    ("fp32", True, True, True, True, False, (2, True, True, 1, 1, False, False)),
    ("fp16", False, True, False, True, False, (2, False, False, 4, 1, False, False)),
    ("bf16", True, False, True, False, False, (1, False, False, 1, 1, True, True)),
    ("bf16", True, True, False, False, True, (2, True, False, 4, 8, True, False)),
    ("fp16", False, True, True, True, True, (2, False, True, 1, 1, False, False)),
])
def test_cast_sr_ptx(arch, dtype, row, col, swizzle, per_token, rht, walk):
    """Stochastic rounding on the plain cast, against the same kernel rounding to nearest: one
    Philox4x32-10 call (ten rounds of two mul.wide.u32 by the Philox multipliers) per 1x16 block
    of each pass (row_steps rowwise, 4 / esize column blocks, 2 per lane with the RHT), the
    software stochastic encode on both archs (16 mul.rz.f32 per block, no e2m1 instruction),
    IEEE arithmetic only; the column pass rotates its blocks' random bytes with run-time prmt
    selectors (4 per block); with the RHT a lane quantizes whole blocks after the exchange of
    the transform's outputs (test_cast_rht_ptx): its call's words are its block's, no smem
    traffic beyond the RN cast's. 16-bit inputs compile the passes twice, the second copy with
    the signs from the inputs: one set.lt.u32 per input word of a rowwise block (8) and of the
    column pass (16, both columns; with the RHT, only without the enc table, the twin's signs
    come from its products' sign bits, 8 at a time: one mask of the even nibbles' sign bits per
    8 elements, 2 blocks per lane), and without the enc table its blocks' enc from the fast
    reciprocal."""
    args = (dtype, row, col, swizzle, per_token, 132, False, walk)
    ptx = compile_ptx(*cast_kernel(*args, rht=rht, stochastic=True), arch=arch)
    rn = compile_ptx(*cast_kernel(*args, rht=rht), arch=arch)
    assert ptx_target(ptx) == arch
    op = CastKernel(dtype, row, col, swizzle, per_token, 132, enc_table=walk[5], rht=rht,
                    stochastic=True)
    assert op.input_signs == (dtype != "fp32" and (not rht or not walk[5]))
    calls = op.row_steps * row + (2 if rht else 4 // op.esize) * col
    fast_rcp = 0 if walk[5] else calls + 2 * per_token  # + the per-token outer scale's
    copies = 2 if op.input_signs or fast_rcp else 1
    assert ptx.count(f"mul.wide.u32 p0, c0, {PHILOX_M0:#010x}") == 10 * calls * copies
    assert ptx.count(f"mul.wide.u32 p1, c2, {PHILOX_M1:#010x}") == 10 * calls * copies
    assert ptx.count("mul.rz.f32") == 16 * calls * copies
    ty = "bf16x2" if dtype == "bf16" else "f16x2"
    signs = (8 * op.row_steps * row + (0 if rht else 16) * col) if op.input_signs else 0
    assert ptx.count(f"set.lt.u32.{ty}") == signs
    assert ptx.count("0x08080808") == (4 if rht and op.input_signs else 0)
    assert ptx.count("lop3.b32") - rn.count("lop3.b32") >= signs
    assert "e2m1" not in ptx
    # without the enc table (walk[5]) the fast copy takes each block's enc from the
    # reciprocal without its slow path; IEEE arithmetic elsewhere
    assert ptx.count("rcp.approx.ftz.f32") == ptx.count(".ftz") == fast_rcp
    assert ptx.count("rcp.rn.f32") == rn.count("rcp.rn.f32")
    assert "div.approx" not in ptx
    reg_prmt = r"prmt\.b32\s+%r\d+, %r\d+, %r\d+, %r\d+;"
    rotations = len(re.findall(reg_prmt, ptx))
    rn_copies = 2 if per_token else 1  # the RN cast's fast copy: per token only
    assert rotations - copies // rn_copies * len(re.findall(reg_prmt, rn)) == (
        0 if rht else 4 * (4 // op.esize) * col * copies)
    rn_st = rn.count("st.shared.v4.b32") // rn_copies * copies  # the RHT exchange's
    assert ptx.count("st.shared.v4.b32") == rn_st


def test_cast_sr_rules():
    with pytest.raises(ValueError, match="stochastic"):
        CastKernel("bf16", True, True, False, False, 132, fused_amax=True, stochastic=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,row,col", [("bf16", True, True), ("fp32", True, True),
                                           ("fp16", False, True), ("bf16", True, False)])
def test_cast_block2d_sr_ptx(arch, dtype, row, col):
    """16x16 blocks with stochastic rounding (per tensor, recipes_dispatch.on_plain_cast, its
    walk): every 1x16 block of a pass draws its own Philox call and is encoded stochastically
    (16 mul.rz.f32) with its tile's scale, in both copies of the passes for 16-bit inputs (the
    fast one with the signs from the inputs); the tile scales are converted once per tile and
    thread as when rounding to nearest."""
    walk = plain_cast_walk(8192, 8192, 4 if dtype == "fp32" else 2, False, col, row, 132,
                           False, True)
    args = (dtype, row, col, False, False, 132, False, walk)
    ptx = compile_ptx(*cast_kernel(*args, block2d=True, stochastic=True), arch=arch)
    rn = compile_ptx(*cast_kernel(*args, block2d=True), arch=arch)
    op = CastKernel(dtype, row, col, False, False, 132, enc_table=walk[5], block2d=True,
                    stochastic=True)
    assert op.input_signs == (dtype != "fp32")
    calls = op.row_steps * row + 4 // op.esize * col
    copies = 2 if op.input_signs or op.fast_rcp else 1
    assert ptx.count(f"mul.wide.u32 p0, c0, {PHILOX_M0:#010x}") == 10 * calls * copies
    assert ptx.count("mul.rz.f32") == 16 * calls * copies
    ty = "bf16x2" if dtype == "bf16" else "f16x2"
    assert ptx.count(f"set.lt.u32.{ty}") == ((8 * op.row_steps * row + 16 * col)
                                             if op.input_signs else 0)
    cvt = r"cvt\.rn\.satfinite\.e4m3x2\.f32"
    assert len(re.findall(cvt, ptx)) == len(re.findall(cvt, rn))
    assert "e2m1" not in ptx and "div.approx" not in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,row,col,swizzle,fused,walk", [
    ("bf16", True, True, False, False, (1, True, False, 4, 8, True, True)),
    ("bf16", True, True, True, True, None),
    ("bf16", True, False, False, False, (1, False, False, 1, 8, False, False)),
    ("fp16", False, True, True, False, (1, True, False, 1, 1, True, False)),
    ("fp32", True, True, True, False, (1, False, False, 1, 1, True, False)),
    ("fp32", True, True, False, False, (1, False, False, 4, 16, False, False)),
])
def test_cast_block2d_ptx(arch, dtype, row, col, swizzle, fused, walk):
    """16x16 blocks: one E4M3 scale conversion per tile and thread instead of one per block
    (row_steps rowwise, 4 / esize columnwise), the tile amax reduced over the lanes of a
    block column (shuffles xor 16 .. bpr: 3 for 16-bit inputs, 4 for fp32) and, with the
    twin, handed to the columnwise pass through smem (one 8-byte store and load) after one
    more consumer barrier; the 1x16 kernel of the same walk is the reference count."""
    args = (dtype, row, col, swizzle, False, 132, fused, walk)
    ptx = compile_ptx(*cast_kernel(*args, block2d=True), arch=arch)
    plain = compile_ptx(*cast_kernel(*args), arch=arch)
    assert ptx_target(ptx) == arch
    op = CastKernel(dtype, row, col, swizzle, False, 132, block2d=True)
    esize = 4 if dtype == "fp32" else 2

    def count(text, pattern):
        return len(re.findall(pattern, text))

    cvt = r"cvt\.rn\.satfinite\.e4m3x2\.f32"
    assert count(plain, cvt) - count(ptx, cvt) == op.row_steps * row + 4 // esize * col - 1
    bfly = r"shfl\.sync\.bfly"
    assert count(ptx, bfly) - count(plain, bfly) == (3 if esize == 2 else 4)
    assert count(ptx, r"st\.shared\.v2\.b32") == count(ptx, r"ld\.shared\.v2\.b32") == int(col)
    bar = r"bar(rier)?\.sync"
    assert count(ptx, bar) - count(plain, bar) == int(col)
    need = [r"cp\.async\.bulk\.tensor", r"st\.global\.v2\.b32"]
    assert missing_instructions(ptx, need) == []
    assert "div.approx" not in ptx and "rcp.approx" not in ptx
    check_e2m1(ptx, arch)


def test_cast_block2d_rules():
    """16x16 blocks need a per-tensor outer scale and no RHT; the smem tile scales exist only
    with the twin (one (byte, enc) pair per 16x16 tile of each ring stage)."""
    for per_token, rht in [(True, False), (False, True)]:
        with pytest.raises(ValueError, match="block2d"):
            CastKernel("bf16", True, True, False, per_token, 132, rht=rht, block2d=True)
    op = CastKernel("bf16", True, True, False, False, 132, stages=4, block2d=True)
    assert op.tile_scale_words == 2 * 4 * 8 * 4
    assert CastKernel("fp32", True, True, False, False, 132, block2d=True).bpr == 2
    assert CastKernel("bf16", True, False, False, False, 132, block2d=True).tile_scale_words == 2


def test_cast_rht_rules():
    """The RHT cast needs the twin, a 16-bit input (the MMA operands) and an amax pass."""
    assert CastKernel("bf16", False, True, False, True, 132, rht=True).warp_cols == 16
    for dtype, col, fused in [("fp32", True, False), ("bf16", False, False), ("fp16", True, True)]:
        with pytest.raises(ValueError, match="rht needs"):
            CastKernel(dtype, True, col, False, False, 132, fused_amax=fused, rht=True)


def test_cast_rht_matrix():
    """The lanes' constant B fragments hold 0.25 * diag(sign) @ H16 with the output columns
    in the order RHT_OUT: rebuilt here from the same bit rules and checked against the
    reference's transform of the identity (ref.rht)."""
    import torch

    from cute_fp4 import ref
    from cute_fp4.quant.cast import RHT_NEG

    h = ref.rht(torch.eye(16, dtype=torch.float64))  # row k: the transform of unit vector k
    out = CastKernel.RHT_OUT
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for half in range(2):
            o = ((g >> 1) << 2) | (2 * half) | (g & 1)
            assert o == out[8 * half + g]
            for k in (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9):
                p = k & o
                p ^= p >> 2
                p ^= p >> 1
                minus = (p ^ (RHT_NEG >> k)) & 1
                assert (-0.25 if minus else 0.25) == h[k, o].item()


def test_cast_rht_exchange():
    """The RHT twin's exchange (_rht_exchange): per warp and output column, lane (g, q)
    stores its 4 outputs of block row i in a slot that lane (g, i) loads as its slot q, the
    slots of a column are 128 distinct 16-byte units of its own buffer (the warps' and
    columns' buffers disjoint), and each quarter warp's 8 lanes hit 8 distinct 16-byte bank
    groups (address / 16 mod 8) in every store and every load."""
    op = CastKernel("bf16", True, True, False, False, 132, rht=True)
    base = 1 << 16
    units = set()
    for warp in range(op.num_consumer_warps):
        lanes = [op._rht_exchange(32 * warp + lane, base) for lane in range(32)]
        for cc in range(2):
            buf = base + (2 * warp + cc) * op.XCH_COL_BYTES
            stores = {(lane // 4, lane % 4, i): lanes[lane][cc][0][i]
                      for lane in range(32) for i in range(4)}
            for lane in range(32):
                g, q = lane // 4, lane % 4
                # slot j of lane (g, q): what lane (g, j) stored for block row q
                assert lanes[lane][cc][1] == [stores[(g, j, q)] for j in range(4)]
            addrs = set(stores.values())
            assert len(addrs) == 128
            assert all(buf <= a < buf + op.XCH_COL_BYTES and a % 16 == 0 for a in addrs)
            units |= addrs
            for k in range(4):
                for quarter in range(4):
                    qlanes = range(8 * quarter, 8 * quarter + 8)
                    for side in range(2):  # stores (block row k), loads (slot k)
                        banks = {lanes[lane][cc][side][k] // 16 % 8 for lane in qlanes}
                        assert len(banks) == 8
    assert len(units) == op.num_consumer_warps * 2 * 128
    assert op.xch_words * 4 == op.num_consumer_warps * 2 * op.XCH_COL_BYTES


def test_cast_run_rules():
    """The run covers one 32-byte sector of rowwise scales (8 tiles of bf16, 16 of fp32) and
    needs compact rowwise scales."""
    assert CastKernel("bf16", True, True, False, False, 132, run=8).run == 8
    assert CastKernel("fp32", True, False, False, True, 132, run=16).run == 16
    for dtype, rowwise, swizzle, run in [("bf16", True, False, 4), ("fp32", True, False, 8),
                                         ("bf16", False, False, 8), ("bf16", True, True, 8)]:
        with pytest.raises(ValueError, match="run must be"):
            CastKernel(dtype, rowwise, True, swizzle, False, 132, run=run)


def test_cast_groups_rules():
    """Two consumer groups: 17 warps per CTA, per-warp exchange buffers and amax slots for all
    16 consumer warps; not with the fused amax, 16x16 blocks or an odd ring.
    dispatch.cast_groups, for 16-bit inputs without 16x16 blocks or stochastic rounding: two
    for one-CTA walks of row+col casts (compact at any size, swizzled from
    GROUPS_MIN_ELEMENTS) and of rowwise-only casts from GROUPS_MIN_ELEMENTS below
    GROUPS_ROWWISE_MAX_ELEMENTS, and for walks of two CTAs per SM (row+col) from
    GROUPS_MIN_ELEMENTS: per token compact (plain, RHT, RHT + stochastic rounding from
    L2_WARM_MAX_BYTES) and the RHT per tensor swizzled (cast_kernel then makes the two CTAs
    one; grouped_walk drops the per-token run and bands); else one."""
    op = CastKernel("bf16", True, True, False, False, 132, stages=8, ctas_per_sm=1, rht=True,
                    groups=2)
    assert (op.threads, op.consumer_threads, op.group_threads) == (544, 512, 256)
    assert op.xch_words * 4 == 16 * 2 * op.XCH_COL_BYTES and op.red_words == 32
    for kw in [dict(fused_amax=True), dict(block2d=True), dict(stages=5), dict(groups=3)]:
        args = dict(stages=8, groups=2)
        args.update(kw)
        with pytest.raises(ValueError, match="groups"):
            CastKernel("bf16", True, True, False, False, 132, **args)
    lo, hi = GROUPS_MIN_ELEMENTS, GROUPS_ROWWISE_MAX_ELEMENTS
    one, two = (1, True, False, 4, 8, True, True), (2, True, False, 4, 8, True, True)

    def groups(dtype="bf16", row=True, col=True, swz=False, per_token=False, fused=False,
               walk=one, rht=False, block2d=False, sr=False, elements=lo):
        return cast_groups(dtype, row, col, swz, per_token, fused, walk, rht, block2d, sr,
                           elements)

    for n in (1 << 12, lo, hi, 1 << 30):
        assert groups(elements=n) == groups(dtype="fp16", elements=n) == 2
        assert groups(per_token=True, elements=n) == 2
        assert groups(swz=True, elements=n) == groups(swz=True, per_token=True, elements=n) == (
            2 if n >= lo else 1)
        for swz in (False, True):
            assert groups(col=False, swz=swz, elements=n) == (2 if lo <= n < hi else 1)
            assert groups(row=False, swz=swz, elements=n) == 1
        # two CTAs per SM: per token compact (plain, RHT), the RHT per tensor swizzled
        assert groups(walk=two, rht=True, swz=True, elements=n) == (2 if n >= lo else 1)
        assert groups(walk=two, rht=True, per_token=True, elements=n) == (2 if n >= lo else 1)
        assert groups(walk=two, per_token=True, elements=n) == (2 if n >= lo else 1)
        # RHT + stochastic rounding: per token compact from L2_WARM_MAX_BYTES
        assert groups(walk=two, rht=True, sr=True, per_token=True, elements=n) == (
            2 if 2 * n >= L2_WARM_MAX_BYTES else 1)
        for kw in [dict(walk=two), dict(walk=two, per_token=True, swz=True),
                   dict(walk=two, per_token=True, col=False),
                   dict(walk=two, per_token=True, dtype="fp32"), dict(dtype="fp32"),
                   dict(fused=True), dict(block2d=True),
                   dict(sr=True), dict(rht=True), dict(walk=two, swz=True),
                   dict(walk=two, rht=True), dict(walk=two, rht=True, swz=True, per_token=True),
                   dict(walk=two, rht=True, swz=True, sr=True), dict(walk=two, rht=True, sr=True),
                   dict(walk=two, rht=True, swz=True, sr=True, per_token=True),
                   dict(walk=two, rht=True, swz=True, row=False),
                   dict(walk=two, rht=True, per_token=True, row=False)]:
            assert groups(elements=n, **kw) == 1


def test_grouped_walk():
    """Per token, where two groups replace two CTAs per SM, the walk has neither the run nor
    bands; every other walk is kept."""
    token = (2, True, True, 4, 8, False, False)
    assert grouped_walk(token, 2, True) == (2, True, True, 1, 1, False, False)
    one_cta = (1, False, True, 4, 8, False, False)
    for walk, groups, per_token in [(token, 1, True), (one_cta, 2, True),
                                    ((2, True, False, 4, 8, True, False), 2, False)]:
        assert grouped_walk(walk, groups, per_token) == walk


def test_cast_enc_table_rules():
    """The enc table needs a per-tensor outer scale; dispatch uses it per tensor except for
    compact twins from ENC_TABLE_COMPACT_TWIN_MAX_BYTES."""
    with pytest.raises(ValueError, match="enc_table"):
        CastKernel("bf16", True, True, False, True, 132, enc_table=True)
    big = ENC_TABLE_COMPACT_TWIN_MAX_BYTES // 2 // 8192  # rows of a bf16 [*, 8192] at the bound
    for m, per_token, compact_twin, table in [
            (big, False, True, False), (big - 128, False, True, True), (big, False, False, True),
            (4096, False, True, True), (4096, True, False, False), (big, True, True, False)]:
        assert cast_walk(m, 8192, 2, per_token, False, compact_twin, True)[5] == table
    assert cast_walk(64, 64, 2, False, True)[5] and not cast_walk(64, 64, 2, True, True)[5]


def test_cast_preload_rule():
    """dispatch preloads a tile's smem words per tensor with the reverse (L2-warm) walk and a
    run, nowhere else."""
    warm = L2_WARM_MAX_BYTES // 2 // 8192 - 128  # rows of a bf16 [*, 8192] below the bound
    for m, k, per_token, compact_row, preload in [
            (warm, 8192, False, True, True), (4096, 8192, False, True, True),
            (4096, 8192, True, True, False), (4096, 8192, False, False, False),
            (warm + 256, 8192, False, True, False), (4096, 8192 + 64, False, True, False)]:
        walk = cast_walk(m, k, 2, per_token, False, True, compact_row)
        assert walk[6] == preload and (not preload or (walk[1] and walk[4] > 1))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_amax_ptx(arch, dtype):
    # per-CTA partial maxima with plain stores: no atomics, so no zero-fill before the launch;
    # chunked (the row groups' partials): the CTA's chunk from the int32 table
    for chunked in (False, True):
        ptx = compile_ptx(*amax_tensor_kernel(dtype, chunked=chunked), arch=arch)
        assert missing_instructions(ptx, [r"st\.global\.b32", r"ld\.global\.nc\.v4",
                                          r"max\.NaN\.f32"]) == []
        assert not re.search(r"\s(red|atom)\.", ptx)
        assert "cache_hint" not in ptx and "createpolicy" not in ptx
        assert ("ld.global.b32" in ptx or "ld.global.u32" in ptx
                or "ld.global.s32" in ptx) == chunked
    # padding (chunked): the warps zero whole 512-byte tiles from the int32 tile table, four
    # coalesced word stores each, before the same loads
    plain, pad = (compile_ptx(*amax_tensor_kernel(dtype, chunked=True, padding=p), arch=arch)
                  for p in (False, True))
    counts = [[len(re.findall(op, p)) for op in (r"st\.global\.b32", r"ld\.global\.[bsu]32",
                                                 r"ld\.global\.nc\.v4")] for p in (plain, pad)]
    assert counts[1] == [counts[0][0] + 4, counts[0][1] + 1, counts[0][2]] == [5, 4, 2]
    with pytest.raises(ValueError, match="padding"):
        amax_tensor_kernel(dtype, padding=True)
    ptx = compile_ptx(*amax_token_kernel(dtype), arch=arch)
    assert missing_instructions(ptx, [r"red\..*global\.max\.u32", r"ld\.global\.nc\.v4",
                                      r"shfl\.sync\.bfly"]) == []
    assert "cache_hint" not in ptx and "createpolicy" not in ptx
    # K1: one 16-row strip per warp, its 16 loads in flight; the strip's row maxima by a
    # transpose-reduction (16 shuffles), its columns' by packed 16-bit maxima
    assert len(re.findall(r"ld\.global\.nc\.v4", ptx)) == 16
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 16
    packed = len(re.findall(r"max\.NaN\.bf16x2", ptx))
    assert packed == (0 if dtype == "fp32" else 16 * 3 + 4 * 15)  # 3 per row, 15 per word


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_amax_token_groups_ptx(arch, dtype):
    """K1 with row groups (the per-token row-group cast's amax pass): the same 16 loads per
    lane, plus the groups of the CTA's 8 strips (int32 loads); the column fold over the warps
    restarts at each new group: one red.max per row pair and up to 8 per column (a predicated
    one at each group change, the last one always); no RHT or per-tensor variant; with
    padding the groups' swizzled padding zeroed after the fold."""
    ptx = compile_ptx(*amax_token_kernel(dtype, 0, groups=True), arch=arch)
    assert len(re.findall(r"ld\.global\.nc\.v4", ptx)) == 16
    assert len(re.findall(r"ld\.global\.[bsu]32", ptx)) == 8
    assert len(re.findall(r"red\.\S*global\.max\.u32", ptx)) == 1 + 8
    plain = compile_ptx(*amax_token_kernel(dtype), arch=arch)
    assert len(re.findall(r"red\.\S*global\.max\.u32", plain)) == 2
    for kw in ({"rht": True}, {"per_tensor": True}):
        with pytest.raises(ValueError, match="groups"):
            amax_token_kernel(dtype, 0, groups=True, **kw)
    # padding: after the fold the warps near the padding zero it, whole 512-byte tiles of four
    # coalesced word stores (the group's last rowwise row tile in the slab's column tiles
    # (256 / 128 columns: 4 / 2), its twin's last column tile in the slab's row tiles (2 / 1),
    # the last slab's twin tile past K) and a word per strip row past K / 16; each warp reads
    # its strip's and the next strip's groups and four GROUP_* entries; the same loads and
    # reductions before, at the plain K1's 3 CTAs per SM
    pad = compile_ptx(*amax_token_kernel(dtype, 0, groups=True, padding=True), arch=arch)
    assert len(re.findall(r"ld\.global\.nc\.v4", pad)) == 16
    assert len(re.findall(r"ld\.global\.[bsu]32", pad)) == 8 + 2 + 4
    assert len(re.findall(r"red\.\S*global\.max\.u32", pad)) == 1 + 8
    tiles = {"bf16": 4 + 2 + 1, "fp32": 2 + 1 + 1}[dtype]
    assert [len(re.findall(rf"st\.global\.{w}\b", p)) for p in (ptx, pad)
            for w in ("b8", "b32")] == [0, 0, 0, 4 * tiles + 1]
    assert re.findall(r"\.minnctapersm (\d+)", ptx + pad) == ["3"]
    with pytest.raises(ValueError, match="padding"):
        amax_token_kernel(dtype, 0, padding=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_amax_token_rht_ptx(arch, dtype, per_tensor):
    """K1 with the RHT's column amaxes: the same 16 loads and row maxima; per column of the
    lane one FP32 transform with the last butterfly folded into the maxima (48 + 8 adds) and
    the whole transform again for lanes that find +Inf (64), no packed column maxima.
    Per tensor: a loop over the CTA's tiles, no atomics (no zero-fill): one store per CTA of
    its row or column maximum by thread 0 / 1 (its partials); the strip's maximum in packed
    maxima over its 64 words; the +Inf path transforms one column at a time in a loop, from
    the strip read again (16 more loads, 64 adds once)."""
    ptx = compile_ptx(*amax_token_kernel(dtype, 0, True, per_tensor), arch=arch)
    cols = 16 // (4 if dtype == "fp32" else 2)
    loads = len(re.findall(r"ld\.global\.nc\.v4", ptx))
    adds = len(re.findall(r"(add|sub)\.rn\.f32", ptx))
    atomics = len(re.findall(r"red\..*global\.max\.u32", ptx))
    packed = len(re.findall(r"max\.NaN\.bf16x2", ptx))
    if per_tensor:
        assert (loads, adds, atomics) == (32, cols * 56 + 64, 0)
        assert len(re.findall(r"st\.global\.[bu]32", ptx)) == 1
        assert packed == (0 if dtype == "fp32" else 63)
    else:
        assert (loads, adds, atomics) == (16, cols * (56 + 64), 2)
        assert packed == (0 if dtype == "fp32" else 16 * 3)  # the row maxima only
    with pytest.raises(ValueError, match="per_tensor needs rht"):
        amax_token_kernel(dtype, 0, False, True)
    for per_tensor, tiles_per_cta in ((False, 2), (True, 0)):
        with pytest.raises(ValueError, match="tiles_per_cta"):
            amax_token_kernel(dtype, 0, True, per_tensor, tiles_per_cta=tiles_per_cta)


@pytest.mark.parametrize("arch", ARCHS)
def test_amax_l2_keep_ptx(arch):
    """l2_keep: every input load carries an L2 cache policy, chosen between evict_first and
    evict_normal."""
    from cute_fp4.quant.recipes_dispatch import amax_recipe_kernel

    for kernel in (amax_tensor_kernel("bf16", 132, 1 << 20), amax_token_kernel("bf16", 1 << 20),
                   amax_recipe_kernel("bf16", True, True, True, True, False, 1 << 20)):
        ptx = compile_ptx(*kernel, arch=arch)
        assert missing_instructions(ptx, [
            r"createpolicy\.fractional\.L2::evict_first\.b64",
            r"createpolicy\.fractional\.L2::evict_normal\.b64",
            r"ld\.global\.nc\.L2::cache_hint\.v4\.b32 \{[^}]*\}, \[%rd\d+\], %rd\d+;"]) == []
        assert not re.search(r"ld\.global\.nc\.v4", ptx)


@pytest.mark.parametrize("arch", ARCHS)
def test_swizzle_scales_ptx(arch):
    """The swizzle kernel (compact -> 128x4 swizzled scales): a 128 x 32-word tile through
    shared memory, per thread 16 4-byte loads (a warp: one row segment each) and 4 16-byte
    stores (a warp: one 512-byte atom each), one barrier between."""
    from cute_fp4.quant.swizzle import swizzle_kernel

    op, args = swizzle_kernel()
    ptx = compile_ptx(op, *args, arch=arch)
    assert ptx_target(ptx) == arch
    assert len(re.findall(r"ld\.global\.b32", ptx)) == 16
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 4
    assert len(re.findall(r"bar\.sync", ptx)) == 1
    assert not re.search(r"(ld|st)\.global\.(b8|u8)", ptx)
