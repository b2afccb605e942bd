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
    # The GPU tests in contiguous chunks of the collected ids, one pytest each, in parallel:
    # the time is mostly kernel compilation (CPU-bound, one core each; neighbouring ids share
    # kernels), the tests' GPU work is small. SHARDS: how many (default: cores - 2, at most 12);
    # SHARD_TIMEOUT_S: each shard's limit (default none); TESTS_K: a pytest -k expression
    # selecting some of them (default all).
    shards="${SHARDS:-$(( $(nproc) > 14 ? 12 : ($(nproc) > 3 ? $(nproc) - 2 : 1) ))}"
    work="$(mktemp -d)"  # the shards' id lists and logs (the device tool returns 8 files)
    python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only tests \
        ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
        | grep '::' > "$work/ids.txt"
    echo "$(wc -l < "$work/ids.txt") GPU tests in $shards shards"
    split -n "l/$shards" -d -a 2 "$work/ids.txt" "$work/ids_"
    pids=()
    for f in "$work"/ids_??; do
        # fewer ids than shards leaves some empty: a pytest without ids would run every test
        [ -s "$f" ] || { rm -f "$f"; continue; }
        mapfile -t ids < "$f"  # one id per line (some ids hold spaces)
        timeout "${SHARD_TIMEOUT_S:-0}" python3 -m pytest -q -m gpu -p no:cacheprovider "${ids[@]}" \
            > "$f.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    : > "$out/gpu_tests.log"
    for f in "$work"/ids_??; do
        { echo "== $(head -1 "$f") .. $(tail -1 "$f") ($(wc -l < "$f") ids)"
          grep -E "^(FAILED|ERROR)" "$f.log"; tail -1 "$f.log"; } | tee -a "$out/gpu_tests.log"
    done
    for f in "$work"/ids_??; do tail -1 "$f.log"; done \
        | grep -oE "[0-9]+ (passed|failed|skipped|errors?|deselected)" \
        | awk '{n[$2] += $1} END {printf "total:"; for (k in n) printf " %d %s", n[k], k; print ""}' \
        | tee -a "$out/gpu_tests.log"
    rm -rf "$work"
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
