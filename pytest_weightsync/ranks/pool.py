"""A warm pool of rank processes that runs functions in every rank.

Starting a rank costs seconds (a fresh interpreter importing torch, then a rendezvous); a
trivial collective costs milliseconds. The pool pays the first cost once per
(world size, backend) and reuses the processes and their process group for every later call.
gloo ranks are forked from a server that imported torch once; NCCL ranks are spawned
(:mod:`pytest_weightsync.ranks.launch`).

Rendezvous goes through a ``FileStore`` in a private temporary directory rather than a TCP
store, so no port is ever bound for it and concurrent pools (xdist workers, parallel CI jobs)
cannot collide. gloo is pinned to the loopback interface for the same reason.

A pool that saw a failure, a death or a timeout is killed at once: a rank that raised may
have left its peers blocked in a collective, and the group may be poisoned. The next call
starts a fresh set of processes.

A call that *passed* can poison the group too: a collective left pending on some ranks only
(an ``async_op=True`` work never waited, one extra collective on one rank) pairs with the next
call's first collective and hands an innocent test wrong data. So after every call that
returned (or skipped) in all ranks, the pool checks with a fresh all-reduce of a per-call token
that the ranks are still in step; when they are not, that call fails with
:class:`RankOutOfStep` and the pool is rebuilt, so the blame lands on the test that left the
mess. A call whose ranks all skipped keeps the warm pool when the check passes.

A call that passed can also leave the *processes* dirty: process groups it never destroyed
(each gloo group keeps threads and sockets), threads, descriptors, child processes, a changed
default dtype or thread count. Every later test would inherit them, and leaked groups pile up
until the fd limit ends the session. So the same check compares each rank with the baseline it
took once warm (:mod:`pytest_weightsync.ranks.hygiene`), and the pool looks for processes left
below the ranks; anything found is reported as a :class:`RankLeakWarning` naming the call and
what it left ("rank 0: +17 process groups, +51 threads, +76 fds"), in the report of the test
that made the call, and the ranks are restarted. ``-W error::pytest_weightsync.ranks.
RankLeakWarning`` turns it into a failure of that test.

Teardown ends everything the ranks started: their process groups, and, found by parentage,
processes a test started in a new session (see :mod:`pytest_weightsync.ranks.reaper`).

The words for what a rank said (its stack, its crash, the processes it left) are found by
:mod:`pytest_weightsync.ranks.diagnosis`; this module decides when to ask.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Callable

from pytest_weightsync.ranks import diagnosis as _diagnosis
from pytest_weightsync.ranks import launch as _launch
from pytest_weightsync.ranks import leftovers as _leftovers
from pytest_weightsync.ranks import reaper as _reaper
from pytest_weightsync.ranks import target as _target
from pytest_weightsync.ranks.errors import (
    RankFailed,
    RankLeakWarning,
    RankOutcome,
    RankOutOfStep,
    RankSkipped,
    RankStartupError,
    RankTimeout,
)

#: Seconds a call may run before its still-running ranks are dumped and killed.
DEFAULT_TIMEOUT = 180.0
#: Seconds to wait for the ranks to start and join the group (interpreter + torch import +
#: rendezvous; slow on a loaded machine, and not charged to the test's own timeout).
DEFAULT_START_TIMEOUT = 300.0
#: Seconds the other ranks get to finish once one rank failed, before they are killed. Ranks
#: blocked in a collective with the failed rank would otherwise wait for the full timeout.
FAILURE_GRACE = 2.0
#: Seconds a stopping rank gets to leave its process group before it is killed.
STOP_GRACE = 3.0
#: Seconds the in-step check (one tiny all-reduce) may take after a call before the ranks
#: count as out of step. Generous, so a starved machine never blames an innocent test: it
#: normally takes a millisecond, and when one rank's check came out wrong the others only get
#: :data:`FAILURE_GRACE` anyway.
CHECK_TIMEOUT = 60.0
#: While a call runs, the ranks' descendants are recorded this often (seconds), so that a
#: process a test started is still found when its rank died before teardown.
RECORD_INTERVAL = 1.0
BACKENDS = ("gloo", "nccl")

_live_pools: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


class RankPool:
    """``world_size`` rank processes with ``torch.distributed`` initialized, kept warm.

    Usable without pytest::

        with RankPool(world_size=4, backend="gloo") as pool:
            results = pool.run(fn, 10)   # fn(10) in every rank -> [r0, r1, r2, r3]

    ``fn`` must be importable by a fresh interpreter (a module-level function, a method of a
    module-level class, or a picklable callable); arguments and return values travel by
    pickle. ``threads`` is passed to ``torch.set_num_threads`` in every rank (0 leaves torch's
    default). ``devices`` sets ``CUDA_VISIBLE_DEVICES`` of the ranks (None inherits it).

    Spawned (NCCL) ranks are tied to the thread that starts them (the kernel kills them when
    it exits), so create and use a pool from a long-lived thread, normally the main one;
    forked (gloo) ranks die with the fork server, which ends with the pytest process.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        threads: int = 1,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        devices: Sequence[str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        grace: float = FAILURE_GRACE,
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool world_size must be a positive int, got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"RankPool backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"RankPool threads must be an int >= 0 (0 = torch default), got {threads!r}")
        _check_timeout(timeout, "RankPool timeout")
        _check_timeout(start_timeout, "RankPool start_timeout")
        self.world_size = world_size
        self.backend = backend
        self.threads = threads
        self.timeout = float(timeout)
        self.devices = tuple(devices) if devices is not None else None
        self.start_timeout = float(start_timeout)
        self.grace = float(grace)
        self._procs: list = []
        self._conns: list = []
        self._tmpdir: str | None = None
        self._lock_fd: int | None = None
        self._calls = 0
        #: Processes seen below the ranks during calls: (pid, start time).
        self._recorded: set = set()
        #: How many times processes were started; tests and benchmarks read it.
        self.starts = 0
        #: Processes below the ranks once they were ready (none, normally): a call may leave
        #: no more.
        self._baseline_children: set = set()

    # -- public API -------------------------------------------------------------------------

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Call ``fn(*args, **kwargs)`` in every rank; return the results in rank order.

        Raises :class:`RankFailed` (with every failing rank's traceback),
        :class:`RankTimeout` (with every hung rank's stack) or :class:`RankSkipped`.
        """
        what = f"{getattr(fn, '__qualname__', fn)!s}"
        arguments = _target.dumps_arguments(args, kwargs, what)
        return self.call(_target.describe(fn), arguments, timeout=timeout, what=what)

    def call(self, fn_ref, arguments: bytes, *, timeout: float | None = None, what: str = "") -> list:
        """:meth:`run` with the function already described and the arguments pickled."""
        timeout = self.timeout if timeout is None else _check_timeout(timeout, "timeout")
        self.start()
        try:
            return self._call(fn_ref, arguments, timeout, what or str(getattr(fn_ref, "qualname", "call")))
        except RankSkipped as exc:
            if not getattr(exc, "pool_in_step", False):
                self._kill()  # a rank skipped while its peers failed, hung or left them out of step
            raise
        except BaseException:
            self._kill()  # failure, timeout, out of step or Ctrl-C/SIGTERM: never reuse
            raise

    def start(self) -> None:
        """Start the ranks and wait until they all joined the group (no-op when running)."""
        if self.running:
            return
        self._kill()  # a half-dead pool (a rank died between calls) is rebuilt whole
        try:
            self._spawn()
            self._await_ready()
        except BaseException:
            self._kill()
            raise

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the temporary directory."""
        if not self._procs:
            self._cleanup_dir()
            return
        # What the tests started goes first: once a rank exits, its orphans are out of reach.
        _reaper.end_all([p.pid for p in self._procs], self._recorded)
        self._recorded = set()
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=STOP_GRACE)
        deadline = time.monotonic() + STOP_GRACE
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    # -- lifecycle --------------------------------------------------------------------------

    def _spawn(self) -> None:
        _leftovers.sweep()  # what a SIGKILLed session left in the same temporary directory
        self._tmpdir = tempfile.mkdtemp(prefix=_leftovers.PREFIX)
        self._lock_fd = _leftovers.claim(self._tmpdir)
        store_path = os.path.join(self._tmpdir, "store")
        ctx = _launch.context(self.backend, self.devices)
        forked = ctx.get_start_method() == "forkserver"
        server_pid = _launch.server_pid() if forked else None
        env = self._rank_env()
        from pytest_weightsync.ranks.worker import rank_main

        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=rank_main,
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    store_path,
                    child_conn,
                    self.threads,
                    env,
                    self._stack_path(rank),
                    os.getpid(),
                    self._crash_path(rank),
                    _launch.start_state() if forked else None,
                    server_pid,
                ),
                name=f"weightsync-rank-{rank}-of-{self.world_size}",
            )
            process.start()
            child_conn.close()
            self._procs.append(process)
            self._conns.append(parent_conn)
        self.starts += 1
        _live_pools.add(self)

    def _rank_env(self) -> dict[str, str]:
        env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        if self.threads > 0:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        return env

    def _await_ready(self) -> None:
        replies, pending = self._collect(self.start_timeout, record=False)
        failures = [self._outcome(r, m) for r, m in sorted(replies.items()) if m[0] != "ready"]
        if not failures and not pending:
            self._baseline_children = _reaper.descendants(self.pids)
            return
        stalled = self._stalled_outcomes(pending, "hung" if not failures else "stalled")
        if failures:
            headline = (
                f"{len(failures)} of {self.world_size} ranks failed to start "
                f"(world_size={self.world_size}, backend={self.backend})"
            )
        else:
            headline = (
                f"ranks {_ranks(pending)} did not join the {self.backend} process group within "
                f"{self.start_timeout:g} s (world_size={self.world_size})"
            )
        raise RankStartupError(headline, failures + stalled)

    def _kill(self) -> None:
        """Kill every rank, everything they started, reap, close pipes, remove the directory."""
        for p in self._procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGSTOP)  # no new children while we look for them
                except (ProcessLookupError, PermissionError):
                    pass
        _reaper.end_all([p.pid for p in self._procs], self._recorded)
        self._recorded = set()
        for p in self._procs:
            if p.pid is None:
                continue
            try:
                # The rank leads its own process group (setpgid in the worker): this also
                # kills whatever the test body started. Safe from pid reuse: a spawned rank
                # is not reaped yet, and the kernel hands out no pid still in use as a
                # process group id (a forked rank is reaped by the fork server, but its
                # group lives while anything the test started is in it).
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.kill()
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            try:
                p.close()
            except ValueError:
                pass
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        _live_pools.discard(self)
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- one call ---------------------------------------------------------------------------

    def _call(self, fn_ref, arguments: bytes, timeout: float, what: str) -> list:
        task = pickle.dumps(
            ("run", fn_ref, list(sys.path), os.getcwd(), arguments), protocol=pickle.HIGHEST_PROTOCOL
        )
        died: dict[int, tuple] = {}
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(task)
            except OSError:
                died[rank] = ("died", self._procs[rank].exitcode)
        replies, pending = self._collect(timeout, skip=died)
        replies.update(died)
        errors = [self._outcome(r, m) for r, m in sorted(replies.items()) if m[0] in ("error", "died")]
        skips = [(r, m[1]) for r, m in sorted(replies.items()) if m[0] == "skip"]
        where = f"(world_size={self.world_size}, backend={self.backend})"
        if errors:
            stalled = self._stalled_outcomes(pending, "stalled")
            raise RankFailed(f"{len(errors)} of {self.world_size} ranks failed in {what} {where}", errors + stalled)
        if pending:
            if skips:
                rank, reason = skips[0]
                raise RankSkipped(reason, rank)  # its peers are stuck: the pool is killed
            hung = self._stalled_outcomes(pending, "hung", timeout)
            raise RankTimeout(
                f"{what} timed out after {timeout:g} s: rank(s) {_ranks(pending)} of "
                f"{self.world_size} still running {where}; their Python stacks follow",
                hung,
            )
        destroyed = any(m[0] == "ok" and m[2] for m in replies.values())
        if destroyed:
            self._kill()  # the call destroyed the process group; start afresh next time
        else:
            issued = {r: m[-1] for r, m in replies.items()}
            left = self._check_in_step(what, where, issued)
            self._report_leftovers(what, where, left)
        if skips:
            rank, reason = skips[0]
            skipped = RankSkipped(reason, rank)
            skipped.pool_in_step = not destroyed
            raise skipped
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def _check_in_step(self, what: str, where: str, issued: dict[int, int | None]) -> dict[int, list[str]]:
        """Raise :class:`RankOutOfStep` unless a fresh all-reduce gives every rank the exact sum;
        return what each rank reported left behind (:mod:`~pytest_weightsync.ranks.hygiene`)."""
        self._calls += 1
        token = 1 + self._calls % 1000  # float32 sums stay exact for any world size < 16384
        message = pickle.dumps(("check", token, CHECK_TIMEOUT))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass
        replies, pending = self._collect(CHECK_TIMEOUT + 1.0, good=("checked",), record=False)
        bad = {r: m for r, m in replies.items() if m[0] != "checked"}
        if not bad and not pending:
            return {r: list(m[1]) for r, m in replies.items() if len(m) > 1 and m[1]}
        outcomes = []
        for rank, m in sorted(bad.items()):
            outcomes.append(self._outcome(rank, m) if m[0] == "died" else RankOutcome(rank, "out-of-step", m[1]))
        for rank in sorted(pending):
            outcomes.append(RankOutcome(rank, "out-of-step", "did not finish a fresh all_reduce on the default group; killed"))
        counts = ", ".join(
            f"rank {r}: {'?' if n is None else n}" for r, n in sorted(issued.items())
        )
        headline = (
            f"{what} returned in every rank but left the ranks out of step {where}: a collective "
            f"is still pending on some ranks (an async_op=True work never waited, or a collective "
            f"issued by some ranks only), so the next collective would pair with it. Operations "
            f"each rank issued on the default group during the call: {counts}. The ranks were "
            f"restarted so the next test starts clean."
        )
        raise RankOutOfStep(headline, outcomes)

    def _report_leftovers(self, what: str, where: str, left: dict[int, list[str]]) -> None:
        """Warn (:class:`RankLeakWarning`, in the report of the test that made the call) about
        whatever the call left in the warm ranks, and restart them: the next test must not
        inherit leaked groups, threads, descriptors, child processes or changed torch settings.
        """
        children = _reaper.descendants(self.pids) - self._baseline_children
        for rank, words in _diagnosis.children_by_rank(children, self.pids).items():
            left.setdefault(rank, []).append(words)
        if not left:
            return
        per_rank = "; ".join(f"rank {r}: {', '.join(left[r])}" for r in sorted(left))
        message = (
            f"{what} left state behind in the warm rank processes {where}: {per_rank}. The "
            f"ranks were restarted so the next test starts clean; free what the call creates "
            f"(dist.destroy_process_group(group) for every new group - Megatron's "
            f"destroy_model_parallel() forgets its groups without destroying them), restore "
            f"global torch settings, wait for child processes."
        )
        self._kill()
        warnings.warn(RankLeakWarning(message), stacklevel=4)

    def _collect(self, timeout: float, *, skip=(), good=("ok", "ready"), record: bool = True) -> tuple[dict, set]:
        """Wait for one reply per rank until the deadline; return (replies, unanswered ranks).

        A rank whose process exits without replying counts as ``died``. Once any rank failed
        (or skipped), the others get :data:`FAILURE_GRACE` more seconds, not the full timeout.
        With ``record``, the ranks' descendants are recorded every :data:`RECORD_INTERVAL`.
        """
        replies: dict[int, tuple] = {}
        pending = set(range(self.world_size)) - set(skip)
        deadline = time.monotonic() + timeout
        next_record = time.monotonic() + RECORD_INTERVAL
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            if record and now >= next_record:
                self._record_descendants()
                next_record = now + RECORD_INTERVAL
            waitables = {}
            for rank in pending:
                waitables[self._conns[rank]] = rank
                waitables[self._procs[rank].sentinel] = rank
            wait = deadline - now
            if record:
                wait = min(wait, max(0.0, next_record - now))
            ready = multiprocessing.connection.wait(list(waitables), timeout=wait)
            for obj in ready:
                rank = waitables[obj]
                if rank not in pending:
                    continue
                replies[rank] = self._receive(rank)
                pending.discard(rank)
                if replies[rank][0] not in good:
                    deadline = min(deadline, time.monotonic() + self.grace)
        return replies, pending

    def _record_descendants(self) -> None:
        table = _reaper.process_table()
        self._recorded = _reaper.alive(self._recorded, table) | _reaper.descendants(self.pids, table)
        _leftovers.record(self._tmpdir, self._recorded)  # for the next session, if we get SIGKILLed

    def _receive(self, rank: int) -> tuple:
        conn, process = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        process.join(timeout=1)
        return ("died", process.exitcode)

    def _stalled_outcomes(self, ranks, kind: str, timeout: float | None = None) -> list[RankOutcome]:
        stacks = self._dump_stacks(sorted(ranks))
        outcomes = []
        for rank in sorted(ranks):
            if kind == "hung":
                summary = f"hung; still running after {timeout:g} s" if timeout else "hung"
            else:
                summary = f"still running {self.grace:g} s after another rank failed; killed"
            if rank in stacks:
                outcomes.append(RankOutcome(rank, kind, summary + "; its Python stack:", stacks[rank]))
            else:
                why = _diagnosis.why_no_stack(self._procs[rank].pid)
                outcomes.append(RankOutcome(rank, kind, f"{summary}; rank {rank} did not answer the "
                                            f"stack-dump signal (SIGUSR1){why}, so its stack is unknown"))
        return outcomes

    def _stack_path(self, rank: int) -> str:
        assert self._tmpdir is not None
        return os.path.join(self._tmpdir, f"stack-rank{rank}.txt")

    def _crash_path(self, rank: int) -> str:
        assert self._tmpdir is not None
        return os.path.join(self._tmpdir, f"crash-rank{rank}.txt")

    def _outcome(self, rank: int, message: tuple) -> RankOutcome:
        outcome = _diagnosis.outcome(rank, message)
        if outcome.kind != "died" or self._tmpdir is None:
            return outcome
        crash = _diagnosis.crash_report(self._crash_path(rank))
        if not crash:
            return outcome
        return dataclasses.replace(outcome, summary=outcome.summary + "; its Python stack at the crash:", detail=crash)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stacks of ``ranks`` (:func:`~pytest_weightsync.ranks.diagnosis.dump_stacks`)."""
        if self._tmpdir is None:
            return {}
        return _diagnosis.dump_stacks(
            {rank: self._stack_path(rank) for rank in ranks}, {rank: self._procs[rank].pid for rank in ranks}
        )


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _check_timeout(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


@atexit.register
def _close_all_pools() -> None:
    """Last line of defence for library users who never closed their pool."""
    for pool in list(_live_pools):
        pool._kill()
