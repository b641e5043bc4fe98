#!/usr/bin/env bash
# Installs everything, then runs every CPU test: the plugin's own tests and all suites, with
# the CPU throughput guard against the committed baseline. GPU-marked tests skip on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh || exit 1
# pytest runs in the background so that stopping this script (Ctrl-C, SIGTERM) stops it too
# instead of leaving it and its xdist workers orphaned: the plugin turns SIGTERM into an
# interrupt that ends every rank pool (a background job ignores SIGINT, so SIGTERM is sent).
.venv/bin/python -m pytest -p weightsync -n 2 tests/ suites/ --weightsync-selftests \
  --weightsync-baseline ci/baselines/cpu.json "$@" &
child=$!
trap 'kill -TERM $child 2>/dev/null; wait $child; exit 130' INT
trap 'kill -TERM $child 2>/dev/null; wait $child; exit 143' TERM
wait $child
rc=$?
trap - INT TERM
# pytest exits 5 when it collected no test: that is a broken run, not a green one.
if [ $rc -eq 5 ]; then echo "test-all: no tests were collected"; exit 1; fi
# The installed layout: wheel + example in a fresh venv, suites run from outside the checkout.
bash ci/wheel-check.sh || { echo "test-all: wheel check failed"; [ $rc -ne 0 ] || rc=1; }
exit $rc
