"""The 16-point Random Hadamard Transform in registers (SPEC section 2), shared by the cast
kernels: sign flips, then fast Walsh-Hadamard butterflies at strides 1, 2, 4, 8, each one
correctly rounded FP32 add / sub in ref.quantize.rht's order.

XOR-permuted inputs (the plain cast's conflict-free column reads): if a thread holds
x'[p] = (D x)[p ^ r] (r < 8 a run-time lane constant, D the sign flips), the same butterflies
give y'[k] = (-1)^popcount(r & k) * y[k] bit for bit: each stage only swaps the roles of a
pair (a + b = b + a, a - b = -(b - a) exactly) and RN is odd. The caller applies D and the
output signs with +-1 factors (rht_sign_factors)."""

from cutlass import Float32, Uint32

from cute_fp4.ref.quantize import RHT_SIGNS

from . import encode as E


# RHT_SIGNS as a bit mask: bit j set where sign j is -1
RHT_SIGN_BITS = sum(1 << j for j, s in enumerate(RHT_SIGNS) if s < 0)


def rht16(xs, scale: bool = True, signs: bool = True):
    """ref.quantize.rht of 16 FP32 values (scale=False leaves out the final x 0.25:
    amax(|y| * 0.25) = amax(|y|) * 0.25, RN is monotone; signs=False leaves out the sign
    flips: the caller applied them)."""
    ys = [E.neg(x) if s < 0 and signs else x for x, s in zip(xs, RHT_SIGNS)]
    for h in (1, 2, 4, 8):
        nxt = list(ys)
        for j in range(16):
            if not j & h:
                nxt[j] = E.add_rn(ys[j], ys[j + h])
                nxt[j + h] = E.sub_rn(ys[j], ys[j + h])
        ys = nxt
    if not scale:
        return ys
    return [E.mul_rn(y, Float32(0.25)) for y in ys]


def rht_sign_factors(r):
    """Per-thread sign factors (+-1.0) of the XOR-permuted RHT with run-time r in 0..7:
    ([16] the sign flip of input position p, i.e. sign p ^ r; [8] the output sign
    (-1)^popcount(r & k) of outputs k and k + 8). Multiplying by them is exact and runs on the
    FMA pipe (an XOR of the sign bit would take the busier ALU pipe)."""
    r = Uint32(r)
    one = Uint32(0x3F800000)
    flips = [E.bits_f32(((Uint32(RHT_SIGN_BITS) >> (r ^ Uint32(p))) << Uint32(31)) | one)
             for p in range(16)]
    # bit r of odd[k]: popcount(r & k) is odd
    odd = [sum(1 << v for v in range(8) if bin(v & k).count("1") % 2) for k in range(8)]
    return flips, [E.bits_f32(((Uint32(t) >> r) << Uint32(31)) | one) for t in odd]
