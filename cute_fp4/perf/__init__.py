"""Benchmarks: `python -m cute_fp4.perf {quant,gemm,linear} [options]`."""
