"""The main loop of one rank process.

A rank starts once, joins the process group, then serves calls until told to stop. Every
message is plain ``pickle`` bytes over a pipe (never torch's shared-memory reductions, which
hand file descriptors around and outlive a killed peer). The rank guards itself against its
parent: it lives in its own process group (so teardown can kill whatever it started), becomes
the "child subreaper" of what it starts (so a process that a test body detached - double fork,
new session - is still found below the rank at teardown), and asks the kernel to kill it when
the parent dies (so a crashed pytest leaves no rank behind).

Diagnostics must survive the worst a test can do: an exception whose ``__str__`` raises is
reported by type and ``repr`` (never by killing the rank), and a hard crash (segfault, abort)
writes the Python stack of every thread to a per-rank file that the parent attaches to the
report, since a dead process can answer nothing.

After each call the parent may ask for a check that the ranks are still in step: a fresh
``all_reduce`` of a per-call token on the default group. A test that left an extra collective
pending on one rank shifts the pairing of every later collective; the check catches it so the
test that left it fails, not the innocent next one. The same check reports what the call left
in the process (process groups, threads, descriptors, global torch settings, compared with
the warm rank's baseline: :mod:`pytest_weightsync.ranks.hygiene`).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any

from pytest_weightsync.ranks import context as _context
from pytest_weightsync.ranks import hygiene as _hygiene
from pytest_weightsync.ranks import target as _target

#: Frames from these files are launcher plumbing and are cut from rank tracebacks.
_PLUMBING = {os.path.abspath(__file__), os.path.abspath(_target.__file__)}

# Kept referenced for the life of the process: faulthandler writes to their descriptors.
_stack_file = None
_crash_file = None
#: What the rank holds once warm (see :mod:`pytest_weightsync.ranks.hygiene`); every call is
#: compared with it.
_baseline: dict | None = None


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
    crash_path: str | None = None,
    start_state: dict | None = None,
    server_pid: int | None = None,
) -> None:
    """Entry point of a rank (the ``target`` of its ``multiprocessing`` Process): spawned by
    the pytest process ``parent_pid``, or forked by the fork server ``server_pid`` with the
    pytest process's ``start_state`` to adopt (:mod:`pytest_weightsync.ranks.launch`)."""
    _detach_and_tie_to_parent(parent_pid, server_pid)
    if start_state is not None:
        from pytest_weightsync.ranks import launch

        launch.adopt(start_state)
    os.environ.update(env)
    _quiet_what_the_machine_lacks()
    global _stack_file, _crash_file
    _stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    if crash_path is not None:
        # A segfault or abort kills the rank before it can answer; this file is all the
        # parent gets of where it happened.
        _crash_file = open(crash_path, "w")
        faulthandler.enable(file=_crash_file, all_threads=True)
    try:
        device = _init_process_group(rank, world_size, backend, store_path, threads)
    except BaseException as exc:
        _send(conn, ("error", _summary(exc), _format(exc), None))
        return
    _context._set_current(_context.RankContext(rank, world_size, backend, device, "pool"))
    global _baseline
    try:
        _hygiene.warm_up(device)
        _baseline = _hygiene.snapshot()
    except BaseException as exc:
        _send(conn, ("error", f"warming up the rank failed: {_summary(exc)}", _format(exc), None))
        return
    _send(conn, ("ready", os.getpid()))
    _serve(conn)


#: Warnings a rank's libraries print about what this machine lacks (no Transformer Engine,
#: Apex or CUDA runtime on a CPU runner), each once per rank and import: the rank processes'
#: stderr lands in the report of the test that imported them, where four ranks' worth of them
#: would bury a five-line located failure. They say nothing about the code under test.
ENVIRONMENT_WARNINGS = (
    r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed",
    r"full scope is deprecated",
)


def _quiet_what_the_machine_lacks() -> None:
    import logging
    import warnings

    for message in ENVIRONMENT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _detach_and_tie_to_parent(parent_pid: int, server_pid: int | None = None) -> None:
    """Lead a process group of its own, die with the process that started it and adopt the
    orphans of what it starts. A forked rank's parent is the fork server, which lives as long
    as some process holds its "alive" pipe: the rank lets go of its copy
    (:func:`release_server`), so the server - and with it, by ``PDEATHSIG``, the rank - ends
    when the pytest process does."""
    direct = parent_pid if server_pid is None else server_pid
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            PR_SET_CHILD_SUBREAPER = 36
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # Orphans of what a test starts are re-parented to the rank, not to init, so
            # teardown still finds them among the rank's descendants.
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except Exception:  # pragma: no cover - best effort; the pipe EOF is the fallback
            pass
    release_server()
    if os.getppid() != direct or not _alive(parent_pid):  # died before prctl took effect
        os._exit(1)


def release_server() -> None:
    """Close this process's copy of the fork server's "alive" pipe (a forked child inherits
    one; while any copy is open the server outlives the pytest process). Code that later uses
    the fork server from this rank starts a server of its own."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    if server is None or server._forkserver_pid is not None:
        return  # no server state, or this process started the server itself
    fd, server._forkserver_alive_fd = server._forkserver_alive_fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        if message[0] == "check":
            _send(conn, _check(*message[1:]))
            continue
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
    before = _operations()
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
            return ("skip", skip_reason, _issued(before))
        return _error_reply(exc)
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return (
            "error",
            f"its return value ({type(result).__name__}) cannot be pickled back: {_safe_text(exc)}",
            "",
            None,
        )
    return ("ok", payload, not _process_group_alive(), _issued(before))


def _error_reply(exc: BaseException) -> tuple:
    """The rank's story of ``exc``; never raises (a broken exception must not kill the rank)."""
    try:
        return ("error", _summary(exc), _format(exc), _try_pickle(exc))
    except BaseException as inner:  # pragma: no cover - _summary/_format already guard
        return ("error", _type_name(exc), f"(formatting the exception failed: {type(inner).__name__})", None)


def _operations() -> int | None:
    """How many operations (collectives and point-to-point) the default group has issued.

    Only used to explain an out-of-step report; None where the backend does not count.
    """
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return None


def _issued(before: int | None) -> int | None:
    after = _operations()
    return None if before is None or after is None else after - before


def _check(token: int, timeout: float) -> tuple:
    """All-reduce ``[token]`` on the default group; every rank must get ``world_size * token``.

    A collective left pending on some ranks only (an ``async_op=True`` work never waited, an
    extra collective on one rank) pairs with this one instead: the sum comes out wrong, or
    the all-reduce never completes. One float32 element, the most common shape of a stray
    collective, so the pairing shows as a wrong value rather than a size mismatch. Polling
    ``is_completed`` (rather than ``wait``) keeps the deadline honest for NCCL too, whose
    ``wait`` does not block the CPU.
    """
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return ("out-of-step", "the default process group was destroyed")
        context = _context.current()
        device = context.device if context is not None else "cpu"
        probe = torch.tensor([float(token)], dtype=torch.float32, device=device)
        expected = [float(token * dist.get_world_size())]
        work = dist.all_reduce(probe, async_op=True)
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return ("out-of-step", f"a fresh all_reduce on the default group did not complete within {timeout:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        work.wait()
        got = probe.cpu().tolist()
    except BaseException as exc:
        return ("out-of-step", f"a fresh all_reduce on the default group failed: {_summary(exc)}")
    if got != expected:
        return (
            "out-of-step",
            f"a fresh all_reduce of {_short([float(token)])} on the default group gave {_short(got)} "
            f"instead of {_short(expected)}",
        )
    try:
        left = _hygiene.leaks(_baseline) if _baseline is not None else []
    except BaseException as exc:  # measuring must never cost the call its verdict
        left = [f"(its state could not be measured: {_summary(exc)})"]
    return ("checked", left)


def _short(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


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
    text = _safe_text(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _safe_text(exc: BaseException) -> str:
    """``str(exc)``, or, when its ``__str__`` raises, a fallback that still says what it was."""
    try:
        return str(exc)
    except BaseException as str_error:
        why = f"{_type_name(exc)}.__str__ raised {type(str_error).__name__}"
    try:
        shown = repr(exc)
    except BaseException:
        shown = f"<{_type_name(exc)} object; repr() raised too>"
    if len(shown) > 500:
        shown = shown[:500] + "..."
    return f"{shown} ({why})"


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    module = getattr(cls, "__module__", "")
    name = getattr(cls, "__qualname__", cls.__name__)
    return name if module in ("builtins", "__main__", "") else f"{module}.{name}"


def _format(exc: BaseException) -> str:
    """The traceback as pytest users expect it: from the test body down, no launcher frames."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in _PLUMBING:
        tb = tb.tb_next
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:
        text = "".join(traceback.format_tb(tb)) + f"{_type_name(exc)}\n"
    # traceback writes "<exception str() failed>" for a broken __str__; say what we know.
    return text.replace("<exception str() failed>", _safe_text(exc))


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
