"""What a call may not leave behind in a warm rank process.

A warm rank serves test after test, so whatever one call leaves in the process is inherited
by every later one: an exporter that re-initializes Megatron's ``parallel_state`` without
destroying the groups leaks about 17 process groups, 51 threads and 76 file descriptors per
call (each gloo group holds threads and sockets) until the fd limit ends the session; a
``torch.set_default_dtype`` or ``set_num_threads`` changes what every later test computes.

This module runs in the rank (it imports torch, which every rank has already). Right after
start-up the rank warms up what torch and the backend create lazily on first use (the
communicator of the default group, the intra-op thread pool, the autograd engine) and takes
a :func:`snapshot`; after every call the pool asks for :func:`leaks` against it. Counts are
re-sampled for a moment (after a garbage collection) before they count: a destroyed gloo
group's threads may need a few milliseconds to exit.

Child processes are checked by the pool itself, from outside (see
:mod:`pytest_weightsync.ranks.reaper`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time

from pytest_weightsync.ranks.reaper import SERVICES

#: Seconds a changed count may take to settle back before it counts as left behind.
SETTLE = 0.5
#: Most names (threads, files) listed per kind in a message.
MAX_LISTED = 3


def warm_up(device: str) -> None:
    """Create what torch and the backend create lazily, so a later call that merely uses them
    is not blamed: the default group's communicator (one collective), the intra-op thread
    pool (one parallel op), the autograd engine (one backward)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        probe = torch.zeros(1, device=device)
        dist.all_reduce(probe)
        dist.barrier()
    a = torch.ones(256, 256)
    (a @ a).sum()
    (torch.ones(1 << 18) + 1).sum()
    x = torch.ones(2, requires_grad=True, device=device)
    (x * 2).sum().backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _logging_fds() -> set[int]:
    """Descriptors held by ``logging`` handlers: a library that opens its log file when first
    imported (flashinfer's JIT log) keeps it for the life of the process, by design - not a
    leak of the call that happened to import it."""
    import logging

    # logging keeps a weak reference to every handler ever made, also those of loggers built
    # without getLogger (flashinfer's JIT logger is a Logger subclass built directly); the
    # walk over the named loggers is for a Python without that list.
    refs = getattr(logging, "_handlerList", None)
    if refs is not None:
        handlers = [ref() for ref in list(refs)]
    else:
        loggers = [logging.getLogger()] + [obj for obj in list(logging.Logger.manager.loggerDict.values())
                                           if isinstance(obj, logging.Logger)]
        handlers = [handler for logger in loggers for handler in list(logger.handlers)]
    held = set()
    for handler in handlers:
        try:
            held.add(handler.stream.fileno())
        except (AttributeError, OSError, ValueError):
            continue
    return held


def descriptor_targets() -> dict[int, str]:
    """Every open descriptor of this process -> what it points at (``socket:[...]``, a path,
    ``/dev/shm/...``); empty without /proc."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except (OSError, ValueError):
            continue  # the descriptor listdir itself used, already closed
    return found


#: Sockets the harness itself opened in this rank (:func:`harness_sockets`): never counted.
_HARNESS_SOCKETS: set[str] = set()


@contextlib.contextmanager
def harness_sockets():
    """Sockets opened inside this block are the harness's, not the call's: reading a CPU
    tensor shared under torch's ``file_system`` strategy connects this process to its sender's
    shared-memory manager once, and the connection stays for the life of the process (torch's
    own cache). The harness reads what exporters send; the connection is its doing."""
    before = {t for t in descriptor_targets().values() if t.startswith("socket:")}
    try:
        yield
    finally:
        _HARNESS_SOCKETS.update(t for t in descriptor_targets().values()
                                if t.startswith("socket:") and t not in before)


def _fds() -> dict[int, str]:
    """:func:`descriptor_targets` without the log files of ``logging`` handlers
    (:func:`_logging_fds`) and the harness's own sockets (:func:`harness_sockets`)."""
    found = descriptor_targets()
    for fd in _logging_fds():
        found.pop(fd, None)
    for fd, target in list(found.items()):
        if target in _HARNESS_SOCKETS:
            del found[fd]
    return found


def _resource_sharer() -> tuple:
    """``(thread ident, listening socket fd)`` of ``multiprocessing``'s process-wide resource
    sharer while it runs, else ``(None, None)``. Pickling a CPU tensor for another process
    (``ForkingPickler``: SGLang's ``MultiprocessingSerializer``) starts it once per process and
    it serves every later share, by design: a sender that used it left nothing behind. (The
    descriptors it holds for shares nobody fetched are counted: those are left behind.)"""
    import sys

    module = sys.modules.get("multiprocessing.resource_sharer")
    sharer = getattr(module, "_resource_sharer", None)
    thread = getattr(sharer, "_thread", None)
    if thread is None or not thread.is_alive():
        return None, None
    try:
        fd = sharer._listener._listener._socket.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    return thread.ident, fd


def _shm_managers() -> int:
    """How many library service helpers (:data:`~pytest_weightsync.ranks.reaper.SERVICES`: torch's
    shared-memory manager) this process started (the first CPU tensor it
    shared under the ``file_system`` strategy starts one, and keeps one socket to it for the
    life of the process - a library's service, like :func:`_resource_sharer`)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children = f.read().split()
        except OSError:
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    count += f.read().strip() in SERVICES
            except OSError:
                continue
    return count


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _process_groups() -> int | None:
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return 0
        return len(dist.distributed_c10d._world.pg_map)
    except Exception:  # a torch without these internals: not counted
        return None


def _torch_state() -> dict[str, object]:
    import torch

    state = {
        "default dtype": torch.get_default_dtype(),
        "torch threads": torch.get_num_threads(),
        "grad mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
    }
    get_device = getattr(torch, "get_default_device", None)
    if get_device is not None:
        state["default device"] = str(get_device())
    return state


def _stack_dump_handler():
    """``None`` while faulthandler (a C handler Python cannot see) owns SIGUSR1."""
    try:
        return signal.getsignal(signal.SIGUSR1)
    except (AttributeError, ValueError):
        return None


def snapshot() -> dict:
    """The rank's countable resources and global torch settings, now (the resource sharer, a
    process-wide service, left out: :func:`_resource_sharer`)."""
    sharer_thread, sharer_fd = _resource_sharer()
    fds = _fds()
    fds.pop(sharer_fd, None)
    return {
        "process groups": _process_groups(),
        "threads": _os_threads() - (sharer_thread is not None),
        "python threads": {t.ident: t.name for t in threading.enumerate()
                           if t.ident != sharer_thread},
        "fds": fds,
        "shm managers": _shm_managers(),
        "torch": _torch_state(),
        "stack-dump handler": _stack_dump_handler(),
    }


def _fd_kind(target: str) -> str:
    for prefix, kind in (("socket:", "socket"), ("pipe:", "pipe"), ("anon_inode:", "anon inode")):
        if target.startswith(prefix):
            return kind
    return "file"


def _delta(word: str, before: int, after: int, detail: str = "") -> str:
    """``+17 process groups``, ``-1 fd``: the change of a count, in words."""
    change = after - before
    return f"{change:+d} {word}{'s' if abs(change) != 1 else ''}{detail}"


def differences(baseline: dict, now: dict) -> list[str]:
    """What ``now`` has that ``baseline`` had not, in words (empty when nothing)."""
    out = []
    groups_then, groups_now = baseline["process groups"], now["process groups"]
    if groups_then is not None and groups_now is not None and groups_now != groups_then:
        out.append(_delta("process group", groups_then, groups_now))
    if now["threads"] != baseline["threads"]:
        new = [name for ident, name in now["python threads"].items()
               if ident not in baseline["python threads"]]
        listed = f" (Python threads {', '.join(map(repr, new[:MAX_LISTED]))}" \
                 f"{', ...' if len(new) > MAX_LISTED else ''})" if new else ""
        out.append(_delta("thread", baseline["threads"], now["threads"], listed))
    new = [target for fd, target in now["fds"].items() if baseline["fds"].get(fd) != target]
    # one socket to each shared-memory manager started since: the manager's, not a leak
    managers = max(0, now.get("shm managers", 0) - baseline.get("shm managers", 0))
    service = [t for t in new if t.startswith("socket:")][:managers]
    for target in service:
        new.remove(target)
    if len(now["fds"]) - len(service) != len(baseline["fds"]):
        kinds: dict[str, int] = {}
        for target in new:
            kinds[_fd_kind(target)] = kinds.get(_fd_kind(target), 0) + 1
        files = [t for t in new if _fd_kind(t) == "file"][:MAX_LISTED]
        detail = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in sorted(kinds.items()))
        if files:
            detail += f": {', '.join(files)}"
        out.append(_delta("fd", len(baseline["fds"]), len(now["fds"]),
                          f" ({detail})" if detail else ""))
    for key, was in baseline["torch"].items():
        value = now["torch"].get(key)
        if value != was:
            out.append(f"{key} {was} -> {value}")
    if now["stack-dump handler"] is not baseline["stack-dump handler"]:
        out.append(f"the stack-dump signal handler (SIGUSR1, faulthandler's) was replaced by "
                   f"{now['stack-dump handler']!r}: a hung rank could no longer show its stack")
    return out


def leaks(baseline: dict, settle: float = SETTLE) -> list[str]:
    """:func:`differences` from ``baseline`` that are still there after ``settle`` seconds
    (and a garbage collection, which closes what unreachable objects held)."""
    found = differences(baseline, snapshot())
    if not found:
        return []
    gc.collect()
    deadline = time.monotonic() + settle
    while True:
        found = differences(baseline, snapshot())
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)
