"""Philox4x32-10 (Salmon et al., Random123) in int64 torch arithmetic, for stochastic rounding.

Eight random bits per element: element i of a stream gets byte i % 4 (bits 8 * (i % 4) and up)
of word j = i // 4, and word j is output word j % 4 of philox(counter, key) with
counter = (lo32(j // 4), hi32(j // 4), offset, stream) and key = (lo32(seed), hi32(seed)).
So one Philox call serves 16 consecutive elements (one 1x16 block of a row), and each 32-bit
word 4 consecutive elements (what Blackwell's cvt.rs ... e2m1x4 takes as rbits).
Stream 0 is the rowwise output, stream 1 the columnwise twin.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of the 64-bit product a * b, without int64 overflow."""
    p_lo = b * (a & 0xFFFF)
    p_hi = b * (a >> 16)
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (t >> 32), t & MASK32


def philox4x32(c0, c1, c2, c3, k0: int, k1: int):
    """Ten Philox rounds on int64 tensors holding 32-bit counters; returns the four words."""
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def check_seed_offset(seed: int, offset: int):
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not 0 <= int(offset) < 2**32:
        raise ValueError(f"offset must be in [0, 2**32), got {offset}")


def philox_bits(numel: int, seed: int, offset: int, stream: int, device=None) -> torch.Tensor:
    """The random bytes (int64 tensor, values in [0, 256)) of elements 0..numel-1 of a stream."""
    check_seed_offset(seed, offset)
    call = torch.arange(-(-numel // 16), dtype=torch.int64, device=device)
    c2 = torch.full_like(call, int(offset) & MASK32)
    c3 = torch.full_like(call, int(stream) & MASK32)
    words = philox4x32(call & MASK32, call >> 32, c2, c3, int(seed) & MASK32, int(seed) >> 32)
    words = torch.stack(words, dim=-1).flatten()
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).flatten()[:numel]
