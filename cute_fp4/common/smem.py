"""Shared-memory tiles of the transposing kernels (window factors, scale swizzle).

No `from __future__ import annotations` here: cute.struct reads its fields' annotations as
objects."""

import cutlass.cute as cute


def padded_tile_storage(dtype, rows: int, cols: int):
    """The shared storage of one `rows` x `cols` tile with a row pitch of cols + 1 elements:
    a warp reading one column of 32 rows then hits 32 distinct banks."""

    @cute.struct
    class SharedStorage:
        tile: cute.struct.MemRange[dtype, rows * (cols + 1)]

    return SharedStorage


def padded_tile(storage, rows: int, cols: int) -> cute.Tensor:
    """The [rows, cols] tile of an allocated `padded_tile_storage`."""
    return storage.tile.get_tensor(cute.make_layout((rows, cols), stride=(cols + 1, 1)))
