"""What a test of an implementation may not leave behind in the pytest process.

Every in-process implementation runs in the pytest process, one test after another, so
whatever a test leaves there is inherited by the next: a thread still running (a non-daemon
one also keeps the interpreter from exiting), a child process, a process group, a changed
``torch.get_default_dtype()`` or other global torch setting, a changed environment variable,
memory held in a global. Warm rank processes are checked the same way after every call; the
snapshot and the comparison of process groups, threads and torch settings are theirs
(:mod:`pytest_weightsync.ranks.hygiene`).

Around every test that runs against a registered implementation: a snapshot before its setup,
and after its teardown whatever differs (re-sampled for a moment after a garbage collection,
as the ranks do) is

- reported as an :class:`ImplementationLeakWarning` naming the implementation and what was
  left (``-W error::pytest_weightsync.process_hygiene.ImplementationLeakWarning`` makes it an
  error of that test), and recorded in the test's report (user property
  ``weightsync_left_behind``; the JSON report lists it per implementation);
- put back where it can be: global torch settings and environment variables, so the next test
  starts with the session's. Threads and processes cannot be taken back: they are reported
  once; child processes are ended at the end of the session and non-daemon threads are not
  waited for (:mod:`pytest_weightsync.session_guard`).

Memory counts when the resident set grew by more than :data:`MEMORY_GROWTH` bytes, measured
after glibc's ``malloc_trim`` (memory a test freed but the allocator kept would otherwise
count: a realistic-layer test of the reference "grows" by 200 MiB without it). A test is
measured whole, harness included; what the harness keeps on purpose is left out: warm rank
pools and multiprocessing's helper processes, the harness's own threads (named
``weightsync-...``), and the bytes the harness cached during the test (its inputs and expected
states, reported through :func:`harness_keeps`: the first test of a realistic topology would
otherwise "leak" the 200 MiB of inputs every later test of it reuses). File descriptors are not compared here (pytest's own come and go).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import warnings
from typing import Optional

import pytest

from pytest_weightsync.deadline import THREAD_PREFIX
from pytest_weightsync.ranks import hygiene, reaper
from pytest_weightsync.registry import registered_of

__all__ = [
    "ImplementationLeakWarning", "LEFT_BEHIND", "MEMORY_GROWTH", "harness_keeps", "left_behind",
]

#: Growth of the resident set (bytes) over one test that is reported.
MEMORY_GROWTH = 128 * 2**20
#: The user property a test's report carries what it left behind in.
LEFT_BEHIND = "weightsync_left_behind"
#: Environment variables that change on their own during a test.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)
MAX_LISTED = hygiene.MAX_LISTED

_BEFORE = pytest.StashKey[dict]()
_CHILDREN = pytest.StashKey[dict]()
#: Bytes the harness has put in its caches in this process (:func:`harness_keeps`).
_HARNESS_KEPT = [0]


def harness_keeps(nbytes: int) -> None:
    """The harness cached ``nbytes`` more (inputs, expected states, oracle blocks): growth of
    the resident set by that much is the harness's, not the implementation's."""
    _HARNESS_KEPT[0] += max(0, int(nbytes))


class ImplementationLeakWarning(UserWarning):
    """A test of an in-process implementation left something in the pytest process (threads,
    child processes, process groups, changed torch settings or environment, memory). Emitted
    after the test's teardown, so pytest reports it against that test."""


# -- measuring ------------------------------------------------------------------------------


def _direct_children() -> Optional[set[int]]:
    """Pids of this process's children (Linux ``/proc``); ``None`` where that is unknown."""
    try:
        tasks = os.listdir("/proc/self/task")
        found: set[int] = set()
        for tid in tasks:
            with open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(pid) for pid in f.read().split())
        return found
    except (OSError, ValueError):
        return None


def _harness_processes() -> set[int]:
    """Children the harness keeps on purpose: warm rank pools, multiprocessing's helpers."""
    keep = set()
    pool = sys.modules.get("pytest_weightsync.ranks.pool")
    for rank_pool in list(getattr(pool, "_live_pools", ())):
        keep.update(pid for pid in rank_pool.pids if pid is not None)
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    keep.add(getattr(getattr(tracker, "_resource_tracker", None), "_pid", None))
    forkserver = sys.modules.get("multiprocessing.forkserver")
    keep.add(getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None))
    keep.discard(None)
    return keep


def _children() -> set[reaper.Identity]:
    direct = _direct_children()
    if direct is not None and not direct:
        return set()
    table = reaper.process_table()
    me = os.getpid()
    if direct is None:
        direct = {pid for pid, (ppid, _) in table.items() if ppid == me}
    keep = _harness_processes()
    return {(pid, table[pid][1]) for pid in direct if pid in table and pid not in keep}


def _malloc_trim():
    """glibc's ``malloc_trim`` (``None`` elsewhere): memory a test freed stays in the
    allocator's arenas, counted as resident, until it is trimmed."""
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def _rss() -> Optional[int]:
    """Resident bytes of this process once the allocator returned what it keeps free."""
    if _TRIM is not None:
        _TRIM(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def snapshot() -> dict:
    """This process's threads (the harness's own left out), children, torch settings,
    process groups, environment and resident memory, now - in the form
    :func:`pytest_weightsync.ranks.hygiene.differences` compares."""
    threads = {t.ident: t for t in threading.enumerate()
               if not t.name.startswith(THREAD_PREFIX)}
    state = {"process groups": None, "torch": {}, "fds": {}, "stack-dump handler": None}
    if "torch" in sys.modules:
        ranks_view = hygiene.snapshot()
        state["process groups"] = ranks_view["process groups"]
        state["torch"] = ranks_view["torch"]
    state.update({
        "threads": len(threads),
        "python threads": {ident: t.name for ident, t in threads.items()},
        "daemon": {ident: t.daemon for ident, t in threads.items()},
        "children": _children(),
        "environ": dict(os.environ),
        "rss": _rss(),
        "harness kept": _HARNESS_KEPT[0],
    })
    return state


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return text if len(text) <= 80 else text[:77] + "..."


def differences(before: dict, after: dict) -> list[str]:
    """What ``after`` has that ``before`` had not, in words (empty when nothing)."""
    new = [ident for ident in after["python threads"] if ident not in before["python threads"]]
    groups = after["process groups"]
    if groups is not None and before["process groups"] is not None:
        groups = max(groups, before["process groups"])  # what ended is not left behind
    words = hygiene.differences(before, dict(after, threads=before["threads"] + len(new),
                                             **{"process groups": groups}))
    blocking = [after["python threads"][i] for i in new if not after["daemon"].get(i, True)]
    if blocking:
        words.append(f"non-daemon: {', '.join(map(repr, blocking[:MAX_LISTED]))}"
                     f"{', ...' if len(blocking) > MAX_LISTED else ''} (Python waits for a "
                     f"non-daemon thread before it exits)")
    children = sorted(after["children"] - before["children"])
    if children:
        shown = ", ".join(f"pid {pid}: {_command_line(pid)}" for pid, _ in children[:MAX_LISTED])
        more = ", ..." if len(children) > MAX_LISTED else ""
        words.append(f"+{len(children)} child process{'es' if len(children) != 1 else ''} "
                     f"({shown}{more})")
    env_before, env_after = before["environ"], after["environ"]
    changed = {k for k in set(env_before) | set(env_after)
               if env_before.get(k) != env_after.get(k) and k not in VOLATILE_ENV}
    if changed:
        parts = []
        for verb, names in (("set", [k for k in changed if k not in env_before]),
                            ("changed", [k for k in changed if k in env_before and k in env_after]),
                            ("removed", [k for k in changed if k not in env_after])):
            if names:
                parts.append(f"{verb} {', '.join(sorted(names))}")
        words.append("environment variables " + "; ".join(parts))
    if before["rss"] is not None and after["rss"] is not None:
        kept = after.get("harness kept", 0) - before.get("harness kept", 0)
        grown = after["rss"] - before["rss"] - kept
        if grown > MEMORY_GROWTH:
            words.append(f"+{grown / 2**20:.0f} MiB resident memory (still held after a garbage "
                         f"collection)")
    return words


def left_behind(before: dict, settle: float = hygiene.SETTLE) -> tuple[dict, list[str]]:
    """``(now, words)``: :func:`differences` from ``before`` still there after ``settle``
    seconds and a garbage collection (a thread may need a moment to exit)."""
    after = snapshot()
    words = differences(before, after)
    if not words:
        return after, []
    gc.collect()
    deadline = time.monotonic() + settle
    while True:
        after = snapshot()
        words = differences(before, after)
        if not words or time.monotonic() >= deadline:
            return after, words
        time.sleep(0.02)


# -- putting back ---------------------------------------------------------------------------


def _torch_setters() -> dict:
    import torch

    return {
        "default dtype": torch.set_default_dtype,
        "torch threads": torch.set_num_threads,
        "grad mode": torch.set_grad_enabled,
        "deterministic algorithms": torch.use_deterministic_algorithms,
        "anomaly detection": torch.set_anomaly_enabled,
        "default device": torch.set_default_device,
    }


def put_back(before: dict, after: dict) -> list[str]:
    """Restore the global torch settings and environment variables of ``before``; the names
    of what was put back."""
    restored = []
    if before["torch"] and "torch" in sys.modules:
        setters = _torch_setters()
        for key, was in before["torch"].items():
            if after["torch"].get(key) != was and key in setters:
                try:
                    setters[key](was)
                    restored.append(key)
                except Exception:  # noqa: BLE001 - reported as left, whatever else happens
                    continue
    env_changed = False
    for key in set(before["environ"]) | set(after["environ"]):
        if key in VOLATILE_ENV or before["environ"].get(key) == after["environ"].get(key):
            continue
        env_changed = True
        if key in before["environ"]:
            os.environ[key] = before["environ"][key]
        else:
            os.environ.pop(key, None)
    if env_changed:
        restored.append("environment variables")
    return restored


def left_children(config: pytest.Config) -> dict:
    """``{identity: what left it}`` of every child process reported in this session."""
    return config.stash.setdefault(_CHILDREN, {})


# -- hooks ----------------------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    if registered_of(item) is not None:
        item.stash[_BEFORE] = snapshot()
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    yield
    before = item.stash.get(_BEFORE, None)
    if before is None:
        return
    del item.stash[_BEFORE]
    after, words = left_behind(before)
    if not words:
        return
    entry = registered_of(item)
    name = entry.name if entry is not None else "?"
    restored = put_back(before, after)
    children = after["children"] - before["children"]
    for identity in children:
        left_children(item.config)[identity] = f"{name} ({item.nodeid})"
    text = f"{name} left this in the pytest process: {'; '.join(words)}"
    if restored:
        text += f" ({', '.join(restored)} put back for the next test)"
    item.user_properties.append((LEFT_BEHIND, text))
    after_words = []
    if children:
        after_words.append("Its child processes are ended when the session ends")
    if any(not daemon for ident, daemon in after["daemon"].items()
           if ident not in before["daemon"]):
        after_words.append("The session does not wait for its non-daemon threads at exit")
    message = f"{text}{'. ' + '. '.join(after_words) if after_words else ''}"
    path, line = item.location[0], item.location[1]
    warnings.warn_explicit(ImplementationLeakWarning(message), ImplementationLeakWarning,
                           str(item.config.rootpath / path), (line or 0) + 1)
