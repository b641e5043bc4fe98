# Sourced by ci/test-all.sh. run_forwarding CMD ARGS... runs CMD as a child of the script,
# in a process group of its own with SIGINT at its default, and passes SIGINT, SIGTERM and
# SIGHUP sent to the script on to that whole group (CMD, pytest-xdist workers, rank
# processes); it returns CMD's exit status and sets FORWARDED_SIGNAL to the last signal passed
# on (empty when none was).
#
# Why not a foreground child: bash runs a trap only after the foreground command ends, and
# without a trap SIGTERM ends the script at once - either way a stopped script left its pytest
# and workers running. Why not a plain background job: a script's background jobs start with
# SIGINT ignored, and the suites' own Ctrl-C tests need it delivered. Why a group of its own: a
# Ctrl-C at the terminal reaches the script's group only, so pytest gets it once (from here),
# not twice (a second Ctrl-C cuts pytest's report short).
#
# A script killed outright (SIGKILL) cannot pass anything on: the child asks the kernel for a
# SIGTERM when its parent dies (Linux's PR_SET_PDEATHSIG), so it does not outlive the script.
#
# FORWARD_PYTHON names the interpreter that resets SIGINT and makes the group (default python3).

run_forwarding() {
  local child="" rc sig parent=$BASHPID
  FORWARDED_SIGNAL=""
  for sig in INT TERM HUP; do
    # shellcheck disable=SC2064  # $sig now, $child when the signal comes
    trap "FORWARDED_SIGNAL=$sig; [ -n \"\$child\" ] && { kill -$sig -- -\$child 2>/dev/null || kill -$sig \$child 2>/dev/null; }" "$sig"
  done
  "${FORWARD_PYTHON:-python3}" -c '
import ctypes, os, signal, sys
os.setpgid(0, 0)
signal.signal(signal.SIGINT, signal.SIG_DFL)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass  # not Linux: the traps still pass signals on
if os.getppid() != int(sys.argv[1]):
    sys.exit(128 + signal.SIGTERM)  # the script died before the request was made
os.execvp(sys.argv[2], sys.argv[2:])
' "$parent" "$@" &
  child=$!
  # wait returns early when a trap ran; wait again until the child is gone
  while kill -0 "$child" 2>/dev/null; do wait "$child"; done
  wait "$child"
  rc=$?
  trap - INT TERM HUP
  return $rc
}
