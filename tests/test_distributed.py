"""Sequence-parallel amax reduction (`amax_group`): two gloo ranks, each holding half of the
rows, must produce exactly their slice of the unsharded quantization, and Linear's outputs and
input gradients must be the slices of the unsharded Linear's. CPU (references); the kernels'
side of the hook is tested in the GPU quantize tests."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cute_fp4
from cute_fp4 import Recipe
from cute_fp4.nn import Linear, LinearRecipe

WORLD = 2
M, K, N = 128, 192, 64  # each rank: 64 rows, a multiple of 16 and 64

RECIPES = [
    Recipe(scaling="tensor", columnwise=True),
    Recipe(scaling="token", columnwise=True),
    Recipe(scaling="tensor", columnwise=True, rht=True),
    Recipe(scaling="token", columnwise=True, rht=True, swizzle=True),
    Recipe(scaling="tensor", block=(16, 16), columnwise=True),
    Recipe(scaling="window64", columnwise=True),
    Recipe(scaling="token", columnwise=True, four_over_six="mse"),
]


def _slices(t, rank):
    """The rows of rank `rank` in the rowwise outputs and the matching columns of the twin."""
    rows = slice(rank * M // WORLD, (rank + 1) * M // WORLD)
    per = M // WORLD
    out = {"data": t.data[rows], "data_t": t.data_t[:, rank * per // 2:(rank + 1) * per // 2]}
    scaling = t.recipe.scaling
    out["amax"] = t.amax[rows] if scaling in ("token", "window64") else t.amax
    out["amax_t"] = (t.amax_t[:, rank * per // 64:(rank + 1) * per // 64]
                     if scaling == "window64" else t.amax_t)
    if not t.recipe.swizzle:
        out["scales"] = t.scales[rows]
        out["scales_t"] = t.scales_t[:, rank * per // 16:(rank + 1) * per // 16]
    return out


def _worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        group = dist.group.WORLD
        torch.manual_seed(0)
        x = torch.randn(M, K) * torch.logspace(-2, 2, M).unsqueeze(1)  # outlier rows
        x[3, 5] = 300.0  # the global max lives on rank 0 only
        mine = x[rank * M // WORLD:(rank + 1) * M // WORLD]
        failures = []
        for recipe in RECIPES:
            full = _slices(cute_fp4.quantize(x, recipe), rank)
            shard = cute_fp4.quantize(mine, recipe, amax_group=group)
            got = {"data": shard.data, "data_t": shard.data_t, "amax": shard.amax,
                   "amax_t": shard.amax_t}
            if not recipe.swizzle:
                got["scales"], got["scales_t"] = shard.scales, shard.scales_t
            for key, want in full.items():
                a, b = got[key], want
                if a.dtype == torch.float8_e4m3fn:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                if not torch.equal(a, b):
                    failures.append(f"{recipe}: {key}")

        # Linear: outputs and input gradients are slices of the unsharded Linear's, the
        # weight gradient sums over the ranks.
        lin_recipe = LinearRecipe.per_token(stochastic_rounding=False)
        base = torch.nn.Linear(K, N)
        full_lin = Linear.from_linear(base, lin_recipe)
        shard_lin = Linear.from_linear(base, lin_recipe, amax_group=group)
        g = torch.randn(M, N)
        xf = x.clone().requires_grad_()
        full_lin(xf).backward(g)
        xs = mine.clone().requires_grad_()
        ys = shard_lin(xs)
        ys.backward(g[rank * M // WORLD:(rank + 1) * M // WORLD])
        rows = slice(rank * M // WORLD, (rank + 1) * M // WORLD)
        with torch.no_grad():
            y_full = full_lin(x)
        if not torch.equal(ys.detach(), y_full[rows]):
            failures.append("Linear output")
        if not torch.equal(xs.grad, xf.grad[rows]):
            failures.append("Linear dgrad")
        dw = shard_lin.weight.grad.clone()
        dist.all_reduce(dw)
        if not torch.allclose(dw, full_lin.weight.grad, rtol=1e-5, atol=1e-5):
            failures.append("Linear wgrad sum")
        results[rank] = failures
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_amax_group_shards_match_unsharded(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    init_file = os.path.join(tmp_path, "rendezvous")
    mp.start_processes(_worker, args=(init_file, results), nprocs=WORLD, start_method="spawn")
    assert dict(results) == {0: [], 1: []}


def test_amax_group_type_checked():
    with pytest.raises(TypeError, match="amax_group"):
        cute_fp4.quantize(torch.randn(32, 32), amax_group="world")
