"""vLLM 0.33.0's source, read from its wheel (never installed), for the vLLM layout checks.

vLLM's CUDA wheel does not import in this project's environment (``docs/backends.md``,
"vLLM"), so ``test_vllm_layouts.py`` holds the vLLM layout model to vLLM's source text: its
constants, mappings and module tree from the AST, and its loading functions *compiled from
that text* and run on CPU over stand-ins for what they read around them (the TP rank and
size, the logger, the current platform). Nothing of vLLM is copied into this repository:
every function is read from the wheel when the tests run.

Where is the wheel: ``$WEIGHTSYNC_VLLM_WHEEL`` (the file, or a folder holding it), else
``.cache/vllm/`` of the repository, where ``ci/install.sh`` fetches it (pinned, hash-checked,
skipped when present). Without it the tests skip with a reason that says how to fetch it - on
a developer machine without network. In CI (``$CI`` set) a missing wheel fails instead: the
source checks must never silently not run there.
"""

from __future__ import annotations

import ast
import copy
import functools
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_weightsync.reference_impl.backends import vllm as facts

VERSION = facts.VERSION
WHEEL = facts.WHEEL
ENV = "WEIGHTSYNC_VLLM_WHEEL"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "vllm"


def wheel_path():
    """The wheel's path, or ``None`` when it is not here."""
    given = os.environ.get(ENV)
    for candidate in ([Path(given)] if given else []) + [CACHE]:
        if candidate.is_file():
            return candidate
        if (candidate / WHEEL).is_file():
            return candidate / WHEEL
    return None


def missing_reason() -> str:
    return (f"vLLM {VERSION}'s wheel ({WHEEL}) is not in {CACHE} nor at ${ENV}: the vLLM source "
            "checks need it (bash ci/install.sh fetches it, pinned and hash-checked; only a "
            "developer machine without network skips them - CI fails instead)")


def require_wheel() -> Path:
    """The wheel; skips (developer machine) or fails (``$CI`` set) when it is absent."""
    path = wheel_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(missing_reason() + "; $CI is set, so this is an install failure",
                        pytrace=False)
        pytest.skip(missing_reason())
    return path


@functools.lru_cache(maxsize=None)
def _zip(path: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(path)


def text(member: str) -> str:
    """The text of ``member`` of the wheel (``vllm/...`` or ``vllm-0.33.0.dist-info/...``)."""
    return _zip(str(require_wheel())).read(member).decode()


def data(member: str) -> bytes:
    return _zip(str(require_wheel())).read(member)


def members() -> list[str]:
    return _zip(str(require_wheel())).namelist()


@functools.lru_cache(maxsize=None)
def tree(rel: str) -> ast.Module:
    """The AST of ``vllm/<rel>``."""
    return ast.parse(text("vllm/" + rel), rel)


def class_node(rel: str, name: str) -> ast.ClassDef:
    for node in tree(rel).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"vLLM {VERSION}: no class {name} in vllm/{rel}")


def _overload(node) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list)


def method_node(rel: str, cls: str, name: str) -> ast.FunctionDef:
    """The definition of ``cls.name`` (not its ``@overload`` stubs)."""
    for node in class_node(rel, cls).body:
        if isinstance(node, ast.FunctionDef) and node.name == name and not _overload(node):
            return node
    raise LookupError(f"vLLM {VERSION}: no method {cls}.{name} in vllm/{rel}")


def function_node(rel: str, name: str) -> ast.FunctionDef:
    for node in tree(rel).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"vLLM {VERSION}: no function {name} in vllm/{rel}")


def module_constant(rel: str, name: str):
    """The literal value of module-level ``name = <literal>`` (annotated or not)."""
    for node in tree(rel).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"vLLM {VERSION}: no constant {name} in vllm/{rel}")


def class_attribute_expr(rel: str, cls: str, name: str) -> ast.expr:
    for node in class_node(rel, cls).body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            return node.value
    raise LookupError(f"vLLM {VERSION}: no class attribute {cls}.{name} in vllm/{rel}")


# --------------------------------------------------------------------------------------------
# Compiling vLLM's own code from the wheel's text
# --------------------------------------------------------------------------------------------

_KEEP_DECORATORS = {"staticmethod", "classmethod", "property", "cached_property"}


class _Prepare(ast.NodeTransformer):
    """Make extracted definitions runnable here: annotations dropped (they name vLLM types),
    imports of vLLM inside functions dropped (the caller provides those names), decorators
    other than staticmethod / classmethod / property (and ``x.setter``) dropped, ``@overload``
    stubs removed, base classes renamed by ``bases``."""

    def __init__(self, bases: dict, keep_annotations: bool):
        self.bases = bases
        self.keep_annotations = keep_annotations

    def _decorators(self, node):
        keep = []
        for d in node.decorator_list:
            if isinstance(d, ast.Name) and d.id in _KEEP_DECORATORS:
                keep.append(d)
            elif isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter", "getter"):
                keep.append(d)
        return keep

    def visit_FunctionDef(self, node):
        if any(isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list):
            return None
        node.decorator_list = self._decorators(node)
        if not self.keep_annotations:
            node.returns = None
            for arg in (node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                        + [a for a in (node.args.vararg, node.args.kwarg) if a]):
                arg.annotation = None
        self.generic_visit(node)
        return node

    def visit_ClassDef(self, node):
        node.decorator_list = [d for d in node.decorator_list
                               if (isinstance(d, ast.Name) and d.id == "dataclass")
                               or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name)
                                   and d.func.id == "dataclass")]
        node.bases = [ast.Name(self.bases[b.id], ast.Load())
                      if isinstance(b, ast.Name) and b.id in self.bases else b
                      for b in node.bases]
        node.bases = [b for b in node.bases if not (isinstance(b, ast.Name) and b.id == "_drop")]
        node.keywords = []
        self.generic_visit(node)
        if not node.body:
            node.body = [ast.Pass()]
        return node

    def visit_AnnAssign(self, node):
        if self.keep_annotations:
            return node
        if node.value is None:
            return ast.Pass()
        return ast.Assign([node.target], node.value)

    def _vllm_import(self, node):
        module = getattr(node, "module", None) or ""
        names = [a.name for a in node.names]
        if node.__class__ is ast.ImportFrom and (module.startswith("vllm") or node.level):
            return ast.Pass()
        if any(n.startswith("vllm") for n in names):
            return ast.Pass()
        return node

    visit_Import = _vllm_import
    visit_ImportFrom = _vllm_import


def compile_defs(rel: str, names, namespace: dict, *, bases=None,
                 keep_annotations: bool = False) -> dict:
    """Compile the top-level classes / functions / assignments ``names`` of ``vllm/<rel>``
    (in the file's order) into ``namespace`` and return it. ``bases`` renames base classes
    (``{"PluggableLayer": "Module"}``; ``"_drop"`` removes one)."""
    wanted = set(names)
    body = []
    for node in tree(rel).body:
        name = (node.name if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                else next((t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                           if isinstance(t, ast.Name)), None))
        if name in wanted:
            body.append(copy.deepcopy(node))
            wanted.discard(name)
    if wanted:
        raise LookupError(f"vLLM {VERSION}: vllm/{rel} has no {sorted(wanted)}")
    module = _Prepare(bases or {}, keep_annotations).visit(ast.Module(body=body, type_ignores=[]))
    ast.fix_missing_locations(module)
    exec(compile(module, f"<vllm {VERSION} vllm/{rel}>", "exec"), namespace)
    return namespace


def compile_methods(rel: str, cls: str, methods, namespace: dict, *, name=None,
                    base: str = "object") -> type:
    """A class ``name`` (default: ``cls``) holding only ``methods`` of vLLM's ``cls``,
    compiled into ``namespace`` on ``base``."""
    source = class_node(rel, cls)
    body = [copy.deepcopy(n) for n in source.body
            if isinstance(n, ast.FunctionDef) and n.name in set(methods) and not _overload(n)]
    found = {n.name for n in body}
    if found != set(methods):
        raise LookupError(f"vLLM {VERSION}: {cls} in vllm/{rel} lacks "
                          f"{sorted(set(methods) - found)}")
    new = ast.ClassDef(name=name or cls, bases=[ast.Name(base, ast.Load())], keywords=[],
                       body=body, decorator_list=[])
    module = _Prepare({}, False).visit(ast.Module(body=[new], type_ignores=[]))
    ast.fix_missing_locations(module)
    exec(compile(module, f"<vllm {VERSION} vllm/{rel}:{cls}>", "exec"), namespace)
    return namespace[name or cls]


class Logger:
    """Stands in for vLLM's logger: records what vLLM would have logged."""

    def __init__(self):
        self.records = []

    def _log(self, level):
        def log(msg, *args, **kwargs):
            self.records.append((level, msg % args if args else msg))
        return log

    def __getattr__(self, name):
        if name in ("debug", "info", "warning", "error", "warning_once", "info_once",
                    "debug_once"):
            return self._log(name)
        raise AttributeError(name)


class Platform(SimpleNamespace):
    """Stands in for ``vllm.platforms.current_platform``: a CPU that is no GPU."""

    def __getattr__(self, name):
        if name.startswith("is_") or name.startswith("use_") or name == "has_device_capability":
            return lambda *a, **k: False
        raise AttributeError(name)
