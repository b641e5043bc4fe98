#!/usr/bin/env bash
# Creates (or reuses) .venv with every pinned dependency and installs this repo editable.
# Usage: bash ci/install.sh            (from the repo root; VENV=path to use another folder)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
C=(-c ci/constraints.txt)
pipq() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ ! -x "$VENV/bin/python" ]; then
  echo "install: creating $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" - <<'PYEOF' || { echo "install: Python 3.10+ required"; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)
PYEOF

# An existing .venv installed from the same pins is reused as it is (pip would spend minutes
# re-resolving it); the version check below still runs.
STAMP="$VENV/.weightsync-install"
want=$(cat ci/install.sh ci/constraints.txt ci/requirements-*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "install: $VENV is up to date with ci/ and pyproject.toml"
else
  rm -f "$STAMP"
  echo "install: torch"
  pipq "${C[@]}" -r ci/requirements-torch.txt
  echo "install: test tools"
  pipq "${C[@]}" -r ci/requirements-test.txt
  echo "install: megatron-core"
  pipq "${C[@]}" -r ci/requirements-megatron.txt
  # what SGLang's MoE layer imports first, then SGLang itself without its dependencies: in the
  # other order pip's resolver would list every SGLang dependency left out on purpose as a
  # 60-line "ERROR: ... dependency conflicts" block on a successful install
  echo "install: what SGLang's MoE layer imports, then sglang (no deps)"
  pipq "${C[@]}" -r ci/requirements-sglang-deps.txt
  pipq --no-deps -r ci/requirements-sglang.txt
  echo "install: megatron-bridge (no deps; only its weight mappings are used)"
  pipq --no-deps "${C[@]}" -r ci/requirements-bridge.txt
  echo "install: pytest-weightsync (editable)"
  pipq --no-deps -e .
fi

# vLLM's source for the vLLM layout checks (suites/selftest/test_vllm_layouts.py): its wheel,
# pinned by hash, downloaded once into .cache/vllm and read there as a zip - never installed
# (it pins another torch). Skipped when present; without network only a non-CI run goes on.
VLLM_WHEEL=.cache/vllm/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
if [ -f "$VLLM_WHEEL" ]; then
  echo "install: vLLM source wheel present ($VLLM_WHEEL)"
else
  echo "install: vLLM source wheel (download only, ~340 MB)"
  if ! "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
      --implementation cp --abi abi3 -d .cache/vllm -r ci/requirements-vllm-source.txt \
      2> >(grep -v "is ignored: it is neither" >&2); then
    if [ -n "${CI:-}" ]; then echo "install: could not fetch $VLLM_WHEEL"; exit 1; fi
    echo "install: WARNING could not fetch $VLLM_WHEEL; the vLLM source checks will skip"
  fi
fi

# No later install may replace the torch pair sglang pins.
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
want = {"torch": "2.14.1", "torchvision": "0.29.1", "megatron-core": "0.16.1", "sglang": "0.5.23",
        "megatron-bridge": "0.3.1"}
bad = {k: md.version(k) for k, v in want.items() if md.version(k).split("+")[0] != v}
if bad:
    raise SystemExit(f"install: wrong versions after install: {bad}, expected {want}")
import importlib.util
if importlib.util.find_spec("vllm") is not None:
    raise SystemExit("install: vllm is importable in the venv; it must only be fetched as source")
import torch
import pytest_weightsync.reference_impl.backends as backends
bridge = backends.probe("megatron_bridge")
if not bridge.available:
    raise SystemExit(f"install: {bridge.reason}")
print(f"install: ok - torch {torch.__version__}, threads default {torch.get_num_threads()}")
PYEOF
echo "$want" > "$STAMP"
