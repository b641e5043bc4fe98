#!/usr/bin/env bash
# Runs the GPU suites and the GPU benchmarks on a CUDA machine and writes everything to a
# results folder (default ./gpu-results):
#
#   bash ci/gpu.sh [RESULTS_DIR] [STAGES]
#
# STAGES is a comma-separated subset of "one,two,bench" (default: all three, in that order):
#   one    every file with GPU tests, one pytest run per file, CUDA_VISIBLE_DEVICES=0; then
#          tests/test_ranks_gpu.py again under pytest-xdist (-n 2). Tests that need two GPUs
#          skip there and are listed as "not run: needs 2 GPUs", not as failures.
#   two    the files with two-GPU tests, with the first two GPUs visible (when there are two;
#          otherwise the stage is listed as not run)
#   bench  benchmarks/bench_expert_sync.py and bench_e2e.py --device cuda on one GPU (40
#          layers; 8 layers with the stateless sender and direct from the trainer's ETP
#          shards; 8 layers per-update with --no-serialize-ahead; 8 layers with the engine
#          ranks side by side; 8 layers at MoE-TP 4), bench_gather.py and
#          bench_e2e_ranks.py (a trainer rank and an engine rank per GPU, MoE-TP 2) on two
#
# GPU_FILES="FILE LIMIT,FILE LIMIT" limits stage one to those files, in that order.
#
# Stage one also runs the GPU throughput guard (suites/selftest/test_throughput_guard.py -m gpu): its
# ratios are saved as RESULTS_DIR/KIND.json (KIND from the GPU's name: h100, h200, ...) and
# compared with ci/baselines/KIND.json (tolerance 0.10) when the visible GPU is the one that
# file names.
#
# Every pytest run is bounded: a per-file wall-clock limit (`timeout`, which also ends the
# receiver and rank processes a test spawned) and, where pytest-timeout is installed, a
# per-test limit. GPU_DEADLINE_S (seconds from the start of this script) caps the whole run:
# a file whose limit would pass it gets only the time left, or is listed as not run. The
# summary (summary.txt) is written line by line as each file finishes, so a run killed from
# outside still leaves every finished file's counts and the name of the one that was running.
#
# Needs python3 with torch (CUDA), triton and pytest; megatron-core and sglang are not needed.
# The suites import `pytest_weightsync.reference_impl` and `pytest_weightsync.suites`, which
# exist only in an installed plugin (pyproject's package-dir mapping): the script installs it
# editable, or else builds a wheel and installs that into the results folder; if neither
# works it stops and says so. NCCL settings already in the environment are passed through;
# NVLink multicast stays off unless the environment says otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

RESULTS="${1:-./gpu-results}"
STAGES="${2:-one,two,bench}"
PYTHON="${PYTHON:-python3}"
TEST_TIMEOUT="${WEIGHTSYNC_TEST_TIMEOUT:-240}"   # seconds per test (pytest-timeout)
GPU_DEADLINE_S="${GPU_DEADLINE_S:-0}"            # 0: no overall cap
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
# Same cuBLAS workspace on every stream: eager and graph-captured matmuls pick the same kernels.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
T0=$(date +%s)

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

# ---- plugin: editable install, else a wheel installed into the results folder -------------
plugin_importable() {
    "$PYTHON" - <<'PY'
import importlib.metadata as md
import pytest_weightsync.plugin, pytest_weightsync.reference_impl.oracle.synth, pytest_weightsync.suites  # noqa
assert any(ep.name == "weightsync" for ep in md.entry_points(group="pytest11")), "no pytest11 entry point"
PY
}
if "$PYTHON" -m pip install --no-deps --no-build-isolation -e . >"$RESULTS/install.log" 2>&1 \
        && plugin_importable >>"$RESULTS/install.log" 2>&1; then
    INSTALL="editable install"
else
    rm -rf "$RESULTS/wheel" "$RESULTS/site"
    if "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$RESULTS/wheel" . >>"$RESULTS/install.log" 2>&1 \
            && "$PYTHON" -m pip install --no-deps --no-index --target "$RESULTS/site" "$RESULTS"/wheel/*.whl \
                >>"$RESULTS/install.log" 2>&1; then
        export PYTHONPATH="$RESULTS/site${PYTHONPATH:+:$PYTHONPATH}"
        export PYTHONSAFEPATH=1  # the checkout's own pytest_weightsync/ lacks the mapped subpackages
        INSTALL="wheel installed into $RESULTS/site (editable install failed, see install.log)"
        if ! plugin_importable >>"$RESULTS/install.log" 2>&1; then
            say "cannot install the plugin: neither an editable install nor a wheel gives an importable"
            say "pytest_weightsync.reference_impl / pytest_weightsync.suites (see $RESULTS/install.log)"
            exit 2
        fi
    else
        say "cannot install the plugin: 'pip install -e .' and 'pip wheel .' both failed (see $RESULTS/install.log)."
        say "The suites import pytest_weightsync.reference_impl and pytest_weightsync.suites, which only an"
        say "installed plugin provides (pyproject package-dir mapping); PYTHONPATH=. does not."
        exit 2
    fi
fi
PLUGIN=(-p weightsync)
TIMEOUT_ARGS=()
if "$PYTHON" -c "import pytest_timeout" >/dev/null 2>&1; then
    TIMEOUT_ARGS=(--timeout="$TEST_TIMEOUT")
fi
XDIST=0
"$PYTHON" -c "import xdist" >/dev/null 2>&1 && XDIST=1

NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
say "== pytest-weightsync GPU run, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "   git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')$(git diff --quiet 2>/dev/null || echo ' (working tree differs)')"
say "   python: $("$PYTHON" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' 2>&1)"
say "   plugin: $INSTALL; GPUs visible: $NGPU; stages: $STAGES"
say "   limits: per test ${TIMEOUT_ARGS[*]:-none (pytest-timeout missing)}; per file see below; overall ${GPU_DEADLINE_S}s (0 = none)"
say "   NCCL env: $(env | grep -E '^(NCCL_|TORCH_SYMM_MEM|NVSHMEM_)' | sort | tr '\n' ' ')"
say "   GPU memory before:"
gpu_memory | tee -a "$SUMMARY"
if [ "$NGPU" -lt 1 ]; then
    say "no CUDA GPU visible: nothing to run"
    exit 1
fi

# One line per pytest run from its junit XML, or from its -v log when the run was killed.
cat >"$RESULTS/summarize.py" <<'PY'
import collections, re, sys, xml.etree.ElementTree as ET
xml_path, log_path, rc, seconds, label = sys.argv[1:6]
rc = int(rc)
TWO_GPU = re.compile(r"needs [2-9]\d* CUDA GPU")
outcome, reasons, notes = {}, {}, []
try:
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        node = f"{case.get('classname')}::{case.get('name')}"
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"
            elif child.tag == "skipped" and kind == "passed":
                kind, reasons[node] = "skipped", (child.get("message") or "").strip()
        outcome[node] = kind
        for prop in case.iter("property"):
            if prop.get("name") == "gpu_memory":
                notes.append(f"{case.get('name')}: {prop.get('value')}")
    source = "junit"
except Exception:
    source = "log"
    line_re = re.compile(r"(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)|(PASSED|FAILED|ERROR|SKIPPED)\s+(\S+::\S+)")
    for line in open(log_path, errors="replace"):
        m = line_re.search(line)
        if m:
            node, word = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            outcome[node] = {"PASSED": "passed", "SKIPPED": "skipped"}.get(word, "failed")
count = collections.Counter(outcome.values())
two = [n for n, k in outcome.items() if k == "skipped" and TWO_GPU.search(reasons.get(n, ""))]
other = collections.Counter(reasons[n] for n, k in outcome.items()
                            if k == "skipped" and n in reasons and n not in two)
status = "ok" if rc in (0, 5) and not count["failed"] else ("TIMED OUT" if rc in (124, 137) else f"exit {rc}")
print(f"   {label:<44} passed {count['passed']:>3}  failed {count['failed']:>3}  "
      f"skipped {count['skipped'] - len(two):>3}  not run (needs 2 GPUs) {len(two):>2}  "
      f"{float(seconds):6.1f} s  {status}" + ("" if source == "junit" else "  (counts from the log)"))
for n, k in outcome.items():
    if k == "failed":
        print(f"      FAILED {n}")
for reason, c in sorted(other.items()):
    print(f"      skipped {c}: {reason[:140]}")
for n in two:
    print(f"      not run, needs 2 GPUs: {n}")
for note in notes:
    print(f"      memory, {note}")
if rc in (124, 137):
    print(f"      stopped at the file's time limit; the test running then: see the end of its log")
PY

STATUS=0
RUN_INDEX=0

remaining() { if [ "$GPU_DEADLINE_S" -gt 0 ]; then echo $((GPU_DEADLINE_S - ($(date +%s) - T0))); else echo 100000; fi; }

# run_pytest LABEL DEVICES LIMIT_S ARGS...: one bounded pytest run, one summary line.
run_pytest() {
    local label=$1 devices=$2 limit=$3 rc start elapsed left name
    shift 3
    left=$(remaining)
    if [ "$left" -lt 30 ]; then
        say "   $label: not run, the overall limit (${GPU_DEADLINE_S}s) is spent"
        STATUS=1
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$((left - 10))
    RUN_INDEX=$((RUN_INDEX + 1))
    name=$(printf "%02d-%s" "$RUN_INDEX" "$(echo "$label" | tr -c 'A-Za-z0-9._-' '_' | sed 's/_*$//')")
    echo "   ... $label (limit ${limit}s, log $name.log)" >>"$SUMMARY"
    start=$(date +%s%N)
    CUDA_VISIBLE_DEVICES=$devices timeout -k 15 "$limit" "$PYTHON" -m pytest "${PLUGIN[@]}" \
        -v -rs -p no:cacheprovider -o junit_family=xunit1 "${TIMEOUT_ARGS[@]}" --junitxml="$RESULTS/$name.xml" "$@" \
        >"$RESULTS/$name.log" 2>&1
    rc=$?
    elapsed=$(( ($(date +%s%N) - start) / 1000000 ))  # ms
    elapsed="$((elapsed / 1000)).$(( (elapsed % 1000) / 100 ))"
    sed -i '$ d' "$SUMMARY"  # the "..." line of this run
    "$PYTHON" "$RESULTS/summarize.py" "$RESULTS/$name.xml" "$RESULTS/$name.log" "$rc" "$elapsed" "$label" \
        | tee -a "$SUMMARY"
    # 5: every test deselected (no GPU test in the file under this -m/-k)
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        STATUS=1
    fi
}

# run_bench NAME LIMIT_S MIN_S TITLE PATTERN ARGS...: one bounded run of benchmarks/NAME.py on GPU 0
# (its JSON and log under $RESULTS), the log's lines matching PATTERN and its exit in the summary;
# not run when less than MIN_S of the overall limit is left. The benchmarks share this so each
# states only its arguments, its time and what of its log to show.
run_bench() {
    local name=$1 limit=$2 min=$3 title=$4 pattern=$5 left rc start out
    shift 5
    out="${BENCH_OUT:-$name}"  # the JSON and log's name, when one benchmark runs twice
    left=$(remaining); [ "$left" -lt "$limit" ] && limit=$((left - 5))
    if [ "$limit" -lt "$min" ]; then
        say "   $name.py: not run, the overall limit is spent"; STATUS=1
        return
    fi
    say "-- $name.py $title""limit ${limit}s)"
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "$limit" "$PYTHON" "benchmarks/$name.py" \
        "$@" --json "$RESULTS/$out.json" >"$RESULTS/$out.log" 2>&1
    rc=$?
    grep -E "$pattern" "$RESULTS/$out.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    say "   $name.py: exit $rc after $(( $(date +%s) - start )) s"
    [ "$rc" -ne 0 ] && STATUS=1
}

# File and per-file wall-clock limit (seconds), pytest's start-up included. Measured on one
# H100 (2026-12-06, the whole of stage one in 345 s with the install): throughput_guard 37 s,
# cuda_graph 11 s, repeated 12 s, engine_layouts 12 s, gpu_model 35 s (296 s on an H200 before
# the oracle built its values on the device: reference_impl/oracle/synth.py, synth_kernel.py),
# fastcopy 12 s, gpu_ipc 29 s (84-103 s before), e2e_sync 52-58 s, per_update_sync 53-54 s,
# gpu_nccl 8 s (every test needs two GPUs), conformance/test_loader.py 11 s, test_speed.py
# 10 s (109-149 s before), test_ranks_gpu.py 17 s and 21 s under -n 2 (RANKS_XDIST_LIMIT).
# Each limit leaves room over its time; `bash ci/gpu.sh RESULTS one` fits six minutes on one
# GPU. Any other suites/{selftest,conformance}/test_*.py with GPU tests (e.g. the
# Megatron-Bridge / DeepEP suites, which skip unless those packages are installed) is
# appended with the default limit, so a new GPU suite cannot be forgotten.
ONE_GPU_FILES=(
    "suites/selftest/test_throughput_guard.py 90"
    "suites/selftest/test_gpu_cuda_graph.py 30"
    "suites/selftest/test_gpu_repeated.py 30"
    "suites/selftest/test_gpu_engine_layouts.py 30"
    "suites/selftest/test_gpu_model.py 70"
    "suites/selftest/test_fastcopy.py 30"
    "suites/selftest/test_gpu_ipc.py 60"
    "suites/selftest/test_e2e_sync.py 90"
    "suites/selftest/test_per_update_sync.py 120"
    "suites/selftest/test_gpu_nccl.py 20"
    "suites/conformance/test_loader.py 30"
    "suites/conformance/test_speed.py 30"
    "tests/test_ranks_gpu.py 30"
)
RANKS_XDIST_LIMIT=30
for f in $(grep -l "pytest.mark.gpu" suites/selftest/test_*.py suites/conformance/test_*.py 2>/dev/null); do
    printf '%s\n' "${ONE_GPU_FILES[@]}" | grep -q "^$f " || ONE_GPU_FILES+=("$f 30")
done
# GPU_FILES="FILE LIMIT,FILE LIMIT": stage one runs just these, in this order (a short device
# session spent on what changed).
if [ -n "${GPU_FILES:-}" ]; then
    IFS=, read -r -a ONE_GPU_FILES <<<"$GPU_FILES"
fi

# The GPU throughput guard: ratios of the reused copy plans to a plain copy, saved as
# $RESULTS/KIND.json every run and compared (tolerance 0.10, counts exact) with the committed
# ci/baselines/KIND.json when this GPU is the one that file was measured on. KIND is the GPU's
# model in lower case (h100, h200, a100): ratios move between kinds, so each kind has its own
# file, and a file's recorded GPU name must match exactly (an H100 PCIe is not an H100 SXM).
GPU_KIND=$("$PYTHON" - <<'PY'
import re
import torch

def gpu_kind(name):
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'; else the name as a slug."""
    m = re.search(r"\b([A-Za-z]+[0-9]+)", name.replace("NVIDIA", ""))
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"

print(gpu_kind(torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""))
PY
)
GPU_KIND="${GPU_KIND:-gpu}"
BASELINE="ci/baselines/$GPU_KIND.json"
GUARD_ARGS=(--weightsync-save-baseline "$RESULTS/$GPU_KIND.json")
# the conformance speed column's rows (speed-gpu/...) are in the same file; that run saves its
# own ratios beside the guard's
SPEED_ARGS=(--weightsync-save-baseline "$RESULTS/$GPU_KIND-speed.json")
if [ -f "$BASELINE" ]; then
    same=$("$PYTHON" - "$BASELINE" <<'PY'
import json, sys, torch
want = json.load(open(sys.argv[1])).get("machine", {}).get("gpu")
print("yes" if want == torch.cuda.get_device_name(0) else f"no: {want!r} vs {torch.cuda.get_device_name(0)!r}")
PY
)
    if [ "$same" = "yes" ]; then
        GUARD_ARGS+=(--weightsync-baseline "$BASELINE")
        SPEED_ARGS+=(--weightsync-baseline "$BASELINE")
        GUARD_NOTE="compared with $BASELINE"
    else
        GUARD_NOTE="not compared with $BASELINE (measured on another GPU, $same)"
    fi
else
    GUARD_NOTE="no $BASELINE yet: it is the guard's and the speed column's rows of one run (docs/gpu.md, \"Baselines\")"
fi
say "   throughput guard: $GUARD_NOTE; this run's ratios: $RESULTS/$GPU_KIND.json, $RESULTS/$GPU_KIND-speed.json"

if has_stage one; then
    say ""
    say "== one GPU (CUDA_VISIBLE_DEVICES=0): pytest -m gpu, one run per file"
    for entry in "${ONE_GPU_FILES[@]}"; do
        read -r file limit <<<"$entry"
        if [ ! -f "$file" ]; then
            say "   $file: not present in this checkout"
            continue
        fi
        if [ "$file" = "suites/selftest/test_throughput_guard.py" ]; then
            run_pytest "$file" 0 "$limit" -m gpu "$file" "${GUARD_ARGS[@]}"
        elif [ "$file" = "suites/conformance/test_speed.py" ]; then
            # the speed column, guarded like the copy plans (-m gpu: PARTIAL by definition)
            run_pytest "$file" 0 "$limit" -m gpu "$file" --weightsync-allow-partial \
                "${SPEED_ARGS[@]}"
        elif [[ "$file" == suites/conformance/* ]]; then
            # -m gpu selects part of the conformance set: its verdict is PARTIAL by definition
            run_pytest "$file" 0 "$limit" -m gpu "$file" --weightsync-allow-partial
        else
            run_pytest "$file" 0 "$limit" -m gpu "$file"
        fi
    done
    # the rank tests again under xdist, unless a GPU_FILES selection left them out
    if printf '%s\n' "${ONE_GPU_FILES[@]}" | grep -q "^tests/test_ranks_gpu.py "; then
        if [ "$XDIST" -eq 1 ]; then
            run_pytest "tests/test_ranks_gpu.py -n 2" 0 "$RANKS_XDIST_LIMIT" -m gpu -n 2 tests/test_ranks_gpu.py
        else
            say "   tests/test_ranks_gpu.py -n 2: not run, pytest-xdist is not installed"
            STATUS=1
        fi
    fi
fi

if has_stage two; then
    say ""
    if [ "$NGPU" -ge 2 ]; then
        say "== two GPUs (CUDA_VISIBLE_DEVICES=0,1)"
        run_pytest "suites/selftest/test_gpu_nccl.py" 0,1 240 -m gpu suites/selftest/test_gpu_nccl.py
        run_pytest "suites/selftest/test_gpu_ipc.py -k two_gpus" 0,1 120 -m gpu -k two_gpus suites/selftest/test_gpu_ipc.py
        run_pytest "tests/test_ranks_gpu.py" 0,1 120 -m gpu tests/test_ranks_gpu.py
        [ "$XDIST" -eq 1 ] && run_pytest "tests/test_ranks_gpu.py -n 2" 0,1 120 -m gpu -n 2 tests/test_ranks_gpu.py
    else
        say "== two GPUs: not run: needs 2 GPUs, $NGPU visible (suites/selftest/test_gpu_nccl.py, the two-GPU"
        say "   tests of suites/selftest/test_gpu_ipc.py and tests/test_ranks_gpu.py; listed per test above)"
    fi
fi

if has_stage bench; then
    say ""
    say "== benchmarks"
    if [ -f benchmarks/bench_expert_sync.py ]; then
        run_bench bench_expert_sync 180 30 "--device cuda (1 GPU, " "GB/s|x[0-9]|ratio|limit" --device cuda
    else
        say "   benchmarks/bench_expert_sync.py not present"
    fi
    if [ -f benchmarks/bench_e2e.py ]; then
        run_bench bench_e2e 480 60 "--device cuda --per-update (1 GPU, 40 Qwen3.5-35B-A3B layers, ~130 GiB; " \
            "^(registered|per_update|per_tensor|per_storage)|processes copying|BIT CHECK|Error" --device cuda --per-update
        # 8 layers (12 GiB): registered, per-update and the stateless sender (docs/performance.md,
        # "Stateless senders")
        # (each with the trainer's ETP shards sent to direct as they are: --trainer-etp)
        BENCH_OUT=bench_e2e_8layers run_bench bench_e2e 300 60 "--layers 8 --per-update --per-tensor --trainer-etp (1 GPU; " \
            "^(registered|per_update|per_tensor|per_storage)|processes copying|BIT CHECK|Error" --device cuda --layers 8 \
            --per-update --per-tensor --per-tensor-layers 4 --trainer-etp --repeats 5
        # the same per-update rows with each later bucket serialized while the engines copy
        # the one before (ColocatedSync(serialize_ahead=False)): what the default gains
        BENCH_OUT=bench_e2e_8layers_behind run_bench bench_e2e 150 30 "--layers 8 --per-update --no-serialize-ahead (1 GPU; " \
            "^(per_update)|BIT CHECK|Error" --device cuda --layers 8 --per-update --no-registered \
            --trainer-etp --no-serialize-ahead --repeats 5
        # the engine ranks side by side at MoE-TP 2 (ColocatedSync(ranks_in_turn=False)): what
        # the default - rank 1's copies after rank 0's, one context switch per update - gains
        BENCH_OUT=bench_e2e_side_by_side run_bench bench_e2e 150 30 "--layers 8 --tp 2 --ranks-side-by-side --trainer-etp (1 GPU; " \
            "^(registered|per_update)|processes copying|BIT CHECK|Error" --device cuda --layers 8 --tp 2 \
            --per-update --ranks-side-by-side --trainer-etp --repeats 5
        # MoE-TP 4 on one GPU (four engine processes in turn): direct from the trainer's ETP
        # shards in one copy, and the formats every rank narrows itself
        BENCH_OUT=bench_e2e_tp4 run_bench bench_e2e 200 40 "--layers 8 --tp 4 --per-update --trainer-etp (1 GPU; " \
            "^(registered|per_update)|processes copying|BIT CHECK|Error" --device cuda --layers 8 --tp 4 \
            --per-update --trainer-etp --formats direct packed compat --repeats 5
    fi
    if [ -f benchmarks/bench_gather.py ]; then
        if [ "$NGPU" -ge 2 ]; then
            CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 300 "$PYTHON" benchmarks/bench_gather.py \
                --device cuda --world-size 2 --json "$RESULTS/bench_gather.json" >"$RESULTS/bench_gather.log" 2>&1 \
                || { STATUS=1; say "   bench_gather.py failed (see bench_gather.log)"; }
            say "-- bench_gather.py --device cuda (2 GPUs, NCCL)"
            grep -E "GB/s|ratio|baseline|budget" "$RESULTS/bench_gather.log" | sed 's/^/    /' | tee -a "$SUMMARY"
        else
            say "   bench_gather.py: not run: needs 2 GPUs, $NGPU visible"
        fi
    fi
    if [ -f benchmarks/bench_e2e_ranks.py ]; then
        if [ "$NGPU" -ge 2 ]; then
            say "-- bench_e2e_ranks.py --device cuda --tp 2 --layers 8 --per-update --trainer-etp (2 GPUs, a trainer and an engine rank on each)"
            CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 300 "$PYTHON" benchmarks/bench_e2e_ranks.py \
                --device cuda --tp 2 --layers 8 --per-update --trainer-etp --repeats 5 \
                --json "$RESULTS/bench_e2e_ranks.json" >"$RESULTS/bench_e2e_ranks.log" 2>&1 \
                || { STATUS=1; say "   bench_e2e_ranks.py failed (see bench_e2e_ranks.log)"; }
            grep -E "^(registered|per_update)|BIT CHECK|Error" "$RESULTS/bench_e2e_ranks.log" \
                | sed 's/^/    /' | tee -a "$SUMMARY"
        else
            say "   bench_e2e_ranks.py: not run: needs 2 GPUs, $NGPU visible"
        fi
    fi
fi

say ""
say "   GPU memory after:"
gpu_memory | tee -a "$SUMMARY"
say "== results in $RESULTS (summary.txt, NN-*.log/xml, bench_*.json/log); $(( $(date +%s) - T0 )) s; status $STATUS"
exit $STATUS
