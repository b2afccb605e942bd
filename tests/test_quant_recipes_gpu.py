"""GPU recipe quantize (cast_recipes kernels) vs the reference: byte equality of data, scales
and amax for 16x16 blocks, RHT, stochastic rounding, window64, 4over6 (mae/mse, 448/256,
exact/fast) and grouped inputs, alone and combined. Outputs are poisoned (0xFF bytes, 12345.0
window amaxes) before the launch."""

import functools

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32, Uint32

import quant_checks
from cute_fp4.common import encode as E
from cute_fp4.common.jit import compile_kernel, device_arch, env_stream, fake_tensor
import cute_fp4
from cute_fp4 import Recipe, ref
from cute_fp4.quant import dispatch
from cute_fp4.quant import recipes_dispatch as rd
from cute_fp4.ref.formats import e2m1_decode, unpack_fp4
from quant_checks import check, check_grouped_layout

pytestmark = pytest.mark.gpu
make_input = functools.partial(quant_checks.make_input, window_outlier=True)

KINDS = ["normal", "outliers", "special"]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(rd, "_alloc", lambda shape, device, dtype=torch.uint8: torch.full(
        shape, 0xFF, dtype=torch.uint8, device=device).view(dtype))
    monkeypatch.setattr(rd, "_alloc_f32", lambda n, device: torch.full(
        (n,), 12345.0, dtype=torch.float32, device=device))


OUTPUTS = [(True, True), (True, False), (False, True)]


def run_all(x, base: Recipe, seed=0, offset=0, outputs=OUTPUTS):
    """Every output set and scale layout of `base` against the reference. A twin transformed
    on the tensor cores (the RHT of rd.on_plain_cast) must be byte-equal in the blocks whose RHT is
    exact in FP32 and follow the SPEC's RHT rule elsewhere (quant_checks.rht_exact_blocks)."""
    exact = None
    for row, col in outputs:
        for swizzle in (False, True):
            recipe = base.replace(rowwise=row, columnwise=col, swizzle=swizzle)
            got = rd.quantize_recipe(x, recipe, seed=seed, offset=offset)
            want = ref.quantize(x, recipe, seed=seed, offset=offset)
            if col and recipe.rht and rd.on_plain_cast(recipe, 1, rd._DTYPE_NAMES[x.dtype]):
                exact = quant_checks.rht_exact_blocks(x) if exact is None else exact
                check(got, want, recipe, twin_agree=0.999, twin_exact=exact)
            else:
                check(got, want, recipe)


@pytest.mark.parametrize("shape", [(16, 16), (48, 64), (128, 1040), (320, 192)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block16(shape, kind, dtype, gen):
    run_all(make_input(shape, kind, dtype, gen), Recipe(block=(16, 16)))


@pytest.mark.parametrize("shape", [(200, 48), (7, 32), (77, 4112)])
def test_block16_rowwise_any_m(shape, gen):
    x = make_input(shape, "outliers", torch.bfloat16, gen)
    run_all(x, Recipe(block=(16, 16)), outputs=[(True, False)])
    run_all(x, Recipe(block=(16, 16), four_over_six="mse"), outputs=[(True, False)])


@pytest.mark.parametrize("shape", [(16, 16), (64, 48), (144, 1040), (320, 192)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_rht(shape, kind, dtype, scaling, gen):
    run_all(make_input(shape, kind, dtype, gen), Recipe(scaling=scaling, rht=True))


@pytest.mark.parametrize("shape", [(144, 1040), (4096, 272), (16, 16)])
@pytest.mark.parametrize("kind", ["outliers", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rht_token_amax_k1(shape, kind, dtype, gen):
    """Per-token RHT of single 16-bit tensors with both outputs: the plain per-token amax pass
    K1 takes the twin's column amaxes after the transform (AmaxToken rht: a warp's 16-row
    strip is one block row; strips past M, clamped copies of the last row, count nothing):
    amaxes and outputs equal to the reference's (run_all's RHT rule), with a tail CTA row
    (144 rows: one strip in the second), a slab tail in K (272 columns) and one block."""
    x = make_input(shape, kind, dtype, gen)
    recipe = Recipe(scaling="token", rht=True, columnwise=True)
    plan = rd._plan((shape[0],), shape[1], recipe, rd._DTYPE_NAMES[dtype], x.device, False)
    assert plan.token_amax is not None and plan.amax_fn is None
    got, want = rd.quantize_recipe(x, recipe), ref.quantize(x, recipe)
    assert quant_checks.same_amax(got.amax, want.amax)
    assert quant_checks.same_amax(got.amax_t, want.amax_t)
    run_all(x, recipe, outputs=[(True, True)])


@pytest.mark.parametrize("shape", [(144, 1040), (4096, 272), (16, 16)])
@pytest.mark.parametrize("kind", ["outliers", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rowwise", [True, False])
def test_rht_tensor_amax_k1(shape, kind, dtype, rowwise, gen):
    """Per-tensor RHT of single 16-bit tensors: K1 per tensor (AmaxToken rht, per_tensor: one
    partial per CTA and side, no zero-fill) instead of RecipeAmax; amaxes and outputs equal
    to the reference's (run_all's RHT rule), with and without the rowwise output."""
    x = make_input(shape, kind, dtype, gen)
    recipe = Recipe(rht=True, columnwise=True, rowwise=rowwise)
    plan = rd._plan((shape[0],), shape[1], recipe, rd._DTYPE_NAMES[dtype], x.device, False)
    assert plan.token_amax is not None and plan.amax_fn is None and plan.tensor_amax is None
    got, want = rd.quantize_recipe(x, recipe), ref.quantize(x, recipe)
    if rowwise:
        assert quant_checks.same_amax(got.amax, want.amax)
    assert quant_checks.same_amax(got.amax_t, want.amax_t)
    run_all(x, recipe, outputs=[(rowwise, True)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_ctas", [27, 41, 81, 100])
def test_rht_tensor_amax_partials(n_ctas, dtype, gen):
    """K1 per tensor launches as many CTAs as its words hold partials (P = len - 1; the
    dispatcher's token_tensor_split caps P where the cast's reduction does), each folding
    tiles b + i P, i < tiles_per_cta: over an input of 81 tiles (bf16 / fp16; 153 fp32) with
    1 to 6 tiles per CTA, every partial is
    written (NaN first; CTAs without a tile store 0), their maxima are the reference's
    amax and post-RHT amax. Then a column block whose RHT meets +Inf and -Inf (NaN; the fast
    maxima give +Inf) in the last tile, at lane column j: the CTA taking that tile reads its
    strip again and transforms its columns one at a time (run-time j), finding the NaN."""
    m, k = 1040, 2064
    name = rd._DTYPE_NAMES[dtype]
    x = make_input((m, k), "outliers", dtype, gen).clamp(-3e4, 3e4)  # fp16: no overflows
    vec = 16 // x.element_size()
    tiles = -(-k // (32 * vec)) * -(-m // 128)
    assert tiles == (81 if vec == 8 else 153)
    fn = dispatch.token_amax_fn(name, 0, device_arch(), rht=True, per_tensor=True,
                                tiles_per_cta=-(-tiles // n_ctas))
    want = ref.quantize(x, Recipe(rht=True, columnwise=True))

    def partials():
        words = torch.full((2, 1 + n_ctas), float("nan"), device="cuda")
        fn(x, words[0], words[1], None, None, None, None)
        return words[:, 1:]

    got = partials()
    assert not got.isnan().any()
    assert quant_checks.same_amax(got[0].max().view(1), want.amax)
    assert quant_checks.same_amax(got[1].max().view(1), want.amax_t)
    assert (got[:, tiles:] == 0).all()
    for j in (0, 5, vec - 1):
        col = (k - 1) // (32 * vec) * 32 * vec + vec + j  # lane 1 of the last column slab
        x[1024 + 2, col], x[1024 + 10, col] = float("inf"), float("-inf")
        got = partials()
        last = (tiles - 1) % n_ctas
        assert got[1, last].isnan() and got[1].isnan().sum() == 1
        assert got[0, last].isinf() and not got[0].isnan().any()
        x[1024 + 2, col] = x[1024 + 10, col] = 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_rht_amax_infinities(scaling, dtype, gen):
    """RecipeAmax and (per token with both outputs, 16-bit inputs) K1 fold the RHT's last
    butterfly into the column maxima (|a| + |b|, amax.rht16_amax_fast), which is +Inf where
    that butterfly has Inf - Inf = NaN; the threads that find +Inf take their columns' maxima
    again with the whole transform.
    Column blocks with two infinities 8 rows apart (they meet only in the last butterfly: a NaN
    amax), with one infinity (+Inf), with finite values whose sums overflow, a NaN-free column
    of the same 16-column slab and normal columns: amaxes (per token one per column; per tensor
    NaN, also wrong as +Inf) and outputs equal to the reference's."""
    m, k = 96, 80
    x = torch.randn((m, k), generator=gen)
    x[16, 3] = x[24, 3] = float("inf")
    x[32, 20], x[40, 20] = float("-inf"), float("inf")
    x[48, 41] = float("inf")
    x[64:80, 57] = 3e38
    x = x.to(dtype).cuda()
    run_all(x, Recipe(scaling=scaling, rht=True), outputs=[(True, True), (False, True)])
    got = rd.quantize_recipe(x, Recipe(scaling=scaling, rht=True, columnwise=True))
    if scaling == "token":  # the columns' own amaxes, the finite ones beside them included
        want = ref.quantize(x, Recipe(scaling=scaling, rht=True, columnwise=True)).amax_t
        assert got.amax_t[[3, 20]].isnan().all() and got.amax_t[41].isinf()
        assert quant_checks.same_amax(got.amax_t, want)
        assert torch.isfinite(got.amax_t[[0, 1, 2, 4, 40, 42, 79]]).all()
    else:
        assert got.amax_t.isnan().all()


def _wide_blocks(shape, dtype, gen):
    """Every 16-row column block mixes magnitudes 2^-24 .. 2^14 (fp16: 2^-14 .. 2^14) with
    random signs, so the RHT's partial sums need more than FP32's 24 bits and round (the
    tensor core's sum and the reference's butterflies may then differ in the last bit)."""
    lo = -14 if dtype == torch.float16 else -24
    e = torch.randint(lo, 15, shape, generator=gen).float()
    x = torch.randn(shape, generator=gen).sign() * (1 + torch.rand(shape, generator=gen)) * 2 ** e
    return x.to(dtype).cuda()


@pytest.mark.parametrize("shape", [(272, 4112), (1040, 2064), (48, 80)])
@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny", "huge", "special", "wide"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_rht_plain_cast(shape, kind, dtype, scaling, gen):
    """Single-tensor RN RHT recipes run on the plain cast with the MMA transform
    (on_plain_cast): byte-equal to the reference's FP32 butterflies wherever the block's
    transform is exact in FP32 (subnormal, huge and special inputs included), with tile tails
    in M and K and several tiles per CTA; elsewhere, and on inputs built so that the block sums
    round ("wide"), the twin within the SPEC's RHT rule (>= 99.9% identical codes; measured:
    notes/quant_recipes.md "Session 21")."""
    wide = kind == "wide"
    x = _wide_blocks(shape, dtype, gen) if wide else make_input(shape, kind, dtype, gen)
    recipe = Recipe(scaling=scaling, rht=True)
    assert rd.on_plain_cast(recipe.replace(columnwise=True), 1, "bf16")
    # the twin blocks whose bytes must equal the reference's (run_all): most of them, except
    # on the wide inputs, built so that the sums round (the SPEC rule is tested there)
    exact = quant_checks.rht_exact_blocks(x).float().mean().item()
    assert (exact < 0.01) if wide else (exact > 0.2)  # measured: < 2e-4, > 0.44
    run_all(x, recipe, outputs=[(True, True), (False, True)])


@pytest.mark.parametrize("shape", [(1008, 2064), (1040, 1024)])
@pytest.mark.parametrize("kind", ["normal", "outliers", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_rht_consumer_groups(shape, kind, dtype, scaling, gen, monkeypatch):
    """The RHT as one CTA of two consumer groups (dispatch.two_cta_groups, its size bound lifted:
    per tensor with swizzled scales, per token with compact ones, there without the run or
    bands) on a GPU of 3 SMs: each CTA walks ~90 tiles (tile tails in M and K), its groups
    taking them in turn; the same bytes as the reference (run_all's RHT rule), the other
    scale layout (two CTAs per SM) alike."""
    monkeypatch.setattr(rd, "num_sms", lambda dev: 3)
    monkeypatch.setattr(dispatch, "GROUPS_MIN_ELEMENTS", 0)
    rd._plan.cache_clear()
    x = make_input(shape, kind, dtype, gen)
    per_token = scaling == "token"
    walk = rd.plain_cast_walk(*shape, 2, per_token, per_token, per_token, 3, True, False)
    name = rd._DTYPE_NAMES[dtype]
    assert walk[0] == 2 and dispatch.cast_groups(name, True, True, not per_token, per_token,
                                                 False, walk, True, False, False,
                                                 x.numel()) == 2
    assert dispatch.grouped_walk(walk, 2, per_token)[3:5] == ((1, 1) if per_token else
                                                             walk[3:5])
    run_all(x, Recipe(scaling=scaling, rht=True), outputs=[(True, True)])
    rd._plan.cache_clear()


@pytest.mark.parametrize("scaling,swizzle", [("tensor", True), ("token", False)])
def test_rht_consumer_groups_large(scaling, swizzle, gen):
    """4096x8192 bf16 (2^25 elements) RHT on two consumer groups at full size: per tensor
    swizzled, per token compact."""
    x = make_input((4096, 8192), "outliers", torch.bfloat16, gen)
    per_token = scaling == "token"
    walk = rd.plain_cast_walk(4096, 8192, 2, per_token, not swizzle, not swizzle, 132, True,
                              False)
    assert dispatch.cast_groups("bf16", True, True, swizzle, per_token, False, walk, True,
                                False, False, x.numel()) == 2
    recipe = Recipe(scaling=scaling, rht=True, columnwise=True, swizzle=swizzle)
    check(rd.quantize_recipe(x, recipe), ref.quantize(x, recipe), recipe, twin_agree=0.999,
          twin_exact=quant_checks.rht_exact_blocks(x))


@pytest.mark.parametrize("shape", [(1008, 2064), (1040, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rht_sr_consumer_groups(shape, dtype, gen, monkeypatch):
    """Per-token RHT + stochastic rounding with compact scales as one CTA of two consumer
    groups (dispatch.two_cta_groups, its size bounds lifted: the forwards walk of inputs from
    L2_WARM_MAX_BYTES, without the run or bands) on a GPU of 3 SMs: the reference's bytes for
    two seeds / offsets (run_all's RHT rule), swizzled scales (two CTAs per SM) alike."""
    monkeypatch.setattr(rd, "num_sms", lambda dev: 3)
    monkeypatch.setattr(dispatch, "GROUPS_MIN_ELEMENTS", 0)
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 0)
    rd._plan.cache_clear()
    x = make_input(shape, "outliers", dtype, gen)
    walk = rd.plain_cast_walk(*shape, 2, True, True, True, 3, True, True)
    name = rd._DTYPE_NAMES[dtype]
    assert walk[0] == 2 and not walk[1]
    assert dispatch.cast_groups(name, True, True, False, True, False, walk, True, False, True,
                                x.numel()) == 2
    assert dispatch.cast_groups(name, True, True, True, True, False, walk, True, False, True,
                                x.numel()) == 1
    for seed, offset in ((5, 0), (123456789, 77)):
        run_all(x, Recipe(scaling="token", rht=True, stochastic_rounding=True), seed, offset,
                outputs=[(True, True)])
    rd._plan.cache_clear()


@pytest.mark.parametrize("shape", [(16, 32), (96, 80), (256, 1024)])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("rht", [False, True])
def test_stochastic_rounding(shape, scaling, rht, gen):
    x = make_input(shape, "outliers", torch.bfloat16, gen)
    for seed, offset in [(0, 0), (12345, 7), (2**64 - 3, 2**32 - 1)]:
        run_all(x, Recipe(scaling=scaling, rht=rht, stochastic_rounding=True), seed, offset)


SR_PLAIN = [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
            (torch.bfloat16, True), (torch.float16, True)]


@pytest.mark.parametrize("shape", [(272, 4112), (1040, 2064), (48, 80)])
@pytest.mark.parametrize("kind", ["normal", "outliers", "tiny", "huge", "special"])
@pytest.mark.parametrize("dtype,rht", SR_PLAIN, ids=["bf16", "fp16", "fp32", "bf16-rht", "fp16-rht"])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_sr_plain_cast(shape, kind, dtype, rht, scaling, gen):
    """Single-tensor 1x16 stochastic rounding runs on the plain cast (on_plain_cast: Philox per
    block in both passes, the column pass's rotated random bytes, with the RHT the words
    exchanged between a column's lanes): byte-equal to the reference for every output set and
    scale layout (the RHT twin within the SPEC's RHT rule where its FP32 sums round), with tile
    tails in M and K, several tiles per CTA, a seed above 2^63 and the largest offset."""
    x = make_input(shape, kind, dtype, gen)
    recipe = Recipe(scaling=scaling, rht=rht, stochastic_rounding=True)
    assert rd.on_plain_cast(recipe.replace(columnwise=True), 1, rd._DTYPE_NAMES[dtype])
    seed = int(torch.randint(0, 2**62, (1,), generator=gen)) * 4 + 3
    offset = 2**32 - 1 - int(torch.randint(0, 9, (1,), generator=gen))
    run_all(x, recipe, seed=seed, offset=offset)
    # the plain cast's amax passes run first: per tensor AmaxTensor (with the RHT K1 per
    # tensor), per token with both outputs AmaxToken (K1; with the RHT its transformed column
    # amaxes); rowwise only (no RHT to apply) per tensor AmaxTensor, per token one read by
    # TokenRowCast
    plan = rd._plan((shape[0],), shape[1], recipe, rd._DTYPE_NAMES[dtype], x.device, False)
    assert (plan.tensor_amax is not None) == (scaling == "tensor")
    assert (plan.token_rows is not None) == (scaling == "token")
    assert plan.token_amax is None
    both = rd._plan((shape[0],), shape[1], recipe.replace(columnwise=True),
                    rd._DTYPE_NAMES[dtype], x.device, False)
    assert (both.token_amax is not None) == (scaling == "token" or rht)
    assert sum(f is not None for f in (both.tensor_amax, both.token_amax, both.amax_fn)) == 1


@pytest.mark.parametrize("shape", [(16, 16), (144, 1040), (320, 192), (1040, 528)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block16_sr_plain_cast(shape, kind, dtype, gen):
    """Per-tensor 16x16 blocks with stochastic rounding run on the plain cast (on_plain_cast:
    CastKernel block2d stochastic after AmaxTensor; each 1x16 block of either output draws its
    own Philox call): byte-equal to the reference for every output set and scale layout, tile
    tails in M and K, a seed above 2^63 and a large offset."""
    x = make_input(shape, kind, dtype, gen)
    recipe = Recipe(block=(16, 16), stochastic_rounding=True)
    assert rd.on_plain_cast(recipe.replace(columnwise=True), 1, rd._DTYPE_NAMES[dtype])
    seed = int(torch.randint(0, 2**62, (1,), generator=gen)) * 4 + 3
    offset = 2**32 - 1 - int(torch.randint(0, 9, (1,), generator=gen))
    run_all(x, recipe, seed=seed, offset=offset)
    plan = rd._plan((shape[0],), shape[1], recipe.replace(columnwise=True),
                    rd._DTYPE_NAMES[dtype], x.device, False)
    assert plan.plain and plan.tensor_amax is not None and plan.tt is None


@pytest.mark.parametrize("per_cta", [8, 4, 2, 1])
def test_amax_tiles_per_cta(per_cta, gen, monkeypatch):
    """RecipeAmax with 1 .. 8 m tiles per CTA row (amax_tiles_per_cta picks 4, 2 or 1 by grid
    size; the CTA row's 4 to 32 strips dealt to its 8 warps): the amaxes and outputs of every
    recipe that takes it (the RHT, per tensor and per token; the recipe kernel's 16x16 and 4over6;
    groups with tails) stay byte-equal to the reference, also with tile counts that are no
    multiple of per_cta."""
    monkeypatch.setattr(rd, "amax_tiles_per_cta", lambda *a: per_cta)
    rd._plan.cache_clear()
    try:
        x = make_input((1040, 528), "outliers", torch.bfloat16, gen)
        for recipe in (Recipe(rht=True), Recipe(scaling="token", rht=True),
                       Recipe(scaling="token", rht=True, stochastic_rounding=True),
                       Recipe(block=(16, 16), four_over_six="mae"),
                       Recipe(scaling="token", four_over_six="mae")):
            run_all(x, recipe, seed=5, offset=3, outputs=[(True, True), (False, True)])
        sizes = [272, 0, 64, 704]
        for recipe in (Recipe(scaling="token", columnwise=True),
                       Recipe(rht=True, columnwise=True, stochastic_rounding=True)):
            check_grouped(x, sizes, recipe, seed=5, offset=3)
    finally:
        rd._plan.cache_clear()


@pytest.mark.parametrize("guard", ["fast", "huge", "tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("rht", [False, True])
def test_sr_input_signs(guard, dtype, scaling, rht, gen):
    """The plain cast's stochastic encoder takes the signs of 16-bit inputs from the inputs
    (with the RHT, where the passes have a fast copy anyway: the twin's from its products'
    sign bits, 8 at a time), and per token the blocks' enc from the reciprocal without its
    slow path, where CastKernel._fast_blocks_ok holds (per tensor, per token per tile and
    warp): -0 inputs (a +0 code, as the reference) and negative subnormals around zero
    blocks; huge: one bf16 block also holds 3e38 (fp16: +inf), so its tensor (per token: its
    row's and column's tiles) takes the per-element signs, where a negative subnormal's
    product underflows to -0 (the reference's +0 code); tiny (bf16): one row and one column
    of magnitudes ~1e-33 (outer scale < 2^-117 per token: the IEEE reciprocal's copy)."""
    if guard == "tiny" and dtype == torch.float16:
        pytest.skip("fp16 has no magnitudes below 2^-117 * 2688")
    x = quant_checks.sign_input(guard, dtype, gen)
    recipe = Recipe(scaling=scaling, stochastic_rounding=True, rht=rht, columnwise=rht)
    run_all(x, recipe, seed=int(torch.randint(0, 2**62, (1,), generator=gen)), offset=11)


@pytest.mark.parametrize("guard", ["fast", "huge"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rht_sr_tensor_no_table(guard, dtype, gen, monkeypatch):
    """Per-tensor RHT + stochastic rounding as inputs from ENC_TABLE_COMPACT_TWIN_MAX_BYTES
    (bound lifted) take it: without the enc table, so the passes have the fast copy (the
    fast reciprocal, the rowwise signs from the inputs, the twin's from its products' sign
    bits); huge: the tensor takes the general copy. The reference's bytes (run_all's RHT
    rule) with -0 inputs and negative subnormals (quant_checks.sign_input)."""
    monkeypatch.setattr(dispatch, "ENC_TABLE_COMPACT_TWIN_MAX_BYTES", 0)
    rd._plan.cache_clear()
    try:
        x = quant_checks.sign_input(guard, dtype, gen)
        walk = rd.plain_cast_walk(*x.shape, 2, False, True, True, rd.num_sms(x.device), True,
                                  True)
        assert not walk[5]
        recipe = Recipe(rht=True, stochastic_rounding=True)
        run_all(x, recipe, seed=int(torch.randint(0, 2**62, (1,), generator=gen)), offset=3,
                outputs=[(True, True), (False, True)])
    finally:
        rd._plan.cache_clear()


@pytest.mark.parametrize("guard", ["fast", "huge"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rht_token_product_signs(guard, dtype, gen):
    """Per-token RHT rounding to nearest: on sm_90 the fast copy's encoder takes the codes'
    signs from the products' sign bits, 8 at a time, in both passes (CastKernel.rn_signs);
    -0 inputs and negative subnormals (quant_checks.sign_input), huge: the general copy for
    the tiles of the 3e38 / inf rows and columns. run_all's RHT rule."""
    x = quant_checks.sign_input(guard, dtype, gen)
    run_all(x, Recipe(scaling="token", rht=True), outputs=[(True, True), (False, True)])


@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rht_token_fast_copy(sr, dtype, gen):
    """Per-token RHT (with or without stochastic rounding) on the plain cast: tiles whose
    warps' outer scales are all >= 2^-117 take the fast copy (the blocks' enc from the
    reciprocal without its slow path), the others the IEEE copy: bf16 rows and columns of
    magnitudes ~1e-34 beside normal ones (fp16 cannot hold them: its tiny rows are
    subnormal, still on the fast copy), a zero block in a tiny row, an all-zero row."""
    m, k = 640, 1040
    x = torch.randn((m, k), generator=gen)
    tiny = 1e-34 if dtype == torch.bfloat16 else 1e-6
    x[7] *= tiny
    x[:, 40] *= tiny
    x[7, 16:32] = 0.0
    x[m // 2] = 0.0
    x = x.to(dtype).cuda()
    recipe = Recipe(scaling="token", rht=True, stochastic_rounding=sr)
    run_all(x, recipe, seed=int(torch.randint(0, 2**62, (1,), generator=gen)), offset=5,
            outputs=[(True, True), (False, True)])


@pytest.mark.parametrize("warm", [True, False])
@pytest.mark.parametrize("rht,sr", [(True, False), (False, True), (True, True)],
                         ids=["rht", "sr", "rht-sr"])
def test_token_recipe_walks(warm, rht, sr, gen, monkeypatch):
    """The per-token walks of rd.plain_cast_walk on small inputs, as the large ones take them
    (warm False: forwards, the amax loads one tile ahead, SR one CTA per SM, the RHT's runs)
    and as the ones below L2_WARM_MAX_BYTES (backwards; the RHT alone with runs): forced by
    the size bound and RUN_MIN_UNITS_PER_SM = 0; several runs per CTA and tile rows with the
    compact twin, bf16 rows and columns of ~1e-34 so both copies of the cast run."""
    monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 1 << 40 if warm else 0)
    monkeypatch.setattr(dispatch, "RUN_MIN_UNITS_PER_SM", 0)
    rd._plan.cache_clear()
    m, k = 1008, 2048
    x = torch.randn((m, k), generator=gen)
    x[5] *= 1e-34
    x[:, 700] *= 1e-34
    x = x.to(torch.bfloat16).cuda()
    walk = rd.plain_cast_walk(m, k, 2, True, True, True, 132, rht, sr)
    runs = rht and not (sr and warm)
    assert walk[:3] == ((2 if rht else 1), warm, True) and walk[4] == (8 if runs else 1)
    assert walk[6] == (rht and sr and warm)
    run_all(x, Recipe(scaling="token", rht=rht, stochastic_rounding=sr),
            seed=int(torch.randint(0, 2**62, (1,), generator=gen)), offset=9,
            outputs=[(True, True), (False, True)])
    rd._plan.cache_clear()


class _EncFromCode:
    """out[c, i] = E.enc_from_code(c, sdec[i]) and out[128 + c, i] the same with fast=True,
    for every scale byte c < 128."""

    @cute.jit
    def __call__(self, sdec: cute.Tensor, out: cute.Tensor, stream):
        n = sdec.shape[0]
        self.kernel(sdec, out, n).launch(grid=((n + 127) // 128, 128, 1), block=(128, 1, 1),
                                         stream=stream)

    @cute.kernel
    def kernel(self, sdec: cute.Tensor, out: cute.Tensor, n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, code, _ = cute.arch.block_idx()
        i = bx * 128 + tidx
        if i < n:
            out[code, i] = E.enc_from_code(Uint32(code), sdec[i])
            out[128 + code, i] = E.enc_from_code(Uint32(code), sdec[i], True)


def test_enc_fast_reciprocal(gen):
    """E.enc_from_code(fast=True) (the reciprocal without its slow path) gives the IEEE
    path's bits and the reference's enc = min(1 / (s * sdec), FLT_MAX) for every scale byte
    (0: FLT_MAX, 0x7F: NaN) and outer scales over the whole domain CastKernel._fast_blocks_ok
    admits (2^-117 <= sdec, RN(448 * sdec) < 2^126; with the SR input signs RN(448 * sdec)
    <= 2^14): log-uniform values, the edges of both, powers of two and their neighbours."""
    zero = torch.zeros(())
    top = torch.tensor(2.0 ** 14 / 448.0, dtype=torch.float32)  # the SR signs' edge
    end = torch.tensor(2.0 ** 126 / 448.0, dtype=torch.float32)
    while end * 448.0 >= 2.0 ** 126:  # the largest sdec with RN(448 * sdec) < 2^126
        end = torch.nextafter(end, zero)
    edges = torch.tensor([2.0 ** -117, 1.0, 2.0 ** -60], dtype=torch.float32)
    pow2 = torch.tensor([2.0 ** e for e in range(-117, 118)], dtype=torch.float32)
    near = torch.cat([torch.nextafter(pow2, zero), torch.nextafter(pow2, pow2 * 2)])
    rand = torch.exp2(torch.rand(1 << 17, generator=gen, dtype=torch.float64) * 234.2 - 117)
    sdec = torch.cat([edges, top.reshape(1), torch.nextafter(top, zero).reshape(1),
                      end.reshape(1), pow2, near, rand.float()])
    sdec = sdec[(sdec >= 2.0 ** -117) & (sdec * 448.0 < 2.0 ** 126)].cuda()
    assert (sdec == 2.0 ** -117).any() and (sdec * 448.0 == 2.0 ** 14).any()
    assert (sdec == end.cuda()).any() and (sdec * 448.0 > 2.0 ** 125).sum() > 100
    op = _EncFromCode()
    fn = compile_kernel(op, fake_tensor(cutlass.Float32, (None,), align=4),
                        fake_tensor(cutlass.Float32, (256, None), align=4), env_stream(),
                        arch=device_arch())
    out = torch.full((256, sdec.numel()), 12345.0, device="cuda")
    fn(sdec, out)
    scales = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().cuda()
    want = (1.0 / (scales[:, None] * sdec[None, :])).clamp(max=torch.finfo(torch.float32).max)
    for got in (out[:128], out[128:]):
        assert torch.equal(got[:127], want[:127])
        assert got[127].isnan().all()
    assert (want[0] == torch.finfo(torch.float32).max).all()


@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (320, 1024)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_window64(shape, kind, dtype, gen):
    x = make_input(shape, kind, dtype, gen)
    run_all(x, Recipe(scaling="window64"))
    run_all(x, Recipe(scaling="window64", rht=True), outputs=[(True, True)])
    run_all(x, Recipe(scaling="window64", stochastic_rounding=True), seed=99, offset=3,
            outputs=[(True, True)])


@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_amax_pass_many_ctas(scaling, rht, dtype, gen):
    """The amax pass (RecipeAmax) over several CTA rows of 8 tiles and several column slabs,
    with a partial last slab and tile (M = 1104, K = 1040), the largest |x| in the last row
    and column; rowwise only, M = 1101 (rows not a multiple of 16); and the cast's k-tile
    loop over several CTAs."""
    x = make_input((1104, 1040), "outliers", dtype, gen)
    x[-1, -3] = -3000.0
    run_all(x, Recipe(scaling=scaling, rht=rht), outputs=[(True, True), (False, True)])
    x = make_input((1101, 1040), "special", dtype, gen)
    run_all(x, Recipe(scaling=scaling), outputs=[(True, False)])


def test_window64_outlier_windows(gen):
    x = torch.randn(128, 256, generator=gen)
    x[5, 64:128] *= 1e4   # one hot rowwise window
    x[64:128, 7] *= 1e-4  # one cold columnwise window
    x[0:64, 200] = 0.0    # all-zero columnwise window
    run_all(x.cuda(), Recipe(scaling="window64"))


FOS = [(fos, emax, fast) for fos in ("mae", "mse") for emax in (448, 256) for fast in (False, True)]


@pytest.mark.parametrize("fos,emax,fast", FOS)
@pytest.mark.parametrize("scaling,block", [("tensor", (1, 16)), ("token", (1, 16)),
                                           ("window64", (1, 16)), ("tensor", (16, 16))])
@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_four_over_six(fos, emax, fast, scaling, block, kind, gen):
    x = make_input((128, 192), kind, torch.bfloat16, gen)
    recipe = Recipe(scaling=scaling, block=block, four_over_six=fos, e4m3_max=emax,
                    fast_math=fast)
    run_all(x, recipe, outputs=[(True, True)])


@pytest.mark.parametrize("fos", ["mae", "mse"])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_four_over_six_ties(fos, fast, block, gen):
    """Blocks whose two candidates tie or nearly tie: constants (both exact), zeros, values on
    both grids, and random blocks scaled to sit at the 4-vs-6 boundary."""
    x = torch.randn(64, 128, generator=gen, dtype=torch.float32)
    x[0:16, 0:16] = 3.0
    x[16:32, 0:16] = 0.0
    x[32:48, 0:16] = torch.tensor([4.0, 2.0, 1.0, 0.0] * 4)
    x[48:64, 0:16] = torch.tensor([6.0, 3.0, 1.5, -6.0] * 4)
    x[:, 16:32] = torch.tensor([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2) * 1.0000001
    x[:, 32:48] = torch.round(x[:, 32:48] * 4) / 4
    for scaling in (["tensor", "token"] if block == (1, 16) else ["tensor"]):
        recipe = Recipe(scaling=scaling, block=block, four_over_six=fos, fast_math=fast)
        run_all(x.cuda(), recipe, outputs=[(True, True)])
        run_all(x.cuda().to(torch.bfloat16), recipe, outputs=[(True, True)])


def test_sr_determinism():
    x = torch.randn(256, 512, device="cuda")
    recipe = Recipe(stochastic_rounding=True, rowwise=True, columnwise=True)
    a = rd.quantize_recipe(x, recipe, seed=5, offset=1)
    b = rd.quantize_recipe(x, recipe, seed=5, offset=1)
    c = rd.quantize_recipe(x, recipe, seed=6, offset=1)
    d = rd.quantize_recipe(x, recipe, seed=5, offset=2)
    assert torch.equal(a.data, b.data) and torch.equal(a.data_t, b.data_t)
    for other in (c, d):
        assert (a.data != other.data).float().mean() > 0.2
        assert (a.data_t != other.data_t).float().mean() > 0.2


def test_sr_unbiased(gen):
    """Blocks of 16 with one 6.0 and values in [0, 6): S_enc = 448, block scale 448, enc = 1, so
    the codes round x itself; the mean over 64 seeds converges to x (RN would be biased)."""
    x = torch.rand(64, 256, generator=gen) * 6
    x[:, ::16] = 6.0
    x = x.cuda()
    recipe = Recipe(stochastic_rounding=True)
    acc = torch.zeros_like(x)
    n = 64
    for seed in range(n):
        t = rd.quantize_recipe(x, recipe, seed=seed, offset=seed * 3)
        assert float(t.scales.view(torch.uint8).float().mean()) == 0x7E  # 448
        acc += e2m1_decode(unpack_fp4(t.data))
    mean = acc / n
    gap = torch.where(x < 2, 0.5, torch.where(x < 4, 1.0, 2.0))
    assert float(((mean - x).abs() / gap).max()) < 0.4
    assert abs(float(((mean - x) / gap).mean())) < 0.01
    rn = e2m1_decode(unpack_fp4(rd.quantize_recipe(x, Recipe(block=(16, 16))).data))
    assert float(((rn - x).abs() / gap).mean()) > 0.2  # RN sits half a gap away on average


def check_grouped(x, splits, recipe, got=None, **kw):
    """rd.quantize_grouped (or `got`, its result) against ref.quantize_grouped (group g's
    stochastic rounding draws Philox streams 2g and 2g + 1), group by group; the groups are
    views of got's flat fields at its offsets."""
    if got is None:
        got = rd.quantize_grouped(x, splits, recipe, **kw)
    want = ref.quantize_grouped(x, splits, recipe, **kw)
    check_grouped_layout(got, want)
    for g, w in zip(got, want):
        check(g, w, recipe)


GROUP_SPLITS = [[64, 0, 128, 16, 48], [0, 0, 256], [16], [32, 96, 0]]


@pytest.mark.parametrize("splits", GROUP_SPLITS)
@pytest.mark.parametrize("recipe", [
    Recipe(columnwise=True), Recipe(scaling="token", columnwise=True, swizzle=True),
    Recipe(rht=True, columnwise=True), Recipe(scaling="token", rht=True, columnwise=True),
    Recipe(block=(16, 16), columnwise=True, swizzle=True),
    Recipe(stochastic_rounding=True, columnwise=True),
    Recipe(four_over_six="mse", scaling="token", columnwise=True),
])
def test_grouped(splits, recipe, gen):
    x = make_input((sum(splits), 96), "outliers", torch.bfloat16, gen)
    check_grouped(x, splits, recipe, seed=3, offset=4)


ROW_GROUP_SPLITS = [272, 0, 64, 704, 16, 128, 48]  # 1232 rows: tails, groups inside tiles


def grouped_scaled(splits, k, kind, dtype, gen):
    """An input of row groups whose magnitudes differ by 2^6 from group to group (distinct
    outer scales), the third group all zero (amax 0)."""
    x = make_input((sum(splits), k), kind, torch.float32, gen)
    r0 = 0
    for g, mg in enumerate(splits):
        x[r0:r0 + mg] *= 0.0 if g == 2 else 2.0 ** (6 * (g % 4) - 9)
        r0 += mg
    return x.to(dtype)


@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("outputs", OUTPUTS)
@pytest.mark.parametrize("swizzle", [False, True])
def test_grouped_row_group_cast(swizzle, outputs, dtype, kind, scaling, gen):
    """Grouped casts on the plain cast with row groups (on_row_group_cast) are byte-equal to
    ref.quantize_grouped (amaxes included; the third group all zero, special values), K with
    a tail tile: per tensor the group amaxes reduced in the cast from the chunked
    AmaxTensor's partials, each lane's block-row group amax; per token the rows' amaxes and
    each group's column amaxes from K1 with row groups (row+col: up to 3 groups in one K1
    CTA's 8 strips) or RecipeAmax (one output), each twin block's in its group (groups
    inside tiles); the twins at their groups' offsets. Swizzled, every group's padding is
    zero (rows to 128, 65 -> 68 rowwise scale columns, twin scale rows 1040 -> 1152 and
    columns 17 -> 20, 1 -> 4, 3 -> 4; the outputs are poisoned); single groups and 16x16
    blocks stay on the recipe kernel, per-token rowwise-only compact groups go to
    TokenRowCast (on_token_rows)."""
    x = grouped_scaled(ROW_GROUP_SPLITS, 1040, kind, dtype, gen)
    recipe = Recipe(scaling=scaling, rowwise=outputs[0], columnwise=outputs[1],
                    swizzle=swizzle)
    assert rd.on_row_group_cast(recipe, ROW_GROUP_SPLITS)
    assert not rd.on_row_group_cast(recipe, [1232])
    check_grouped(x, ROW_GROUP_SPLITS, recipe)
    plan = rd._plan(tuple(ROW_GROUP_SPLITS), 1040, recipe, rd._DTYPE_NAMES[dtype], x.device,
                    False)
    # the groups' first block rows, first amax partials, swizzled their padded rowwise block
    # rows and their twin scales' 512-byte units
    if scaling == "token" and not outputs[1] and not swizzle:
        assert plan.token_rows is not None and not plan.row_groups
        return
    chunks, pfirst = rd.group_chunks(ROW_GROUP_SPLITS, 1040, x.element_size(),
                                     torch.cuda.get_device_properties(0).multi_processor_count)
    if scaling == "token":  # no partials: RecipeAmax's amaxes
        chunks, pfirst = None, [0] * 8
    starts = [0, 17, 17, 21, 65, 66, 74, 77] + pfirst
    if swizzle:
        starts += [0, 24, 24, 32, 80, 88, 96, 104] + [0, 45, 45, 54, 153, 162, 180, 189]
    assert plan.row_groups and plan.starts.tolist() == starts
    if scaling == "tensor":
        assert plan.chunks.tolist() == chunks.tolist()
        assert plan.tensor_amax is not None and plan.amax_fn is None
        assert plan.tt is None and plan.at is None  # no recipe kernel, none of its tables
        # these groups pad: swizzled with a twin the amax pass zeroes the tiles holding it,
        # not the cast (rowwise only its padding warp)
        assert (plan.pad_tiles is not None) == (swizzle and outputs[1]) and not plan.k1_padding
        if plan.pad_tiles is not None:
            assert plan.pad_tiles.tolist() == rd.padding_tiles(ROW_GROUP_SPLITS, 1040,
                                                               *outputs).tolist()
    elif outputs == (True, True):  # K1 with the groups' column amaxes
        assert plan.chunks is None and plan.tensor_amax is None and plan.amax_fn is None
        assert plan.token_amax is not None and plan.tt is None
        assert plan.k1_padding == swizzle  # these groups pad: K1 zeroes it, not the cast
        assert plan.strips.tolist() == [g for g, mg in enumerate(ROW_GROUP_SPLITS)
                                        for _ in range(mg // 16)]
    else:  # one side only: RecipeAmax (the cast zeroes the padding)
        assert plan.strips is None and plan.amax_fn is not None and not plan.k1_padding
        assert plan.pad_tiles is None


@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_row_group_cast_unpadded(scaling, dtype, gen):
    """Swizzled scales without padding (rd.row_group_padding False: per token the row-group
    cast without its padding code, CastKernel padding=False): groups of multiples of 128 rows
    (an empty one too) and K a multiple of 128, every output set; groups of multiples of 64
    rows, the twin alone (its scale columns a multiple of 4; rowwise they pad). Outputs
    poisoned."""
    for splits, outputs in (([256, 0, 128, 384], OUTPUTS), ([64, 192, 0, 128], OUTPUTS[2:])):
        x = grouped_scaled(splits, 1024, "outliers", dtype, gen)
        for row, col in outputs:
            recipe = Recipe(scaling=scaling, rowwise=row, columnwise=col, swizzle=True)
            assert not rd.row_group_padding(splits, 1024, row, col)
            check_grouped(x, splits, recipe)
            assert rd._plan(tuple(splits), 1024, recipe, rd._DTYPE_NAMES[dtype], x.device,
                            False).pad_tiles is None
        assert rd.row_group_padding(splits, 1024, True, True) == (splits[0] == 64)


@pytest.mark.parametrize("n_groups", [9, 40, rd.ROW_GROUPS_MAX])
def test_grouped_row_group_cast_many(n_groups, gen):
    """The row-group cast with 16 to 64 enc tables (rd.row_group_tables: 9 groups -> 16, 40
    and 64 -> 64, the most shared memory: two CTAs per SM rowwise only), groups of 0 to 48
    rows, row+col and rowwise only; per token row+col (K1's CTAs then span up to 5 groups)."""
    splits = [16 * (g % 4) for g in range(n_groups)]
    x = grouped_scaled(splits, 272, "outliers", torch.bfloat16, gen)
    for scaling, outputs in [("tensor", OUTPUTS[0]), ("tensor", OUTPUTS[1]),
                             ("token", OUTPUTS[0])]:
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, rowwise=outputs[0], columnwise=outputs[1],
                            swizzle=swizzle)
            assert rd.on_row_group_cast(recipe, splits)
            check_grouped(x, splits, recipe)


@pytest.mark.parametrize("scaling", ["tensor", "token"])
def test_grouped_ragged_twin_band(scaling, gen):
    """Groups whose twin rows are not whole 32-byte sectors walk bands of tile rows
    (RAGGED_TWIN_BAND: here all 16 of 2048 rows, with a columnwise output but per token
    swizzled, whose row+col cast runs two consumer groups instead: row_group_groups)."""
    splits = ROW_GROUP_SPLITS + [816]
    x = grouped_scaled(splits, 256, "outliers", torch.bfloat16, gen)
    for outputs in OUTPUTS:
        for swizzle in (False, True):
            recipe = Recipe(scaling=scaling, rowwise=outputs[0], columnwise=outputs[1],
                            swizzle=swizzle)
            plan = rd._plan(tuple(splits), 256, recipe, "bf16", x.device, False)
            # per token rowwise only with compact scales: TokenRowCast, no tile walk
            token_rows = scaling == "token" and not outputs[1] and not swizzle
            assert (plan.token_rows is not None) == token_rows and plan.row_groups != token_rows
            if not token_rows:
                wide = outputs[1] and not (scaling == "token" and swizzle)
                walk = rd.row_group_walk(
                    2048, 256, 2, outputs[1], outputs[0], swizzle,
                    torch.cuda.get_device_properties(0).multi_processor_count,
                    scaling == "token", True)
                assert (walk[3] == 16) == wide
                if scaling == "token" and swizzle and outputs == (True, True):
                    assert rd.row_group_groups("bf16", True, True, True, True, walk,
                                               2048 * 256, True) == 2
            check_grouped(x, splits, recipe)


@pytest.mark.parametrize("scaling", ["tensor", "token"])
@pytest.mark.parametrize("walk", ["forwards", "run", "run_short", "run_shorter", "one_group",
                                  "preload"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_row_group_walks(walk, dtype, scaling, gen, monkeypatch):
    """The row-group cast's other walks: forwards (inputs past L2_WARM_MAX_BYTES; per token
    one CTA per SM, row+col compact of two consumer groups), the full run (K = 1024: two runs
    per tile row; compact rowwise scales staged), shorter runs (the group lookup once per 4 /
    2 tiles with bf16, 8 / 4 with fp32: row_group_run), one consumer group, the preload; all
    but the preload with swizzled scales too; per tensor and per token."""
    units = {"run": 0, "run_short": 0.25, "run_shorter": 0.5}  # runs per SM: 20 / 40 / 80
    if walk == "forwards":
        monkeypatch.setattr(dispatch, "L2_WARM_MAX_BYTES", 0)
    elif walk in units:
        monkeypatch.setattr(dispatch, "RUN_MIN_UNITS_PER_SM", units[walk])
    elif walk == "one_group":
        monkeypatch.setattr(rd, "row_group_groups", lambda *a: 1)
    else:
        base = rd.row_group_walk
        monkeypatch.setattr(rd, "row_group_walk", lambda *a: base(*a)[:6] + (True,))
    rd._plan.cache_clear()
    try:
        x = grouped_scaled(ROW_GROUP_SPLITS, 1024, "outliers", dtype, gen)
        layouts = (False,) if walk == "preload" else (False, True)
        for outputs in OUTPUTS:
            for swizzle in layouts:
                recipe = Recipe(scaling=scaling, rowwise=outputs[0], columnwise=outputs[1],
                                swizzle=swizzle)
                check_grouped(x, ROW_GROUP_SPLITS, recipe)
        full = 8 if dtype == torch.bfloat16 else 16
        want = {"run": full, "run_short": full // 2, "run_shorter": full // 4}.get(walk, 1)
        assert rd.row_group_walk(1232, 1024, x.element_size(), True, True, False,
                                 torch.cuda.get_device_properties(0).multi_processor_count
                                 )[4] == want
    finally:
        rd._plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sr", [False, True])
def test_grouped_token_rows(sr, kind, dtype, gen):
    """Grouped per-token rowwise-only recipes run one TokenRowCast over the whole tensor
    (rd.on_token_rows): byte-equal to ref.quantize_grouped (row amaxes included; the third
    group all zero) with compact scales for any group sizes and swizzled scales for groups
    of multiples of 128 rows but the last (each group's padding zero, outputs poisoned); a
    swizzled group off the 128-row grid keeps the recipe kernel. Stochastic rounding: group g
    draws Philox stream 2g, its blocks indexed from its first row (the per-row table)."""
    k = 1040
    for splits, swizzle in [([5, 0, 100, 151, 16], False), ([384, 0, 128, 256, 77], True),
                            ([128, 0, 128, 64, 48], True)]:
        x = grouped_scaled(splits, k, kind, dtype, gen)
        recipe = Recipe(scaling="token", swizzle=swizzle, stochastic_rounding=sr)
        plan = rd._plan(tuple(splits), k, recipe, rd._DTYPE_NAMES[dtype], x.device, False)
        on_rows = not swizzle or all(mg % 128 == 0 for mg in splits[:-1])
        assert (plan.token_rows is not None) == on_rows
        assert (plan.tt is None) == on_rows  # no recipe kernel tables
        assert (plan.row_streams is not None) == (on_rows and sr)
        check_grouped(x, splits, recipe, seed=11, offset=5)


@pytest.mark.parametrize("recipe", [Recipe(stochastic_rounding=True, columnwise=True),
                                    Recipe(scaling="token", stochastic_rounding=True)],
                         ids=["recipe_kernel", "token_rows"])
def test_grouped_sr_streams_and_rng_state(recipe, gen):
    """Stochastic rounding of groups: each group draws its own Philox streams (2g, 2g + 1), so
    equal groups round differently (the kernel once gave every group streams 0 and 1, which
    ref.quantize_grouped does not); rng_state on the device replaces seed / offset, read by
    the kernel: a CUDA graph replays with the state the tensor holds then. Per-token rowwise
    only on TokenRowCast (its per-row table of streams), the rest on the recipe kernel."""
    part = make_input((64, 96), "normal", torch.bfloat16, gen)
    x = torch.cat([part, part])
    plan = rd._plan((64, 64), 96, recipe, "bf16", x.device, False)
    assert (plan.token_rows is not None) == (recipe.scaling == "token")
    a, b = rd.quantize_grouped(x, [64, 64], recipe, seed=9, offset=2)
    assert not torch.equal(a.data, b.data)
    assert recipe.scaling != "token" or torch.equal(a.scales, b.scales)  # (per row)
    assert not recipe.columnwise or not torch.equal(a.data_t, b.data_t)
    check_grouped(x, [64, 64], recipe, seed=9, offset=2)
    rng = torch.tensor([9, 2], dtype=torch.int64, device="cuda")
    for g, w in zip(cute_fp4.quantize_grouped(x, [64, 64], recipe, rng_state=rng),
                    ref.quantize_grouped(x, [64, 64], recipe, seed=9, offset=2)):
        check(g, w, recipe)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = rd.quantize_grouped(x, [64, 64], recipe, rng_state=rng)
    rng[1] = 7
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(outs, ref.quantize_grouped(x, [64, 64], recipe, seed=9, offset=7)):
        check(g, w, recipe)


def test_grouped_new_sizes_no_sync(gen):
    """A grouped call with split sizes it has no plan for builds the plan's device tables
    without a host-device sync (rd._upload: pinned staging, asynchronous copies): behind a
    long GPU sleep the call returns with the stream still busy, and its results equal the
    reference. Row-group casts per tensor (chunks, group and padding tables) and per token
    (K1's strip table), TokenRowCast with grouped SR (its row table, the seed), the recipe
    kernel (its tile, group and amax tables). While a CUDA graph is being captured a new
    configuration is a clear error (its tables could not be copied). A new seed or offset
    reuses the plan (rd._rng_table: one small copy, no sync) and under capture is the same
    clear error."""
    splits = [272, 0, 48, 704, 16, 192]  # not multiples of 128 rows: padding
    x = grouped_scaled(splits, 1040, "outliers", torch.bfloat16, gen)
    stream = torch.cuda.current_stream()
    for recipe in (Recipe(columnwise=True, swizzle=True),
                   Recipe(scaling="token", columnwise=True, swizzle=True),
                   Recipe(scaling="token", stochastic_rounding=True),
                   Recipe(rht=True, columnwise=True)):
        rd.quantize_grouped(x, splits, recipe, seed=5)  # the kernels compiled
        torch.cuda.synchronize()
        rd._plan.cache_clear()  # the next call builds its plan (and seed table) again
        rd._rng_table.cache_clear()
        torch.cuda._sleep(1 << 30)  # ~0.5 s of the GPU
        got = rd.quantize_grouped(x, splits, recipe, seed=5)
        assert not stream.query(), recipe  # returned before the sleep ended: no sync
        torch.cuda.synchronize()
        check_grouped(x, splits, recipe, got=got, seed=5)
    rd.quantize_grouped(x, splits, Recipe(), seed=5)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            rd.quantize_grouped(x, [16] + splits[1:-1] + [448], Recipe(), seed=5)
    sr = Recipe(scaling="token", stochastic_rounding=True)
    rd.quantize_grouped(x, splits, sr, seed=5, offset=10)  # its plan (the loop cleared it)
    misses = rd._plan.cache_info().misses
    for offset in (11, 12):
        torch.cuda._sleep(1 << 30)
        got = rd.quantize_grouped(x, splits, sr, seed=5, offset=offset)
        assert not stream.query()
        torch.cuda.synchronize()
        check_grouped(x, splits, sr, got=got, seed=5, offset=offset)
    assert rd._plan.cache_info().misses == misses
    with pytest.raises(RuntimeError, match="seed or offset"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            rd.quantize_grouped(x, splits, sr, seed=5, offset=13)


def test_graph_keeps_its_tables(gen):
    """A CUDA graph of recipe quantizes keeps their plans' device tables and seed tables (rd.
    _CAPTURED): with the plan caches cleared and their memory handed out again (filled with
    junk), a replay still equals the reference. A grouped row-group cast per tensor
    swizzled (chunks, group and padding tables), a single stochastic-rounding quantize (its
    seed table) and the recipe kernel (4over6: tile, group and amax tables, the (0, 0) seed
    table)."""
    splits = [272, 0, 48, 704, 16, 192]
    x = grouped_scaled(splits, 1040, "outliers", torch.bfloat16, gen)
    grouped, sr = Recipe(columnwise=True, swizzle=True), Recipe(stochastic_rounding=True,
                                                                columnwise=True)
    four = Recipe(four_over_six="mae", columnwise=True)
    calls = (lambda: rd.quantize_grouped(x, splits, grouped),
             lambda: rd.quantize_recipe(x, sr, seed=3, offset=41),
             lambda: rd.quantize_recipe(x, four))
    for call in calls:
        call()  # the plans and seed tables made before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    plans = [rd._plan(tuple(sz), 1040, r, "bf16", x.device, False)
             for sz, r in ((splits, grouped), ([1232], sr), ([1232], four))]
    assert all(any(p is kept for kept in rd._CAPTURED.values()) for p in plans)
    rd._plan.cache_clear()
    rd._rng_table.cache_clear()
    del plans
    junk = [torch.full((512 * i,), 0xFF, dtype=torch.uint8, device="cuda")
            for i in range(1, 65) for _ in range(4)]
    graph.replay()
    torch.cuda.synchronize()
    del junk
    check_grouped(x, splits, grouped, got=outs[0])
    check(outs[1], ref.quantize(x, sr, seed=3, offset=41), sr)
    check(outs[2], ref.quantize(x, four), four)


def test_grouped_window64_and_rowwise_uneven(gen):
    x = make_input((256, 128), "outliers", torch.float32, gen)
    splits = [64, 0, 128, 64]
    recipe = Recipe(scaling="window64", columnwise=True, swizzle=True)
    check_grouped(x, splits, recipe)
    splits = [5, 0, 100, 151]  # rowwise only: any group size
    for recipe in (Recipe(scaling="token"), Recipe(block=(16, 16), swizzle=True),
                   Recipe(stochastic_rounding=True)):
        check_grouped(x, splits, recipe, seed=1)


def test_bad_inputs():
    x = torch.randn(48, 64, device="cuda")
    with pytest.raises(ValueError, match="multiple of 64"):
        rd.quantize_recipe(x, Recipe(scaling="window64", columnwise=True))
    with pytest.raises(ValueError, match="split_sizes"):
        rd.quantize_grouped(x, [16, 16], Recipe())
    with pytest.raises(ValueError, match="split_sizes\\[1\\]"):
        rd.quantize_grouped(x, [16, 8, 24], Recipe(columnwise=True))
    with pytest.raises(ValueError, match="seed"):
        rd.quantize_recipe(x, Recipe(stochastic_rounding=True), seed=-1)
    with pytest.raises(TypeError):
        rd.quantize_recipe(x.double(), Recipe())


@pytest.mark.parametrize("recipe,calls", [
    (Recipe(columnwise=True), [1]),  # rowwise amax = columnwise amax: one tensor
    (Recipe(rht=True, columnwise=True), [1, 1]),  # rowwise and post-RHT columnwise amax
    (Recipe(rht=True), [1]),
    (Recipe(rowwise=False, columnwise=True, rht=True), [1]),
    (Recipe(scaling="token", columnwise=True), [192]),  # the column amax only
    (Recipe(scaling="token", rht=True, columnwise=True, swizzle=True), [192]),
    (Recipe(scaling="token"), []),
    (Recipe(block=(16, 16), columnwise=True, swizzle=True), [1]),
    (Recipe(four_over_six="mse", rht=True, columnwise=True), [1, 1]),
    (Recipe(scaling="window64", columnwise=True), []),  # windows are local to a shard
    (Recipe(columnwise=True, stochastic_rounding=True), [1]),  # the plain cast's AmaxTensor
    (Recipe(scaling="token", columnwise=True, stochastic_rounding=True), [192]),
])
def test_amax_reduce(recipe, calls, gen):
    """amax_reduce replaces the amaxes that span M by 4x their value (a larger "global" amax):
    the outputs equal the reference quantized with those amaxes."""
    x = make_input((128, 192), "outliers", torch.bfloat16, gen)
    seen = []

    def times4(t):
        assert t.dtype == torch.float32 and t.is_cuda
        seen.append(t.numel())
        t.mul_(4.0)

    got = rd.quantize_recipe(x, recipe, amax_reduce=times4)
    assert seen == calls
    want = ref.quantize(x, recipe, amax_reduce=lambda t: t.mul_(4.0))
    check(got, want, recipe)
    if calls:
        plain = rd.quantize_recipe(x, recipe)
        side = "_t" if recipe.scaling == "token" or not recipe.rowwise else ""
        assert not torch.equal(getattr(got, "scales" + side).view(torch.uint8),
                               getattr(plain, "scales" + side).view(torch.uint8))


def test_amax_reduce_grouped_rejected():
    x = torch.randn(64, 64, device="cuda")
    with pytest.raises(ValueError, match="amax_reduce"):
        rd.quantize_grouped(x, [32, 32], Recipe(), amax_reduce=lambda t: t)
