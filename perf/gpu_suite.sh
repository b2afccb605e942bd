#!/usr/bin/env bash
# Runs the GPU tests and the benchmarks in one go on a CUDA machine; logs and tables go to
# $1 (default: $OUT, else ./perf/out). On the project's device machine:
#   source .gpu/prelude.sh && bash perf/gpu_suite.sh [tests|bench|all] ...
# Extra arguments after the mode are passed to pytest (mode tests) or select benchmarks
# (mode bench: any of quant gemm linear; default all three that exist).
set -uo pipefail
mode="${1:-all}"; shift || true
out="${OUT:-./perf/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, 'SMs')" | tee "$out/device.txt"
if [ "$mode" = tests ] || [ "$mode" = all ]; then
    python3 -m pytest -q -m gpu -p no:cacheprovider "$@" tests 2>&1 | tee "$out/gpu_tests.log"
    status=${PIPESTATUS[0]}
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
    benches=("$@"); [ "$mode" = all ] || [ ${#benches[@]} -gt 0 ] || benches=(quant gemm linear)
    [ "$mode" = all ] && benches=(quant gemm linear)
    for b in "${benches[@]}"; do
        python3 -m cute_fp4.perf "$b" --json "$out/$b.json" 2>&1 | tee "$out/$b.md" || status=1
    done
fi
exit $status
