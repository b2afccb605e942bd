"""`python -m cute_fp4.perf quant`: NVFP4 quantize (amax + K2 cast) bandwidth sweep.

Columns: time, GB/s of the unavoidable bytes, % of the HBM floor (unavoidable bytes / copy
bandwidth measured in this run: the input is read twice, once for the amax and once for the
cast, except per-token rowwise only, which finds each row's amax and casts the row in one pass
(quant/token_rows.py): once; every output is written once), speedup over torch.compile of the
reference quantizer.
Eager times flush L2 before each call (do_bench); graph replays take 3 distinct inputs in turn,
so a call can find in L2 only what its own amax pass left there (the cast reads that part
first: quant/cast.py), never its input from the previous call.

A second table gives the host time per call on a tiny input (16 x 64, rowwise), the best of
5 means over 2000 back-to-back calls (the device host's timing noise is one-sided): one
compiled kernel called through TVM-FFI with prebuilt arguments (the fused cast; per token
TokenRowCast), the CUDA quantize
(`quant.dispatch.quantize`: allocation, views, and for this size the ONE launch of the cast
with its fused amax; larger inputs: amax kernel, per-token zero-fill, cast) and the public
`cute_fp4.quantize`, and the same writing into the buffers of an earlier result (`out=`: no
allocation, no views). `--host-only` prints just this table.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..recipe import Recipe
from .common import (GRAPH_INPUTS, bench_graph_ms, bench_ms, copy_bandwidth_gbs,
                     host_overhead_us, progress, report)

M_DEFAULT = [1024, 2048, 4096, 8192, 16384, 32768]
K_DEFAULT = [2048, 4096, 8192]


def floor_bytes(m: int, k: int, elem: int, rowwise: bool, columnwise: bool,
                reads: int = 2) -> int:
    """Unavoidable bytes: the input read `reads` times (twice: an amax pass, then the cast;
    once: per-token rowwise only, whose rows are cast in the pass that finds their amax),
    every output written once."""
    outputs = (int(rowwise) + int(columnwise)) * (m * k // 2 + m * k // 16)
    return reads * m * k * elem + outputs


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf quant")
    p.add_argument("--m", type=int, nargs="*", default=M_DEFAULT)
    p.add_argument("--k", type=int, nargs="*", default=K_DEFAULT)
    p.add_argument("--scaling", nargs="*", default=["tensor", "token"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--modes", nargs="*", default=["eager", "graph"])
    p.add_argument("--baseline", default="compile", choices=["compile", "none"],
                   help="torch.compile of the reference quantizer as the baseline (slow to build)")
    p.add_argument("--swizzle", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--host-only", action="store_true",
                   help="only the host-time table (no bandwidth sweep)")
    args = p.parse_args(argv)

    from ..quant import dispatch
    from ..quant.dispatch import quantize
    from .. import ref

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.host_only:
        overhead = host_overhead_rows(dtype, args.scaling)
        report(overhead, "Host time per call on 16x64 (rowwise), us")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(),
                           "host_overhead_us": overhead}, f, indent=1)
        return 0
    copy_bw = copy_bandwidth_gbs()
    compiled_ref = torch.compile(ref.quantize) if args.baseline == "compile" else None
    rows = []
    combos = [(m, k, s, rw, cw) for m in args.m for k in args.k for s in args.scaling
              for rw, cw in ((True, False), (True, True))]
    for i, (m, k, scaling, rw, cw) in enumerate(combos, 1):
        progress(i, len(combos), f"M={m} K={k} {scaling} {'row+col' if cw else 'row'}")
        # graph replays rotate over distinct inputs: the cast reads its input right after the
        # amax pass (part of it from L2), never the previous call's
        xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(GRAPH_INPUTS)]
        x = xs[0]
        recipe = Recipe(scaling=scaling, rowwise=rw, columnwise=cw, swizzle=args.swizzle)
        fn = lambda: quantize(x, recipe)  # noqa: E731
        base_ms = None
        if compiled_ref is not None:
            base_ms = bench_ms(lambda: compiled_ref(x, recipe))
        reads = 1 if dispatch.plan_for(x, recipe).token_rows is not None else 2
        nbytes = floor_bytes(m, k, x.element_size(), rw, cw, reads)
        floor_ms = nbytes / copy_bw / 1e6
        for mode in args.modes:
            ms = (bench_ms(fn) if mode == "eager" else
                  bench_graph_ms([lambda xi=xi: quantize(xi, recipe) for xi in xs]))
            rows.append({
                "M": m, "K": k, "scaling": scaling, "outputs": "row+col" if cw else "row",
                "mode": mode, "time_us": ms * 1e3, "GB/s": nbytes / ms / 1e6,
                "%floor": 100 * floor_ms / ms,
                "vs_compile": (base_ms / ms) if base_ms is not None else float("nan"),
            })
        del x, xs
    title = (f"NVFP4 quantize ({args.dtype}, {'swizzled' if args.swizzle else 'compact'} scales), "
             f"{torch.cuda.get_device_name()}, copy bandwidth {copy_bw:.0f} GB/s")
    report(rows, title)
    overhead = host_overhead_rows(dtype, args.scaling)
    print()
    report(overhead, "Host time per call on 16x64 (rowwise), us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "device": torch.cuda.get_device_name(), "rows": rows,
                       "host_overhead_us": overhead}, f, indent=1)
    return 0


def host_overhead_rows(dtype, scalings):
    """Per scaling: host microseconds of the bare kernel call (TVM-FFI, the plan's function:
    the fused cast, or per token TokenRowCast), of quant.dispatch.quantize and of
    cute_fp4.quantize on a 16x64 input, fresh outputs and `out=` an earlier result; "path"
    says which the dispatch takes (TokenRowCast or the fused cast: one launch; or amax kernel
    + cast)."""
    import cute_fp4
    from ..quant import dispatch

    x = torch.randn(16, 64, device="cuda", dtype=dtype)
    def best_us(fn, repeats=5):
        return min(host_overhead_us(fn) for _ in range(repeats))

    rows = []
    for scaling in scalings:
        recipe = Recipe(scaling=scaling)
        t = dispatch.quantize(x, recipe)
        plan = dispatch.plan_for(x, recipe)
        amax = torch.zeros(plan.n_amax, device="cuda")
        amax_r, amax_c = (amax[:16], amax[16:]) if scaling == "token" else (amax, amax)
        if plan.token_rows is not None:
            path = "rows (1 launch)"
            kernel = lambda: plan.token_rows(x, amax_r, t.data, t.scales, None, None)  # noqa: E731
        else:
            path = "fused (1 launch)" if plan.fused else "amax + cast"
            kernel = lambda: plan.cast(x, amax_r, amax_c, t.data, t.scales,  # noqa: E731
                                       plan.dummy, plan.dummy_f8, None)
        rows.append({
            "scaling": scaling,
            "path": path,
            "kernel call (TVM-FFI)": best_us(kernel),
            "quant.dispatch.quantize": best_us(lambda: dispatch.quantize(x, recipe)),
            "cute_fp4.quantize": best_us(lambda: cute_fp4.quantize(x, recipe)),
            "cute_fp4.quantize(out=)": best_us(lambda: cute_fp4.quantize(x, recipe, out=t)),
        })
    return rows
