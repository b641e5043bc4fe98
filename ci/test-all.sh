#!/usr/bin/env bash
# Installs everything, then runs every CPU test: the plugin's own tests and all suites, with
# the CPU throughput guard against the committed baseline. GPU-marked tests skip on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh || exit 1
# pytest runs as a child that gets the signals sent to this script (Ctrl-C, SIGTERM, SIGHUP),
# with its xdist workers: stopping the script never leaves them running (ci/forward-signals.sh).
. ci/forward-signals.sh
FORWARD_PYTHON=.venv/bin/python run_forwarding .venv/bin/python -m pytest -p weightsync -n 2 --dist worksteal \
  tests/ suites/ --weightsync-selftests --weightsync-baseline ci/baselines/cpu.json "$@"
rc=$?
if [ -n "$FORWARDED_SIGNAL" ]; then echo "test-all: stopped by SIG$FORWARDED_SIGNAL"; exit $rc; fi
# pytest exits 5 when it collected no test: that is a broken run, not a green one.
if [ $rc -eq 5 ]; then echo "test-all: no tests were collected"; exit 1; fi
# The installed layout: wheel + example in a fresh venv, suites run from outside the checkout.
bash ci/wheel-check.sh || { echo "test-all: wheel check failed"; [ $rc -ne 0 ] || rc=1; }
exit $rc
