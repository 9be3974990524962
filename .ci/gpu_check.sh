#!/usr/bin/env bash
# One lease of a lent GPU, as one command (installs nothing; about 7 minutes, at most 9.5):
#   bash .ci/gpu_check.sh [OUT_DIR]
# The compiled-kernel tests (tests/pallas_attn/test_gpu_compiled.py), then each section of
# benchmarks.gpu_suite in its own process under its own time limit, so a hang or a crash in one
# leaves the others' results. Writes into OUT_DIR (default $OUT, else benchmarks/results):
# gpu_env.txt, gpu_tests.log, gpu_tests.xml, gpu_suite_<device>.json, gpu_check.log.
set -u
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$(date +%s)
# Which parts: GPU_TESTS=0 skips the tests (GPU_TESTS_K: a pytest -k filter, GPU_TESTS_LIMIT in s);
# GPU_SECTIONS lists section:limit_s pairs; GPU_CHECKS picks checks by name. Rows not rerun are kept
# from benchmarks/results/gpu_suite_<device>.json (a row replaces the one of its section and name).
tests=${GPU_TESTS:-1}
# Limits from the H200 leases of 2026-11-30 (tests 118 s for 70 of the 79, check 115 s, decode
# 9 s, attention 54 s, speculative 82 s, generate 18 s, each with its process start): about 7 min.
sections=${GPU_SECTIONS:-check:130 decode:30 attention:80 speculative:110 generate:50}
if [[ $out != benchmarks/results ]]; then cp benchmarks/results/gpu_suite_nvidia_h*.json "$out"/ 2>/dev/null; fi

step() {  # step LIMIT_S [-s SIGNAL] CMD...: runs CMD under a time limit, logs its status and time
    local limit=$1 t0 rc sig=TERM
    shift
    if [[ $1 == -s ]]; then sig=$2; shift 2; fi
    t0=$(date +%s)
    echo "== $(date -u +%T) start (limit ${limit}s): $*"
    timeout -s "$sig" -k 10 "$limit" "$@"
    rc=$?
    echo "== $(date -u +%T) rc=$rc after $(($(date +%s) - t0))s: $*"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem \
        --format=csv
    $py -c "import sys, jax, jaxlib, flax, optax, numpy; print(sys.version); \
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, 'numpy', numpy.__version__); print(jax.devices())"
    nproc
} >"$out/gpu_env.txt" 2>&1

{
    cat "$out/gpu_env.txt"
    # Several pytest workers share the GPU: no preallocation.
    # Several pytest workers share the GPU: no preallocation. At the limit pytest gets SIGINT, so
    # it still prints the failures so far.
    if [[ $tests == 1 ]]; then
        XLA_PYTHON_CLIENT_PREALLOCATE=false step "${GPU_TESTS_LIMIT:-150}" -s INT $py -m pytest -q \
            -n 12 -rfE --tb=short -p no:cacheprovider -k "${GPU_TESTS_K:-}" \
            tests/pallas_attn/test_gpu_compiled.py \
            --junitxml="$out/gpu_tests.xml" >"$out/gpu_tests.log" 2>&1
        grep -v PytestBenchmarkWarning "$out/gpu_tests.log" | grep -v "warner(" | tail -n 60
    fi
    for s in $sections; do
        step "${s#*:}" $py -m benchmarks.gpu_suite --sections "${s%%:*}" --out "$out" \
            --checks "${GPU_CHECKS:-}"
    done
    echo "== total $(($(date +%s) - start))s"
} 2>&1 | tee "$out/gpu_check.log"
