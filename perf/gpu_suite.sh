#!/usr/bin/env bash
# The GPU tests and the benchmarks in one go, for one device call. On the project's device:
#   source .gpu/prelude.sh && bash perf/gpu_suite.sh [MODE] [BENCH ...]
# MODE: tests | bench | all (default). BENCH: any of quant quant_recipes gemm gemm_w4a16
# linear dequant compile (default all).
# Output folder: $OUT if set, else ./perf/out. It receives gpu_tests.log, bench.md (every
# table, in order) and bench_json.tar.gz (each benchmark's --json file): few files, because
# the device tool returns at most 8.
set -uo pipefail
mode="${1:-all}"
[ $# -gt 0 ] && shift
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(quant quant_recipes gemm gemm_w4a16 linear dequant compile)
out="${OUT:-./perf/out}"
mkdir -p "$out" "$out/json"
export PYTHONUNBUFFERED=1
status=0
python3 -c "import torch; p = torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, 'SMs')"
if [ "$mode" = tests ] || [ "$mode" = all ]; then
    # One pytest per group of files, in parallel: the time is mostly kernel compilation
    # (CPU-bound, one core each); the GPU work of the tests is small.
    # test_quant_gpu.py is two shards (-k filters), its compilation being the longest
    shards=("tests/test_quant_gpu.py" "tests/test_quant_gpu.py" "tests/test_quant_recipes_gpu.py"
            "tests/test_gemm_gpu.py" "tests/test_gemm_w4a16_gpu.py"
            "tests/test_dequantize_gpu.py tests/test_api_gpu.py tests/test_nn.py tests/test_cli.py")
    filters=("block2d or token_rows or fused" "not (block2d or token_rows or fused)" "" "" "" "")
    pids=()
    for i in "${!shards[@]}"; do
        python3 -m pytest -q -m gpu -p no:cacheprovider ${shards[$i]} \
            ${filters[$i]:+-k "${filters[$i]}"} > "$out/shard$i.log" 2>&1 &
        pids+=($!)
    done
    : > "$out/gpu_tests.log"
    for i in "${!shards[@]}"; do
        wait "${pids[$i]}" || status=1
        { echo "== ${shards[$i]} ${filters[$i]:+-k \"${filters[$i]}\"}"; grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/shard$i.log"; } \
            | tee -a "$out/gpu_tests.log"
        rm -f "$out/shard$i.log"
    done
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
    : > "$out/bench.md"
    for b in "${benches[@]}"; do
        python3 -m cute_fp4.perf "$b" --json "$out/json/$b.json" 2>/dev/null | tee -a "$out/bench.md"
        [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark $b failed" | tee -a "$out/bench.md"; status=1; }
        echo | tee -a "$out/bench.md"
    done
    tar czf "$out/bench_json.tar.gz" -C "$out" json
fi
rm -rf "$out/json"
exit $status
