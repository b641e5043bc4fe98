"""Which implementations the conformance suites run against, and the fixtures that hand them out.

Implementations (see :mod:`pytest_weightsync.protocols`) are registered four ways, all
equivalent:

1. an entry point in the ``weightsync.loaders`` group of an installed package;
2. ``--weightsync-loader module:attr`` on the command line (repeatable);
3. the ``pytest_weightsync_register_implementations(config)`` hook of a plugin;
4. a ``weightsync_implementations`` fixture overridden in a ``conftest.py``, returning a
   list. It is evaluated once at collection time (it parametrizes tests), so it may ask for
   no fixture other than ``pytestconfig``.

Each registration is an implementation object, a class (instantiated with no arguments) or
a ``"module:attr"`` string naming either. The reference implementation is registered like
everyone else (it is also a built-in default, so it runs when its entry point is not
installed). Stock SGLang's model loaders (``sglang-qwen3-moe``, ``sglang-qwen3.5-moe``, see
``pytest_weightsync.reference_impl.backends.sglang_models``) are built-in defaults too, added
only when SGLang imports (probed when a test first asks for implementations, never at plugin
import), so a conformance run shows how the real engine fares next to the loaders under test.
Built-in rows and their probes are reached by their ``"module:attr"`` names, as entry points
are: the plugin decides verdicts and imports nothing it judges.
Two registrations of the same name are one implementation when they are of the same class and
a usage error otherwise; ``--weightsync-only NAME`` narrows the set (and, naming no SGLang row,
spares the probe).

Resolving a registration runs the code under test (its module's import, its constructor, a
hook or fixture that lists implementations): each is bounded by the call time limit
(``--weightsync-call-timeout``, :mod:`pytest_weightsync.deadline`; the built-in rows are the
project's own and are not), and a time-out, ``SystemExit``, a ``KeyboardInterrupt`` of its own
or any other ``BaseException`` (:mod:`pytest_weightsync.boundary`) becomes a
:class:`RegistrationError` naming the registration: a usage error, with the JSON report still
written. A failed resolution is remembered, so nothing is imported twice.

Tests ask for ``weightsync_impl`` (every implementation), ``weightsync_loader`` (those with
``load_weights``) or ``weightsync_exporter`` (those with ``export_weights``); each is
parametrized here with the implementation name as the test id.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import pytest

from pytest_weightsync import boundary
from pytest_weightsync.deadline import CallTimeoutError, deadline
from pytest_weightsync.protocols import protocol_problems, roles_of
from pytest_weightsync.vocabulary import ROLES

#: Entry-point group third-party packages register implementations in.
ENTRY_POINT_GROUP = "weightsync.loaders"
#: Registered before everything else; deduplicated against its own entry point.
BUILTIN_DEFAULTS = ("pytest_weightsync.reference_impl.impl:ReferenceImplementation",)
#: Built-in defaults that need an optional backend: backend -> {name: "module:attr"}. Added
#: only when the backend probes as importable, and only when a test asks for implementations
#: (probing imports the backend: seconds, so never at plugin import or for runs without
#: conformance tests). ``WEIGHTSYNC_OPTIONAL_BUILTINS`` narrows them: unset = every available
#: backend, a comma-separated list = those backends, empty or ``none`` = none.
OPTIONAL_BUILTINS = {
    "sglang": {
        "sglang-qwen3-moe":
            "pytest_weightsync.reference_impl.backends.sglang_models:Qwen3MoeLoader",
        "sglang-qwen3.5-moe":
            "pytest_weightsync.reference_impl.backends.sglang_models:Qwen35MoeLoader",
    },
}
#: Backend -> ``"module:attr"`` of a function of no arguments saying whether the backend's rows
#: can run here: an object with a bool ``available`` and a ``reason`` sentence. The rows' own
#: module answers (imported by name, like the rows; importing it must not import the backend).
OPTIONAL_PROBES = {
    "sglang": "pytest_weightsync.reference_impl.backends.sglang_models:backend_status",
}
OPTIONAL_BUILTINS_ENV = "WEIGHTSYNC_OPTIONAL_BUILTINS"
#: Fixtures parametrized with implementations, and the role each requires (None: any).
IMPL_FIXTURES = {"weightsync_impl": None, "weightsync_loader": "loader",
                 "weightsync_exporter": "exporter",
                 "weightsync_distributed_exporter": "distributed_exporter",
                 "weightsync_serving_engine": "serving_engine",
                 "weightsync_orchestrator": "orchestrator",
                 "weightsync_adapter_loader": "adapter_loader",
                 "weightsync_adapter_exporter": "adapter_exporter",
                 "weightsync_adapter_merger": "adapter_merger"}

_BASE = pytest.StashKey["Registry"]()
_DECLARED = pytest.StashKey["Registry"]()
#: The error that building each registry ended with (kept: it is not built again).
_FAILED = pytest.StashKey[dict]()
_FIXTURE_EXTRAS = pytest.StashKey[dict]()
#: The text of a usage error raised while resolving registrations (the report writes it to
#: the JSON).
USAGE_ERROR = pytest.StashKey[str]()


class RegistrationError(pytest.UsageError):
    """A registration that cannot be used: unimportable, not an implementation, or a
    duplicate name. The message names the registration and where it came from."""


@dataclass(frozen=True)
class Registered:
    """One implementation under test, and where its registration came from."""

    name: str
    obj: Any
    source: str

    @property
    def roles(self) -> tuple[str, ...]:
        return roles_of(self.obj)

    def __repr__(self) -> str:  # shown in ids and failure headers
        return f"<implementation {self.name!r} from {self.source}>"


def _builtin(source: str) -> bool:
    return source.startswith("built-in default")


def at_boundary(source: str, what: str, fn, *args, bounded: bool = True):
    """``fn(*args)``: code of the registration ``source`` runs, under the call time limit
    when ``bounded``. A time-out, or anything it raises that is not an ``Exception``
    (:func:`pytest_weightsync.boundary.describe`), becomes a :class:`RegistrationError`;
    an ``Exception`` is passed on for the caller to word."""
    seen = boundary.interrupts()
    try:
        with deadline(what, None if bounded else 0):
            return fn(*args)
    except CallTimeoutError as error:
        raise RegistrationError(f"{source}: {error}") from None
    except BaseException as exc:
        text = boundary.describe(what, exc, seen)
        if text is None:
            raise
        raise RegistrationError(f"{source}: {text}; the registration is refused") from exc


def import_target(target: str, source: str) -> Any:
    """The object ``"package.module:attr.sub"`` names."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise RegistrationError(f"{source}: {target!r} is not of the form 'module:attr' "
                                f"(e.g. 'mypkg.sync:MyLoader')")
    try:
        obj = at_boundary(source, f"importing {module_name!r}", importlib.import_module,
                          module_name, bounded=not _builtin(source))
    except RegistrationError:
        raise
    except Exception as exc:
        raise RegistrationError(f"{source}: cannot import module {module_name!r} for "
                                f"{target!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistrationError(f"{source}: module {module_name!r} has no attribute "
                                    f"{attr!r} (from {target!r})") from None
    return obj


def as_implementation(obj: Any, source: str) -> Any:
    """``obj`` as an implementation instance: strings are imported, classes instantiated,
    and the result checked against the protocol."""
    if isinstance(obj, str):
        obj = import_target(obj, source)
    if inspect.isclass(obj):
        try:
            obj = at_boundary(source, f"{obj.__qualname__}()", obj, bounded=not _builtin(source))
        except RegistrationError:
            raise
        except Exception as exc:
            raise RegistrationError(f"{source}: cannot instantiate {obj.__qualname__} with no "
                                    f"arguments: {type(exc).__name__}: {exc}") from exc
    problems = protocol_problems(obj)
    if problems:
        raise RegistrationError(f"{source}: {obj!r:.100} is not a weightsync implementation: "
                                + "; ".join(problems))
    return obj


class Registry:
    """Implementations by name, in registration order."""

    def __init__(self, entries: Iterable[Registered] = ()) -> None:
        self._entries: dict[str, Registered] = {}
        for entry in entries:
            self._entries[entry.name] = entry

    def add(self, obj: Any, source: str) -> Optional[Registered]:
        """Register ``obj`` (see :func:`as_implementation`); returns the new entry, or
        ``None`` when the same implementation is already registered under its name."""
        impl = as_implementation(obj, source)
        known = self._entries.get(impl.name)
        if known is not None:
            if type(known.obj) is type(impl):
                return None
            raise RegistrationError(
                f"duplicate implementation name {impl.name!r}: {type(impl).__qualname__} from "
                f"{source} and {type(known.obj).__qualname__} from {known.source}; give each "
                f"implementation a unique 'name'")
        entry = Registered(impl.name, impl, source)
        self._entries[impl.name] = entry
        return entry

    def copy(self) -> "Registry":
        return Registry(self._entries.values())

    def only(self, names: Iterable[str], source: str) -> "Registry":
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in self._entries]
        if unknown:
            raise RegistrationError(f"{source}: no implementation named {unknown}; registered: "
                                    f"{sorted(self._entries)}")
        return Registry(self._entries[n] for n in names)

    def with_role(self, role: Optional[str]) -> list[Registered]:
        return [e for e in self._entries.values() if role is None or role in e.roles]

    def names(self) -> list[str]:
        return list(self._entries)

    def __iter__(self):
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def _entry_points() -> list:
    from importlib.metadata import entry_points

    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def optional_backends() -> list[str]:
    """Backends whose built-in rows this run may add (before probing), per
    ``WEIGHTSYNC_OPTIONAL_BUILTINS``."""
    import os

    wanted = os.environ.get(OPTIONAL_BUILTINS_ENV)
    if wanted is None:
        return list(OPTIONAL_BUILTINS)
    names = [n.strip() for n in wanted.split(",") if n.strip() and n.strip() != "none"]
    return [n for n in OPTIONAL_BUILTINS if n in names]


def optional_names() -> dict[str, str]:
    """Name -> backend of every optional built-in row (no import, no probe)."""
    return {name: backend for backend, rows in OPTIONAL_BUILTINS.items() for name in rows}


def optional_targets() -> list[tuple[str, str]]:
    """``(target, source)`` of the optional built-in rows available here: those of each
    allowed backend that probes as importable (a missing backend adds none)."""
    targets = []
    for backend in optional_backends():
        status = import_target(OPTIONAL_PROBES[backend], "built-in default")()
        if status.available:
            source = f"built-in default (stock {backend}: {status.reason})"
            targets += [(t, source) for t in OPTIONAL_BUILTINS[backend].values()]
    return targets


def build_registry(config: pytest.Config, optional: bool = True) -> Registry:
    """Built-in defaults (with the optional backends' rows when ``optional``), then entry
    points, then the hook, then ``--weightsync-loader``."""
    registry = Registry()
    for target in BUILTIN_DEFAULTS:
        registry.add(target, "built-in default")
    if optional:
        for target, source in optional_targets():
            registry.add(target, source)
    for ep in _entry_points():
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
        source = f"entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}, {dist})"
        try:
            obj = at_boundary(source, f"loading entry point {ep.name!r}", ep.load)
        except RegistrationError:
            raise
        except Exception as exc:
            raise RegistrationError(f"{source}: cannot load: {type(exc).__name__}: {exc}") from exc
        registry.add(obj, source)
    hook = getattr(config.hook, "pytest_weightsync_register_implementations", None)
    if hook is not None:
        source = "hook pytest_weightsync_register_implementations"
        try:
            results = at_boundary(source, "the hook", lambda: hook(config=config))
        except RegistrationError:
            raise
        except Exception as exc:
            raise RegistrationError(f"{source}: raised {type(exc).__name__}: {exc}") from exc
        for plugin_result in results:
            for obj in plugin_result or ():
                registry.add(obj, source)
    for target in config.getoption("weightsync_loader", None) or ():
        registry.add(target, f"--weightsync-loader {target}")
    return registry


def _built_once(config: pytest.Config, key, optional: bool) -> Registry:
    """The registry under ``key``, built at the first ask. A build that failed is not
    retried (it would import the code under test again): later asks raise its error again,
    and one cut short by an interruption leaves a :class:`RegistrationError` saying so."""
    if key in config.stash:
        return config.stash[key]
    failed = config.stash.setdefault(_FAILED, {})
    if key in failed:
        raise RegistrationError(str(failed[key]))
    try:
        config.stash[key] = build_registry(config, optional=optional)
    except RegistrationError as error:
        failed[key] = error
        raise
    except BaseException as exc:
        failed[key] = RegistrationError(f"the registrations were not resolved: resolving them "
                                        f"ended with {type(exc).__name__}: {exc}")
        raise
    return config.stash[key]


def resolution_failed(config: pytest.Config, message: str) -> None:
    """Record that resolving the registrations failed with ``message`` (a call in it was
    abandoned and the session is ending): later asks raise it instead of importing again,
    and the JSON report names it as the usage error."""
    failed = config.stash.setdefault(_FAILED, {})
    for key in (_DECLARED, _BASE):
        if key not in config.stash:
            failed.setdefault(key, RegistrationError(message))
    config.stash[USAGE_ERROR] = message


def declared_registry(config: pytest.Config) -> Registry:
    """Every registration except the optional built-in rows (nothing is probed), built once:
    what validating the command line and naming sources needs."""
    return _built_once(config, _DECLARED, optional=False)


def base_registry(config: pytest.Config) -> Registry:
    """The registry every test shares (everything but conftest fixture overrides, the
    optional built-in rows included), built once."""
    declared_registry(config)  # a bad registration is reported before any probing
    return _built_once(config, _BASE, optional=True)


def _needs_optional(config: pytest.Config) -> bool:
    """Whether this run may show optional rows: not when ``--weightsync-only`` names none."""
    only = config.getoption("weightsync_only", None) or ()
    return not only or any(name in optional_names() for name in only)


# --------------------------------------------------------------------------------------------
# Hooks and fixtures
# --------------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """Resolve registrations before collecting, so a bad one is a usage error (exit code 4)
    with its message, not a collection traceback per module - also on the xdist controller.
    The message is kept for the JSON report."""
    config = session.config
    only = config.getoption("weightsync_only", None) or ()
    try:
        registry = base_registry(config) if only and _needs_optional(config) else \
            declared_registry(config)
        if only:
            registry.only(only, "--weightsync-only")
    except RegistrationError as error:
        config.stash[USAGE_ERROR] = str(error)
        raise


class _NoImplementation:
    """The parameter of a test whose role no selected implementation plays (e.g. an exporter
    test under ``--weightsync-only`` naming a loader): such a test is deselected, not skipped."""

    def __repr__(self) -> str:
        return "no-implementation"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    unused = [item for item in items if any(
        isinstance(getattr(item, "callspec", None) and item.callspec.params.get(name),
                   _NoImplementation) for name in IMPL_FIXTURES)]
    if unused:
        drop = set(map(id, unused))
        items[:] = [item for item in items if id(item) not in drop]
        config.hook.pytest_deselected(items=unused)


@pytest.fixture
def weightsync_implementations() -> list:
    """Extra implementations to run the conformance suites against: override in a
    ``conftest.py`` and return a list of implementation objects, classes or ``"module:attr"``
    strings. Evaluated once at collection time (it may ask only for ``pytestconfig``)."""
    return []


def _fixture_extras(metafunc: pytest.Metafunc) -> tuple[tuple, str]:
    """``(objects, source)`` returned by the closest ``weightsync_implementations`` override."""
    defs = getattr(metafunc, "_arg2fixturedefs", {}).get("weightsync_implementations") or ()
    if not defs:
        return (), ""
    fixturedef = defs[-1]
    func = fixturedef.func
    if getattr(func, "__module__", None) == __name__:  # the default above: no extras
        return (), ""
    # baseid is empty for a rootdir conftest and for plugins: name the defining module then.
    where = fixturedef.baseid or getattr(func, "__module__", None) or "plugin"
    source = f"fixture weightsync_implementations ({where})"
    cache = metafunc.config.stash.setdefault(_FIXTURE_EXTRAS, {})
    if id(fixturedef) not in cache:
        unsupported = [a for a in fixturedef.argnames if a != "pytestconfig"]
        if unsupported or inspect.isgeneratorfunction(func):
            found = (f"it asks for {unsupported}" if unsupported else "it is a generator")
            raise RegistrationError(
                f"{source}: it parametrizes tests, so it is evaluated at collection time and may "
                f"ask for no fixture but pytestconfig and must return (not yield) a list; "
                f"{found}")
        kwargs = {"pytestconfig": metafunc.config} if fixturedef.argnames else {}
        try:
            result = at_boundary(source, f"{getattr(func, '__qualname__', func)}()",
                                 lambda: func(**kwargs))
        except RegistrationError:
            raise
        except Exception as exc:
            raise RegistrationError(f"{source}: raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, (list, tuple)):
            raise RegistrationError(f"{source}: must return a list of implementations, got "
                                    f"{type(result).__name__}")
        cache[id(fixturedef)] = (tuple(result), source)
    return cache[id(fixturedef)]


def registry_for(metafunc: pytest.Metafunc) -> Registry:
    """The implementations a test function runs against: the shared registry plus its
    conftest override, narrowed by ``--weightsync-only``."""
    config = metafunc.config
    registry = base_registry(config) if _needs_optional(config) else declared_registry(config)
    extras, source = _fixture_extras(metafunc)
    if extras:
        registry = registry.copy()
        for obj in extras:
            registry.add(obj, source)
    only = metafunc.config.getoption("weightsync_only", None) or ()
    if only:
        registry = registry.only(only, "--weightsync-only")
    return registry


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize before anything else, so the implementation is always the first part of a
    test id: the same id whether the suites are collected by path or with ``--pyargs`` (where
    their conftest registers later), so a printed id can be pasted back."""
    wanted = [name for name in IMPL_FIXTURES if name in metafunc.fixturenames]
    if not wanted:
        return
    registry = registry_for(metafunc)
    for argname in wanted:
        entries = registry.with_role(IMPL_FIXTURES[argname])
        if not entries:
            metafunc.parametrize(argname, [_NoImplementation()], ids=["no-implementation"],
                                 indirect=True)
            continue
        metafunc.parametrize(argname, entries, ids=[e.name for e in entries], indirect=True)


def _parametrized(request: pytest.FixtureRequest):
    # Each of the fixtures below asks for ``weightsync_implementations`` only so that a
    # conftest override of it is part of the test's fixture closure, where
    # pytest_generate_tests finds it.
    param = getattr(request, "param", None)
    if not isinstance(param, Registered):
        raise RuntimeError(f"{request.fixturename} is parametrized by pytest_weightsync.registry; "
                           f"it cannot be requested from a fixture that is not")
    return param.obj


@pytest.fixture
def weightsync_impl(request: pytest.FixtureRequest, weightsync_implementations):
    """One registered implementation (the test runs once per implementation)."""
    return _parametrized(request)


def _role_fixture(name: str, role: str):
    """The fixture ``name``: one registered implementation playing ``role`` (parametrized by
    :func:`pytest_generate_tests`)."""

    def fixture(request: pytest.FixtureRequest, weightsync_implementations):
        return _parametrized(request)

    fixture.__doc__ = f"One registered implementation that has ``{ROLES[role]}``."
    return pytest.fixture(name=name)(fixture)


weightsync_loader = _role_fixture("weightsync_loader", "loader")
weightsync_exporter = _role_fixture("weightsync_exporter", "exporter")
weightsync_distributed_exporter = _role_fixture("weightsync_distributed_exporter",
                                                "distributed_exporter")
weightsync_serving_engine = _role_fixture("weightsync_serving_engine", "serving_engine")
weightsync_orchestrator = _role_fixture("weightsync_orchestrator", "orchestrator")
weightsync_adapter_loader = _role_fixture("weightsync_adapter_loader", "adapter_loader")
weightsync_adapter_exporter = _role_fixture("weightsync_adapter_exporter", "adapter_exporter")
weightsync_adapter_merger = _role_fixture("weightsync_adapter_merger", "adapter_merger")


def registered_of(item: pytest.Item) -> Optional["Registered"]:
    """The registration ``item`` runs against (its implementation fixture's parameter),
    ``None`` for a test that has none."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    for argname in IMPL_FIXTURES:
        entry = callspec.params.get(argname)
        if isinstance(entry, Registered):
            return entry
    return None


def implementation_of(item: pytest.Item) -> Optional[str]:
    """Name of the implementation ``item`` runs against, ``None`` for a test that has none."""
    entry = registered_of(item)
    return None if entry is None else entry.name
