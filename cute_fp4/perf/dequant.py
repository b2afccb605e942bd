"""`python -m cute_fp4.perf dequant [--json F]`: NVFP4 and MXFP8 (E4M3) -> bf16/fp32
dequantize bandwidth.

Floor: data + scales read once, output written once, at the device-to-device copy bandwidth
measured in the same run. Also the host overhead of one call on a tiny tensor.
"""

from __future__ import annotations

import argparse

import torch

from .. import dequantize, mxfp8_dequantize, ref
from ..recipe import Recipe
from .common import (bench_graph_ms, bench_ms, copy_bandwidth_gbs, graph_sets, host_overhead_us,
                     progress, report)

SHAPES = [(m, k) for m in (1024, 8192, 32768) for k in (2048, 8192)]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf dequant", description=__doc__)
    p.add_argument("--json")
    args = p.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    cases = [(s, fmt, dt) for s in SHAPES for fmt in ("tensor", "token", "mxfp8")
             for dt in (torch.bfloat16, torch.float32)]
    for i, ((m, k), fmt, dtype) in enumerate(cases, 1):
        progress(i, len(cases), f"{m}x{k} {fmt} {dtype}")
        out_bytes = m * k * torch.finfo(dtype).bits // 8
        if fmt == "mxfp8":
            nbytes = m * k + m * k // 32 + out_bytes
            xs = [ref.mxfp8_quantize(torch.randn(m, k, device="cuda"))
                  for _ in range(graph_sets(nbytes))]
            calls = [lambda x=x: mxfp8_dequantize(*x, dtype) for x in xs]
        else:
            nbytes = m * k // 2 + m * k // 16 + out_bytes
            ts = [ref.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                               Recipe(scaling=fmt)) for _ in range(graph_sets(nbytes))]
            calls = [lambda t=t: dequantize(t, dtype) for t in ts]
        ms = bench_ms(calls[0])
        # graph mode rotates over distinct inputs: none is left in L2 by the calls before
        graph_ms = bench_graph_ms(calls)
        floor_ms = nbytes / copy_gbs / 1e6
        rows.append({"M": m, "K": k, "format": "mxfp8" if fmt == "mxfp8" else "nvfp4",
                     "scaling": "block" if fmt == "mxfp8" else fmt,
                     "out": str(dtype).split(".")[-1], "ms": ms, "graph ms": graph_ms,
                     "GB/s": nbytes / ms / 1e6, "% of floor": 100 * floor_ms / ms,
                     "% of floor (graph)": 100 * floor_ms / graph_ms})
    tiny = ref.quantize(torch.randn(16, 64, device="cuda"), Recipe())
    overhead = host_overhead_us(lambda: dequantize(tiny, torch.bfloat16))
    tiny_out = torch.empty(16, 64, dtype=torch.bfloat16, device="cuda")
    overhead_out = host_overhead_us(lambda: dequantize(tiny, torch.bfloat16, out=tiny_out))
    report(rows, f"NVFP4 / MXFP8 dequantize ({torch.cuda.get_device_name()}; copy bandwidth "
                 f"{copy_gbs:.0f} GB/s; host overhead {overhead:.1f} us per call, "
                 f"{overhead_out:.1f} with out=)", args.json)
    return 0
