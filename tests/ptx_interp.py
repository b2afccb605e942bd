"""A small interpreter for the straight-line inline PTX of cute_fp4's bit-level helpers (E2M1
encoders, the dequantize table decode), so that CPU tests can compare their exact results with
the torch references. Registers hold 32-bit patterns; FP32 instructions round exactly as the
hardware does (round to nearest even, subnormals kept: these snippets use no .ftz), from exact
rational arithmetic. Only the instructions those snippets use are known; anything else raises."""

import re
import struct
from fractions import Fraction

import torch

MASK32 = 0xFFFFFFFF
SIGN = 0x80000000


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & MASK32))[0]


def bits(value: float) -> int:
    """The bit pattern of a value exactly representable in FP32 (or +-inf)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def to_f32(value: float) -> float:
    """A Python float rounded to the nearest FP32 value (ties to even)."""
    return f32(bits(value))


def round_f32(x: Fraction, negative_zero: bool = False, toward_zero: bool = False) -> int:
    """The FP32 bit pattern of the exact value x rounded to nearest even, or toward zero
    (overflow to inf, or to the largest finite value toward zero)."""
    if x == 0:
        return SIGN if negative_zero else 0
    sign = SIGN if x < 0 else 0
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(x, quantum)
    n = int(n)
    if not toward_zero and (rem * 2 > quantum or (rem * 2 == quantum and n % 2)):
        n += 1
    v = n * quantum
    if v >= Fraction(2) ** 128:
        return sign | (0x7F7FFFFF if toward_zero else 0x7F800000)
    return sign | bits(float(v))


def _frac(b: int) -> Fraction:
    v = f32(b)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError("ptx_interp: FP32 arithmetic on inf / NaN operands is not modelled")
    return Fraction(v)


def _neg(b: int) -> bool:
    return bool(b & SIGN)


def _mul(a, b):
    return round_f32(_frac(a) * _frac(b), _neg(a) != _neg(b))


def _mul_rz(a, b):
    return round_f32(_frac(a) * _frac(b), _neg(a) != _neg(b), toward_zero=True)


def _add(a, b):
    return round_f32(_frac(a) + _frac(b), _neg(a) and _neg(b))


def _fma(a, b, c):
    prod = _frac(a) * _frac(b)
    neg_prod = _neg(a) != _neg(b)
    return round_f32(prod + _frac(c), prod == 0 and neg_prod and _neg(c))


def _min(a, b):
    fa, fb = f32(a), f32(b)
    if fa != fa:
        return b
    if fb != fb:
        return a
    if fa < fb or (fa == fb and _neg(a)):
        return a
    return b


def prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32, default mode: byte i of the result is byte sel[i] & 7 of {b, a}, or with
    sel[i] & 8 that byte's sign replicated."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> 4 * i) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32: bit k of the result is bit (4 a_k + 2 b_k + c_k) of lut."""
    return sum(((lut >> ((a >> k & 1) * 4 + (b >> k & 1) * 2 + (c >> k & 1))) & 1) << k
               for k in range(32))


def _to16(b: int, dtype: torch.dtype) -> int:
    t = torch.tensor([f32(b)], dtype=torch.float32).to(dtype)
    return int(t.view(torch.int16).item()) & 0xFFFF


def _half_f32(h: int, dtype: torch.dtype) -> int:
    """FP32 bits of a 16-bit bf16 / fp16 pattern (exact)."""
    t = torch.tensor([h & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dtype)
    return bits(t.float().item())


def _x2_mul(a: int, b: int, dtype: torch.dtype) -> int:
    """mul.rn.bf16x2 / f16x2: each product of two 16-bit values is exact in FP32, then rounded
    once to the 16-bit format."""
    out = 0
    for h in (0, 16):
        x, y = _half_f32(a >> h, dtype), _half_f32(b >> h, dtype)
        out |= _to16(_mul(x, y), dtype) << h
    return out


def _x2_set_lt(a: int, b: int, dtype: torch.dtype) -> int:
    """set.lt.u32.bf16x2 / f16x2: per half 0xFFFF where a < b (NaN: false), else 0."""
    out = 0
    for h in (0, 16):
        if f32(_half_f32(a >> h, dtype)) < f32(_half_f32(b >> h, dtype)):
            out |= 0xFFFF << h
    return out


def _e4m3x2_to_f16x2(q: int) -> int:
    """cvt.rn.f16x2.e4m3x2: the two E4M3 bytes of a 16-bit operand, each to FP16 (exact)."""
    t = torch.tensor([q & 0xFF, (q >> 8) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    lo, hi = (int(v) & 0xFFFF for v in t.to(torch.float16).view(torch.int16).tolist())
    return lo | hi << 16


OPS = {
    "mov.f32": lambda x: x[0], "mov.b32": lambda x: x[0],
    "mul.rn.f32": lambda x: _mul(*x), "mul.rz.f32": lambda x: _mul_rz(*x),
    "add.rn.f32": lambda x: _add(*x), "mul.lo.u32": lambda x: (x[0] * x[1]) & MASK32,
    "mad.lo.u32": lambda x: (x[0] * x[1] + x[2]) & MASK32,
    "fma.rn.f32": lambda x: _fma(*x), "abs.f32": lambda x: x[0] & ~SIGN & MASK32,
    "min.f32": lambda x: _min(*x),
    "add.u32": lambda x: (x[0] + x[1]) & MASK32, "sub.u32": lambda x: (x[0] - x[1]) & MASK32,
    "shl.b32": lambda x: (x[0] << x[1]) & MASK32, "shr.b32": lambda x: x[0] >> x[1],
    "shr.u32": lambda x: x[0] >> x[1], "and.b32": lambda x: x[0] & x[1],
    "or.b32": lambda x: x[0] | x[1], "prmt.b32": lambda x: prmt(*x),
    "lop3.b32": lambda x: lop3(*x), "cvt.u32.u16": lambda x: x[0] & 0xFFFF,
    "cvt.rn.bf16.f32": lambda x: _to16(x[0], torch.bfloat16),
    "cvt.rn.f16.f32": lambda x: _to16(x[0], torch.float16),
    "mul.rn.bf16x2": lambda x: _x2_mul(*x, torch.bfloat16),
    "mul.rn.f16x2": lambda x: _x2_mul(*x, torch.float16),
    "set.lt.u32.bf16x2": lambda x: _x2_set_lt(*x, torch.bfloat16),
    "set.lt.u32.f16x2": lambda x: _x2_set_lt(*x, torch.float16),
    "cvt.u16.u32": lambda x: x[0] & 0xFFFF,
    "cvt.rn.f16x2.e4m3x2": lambda x: _e4m3x2_to_f16x2(x[0]),
}


def run(ptx: str, args) -> dict:
    """Interpret `ptx` with its inputs `args` (32-bit patterns): a list for the operands
    {$r0}, {$r1}, ... of cute.arch.inline_ptx, or a dict of operand names (e.g. "$4" of
    inline_asm); returns the registers (outputs under their operand names, {$wN} / $N)."""
    regs = dict(args) if isinstance(args, dict) else {"{$r%d}" % i: v for i, v in enumerate(args)}

    def value(tok: str) -> int:
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0) & MASK32

    for line in re.split(r"[;\n]", ptx):
        line = line.strip()
        if not line or line[0] in "{}." or line.startswith("//"):
            continue
        pred = None
        if line.startswith("@"):
            pred, line = line.split(None, 1)
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "setp.lt.f32":
            a, b = f32(value(src[0])), f32(value(src[1]))
            regs[dst] = a < b
            continue
        if pred is not None and not regs[pred[1:]]:
            continue
        if op not in OPS:
            raise NotImplementedError(f"ptx_interp: {op}")
        regs[dst] = OPS[op]([value(t) for t in src])
    return regs


def outputs(regs: dict, count: int):
    return [regs["{$w%d}" % i] for i in range(count)]
