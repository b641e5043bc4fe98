#!/usr/bin/env bash
# Proves the installable layout: the wheel alone (no checkout) carries the plugin, the
# reference implementation and the conformance suites, under the one top-level name
# pytest_weightsync.
#
# 1. build the pytest-weightsync and example wheels from a copy of the sources (nothing is
#    written into the checkout);
# 2. check each wheel's top-level names (pytest_weightsync / weightsync_example_loader only);
# 3. make a fresh venv in a temp dir OUTSIDE the checkout; give it the heavy dependencies
#    without reinstalling them (a .pth file pointing at a directory of symlinks to everything
#    in .venv's site-packages except this project's own installs), then pip install --no-deps
#    both wheels;
# 4. from a temp folder outside the checkout, run a small selection of the installed suites
#    with `pytest -p weightsync --pyargs pytest_weightsync.suites`: the suites' conftest must
#    parametrize moe_case, the example loader must pass and its swapped twin must fail.
# Exits non-zero on any failure. Everything lives in one temp dir, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY="$REPO/.venv/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
WORK=$(mktemp -d "${TMPDIR:-/tmp}/weightsync-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "wheel-check: FAIL: $*" >&2; exit 1; }
start=$SECONDS

# 1. wheels, built from copies of the sources (setuptools writes build/ and *.egg-info in-tree)
mkdir -p "$WORK/src" "$WORK/dist"
tar -C "$REPO" --exclude=./.venv --exclude=./.git --exclude='*.egg-info' --exclude=./build \
    --exclude='__pycache__' --exclude=.hypothesis --exclude=.pytest_cache -cf - . \
    | tar -C "$WORK/src" -xf -
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index "$WORK/src" -w "$WORK/dist" \
    || fail "building the pytest-weightsync wheel"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index \
    "$WORK/src/examples/weightsync-example-loader" -w "$WORK/dist" || fail "building the example wheel"

# 2. top-level names of each wheel
"$PY" - "$WORK/dist" <<'EOF' || fail "unexpected top-level names in a wheel"
import sys, zipfile, pathlib
allowed = {"pytest_weightsync": {"pytest_weightsync"},
           "weightsync_example_loader": {"weightsync_example_loader"}}
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    tops = {n.split("/", 1)[0] for n in zipfile.ZipFile(wheel).namelist()}
    names = {t for t in tops if not t.endswith((".dist-info", ".data"))}
    wanted = next((v for k, v in allowed.items() if k in names), None)
    if wanted is None or names != wanted:
        sys.exit(f"{wheel.name}: top-level names {sorted(names)}")
    print(f"wheel-check: {wheel.name}: top-level {sorted(names)}")
EOF

# 3. fresh venv with the heavy dependencies linked in, not reinstalled
"$PY" -m venv --without-pip "$WORK/venv"
VPY="$WORK/venv/bin/python"
VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$WORK/deps"
for entry in "$SITE"/*; do
    name=$(basename "$entry")
    case "$name" in
        pytest_weightsync*|__editable__*|weightsync_example*|*.pth|__pycache__) continue ;;
    esac
    ln -s "$entry" "$WORK/deps/$name"
done
echo "$WORK/deps" > "$VSITE/weightsync-wheel-check-deps.pth"
"$PY" -m pip --python "$VPY" install --quiet --no-deps --no-index "$WORK"/dist/*.whl \
    || fail "installing the wheels into the fresh venv"

# 4. the installed suites, run from outside the checkout
mkdir -p "$WORK/run"
cd "$WORK/run"
"$VPY" - "$WORK/venv" <<'EOF' || fail "the installed packages are not the ones imported"
import sys, importlib.util
import pytest_weightsync, pytest_weightsync.reference_impl, pytest_weightsync.suites
import weightsync_example_loader
for mod in (pytest_weightsync, pytest_weightsync.reference_impl, pytest_weightsync.suites,
            weightsync_example_loader):
    if not mod.__file__.startswith(sys.argv[1]):
        sys.exit(f"{mod.__name__} imported from {mod.__file__}, not the fresh venv")
for name in ("reference_impl", "suites"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"a top-level {name!r} is importable: the wheel must not install one")
print("wheel-check: imports come from the fresh venv; no top-level reference_impl/suites")
EOF
TOPOLOGY="L4E8H8I2-T.tp2ep4etp1pp2seq-R.tp1ep2dp1gu"
set +e
# The loader suite module by its installed name: its package conftest (moe_case) must load.
"$VPY" -m pytest -p weightsync --pyargs pytest_weightsync.suites.test_conformance \
    -p no:cacheprovider -k "on_every_rank and $TOPOLOGY" \
    --weightsync-only example --weightsync-only example-swapped -v -W ignore > out.txt 2>&1
rc=$?
set -e
# Show the matrix, prefixed: the inner run's own closing line ("2 failed, ...": the swapped twin
# failing as it must) would read like the outcome of the whole CI run.
grep -E "^(implementation|example)" out.txt | sed 's/^/wheel-check: matrix: /'
fail() { sed 's/^/wheel-check: inner run: /' out.txt | tail -40 >&2; echo "wheel-check: FAIL: $*" >&2; exit 1; }
[ $rc -eq 1 ] || fail "expected exit code 1 (example passes, example-swapped fails), got $rc"
grep -Eq "test_loader_lands_bit_exact_on_every_rank\[$TOPOLOGY-example-(compat|packed|direct)\] PASSED" out.txt \
    || fail "no moe_case-parametrized test of the example ran (suites' conftest not found?)"
grep -Eq "^example +[0-9]+/0/0 +PASS" out.txt || fail "the example loader did not pass"
grep -Eq "^example-swapped +0/[1-9][0-9]*/0 +FAIL" out.txt || fail "example-swapped did not fail"
echo "wheel-check: OK in $((SECONDS - start)) s"
