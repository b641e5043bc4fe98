"""What a failed, hung or untidy rank says about itself, read back for the test report.

:class:`~pytest_weightsync.ranks.pool.RankPool` decides *when* a call failed, hung or left
something behind; this module finds the words for *what* happened, so the report points at the
test's own code: the Python stack a rank dumps on SIGUSR1 (or faulthandler wrote when it
crashed), trimmed of the serving loop; why a rank wrote no stack (the kernel's view of its
signal mask and state); a rank's reply turned into a :class:`RankOutcome`; the processes a call
left below each rank, with their command lines. Everything here reads ``/proc`` and files the
ranks wrote; nothing here starts, stops or signals a rank except to ask for its stack.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

from pytest_weightsync.ranks import reaper as _reaper
from pytest_weightsync.ranks.errors import RankOutcome

__all__ = [
    "children_by_rank",
    "crash_report",
    "dump_stacks",
    "outcome",
    "trim_stack",
    "why_no_stack",
]


def dump_stacks(stack_paths: dict[int, str], pids: dict[int, int | None]) -> dict[int, str]:
    """Ask each rank's faulthandler for its Python stacks (SIGUSR1) and read them back."""
    # A rank creates its stack file right before arming faulthandler: without the file
    # there is nobody to answer (a rank still importing torch), so do not wait for it.
    ranks = [rank for rank in sorted(stack_paths) if os.path.exists(stack_paths[rank])]
    if not ranks:
        return {}
    offsets = {}
    for rank in ranks:
        path = stack_paths[rank]
        offsets[rank] = os.path.getsize(path) if os.path.exists(path) else 0
        try:
            os.kill(pids[rank], signal.SIGUSR1)
        except (ProcessLookupError, TypeError):
            pass
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + 2.0
    last_sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        time.sleep(0.05)
        settled = True
        for rank in ranks:
            path = stack_paths[rank]
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if size == offsets[rank] or last_sizes.get(rank) != size:
                settled = False
            last_sizes[rank] = size
        if settled:
            break
    for rank in ranks:
        try:
            with open(stack_paths[rank]) as f:
                f.seek(offsets[rank])
                text = f.read()
        except OSError:
            continue
        if text.strip():  # nothing written: the rank did not answer (see why_no_stack)
            stacks[rank] = trim_stack(text)
    return stacks


def why_no_stack(pid) -> str:
    """What the kernel says about a rank that wrote no stack for SIGUSR1: ignored or
    blocked there, or a process that cannot run (stopped, in uninterruptible sleep)."""
    status = _proc_status(pid)
    if not status:
        return ""
    bit = 1 << (signal.SIGUSR1 - 1)
    reasons = []
    if int(status.get("SigIgn", "0"), 16) & bit:
        reasons.append("it ignores SIGUSR1 (the code under test set SIG_IGN)")
    elif int(status.get("SigBlk", "0"), 16) & bit:
        reasons.append("SIGUSR1 is blocked in its main thread")
    elif int(status.get("SigCgt", "0"), 16) & bit:
        reasons.append("a handler caught SIGUSR1 but wrote no stack: the code under test "
                       "may have replaced faulthandler's")
    state = status.get("State", "")
    if state and not state.startswith(("S", "R")):
        reasons.append(f"process state {state}")
    return f": {'; '.join(reasons)}" if reasons else ""


def crash_report(path: str) -> str:
    """What faulthandler wrote at ``path`` when the rank crashed (segfault, abort), trimmed; or ''."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return trim_stack(text).strip("\n") if text.strip() else ""


def trim_stack(text: str) -> str:
    """Drop the frames of the rank's serving loop and interpreter bootstrap from a dump.

    What is left starts at the user's function, so the report shows where *it* is stuck.
    """
    from pytest_weightsync.ranks import worker

    plumbing = (f'File "{os.path.abspath(worker.__file__)}"', f"{os.sep}multiprocessing{os.sep}", 'File "<string>"')
    lines = [line for line in text.splitlines() if not any(p in line for p in plumbing)]
    # A crash dump ends with the list of loaded extension modules: long, and no help here.
    return "\n".join(line for line in lines if not line.startswith("Extension modules:")) + "\n"


def _proc_status(pid) -> dict[str, str]:
    """``/proc/PID/status`` as a dict (empty where there is none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except (OSError, ValueError, TypeError):
        return {}


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text if len(text) <= 80 else text[:77] + "..."


def children_by_rank(children, rank_pids: list[int]) -> dict[int, str]:
    """``{rank: "+N child processes (pid P: CMD, ...)"}`` for processes left below each rank."""
    if not children:
        return {}
    table = _reaper.process_table()
    out = {}
    for rank, pid in enumerate(rank_pids):
        mine = sorted(p for p, _ in _reaper.descendants([pid], table) & children)
        if mine:
            shown = ", ".join(f"pid {p}: {_command_line(p)}" for p in mine[:3])
            more = ", ..." if len(mine) > 3 else ""
            plural = "es" if len(mine) != 1 else ""
            out[rank] = f"+{len(mine)} child process{plural} still running ({shown}{more})"
    return out


def outcome(rank: int, message: tuple) -> RankOutcome:
    kind = message[0]
    if kind == "error":
        _, summary, detail, exc_bytes = message
        exception = None
        if exc_bytes is not None:
            try:
                exception = pickle.loads(exc_bytes)
            except Exception:
                exception = None
        return RankOutcome(rank, "error", summary, detail, exception)
    if kind == "died":
        code = message[1]
        how = f"killed by signal {_signal_name(-code)}" if isinstance(code, int) and code < 0 else f"exit code {code}"
        return RankOutcome(rank, "died", f"process died without answering ({how})")
    if kind == "skip":
        return RankOutcome(rank, "error", f"skipped while starting: {message[1]}")
    return RankOutcome(rank, "error", f"unexpected reply {kind!r}")


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)
