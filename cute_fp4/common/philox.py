"""Philox4x32-10 in the CuTe DSL, bit-exact to `cute_fp4.ref.philox` (stochastic rounding).

Element i of a stream gets word i % 4 of philox(counter, key) with
counter = (lo32(i // 4), hi32(i // 4), offset, stream) and key = (lo32(seed), hi32(seed));
stream 0 is the rowwise output, stream 1 the columnwise twin. The ten rounds are one inline
PTX block (mul.hi/lo.u32, xor, key bumps), called from `@cute.jit` / `@cute.kernel` code.
"""

from cutlass import Uint32
import cutlass.cute as cute

from cute_fp4.ref.philox import PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, ROUNDS


def _philox_ptx() -> str:
    lines = ["{\n.reg .b32 c0, c1, c2, c3, k0, k1, h0, l0, h1, l1;\n",
             "mov.b32 c0, {$r0};\nmov.b32 c1, {$r1};\nmov.b32 c2, {$r2};\nmov.b32 c3, {$r3};\n",
             "mov.b32 k0, {$r4};\nmov.b32 k1, {$r5};\n"]
    for r in range(ROUNDS):
        if r:
            lines.append(f"add.u32 k0, k0, {PHILOX_W0:#010x};\nadd.u32 k1, k1, {PHILOX_W1:#010x};\n")
        lines.append(
            f"mul.hi.u32 h0, c0, {PHILOX_M0:#010x};\nmul.lo.u32 l0, c0, {PHILOX_M0:#010x};\n"
            f"mul.hi.u32 h1, c2, {PHILOX_M1:#010x};\nmul.lo.u32 l1, c2, {PHILOX_M1:#010x};\n"
            "xor.b32 c0, h1, c1;\nxor.b32 c0, c0, k0;\nmov.b32 c1, l1;\n"
            "xor.b32 c2, h0, c3;\nxor.b32 c2, c2, k1;\nmov.b32 c3, l0;\n")
    lines.append("mov.b32 {$w0}, c0;\nmov.b32 {$w1}, c1;\nmov.b32 {$w2}, c2;\nmov.b32 {$w3}, c3;\n}")
    return "".join(lines)


_PHILOX = _philox_ptx()


def philox4x32(c0, c1, c2, c3, k0, k1):
    """The four 32-bit output words (Uint32) of Philox4x32-10 for one counter and key."""
    return cute.arch.inline_ptx(
        _PHILOX, write_only_types=[Uint32] * 4,
        read_only_args=[Uint32(c0), Uint32(c1), Uint32(c2), Uint32(c3), Uint32(k0), Uint32(k1)],
    )


def philox_words16(idx0, offset, stream: int, k0, k1):
    """Random words for the 16 consecutive elements idx0 .. idx0 + 15 of a stream (idx0 an
    Int64 multiple of 4): a Python list of 16 Uint32."""
    group = idx0 // 4
    words = []
    for j in range(4):
        g = group + j
        lo = Uint32(g & 0xFFFFFFFF)
        hi = Uint32(g >> 32)
        words += list(philox4x32(lo, hi, offset, Uint32(stream), k0, k1))
    return words
