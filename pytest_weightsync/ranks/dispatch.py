"""The pytest side of the launcher: the ``ranks`` marker and the ``rank_pool`` fixture.

A ``ranks``-marked test is run through :func:`pytest_pyfunc_call`: pytest resolves every
fixture and parameter in the test process as usual, then, instead of calling the function,
this hook pickles the function's identity and its arguments to the ranks of a warm
:class:`~pytest_weightsync.ranks.RankPool` and turns what the ranks report back into the
test's outcome (pass, skip, or a failure with every rank's traceback or stack).

Under an external launcher (torchrun) nothing is spawned: the test body runs in-process in
the job's own process group (see :mod:`pytest_weightsync.ranks.torchrun`).

Nothing here imports torch at import time; only a gpu-marked or NCCL test asks torch about
CUDA, and only the rank processes initialize torch.distributed.

SIGTERM (what CI runners and process managers send) is turned into the same interrupt as
Ctrl-C while the session runs, so the pools are torn down - ranks, whatever the tests started,
temporary directories - instead of the process vanishing with them still around.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any, Callable

import pytest

from pytest_weightsync.ranks import partition as _partition
from pytest_weightsync.ranks import target as _target
from pytest_weightsync.ranks import torchrun as _torchrun
from pytest_weightsync.ranks.errors import RankFailed, RankSkipped, RankStartupError, RankTimeout

DEFAULT_TIMEOUT_INI = "weightsync_rank_timeout"
#: The ini key's default (declared in :mod:`pytest_weightsync.plugin`).
DEFAULT_TEST_TIMEOUT = 180.0


@dataclasses.dataclass(frozen=True)
class RanksSpec:
    """The validated arguments of a ``ranks`` marker."""

    n: int
    backend: str | None = None
    timeout: float | None = None


def ranks_spec(item: pytest.Item) -> RanksSpec | None:
    """Parse ``@pytest.mark.ranks(n, backend=None, timeout=None)``; None when unmarked."""
    marker = item.get_closest_marker("ranks")
    if marker is None:
        return None
    where = f"{item.nodeid}: @pytest.mark.ranks"
    if len(marker.args) > 1:
        raise pytest.UsageError(f"{where} takes one positional argument n, got {marker.args!r}")
    unknown = set(marker.kwargs) - {"n", "backend", "timeout"}
    if unknown:
        raise pytest.UsageError(f"{where} got unknown argument(s) {sorted(unknown)}; "
                                f"expected ranks(n, backend=None, timeout=None)")
    n = marker.kwargs.get("n", marker.args[0] if marker.args else None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"{where} needs a positive int n (the world size), got {n!r}")
    backend = marker.kwargs.get("backend")
    if backend not in (None, "gloo", "nccl"):
        raise pytest.UsageError(f"{where}: backend must be 'gloo', 'nccl' or None, got {backend!r}")
    timeout = marker.kwargs.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise pytest.UsageError(f"{where}: timeout must be a positive number of seconds, got {timeout!r}")
    return RanksSpec(n, backend, None if timeout is None else float(timeout))


# -- settings resolution ----------------------------------------------------------------------


def resolve_timeout(config: pytest.Config, requested: float | None) -> tuple[float, str]:
    """(seconds, where the value came from): marker/argument > option > ini (default 180)."""
    if requested is not None:
        return float(requested), "the ranks marker / timeout argument"
    option = config.getoption("weightsync_rank_timeout", None)
    if option is not None:
        if option <= 0:
            raise pytest.UsageError(f"--weightsync-rank-timeout must be positive, got {option!r}")
        return float(option), "--weightsync-rank-timeout"
    raw = config.getini(DEFAULT_TIMEOUT_INI)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"ini {DEFAULT_TIMEOUT_INI} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise pytest.UsageError(f"ini {DEFAULT_TIMEOUT_INI} must be positive, got {raw!r}")
    return value, f"ini {DEFAULT_TIMEOUT_INI}"


def resolve_start_timeout(config: pytest.Config) -> tuple[float, str]:
    """(seconds, source) allowed for starting a pool's ranks: ``--weightsync-startup-timeout``,
    else the ini key ``weightsync_startup_timeout``, else :data:`~pytest_weightsync.ranks.pool.
    DEFAULT_START_TIMEOUT` (300 s), since a cold start on a loaded machine (an interpreter
    importing torch, then a rendezvous) can take minutes. It is separate from the rank timeout:
    a short ``--weightsync-rank-timeout`` bounds test bodies, not start-up, and a marker's
    ``timeout=`` never bounds start-up either (it costs the same for every test and is not
    charged to the body).
    """
    from pytest_weightsync.ranks.pool import DEFAULT_START_TIMEOUT

    option = config.getoption("weightsync_startup_timeout", None)
    if option is not None:
        if option <= 0:
            raise pytest.UsageError(f"--weightsync-startup-timeout must be positive, got {option!r}")
        return float(option), "--weightsync-startup-timeout"
    raw = config.getini("weightsync_startup_timeout")
    if raw not in (None, ""):
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise pytest.UsageError(f"ini weightsync_startup_timeout must be a number of seconds, "
                                    f"got {raw!r}") from None
        if value <= 0:
            raise pytest.UsageError(f"ini weightsync_startup_timeout must be positive, got {raw!r}")
        return value, "ini weightsync_startup_timeout"
    return DEFAULT_START_TIMEOUT, "the default start-up limit"


def resolve_threads(config: pytest.Config) -> int:
    threads = config.getoption("weightsync_threads", None)
    if threads is None:
        return 1
    if threads < 0:
        raise pytest.UsageError(f"--weightsync-threads must be >= 0 (0 = torch default), got {threads}")
    return threads


def resolve_backend(config: pytest.Config, item: pytest.Item, requested: str | None) -> str:
    """Marker/argument > --weightsync-backend > auto (NCCL for gpu-marked tests with CUDA)."""
    if requested is not None:
        return requested
    option = config.getoption("weightsync_backend", "auto") or "auto"
    if option != "auto":
        return option
    if item.get_closest_marker("gpu") is not None and _gpu_count() > 0:
        return "nccl"
    return "gloo"


def _gpu_count() -> int:
    from pytest_weightsync import gpu_gate

    return gpu_gate._visible_gpus()[0]


def _nccl_unavailable(world_size: int) -> str | None:
    """Why an NCCL pool of ``world_size`` ranks cannot run here, or None if it can."""
    from pytest_weightsync import gpu_gate

    have, why = gpu_gate._visible_gpus()
    if have == 0:
        return f"backend nccl needs CUDA: {why}"
    if have < world_size:
        return f"backend nccl with {world_size} ranks needs {world_size} GPUs, {have} visible"
    return None


def rank_devices(backend: str, world_size: int, environ=None) -> tuple[str, ...] | None:
    """CUDA_VISIBLE_DEVICES for the ranks of this xdist worker; None to inherit the parent's."""
    environ = os.environ if environ is None else environ
    index = _partition.xdist_worker_index(environ.get("PYTEST_XDIST_WORKER"))
    if backend != "nccl" or index is None:
        return None
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    visible = _partition.parse_visible(environ.get("CUDA_VISIBLE_DEVICES"), _gpu_count())
    return _partition.devices_for_pool(visible, index, count, world_size)


# -- the pool cache ---------------------------------------------------------------------------


class PoolCache:
    """Warm pools of this pytest process, one per (world size, backend, threads, devices).

    With ``--weightsync-no-pool`` every call gets a fresh pool that is closed right after.
    """

    def __init__(self, reuse: bool):
        self.reuse = reuse
        self._pools: dict[tuple, Any] = {}

    def run(
        self, key: tuple, fn_ref, arguments: bytes, timeout: float, what: str, start_timeout: float | None = None
    ) -> list:
        from pytest_weightsync.ranks.pool import DEFAULT_START_TIMEOUT, RankPool

        world_size, backend, threads, devices = key
        start_timeout = DEFAULT_START_TIMEOUT if start_timeout is None else start_timeout
        pool = self._pools.get(key) if self.reuse else None
        if pool is None:
            pool = RankPool(world_size, backend, threads, timeout, devices=devices, start_timeout=start_timeout)
            if self.reuse:
                self._pools[key] = pool
        pool.start_timeout = float(start_timeout)
        try:
            return pool.call(fn_ref, arguments, timeout=timeout, what=what)
        finally:
            if not self.reuse:
                pool.close()

    def close_all(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


_POOLS = pytest.StashKey[PoolCache]()


def _pool_cache(config: pytest.Config) -> PoolCache:
    cache = config.stash.get(_POOLS, None)
    if cache is None:
        cache = PoolCache(reuse=not config.getoption("weightsync_no_pool", False))
        config.stash[_POOLS] = cache
    return cache


def run_in_ranks(
    config: pytest.Config,
    item: pytest.Item,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    *,
    backend: str | None,
    timeout: float | None,
) -> list:
    """Run ``fn`` in ``world_size`` ranks for test ``item``; pytest-flavoured outcomes.

    Skips (a rank skipped, or NCCL is impossible here) become ``pytest.skip``; failures
    stay :class:`RankFailed` so the caller decides how to report them.
    """
    backend = resolve_backend(config, item, backend)
    if backend == "nccl":
        why = _nccl_unavailable(world_size)
        if why:
            _skip_at_test(why)
    seconds, source = resolve_timeout(config, timeout)
    start_seconds, start_source = resolve_start_timeout(config)
    what = getattr(fn, "__qualname__", repr(fn))
    fn_ref = _target.describe(fn)
    arguments = _target.dumps_arguments(tuple(args), dict(kwargs), f"{item.nodeid} -> {what}")
    key = (world_size, backend, resolve_threads(config), rank_devices(backend, world_size))
    try:
        return _pool_cache(config).run(key, fn_ref, arguments, seconds, what, start_seconds)
    except RankSkipped as exc:
        _skip_at_test(exc.reason)
    except RankStartupError as exc:
        exc.args = (f"{exc}\n(start-up limit {start_seconds:g} s from {start_source})",)
        raise
    except RankTimeout as exc:
        exc.args = (f"{exc}\n(timeout {seconds:g} s from {source})",)
        raise


# -- hooks ------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip early (before fixtures run) when the ranks cannot exist here."""
    spec = ranks_spec(item)
    if spec is None:
        return
    if _torchrun.active():
        have = _torchrun.world_size()
        if spec.n != have:
            _skip_at_test(f"ranks({spec.n}) needs WORLD_SIZE={spec.n} under torchrun; this job has WORLD_SIZE={have}")
        return
    backend = resolve_backend(item.config, item, spec.backend)
    if backend == "nccl" and item.get_closest_marker("gpu") is None:
        why = _nccl_unavailable(spec.n)
        if why:
            _skip_at_test(why)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> object | None:
    spec = ranks_spec(pyfuncitem)
    if spec is None:
        return None
    if _torchrun.active():
        _torchrun.ensure_initialized(_torchrun_backend(pyfuncitem.config, spec.backend))
        return None  # pytest's own hook calls the body in this process, in the job's group
    funcargs = pyfuncitem.funcargs
    testargs = {name: funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    failure = None
    try:
        run_in_ranks(
            pyfuncitem.config,
            pyfuncitem,
            pyfuncitem.obj,
            spec.n,
            (),
            testargs,
            backend=spec.backend,
            timeout=spec.timeout,
        )
    except (RankFailed, TypeError) as exc:
        failure = str(exc)
    if failure is not None:  # outside the except block: no "during handling" chain in the report
        pytest.fail(failure, pytrace=False)
    return True


def _skip_at_test(reason: str) -> None:
    """Skip, reported at the test's own location (not this module's line) like a skip in
    the body would be."""
    try:
        from _pytest.outcomes import Skipped

        raise Skipped(msg=reason, _use_item_location=True)
    except TypeError:  # pragma: no cover - older pytest without the keyword
        pytest.skip(reason)


def _torchrun_backend(config: pytest.Config, requested: str | None) -> str:
    return requested or config.getoption("weightsync_backend", "auto") or "auto"


# -- SIGTERM ----------------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """pytest received SIGTERM; raised like Ctrl-C so every pool is cleaned up on the way out."""


_SIGTERM = pytest.StashKey[object]()


def pytest_configure(config: pytest.Config) -> None:
    """Treat SIGTERM like Ctrl-C, unless someone already handles it or we are not main."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # a handler of the user's, the CI's, or an outer pytest session's own
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no signals here
        return
    config.stash[_SIGTERM] = signal.SIG_DFL


def _on_sigterm(signum, frame) -> None:
    # A second SIGTERM during cleanup ends the process at once, as it would without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated("SIGTERM received: stopping the session and the rank processes")


def _restore_sigterm(config: pytest.Config) -> None:
    previous = config.stash.get(_SIGTERM, None)
    if previous is None:
        return
    del config.stash[_SIGTERM]
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, previous)
    except (ValueError, OSError):  # pragma: no cover - not the main thread
        pass


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = session.config.stash.get(_POOLS, None)
    if cache is not None:
        cache.close_all()


def pytest_unconfigure(config: pytest.Config) -> None:
    cache = config.stash.get(_POOLS, None)
    if cache is not None:
        cache.close_all()
    _restore_sigterm(config)


# -- the fixture ------------------------------------------------------------------------------


class RankPoolFixture:
    """What the ``rank_pool`` fixture gives a test: ``run(fn, world_size, *args, **kwargs)``.

    Pools are shared by every test of the session (warm), keyed by world size and backend.
    """

    def __init__(self, config: pytest.Config, item: pytest.Item):
        self._config = config
        self._item = item

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        backend: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list:
        """``fn(*args, **kwargs)`` in every one of ``world_size`` ranks -> results in rank order.

        Raises :class:`~pytest_weightsync.ranks.RankFailed` with every rank's traceback when
        a rank fails or hangs (``RankTimeout``); a rank's ``pytest.skip`` skips the test.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"rank_pool.run world_size must be a positive int, got {world_size!r}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"rank_pool.run backend must be 'gloo', 'nccl' or None, got {backend!r}")
        if _torchrun.active():
            have = _torchrun.world_size()
            if world_size != have:
                _skip_at_test(f"rank_pool.run(world_size={world_size}) under torchrun needs WORLD_SIZE={world_size}; this job has {have}")
            _torchrun.ensure_initialized(_torchrun_backend(self._config, backend))
            try:
                return _torchrun.run_local(fn, args, kwargs)
            except RankSkipped as exc:
                _skip_at_test(exc.reason)
        return run_in_ranks(
            self._config, self._item, fn, world_size, args, kwargs, backend=backend, timeout=timeout
        )


@pytest.fixture
def rank_pool(request: pytest.FixtureRequest) -> RankPoolFixture:
    """Run module-level functions in n torch.distributed ranks; returns per-rank results."""
    return RankPoolFixture(request.config, request.node)
