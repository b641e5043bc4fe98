"""How a function travels from the test process to the ranks.

pickle sends functions by name (``module.qualname``), but a test module is imported by pytest
under a name that only resolves with pytest's ``sys.path`` (``importmode=prepend``) or not at
all (``importmode=importlib``). A :class:`FunctionRef` therefore carries the module's name,
its file and the parent's ``sys.path``: the rank restores the path, imports the module by name
and falls back to loading it from its file. The module is registered in ``sys.modules`` under
the parent's name *before* the arguments are unpickled, so arguments whose classes live in
the test module resolve too.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import pickle
import sys
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class ModuleRef:
    """A module as the parent knows it: importable name and the file it came from."""

    name: str
    file: str | None
    #: pytest rewrote the module's asserts in the parent; do the same in the rank so a
    #: failing assert there explains itself just as well.
    rewrite: bool = False

    @classmethod
    def of(cls, module_name: str) -> "ModuleRef":
        module = sys.modules.get(module_name)
        loader = getattr(module, "__loader__", None)
        rewrite = type(loader).__name__ == "AssertionRewritingHook"
        return cls(module_name, getattr(module, "__file__", None), rewrite)

    def load(self):
        """Import the module in this process, making sure it is the parent's file."""
        module = sys.modules.get(self.name)
        if module is not None and _same_file(getattr(module, "__file__", None), self.file):
            return module
        if module is not None:
            # A different file under the same name (a warm rank reused by another pytest
            # run's test module of the same basename): forget it and import afresh.
            del sys.modules[self.name]
        if self.rewrite and self.file is not None:
            rewritten = _load_rewritten(self.name, self.file)
            if rewritten is not None:
                return rewritten
        try:
            module = importlib.import_module(self.name)
        except ImportError:
            module = None
        if module is not None and (self.file is None or _same_file(module.__file__, self.file)):
            return module
        if self.file is None:
            raise ImportError(f"module {self.name!r} cannot be imported in the rank process")
        spec = importlib.util.spec_from_file_location(self.name, self.file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load module {self.name!r} from {self.file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(self.name, None)
            raise
        return module


@dataclasses.dataclass(frozen=True)
class FunctionRef:
    """A module-level function or a test-class method, by module and qualified name.

    ``bind`` means the last name is a method of a class to instantiate with no arguments
    (how pytest builds test-class instances); instance state set by the parent's fixtures does
    not travel.
    """

    module: ModuleRef
    qualname: str
    bind: bool = False

    def resolve(self) -> Callable[..., Any]:
        owner: Any = self.module.load()
        *path, last = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        if self.bind and isinstance(owner, type):
            return getattr(owner(), last)
        return getattr(owner, last)


@dataclasses.dataclass(frozen=True)
class PickledCallable:
    """Any other picklable callable (a ``functools.partial``, a callable instance), by value.

    ``preload`` is the module its class or function came from, imported first for the same
    reason as :class:`FunctionRef`.
    """

    payload: bytes
    preload: ModuleRef | None

    def resolve(self) -> Callable[..., Any]:
        if self.preload is not None:
            self.preload.load()
        return pickle.loads(self.payload)


def describe(fn: Callable[..., Any]) -> FunctionRef | PickledCallable:
    """Turn ``fn`` into something a rank can resolve, or raise TypeError saying why not."""
    if not callable(fn):
        raise TypeError(f"the function to run in the ranks must be callable, got {fn!r}")
    func = fn.__func__ if inspect.ismethod(fn) else fn
    qualname = getattr(func, "__qualname__", None)
    module_name = getattr(func, "__module__", None)
    if inspect.isfunction(func) and qualname and module_name:
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"{module_name}.{qualname} cannot run in the ranks: it is a lambda or a "
                f"nested function, which a spawned process cannot import; define it at "
                f"module level"
            )
        bind = inspect.ismethod(fn) and not isinstance(fn.__self__, type)
        return FunctionRef(ModuleRef.of(module_name), qualname, bind=bind)
    try:
        payload = pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"{fn!r} cannot run in the ranks: it cannot be pickled ({exc})") from exc
    owner = getattr(fn, "func", fn)  # functools.partial keeps the function in .func
    owner_module = getattr(owner, "__module__", None) or type(fn).__module__
    return PickledCallable(payload, ModuleRef.of(owner_module) if owner_module else None)


def dumps_arguments(args: tuple, kwargs: dict, what: str) -> bytes:
    """Pickle call arguments, naming the argument that cannot travel when one cannot."""
    try:
        return pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    for index, value in enumerate(args):
        _check_picklable(value, f"{what}: positional argument {index}")
    for name, value in kwargs.items():
        _check_picklable(value, f"{what}: argument {name!r}")
    raise TypeError(f"{what}: the arguments cannot be pickled together")  # pragma: no cover


def _check_picklable(value: Any, where: str) -> None:
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{where} ({type(value).__name__}) cannot be pickled to the rank processes: {exc}. "
            f"Values reach the ranks by pickle; use picklable parameters and fixture values, "
            f"or build the object inside the test body."
        ) from exc


def merge_sys_path(parent_path: list[str]) -> None:
    """Put the parent's ``sys.path`` first, keeping this process's extra entries after it."""
    seen = set(parent_path)
    sys.path[:] = list(parent_path) + [p for p in sys.path if p not in seen]


def _load_rewritten(name: str, file: str):
    """Execute ``file`` as module ``name`` with pytest's assert rewriting; None if unavailable."""
    try:
        import ast
        import types

        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:  # pragma: no cover - pytest is a dependency
        return None
    with open(file, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=file)
    rewrite_asserts(tree, source, file)
    code = compile(tree, file, "exec", dont_inherit=True)
    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    module = types.ModuleType(name)
    module.__file__ = file
    module.__package__ = package
    module.__spec__ = importlib.util.spec_from_file_location(name, file)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)
