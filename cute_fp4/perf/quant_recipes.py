"""`python -m cute_fp4.perf quant_recipes` (also `python -m cute_fp4.perf quant --rht` etc.):
bandwidth of the recipe quantize kernels (cast_recipes) against the plain cast
(quant.dispatch) measured in the same run.

One recipe from the flags (--rht, --sr, --2d, --window64, --four-over-six {mae,mse}
[--fast-math], --scaling token, --grouped N [--ragged], --swizzle), or --suite: every recipe of
issues 4 and 5 in one table. Columns: time, % of the HBM floor (unavoidable bytes / copy
bandwidth of this run: the input read twice when an outer amax pass is needed, once for
window64 and per token rowwise only; every output written once), the ratio to the plain cast of
the same shape, outputs and scale layout (the plain cast uses the recipe's scaling where it
supports it, else per-tensor) and, for grouped inputs, the ratio to one single-tensor launch of
the same recipe and total size.

Each recipe is timed as `cute_fp4.quantize` runs it on CUDA (`ops.quantize_impl`: 16x16
blocks per tensor on the plain cast, the rest on the recipe kernels, whose dispatch sends the
single-tensor 1x16 RHT and stochastic rounding back to the plain cast's walk), except the
suite's "recipe kernel" rows, which time `recipes_dispatch.quantize_recipe` itself.

With --grouped N a second table gives the host time of a grouped call (grouped_host_rows): on
a small input, with the same split sizes every call (its plan cached) and with new ones every
call (a plan built per call, as MoE routing changes the sizes every step), each without and
with the groups' NVFP4Tensor views, for N and for ROW_GROUPS_MAX groups. `--host-only` prints
just that table; `--host-k` / `--host-rows` set its input's K and rows per group (a plan's
tables grow with the input's tiles: MoE sizes, e.g. `--host-k 4096 --host-rows 2048`).
"""

from __future__ import annotations

import argparse
import os

import torch

from ..recipe import Recipe
from .common import (GRAPH_INPUTS, bench_graph_ms, bench_ms, copy_bandwidth_gbs,
                     host_overhead_us, progress, report)


def floor_bytes(m: int, k: int, elem: int, recipe: Recipe) -> int:
    outs = int(recipe.rowwise) + int(recipe.columnwise)
    out = outs * (m * k // 2 + m * k // 16)
    if recipe.scaling == "window64":
        out += outs * m * k // 64 * 4
    # one read: window64 (no amax pass) and per-token rowwise only (TokenRowCast)
    one_read = recipe.scaling == "window64" or (recipe.scaling == "token"
                                                 and not recipe.columnwise)
    passes = 1 if one_read else 2
    return passes * m * k * elem + out


RAGGED = (3, -2, 1, -3, 2, -1, 5)  # --ragged: multiples of `unit` added to the groups


def _splits(total: int, n: int, unit: int, ragged: bool = False):
    """n uneven group sizes (multiples of `unit`) summing to total; for the benchmark's M
    multiples of 128 rows, or with `ragged` off them by multiples of `unit` (RAGGED; with
    unit 16 none of the benchmark's groups is then a multiple of 128 rows, so their swizzled
    scales have padding)."""
    base = total // n // unit
    sizes = [unit * max(base + (i % 3 - 1) * max(base // 4, 1)
                        + (RAGGED[i % len(RAGGED)] if ragged else 0), 0) for i in range(n - 1)]
    return sizes + [total - sum(sizes)]


def _plain_recipe(recipe: Recipe) -> Recipe:
    """The plain-cast baseline of a recipe: same outputs and scale layout, its scaling where
    the plain cast has it (tensor, token), else per-tensor."""
    scaling = recipe.scaling if recipe.scaling in ("tensor", "token") else "tensor"
    return Recipe(scaling=scaling, rowwise=recipe.rowwise, columnwise=recipe.columnwise,
                  swizzle=recipe.swizzle)


def cases(args):
    """[(label, recipe, groups)]: groups 0 = one single-tensor call of cute_fp4.quantize's
    CUDA path, -1 = one call of the recipe kernels (quantize_recipe), N > 0 = N groups,
    (N, True) = N ragged groups (_splits)."""
    cw = not args.rowwise_only

    def rec(**kw):
        return Recipe(rowwise=True, columnwise=cw, swizzle=args.swizzle, **kw)

    if args.suite:
        out = [("recipe kernel, no option", rec(), -1), ("rht", rec(rht=True), 0),
               ("token + rht", rec(scaling="token", rht=True), 0),
               ("stochastic rounding", rec(stochastic_rounding=True), 0),
               ("token + SR", rec(scaling="token", stochastic_rounding=True), 0),
               ("rht + SR", rec(rht=True, stochastic_rounding=True), 0),
               ("token + rht + SR", rec(scaling="token", rht=True, stochastic_rounding=True), 0),
               ("2d (16, 16)", rec(block=(16, 16)), 0),
               ("2d (16, 16), recipe kernel", rec(block=(16, 16)), -1),
               ("window64", rec(scaling="window64"), 0)]
        out += [(f"4over6 {fos}{' fast_math' if fast else ''}",
                 rec(four_over_six=fos, fast_math=fast), 0)
                for fos in ("mae", "mse") for fast in (False, True)]
        return out + [("grouped N=8 (uneven)", rec(), 8)]
    recipe = rec(scaling="window64" if args.window64 else args.scaling,
                 block=(16, 16) if args.block2d else (1, 16), rht=args.rht,
                 stochastic_rounding=args.sr, four_over_six=args.four_over_six,
                 fast_math=args.fast_math)
    out = [("recipe", recipe, 0)]
    if args.grouped:
        out.append((f"grouped N={args.grouped} (uneven)", recipe, args.grouped))
        if args.ragged:
            out.append((f"grouped N={args.grouped} (ragged)", recipe, (args.grouped, True)))
    return out


def grouped_host_rows(recipe: Recipe, group_counts, dtype, calls: int = 300, k: int = 256,
                      rows_per_group: int = 96):
    """Host microseconds per quantize_grouped call on an input of K columns and rows_per_group
    rows per group on average (by default small: the GPU work is a few microseconds; at MoE
    sizes the cached calls' times may be the GPU's) split at random multiples of 16
    rows (64 for window64), per number of groups: the same split sizes every call (the plan
    cached: allocations, two launches, the GroupedNVFP4Tensor), new split sizes every call (a
    plan built per call: its tables made and copied to the device, and the call), each alone
    and with every group's NVFP4Tensor views made (`.groups()`, what a consumer of the groups
    one by one pays), and one quantize_recipe of the same input. Best of 3 means over `calls`
    calls (the device host's timing noise is one-sided); new sizes: `calls` distinct splits
    per repetition, the plan cache cleared before each."""
    import random
    import time

    from ..quant import recipes_dispatch as rd

    unit = 64 if recipe.scaling == "window64" else 16
    rows = []
    for n in group_counts:
        m = rows_per_group * n
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        rnd = random.Random(n)

        def splits(count):  # distinct splits of m rows into n nonempty groups
            out = set()
            while len(out) < count:
                cuts = sorted(rnd.sample(range(1, m // unit), n - 1))
                out.add(tuple(unit * (b - a) for a, b in zip([0] + cuts, cuts + [m // unit])))
            return [list(t) for t in out]

        def call(sizes):
            return rd.quantize_grouped(x, sizes, recipe)

        def with_views(sizes):
            return rd.quantize_grouped(x, sizes, recipe).groups()

        row = {"groups": n, "rows": m, "K": k}
        sizes = splits(1)[0]
        for what, fn in (("", call), (" + views", with_views)):
            row["cached sizes" + what] = min(host_overhead_us(lambda: fn(sizes), calls)
                                             for _ in range(3))
        for what, fn in (("", call), (" + views", with_views)):
            new = float("inf")
            for _ in range(3):
                todo = splits(calls)
                rd._plan.cache_clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for t in todo:
                    fn(t)
                new = min(new, (time.perf_counter() - start) / calls * 1e6)
                torch.cuda.synchronize()
            row["new sizes" + what] = new
        row["one quantize_recipe"] = min(host_overhead_us(lambda: rd.quantize_recipe(x, recipe),
                                                          calls) for _ in range(3))
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf quant_recipes")
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
    p.add_argument("--ragged", action="store_true",
                   help="with --grouped: also groups off multiples of 128 rows (by 16-row steps)")
    p.add_argument("--suite", action="store_true", help="every recipe of issues 4 and 5")
    p.add_argument("--rowwise-only", action="store_true")
    p.add_argument("--swizzle", action="store_true", help="scales in the 128x4 layout")
    p.add_argument("--modes", nargs="*", default=["graph", "eager"],
                   help="graph: CUDA-graph replay (GPU time); eager: with host overhead")
    p.add_argument("--json", default=None)
    p.add_argument("--host-only", action="store_true",
                   help="with --grouped: only the host-time table")
    p.add_argument("--host-k", type=int, default=256, help="the host-time table's K")
    p.add_argument("--host-rows", type=int, default=96,
                   help="the host-time table's rows per group (on average)")
    args = p.parse_args(argv)
    if args.ragged and not args.grouped:
        p.error("--ragged needs --grouped N")
    if args.host_only and not args.grouped:
        p.error("--host-only needs --grouped N")
    if args.host_k <= 0 or args.host_k % 64:
        p.error("--host-k must be a positive multiple of 64")
    if args.host_rows < 64:
        p.error("--host-rows must be at least 64 (groups split at multiples of 16 or 64 rows)")

    from ..ops import quantize_impl
    from ..quant.dispatch import quantize as plain
    from ..quant.recipes_dispatch import quantize_grouped, quantize_recipe

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    todo = cases(args)
    host_title = (f"Host time per grouped call, us, {todo[0][1]} ({args.dtype}), "
                  f"{torch.cuda.get_device_name()}")
    if args.host_only:
        report(grouped_host_rows(todo[0][1], _host_groups(args.grouped), dtype, k=args.host_k,
                                 rows_per_group=args.host_rows), host_title, args.json)
        return 0
    copy_bw = copy_bandwidth_gbs()
    rows = []
    shapes = [(m, k) for m in args.m for k in args.k]
    for i, (m, k) in enumerate(shapes, 1):
        progress(i, len(shapes), f"M={m} K={k}")
        # graph replays rotate over distinct inputs (no call reads its input from L2 after the
        # previous call), as in `perf quant`
        xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(GRAPH_INPUTS)]
        x = xs[0]
        for mode in args.modes:
            def bench(f, mode=mode):
                if mode == "graph":
                    return bench_graph_ms([lambda xi=xi: f(xi) for xi in xs])
                return bench_ms(lambda: f(x))
            plain_ms, single_ms = {}, {}

            def row(label, recipe, ms, vs_plain, vs_one):
                floor_ms = floor_bytes(m, k, x.element_size(), recipe) / copy_bw / 1e6
                rows.append({"M": m, "K": k, "mode": mode, "kernel": label,
                             "time_us": ms * 1e3, "%floor": 100 * floor_ms / ms,
                             "vs plain": vs_plain, "vs 1 launch": vs_one})

            for label, recipe, groups in todo:
                base = _plain_recipe(recipe)
                if base not in plain_ms:
                    plain_ms[base] = bench(lambda xi: plain(xi, base))
                    row(f"plain cast ({base.scaling})", base, plain_ms[base], 1.0, float("nan"))
                groups, ragged = groups if isinstance(groups, tuple) else (groups, False)
                if groups > 0:
                    if recipe not in single_ms:
                        single_ms[recipe] = bench(lambda xi: quantize_recipe(xi, recipe, seed=1))
                    sizes = _splits(m, groups, 64 if recipe.scaling == "window64" else 16, ragged)
                    ms = bench(lambda xi: quantize_grouped(xi, sizes, recipe, seed=1))
                    row(label, recipe, ms, ms / plain_ms[base], ms / single_ms[recipe])
                elif groups < 0:
                    ms = bench(lambda xi: quantize_recipe(xi, recipe, seed=1))
                    single_ms[recipe] = ms
                    row(label, recipe, ms, ms / plain_ms[base], float("nan"))
                else:
                    ms = bench(lambda xi: quantize_impl(xi, recipe, 1, 0))
                    row(label, recipe, ms, ms / plain_ms[base], float("nan"))
    what = "every recipe" if args.suite else str(todo[0][1])
    title = (f"NVFP4 recipe quantize, {what} ({args.dtype}, "
             f"{'row' if args.rowwise_only else 'row+col'}), {torch.cuda.get_device_name()}, "
             f"copy bandwidth {copy_bw:.0f} GB/s")
    report(rows, title, args.json)
    if args.grouped:
        print()
        host_json = args.json and os.path.splitext(args.json)[0] + "_host.json"
        report(grouped_host_rows(todo[0][1], _host_groups(args.grouped), dtype, k=args.host_k,
                                 rows_per_group=args.host_rows), host_title, host_json)
    return 0


def _host_groups(n: int):
    """The group counts of the host-time table: n and ROW_GROUPS_MAX."""
    from ..quant.recipes_dispatch import ROW_GROUPS_MAX

    return sorted({n, ROW_GROUPS_MAX})


if __name__ == "__main__":
    raise SystemExit(main())
