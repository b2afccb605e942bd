"""Timing and reporting helpers shared by the benchmarks (`python -m cute_fp4.perf ...`).

Times are medians of CUDA-event timings after warm-up (triton.testing.do_bench when triton is
installed). Every ratio is against a baseline measured in the same process.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch


def bench_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of `fn()` on the current stream."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        pass
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# Distinct inputs that graph-mode quantize benchmarks rotate over (each is larger than half of
# the 50 MB L2 at the sweep sizes, so a call never finds its input left by the call before).
GRAPH_INPUTS = 3


def graph_sets(nbytes: int, limit: int = 8) -> int:
    """How many distinct operand sets of `nbytes` a CUDA-graph timing rotates over so that no
    call finds its operands in L2 from the calls before: enough to fill four times the L2, at
    most `limit` (eager timings need none: do_bench flushes L2 before every call). A GEMM
    that replays one weight matrix of less than the L2 size reads part of it from L2, and
    twice the L2 is not enough to stop it (H100, session 18: W4A16 1 x 8192 x 8192 took 16.0
    us on one weight set, 16.9 on three, 17.7 on six)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(limit, -(-4 * l2 // max(1, nbytes))))


def bench_graph_ms(fn, replays_per_graph: int = 10) -> float:
    """Median milliseconds of one call replayed from a captured CUDA graph. `fn` is a callable
    or a list of callables taken in turn (e.g. the same op on distinct inputs, so that no
    call finds its input in L2 from the call before)."""
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(replays_per_graph):
            fns[i % len(fns)]()
    return bench_ms(graph.replay) / replays_per_graph


def timing_modes(graphs: bool):
    """[(mode, timer)] of the GEMM benchmarks: "eager" times the first of a list of callables
    (`bench_ms`, L2 flushed), "graph" replays the list (`bench_graph_ms`) when `graphs`."""
    modes = [("eager", lambda fns: bench_ms(fns[0]))]
    if graphs:
        modes.append(("graph", bench_graph_ms))
    return modes


def host_overhead_us(fn: Callable[[], object], iters: int = 2000) -> float:
    """Mean host microseconds per call of `fn()` (launch cost; the GPU work is tiny)."""
    import time

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def host_ms_gpu_busy(fn: Callable[[], object], calls: int = 10, repeats: int = 7) -> float:
    """Median host milliseconds per call of `fn()` while the GPU is busy with queued work (a
    `torch.cuda._sleep` longer than the calls), so the host never waits for the GPU: what an
    eager loop spends enqueueing. When it exceeds the GPU time of a call, eager calls are
    host-bound. Few calls per repeat, so that the CUDA launch queue (~1000 entries) never
    fills (a full queue blocks the host until the sleep ends)."""
    import time

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(200_000_000)  # ~0.1 s at ~2 GHz
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def cublas_bf16_tflops(m: int, n: int, k: int) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b.t())
    return 2 * m * n * k / ms / 1e9


def progress(i: int, total: int, label: str):
    """One-line progress on stderr (the table goes to stdout)."""
    sys.stderr.write(f"\r[{i}/{total}] {label:<60}")
    sys.stderr.flush()
    if i == total:
        sys.stderr.write("\n")


def report(rows: List[Dict[str, object]], title: str, json_path: Optional[str] = None,
           floatfmt: str = ".3g") -> str:
    """Print a tabulate table of `rows` (dicts with the same keys) and optionally save JSON."""
    from tabulate import tabulate

    text = f"## {title}\n\n" + tabulate(rows, headers="keys", tablefmt="github",
                                         floatfmt=floatfmt)
    print(text, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            json.dump({"title": title, "device": device, "rows": rows}, f, indent=1)
    return text
