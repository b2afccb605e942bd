"""`python -m cute_fp4.perf compile [--arch A] [--json F]`: JIT compile time of one kernel of
each family (SPEC 5: cold <= 2 s per kernel, warm from a disk cache << 1 s).

Each kernel is compiled in fresh processes: "cold" with no cache (what a user's first call
pays, the DSL's per-process set-up included; the DSL's own file cache does not apply to
`cute.compile`; CUTE_FP4_KERNEL_CACHE=0), then twice with one new, empty
CUTE_FP4_KERNEL_CACHE directory (common.jit's disk cache): the first compiles and exports the
kernel, the second loads it. Only `KERNELS.get` is timed (not the imports, nor building the
fake arguments). The last column is its in-memory hit in the cold process (every later call
of the same configuration). Runs without a GPU (the arch defaults to the device's, else
sm_90a, passed as CUTE_DSL_ARCH); compilation is CPU work, so the times depend on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .common import progress, report

KERNELS = ("cast", "amax_token", "dequantize", "w4a16", "mixed", "w4a4", "recipe_cast",
           "sm100_gemm")


def _build(name: str):
    """(op, *fake args) of the benchmark's configuration of kernel family `name`."""
    if name == "cast":
        from ..quant.dispatch import cast_kernel

        return cast_kernel("bf16", True, True, False, False)
    if name == "amax_token":
        from ..quant.dispatch import amax_token_kernel

        return amax_token_kernel("bf16")
    if name == "dequantize":
        from ..quant.dequantize import nvfp4_kernel

        return nvfp4_kernel(torch.bfloat16, "tensor", True, 448)
    if name == "w4a16":
        from ..gemm.sm90_w4a16 import w4a16_kernel

        op, args = w4a16_kernel(torch.bfloat16, torch.bfloat16, flags=(True, False, False),
                                decode=(448, None, None))
        return (op, *args)
    if name == "mixed":
        from ..gemm.sm90_mixed import UNSCALE_W4A4, mixed_kernel

        op, args = mixed_kernel(torch.bfloat16, 128, 6, (True, True, True, False), None, False,
                                UNSCALE_W4A4, True)
        return (op, *args)
    if name == "w4a4":
        from ..gemm.dispatch import _w4a4_kernel

        op, args = _w4a4_kernel(torch.bfloat16, 128, 6, (True, False, False, False), None)
        return (op, *args)
    if name == "recipe_cast":
        from ..quant.recipes_dispatch import cast_recipe_kernel
        from ..recipe import Recipe

        return cast_recipe_kernel("bf16", Recipe(rht=True, stochastic_rounding=True))
    if name == "sm100_gemm":
        from ..gemm.sm100_blockscaled import sm100_gemm_kernel

        return sm100_gemm_kernel(torch.bfloat16, 256, (True, False, False, False))
    raise ValueError(f"unknown kernel {name!r}; one of {KERNELS}")


def _compile_once(name: str, arch: str) -> dict:
    """In this process: compile `name` through KERNELS (seconds), then its in-memory hit (us)."""
    from ..common.jit import KERNELS as cache, compile_kernel

    built = _build(name)
    start = time.perf_counter()
    cache.get(("perf_compile", name, arch), lambda: compile_kernel(*built, arch=arch))
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    cache.get(("perf_compile", name, arch), lambda: None)
    return {"seconds": seconds, "hit_us": (time.perf_counter() - start) * 1e6}


def _in_subprocess(name: str, arch: str, kernel_cache: str = None) -> dict:
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_FP4_KERNEL_CACHE=kernel_cache or "0")
    run = subprocess.run([sys.executable, "-m", "cute_fp4.perf.compile", "--one", name,
                          "--arch", arch], env=env, capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"compiling {name} for {arch} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cute_fp4.perf compile", description=__doc__)
    p.add_argument("--arch", default=None, help="sm_90a or sm_100a (default: the device's, "
                                                "else sm_90a); sm100_gemm always sm_100a")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    arch = args.arch
    if arch is None:
        from ..common.jit import device_arch

        arch = device_arch() if torch.cuda.is_available() else "sm_90a"
    if args.one:
        print(json.dumps(_compile_once(args.one, arch)))
        return 0
    names = [n for n in args.kernels.split(",") if n]
    rows = []
    for i, name in enumerate(names):
        progress(i, len(names), name)
        target = "sm_100a" if name == "sm100_gemm" else arch
        cold = _in_subprocess(name, target)
        with tempfile.TemporaryDirectory(prefix="cute_fp4_kernels_") as cache_dir:
            export = _in_subprocess(name, target, cache_dir)
            cached = _in_subprocess(name, target, cache_dir)
        rows.append({"kernel": name, "arch": target, "cold s": cold["seconds"],
                     "cold + export s": export["seconds"], "from disk s": cached["seconds"],
                     "in-memory hit us": cold["hit_us"]})
    progress(len(names), len(names), "done")
    host = os.cpu_count()
    report(rows, f"JIT compile time per kernel (host with {host} CPUs)", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
