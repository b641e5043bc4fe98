#!/usr/bin/env bash
# Proves the wheel-only path a third party takes: `pip install pytest-weightsync mypkg`, then
# `pytest -p weightsync --pyargs pytest_weightsync.suites --weightsync-only NAME`.
#
# 1. build the pytest-weightsync and example wheels from a copy of the sources (nothing is
#    written into the checkout); check each wheel's top-level names, and that the wheel ships
#    the conformance suites and their harness but not the reference's self-tests;
# 2. make a fresh venv in a temp dir OUTSIDE the checkout holding only torch (linked from
#    .venv with the packages torch itself requires: a 5 GB CUDA build is not reinstalled), then
#    `pip install` both wheels the plain way: pip resolves everything else (pytest, hypothesis,
#    megatron-core for the example's distributed exporter) from the package index, pinned by
#    ci/constraints.txt so nothing can replace torch;
#    Before and after the install, a foreign project's suite runs identically
#    (ci/foreign_check.py): the plugin is inert in a session that does not ask for it;
# 3. from a temp folder outside the checkout, run the whole shipped conformance set:
#    - against the example package's implementation (`example`: loader + distributed
#      exporter): exit 0, verdict PASS;
#    - against each broken twin (`example-swapped`, `example-unregrouped`): exit 1, FAIL with
#      the bug located; the JSON's rerun command of the failing cell reruns exactly it;
#    - against the example's LoRA adapter loader (`example-adapter`): exit 0, verdict PASS.
# Exits non-zero on any failure. Everything lives in one temp dir, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY="$REPO/.venv/bin/python"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/weightsync-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "wheel-check: FAIL: $*" >&2; exit 1; }
start=$SECONDS

# 1. wheels, built from copies of the sources (setuptools writes build/ and *.egg-info in-tree)
mkdir -p "$WORK/src" "$WORK/dist"
tar -C "$REPO" --exclude=./.venv --exclude=./.git --exclude='*.egg-info' --exclude=./build --exclude='*/build' \
    --exclude='__pycache__' --exclude=.hypothesis --exclude=.pytest_cache --exclude='./.wt-*' \
    -cf - . | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index "$WORK/src" -w "$WORK/dist" \
    || fail "building the pytest-weightsync wheel"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index \
    "$WORK/src/examples/weightsync-example-loader" -w "$WORK/dist" || fail "building the example wheel"

"$PY" - "$WORK/dist" <<'EOF' || fail "unexpected contents of a wheel"
import sys, zipfile, pathlib
allowed = {"pytest_weightsync": {"pytest_weightsync"},
           "weightsync_example_loader": {"weightsync_example_loader"}}
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    tops = {t for t in tops if not t.endswith((".dist-info", ".data"))}
    wanted = next((v for k, v in allowed.items() if k in tops), None)
    if wanted is None or tops != wanted:
        sys.exit(f"{wheel.name}: top-level names {sorted(tops)}")
    if "pytest_weightsync" in tops:
        shipped = {n for n in names if n.startswith("pytest_weightsync/suites/")}
        for need in ("conformance/test_loader.py", "conformance/test_distributed_exporter.py",
                     "harness/judge.py", "conftest.py"):
            if f"pytest_weightsync/suites/{need}" not in shipped:
                sys.exit(f"{wheel.name} lacks pytest_weightsync/suites/{need}")
        selftests = sorted(n for n in shipped if "/selftest/" in n)
        if selftests:
            sys.exit(f"{wheel.name} ships the reference's self-tests: {selftests[:3]}")
    print(f"wheel-check: {wheel.name}: top-level {sorted(tops)}")
EOF

# 2. a fresh venv holding only torch (and what torch requires), then a plain pip install
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$WORK/torch"
"$PY" - "$WORK/torch" <<'EOF' || fail "linking torch into the fresh venv"
import os, re, sys
from importlib import metadata
from pathlib import Path

target = Path(sys.argv[1])
wanted, todo = set(), ["torch"]
while todo:  # torch and the distributions it requires, transitively (markers evaluated)
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in wanted:
        continue
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    wanted.add(name)
    from packaging.requirements import Requirement
    for spec in dist.requires or ():
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
linked = set()
for name in sorted(wanted):
    dist = metadata.distribution(name)
    for f in dist.files or ():
        top = f.parts[0]
        if top in linked or top in ("..", "__pycache__") or top.endswith(".pth"):
            continue
        source = Path(dist.locate_file(top))
        if source.exists():
            os.symlink(source, target / top)
            linked.add(top)
print(f"wheel-check: fresh venv gets torch and {len(wanted) - 1} packages it requires: "
      + ", ".join(sorted(wanted - {"torch"})))
EOF
echo "$WORK/torch" > "$VSITE/weightsync-wheel-check-torch.pth"
# 2b. a foreign project's suite (ci/foreign-suite: threads, atexit, its own gpu marker and alarm
#     handler, a session child process, a warning, a failing test), run before the wheel is
#     installed - with pytest and hypothesis, the wheel's other pytest plugin, already there -
#     and again after: identical (ci/foreign_check.py)
"$VPY" -m pip install --quiet --disable-pip-version-check -c "$REPO/ci/constraints.txt" \
    pytest hypothesis 2> >(grep -v "is ignored: it is neither" >&2) \
    || fail "pip install of pytest and hypothesis into the fresh venv"
"$VPY" "$REPO/ci/foreign_check.py" record "$VPY" "$WORK/foreign-without.json" \
    || fail "recording the foreign suite without the wheel"
"$VPY" -m pip install --quiet --disable-pip-version-check -c "$REPO/ci/constraints.txt" \
    "$WORK"/dist/*.whl 2> >(grep -v "is ignored: it is neither" >&2) \
    || fail "pip install of the wheels into the fresh venv"
"$VPY" "$REPO/ci/foreign_check.py" record "$VPY" "$WORK/foreign-with.json" \
    || fail "recording the foreign suite with the wheel"
"$VPY" "$REPO/ci/foreign_check.py" compare "$WORK/foreign-without.json" "$WORK/foreign-with.json" \
    || fail "the wheel changed a foreign project's test run"
"$VPY" "$REPO/ci/foreign_check.py" record "$VPY" "$WORK/foreign-named.json" -p weightsync \
    || fail "recording the foreign suite with -p weightsync"
"$VPY" "$REPO/ci/foreign_check.py" compare "$WORK/foreign-without.json" "$WORK/foreign-named.json" \
    --named || fail "naming the plugin changed a foreign test's outcome or side effects"
"$VPY" "$REPO/ci/foreign_check.py" imports "$VPY" || fail "the idle plugin imports too much"
mkdir -p "$WORK/run"
cd "$WORK/run"  # outside the checkout: nothing may come from the source tree
"$VPY" - "$WORK/venv" <<'EOF' || fail "the fresh venv does not hold what was installed"
import sys, importlib.util
from importlib import metadata
import pytest_weightsync, pytest_weightsync.suites, weightsync_example_loader
for mod in (pytest_weightsync, pytest_weightsync.suites, weightsync_example_loader):
    if not mod.__file__.startswith(sys.argv[1]):
        sys.exit(f"{mod.__name__} imported from {mod.__file__}, not the fresh venv")
for name in ("reference_impl", "suites", "pytest_weightsync.suites.selftest"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name!r} is importable: the wheel must not install it")
if metadata.version("torch").split("+")[0] != "2.14.1":
    sys.exit(f"torch {metadata.version('torch')} in the fresh venv: an install replaced it")
print("wheel-check: imports come from the fresh venv; torch", metadata.version("torch"))
EOF

# 3. the whole shipped conformance set, run from outside the checkout
export WEIGHTSYNC_OPTIONAL_BUILTINS=none  # no SGLang here anyway; be explicit
suite() { "$VPY" -m pytest -p weightsync --pyargs pytest_weightsync.suites -q -p no:cacheprovider \
          -W ignore "$@"; }
inner() { sed 's/^/wheel-check: inner run: /' "$1" | tail -40 >&2; }
matrix() { grep -E "^(implementation|example)" "$1" | sed 's/^/wheel-check: matrix: /'; }

# expect_pass NAME REPORT "ROLES" "PROPERTIES": NAME's run alone exits 0, its verdict is PASS
# with exactly ROLES, every one of PROPERTIES ran, and no self-test was shipped
expect_pass() {
    local name=$1 report=$2 roles=$3 props=$4
    set +e
    suite --weightsync-only "$name" --weightsync-report "$report.json" > "$report.txt" 2>&1
    local rc=$?
    set -e
    matrix "$report.txt"
    [ $rc -eq 0 ] || { inner "$report.txt"; fail "$name's conformance run exited $rc, expected 0"; }
    "$VPY" - "$report.json" "$name" "$roles" "$props" <<'EOF' || { inner "$report.txt"; fail "$name is not PASS"; }
import json, sys
report = json.load(open(sys.argv[1]))
name, roles, wanted = sys.argv[2], set(sys.argv[3].split()), sys.argv[4].split()
(impl,) = report["implementations"]
assert impl["name"] == name and impl["verdict_word"] == "PASS", impl
assert set(impl["roles"]) == roles, impl
props = set(report["properties"])
for prop in wanted:
    assert prop in props, (prop, props)
assert not any("selftest" in t["nodeid"] for t in report["tests"])
print(f"wheel-check: {name} PASS ({impl['ran']} tests, properties {sorted(props)})")
EOF
}

expect_pass example ok "loader distributed_exporter" \
    "bit_exact in_place no_stale_values distributed_export_bit_exact coverage model_bit_exact tied_embeddings targets"

for twin in example-swapped example-unregrouped; do
    set +e
    suite --weightsync-only "$twin" -x --weightsync-report "$twin.json" > "$twin.txt" 2>&1
    rc=$?
    set -e
    matrix "$twin.txt"
    [ $rc -eq 1 ] || { inner "$twin.txt"; fail "$twin exited $rc, expected 1 (a located failure)"; }
    "$VPY" - "$twin.json" "$twin" > rerun.sh <<'EOF' || { inner "$twin.txt"; fail "$twin did not fail located"; }
import json, sys
report = json.load(open(sys.argv[1]))
twin = sys.argv[2]
(impl,) = report["implementations"]
assert impl["verdict_word"] == "FAIL", impl
failure = report["failures"][0]
wanted = {"example-swapped": "gate/up halves swapped",
          "example-unregrouped": "first at layer=0 expert=0 projection="}[twin]
assert wanted in failure["message"], failure["message"][:500]
print(failure["rerun"])
EOF
    set +e
    bash rerun.sh > rerun.txt 2>&1
    rc=$?
    set -e
    grep -q "1 failed" rerun.txt && [ $rc -eq 1 ] \
        || { inner rerun.txt; fail "the rerun command of $twin's failing cell did not rerun it"; }
    echo "wheel-check: $twin FAIL, located; its rerun command reruns exactly the failing cell"
done

# the example's LoRA adapter loader, alone: exit 0, verdict PASS on every LoRA property it claims
expect_pass example-adapter adapter "adapter_loader" \
    "lora_bit_exact lora_coverage lora_scale_once base_untouched lora_versions"
echo "wheel-check: OK in $((SECONDS - start)) s"
