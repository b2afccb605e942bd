"""`python -m cute_fp4.perf gemm`: NVFP4 GEMM vs cuBLAS BF16 and dequantize-then-cuBLAS.

Per shape (M x N x K), in one process: cuBLAS BF16 (torch.matmul on BF16 operands),
dequantize-then-cuBLAS (cute_fp4.dequantize of both NVFP4 operands, then torch.matmul) and the
NVFP4 GEMM (gemm_nvfp4, swizzled scales, BF16 out, path "auto": "weight_stream" when
min(M, N) <= 16, else "predecode"), each eager (do_bench flushes L2 before every call) and
replayed from a CUDA graph that rotates over distinct operands (column "graph sets": enough
to fill four times the L2, at most 8). `--paths` adds
gemm_nvfp4 with named paths (e.g. predecode,weight_stream: both at the decode sizes);
`--variants` adds the "decode_both" kernel (sm90_w4a4) and the predecode path's GEMM kernel
alone (its predecoded BF16 operand made once, outside the timing). `--window64` times
1x64 local-encode operands instead (Recipe(scaling="window64", swizzle=True) quantizes of
random BF16, both operands): the NVFP4 GEMM is then `cute_fp4.gemm(a, b)` (the "window" path), dequantize-then-
cuBLAS dequantizes them with `cute_fp4.dequantize`, and "decode_both" is gemm_nvfp4's slower
window64 kernel; `--window64 weights` quantizes only B window64 and A per token (inference
with window64 weights: `cute_fp4.gemm` takes the weight_stream path at decode sizes, else
predecode with the weights in registers), and times gemm_nvfp4's "window" path instead of
"decode_both" (column "window"). TFLOP/s count 2*M*N*K; ratios are against cuBLAS BF16 (and
dequantize-then-cuBLAS) of the same mode.
"""

from __future__ import annotations

import argparse
import functools
from typing import Tuple

import torch

from .common import graph_sets, progress, report, timing_modes

MAIN_SHAPES = [(8192, 8192, 8192), (16384, 2048, 7168), (4096, 4096, 4096)]
SWEEP_M = [1024, 2048, 4096, 8192, 16384, 32768]
SWEEP_NK = [2048, 4096, 8192]
# the decode sizes (W4A4 with freshly quantized activations, the "weight_stream" path;
# W4A16 has its own bench)
DECODE_SHAPES = [(m, n, k) for (n, k) in ((8192, 8192), (28672, 8192)) for m in (1, 16, 64)]


def _operands(m: int, n: int, k: int):
    from ..ref.swizzle import swizzle_scales

    def op(rows):
        data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device="cuda")
        sc = torch.exp2(torch.rand(rows, k // 16, device="cuda") * 4 - 2).to(torch.float8_e4m3fn)
        return data, sc, swizzle_scales(sc)

    return op(m), op(n)


def _dequantize_fn(data, scales, dtype=torch.bfloat16):
    """Dequantize to `dtype` with the package's GPU kernel (cute_fp4.dequantize of a per-tensor
    NVFP4Tensor whose amax makes S_enc = 1, i.e. the values e2m1 * scale)."""
    from .. import dequantize
    from ..recipe import Recipe
    from ..tensor import NVFP4Tensor

    rows, k = data.shape[0], data.shape[1] * 2
    amax = torch.full((1,), 448.0 * 6.0, device=data.device)
    t = NVFP4Tensor(data=data, scales=scales, amax=amax, data_t=None, scales_t=None,
                    amax_t=None, recipe=Recipe(swizzle=False), shape=(rows, k),
                    dtype=dtype)
    return lambda: dequantize(t, dtype)


def _kernel_only_fn(a, sa, b, sb, out):
    """The predecode path's GEMM kernel with its BF16 operand decoded once in advance."""
    from ..common.jit import device_arch
    from ..gemm.dispatch import predecode_operands, predecode_swap
    from ..gemm.sm90_mixed import UNSCALE_W4A4, launch_mixed

    arch = device_arch(a.device)
    swap = predecode_swap(a.shape[0], b.shape[0])
    x, sx, y16 = predecode_operands(a, sa.view(torch.uint8).reshape(-1), b,
                                    sb.view(torch.uint8).reshape(-1), arch, swap)
    return lambda: launch_mixed(x, sx, y16, out, None, None, None, None, transposed=swap,
                                unscale_exp=UNSCALE_W4A4, arch=arch)


def _window64_fns(m: int, n: int, k: int, sets: int, which: str) -> dict:
    """dequantize-then-cuBLAS and cute_fp4.gemm on `sets` distinct pairs of window64 operands
    (which: "both", or "weights": A per token), and gemm_nvfp4's other window64 kernel
    ("decode_both"; with "weights" the "window" path)."""
    from .. import dequantize, gemm, quantize
    from ..common.jit import device_arch
    from ..gemm.dispatch import gemm_nvfp4
    from ..gemm.factors import epilogue_operands
    from ..recipe import Recipe

    # swizzled scales, as nn.Linear and convert make them (compact ones are swizzled per call
    # on the predecode and window paths: one more launch)
    recipe = Recipe(scaling="window64", columnwise=False, swizzle=True)
    a_recipe = (recipe if which == "both"
                else Recipe(scaling="token", columnwise=False, swizzle=True))
    pairs = [tuple(quantize(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), r)
                   for rows, r in ((m, a_recipe), (n, recipe))) for _ in range(sets)]
    fns = {
        "dequant+cublas": [lambda a=a, b=b: torch.matmul(dequantize(a), dequantize(b).t())
                           for a, b in pairs],
        "nvfp4": [functools.partial(gemm, a, b) for a, b in pairs],
    }
    if which == "both":
        fns["decode_both"] = [functools.partial(gemm_nvfp4, a.data, a.scales, b.data, b.scales,
                                                scales_swizzled=True, a_window_amax=a.amax,
                                                b_window_amax=b.amax, path="decode_both")
                              for a, b in pairs]
    else:
        arch = device_arch(pairs[0][0].data.device)
        fns["window"] = [functools.partial(
            gemm_nvfp4, a.data, a.scales, b.data, b.scales, scales_swizzled=True,
            row=epilogue_operands("token", a.amax, 448, "window64", b.amax, 448, arch)[1],
            b_window_amax=b.amax, path="window") for a, b in pairs]
    return fns


def bench_shape(m: int, n: int, k: int, graphs: bool, variants: bool = False,
                paths: Tuple[str, ...] = (), window64: str = "") -> dict:
    from ..gemm.dispatch import gemm_nvfp4

    # graph mode rotates over distinct operand sets (graph_sets): no call finds its operands
    # in L2 from the calls before
    n_sets = graph_sets((m + n) * (k // 2 + k // 16))
    sets = [] if window64 else [_operands(m, n, k) for _ in range(n_sets)]
    sets16 = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
               torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
              for _ in range(graph_sets((m + n) * k * 2))]
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def each(make):
        return [make(a, sa, b, sb) for (a, _, sa), (b, _, sb) in sets]

    fns = {
        "cublas_bf16": [lambda a16=a16, b16=b16: torch.matmul(a16, b16.t())
                        for a16, b16 in sets16],
        "dequant+cublas": [
            lambda deq_a=_dequantize_fn(a, sa_c), deq_b=_dequantize_fn(b, sb_c):
            torch.matmul(deq_a(), deq_b().t()) for (a, sa_c, _), (b, sb_c, _) in sets],
        "nvfp4": each(lambda a, sa, b, sb: functools.partial(
            gemm_nvfp4, a, sa, b, sb, scales_swizzled=True, out=out)),
    }
    if window64:
        fns.update(_window64_fns(m, n, k, n_sets, window64))
    for path in paths:
        fns[path] = each(lambda a, sa, b, sb, path=path: functools.partial(
            gemm_nvfp4, a, sa, b, sb, scales_swizzled=True, out=out, path=path))
    if variants:
        fns["decode_both"] = each(lambda a, sa, b, sb: functools.partial(
            gemm_nvfp4, a, sa, b, sb, scales_swizzled=True, out=out, path="decode_both"))
        fns["kernel_only"] = each(lambda a, sa, b, sb: _kernel_only_fn(a, sa, b, sb, out))
    flop = 2.0 * m * n * k
    row = {"M": m, "N": n, "K": k,
           "operands": {"": "plain", "both": "window64", "weights": "token x window64"}[window64],
           "graph sets": n_sets}
    for mode, timer in timing_modes(graphs):
        ms = {name: timer(fn) for name, fn in fns.items()}
        for name, t in ms.items():
            row[f"{name} {mode} TFLOP/s"] = flop / t / 1e9
        row[f"nvfp4/cublas {mode}"] = ms["cublas_bf16"] / ms["nvfp4"]
        row[f"nvfp4/dequant+cublas {mode}"] = ms["dequant+cublas"] / ms["nvfp4"]
        for other in ("decode_both", "window"):
            if window64 and other in ms:
                row[f"nvfp4/{other} {mode}"] = ms[other] / ms["nvfp4"]
        for path in paths:
            row[f"nvfp4/{path} {mode}"] = ms[path] / ms["nvfp4"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf gemm", description=__doc__)
    p.add_argument("--sweep", action="store_true",
                   help="add M in {1024..32768} x N=K in {2048, 4096, 8192}")
    p.add_argument("--decode", action="store_true",
                   help="add M in {1, 16, 64} x (N, K) in {(8192, 8192), (28672, 8192)}")
    p.add_argument("--shapes", type=str, default=None,
                   help="comma-separated MxNxK list instead of the default shapes")
    p.add_argument("--no-graphs", action="store_true", help="eager timings only")
    p.add_argument("--variants", action="store_true",
                   help="also time the decode_both kernel and the predecode GEMM kernel alone")
    p.add_argument("--paths", type=str, default="",
                   help="comma-separated gemm_nvfp4 paths to time besides auto "
                        "(weight_stream, predecode, decode_both)")
    p.add_argument("--window64", nargs="?", const="both", default="",
                   choices=("both", "weights"),
                   help="1x64 local-encode operands through cute_fp4.gemm: both (the default) "
                        "or the weights (B) only, A per token")
    p.add_argument("--json", type=str, default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.window64 and (args.variants or args.paths):
        raise SystemExit("--window64 takes neither --variants nor --paths")
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = list(MAIN_SHAPES)
        if args.sweep:
            shapes += [(m, nk, nk) for nk in SWEEP_NK for m in SWEEP_M]
        if args.decode:
            shapes += DECODE_SHAPES
    paths = tuple(x for x in args.paths.split(",") if x)
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        progress(i, len(shapes), f"{m}x{n}x{k}")
        rows.append(bench_shape(m, n, k, graphs=not args.no_graphs, variants=args.variants,
                                paths=paths, window64=args.window64))
        torch.cuda.empty_cache()
    progress(len(shapes), len(shapes), "done")
    report(rows, f"NVFP4 GEMM on {torch.cuda.get_device_name()}", args.json)
    return 0
