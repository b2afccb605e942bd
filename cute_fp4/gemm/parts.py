"""Pieces the GEMM kernels share.

The FP32 epilogue operands (SPEC section 3, ref.gemm's order): D[m, n] =
cast(((acc * scale * alpha) * row[m]) * col[n] + bias[n]), `scale` the power of two that
removes the decode's scaling (1 where there is none). A kernel carries the optional operands
as one tuple `epi` = (alpha [1], row, col, bias) from its `__call__` to where they are applied;
which of them exist is compile-time config (has_alpha, has_row, has_col, has_bias), and so is
`decode`: alpha, row or col may hold outer amaxes instead of factors, whose decode scales
1 / S_enc the kernel computes where it loads them (the operand's own quantization scales, with
no separate launch to turn them into factors first).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.jit import dyn, fake_tensor, torch_to_cutlass
from ..common.scales import decode_outer_scale


class EpilogueOperands:
    """The epilogue flags and math of a GEMM kernel class."""

    def set_epilogue_flags(self, has_alpha: bool, has_row: bool, has_col: bool,
                           has_bias: bool, decode=(None, None, None)):
        """decode: per epilogue vector (alpha, row, col), None when it holds the factors, or the
        e4m3_max of the outer amaxes it holds (the factor is then their decode scale, as
        ref.gemm.epilogue_factors makes it from one operand: ref.formats.decode_scale)."""
        if len(decode) != 3 or any(e not in (None, 448, 256) for e in decode):
            raise ValueError(f"decode must be 3 entries of None, 448 or 256, got {decode}")
        self.has_alpha = has_alpha
        self.has_row = has_row
        self.has_col = has_col
        self.has_bias = has_bias
        self.decode = tuple(decode)

    def _factor(self, which: int, value) -> Float32:
        """An alpha (0) / row (1) / col (2) entry as its FP32 factor."""
        value = value.to(Float32)
        if const_expr(self.decode[which] is not None):
            value = decode_outer_scale(value, float(self.decode[which]))
        return value

    def acc_scale(self, scale: float, epi) -> Float32:
        """The factor of every accumulator: `scale` times alpha where present."""
        factor = Float32(scale)
        if const_expr(self.has_alpha):
            factor = factor * self._factor(0, epi[0][0])
        return factor

    def apply_operands(self, v: Float32, m, n, epi, cached=None) -> Float32:
        """v * row[m] * col[n] + bias[n] in FP32, with the operands present, in that order;
        `cached`: their values from `load_operands` instead of loads here."""
        _, row, col, bias = epi
        row_v, col_v, bias_v = cached if cached is not None else (None, None, None)
        if const_expr(self.has_row):
            v = v * (self._factor(1, row[m]) if row_v is None else row_v)
        if const_expr(self.has_col):
            v = v * (self._factor(2, col[n]) if col_v is None else col_v)
        if const_expr(self.has_bias):
            v = v + (bias[n].to(Float32) if bias_v is None else bias_v)
        return v

    def load_operands(self, cache: dict, key_m, key_n, m, n, m_rows, n_cols, epi):
        """(row[m], col[n], bias[n]) as FP32 for an accumulator element whose row / column
        within the thread's fragment are the trace-time constants key_m / key_n: loaded once per
        key (a thread's C fragment spans few rows and columns; loading per element made the
        per-token GEMMs ~5% slower), at indices clamped into the vectors so the loads need no
        predicate (an element outside D uses no value)."""
        _, row, col, bias = epi
        if const_expr(self.has_row) and ("row", key_m) not in cache:
            cache["row", key_m] = self._factor(1, row[cutlass.min(m, m_rows - 1)])
        if const_expr(self.has_col) and ("col", key_n) not in cache:
            cache["col", key_n] = self._factor(2, col[cutlass.min(n, n_cols - 1)])
        if const_expr(self.has_bias) and ("bias", key_n) not in cache:
            cache["bias", key_n] = bias[cutlass.min(n, n_cols - 1)].to(Float32)
        return (cache.get(("row", key_m)), cache.get(("col", key_n)), cache.get(("bias", key_n)))


def epilogue_fakes(flags, bias_dtype, rows, cols) -> tuple:
    """The fakes of the optional epilogue operands for compiling a GEMM: alpha [1], row
    [rows of D], col and bias [cols of D] (FP32 vectors, bias of `bias_dtype` aligned to its
    element), None where flags = (has_alpha, has_row, has_col, has_bias) say absent."""
    has_alpha, has_row, has_col, has_bias = flags
    return (
        fake_tensor(cutlass.Float32, (1,), align=4) if has_alpha else None,
        fake_tensor(cutlass.Float32, (rows,), align=4) if has_row else None,
        fake_tensor(cutlass.Float32, (cols,), align=4) if has_col else None,
        fake_tensor(torch_to_cutlass(bias_dtype), (cols,),
                    align=torch.empty((), dtype=bias_dtype).element_size())
        if has_bias else None,
    )


def window_update(acc, part, coords, sWX, sWY, s, x_window: bool, y_window: bool,
                  acc_of=None, cache=None):
    """acc += (wx[p] * wy[q]) * part (the factor present alone with one window operand) with
    the window factors of pipeline stage `s` (sWX / sWY: [rows, 1, stages] FP32); each factor
    loaded once per thread, keyed by its trace-time row / column offset within the fragment
    (`coords`: the thread's partition of the part tile's identity tensor). `acc_of`: where
    part element i goes in acc (`part_positions`; default i) for a part tile of a column
    slice, whose rows are the tile's (so x factors only: its column coordinates are the
    slice's); `cache`: a dict of the factors loaded so far, shared by the slices of one
    k-tile. Plain Python at trace time, like `EpilogueOperands.load_operands`. The window64
    GEMMs use it (`sm90_window`, `sm90_w4a4`, `sm90_mixed`)."""
    if acc_of is not None and y_window:
        raise ValueError("window_update: column slices (acc_of) take x factors only")
    cache = {} if cache is None else cache
    for i in range(cute.size(part)):
        p, q = coords[i]
        kp, kq = coords.layout(i)
        f = None
        if x_window:
            if ("x", kp) not in cache:
                cache["x", kp] = sWX[p, 0, s]
            f = cache["x", kp]
        if y_window:
            if ("y", kq) not in cache:
                cache["y", kq] = sWY[q, 0, s]
            f = cache["y", kq] if f is None else f * cache["y", kq]
        a = i if acc_of is None else acc_of[i]
        acc[a] = acc[a] + f * part[i]


def part_positions(acc_coords, part_coords, q0: int):
    """For a part tile holding columns q0.. of the accumulator tile: the acc index of each
    part element (both arguments: the thread's partitions of the identity tensors of the two
    tiles, whose trace-time offsets match up to q0). Plain Python at trace time."""
    where = {tuple(acc_coords.layout(j)): j for j in range(cute.size(acc_coords))}
    return [where[(kp, kq + q0)]
            for kp, kq in (part_coords.layout(i) for i in range(cute.size(part_coords)))]


def prefetch_tma(*atoms):
    """Prefetch the descriptors of TMA atoms (absent ones: None)."""
    for atom in atoms:
        if atom is not None:
            cpasync.prefetch_descriptor(atom)


def tma_slices(tma, smem: cute.Tensor, gmem: cute.Tensor, modes: int = 2):
    """(smem, gmem) partitions of a TMA copy of one CTA (no multicast): the first `modes` modes
    of the staged shared-memory tensor and of the tiled global tensor are one box."""
    return cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(smem, 0, modes),
                                 cute.group_modes(gmem, 0, modes))


def window_slices(tma, sW: cute.Tensor, mW: cute.Tensor, rows: int):
    """(smem, gmem) TMA partitions of an optional window64 factor operand (`window_fake`:
    [rows padded to 4, K/64]) in boxes of `rows` factors of one k-tile, indexed (None, row
    tile, k-tile) on the gmem side; (None, None) where the operand is absent (`tma` None)."""
    if tma is None:
        return None, None
    return tma_slices(tma, sW, cute.local_tile(mW, (rows, 1), (None, None)))


def window_fake(present: bool):
    """The fake of an optional window64 factor tensor: [rows padded to 4, K/64] FP32 with the
    rows contiguous (`dispatch._window_factors`)."""
    if not present:
        return None
    return fake_tensor(cutlass.Float32, (dyn(4), dyn()), stride_order=(0, 1))
