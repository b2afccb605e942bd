"""CPU check of the bf16 / fp16 dequantize table decode (quant.dequantize.lut_decode16): its PTX
is run by a small interpreter of the instructions it uses and compared with torch, value by
value, on blocks of random codes and on q1 / q15 at and inside TABLE_BOUNDS."""

import random
import re

import pytest
import torch

from cute_fp4.quant.dequantize import TABLE_BOUNDS, _lut_decode16_ptx

MASK32 = 0xFFFFFFFF


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[i] & 7 of {b, a}, or with
    sel[i] & 8 the sign of that byte replicated."""
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
    """PTX lop3.b32: bit k of the result is bit (4 a_k + 2 b_k + c_k) of lut."""
    return sum(((lut >> ((a >> k & 1) * 4 + (b >> k & 1) * 2 + (c >> k & 1))) & 1) << k
               for k in range(32))


def run_ptx(ptx: str, args, out_dtype: torch.dtype):
    """Interpret lut_decode16's PTX with operands `args` ($r0 .. $r3); its 8 output words."""
    regs = {}

    def value(tok: str) -> int:
        m = re.fullmatch(r"\{\$r(\d)\}", tok)
        if m:
            return args[int(m.group(1))]
        return regs[tok] if tok in regs else int(tok, 0)

    for line in ptx.split("\n"):
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op.startswith("cvt.rn."):  # FP32 operand -> 16-bit pattern
            f = torch.tensor([value(src[0])], dtype=torch.float32).to(out_dtype)
            r = int(f.view(torch.int16).item()) & 0xFFFF
        else:
            x = [value(t) for t in src]
            r = {"cvt.u32.u16": lambda: x[0] & 0xFFFF,
                 "sub.u32": lambda: (x[0] - x[1]) & MASK32,
                 "add.u32": lambda: (x[0] + x[1]) & MASK32,
                 "shl.b32": lambda: (x[0] << x[1]) & MASK32,
                 "shr.b32": lambda: x[0] >> x[1],
                 "and.b32": lambda: x[0] & x[1],
                 "prmt.b32": lambda: prmt(*x),
                 "lop3.b32": lambda: lop3(*x)}[op]()
        regs[dst] = r
    return [regs["{$w%d}" % i] for i in range(8)]


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def expected(codes, q1: float, q15: float, out_dtype: torch.dtype):
    """The values as DequantizeNVFP4 computes them: 2**(e - 1) * q1 or q15 in FP32, then
    rounded to out_dtype (signed zeros kept)."""
    out = []
    for c in codes:
        m = c & 7
        if m == 0:
            v = 0.0
        else:
            base = q15 if m in (3, 5, 7) else q1
            v = f32(base * {1: 0.5, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 4}[m])
        v = -v if c & 8 else v
        t = torch.tensor([v], dtype=torch.float32).to(out_dtype)
        out.append(int(t.view(torch.int16).item()) & 0xFFFF)
    return out


@pytest.mark.parametrize("out_dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_table_decode_matches_torch(out_dtype, name):
    ptx = _lut_decode16_ptx(out_dtype == torch.float16)
    lo, hi = TABLE_BOUNDS[name]
    rng = random.Random(35)
    cases = [(lo, f32(1.5 * lo)), (f32(hi / 1.5), hi), (1.0, 1.5)]
    lo_e, hi_e = (-124, 125) if name == "bf16" else (-12, 13)
    for _ in range(60):
        q1 = f32(2.0 ** rng.uniform(lo_e, hi_e))
        q15 = f32(q1 * 1.5 * rng.choice([1.0, 1 + 2.0 ** -23, 1 - 2.0 ** -23]))
        if lo <= q1 and q15 <= hi:
            cases.append((q1, q15))
    assert len(cases) > 40
    for n, (q1, q15) in enumerate(cases):
        w0, w1 = ((0x76543210, 0xFEDCBA98) if n == 0
                  else (rng.getrandbits(32), rng.getrandbits(32)))
        got = []
        for word in run_ptx(ptx, [w0, w1, q1, q15], out_dtype):
            got += [word & 0xFFFF, word >> 16]
        codes = [(w >> 4 * j) & 0xF for w in (w0, w1) for j in range(8)]
        assert got == expected(codes, q1, q15, out_dtype), (q1, q15, hex(w0), hex(w1))
