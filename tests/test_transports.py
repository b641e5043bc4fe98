"""The transport registry: one module per transport, one word each, one docs section each.

The builtin transports are the vocabulary's words, those a loader may be handed are the
loader-facing ones, every transport names a docs section that exists, and loading the registry
imports no torch (the plugin reads it at collection time).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_weightsync import transports
from pytest_weightsync.vocabulary import LOADER_TRANSPORTS, TRANSPORTS

ROOT = Path(__file__).resolve().parents[1]


def _anchors(path: Path) -> set:
    """GitHub's anchors of ``path``'s headings."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_builtin_transports_are_the_vocabulary_words():
    assert set(transports.BUILTIN) == set(TRANSPORTS)
    assert list(transports.all_transports())[-1] == transports.FALLBACK


def test_the_loader_facing_transports_are_the_loader_words():
    facing = {n for n, t in transports.all_transports().items() if t.loader_facing}
    assert facing == set(LOADER_TRANSPORTS)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_every_builtin_transport_has_its_module_and_docs_section(name):
    transport = transports.get(name)
    assert transport.name == name
    assert type(transport).__module__.startswith("pytest_weightsync.transports.")
    doc, _, anchor = transport.docs.partition("#")
    assert anchor in _anchors(ROOT / doc), (name, transport.docs)


def test_every_item_is_recognised_by_exactly_its_transport():
    import torch

    from pytest_weightsync import wire
    from pytest_weightsync.transports import weight_transfer as wt

    pairs = [("w", torch.ones(2))]
    items = {"tensors": pairs, "flattened_bucket": wire.flattened_bucket(pairs),
             "serialized": wire.TensorUpdate([b""]), "weight_transfer": wt.TransferCall(wt.START)}
    for name, item in items.items():
        assert transports.of(item).name == name
        claimed = [n for n, t in transports.all_transports().items()
                   if n != transports.FALLBACK and t.recognises(item)]
        assert claimed == ([] if name == "tensors" else [name])


def test_the_registry_imports_no_torch():
    code = ("import sys; from pytest_weightsync import transports; transports.names(); "
            "import pytest_weightsync.wire; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
