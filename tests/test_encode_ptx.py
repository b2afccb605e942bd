"""CPU checks of the sm_90 software E2M1 encoders and the GEMM's E2M1 -> BF16 decode: their PTX
runs in the interpreter of ptx_interp and is compared bit for bit with the torch references
(ref.formats), on random values around every code boundary, ties, signed zeros, subnormal and
saturating products. The GPU tests check the kernels built from them; these run in CI."""

import random

import pytest
import torch
from ptx_interp import bits, outputs, run, to_f32

from cute_fp4.common import decode as D
from cute_fp4.common import encode as E
from cute_fp4.ref.formats import e2m1_encode, e2m1_encode_stochastic, e2m1_table

E2M1_MAX = 6.0


def rand_values(rng: random.Random, n: int):
    """FP32 values whose products with enc land on and around the E2M1 grid: boundaries
    (0.25, 0.75, 1.25, ... ties to even), the grid itself, random magnitudes, +-0."""
    grid = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            v = rng.choice(grid) * (1 + rng.choice([0.0, 2.0 ** -22, -(2.0 ** -22)]))
        elif r < 0.9:
            v = rng.uniform(0, 8)
        else:
            v = 0.0
        out.append(to_f32(v if rng.random() < 0.5 else -v))
    return out


def ref_codes(xs, enc: float, random_bytes=None):
    """ref.quantize_blocks' codes for values xs with the block multiplier enc."""
    v = (torch.tensor(xs, dtype=torch.float32) * torch.tensor(enc, dtype=torch.float32))
    v = v.clamp(-E2M1_MAX, E2M1_MAX)
    if random_bytes is None:
        return e2m1_encode(v).tolist()
    return e2m1_encode_stochastic(v, torch.tensor(random_bytes, dtype=torch.int64)).tolist()


def nibbles(word: int):
    return [(word >> 4 * i) & 0xF for i in range(8)]


ENCS = [1.0, 0.5, 2.0 ** -3, 1.0 + 2.0 ** -10, 3.0, 2.0 ** 40, 2.0 ** -14]
# every tie and boundary of the E2M1 grid, signed zeros, saturation: each in every lane
BOUNDARIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.25, -0.75, -1.25, -1.75, -2.5,
              -3.5, -5.0, -0.0, 0.0, -7.0, 0.2, -0.3, 4.5, -5.5, 2.75, -1.0]


def boundary_blocks():
    """Blocks of 8 values (multiplier 1) that put every value of BOUNDARIES in every lane."""
    n = len(BOUNDARIES)
    return [[BOUNDARIES[(start + i) % n] for i in range(8)] for start in range(n)]


@pytest.mark.parametrize("signs8", [False, True])
def test_encode8_matches_reference(signs8):
    """encode8's software encoder (a compare per sign) and encode8_nonzero_products (the
    signs 8 at a time from the products' sign bits; its callers guarantee that no nonzero
    product underflows, which holds for these values and multipliers)."""
    ptx = E._SW_ENCODE8_SIGNS if signs8 else E._SW_ENCODE8
    rng = random.Random(8 + signs8)
    for xs in boundary_blocks():
        (word,) = outputs(run(ptx, [bits(x) for x in xs] + [bits(1.0)]), 1)
        assert nibbles(word) == ref_codes(xs, 1.0), xs
    for enc in ENCS:
        for _ in range(40):
            xs = [x / enc for x in rand_values(rng, 8)]
            xs = [to_f32(x) for x in xs]
            (word,) = outputs(run(ptx, [bits(x) for x in xs] + [bits(enc)]), 1)
            assert nibbles(word) == ref_codes(xs, enc), (enc, xs)


def test_encode8_underflow_and_saturation():
    """The per-element-sign encoder where products underflow to -0 (a negative value that
    rounds to zero gives 0x8 in the reference only when its product is strictly negative:
    here the product is -0, code 0) and where they overflow to inf (code 7)."""
    tiny, huge = 2.0 ** -140, 2.0 ** 100
    xs = [-tiny, tiny, -1e-45, 0.0, -0.0, -huge, huge, -3.0]
    for enc in (2.0 ** -20, 2.0 ** 40):
        xs32 = [to_f32(x) for x in xs]
        (word,) = outputs(run(E._SW_ENCODE8, [bits(x) for x in xs32] + [bits(enc)]), 1)
        assert nibbles(word) == ref_codes(xs32, enc)


@pytest.mark.parametrize("signs8", [False, True])
def test_sr_encode8_matches_reference(signs8):
    """sr_encode8 / sr_encode8_nonzero_products against e2m1_encode_stochastic with the same
    random bytes (element i: byte i % 4 of word i // 4), every byte value at a code boundary
    included."""
    ptx = E._SR_ENCODE8_SIGNS if signs8 else E._SR_ENCODE8
    rng = random.Random(18 + signs8)
    # a value one FP32 step (2**-24) below the round-up threshold of random byte b in the
    # subnormal binades: a * 2**-126 must be truncated (rounding to nearest would reach the
    # threshold), in every lane
    for lane in range(8):
        for b in (0, 1, 100, 254, 255):
            xs = [to_f32(x) for x in rand_values(rng, 8)]
            xs[lane] = (511 - 2 * b) / 1024 - 2.0 ** -24
            words = [rng.getrandbits(32) for _ in range(2)]
            k = 8 * (lane % 4)
            words[lane // 4] = (words[lane // 4] & ~(0xFF << k) & 0xFFFFFFFF) | (b << k)
            rbytes = [(words[i // 4] >> 8 * (i % 4)) & 0xFF for i in range(8)]
            (word,) = outputs(run(ptx, [bits(x) for x in xs] + [bits(1.0)] + words), 1)
            assert nibbles(word) == ref_codes(xs, 1.0, rbytes), (lane, b, xs)
    for enc in ENCS:
        for n in range(40):
            xs = [to_f32(x / enc) for x in rand_values(rng, 8)]
            words = [rng.getrandbits(32) for _ in range(2)]
            if n < 2:
                words = [0x00FF7F80, 0x01FE0000 | n]
            rbytes = [(words[i // 4] >> 8 * (i % 4)) & 0xFF for i in range(8)]
            (word,) = outputs(run(ptx, [bits(x) for x in xs] + [bits(enc)] + words), 1)
            assert nibbles(word) == ref_codes(xs, enc, rbytes), (enc, xs, words)


def test_decode_e2m1x8_matches_reference():
    """The GEMM's E2M1 -> BF16 decode: e4m3_to_bf16x2_scale then decode_e2m1x8 give
    e2m1 * scale * 2**-7 exactly, in the K order [0, 4, 1, 5, 2, 6, 3, 7] (fast form) or
    natural order, for every code and every finite E4M3 scale."""
    table = e2m1_table(dtype=torch.float32)
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    rng = random.Random(7)
    for sf in range(0x7F):
        scale2 = run(D._SCALE_ASM, {"$1": sf})["$0"]
        assert scale2 & 0xFFFF == scale2 >> 16
        scale = float(e4m3[sf])
        want_scale = torch.tensor(scale * 2.0 ** 119, dtype=torch.float32).to(torch.bfloat16)
        assert scale2 & 0xFFFF == int(want_scale.view(torch.int16).item()) & 0xFFFF
        w = rng.getrandbits(32) if sf else 0x76543210
        codes = nibbles(w)
        want = [torch.tensor(float(table[c]) * scale * 2.0 ** -7,
                             dtype=torch.float32).to(torch.bfloat16) for c in codes]
        want = [int(t.view(torch.int16).item()) & 0xFFFF for t in want]
        for natural in (False, True):
            regs = run(D._DECODE_ASM[natural], {"$4": w, "$5": scale2})
            got = [regs["$%d" % i] for i in range(4)]
            halves = [(g >> 16 * h) & 0xFFFF for g in got for h in (0, 1)]
            order = list(range(8)) if natural else D.kperm8()
            assert halves == [want[k] for k in order], (sf, hex(w), natural)



def test_decode_e2m1x8_f16_matches_reference():
    """The FP16 decode of the mixed W4A16 kernel: e4m3_to_f16x2_scale then decode_e2m1x8_f16
    give e2m1 * scale * 2**-14 exactly (FP16 subnormals for the smallest), both K orders,
    every finite E4M3 scale."""
    table = e2m1_table(dtype=torch.float32)
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    rng = random.Random(16)
    for sf in range(0x7F):
        scale2 = run(D._F16_SCALE_ASM, {"$1": sf})["$0"]
        want_scale = torch.tensor(float(e4m3[sf])).to(torch.float16)
        assert scale2 & 0xFFFF == scale2 >> 16 == int(want_scale.view(torch.int16)) & 0xFFFF
        w = rng.getrandbits(32) if sf else 0x76543210
        want = [torch.tensor(float(table[c]) * float(e4m3[sf]) * 2.0 ** -14).to(torch.float16)
                for c in nibbles(w)]
        want = [int(t.view(torch.int16).item()) & 0xFFFF for t in want]
        for natural in (False, True):
            regs = run(D._FP16_DECODE_ASM[natural], {"$4": w, "$5": scale2})
            halves = [(regs["$%d" % i] >> 16 * h) & 0xFFFF for i in range(4) for h in (0, 1)]
            order = list(range(8)) if natural else D.kperm8()
            assert halves == [want[k] for k in order], (sf, hex(w), natural)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_sr_encode16_signed_matches_reference(dtype, name):
    """sr_encode16_signed's 8-element encoder with the signs from the inputs' sign words
    (sign_word: one set.lt per pair, strictly negative only, so -0 gives a + code) for 16-bit
    inputs under its callers' guard (enc >= 2**-14): every lane in either half of its word."""
    rng = random.Random(24)
    halves = tuple(i % 2 for i in range(8))
    ptx = E._sr_encode8_signed_ptx(halves)
    sign_ptx = E._sign_word_ptx(name)
    encs = (1.0, 2.0 ** -14, 3.0, 2.0 ** 20) if name == "bf16" else (1.0, 2.0 ** -12, 3.0, 2.0 ** 8)
    for enc in encs:  # (fp16: the values / enc stay finite)
        for n in range(30):
            vals = rand_values(rng, 8) if n else BOUNDARIES[:8]
            x16 = torch.tensor(vals, dtype=torch.float32).div(enc).to(dtype)
            if n == 1:
                x16[0], x16[1] = -0.0, -(2.0 ** -24 if name == "fp16" else 2.0 ** -133)
            xs = x16.float().tolist()
            pairs = x16.view(torch.int16).tolist()
            pair_words = [(pairs[2 * j] & 0xFFFF) | (pairs[2 * j + 1] & 0xFFFF) << 16
                          for j in range(4)]
            signs = [outputs(run(sign_ptx, [pair_words[i // 2]]), 1)[0] for i in range(8)]
            words = [rng.getrandbits(32) for _ in range(2)]
            rbytes = [(words[i // 4] >> 8 * (i % 4)) & 0xFF for i in range(8)]
            args = [bits(x) for x in xs] + [bits(enc)] + words + signs
            (word,) = outputs(run(ptx, args), 1)
            assert nibbles(word) == ref_codes(xs, enc, rbytes), (enc, xs)
