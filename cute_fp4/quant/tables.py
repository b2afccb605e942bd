"""Host tables of the grouped (and single-tensor recipe) plans, built with numpy.

A plan for new split sizes (an MoE step) is host time on every call that brings them, so its
tables are numpy arrays: numpy's operations on small arrays cost ~1 us each where torch's cost
5-10 us, and a list of ints becomes an array ~2.5x faster than a tensor (800 ints: 23 us
against 58 on the 2-core CPU). recipes_dispatch._upload then packs them into one pinned
buffer (numpy copies), copies it to the GPU once and hands each table out as a typed view."""

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _within(counts: np.ndarray) -> np.ndarray:
    """int64 [sum(counts)]: each entry's index within its run of counts[i] entries."""
    within = np.arange(int(counts.sum()), dtype=np.int64)
    within -= np.repeat(np.cumsum(counts) - counts, counts)
    return within


def arith_runs(starts, counts, steps) -> np.ndarray:
    """int64 [sum(counts)]: for each i, counts[i] values starts[i] + j * steps[i] (j = 0 ..
    counts[i] - 1), one run after another."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64), counts) + _within(counts) * np.repeat(
        np.asarray(steps, dtype=np.int64), counts)


def ragged_table(rows, counts, steps=None) -> np.ndarray:
    """int32 [sum(counts), len(rows[0])]: for each g, counts[g] rows, the i-th rows[g] + i *
    steps (a value per column; no steps: zeros), one group after another: the groups' entries
    of a plan's table."""
    counts = np.asarray(counts, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64).reshape(counts.size, -1)
    table = np.repeat(rows, counts, axis=0)
    if steps is not None:
        within = _within(counts)
        for c, step in enumerate(steps):
            if step:  # the columns that step only (the chunk table's 1 of 3: 26 -> 16 us)
                table[:, c] += within * step
    return table.astype(np.int32)


def pack_offsets(tables: dict) -> tuple:
    """(offsets, bytes) of a staging buffer holding `tables` (numpy arrays), each from a
    16-byte boundary."""
    offsets, n = [], 0
    for t in tables.values():
        offsets.append(n)
        n += -(-t.nbytes // 16) * 16
    return offsets, n


def pack(buf: np.ndarray, tables: dict, offsets) -> None:
    """Copy each table's bytes into the uint8 buffer `buf` at its offset, zeros between."""
    for t, o, end in zip(tables.values(), offsets, offsets[1:] + [buf.size]):
        buf[o:o + t.nbytes] = t.reshape(-1).view(np.uint8)
        buf[o + t.nbytes:end] = 0


def typed_views(buf: torch.Tensor, tables: dict, offsets) -> dict:
    """Each table's view (its dtype and shape) of `buf` (uint8, on any device) packed by
    `pack`: one tensor object per table (as_strided of one typed view of the buffer per
    dtype)."""
    typed, views = {}, {}
    for (attr, t), o in zip(tables.items(), offsets):
        dtype = _TORCH_DTYPES[t.dtype]
        if dtype not in typed:
            typed[dtype] = buf.view(dtype)
        views[attr] = typed[dtype].as_strided(t.shape, [s // t.itemsize for s in t.strides],
                                              o // t.itemsize)
    return views
