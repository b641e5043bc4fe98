#!/usr/bin/env bash
# Runs the GPU suites and the GPU benchmarks on a CUDA machine and writes everything to a
# results folder (default ./gpu-results):
#
#   bash ci/gpu.sh [RESULTS_DIR] [STAGES]
#
# STAGES is a comma-separated subset of "one,two,bench" (default: all three, in that order):
#   one    pytest -m gpu suites/ with CUDA_VISIBLE_DEVICES=0 (2-GPU tests skip with a reason)
#   two    pytest -m gpu suites/ with the first two GPUs visible (when there are two)
#   bench  benchmarks/bench_expert_sync.py --device cuda on one GPU, bench_gather.py on two
# Split the stages over several invocations when one call has a time limit.
#
# Needs python3 with torch (CUDA), triton and pytest; megatron-core and sglang are not needed.
# NCCL settings already in the environment (e.g. NCCL_NVLS_ENABLE=0) are passed through
# untouched. At the end it prints a summary (pass counts per suite, throughput lines, GPU
# memory before and after) to paste into docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."

RESULTS="${1:-./gpu-results}"
STAGES="${2:-one,two,bench}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
# Same cuBLAS workspace on every stream: eager and graph-captured matmuls pick the same kernels.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
export PYTHONUNBUFFERED=1

say() { echo "$@" | tee -a "$SUMMARY"; }
has_stage() { [[ ",$STAGES," == *",$1,"* ]]; }

gpu_memory() {  # one line per GPU: index, name, used / total MiB
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null \
            | sed 's/^/    /'
    else
        "$PYTHON" - <<'PY'
import torch
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    print(f"    {i}, {torch.cuda.get_device_name(i)}, {(total - free) >> 20} MiB, {total >> 20} MiB")
PY
    fi
}

# ---- plugin: installed editable if possible, else from the source tree ---------------------
if "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$RESULTS/install.log" 2>&1 \
        && "$PYTHON" -c "import pytest_weightsync.plugin" 2>>"$RESULTS/install.log"; then
    PLUGIN=(-p weightsync)
    INSTALL="editable install"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PLUGIN=(-p pytest_weightsync.plugin)
    INSTALL="PYTHONPATH (pip install failed, see install.log)"
fi

NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
say "== pytest-weightsync GPU run, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "   git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
say "   python: $("$PYTHON" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' 2>&1)"
say "   plugin: $INSTALL; GPUs visible: $NGPU; stages: $STAGES"
say "   NCCL env: $(env | grep -E '^(NCCL_|TORCH_SYMM_MEM|NVSHMEM_)' | sort | tr '\n' ' ')"
say "   GPU memory before:"
gpu_memory | tee -a "$SUMMARY"
if [ "$NGPU" -lt 1 ]; then
    say "no CUDA GPU visible: nothing to run"
    exit 1
fi

STATUS=0

run_suites() {  # $1 = label, $2 = CUDA_VISIBLE_DEVICES
    local label=$1 devices=$2 rc
    say ""
    say "== pytest -m gpu suites/ ($label, CUDA_VISIBLE_DEVICES=$devices)"
    CUDA_VISIBLE_DEVICES=$devices "$PYTHON" -m pytest "${PLUGIN[@]}" -m gpu suites/ -rs -p no:cacheprovider \
        --junitxml="$RESULTS/pytest-$label.xml" --weightsync-report="$RESULTS/report-$label.json" \
        >"$RESULTS/pytest-$label.log" 2>&1
    rc=$?
    tail -n 1 "$RESULTS/pytest-$label.log" | tee -a "$SUMMARY"
    "$PYTHON" - "$RESULTS/pytest-$label.xml" <<'PY' | tee -a "$SUMMARY"
import collections, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:
    print(f"    (no junit xml: {exc})"); sys.exit(0)
counts = collections.defaultdict(collections.Counter)
failed = []
for case in root.iter("testcase"):
    suite = case.get("classname", "?").split(".")[0]
    kind = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            kind = "failed"; failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif child.tag == "skipped":
            kind = "skipped"
    counts[suite][kind] += 1
for suite, c in sorted(counts.items()):
    print(f"    {suite:<28} passed {c['passed']:>3}  failed {c['failed']:>3}  skipped {c['skipped']:>3}")
for name in failed:
    print(f"    FAILED {name}")
PY
    if [ $rc -ne 0 ]; then
        STATUS=1
        say "   (exit code $rc; full log: pytest-$label.log)"
    fi
}

if has_stage one; then
    run_suites one-gpu 0
fi
if has_stage two; then
    if [ "$NGPU" -ge 2 ]; then
        run_suites two-gpu 0,1
    else
        say ""
        say "== two-GPU stage skipped: $NGPU GPU(s) visible"
    fi
fi

if has_stage bench; then
    say ""
    say "== benchmarks"
    if [ -f benchmarks/bench_expert_sync.py ]; then
        CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" benchmarks/bench_expert_sync.py \
            --device cuda --json "$RESULTS/bench_expert_sync.json" >"$RESULTS/bench_expert_sync.log" 2>&1 \
            || { STATUS=1; say "   bench_expert_sync.py failed (see bench_expert_sync.log)"; }
        say "-- bench_expert_sync.py --device cuda (1 GPU)"
        grep -E "GB/s|x[0-9]|ratio|limit" "$RESULTS/bench_expert_sync.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    else
        say "   benchmarks/bench_expert_sync.py not present"
    fi
    if [ -f benchmarks/bench_gather.py ]; then
        if [ "$NGPU" -ge 2 ]; then
            CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" benchmarks/bench_gather.py \
                --device cuda --world-size 2 --json "$RESULTS/bench_gather.json" >"$RESULTS/bench_gather.log" 2>&1 \
                || { STATUS=1; say "   bench_gather.py failed (see bench_gather.log)"; }
            say "-- bench_gather.py --device cuda (2 GPUs, NCCL)"
            grep -E "GB/s|ratio|baseline|budget" "$RESULTS/bench_gather.log" | sed 's/^/    /' | tee -a "$SUMMARY"
        else
            say "   bench_gather.py skipped: needs 2 GPUs, $NGPU visible"
        fi
    fi
fi

say ""
say "   GPU memory after:"
gpu_memory | tee -a "$SUMMARY"
say "== results in $RESULTS (summary.txt, pytest-*.log/xml, report-*.json, bench_*.json/log); status $STATUS"
exit $STATUS
