"""Find and end every process a rank started, including the ones that left its process group.

Killing a rank's process group ends what a test body started with a plain ``subprocess.Popen``;
a process started with ``start_new_session=True`` (or any daemon that called ``setsid``) is in
another group and survives it. Such processes are found by parentage instead: the rank is a
child subreaper (see :mod:`pytest_weightsync.ranks.worker`), so even a double-forked daemon
stays below it while the rank lives, and the pool also records what it saw while a call was
running, for a rank that dies before teardown.

A process is identified by (pid, start time), never by pid alone, so a recorded pid that the
kernel reused for an unrelated process is left alone. Linux reads ``/proc`` directly (no
dependency); elsewhere ``psutil`` is used when it is installed, and nothing is found otherwise.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

#: A process: (pid, start time in the kernel's own unit). Stable for the process's life.
Identity = tuple[int, float]
#: Helper processes a library starts once per process and that end by themselves once their
#: clients are gone: torch's shared-memory manager (started by the first CPU tensor shared
#: under the ``file_system`` strategy, which many RL senders choose) exits a few seconds after
#: its last client and removes its directory then - killed, it leaves the directory behind.
#: They are never counted as left behind nor ended here (``/proc``'s 15-character names).
SERVICES = (b"torch_shm_manag",)


def process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, start time) of every live (non-zombie) process visible here."""
    if os.path.isdir("/proc/self"):
        return _proc_table()
    try:
        import psutil
    except ImportError:
        return {}
    table = {}
    for proc in psutil.process_iter(["ppid", "create_time", "status"]):
        info = proc.info
        if info.get("ppid") is None or info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.name().encode()[:15] in SERVICES:
                continue
        except psutil.Error:
            continue
        table[proc.pid] = (info["ppid"], info["create_time"])
    return table


def _proc_table() -> dict[int, tuple[int, float]]:
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        # the last ")". Fields after it start at field 3 (state); starttime is field 22.
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) < 20 or fields[0] == b"Z":
            continue
        if data[data.find(b"(") + 1 : data.rfind(b")")] in SERVICES:
            continue
        table[int(name)] = (int(fields[1]), float(fields[19]))
    return table


def descendants(roots: Iterable[int], table: dict[int, tuple[int, float]] | None = None) -> set[Identity]:
    """Every live process below the given pids (children, grandchildren, ...)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[Identity] = set()
    stack = [pid for pid in roots if pid is not None]
    seen = set(stack)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                found.add((child, table[child][1]))
                stack.append(child)
    return found


def alive(identities: Iterable[Identity], table: dict[int, tuple[int, float]] | None = None) -> set[Identity]:
    """The subset of ``identities`` still running as the same process (not a reused pid)."""
    table = process_table() if table is None else table
    return {(pid, start) for pid, start in identities if pid in table and table[pid][1] == start}


def send(identities: Iterable[Identity], sig: int) -> None:
    """Signal each process that is still the one recorded; vanished ones are skipped."""
    for pid, _ in alive(identities):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_all(roots: Iterable[int], recorded: Iterable[Identity] = ()) -> set[Identity]:
    """Stop, then kill, every descendant of ``roots`` and every recorded process still alive.

    Stopping first keeps a process from forking a child the kill would miss; the search is
    repeated until it finds nothing new (orphans of a stopped process move to the subreaper
    rank, which is one of the roots). Returns what was killed.
    """
    roots = [pid for pid in roots if pid is not None]
    victims = alive(recorded)
    send(victims, signal.SIGSTOP)
    for _ in range(4):
        found = descendants(roots) - victims
        if not found:
            break
        send(found, signal.SIGSTOP)
        victims |= found
    send(victims, signal.SIGKILL)
    return victims
