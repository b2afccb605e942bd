"""`python -m cute_fp4.perf.quant_recipes`: bandwidth of the recipe quantize kernels
(cast_recipes) against the plain cast (quant.dispatch) measured in the same run.

Columns: time, % of the HBM floor (unavoidable bytes / copy bandwidth of this run: the input
read twice when an outer amax pass is needed, once for window64; every output written once),
and the ratio to the plain cast of the same shape and outputs (the plain cast uses the
recipe's scaling where it supports it, else per-tensor).
"""

from __future__ import annotations

import argparse

import torch

from ..recipe import Recipe
from .common import bench_graph_ms, bench_ms, copy_bandwidth_gbs, progress, report


def floor_bytes(m: int, k: int, elem: int, recipe: Recipe) -> int:
    outs = int(recipe.rowwise) + int(recipe.columnwise)
    out = outs * (m * k // 2 + m * k // 16)
    if recipe.scaling == "window64":
        out += outs * m * k // 64 * 4
    passes = 1 if recipe.scaling == "window64" else 2
    return passes * m * k * elem + out


def _splits(total: int, n: int, unit: int):
    """n uneven group sizes (multiples of `unit`) summing to total."""
    base = total // n // unit
    sizes = [unit * max(base + (i % 3 - 1) * max(base // 4, 1), 0) for i in range(n - 1)]
    return sizes + [total - sum(sizes)]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf.quant_recipes")
    p.add_argument("--m", type=int, nargs="*", default=[8192])
    p.add_argument("--k", type=int, nargs="*", default=[8192])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--scaling", default="tensor", choices=["tensor", "token"])
    p.add_argument("--rht", action="store_true")
    p.add_argument("--sr", action="store_true")
    p.add_argument("--2d", dest="block2d", action="store_true")
    p.add_argument("--window64", action="store_true")
    p.add_argument("--four-over-six", choices=["mae", "mse"], default=None)
    p.add_argument("--fast-math", action="store_true")
    p.add_argument("--grouped", type=int, default=0, help="N groups (uneven) vs one launch")
    p.add_argument("--rowwise-only", action="store_true")
    p.add_argument("--modes", nargs="*", default=["graph", "eager"],
                   help="graph: CUDA-graph replay (GPU time); eager: with host overhead")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from ..quant.dispatch import quantize as plain
    from ..quant.recipes_dispatch import quantize_grouped, quantize_recipe

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    cw = not args.rowwise_only
    recipe = Recipe(scaling="window64" if args.window64 else args.scaling,
                    block=(16, 16) if args.block2d else (1, 16), rht=args.rht,
                    stochastic_rounding=args.sr, four_over_six=args.four_over_six,
                    fast_math=args.fast_math, rowwise=True, columnwise=cw)
    base = Recipe(scaling=args.scaling if not args.window64 else "tensor", rowwise=True,
                  columnwise=cw)
    copy_bw = copy_bandwidth_gbs()
    rows = []
    shapes = [(m, k) for m in args.m for k in args.k]
    for i, (m, k) in enumerate(shapes, 1):
        progress(i, len(shapes), f"M={m} K={k}")
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        cases = [("plain cast", base, lambda: plain(x, base))]
        if args.grouped:
            sizes = _splits(m, args.grouped, 64 if args.window64 else 16)
            cases.append(("recipe, 1 launch", recipe, lambda: quantize_recipe(x, recipe, seed=1)))
            cases.append((f"grouped N={args.grouped}", recipe,
                          lambda: quantize_grouped(x, sizes, recipe, seed=1)))
        else:
            cases.append(("recipe", recipe, lambda: quantize_recipe(x, recipe, seed=1)))
        for mode in args.modes:
            times = {}
            for label, rec, fn in cases:
                ms = bench_graph_ms(fn) if mode == "graph" else bench_ms(fn)
                times[label] = ms
                floor_ms = floor_bytes(m, k, x.element_size(), rec) / copy_bw / 1e6
                rows.append({"M": m, "K": k, "mode": mode, "kernel": label, "time_us": ms * 1e3,
                             "%floor": 100 * floor_ms / ms,
                             "vs plain": ms / times["plain cast"],
                             "vs 1 launch": (ms / times["recipe, 1 launch"]
                                             if "recipe, 1 launch" in times else float("nan"))})
        del x
    title = (f"NVFP4 recipe quantize {recipe} ({args.dtype}), {torch.cuda.get_device_name()}, "
             f"copy bandwidth {copy_bw:.0f} GB/s")
    report(rows, title, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
