"""CPU checks of common.stores' shared-memory slot map (`_slot`): for every chunk layout the
kernels use, the warp's chunks land on distinct slots, and both the writes (each lane's chunk
c) and the linear read-back are free of bank conflicts. A 16-byte shared access is served in
four phases of 8 consecutive lanes; a phase is conflict-free when its 8 addresses fall in 8
distinct 16-byte bank groups of a 128-byte row."""

import pytest

from cute_fp4.common.stores import _slot


def _ways(addresses):
    """The worst bank-conflict degree of a warp's 16-byte shared access (1: conflict-free)."""
    worst = 1
    for p in range(0, 32, 8):
        groups = [(a // 16) % 8 for a in addresses[p:p + 8]]
        worst = max(worst, max(groups.count(b) for b in groups))
    return worst


def _conflict_free(addresses):
    return _ways(addresses) == 1


def _dequantize_layout(n):
    """store_blocks: lane l holds block l, chunks c = 0..n-1 (chunk index l * n + c)."""
    return [[lane * n + c for lane in range(32)] for c in range(n)]


def _unit_layout():
    """store_unit_chunks (pre-pass, PermuteK): lane l holds chunks 2 i + l % 2 of the 128-byte
    k-tile row of lanes l & ~1 and l | 1."""
    return [[(lane - lane % 2) * 4 + 2 * i + lane % 2 for lane in range(32)] for i in range(4)]


@pytest.mark.parametrize("layout", [_dequantize_layout(1), _dequantize_layout(2),
                                    _dequantize_layout(4), _dequantize_layout(8), _unit_layout()],
                         ids=["n1", "n2-bf16", "n4-fp32", "n8-mxfp8-fp32", "prepass"])
def test_slot_map(layout):
    n = len(layout)
    chunks = sorted(g for per_c in layout for g in per_c)
    assert chunks == list(range(32 * n))  # every chunk held by one lane
    assert sorted(_slot(g) for g in chunks) == [16 * g for g in range(32 * n)]  # a permutation
    for per_c in layout:  # the writes: one instruction per chunk position
        assert _conflict_free([_slot(g) for g in per_c])
    for k in range(n):  # the read-back: lane l reads chunk 32 k + l
        assert _conflict_free([_slot(32 * k + lane) for lane in range(32)])


def test_slot_map_without_swizzle_conflicts():
    """The check can fail: the plain map (slot = chunk) has 4-way conflicts on the fp32
    dequantize writes, and XOR-ing the bank row alone (without the factor 5) 2-way conflicts
    on the pre-pass's."""
    assert not _conflict_free([16 * g for g in _dequantize_layout(4)[0]])
    assert _ways([(g ^ ((g >> 3) & 7)) << 4 for g in _unit_layout()[0]]) == 2
