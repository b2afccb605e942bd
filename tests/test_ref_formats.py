"""Hand-computed vectors for the element formats (SPEC section 1): E2M1 encode/decode, nibble
packing, E4M3 block-scale rounding and the FP32 outer scale S_enc."""

import math

import pytest
import torch

from cute_fp4 import ref
from cute_fp4.ref.formats import FLT_MAX, RCP_E2M1_MAX

INF = float("inf")
NAN = float("nan")
F32_TINY = 1.401298464324817e-45  # smallest FP32 subnormal, 2**-149


def f32(v):
    return torch.tensor(v, dtype=torch.float32)


def above(v):
    """The next FP32 value above v."""
    return torch.nextafter(f32(v), f32(INF)).item()


def below(v):
    """The next FP32 value below v."""
    return torch.nextafter(f32(v), f32(-INF)).item()


def enc1(v: float) -> int:
    return int(ref.e2m1_encode(torch.tensor([v], dtype=torch.float32))[0])


# ---------------------------------------------------------------------------------------------
# E2M1 encode: every code, every tie (ties go to the even code), the neighbours of every tie.
# Codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6.
# ---------------------------------------------------------------------------------------------

EXACT = [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7)]


@pytest.mark.parametrize("value,code", EXACT)
def test_e2m1_encode_exact_values(value, code):
    assert enc1(value) == code
    if value:
        assert enc1(-value) == code | 0x8


# (tie point, code below, code above, code the tie goes to: the even one)
TIES = [
    (0.25, 0, 1, 0),  # 0 | 0.5   -> code 0
    (0.75, 1, 2, 2),  # 0.5 | 1   -> code 2
    (1.25, 2, 3, 2),  # 1 | 1.5   -> code 2
    (1.75, 3, 4, 4),  # 1.5 | 2   -> code 4
    (2.5, 4, 5, 4),  # 2 | 3     -> code 4
    (3.5, 5, 6, 6),  # 3 | 4     -> code 6
    (5.0, 6, 7, 6),  # 4 | 6     -> code 6
]


@pytest.mark.parametrize("tie,lo,hi,even", TIES)
def test_e2m1_encode_ties_to_even(tie, lo, hi, even):
    assert enc1(tie) == even
    assert enc1(above(tie)) == hi
    assert enc1(below(tie)) == lo


@pytest.mark.parametrize("tie,lo,hi,even", TIES)
def test_e2m1_encode_negative_ties(tie, lo, hi, even):
    assert enc1(-tie) == even | 0x8
    assert enc1(-above(tie)) == hi | 0x8
    assert enc1(-below(tie)) == lo | 0x8


# Values strictly inside each interval, far from the tie: nearest code.
INTERIOR = [(0.1, 0), (0.4, 1), (0.6, 1), (0.9, 2), (1.1, 2), (1.4, 3), (1.6, 3), (1.9, 4),
            (2.2, 4), (2.8, 5), (3.2, 5), (3.8, 6), (4.5, 6), (5.5, 7), (5.99, 7)]


@pytest.mark.parametrize("value,code", INTERIOR)
def test_e2m1_encode_interior(value, code):
    assert enc1(value) == code
    assert enc1(-value) == code | 0x8


@pytest.mark.parametrize("value,code", [
    (7.0, 0x7), (6.5, 0x7), (above(6.0), 0x7), (1e30, 0x7), (INF, 0x7), (FLT_MAX, 0x7),
    (-7.0, 0xF), (-1e30, 0xF), (-INF, 0xF), (-6.0, 0xF),
])
def test_e2m1_encode_saturates(value, code):
    assert enc1(value) == code


@pytest.mark.parametrize("value,code", [
    (NAN, 0x0),  # NaN -> code 0 (TE cast_to_fp4x2: no comparison holds)
    (0.0, 0x0),  # +0
    (-0.0, 0x0),  # exact -0 encodes as +0
    (-1e-30, 0x8),  # a negative value that rounds to zero keeps its sign
    (-F32_TINY, 0x8),
    (-0.25, 0x8),  # the negative tie rounds to -0
    (F32_TINY, 0x0),
    (0.25, 0x0),
])
def test_e2m1_encode_zero_nan_sign(value, code):
    assert enc1(value) == code


def test_e2m1_encode_vector_and_shape():
    v = torch.tensor([[0.0, 0.3, -0.8, 1.3, -1.8, 2.6, -3.6, 5.1],
                      [7.0, -7.0, NAN, -0.0, 0.75, -1.25, 2.5, -5.0]])
    codes = ref.e2m1_encode(v)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 8)
    assert codes.tolist() == [[0x0, 0x1, 0xA, 0x3, 0xC, 0x5, 0xE, 0x7],
                              [0x7, 0xF, 0x0, 0x0, 0x2, 0xA, 0x4, 0xE]]


def te_interval_code(v: float) -> int:
    """TransformerEngine's cast_to_fp4x2 interval table (reference_nvfp4.py), per value; later
    rows overwrite earlier ones exactly as its sequence of masked assignments does."""
    code = 0
    table = [
        (lambda x: 0.0 <= x <= 0.25, 0), (lambda x: 0.25 < x < 0.75, 1),
        (lambda x: 0.75 <= x <= 1.25, 2), (lambda x: 1.25 < x < 1.75, 3),
        (lambda x: 1.75 <= x <= 2.5, 4), (lambda x: 2.5 < x < 3.5, 5),
        (lambda x: 3.5 <= x <= 5.0, 6), (lambda x: x > 5.0, 7),
        (lambda x: -0.25 <= x < -0.0, 8), (lambda x: -0.75 < x < -0.25, 9),
        (lambda x: -1.25 <= x <= -0.75, 10), (lambda x: -1.75 < x < -1.25, 11),
        (lambda x: -2.5 <= x <= -1.75, 12), (lambda x: -3.5 < x < -2.5, 13),
        (lambda x: -5.0 <= x <= -3.5, 14), (lambda x: x < -5.0, 15),
    ]
    for inside, c in table:
        if inside(v):
            code = c
    return code


def test_e2m1_encode_matches_te_interval_table_on_a_sweep():
    ties = [t for t, *_ in TIES] + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    special = []
    for t in ties:
        special += [t, above(t), below(t), -t, -above(t), -below(t)]
    sweep = torch.linspace(-7.0, 7.0, 2801).tolist() + special + [0.0, -0.0, 1e-40, -1e-40]
    v = torch.tensor(sweep, dtype=torch.float32)
    got = ref.e2m1_encode(v).tolist()
    expected = [te_interval_code(x) for x in v.tolist()]
    assert got == expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_e2m1_encode_rejects_non_fp32(dtype):
    with pytest.raises(TypeError, match="float32"):
        ref.e2m1_encode(torch.zeros(4, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# E2M1 decode
# ---------------------------------------------------------------------------------------------

DECODED = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.mark.parametrize("code", range(16))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_e2m1_decode_every_code(code, dtype):
    v = ref.e2m1_decode(torch.tensor([code], dtype=torch.uint8), dtype)
    assert v.dtype == dtype
    assert v.item() == DECODED[code]
    assert math.copysign(1.0, v.item()) == (-1.0 if code >= 8 else 1.0)


def test_e2m1_decode_ignores_high_nibble():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    v = ref.e2m1_decode(codes)
    assert v.tolist() == [DECODED[c & 0xF] for c in range(256)]


@pytest.mark.parametrize("code", range(16))
def test_e2m1_encode_decode_round_trip(code):
    v = ref.e2m1_decode(torch.tensor([code], dtype=torch.uint8))
    expected = 0 if code == 8 else code  # -0.0 encodes as +0
    assert ref.e2m1_encode(v).item() == expected


def test_e2m1_table_constant():
    assert ref.E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------------------------------------
# Nibble packing: even element in the low nibble
# ---------------------------------------------------------------------------------------------

def test_pack_even_element_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4, 0xF, 0x0, 0x7, 0x8]], dtype=torch.uint8)
    packed = ref.pack_fp4(codes)
    # bytes: (hi=elem1, lo=elem0) ...
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0x87]]


def test_unpack_literal():
    packed = torch.tensor([[0x21, 0x43, 0x0F, 0x87], [0xF0, 0x00, 0xFF, 0x5A]], dtype=torch.uint8)
    assert ref.unpack_fp4(packed).tolist() == [[1, 2, 3, 4, 0xF, 0, 7, 8],
                                               [0, 0xF, 0, 0, 0xF, 0xF, 0xA, 0x5]]


def test_pack_unpack_all_byte_values():
    packed = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(16, 16)
    codes = ref.unpack_fp4(packed)
    assert codes.shape == (16, 32)
    assert codes[:, 0::2].equal(packed & 0xF) and codes[:, 1::2].equal(packed >> 4)
    assert ref.pack_fp4(codes).equal(packed)


def test_pack_matches_torch_float4_view():
    """Packed bytes view as torch.float4_e2m1fn_x2 without copying ([rows, cols/2])."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch has no float4_e2m1fn_x2")
    packed = ref.pack_fp4(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8))
    v = packed.view(torch.float4_e2m1fn_x2)
    assert v.shape == (1, 2)
    assert v.view(torch.uint8).tolist() == [[0x21, 0x43]]


def test_pack_odd_length_raises():
    with pytest.raises(ValueError, match="even last dimension"):
        ref.pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


def test_unpack_non_uint8_raises():
    with pytest.raises(TypeError, match="uint8"):
        ref.unpack_fp4(torch.zeros(2, 3, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# E4M3 block scales: round to nearest even, clamp at 448, NaN stays NaN (0x7F)
# E4M3 byte = s eeee mmm, bias 7: 1.0 = 0x38, 448 = 1.75 * 2^8 = 0x7E, 2^-6 = 0x08 (min
# normal), 2^-9 = 0x01 (min subnormal).
# ---------------------------------------------------------------------------------------------

E4M3_CASES = [
    (0.0, 0x00),
    (1.0, 0x38),
    (1.125, 0x39),  # mantissa 1
    (1.0625, 0x38),  # tie between 1.0 (m=0) and 1.125 (m=1) -> even m=0
    (above(1.0625), 0x39),
    (1.1875, 0x3A),  # tie between 1.125 (m=1) and 1.25 (m=2) -> m=2
    (below(1.1875), 0x39),
    (2.0, 0x40),
    (240.0, 0x77),  # 1.875 * 2^7
    (400.0, 0x7C),  # tie 384 (1.5*2^8, m=4) | 416 (m=5) -> 384
    (416.0, 0x7D),
    (432.0, 0x7E),  # tie 416 (m=5) | 448 (m=6) -> 448
    (448.0, 0x7E),
    (449.0, 0x7E),  # clamped
    (464.0, 0x7E),  # would round to 480 (NaN pattern) without the clamp
    (1e30, 0x7E),
    (INF, 0x7E),
    (2.0 ** -6, 0x08),
    (2.0 ** -9, 0x01),
    (2.0 ** -10, 0x00),  # tie 0 | 2^-9 -> 0
    (above(2.0 ** -10), 0x01),
    (3 * 2.0 ** -10, 0x02),  # tie 2^-9 (m=1) | 2^-8 (m=2) -> m=2
    (7 * 2.0 ** -9, 0x07),  # largest subnormal
    (0.171875, 0x23),  # 1.375 * 2^-3
    (1.0 / 6.0, 0x23),  # 0.16667: 0.15625 | 0.171875, nearer 0.171875
    (74.666672, 0x69),  # 72 = 1.125 * 2^6 (e=13, m=1) | 80 (m=2), midpoint 76 -> 72
    (76.0, 0x6A),  # the midpoint itself -> even m=2 (80)
]


@pytest.mark.parametrize("value,byte", E4M3_CASES)
def test_to_e4m3_rounding_and_clamp(value, byte):
    s = ref.to_e4m3(f32([value]))
    assert s.dtype == torch.float8_e4m3fn
    assert s.view(torch.uint8).item() == byte


def test_to_e4m3_nan_and_negative():
    s = ref.to_e4m3(f32([NAN, -1.0, -1000.0]))
    assert s.view(torch.uint8).tolist() == [0x7F, 0xB8, 0xFE]


@pytest.mark.parametrize("byte", range(0, 0x7F))
def test_to_e4m3_exact_on_every_positive_code(byte):
    v = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    assert ref.to_e4m3(v).view(torch.uint8).item() == byte


# ---------------------------------------------------------------------------------------------
# Outer scale S_enc = E4M3_MAX * 6 / amax, capped at FLT_MAX, 1 where amax is 0 (or S_enc is 0)
# ---------------------------------------------------------------------------------------------

S_ENC_CASES = [
    (1.0, 448, 2688.0),  # 448 * 6
    (1.0, 256, 1536.0),  # 256 * 6
    (6.0, 448, 448.0),
    (6.0, 256, 256.0),
    (7.0, 448, 384.0),
    (3.0, 448, 896.0),
    (2688.0, 448, 1.0),
    (1536.0, 256, 1.0),
    (0.5, 448, 5376.0),
    (0.0, 448, 1.0),  # guard: amax 0 -> 1
    (0.0, 256, 1.0),
    (INF, 448, 1.0),  # 2688 / inf = 0 -> guard -> 1
    (INF, 256, 1.0),
    (F32_TINY, 448, FLT_MAX),  # 2688 / 2^-149 overflows -> capped
    (F32_TINY, 256, FLT_MAX),
    (1e-38, 448, FLT_MAX),  # 2.688e41 overflows FP32
    (1e-300, 448, 1.0),  # becomes +0.0 in FP32, so the amax == 0 guard applies
]


@pytest.mark.parametrize("amax,e4m3_max,expected", S_ENC_CASES)
def test_encode_scale(amax, e4m3_max, expected):
    s = ref.encode_scale(f32([amax]), e4m3_max)
    assert s.dtype == torch.float32
    assert s.item() == expected


def test_encode_scale_not_capped_just_below_overflow():
    # amax = 2688 / 2^127 = 21 * 2^-120: S_enc = 2^127 exactly, well below FLT_MAX.
    amax = 21 * 2.0 ** -120
    assert ref.encode_scale(f32([amax])).item() == 2.0 ** 127


def test_encode_scale_rounding_is_one_fp32_division():
    # 2688 / 10 = 268.8 is not representable: the result is fp32(268.8).
    s = ref.encode_scale(f32([10.0])).item()
    assert s == torch.tensor(268.8, dtype=torch.float32).item()
    assert s == f32(2688.0).div(f32(10.0)).item()


def test_encode_scale_vector_and_nan():
    s = ref.encode_scale(f32([0.0, 1.0, INF, 6.0, NAN]))
    assert s[:4].tolist() == [1.0, 2688.0, 1.0, 448.0]
    assert math.isnan(s[4].item())  # a NaN amax poisons the scale (as in TE)


def test_encode_scale_accepts_bf16_amax():
    s = ref.encode_scale(torch.tensor([6.0], dtype=torch.bfloat16))
    assert s.dtype == torch.float32 and s.item() == 448.0


@pytest.mark.parametrize("amax,expected", [
    (2688.0, 1.0), (5376.0, 2.0), (1344.0, 0.5), (0.0, 1.0), (INF, 1.0), (F32_TINY, 1.0 / FLT_MAX),
])
def test_decode_scale(amax, expected):
    d = ref.decode_scale(f32([amax])).item()
    assert d == torch.tensor(expected, dtype=torch.float32).item()


def test_decode_scale_is_fp32_reciprocal_of_encode():
    amax = f32([1.0, 7.0, 10.0, 0.1])
    assert ref.decode_scale(amax).equal(1.0 / ref.encode_scale(amax))
    # fp32(1/2688) == 1/2688 rounded once
    assert ref.decode_scale(f32([1.0])).item() == f32(1.0 / 2688.0).item()


def test_rcp_e2m1_max_is_fp32_one_sixth():
    assert RCP_E2M1_MAX == f32(1.0 / 6.0).item()
    # 0x3E2AAAAB
    assert f32(RCP_E2M1_MAX).view(torch.int32).item() == 0x3E2AAAAB
