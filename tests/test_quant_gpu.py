"""GPU quantize (amax kernels + K2 cast) vs the reference: byte equality of data, scales and
amax, for many shapes, distributions, dtypes, every output combination and both scale layouts.
Outputs are poisoned (0xFF) before the launch."""

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32, Uint32

from cute_fp4 import Recipe, ref
from cute_fp4.common import encode as E
from cute_fp4.common.jit import compile_kernel, device_arch, env_stream, fake_tensor
from cute_fp4.common.scales import OUTER_FAST_MAX, OUTER_FAST_MIN, outer_block_scales
from cute_fp4.quant import dispatch

from quant_checks import check, make_input, same_amax, sign_input, u8

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(16, 16), (32, 64), (48, 16), (128, 128), (112, 336), (256, 1040), (640, 2064),
          (1024, 4096), (4096, 1024)]
KINDS = ["normal", "outliers", "tiny", "huge", "special"]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    def alloc(nbytes, device):
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)
    monkeypatch.setattr(dispatch, "_alloc", alloc)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_quantize_bit_exact(shape, kind, dtype, scaling, gen):
    x = make_input(shape, kind, dtype, gen)
    for row, col in [(True, True), (True, False), (False, True)]:
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("shape", [(200, 48), (1, 16), (77, 4112)])
def test_rowwise_any_m(shape, gen):
    x = make_input(shape, "outliers", torch.bfloat16, gen)
    for scaling in ("tensor", "token"):
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


def test_columnwise_any_k(gen):
    x = make_input((64, 40), "normal", torch.bfloat16, gen)
    for swizzle in (False, True):
        recipe = Recipe(scaling="token", rowwise=False, columnwise=True, swizzle=swizzle)
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


class _OuterScalesFast:
    """Every FP32 amax from lo_bits on (n values): out[0] / out[1] = the largest amax bits
    where outer_block_scales(fast=True)'s S_enc / 6 / S_dec differ from the IEEE ones (0:
    none), for the recipe's e4m3_max."""

    ctas, threads = 1056, 256

    def __init__(self, e4m3_max: int):
        self.e4m3_max = float(e4m3_max)

    @cute.jit
    def __call__(self, out: cute.Tensor, lo_bits: Int32, n: Int32, stream):
        self.kernel(out, lo_bits, n).launch(grid=(self.ctas, 1, 1), block=(self.threads, 1, 1),
                                            stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor, lo_bits: Int32, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        base = out.iterator.toint()
        for i in cutlass.range(bidx * self.threads + tidx, n, self.ctas * self.threads, unroll=1):
            bits = Uint32(lo_bits + i)
            amax = E.bits_f32(bits)
            s6, sdec = outer_block_scales(amax, self.e4m3_max)
            f6, fdec = outer_block_scales(amax, self.e4m3_max, True)
            if E.f32_bits(s6) != E.f32_bits(f6):
                E.red_max_u32(base, bits)
            if E.f32_bits(sdec) != E.f32_bits(fdec):
                E.red_max_u32(base + 4, bits)


@pytest.mark.parametrize("e4m3_max", [448, 256])
def test_outer_scales_fast_exhaustive(e4m3_max):
    """outer_block_scales(fast=True) (division and reciprocal without their slow-path branches)
    gives the IEEE outer_block_scales' bits for EVERY FP32 amax in [OUTER_FAST_MIN,
    OUTER_FAST_MAX] (1.68e9 values) and for 0, the domain `scales.outer_fast_ok` admits (the
    per-token cast's fast copy, the W4A16 window64 factors), for both recipe e4m3_max; and
    the check finds the differences it is for: below the domain, at the subnormal amaxes
    (S_enc capped at FLT_MAX) the fast reciprocal misses."""
    op = _OuterScalesFast(e4m3_max)
    fn = compile_kernel(op, fake_tensor(cutlass.Int32, (2,), align=4), Int32(0), Int32(0),
                        env_stream(), arch=device_arch())
    lo = int(torch.tensor(OUTER_FAST_MIN, dtype=torch.float32).view(torch.int32))
    hi = int(torch.tensor(OUTER_FAST_MAX, dtype=torch.float32).view(torch.int32))
    out = torch.zeros(2, dtype=torch.int32, device="cuda")
    fn(out, lo, hi - lo + 1)
    fn(out, 0, 1)  # amax 0
    assert out.tolist() == [0, 0]
    fn(out, 1, 1 << 23)  # the subnormal amaxes
    assert out[1].item() != 0


@pytest.mark.parametrize("shape", [(640, 2064), (1024, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_fast_copy_bit_exact(shape, dtype, gen):
    """Per token, the cast's tiles whose warps' outer scales are all >= 2^-117 take the fast
    copy of the passes (the blocks' enc from the reciprocal without its slow path), the
    others the IEEE copy (CastKernel._fast_blocks_ok): rows and columns of magnitudes ~1e-34
    (outer scales ~2^-121) and ~1e-31 (~2^-111, fast) beside normal ones, a zero block in a
    tiny row (scale byte 0: enc FLT_MAX) and an all-zero row (outer scale 1)."""
    m, k = shape
    x = torch.randn(shape, generator=gen)
    x[7] *= 1e-34
    x[m - 100] *= 1e-31
    x[:, 40] *= 1e-34
    x[:, k - 33] *= 1e-31
    x[7, 16:32] = 0.0
    x[m // 2] = 0.0
    x = x.to(dtype).cuda()
    for row, col in [(True, True), (False, True)]:  # rowwise only: TokenRowCast
        for swizzle in (False, True):
            recipe = Recipe(scaling="token", rowwise=row, columnwise=col, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("guard", ["fast", "huge"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_product_signs(guard, dtype, gen):
    """Per token on sm_90 the cast's fast copy takes the codes' signs from the products' sign
    bits, 8 at a time (CastKernel.rn_signs, under _fast_blocks_ok's enc >= 2^-14): -0 inputs
    (+0 codes, as the reference) and negative subnormals (sign_input); huge: the
    tiles of the rows and columns holding 3e38 (fp16: +inf) take the general copy, where a
    negative subnormal's product underflows to -0 (a +0 code)."""
    x = sign_input(guard, dtype, gen)
    for row, col in [(True, True), (False, True)]:  # rowwise only: TokenRowCast
        for swizzle in (False, True):
            recipe = Recipe(scaling="token", rowwise=row, columnwise=col, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


# Per-token rowwise-only outputs cast in the amax pass (TokenRowCast): every work split
# (units of one 16-element block; threads per row 32 .. 256 with K = 16 .. 2064, 64 at K = 784,
# units per thread 1 .. 4 with K up to 16384: 3 at 10240, 4 at 12304 and 16384), strips in
# tails (M not a multiple of the strip's rows), several strips per CTA with a persistent grid
# (8192 x 2048: both halves of the row-maxima buffer), swizzled padding rows and columns.
TOKEN_ROW_SHAPES = [(4096, 16), (300, 48), (1000, 272), (500, 784), (777, 1040), (640, 2064),
                    (8192, 2048), (129, 8192), (40, 10240), (64, 16384), (33, 12304)]


@pytest.fixture
def token_rows(monkeypatch):
    """token_rows(on, ctas): dispatch.TOKEN_ROWS / TOKEN_ROWS_CTAS_PER_SM for the test, the
    cached plans dropped."""
    def set_(on: bool, ctas: int = dispatch.TOKEN_ROWS_CTAS_PER_SM):
        monkeypatch.setattr(dispatch, "TOKEN_ROWS", on)
        monkeypatch.setattr(dispatch, "TOKEN_ROWS_CTAS_PER_SM", ctas)
        dispatch._plan.cache_clear()
    yield set_
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("shape", TOKEN_ROW_SHAPES)
@pytest.mark.parametrize("kind", ["outliers", "special", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctas", [0, 1, 3])
def test_token_rows_bit_exact(shape, kind, dtype, ctas, gen, token_rows):
    """Per token, rowwise only: one launch of TokenRowCast gives the reference's bytes, with
    one CTA per strip (ctas 0) or a persistent grid; into an earlier result's buffers too."""
    token_rows(True, ctas)
    x = make_input(shape, kind, dtype, gen)
    for swizzle in (False, True):
        recipe = Recipe(scaling="token", swizzle=swizzle)
        plan = dispatch.plan_for(x, recipe)
        assert plan.token_rows is not None and plan.amax is None and plan.cast is None
        want = ref.quantize(x, recipe)
        got = dispatch.quantize(x, recipe)
        check(got, want, recipe)
        for t in (got.data, got.scales.view(torch.uint8), got.amax.view(torch.uint8)):
            t.fill_(0xFF)
        check(dispatch.quantize(x, recipe, out=got), want, recipe)


@pytest.mark.parametrize("shape", [(640, 2064), (129, 8192), (48, 16400)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("on", [True, False])
def test_token_rows_off_bit_exact(shape, dtype, on, gen, token_rows):
    """Per-token rowwise outputs through K1 + the K2 cast: with the twin, rows over 16384
    elements ((48, 16400): token_rows_config is None), and any shape with TOKEN_ROWS off."""
    token_rows(on)
    x = make_input(shape, "outliers", dtype, gen)
    for col in (False, True) if shape[0] % 16 == 0 else (False,):
        for swizzle in (False, True):
            recipe = Recipe(scaling="token", rowwise=True, columnwise=col, swizzle=swizzle)
            plan = dispatch.plan_for(x, recipe)
            assert (plan.token_rows is None) is (not on or col or shape[1] > 16384)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.fixture
def cold_walk(monkeypatch):
    """Every input takes the cast walk of large inputs (forwards, amaxes loaded where used,
    compact twins per tensor without the enc table): dispatch.L2_WARM_MAX_BYTES =
    ENC_TABLE_COMPACT_TWIN_MAX_BYTES = 0; cached plans are dropped before and after."""
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 0)
    monkeypatch.setattr(dispatch, "ENC_TABLE_COMPACT_TWIN_MAX_BYTES", 0)
    dispatch._plan.cache_clear()
    yield
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("shape", [(128, 128), (112, 336), (640, 2064), (1024, 4096)])
@pytest.mark.parametrize("kind", ["outliers", "special"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_cold_walk_bit_exact(shape, kind, dtype, scaling, gen, cold_walk):
    """The walk of inputs >= L2_WARM_MAX_BYTES (the other tests' inputs are below it)."""
    x = make_input(shape, kind, dtype, gen)
    walk = dispatch.cast_walk(*shape, x.element_size(), scaling == "token", False)
    assert walk == ((1, False, True, 1, 1, False, False) if scaling == "token"
                    else (1, False, False, 1, 1, True, False))
    for row, col in [(True, True), (True, False), (False, True)]:
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=swizzle)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("shape", [(656, 2064), (1040, 528), (48, 4112), (16, 272)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_token_amax_tails(shape, dtype, gen):
    """K1 (AmaxToken: 128-row CTAs, one 16-row strip per warp) with a 16-row tail CTA row
    (656, 1040), CTAs whose warps past M read clamped rows (M = 48, 16) and a 16-column tail
    slab (slabs of 256 bf16 / fp16 or 128 fp32 columns): amaxes and outputs byte-equal."""
    x = make_input(shape, "outliers", dtype, gen)
    for row in (True, False):
        recipe = Recipe(scaling="token", rowwise=row, columnwise=True)
        assert dispatch.plan_for(x, recipe).amax is not None
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("shape", [(1008, 2064), (512, 80), (4096, 192)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("warm", [True, False])
def test_band_walk_bit_exact(shape, dtype, scaling, warm, gen, monkeypatch):
    """The band-ordered tile walk of compact twins (tile rows in whole bands; a tail tile row
    and column in (1008, 2064)), walking backwards (warm) and forwards."""
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 1 << 40 if warm else 0)
    dispatch._plan.cache_clear()
    x = make_input(shape, "outliers", dtype, gen)
    for row in (True, False):
        recipe = Recipe(scaling=scaling, rowwise=row, columnwise=True)
        plan = dispatch.plan_for(x, recipe)
        walk = dispatch.cast_walk(*shape, x.element_size(), scaling == "token", False, True)
        assert walk[1] == warm and walk[3] == dispatch.COMPACT_TWIN_BAND and not plan.fused
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("shape", [(1008, 1024), (200, 512), (8192, 4096), (1001, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("warm", [True, False])
def test_run_walk_bit_exact(shape, dtype, scaling, warm, gen, monkeypatch):
    """The run walk (compact rowwise scales staged per run of tiles along K and stored as
    whole sectors), forced at any size: tail tile rows ((1008, 1024), (1001, 512) rowwise
    only), one run per tile row, several runs per CTA ((8192, 4096): both smem buffers), with
    and without the compact twin (and its band walk), backwards (warm: per tensor with the
    smem words preloaded) and forwards (as large inputs: per tensor the compact twin without
    the enc table)."""
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 1 << 40 if warm else 0)
    monkeypatch.setattr(dispatch, "ENC_TABLE_COMPACT_TWIN_MAX_BYTES", 1 << 40 if warm else 0)
    monkeypatch.setattr(dispatch, "RUN_MIN_UNITS_PER_SM", 0)
    monkeypatch.setattr(dispatch, "RUN_BYTES", {key: (0, 1 << 62) for key in dispatch.RUN_BYTES})
    dispatch._plan.cache_clear()
    x = make_input(shape, "outliers", dtype, gen)
    run = 512 * x.element_size() // 128  # tiles of 128 bytes per row in 512 columns
    for col in ((False,) if shape[0] % 16 else (False, True)):
        recipe = Recipe(scaling=scaling, rowwise=True, columnwise=col)
        walk = dispatch.cast_walk(*shape, x.element_size(), scaling == "token", False, col, True)
        assert walk[1] == warm and walk[4] == run and not dispatch.plan_for(x, recipe).fused
        assert walk[5] == (scaling == "tensor" and (warm or not col))
        assert walk[6] == (scaling == "tensor" and warm)
        out = dispatch.quantize(x, recipe)
        check(out, ref.quantize(x, recipe), recipe)
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("shape", [(1008, 2064), (1040, 1024), (2048, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling,warm", [("tensor", True), ("tensor", False), ("token", False),
                                          ("token", True)])
@pytest.mark.parametrize("run", [False, True])
def test_consumer_groups_bit_exact(shape, dtype, scaling, warm, run, gen, monkeypatch):
    """Casts of one CTA per SM with two consumer groups (dispatch.cast_groups, its size
    bounds lifted) on a GPU of 3 SMs: each CTA walks ~90 tiles (1008x2064: tail tile row and
    column), its groups taking them in turn over many laps of the ring, the last unit group
    0's alone where a CTA has an odd count; with the run (forced where K allows it, else
    none) the groups share each run's tiles and scale flush; per token one CTA per SM
    (L2_WARM_MAX_BYTES = 0) with the amax prefetch, and (warm) the two-CTA walk of compact
    row+col casts as one CTA of two groups without the run or bands (grouped_walk). Row+col
    and (per tensor) rowwise only, compact and swizzled scales: byte-equal."""
    monkeypatch.setattr(dispatch, "num_sms", lambda dev: 3)
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 1 << 40 if warm else 0)
    monkeypatch.setattr(dispatch, "RUN_MIN_UNITS_PER_SM", 0)
    monkeypatch.setattr(dispatch, "RUN_BYTES",
                        {key: (0, 1 << 62 if run else 0) for key in dispatch.RUN_BYTES})
    monkeypatch.setattr(dispatch, "GROUPS_MIN_ELEMENTS", 0)
    dispatch._plan.cache_clear()
    x = make_input(shape, "outliers", dtype, gen)
    for col in (True, False):
        for swz in (False, True):
            recipe = Recipe(scaling=scaling, rowwise=True, columnwise=col, swizzle=swz)
            plan = dispatch.plan_for(x, recipe)
            assert not plan.fused and (plan.token_rows is None) == (col or scaling == "tensor")
            walk = dispatch.cast_walk(*shape, x.element_size(), scaling == "token", False,
                                      col and not swz, not swz, 3)
            assert walk[0] == (2 if scaling == "token" and warm else 1)
            assert (walk[4] > 1) == (run and not swz and shape[1] % 512 == 0)
            groups = dispatch.cast_groups(dispatch._DTYPE_NAMES[dtype], True, col, swz,
                                          scaling == "token", False, walk, False, False, False,
                                          x.numel())
            # per token rowwise only: TokenRowCast, not the cast
            assert groups == (1 if walk[0] == 2 and (swz or not col) else 2)
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("shape", [(1008, 1024), (640, 2064)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("kind", ["outliers", "special"])
def test_l2_keep_bit_exact(shape, dtype, scaling, kind, gen, monkeypatch):
    """The amax pass with L2 priorities (its loads split between evict_first and evict_normal
    at L2_KEEP_BYTES from the end, here set inside these inputs): same bytes and amaxes."""
    keep = {True: 40000 * 16, False: 30000 * 16}
    monkeypatch.setattr(dispatch, "L2_KEEP_BYTES", keep)
    dispatch._plan.cache_clear()
    x = make_input(shape, kind, dtype, gen)
    for col in (False, True):
        recipe = Recipe(scaling=scaling, rowwise=True, columnwise=col)
        plan = dispatch.plan_for(x, recipe)
        assert plan.l2_keep == keep[col] and not plan.fused
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("recipe", [
    Recipe(scaling="token", columnwise=True, swizzle=True),
    Recipe(scaling="token", columnwise=True), Recipe(columnwise=True, swizzle=True), Recipe(),
    Recipe(swizzle=True)],
    ids=["token-swz", "token", "tensor-swz", "tensor-row", "tensor-row-swz"])
def test_large(recipe, gen):
    """8192^2 bf16: per token swizzled two CTAs per SM; per token compact (its two CTAs as one
    of two groups, without the run or bands), per tensor row+col swizzled and rowwise only,
    one CTA per SM of two consumer groups (dispatch.cast_groups at its own bounds)."""
    x = make_input((8192, 8192), "outliers", torch.bfloat16, gen)
    col, swz, per_token = recipe.columnwise, recipe.swizzle, recipe.scaling == "token"
    walk = dispatch.cast_walk(8192, 8192, 2, per_token, False, col and not swz, not swz)
    groups = dispatch.cast_groups("bf16", True, col, swz, per_token, False, walk, False, False,
                                  False, x.numel())
    assert groups == (1 if per_token and swz else 2)
    grouped = dispatch.grouped_walk(walk, groups, per_token)
    assert grouped[3:5] == ((1, 1) if per_token and groups == 2 else walk[3:5])
    check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


def test_bad_inputs():
    x = torch.randn(32, 24, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        dispatch.quantize(x, Recipe())
    with pytest.raises(ValueError, match="multiple of 16"):
        dispatch.quantize(torch.randn(24, 32, device="cuda"), Recipe(rowwise=False, columnwise=True))
    with pytest.raises(TypeError):
        dispatch.quantize(torch.randn(32, 32, device="cuda").to(torch.float64), Recipe())
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.quantize(torch.randn(32, 64, device="cuda").t(), Recipe())
    for opt in [dict(rht=True, columnwise=True), dict(stochastic_rounding=True),
                dict(four_over_six="mae"), dict(scaling="window64")]:
        with pytest.raises(NotImplementedError, match=next(iter(opt))):
            dispatch.quantize(torch.randn(64, 64, device="cuda"), Recipe(**opt))
    # a rowwise-only recipe's RHT has nothing to transform (Recipe.twin_rht): the plain cast
    x = torch.randn(64, 64, device="cuda")
    check(dispatch.quantize(x, Recipe(rht=True)), ref.quantize(x, Recipe()), Recipe())


@pytest.mark.parametrize("scaling,block", [("tensor", (1, 16)), ("token", (1, 16)),
                                           ("tensor", (16, 16))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_reduce(scaling, block, dtype, gen):
    """A cross-rank amax reduction stand-in that raises the amax (x3, or a fixed larger value):
    the outputs are the reference's with that amax; the per-row amaxes stay local."""
    x = make_input((256, 1040), "outliers", dtype, gen)
    big = float(x.float().abs().max()) * 3
    for amax_reduce in (lambda t: t.copy_(t * 3), lambda t: t.fill_(big)):
        for row, col in [(True, True), (True, False), (False, True)]:
            for swizzle in (False, True):
                recipe = Recipe(scaling=scaling, block=block, rowwise=row, columnwise=col,
                                swizzle=swizzle)
                got = dispatch.quantize(x, recipe, amax_reduce=amax_reduce)
                check(got, ref.quantize(x, recipe, amax_reduce=amax_reduce), recipe)
                if scaling == "token" and row:
                    assert same_amax(got.amax, ref.amax_per_token(x)[0])


# 16x16 blocks (per tensor) on the plain cast (CastKernel block2d): tiles of one row pass warp
# shared with the twin through smem; rowwise only where M is not a multiple of 16 (tail tiles
# padded with zero rows, as the reference pads them).
@pytest.mark.parametrize("shape", SHAPES + [(200, 48), (77, 4112)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_block2d_bit_exact(shape, kind, dtype, gen):
    x = make_input(shape, kind, dtype, gen)
    for row, col in _output_sets(shape[0]):
        for swizzle in (False, True):
            recipe = Recipe(block=(16, 16), rowwise=row, columnwise=col, swizzle=swizzle)
            got = dispatch.quantize(x, recipe)
            want = ref.quantize(x, recipe)
            check(got, want, recipe)
            if row and col and not swizzle:
                # one scale per 16x16 tile: the twin's scales are the rowwise ones transposed
                tiles = u8(got.scales)[::16].t().repeat_interleave(16, 0)
                assert torch.equal(u8(got.scales_t), tiles)


@pytest.mark.parametrize("shape", [(1008, 1024), (640, 2064), (8192, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("kind", ["outliers", "special"])
def test_block2d_walks_bit_exact(shape, dtype, warm, kind, gen, monkeypatch):
    """16x16 blocks on the walks of large inputs, forced here: backwards with the enc table and
    the preloaded words (warm) or forwards without the table (cold); the run (compact rowwise
    scales) and the band (compact twin) at every size; several tiles per CTA and ring stage
    ((8192, 4096): every stage's tile-scale buffer reused)."""
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 1 << 40 if warm else 0)
    monkeypatch.setattr(dispatch, "ENC_TABLE_COMPACT_TWIN_MAX_BYTES", 1 << 40 if warm else 0)
    monkeypatch.setattr(dispatch, "RUN_MIN_UNITS_PER_SM", 0)
    monkeypatch.setattr(dispatch, "RUN_BYTES", {key: (0, 1 << 62) for key in dispatch.RUN_BYTES})
    dispatch._plan.cache_clear()
    x = make_input(shape, kind, dtype, gen)
    for row, col in [(True, True), (True, False), (False, True)]:
        for swizzle in (False, True):
            recipe = Recipe(block=(16, 16), rowwise=row, columnwise=col, swizzle=swizzle)
            walk = dispatch.cast_walk(*shape, x.element_size(), False, False,
                                      col and not swizzle, row and not swizzle)
            assert walk[1] == warm and walk[6] == (warm and row and not swizzle and walk[4] > 1)
            assert not dispatch.plan_for(x, recipe).fused
            check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)
    dispatch._plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_subnormal_blocks(dtype, gen):
    """Blocks made only of subnormal 16-bit values (the packed block amax keeps them)."""
    tiny = 1e-39 if dtype == torch.bfloat16 else 3e-6
    x = (torch.randn(64, 128, generator=gen) * tiny).to(dtype).cuda()
    assert bool((x != 0).any())
    for scaling in ("tensor", "token"):
        recipe = Recipe(scaling=scaling, rowwise=True, columnwise=True)
        check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


# ---------------------------------------------------------------- fused single-launch path
# Tiny inputs (at most dispatch.FUSED_MAX_TILES cast tiles) are quantized by ONE launch: the
# cast computes the amaxes itself (one CTA). Both paths are forced here on the same inputs.
TINY_SHAPES = [(1, 16), (3, 48), (15, 16), (16, 16), (17, 64), (32, 64), (48, 272), (64, 80),
               (33, 1040), (128, 528)]
TINY_KINDS = KINDS + ["zero"]


@pytest.fixture
def fused_limit(monkeypatch):
    """set(n): dispatch.FUSED_MAX_TILES = n for this test; cached plans are dropped before and
    after (monkeypatch restores the constant after this teardown)."""
    def set_limit(n):
        monkeypatch.setattr(dispatch, "FUSED_MAX_TILES", n)
        dispatch._plan.cache_clear()
    yield set_limit
    dispatch._plan.cache_clear()


def _tiny_input(shape, kind, dtype, gen):
    if kind == "zero":
        return torch.zeros(shape, dtype=dtype, device="cuda")
    return make_input(shape, kind, dtype, gen)


def _output_sets(m):
    """(rowwise, columnwise) combinations valid for M rows (the twin needs M % 16 == 0)."""
    return [(True, False)] + ([(True, True), (False, True)] if m % 16 == 0 else [])


@pytest.mark.parametrize("shape", TINY_SHAPES)
@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_fused_bit_exact(shape, kind, dtype, scaling, gen, fused_limit):
    """The one-launch path and the two-launch path both give the reference's bytes."""
    x = _tiny_input(shape, kind, dtype, gen)
    for limit, fused in ((10**6, True), (0, False)):
        fused_limit(limit)
        for row, col in _output_sets(shape[0]):
            for swizzle in (False, True):
                recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=swizzle)
                plan = dispatch.plan_for(x, recipe)
                rows = scaling == "token" and not col  # TokenRowCast at any size
                assert plan.fused is (fused and not rows)
                assert (plan.token_rows is not None) is rows
                assert (plan.amax is None) is (fused or rows)
                check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("shape", TINY_SHAPES)
@pytest.mark.parametrize("kind", ["outliers", "special", "zero"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block2d_fused_bit_exact(shape, kind, dtype, gen, fused_limit):
    """16x16 blocks on tiny inputs: the one-launch path and the two-launch path."""
    x = _tiny_input(shape, kind, dtype, gen)
    for limit, fused in ((10**6, True), (0, False)):
        fused_limit(limit)
        for row, col in _output_sets(shape[0]):
            for swizzle in (False, True):
                recipe = Recipe(block=(16, 16), rowwise=row, columnwise=col, swizzle=swizzle)
                assert dispatch.plan_for(x, recipe).fused is fused
                check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tiles", sorted({1, 2, 4, dispatch.FUSED_MAX_TILES}))
def test_fused_threshold(dtype, tiles, gen, fused_limit):
    """With FUSED_MAX_TILES = tiles (the committed value among them), the dispatch takes the
    fused path up to that many cast tiles (along M or K) and the two launches just above;
    amax_reduce always takes the two launches; per-token rowwise only always TokenRowCast."""
    fused_limit(tiles)
    tile_k = 128 // torch.empty((), dtype=dtype).element_size()
    cases = [((128 * tiles, tile_k), True), ((128, tile_k * tiles), True),
             ((128 * tiles - 16, tile_k + 16), False), ((128 * tiles + 16, tile_k), False),
             ((128, tile_k * tiles + 16), False)]
    for shape, fused in cases:
        x = make_input(shape, "outliers", dtype, gen)
        assert (dispatch.cast_tiles(*shape, x.element_size()) <= tiles) is fused
        for scaling in ("tensor", "token"):
            for row, col in _output_sets(shape[0]):
                recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=True)
                rows = scaling == "token" and not col
                assert dispatch.plan_for(x, recipe).fused is (fused and not rows)
                assert (dispatch.plan_for(x, recipe).token_rows is not None) is rows
                assert not dispatch.plan_for(x, recipe, reduced=True).fused
                check(dispatch.quantize(x, recipe), ref.quantize(x, recipe), recipe)


def test_fused_leading_dims(gen):
    """A 3-D tiny input: the fused path flattens it and keeps the original shape."""
    x = make_input((48, 64), "outliers", torch.bfloat16, gen).view(2, 24, 64)
    for scaling in ("tensor", "token"):
        recipe = Recipe(scaling=scaling, columnwise=True)
        got = dispatch.quantize(x, recipe)
        assert dispatch.plan_for(x, recipe).fused and got.shape == (2, 24, 64)
        check(got, ref.quantize(x, recipe), recipe)


@pytest.mark.parametrize("rows,cols", [(1, 4), (5, 12), (128, 4), (130, 8), (300, 132),
                                       (1000, 4), (8192, 512), (130, 5)])
def test_swizzle_scales_bit_exact(rows, cols, gen):
    """The swizzle kernel (compact -> 128x4 swizzled scales, quant/swizzle.py, which the GEMMs
    run on compact scales) writes the reference's bytes, the zero padding included, into a
    poisoned buffer (cols % 4 == 0; other widths take the reference); swizzle_scales returns
    them in the padded shape and the input's dtype, also for a strided input."""
    from cute_fp4.quant.swizzle import swizzle_kernel, swizzle_scales

    s = torch.randint(0, 256, (rows, cols + 4), generator=gen, dtype=torch.uint8)[:, :cols]
    want = ref.swizzle_scales(s)
    if cols % 4 == 0:
        op, args = swizzle_kernel()
        fn = compile_kernel(op, *args, arch=device_arch())
        out = torch.full(want.shape, 0xFF, dtype=torch.uint8, device="cuda")
        fn(s.contiguous().cuda().view(torch.int32), out.view(-1).view(torch.int32))
        assert torch.equal(out.cpu(), want)
    got = swizzle_scales(s.cuda().view(torch.float8_e4m3fn))
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8).cpu(), want)
