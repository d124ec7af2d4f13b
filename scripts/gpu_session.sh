#!/usr/bin/env bash
# One short GPU session for notebook 09 and notebook 07's GPU half, prepared on CPU.
#
#   OUT=build/gpu bash scripts/gpu_session.sh        # on a CUDA machine, from the repo root
#
# It uses the machine's own python, torch, triton and transformers (a lent GPU machine may
# have no network: nothing is installed) with kvlib from this tree (PYTHONPATH), and runs, each
# step under its own time limit and each logged to $OUT whatever the others do:
#
#   1. the environment: GPU name, torch / triton / transformers versions;
#   2. benchmarks/bench_kernel.py: decode-step latency 1k-128k, bytes read, bandwidth, the
#      whole-model decode at 32k (run "kernel", written to $OUT/results.json, a copy of
#      kvlib/results.json); every fused row is first checked against the torch path on CUDA
#      (compiled, float16), so a wrong kernel stops it;
#   3. scripts/gpu_check.py: notebook 07's full-model check on a random-initialised model;
#   4. notebook 09 under strict nbval on CUDA.
# (tests/test_kernels.py is left out: the test suite runs the kernel in Triton's interpreter.)
#
# About 8 minutes on an H100/H200-class GPU; STEP_LIMIT (seconds, default 240) bounds each step.
# Exit status: the number of steps that failed.
set -u
OUT=${OUT:-build/gpu}
STEP_LIMIT=${STEP_LIMIT:-240}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
cp kvlib/results.json "$OUT/results.json"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0

step() {  # step NAME COMMAND...: run with a time limit, log to $OUT/NAME.log, count failures
    local name=$1
    shift
    local t0=$SECONDS
    timeout "$STEP_LIMIT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step environment "$PYTHON" -c "
import torch, transformers
print('torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__)
print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
import triton; print('triton', triton.__version__)
assert torch.cuda.is_available(), 'no CUDA device'
"
step bench_kernel "$PYTHON" benchmarks/bench_kernel.py --json "$OUT/results.json"
step gpu_check "$PYTHON" scripts/gpu_check.py --time-limit $((STEP_LIMIT - 30))
step nbval_09 "$PYTHON" -m pytest -q -p no:cacheprovider --nbval --nbval-current-env \
    --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout 150 \
    notebooks/09_fused_decode_kernel.ipynb
exit "$failed"
