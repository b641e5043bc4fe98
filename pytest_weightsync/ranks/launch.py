"""How rank processes are started: forked from a warm server for gloo, spawned for NCCL.

A spawned rank is a fresh interpreter: it imports torch (about 2.5 s of CPU) and, for the
Megatron suites, megatron-core (about 5 s more) before it can join its group - for every rank
of every pool start, which on a 2-core machine was most of what a pool start cost. gloo ranks
are therefore forked from multiprocessing's *forkserver*, a single-threaded server process
that imported those modules once (:data:`PRELOAD`, plus what the harness declared with
:func:`want_preloaded` before the server started). NCCL ranks, and gloo ranks given GPUs, keep
``spawn``: CUDA must not be initialised in a forked server, and GPU pools are few.

A forked rank is the server's child, not the pytest process's, so what ``spawn`` gave it for
free is handed over explicitly (:func:`start_state`, then :func:`adopt` in the rank): the
environment of the pytest process *now* (the server holds the one it started with), the
working directory, and the stdout / stderr descriptors of the test that started the pool (the
server holds those of the test during which it started). Tying a rank to the pytest process
is in :func:`pytest_weightsync.ranks.worker.release_server`.
"""

from __future__ import annotations

import multiprocessing
import os
import threading

__all__ = [
    "InheritedFd", "PRELOAD", "adopt", "context", "server_pid", "start_state", "want_preloaded",
]

#: Imported once in the fork server, in order: what every rank imports before it can serve a
#: call (``server`` first: it quiets what the imports say about the machine).
PRELOAD = ("pytest_weightsync.ranks.server", "torch", "torch.distributed")

_wanted: list[str] = []
_lock = threading.Lock()


def want_preloaded(*modules: str) -> None:
    """Ask for ``modules`` to be imported in the fork server too (a harness whose ranks all
    import megatron-core declares it at its own import). Takes effect only if the server has
    not started yet in this process; ranks import whatever it lacks themselves."""
    with _lock:
        for name in modules:
            if name not in _wanted:
                _wanted.append(name)


def context(backend: str, devices=None):
    """The ``multiprocessing`` context that starts ranks of ``backend``: the fork server for
    CPU gloo ranks; ``spawn`` for NCCL ranks and for ranks given GPUs (``devices``), which may
    initialise CUDA - safe only in a process that was never forked from one that touched it."""
    if (backend != "gloo" or devices is not None
            or "forkserver" not in multiprocessing.get_all_start_methods()):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    with _lock:
        from multiprocessing import forkserver

        if forkserver._forkserver._forkserver_pid is None:  # not started: choose its imports
            ctx.set_forkserver_preload(list(PRELOAD) + _wanted)
        try:
            _short_socket_dir()
            forkserver.ensure_running()
        except OSError:  # no socket for the server here: spawn as before
            return multiprocessing.get_context("spawn")
    return ctx


#: Longest directory the server's socket (``listener-XXXXXXXX`` in it) may live in: a UNIX
#: socket path has at most 107 bytes.
_SOCKET_DIR_MAX = 80


def _short_socket_dir() -> None:
    """The server listens on a UNIX socket in ``multiprocessing``'s temporary directory, under
    ``TMPDIR``; a deep ``TMPDIR`` (pytest's ``tmp_path`` of a nested session) makes the path
    too long to bind. Then that directory is made under the system's default temporary
    directory instead (removed at exit, as ``multiprocessing`` removes its own)."""
    import shutil
    import tempfile
    from multiprocessing import process, util

    if len(util.get_temp_dir()) <= _SOCKET_DIR_MAX:
        return
    for base in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            break
    else:
        return
    short = tempfile.mkdtemp(prefix="pymp-", dir=base)
    util.Finalize(None, shutil.rmtree, args=(short, True), exitpriority=-100)
    process.current_process()._config["tempdir"] = short


def server_pid():
    """The fork server's pid (``None`` before it starts)."""
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


class InheritedFd:
    """A descriptor of the starting process that the rank receives as its own duplicate,
    passed by ``multiprocessing`` alongside the process object (``DupFd`` at pickling time:
    over the fork server's socket, or inherited under ``spawn``). :meth:`detach` in the rank
    returns it."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_Received, (reduction.DupFd(self.fd),))

    def detach(self) -> int:  # pragma: no cover - only an unpickled one is detached
        raise RuntimeError("InheritedFd is detached in the process that received it")


class _Received:
    def __init__(self, dup):
        self._dup = dup

    def detach(self) -> int:
        return self._dup.detach()


def start_state() -> dict:
    """What a rank adopts from the process starting it now: environment, working directory,
    stdout and stderr."""
    return {"environ": dict(os.environ), "cwd": os.getcwd(),
            "stdio": {1: InheritedFd(1), 2: InheritedFd(2)}}


def adopt(state: dict) -> None:
    """In the rank: take the starting process's environment, directory and stdout / stderr
    (see :func:`start_state`)."""
    os.environ.clear()
    os.environ.update(state["environ"])
    try:
        os.chdir(state["cwd"])
    except OSError:  # removed since: the rank works from wherever the server runs
        pass
    for target, received in state["stdio"].items():
        fd = received.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
