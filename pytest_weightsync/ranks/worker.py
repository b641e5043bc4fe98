"""The main loop of one rank process.

A rank starts once, joins the process group, then serves calls until told to stop. Every
message is plain ``pickle`` bytes over a pipe (never torch's shared-memory reductions, which
hand file descriptors around and outlive a killed peer). The rank guards itself against its
parent: it lives in its own process group (so teardown can kill whatever it started) and asks
the kernel to kill it when the parent dies (so a crashed pytest leaves no orphan behind).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback
from typing import Any

from pytest_weightsync.ranks import context as _context
from pytest_weightsync.ranks import target as _target

#: Frames from these files are launcher plumbing and are cut from rank tracebacks.
_PLUMBING = {os.path.abspath(__file__), os.path.abspath(_target.__file__)}

# Kept referenced for the life of the process: faulthandler writes to its descriptor.
_stack_file = None


def rank_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    conn,
    threads: int,
    env: dict[str, str],
    stack_path: str,
    parent_pid: int,
) -> None:
    """Entry point of a spawned rank (the ``target`` of its ``multiprocessing`` Process)."""
    _detach_and_tie_to_parent(parent_pid)
    os.environ.update(env)
    global _stack_file
    _stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    try:
        device = _init_process_group(rank, world_size, backend, store_path, threads)
    except BaseException as exc:
        _send(conn, ("error", _summary(exc), _format(exc), None))
        return
    _context._set_current(_context.RankContext(rank, world_size, backend, device, "pool"))
    _send(conn, ("ready", os.getpid()))
    _serve(conn)


def _detach_and_tie_to_parent(parent_pid: int) -> None:
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except Exception:  # pragma: no cover - best effort; the pipe EOF is the fallback
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _init_process_group(rank: int, world_size: int, backend: str, store_path: str, threads: int) -> str:
    import torch
    import torch.distributed as dist

    if threads > 0:
        torch.set_num_threads(threads)
    device = "cpu"
    if backend == "nccl":
        count = torch.cuda.device_count()
        if count == 0:  # RankPool used as a library on a host without CUDA
            raise RuntimeError(
                f"backend nccl needs a CUDA GPU, rank {rank} sees none "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        local = rank % count
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return device


def _serve(conn) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "stop":
            _shutdown()
            return
        reply = _run(*message[1:])
        # stdout of a spawned process is block-buffered: flush so a rank's prints land in
        # the capture of the test that made them, not of some later test.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        _send(conn, reply)


def _run(target, sys_path: list[str], cwd: str, arguments: bytes) -> tuple:
    try:
        _target.merge_sys_path(sys_path)
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        fn = target.resolve()
        args, kwargs = pickle.loads(arguments)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        skip_reason = _skip_reason(exc)
        if skip_reason is not None:
            return ("skip", skip_reason)
        return ("error", _summary(exc), _format(exc), _try_pickle(exc))
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return (
            "error",
            f"its return value ({type(result).__name__}) cannot be pickled back: {exc}",
            "",
            None,
        )
    return ("ok", payload, not _process_group_alive())


def _process_group_alive() -> bool:
    """False when the call destroyed the default group: the pool must not be reused."""
    import torch.distributed as dist

    return dist.is_initialized()


def _shutdown() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _skip_reason(exc: BaseException) -> str | None:
    # pytest renames its outcome classes' __module__ to "builtins"; match by class instead.
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.Skipped):
        return str(exc.msg)
    return None


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _format(exc: BaseException) -> str:
    """The traceback as pytest users expect it: from the test body down, no launcher frames."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in _PLUMBING:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _try_pickle(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        return data
    except Exception:
        return None


def _send(conn, message: Any) -> None:
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except (BrokenPipeError, OSError):
        os._exit(1)
