"""CPU check of the bf16 / fp16 dequantize table decode (quant.dequantize.lut_decode16): its PTX
runs in the interpreter of ptx_interp and is compared with torch, value by value, on blocks of
random codes with q1 / q15 at and inside TABLE_BOUNDS."""

import random

import pytest
import torch
from ptx_interp import bits, outputs, run, to_f32

from cute_fp4.quant.dequantize import TABLE_BOUNDS, _lut_decode16_ptx


def expected(codes, q1: float, q15: float, out_dtype: torch.dtype):
    """The values as DequantizeNVFP4 computes them: 2**(e - 1) * q1 or q15 in FP32, then
    rounded to out_dtype (signed zeros kept)."""
    out = []
    for c in codes:
        m = c & 7
        v = 0.0
        if m:
            base = q15 if m in (3, 5, 7) else q1
            v = to_f32(base * {1: 0.5, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 4}[m])
        v = -v if c & 8 else v
        t = torch.tensor([v], dtype=torch.float32).to(out_dtype)
        out.append(int(t.view(torch.int16).item()) & 0xFFFF)
    return out


@pytest.mark.parametrize("out_dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_table_decode_matches_torch(out_dtype, name):
    ptx = _lut_decode16_ptx(out_dtype == torch.float16)
    lo, hi = TABLE_BOUNDS[name]
    rng = random.Random(35)
    cases = [(lo, to_f32(1.5 * lo)), (to_f32(hi / 1.5), hi), (1.0, 1.5)]
    lo_e, hi_e = (-124, 125) if name == "bf16" else (-12, 13)
    for _ in range(60):
        q1 = to_f32(2.0 ** rng.uniform(lo_e, hi_e))
        q15 = to_f32(q1 * 1.5 * rng.choice([1.0, 1 + 2.0 ** -23, 1 - 2.0 ** -23]))
        if lo <= q1 and q15 <= hi:
            cases.append((q1, q15))
    assert len(cases) > 40
    for n, (q1, q15) in enumerate(cases):
        w0, w1 = ((0x76543210, 0xFEDCBA98) if n == 0
                  else (rng.getrandbits(32), rng.getrandbits(32)))
        got = []
        for word in outputs(run(ptx, [w0, w1, bits(q1), bits(q15)]), 8):
            got += [word & 0xFFFF, word >> 16]
        codes = [(w >> 4 * j) & 0xF for w in (w0, w1) for j in range(8)]
        assert got == expected(codes, q1, q15, out_dtype), (q1, q15, hex(w0), hex(w1))
