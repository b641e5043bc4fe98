"""What a killed session left behind, cleaned up by the next one.

SIGKILL gives pytest no chance to clean up: the ranks die with it (``PR_SET_PDEATHSIG``), but
the pool's temporary directory stays, and so do processes a test body started. Each pool
therefore holds an exclusive ``flock`` on a file in its directory for as long as it lives and
writes there the processes it saw below its ranks. The kernel drops the lock when the owner
dies, however it dies; the next pool to start (in any session sharing the temporary
directory) takes the lock of a directory nobody holds, ends the processes listed in it that
are still the same processes (pid and start time), and removes the directory.

A directory is only swept once it is :data:`MIN_AGE` seconds old, so one that another pool
created a moment ago, before it could take its lock, is never touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

from pytest_weightsync.ranks import reaper as _reaper

PREFIX = "weightsync-ranks-"
LOCK_NAME = "owner.lock"
RECORD_NAME = "processes.txt"
#: Seconds a directory must exist before a sweep may remove it.
MIN_AGE = 60.0


def claim(directory: str) -> int | None:
    """Lock ``directory`` for this process's lifetime; the descriptor to close at cleanup."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: nothing to sweep with
        return None
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # pragma: no cover - a fresh private directory is never locked
        os.close(fd)
        return None
    return fd


def record(directory: str | None, identities) -> None:
    """Write the processes seen below the ranks, replacing the previous list atomically."""
    if directory is None:
        return
    path = os.path.join(directory, RECORD_NAME)
    try:
        with open(path + ".tmp", "w") as f:
            f.write("".join(f"{pid} {start!r}\n" for pid, start in sorted(identities)))
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def sweep(parent: str | None = None, now: float | None = None) -> list[str]:
    """End the recorded processes of every abandoned pool directory and remove it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return []
    parent = tempfile.gettempdir() if parent is None else parent
    now = time.time() if now is None else now
    swept = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return []
    for name in names:
        directory = os.path.join(parent, name)
        lock = os.path.join(directory, LOCK_NAME)
        try:
            if now - os.stat(directory).st_mtime < MIN_AGE or not os.path.exists(lock):
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner is alive
            _end_recorded(directory)
            shutil.rmtree(directory, ignore_errors=True)
            swept.append(directory)
        finally:
            os.close(fd)
    return swept


def _end_recorded(directory: str) -> None:
    identities = set()
    try:
        with open(os.path.join(directory, RECORD_NAME)) as f:
            for line in f:
                pid, start = line.split()
                identities.add((int(pid), float(start)))
    except (OSError, ValueError):
        return
    _reaper.send(identities, signal.SIGKILL)
