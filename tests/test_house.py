"""The house keeps its plan: rooms of ``reference_impl`` import only what they may, the oracle
shares no code with what it judges, the plugin (the judge) imports nothing of the reference it
judges, no room imports the suites, and no module or room of the repository is part of an
import cycle; the room table of ``docs/architecture.md`` says what ``MAY_IMPORT`` says.

Imports are read from the source (every ``import``, lazy ones inside functions included), so a
cycle or a forbidden import is caught before anything runs it. The registry's loading of a
registered ``"module:attr"`` string (how entry points, built-in rows and the reference's
eligibility decision are reached) is no import statement, and is how the plugin reaches what it
judges.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Repository folder -> the dotted name it installs as.
PACKAGES = {"pytest_weightsync": "pytest_weightsync",
            "reference_impl": "pytest_weightsync.reference_impl",
            "suites": "pytest_weightsync.suites"}
REFERENCE = "pytest_weightsync.reference_impl"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """Every first-party module ``name`` imports (resolved to a module, not a package attribute)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


GRAPH = {name: sorted(set(_imports(name, path))) for name, path in MODULES.items()}


def _cycles(graph: dict[str, list]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_the_repository_is_part_of_an_import_cycle():
    assert len(MODULES) > 100, "the module walk found too little"
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    importer = "pytest_weightsync.reference_impl.engine.receiver"
    imported = "pytest_weightsync.reference_impl.model.layout"
    assert imported in GRAPH[importer]
    planted = dict(GRAPH, **{imported: GRAPH[imported] + [importer]})
    assert [importer, imported] in _cycles(planted)


def _room(name: str):
    parts = name.split(".")
    if parts[:2] != REFERENCE.split(".") or len(parts) < 3:
        return None
    return parts[2]


ROOMS = importlib.import_module(REFERENCE).ROOMS


def test_the_reference_has_few_modules_at_its_top_level_and_every_room_says_what_it_is():
    top = sorted(p.stem for p in (ROOT / "reference_impl").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 10, top
    folders = sorted(p.name for p in (ROOT / "reference_impl").iterdir()
                     if (p / "__init__.py").is_file())
    assert folders == sorted(ROOMS)
    for room in ROOMS:
        module = importlib.import_module(f"{REFERENCE}.{room}")
        doc = module.__doc__ or ""
        assert len(doc.split()) >= 30, f"{room}/__init__.py must say what the room is"
        assert set(module.MAY_IMPORT) <= set(ROOMS) | {"errors"}, room


def _forbidden(graph: dict, room: str) -> list[str]:
    """``"module imports module"`` for every import of ``room`` that its ``MAY_IMPORT`` omits
    (the plugin and ``reference_impl``'s own ``__init__`` are open to every room)."""
    allowed = set(importlib.import_module(f"{REFERENCE}.{room}").MAY_IMPORT) | {room}
    return [f"{name} imports {target}" for name in graph if _room(name) == room
            for target in graph[name] if _room(target) not in allowed | {None}]


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_the_rooms_it_may(room):
    assert _forbidden(GRAPH, room) == []


def _imports_of(room: str) -> dict[str, set]:
    return {name: {_room(t) for t in targets} for name, targets in GRAPH.items()
            if _room(name) == room}


def test_the_oracle_never_imports_a_sender_a_receiver_or_a_trainer():
    # Stated apart from MAY_IMPORT: loosening the oracle's list must not loosen this.
    wrong = {name: rooms & {"senders", "engine", "trainer", "sharing"}
             for name, rooms in _imports_of("oracle").items()}
    assert {k: v for k, v in wrong.items() if v} == {}
    assert any("model" in rooms for rooms in _imports_of("oracle").values())


def test_receivers_never_read_the_oracle():
    readers = [name for name, rooms in _imports_of("engine").items()
               if "oracle" in rooms and not name.endswith(".process")]
    assert readers == []


def test_the_room_check_sees_a_planted_import():
    name, sender = f"{REFERENCE}.oracle.synth", f"{REFERENCE}.senders.direct"
    assert sender in MODULES
    planted = dict(GRAPH, **{name: GRAPH[name] + [sender]})
    assert _forbidden(planted, "oracle") == [f"{name} imports {sender}"]


def _part(name: str) -> str:
    """``"plugin"``, ``"suites"`` or the reference room (``"reference.<room>"``) of a module."""
    folder = MODULES[name].relative_to(ROOT).parts[0]
    if folder == "reference_impl":
        return f"reference.{_room(name) or '__init__'}"
    return {"pytest_weightsync": "plugin", "suites": "suites"}[folder]


def _crossings(graph: dict, source: str, target: str) -> list[str]:
    """``"module imports module"`` for every import from a module of part ``source`` into one of
    part ``target`` (a prefix: ``"reference"`` is every room)."""
    return [f"{name} imports {t}" for name in graph if _part(name).startswith(source)
            for t in graph[name] if _part(t).startswith(target)]


def test_the_plugin_imports_nothing_of_the_reference_it_judges():
    assert _crossings(GRAPH, "plugin", "reference") == []


def test_no_room_of_the_reference_imports_the_suites():
    assert _crossings(GRAPH, "reference", "suites") == []


def test_no_room_is_part_of_an_import_cycle():
    rooms: dict[str, set] = {}
    for name, targets in GRAPH.items():
        rooms.setdefault(_part(name), set()).update(
            _part(t) for t in targets if _part(t) != _part(name))
    assert _cycles({room: sorted(targets) for room, targets in rooms.items()}) == []


def test_the_judge_check_sees_a_planted_lazy_import(tmp_path):
    plugin, reference = "pytest_weightsync.wire", f"{REFERENCE}.engine.tensor_checks"
    assert plugin in MODULES and reference in MODULES
    planted = tmp_path / "wire.py"
    planted.write_text(MODULES[plugin].read_text() + "\n\ndef planted():\n    from "
                       "pytest_weightsync.reference_impl.engine import tensor_checks\n")
    graph = dict(GRAPH, **{plugin: sorted(set(_imports(plugin, planted)))})
    assert _crossings(graph, "plugin", "reference") == [f"{plugin} imports {reference}"]


def _room_table() -> dict[str, set]:
    """Room -> the rooms its row of ``docs/architecture.md``'s room table says it may import
    (the last column, words before any parenthesis)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| room | what it holds | may import |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        may = cells[-1].split("(", 1)[0]
        rows[cells[0].strip("`/")] = {w.strip() for w in may.split(",") if w.strip()}
    return rows


def test_the_room_table_in_the_docs_says_what_may_import_says():
    rows = _room_table()
    assert sorted(rows) == sorted(ROOMS)
    for room in ROOMS:
        may = set(importlib.import_module(f"{REFERENCE}.{room}").MAY_IMPORT)
        assert rows[room] | {"errors"} == may | {"errors"}, room


def _placed(text: str, stem: str) -> bool:
    """Whether ``stem`` is named inside backticks in ``text`` (``stem``, ``stem.py``, a path or
    a list of modules ending with it) or in one of its fenced drawings."""
    import re

    if re.search(rf"`[^`\n]*\b{re.escape(stem)}(\.py)?\b[^`\n]*`", text):
        return True
    fenced = "".join(text.split("```")[1::2])  # the tree drawings
    return re.search(rf"\b{re.escape(stem)}\b", fenced) is not None


def test_every_module_is_placed_in_the_architecture_doc():
    text = (ROOT / "docs" / "architecture.md").read_text()
    unplaced = [str(path.relative_to(ROOT)) for name, path in MODULES.items()
                if path.name != "__init__.py" and not name.startswith(
                    ("pytest_weightsync.suites.selftest", "pytest_weightsync.suites.conftest"))
                and not _placed(text, path.stem)]
    assert unplaced == []


def test_the_where_table_names_the_extension_points():
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Where does X go"):]
    for row in ("a new model family", "a new transport", "a new engine control-plane call",
                "a new adapter format"):
        assert f"| {row}" in table, row
    for point in ("weightsync.transports", "pytest_weightsync_extra_topologies", "`weightsync`"):
        assert point in table, point
