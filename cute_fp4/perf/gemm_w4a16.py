"""`python -m cute_fp4.perf gemm_w4a16`: the sm_90 W4A16 GEMM vs cuBLAS (16-bit weights) and
dequantize-then-cuBLAS.

Per shape (M x N x K), in one process: cuBLAS (torch.matmul, 16-bit weights of the
activations' dtype; the column keeps the name cublas_bf16), dequantize-then-cuBLAS
(cute_fp4.dequantize of the NVFP4 weights every call, then torch.matmul) and the W4A16 kernel
that `cute_fp4.gemm` dispatches to (the weight-streaming gemm_w4a16_sm90 where
`dispatch.stream_weights` says so, the mixed wgmma gemm_mixed_sm90 otherwise, column
"kernel"; BF16 activations unless --act-dtype fp16, swizzled scales, output in the
activations' dtype), each eager (do_bench flushes L2 before every call) and replayed from a
CUDA graph that rotates over distinct weight matrices (column "graph sets", enough to fill
four times the L2: a decode step does not find its layer's weights in L2). Reports microseconds,
speedups over cuBLAS of the same mode and the W4A16 kernel's weight bandwidth (packed bytes +
scales, GB/s). Column "cute_fp4.gemm": the public call on the same weights as a per-tensor
NVFP4Tensor (its alpha decoded from the amax in the kernel's epilogue), i.e. what a user's
call costs beyond the kernel (automatic configuration only). `--window64`: the weights are
Recipe(scaling="window64", swizzle=True) quantizes of random BF16 (1x64 local-encode outer
scales), the W4A16 GEMM is `cute_fp4.gemm(x, w)` (column "kernel": the kernel of
`dispatch.gemm_w4a16`'s "auto" path, stream or mixed; GB/s count the window amaxes too),
dequantize-then-cuBLAS dequantizes those weights, and columns "stream" / "mixed" time
`gemm_w4a16`'s explicit paths.
"""

from __future__ import annotations

import argparse
import functools
from typing import List

import torch

from .common import graph_sets, progress, report, timing_modes

DECODE_M = [1, 16, 32, 64]
DECODE_NK = [(8192, 8192), (28672, 8192)]
PREFILL = [(512, 8192, 8192)]


def bench_configs(m: int, n: int, k: int, graphs: bool, configs,
                  act_dtype: torch.dtype = torch.bfloat16) -> List[dict]:
    """One row per W4A16 configuration (None: automatic), the baselines timed once."""
    from ..api import gemm as api_gemm
    from ..gemm.dispatch import W4A16_MAX_DECODE_ROWS, stream_weights
    from ..gemm.sm90_mixed import gemm_mixed_sm90
    from ..gemm.sm90_w4a16 import gemm_w4a16_sm90
    from ..recipe import Recipe
    from ..ref.swizzle import swizzle_scales
    from ..tensor import NVFP4Tensor
    from .gemm import _dequantize_fn

    if m > W4A16_MAX_DECODE_ROWS and configs != [None]:
        raise ValueError(f"--config sets the decode kernel (M <= {W4A16_MAX_DECODE_ROWS}), "
                         f"got M = {m}")
    stream = configs != [None] or stream_weights(m)
    a = torch.randn(m, k, device="cuda", dtype=act_dtype)
    out = torch.empty(m, n, dtype=act_dtype, device="cuda")
    amax = torch.full((1,), 3.0, device="cuda")
    weight_bytes = n * (k // 2) + n * (k // 16)
    weights = []  # graph mode rotates over these (graph_sets): no call finds its weights in L2
    for _ in range(graph_sets(weight_bytes)):
        b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        sb_c = torch.exp2(torch.rand(n, k // 16, device="cuda") * 4 - 2).to(torch.float8_e4m3fn)
        weights.append((b, sb_c, swizzle_scales(sb_c)))
    b16s = [torch.randn(n, k, device="cuda", dtype=act_dtype)
            for _ in range(graph_sets(n * k * a.element_size()))]
    deq_bs = [_dequantize_fn(b, sb_c, act_dtype) for b, sb_c, _ in weights]
    base = {
        "cublas_bf16": [lambda b16=b16: torch.matmul(a, b16.t()) for b16 in b16s],
        "dequant+cublas": [lambda deq_b=deq_b: torch.matmul(a, deq_b().t()) for deq_b in deq_bs],
    }
    rows = []
    for config in configs:
        row = {"M": m, "N": n, "K": k, "act": str(act_dtype).replace("torch.", ""),
               "kernel": "stream" if stream else "mixed", "graph sets": len(weights)}
        if len(configs) > 1:
            row["config"] = ",".join(map(str, config)) if config else "auto"
        rows.append(row)

    def api(b, sb):
        """cute_fp4.gemm of the weights as a per-tensor NVFP4Tensor (amax 3: alpha != 1), the
        call a user makes: its epilogue decodes the amax in the kernel."""
        t = NVFP4Tensor(b, sb, amax, None, None, None, Recipe(swizzle=True, columnwise=False),
                        (n, k), act_dtype)
        return lambda: api_gemm(a, t, out_dtype=act_dtype)

    def w4a16(b, sb, config):
        if stream:
            return lambda: gemm_w4a16_sm90(a, b, sb, scales_swizzled=True, out=out,
                                           config=config, out_dtype=act_dtype)
        return lambda: gemm_mixed_sm90(b, sb, a, scales_swizzled=True, out=out,
                                       out_dtype=act_dtype)

    for mode, timer in timing_modes(graphs):
        base_ms = {name: timer(fns) for name, fns in base.items()}
        for config, row in zip(configs, rows):
            ms = dict(base_ms)
            ms["w4a16"] = timer([w4a16(b, sb, config) for b, _, sb in weights])
            if config is None:
                ms["cute_fp4.gemm"] = timer([api(b, sb) for b, _, sb in weights])
                row[f"cute_fp4.gemm/cublas {mode}"] = ms["cublas_bf16"] / ms["cute_fp4.gemm"]
            for name, t in ms.items():
                row[f"{name} {mode} us"] = t * 1e3
            row[f"w4a16/cublas {mode}"] = ms["cublas_bf16"] / ms["w4a16"]
            row[f"w4a16/dequant+cublas {mode}"] = ms["dequant+cublas"] / ms["w4a16"]
            row[f"w4a16 {mode} GB/s"] = weight_bytes / ms["w4a16"] / 1e6
    del b16s
    return rows


def bench_window64(m: int, n: int, k: int, graphs: bool) -> List[dict]:
    """One row: cute_fp4.gemm of BF16 activations and window64 weights vs the baselines."""
    from .. import dequantize, gemm, quantize
    from ..gemm.dispatch import gemm_w4a16, stream_weights
    from ..recipe import Recipe

    # swizzled scales, as nn.Linear and convert make them (compact ones are swizzled per call
    # on the mixed path: one more launch)
    recipe = Recipe(scaling="window64", columnwise=False, swizzle=True)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight_bytes = n * (k // 2) + n * (k // 16) + n * (k // 64) * 4
    weights = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), recipe)
               for _ in range(graph_sets(weight_bytes))]
    b16s = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(graph_sets(n * k * 2))]
    fns = {
        "cublas_bf16": [lambda b16=b16: torch.matmul(a, b16.t()) for b16 in b16s],
        "dequant+cublas": [lambda w=w: torch.matmul(a, dequantize(w).t()) for w in weights],
        "w4a16": [lambda w=w: gemm(a, w) for w in weights],
    }
    for path in ("stream", "mixed"):
        fns[path] = [functools.partial(gemm_w4a16, a, w.data, w.scales,
                                       scales_swizzled=w.recipe.swizzle, b_window_amax=w.amax,
                                       e4m3_max=w.recipe.e4m3_max, path=path) for w in weights]
    row = {"M": m, "N": n, "K": k, "act": "bfloat16",
           "kernel": "stream" if stream_weights(m) else "mixed",
           "graph sets": len(weights)}
    for mode, timer in timing_modes(graphs):
        ms = {name: timer(f) for name, f in fns.items()}
        for name, t in ms.items():
            row[f"{name} {mode} us"] = t * 1e3
        row[f"w4a16/cublas {mode}"] = ms["cublas_bf16"] / ms["w4a16"]
        row[f"w4a16/dequant+cublas {mode}"] = ms["dequant+cublas"] / ms["w4a16"]
        row[f"w4a16 {mode} GB/s"] = weight_bytes / ms["w4a16"] / 1e6
        for path in ("stream", "mixed"):
            row[f"w4a16/{path} {mode}"] = ms[path] / ms["w4a16"]
    return [row]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf gemm_w4a16", description=__doc__)
    p.add_argument("--shapes", type=str, default=None,
                   help="comma-separated MxNxK list instead of the default shapes")
    p.add_argument("--no-prefill", action="store_true", help="decode shapes only")
    p.add_argument("--no-graphs", action="store_true", help="eager timings only")
    p.add_argument("--config", type=str, default=None,
                   help="tile_m,row_tiles,k_warps,unroll,row_warps of the decode kernel for "
                        "every shape (default: automatic); several separated by ';' give one row "
                        "each (a sweep)")
    p.add_argument("--act-dtype", choices=("bf16", "fp16"), default="bf16",
                   help="activation (and output, cuBLAS weight) dtype")
    p.add_argument("--window64", action="store_true",
                   help="window64 (1x64 local-encode) weights through cute_fp4.gemm")
    p.add_argument("--json", type=str, default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.window64 and (args.config or args.act_dtype != "bf16"):
        raise SystemExit("--window64 takes neither --config nor --act-dtype fp16")
    act_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.act_dtype]
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = [(m, n, k) for (n, k) in DECODE_NK for m in DECODE_M]
        if not args.no_prefill:
            shapes += PREFILL
    configs = ([tuple(int(x) for x in c.split(",")) for c in args.config.split(";")]
               if args.config else [None])
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        progress(i, len(shapes), f"{m}x{n}x{k}")
        rows += (bench_window64(m, n, k, not args.no_graphs) if args.window64
                 else bench_configs(m, n, k, not args.no_graphs, configs, act_dtype))
        torch.cuda.empty_cache()
    progress(len(shapes), len(shapes), "done")
    report(rows, f"W4A16 GEMM on {torch.cuda.get_device_name()}", args.json)
    return 0
