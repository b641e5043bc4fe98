"""One protocol home: ``pytest_weightsync.protocols`` defines the implementation protocol and the
only ``Capabilities``; the plugin modules never import the reference implementation or the
suites (no import cycle: ``reference_impl`` imports the plugin's protocols, not the reverse);
capability predicates that raise are one usage error naming the implementation."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_weightsync"
#: Modules that may import neither reference_impl nor suites anywhere, not even lazily (the
#: registry reaches its built-in rows by their "module:attr" names, never by an import; every
#: plugin module is held to it by tests/test_house.py, these by name here too).
NEVER = ("protocols.py", "capabilities.py", "claims.py", "distributed.py", "plugin.py",
         "compare.py", "activation.py", "wire.py", "readable.py", "registry.py",
         "eligibility.py")
FORBIDDEN = ("pytest_weightsync.reference_impl", "pytest_weightsync.suites", "reference_impl",
             "suites")


def _imports(tree, top_level_only: bool):
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_plugin_modules_do_not_import_reference_impl_or_suites():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        strict = rel in NEVER
        for name in _imports(tree, top_level_only=not strict):
            if _forbidden(name):
                bad.append(f"{rel}: import {name}" + ("" if strict else " at module level"))
    assert not bad, "plugin modules import the reference implementation or suites:\n" + \
        "\n".join(bad)


BLOCKER = '''
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[:2] in (["pytest_weightsync", "reference_impl"],
                                   ["pytest_weightsync", "suites"]):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
import pytest_weightsync.plugin, pytest_weightsync.protocols, pytest_weightsync.registry
import pytest_weightsync.claims, pytest_weightsync.distributed, pytest_weightsync.report
for name in ("torch", "pytest_weightsync.reference_impl", "pytest_weightsync.suites"):
    assert name not in sys.modules, name
print("ok")
'''


def test_plugin_imports_with_reference_impl_blocked_and_without_torch():
    proc = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_select_uses_the_one_capabilities_class():
    from pytest_weightsync import protocols
    from pytest_weightsync.reference_impl.senders import select

    assert select.Capabilities is protocols.Capabilities
    from pytest_weightsync import vocabulary
    from pytest_weightsync.reference_impl.model import layout
    from pytest_weightsync.reference_impl.engine import receiver
    from pytest_weightsync.reference_impl.backends import megatron

    # one home per word: everyone holds the vocabulary's own objects, no copies
    assert protocols.FORMATS is vocabulary.FORMATS
    assert protocols.ORDERS is vocabulary.ORDERS is layout.GATE_UP_ORDERS
    assert protocols.EXPERT_IMPLS is vocabulary.EXPERT_IMPLS is layout.EXPERT_IMPLS
    assert megatron.EXPERT_TYPES is vocabulary.EXPERT_IMPLS
    assert receiver.LOAD_FORMATS is vocabulary.LOAD_FORMATS
    assert layout.PAD_MODES is vocabulary.PAD_MODES


def test_trainer_side_claims_skip_with_the_reason():
    from pytest_weightsync.protocols import Capabilities
    from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology

    spec = MoESpec(num_layers=2, num_experts=4, hidden=8, intermediate=4)
    te_only = Capabilities(expert_impls={"te_grouped"}, max_trainer_pp=1, max_trainer_ep=2)
    assert "TEGroupedMLP" not in (te_only.trainer_refusal(spec, TrainerTopology()) or "x")
    assert "SequentialMLP" in te_only.trainer_refusal(spec, TrainerTopology())
    assert te_only.trainer_refusal(spec, TrainerTopology(expert_impl="te_grouped")) is None
    assert "pipeline parallelism" in te_only.trainer_refusal(
        spec, TrainerTopology(pp=2, expert_impl="te_grouped"))
    assert "ep <= 2" in te_only.trainer_refusal(spec, TrainerTopology(ep=4, expert_impl="te_grouped"))
    with pytest.raises(ValueError, match="expert_impls"):
        Capabilities(expert_impls={"grouped"})
    with pytest.raises(ValueError, match="max_trainer_tp"):
        Capabilities(max_trainer_tp=0)


def test_raising_predicate_is_a_claim_error_naming_it():
    from pytest_weightsync.protocols import Capabilities, ClaimError
    from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology

    def picky(spec, trainer):
        return trainer.nonexistent

    caps = Capabilities(trainer_topology=picky)
    with pytest.raises(ClaimError, match=r"trainer_topology predicate .*picky.* raised "
                                         r"AttributeError"):
        caps.trainer_refusal(MoESpec(1, 1, 1, 1), TrainerTopology())


BADMOD = '''
from pytest_weightsync.protocols import Capabilities


def boom(spec, receiver):
    raise KeyError("moe_tp")


class Bad:
    name = "bad-predicate"
    capabilities = Capabilities(topology=boom)

    def load_weights(self, params, payload, *, format, spec, topology, rank):
        pass
'''

TESTS = '''
import pytest
from types import SimpleNamespace

RECEIVER = SimpleNamespace(moe_tp=1, moe_ep=1, moe_dp=1, order="gate_up", padded=False)
CASES = [SimpleNamespace(spec=None, receiver=RECEIVER, trainer=None, n=n) for n in range(40)]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("fmt", ["compat", "packed", "direct"])
def test_each(weightsync_loader, case, fmt):
    pass
'''


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_raising_predicate_is_one_collection_error(pytester: pytest.Pytester, xdist):
    pytester.makepyfile(test_many=TESTS, badmod=BADMOD)
    result = pytester.runpytest_subprocess("-p", "weightsync", "--weightsync-loader",
                                           "badmod:Bad", "--weightsync-only", "bad-predicate",
                                           "-p", "no:cacheprovider", *xdist)
    out = result.stdout.str()
    # one collection error (one per xdist worker), no test run: not 120 failures
    assert result.ret in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.TESTS_FAILED), out
    errors = 2 if xdist else 1
    assert out.count("E   pytest_weightsync.claims.CapabilityPredicateError: implementation "
                     "'bad-predicate'") == errors, out
    assert "topology predicate boom raised KeyError" in out, out
    assert f"{errors} error" in out and " passed" not in out and " failed" not in out, out
