"""`python -m cute_fp4.perf linear [--fwd|--bwd] [--shapes seed|deepseek|all] [--json F]`.

Times `cute_fp4.nn.Linear` (per-tensor and per-token recipes) against a BF16 `torch.nn.Linear`
of the same shape in the same run: forward, or forward + backward, eager and CUDA-graph replay,
and the host time an eager step spends enqueueing (`host ms`, measured with the GPU busy: where
it exceeds the graph time, eager steps are host-bound). Ratios < 1 mean NVFP4 is faster.
Target (SPEC 5): fwd+bwd <= 1.3x BF16 at 16384x7168 -> 2048 (per-token recipe).
"""

from __future__ import annotations

import argparse

import torch

from .. import api
from ..nn import Linear, LinearRecipe, _with_outputs
from .common import bench_graph_ms, bench_ms, host_ms_gpu_busy, progress, report

SEED_SHAPES = [(m, k, k) for m in (1024, 4096, 16384, 32768) for k in (2048, 4096, 8192)]
DEEPSEEK_SHAPES = [(m, 7168, 2048) for m in (16384, 32768, 65536, 98304)]
RECIPES = {"per-tensor": LinearRecipe.per_tensor, "per-token": LinearRecipe.per_token}


def _step(module, x, g, backward: bool):
    if not backward:
        def fwd():
            with torch.no_grad():
                module(x)
        return fwd

    def fwd_bwd():
        x.grad = None
        module.weight.grad = None
        module(x).backward(g)
    return fwd_bwd


def _time(module, x, g, backward: bool, graphs: bool):
    fn = _step(module, x, g, backward)
    eager = bench_ms(fn)
    graph = None
    if graphs:
        try:
            graph = bench_graph_ms(fn)
        except (RuntimeError, NotImplementedError) as e:
            graph = f"n/a ({type(e).__name__}: {str(e)[:60]})"
    return eager, graph, host_ms_gpu_busy(fn)


def run(shapes, backward: bool, graphs: bool):
    rows = []
    for i, (m, k, n) in enumerate(shapes, 1):
        progress(i, len(shapes), f"M={m} K={k} N={n}")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        base = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        bf16_eager, bf16_graph, bf16_host = _time(base, x, g, backward, graphs)
        row = {"M": m, "K": k, "N": n, "bf16 ms": bf16_eager}
        if graphs:
            row["bf16 graph ms"] = bf16_graph
        row["bf16 host ms"] = bf16_host
        per_tensor_ms = None
        for name, make in RECIPES.items():
            q = Linear.from_linear(base, make(stochastic_rounding=backward))
            try:
                eager, graph, host = _time(q, x, g, backward, graphs)
            except NotImplementedError as e:
                row[f"{name} ms"] = f"n/a: {e}"[:60]
                continue
            row[f"{name} ms"] = eager
            if graphs:
                row[f"{name} graph ms"] = graph
            row[f"{name} host ms"] = host
            row[f"{name} / bf16"] = eager / bf16_eager
            if name == "per-tensor":
                per_tensor_ms = eager
            elif per_tensor_ms is not None:
                row[f"{name} / per-tensor"] = eager / per_tensor_ms
            if graphs:  # a failed capture shows its reason instead of a ratio
                both = isinstance(graph, float) and isinstance(bf16_graph, float)
                row[f"{name} graph / bf16 graph"] = (graph / bf16_graph if both
                                                     else graph if isinstance(graph, str)
                                                     else bf16_graph)
        rows.append(row)
    return rows


def breakdown(m: int, k: int, n: int, recipe_name: str):
    """Milliseconds of each step of one training step (eager), next to the BF16 GEMM of the
    same role: where the time of `Linear` goes. The weight quantization is cached across steps
    by `Linear` while the weight does not change; a real training step pays it once."""
    recipe = RECIPES[recipe_name]()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rng = torch.tensor([0, 0], dtype=torch.int64, device="cuda")
    x_recipe = _with_outputs(recipe.activation, True, True)
    w_recipe = _with_outputs(recipe.weight, True, True)
    dy_recipe = _with_outputs(recipe.grad, True, True)
    xq, wq = api.quantize(x, x_recipe), api.quantize(w, w_recipe)
    dyq = api.quantize(dy, dy_recipe, rng_state=rng)
    steps = [
        ("quantize x (row+col)", lambda: api.quantize(x, x_recipe), None),
        ("quantize w (row+col)", lambda: api.quantize(w, w_recipe), None),
        ("quantize dy (row+col) + bias grad",
         lambda: api.quantize_dbias(dy, dy_recipe, rng_state=rng), lambda: dy.sum(0)),
        ("fprop x.wT", lambda: api.gemm(xq, wq, out_dtype=torch.bfloat16), lambda: x @ w.t()),
        ("dgrad dy.w", lambda: api.gemm(dyq, wq.t(), out_dtype=torch.bfloat16), lambda: dy @ w),
        ("wgrad dyT.x", lambda: api.gemm(dyq.t(), xq.t(), out_dtype=torch.bfloat16),
         lambda: dy.t() @ x),
    ]
    rows = []
    for name, ours, bf16 in steps:
        row = {"step": name, f"{recipe_name} ms": bench_ms(ours)}
        if bf16 is not None:
            row["bf16 ms"] = bench_ms(bf16)
            row["ratio"] = row[f"{recipe_name} ms"] / row["bf16 ms"]
        rows.append(row)
    total = sum(r[f"{recipe_name} ms"] for r in rows)
    bf16_total = sum(r.get("bf16 ms", 0.0) for r in rows)
    rows.append({"step": "sum", f"{recipe_name} ms": total, "bf16 ms": bf16_total,
                 "ratio": total / bf16_total})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf linear", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--fwd", action="store_true", help="forward only (no_grad)")
    mode.add_argument("--bwd", action="store_true", help="forward + backward (default)")
    p.add_argument("--shapes", choices=("seed", "deepseek", "all", "target"), default="target",
                   help="target: the SPEC 5 shape 16384x7168->2048 only")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph column")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each quantize and GEMM of one step (eager)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    shapes = {"seed": SEED_SHAPES, "deepseek": DEEPSEEK_SHAPES,
              "all": SEED_SHAPES + DEEPSEEK_SHAPES, "target": [(16384, 7168, 2048)]}[args.shapes]
    backward = not args.fwd
    rows = run(shapes, backward, graphs=not args.no_graphs)
    what = "forward + backward" if backward else "forward"
    report(rows, f"NVFP4 Linear vs BF16 nn.Linear, {what} ({torch.cuda.get_device_name()})",
           args.json)
    if args.breakdown:
        for m, k, n in shapes:
            for name in RECIPES:
                print()
                report(breakdown(m, k, n, name),
                       f"Where the time goes: {name}, {m}x{k} -> {n}, one training step")
    return 0
