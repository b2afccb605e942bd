"""Element formats: E2M1 encode/decode and packing, E4M3 block scales, the FP32 outer scale.

Every arithmetic step is one FP32 torch op, in the order SPEC section 1 gives, so the kernels
can reproduce these results bit for bit.
"""

from __future__ import annotations

import torch

# The float dtypes of quantize inputs and of dense (dequantized / GEMM) outputs.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
# fp32(1/6): the reference folds the 1/6 of the block scale into the outer scale first.
RCP_E2M1_MAX = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding to nearest with ties to the even code: (threshold, inclusive) for codes 1..7.
# A magnitude above the threshold (or equal where inclusive) reaches the next code.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 E2M1 values indexed by code (bit 3 is the sign)."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """FP32 values -> E2M1 codes (uint8, one per element), saturating at +-6.

    Round to nearest, ties to the even code. An exact +-0 gives code 0; a negative value that
    rounds to zero gives 0x8; NaN gives code 0.
    """
    if v.dtype != torch.float32:
        raise TypeError(f"e2m1_encode expects float32 values, got {v.dtype}")
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, inclusive in _E2M1_STEPS:
        code += (mag >= threshold if inclusive else mag > threshold).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_encode_stochastic(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """FP32 values -> E2M1 codes, rounding up with probability equal to the fractional position,
    quantised to 1/256.

    `bits` holds one random byte b per element (int64 tensor, values in [0, 256)). With
    frac = (|v| - lo) / (hi - lo) (exact in FP32: the code gaps are powers of two), a magnitude
    rounds up to the next code iff frac >= (511 - 2b) / 512, i.e. iff adding (b + 1/2) / 256 of
    the gap reaches the next code (the magnitude plus a random offset, rounded toward zero).
    With b uniform, P(up) = #{b : 2b >= 511 - 512 frac} / 256 differs from frac by at most
    1/512 (exactly frac when 256 frac is an integer), so the bias of a rounded value is at most
    gap / 512 (gap = 0.5, 1 or 2 before the block scale). Saturates at 6; exact codes never move
    (frac = 0 never rounds up); sign and NaN as in `e2m1_encode`.
    """
    if v.dtype != torch.float32:
        raise TypeError(f"e2m1_encode_stochastic expects float32 values, got {v.dtype}")
    if bits.shape != v.shape:
        raise ValueError(f"random bits shape {tuple(bits.shape)} != values shape {tuple(v.shape)}")
    mag = v.abs().clamp(max=E2M1_MAX)
    table = torch.tensor(E2M1_VALUES + (E2M1_MAX,), dtype=torch.float32, device=v.device)
    lower = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for value in E2M1_VALUES[1:]:
        lower += (mag >= value).to(torch.int64)
    lo = table[lower]
    gap = table[(lower + 1).clamp(max=7)] - lo
    frac = torch.where(gap > 0, (mag - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    threshold = (511 - 2 * bits).to(torch.float32) / 512  # exact
    code = (lower + (frac >= threshold).to(torch.int64)).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, low nibble) -> values."""
    return e2m1_table(codes.device, dtype)[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3 after clamping to +-448 (saturating; NaN stays NaN)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def encode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """Outer encode scale S_enc = e4m3_max * 6 / amax, capped at FLT_MAX, 1 where amax is 0."""
    amax = amax.to(torch.float32)
    # Constants made on the device (no host copy: CUDA-graph capturable); clamp keeps NaN.
    s = (torch.full_like(amax, float(e4m3_max) * E2M1_MAX) / amax).clamp(max=FLT_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def decode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """S_dec = 1 / S_enc (one FP32 division)."""
    return 1.0 / encode_scale(amax, e4m3_max)
