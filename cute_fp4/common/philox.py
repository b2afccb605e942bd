"""Philox4x32-10 in the CuTe DSL, bit-exact to `cute_fp4.ref.philox` (stochastic rounding).

Eight random bits per element: element i of a stream gets byte i % 4 of word i // 4, and word
j is output j % 4 of philox(counter, key) with counter = (lo32(j // 4), hi32(j // 4), offset,
stream) and key = (lo32(seed), hi32(seed)); stream 0 is the rowwise output, stream 1 the
columnwise twin. One call gives the bytes of 16 consecutive elements (one 1x16 block). The key
schedule (the ten round keys) is computed once per thread (`round_keys`); the ten rounds are
one inline PTX block of mul.wide.u32 (one IMAD.WIDE per 32x32 -> 64-bit product) and xor,
called from `@cute.jit` / `@cute.kernel` code.
"""

from cutlass import Int64, Uint32
import cutlass.cute as cute

from cute_fp4.ref.philox import MASK32, PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, ROUNDS


def _philox_ptx() -> str:
    # operands: r0..r3 counter, r4 + 2 * i / r5 + 2 * i the keys of round i
    lines = ["{\n.reg .b32 c0, c1, c2, c3, h0, l0, h1, l1;\n.reg .b64 p0, p1;\n",
             "mov.b32 c0, {$r0};\nmov.b32 c1, {$r1};\nmov.b32 c2, {$r2};\nmov.b32 c3, {$r3};\n"]
    for r in range(ROUNDS):
        ka, kb = "{$r%d}" % (4 + 2 * r), "{$r%d}" % (5 + 2 * r)
        lines.append(
            f"mul.wide.u32 p0, c0, {PHILOX_M0:#010x};\nmul.wide.u32 p1, c2, {PHILOX_M1:#010x};\n"
            "mov.b64 {l0, h0}, p0;\nmov.b64 {l1, h1}, p1;\n"
            f"xor.b32 c0, h1, c1;\nxor.b32 c0, c0, {ka};\nmov.b32 c1, l1;\n"
            f"xor.b32 c2, h0, c3;\nxor.b32 c2, c2, {kb};\nmov.b32 c3, l0;\n")
    lines.append("mov.b32 {$w0}, c0;\nmov.b32 {$w1}, c1;\nmov.b32 {$w2}, c2;\nmov.b32 {$w3}, c3;\n}")
    return "".join(lines)


_PHILOX = _philox_ptx()


def round_keys(k0, k1):
    """The key schedule of a (k0, k1) key: [k0_0, k1_0, k0_1, k1_1, ...] (2 * ROUNDS Uint32)."""
    keys = []
    for r in range(ROUNDS):
        keys += [Uint32(k0) + Uint32((r * PHILOX_W0) & MASK32),
                 Uint32(k1) + Uint32((r * PHILOX_W1) & MASK32)]
    return keys


def rng_round_keys(rng):
    """(round keys, offset) of stochastic rounding's int64 [seed, offset] device tensor: the
    key schedule of the seed's two 32-bit halves and the offset's low 32 bits (a Uint32)."""
    seed = rng[0]
    return round_keys(Uint32(seed & 0xFFFFFFFF), Uint32(seed >> 32)), Uint32(rng[1])


def philox4x32(c0, c1, c2, c3, keys):
    """The four 32-bit output words (Uint32) of Philox4x32-10 for one counter and the round
    keys of `round_keys`."""
    return cute.arch.inline_ptx(
        _PHILOX, write_only_types=[Uint32] * 4,
        read_only_args=[Uint32(c0), Uint32(c1), Uint32(c2), Uint32(c3)] + list(keys),
    )


def philox_call(call, offset, stream: int, keys):
    """The four random words of Philox call `call` (an Int64: the 16-element block
    16 * call .. 16 * call + 15 of the stream) of a stream: word j holds the bytes of elements
    16 * call + 4j .. 4j + 3."""
    return list(philox4x32(Uint32(call & 0xFFFFFFFF), Uint32(call >> 32), offset, Uint32(stream),
                           keys))


def philox_block16(idx0, offset, stream: int, keys):
    """The four random words of the 16 consecutive elements idx0 .. idx0 + 15 of a stream
    (idx0 an Int64 multiple of 16): philox_call of idx0 / 16."""
    return philox_call(Int64(idx0) // 16, offset, stream, keys)
