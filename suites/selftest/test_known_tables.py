"""A shared payload's table is recognised only for entries with every fact it was built from.

A stateless sender builds the same payload every update; ``SharedPayload`` takes the table it
built before (``sharing.known_tables``) once the payload came back at the same addresses. The
oracle here is a table built with nothing remembered: whatever was remembered, a payload's
table, storages and entry count equal that one's, and a bad entry is refused as it would be.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.model.layout import MoESpec  # noqa: E402
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.senders import compat  # noqa: E402
from pytest_weightsync.reference_impl.sharing import known_tables, tensor_guard  # noqa: E402
from pytest_weightsync.reference_impl.sharing.shared_payload import (  # noqa: E402
    SharedPayload,
    SharedPayloadError,
)

SPEC = MoESpec(num_layers=2, num_experts=4, hidden=16, intermediate=8)

needs_guard = pytest.mark.skipif(
    tensor_guard.native_metadata_guard([torch.zeros(1)]) is None,
    reason="this torch has no native tensor guard: nothing is recognised")


@pytest.fixture(autouse=True)
def nothing_remembered():
    known_tables._KNOWN.clear()
    yield
    known_tables._KNOWN.clear()


def fresh(items) -> SharedPayload:
    """The oracle: the payload tabled with nothing remembered (and nothing left behind)."""
    saved = dict(known_tables._KNOWN)
    known_tables._KNOWN.clear()
    try:
        return SharedPayload(items)
    finally:
        known_tables._KNOWN.clear()
        known_tables._KNOWN.update(saved)


def same(got: SharedPayload, want: SharedPayload) -> None:
    assert got.table == want.table and got.entries == want.entries and got.nbytes == want.nbytes
    assert ([(w.data_ptr(), w.numel(), w.device) for w in got.wholes]
            == [(w.data_ptr(), w.numel(), w.device) for w in want.wholes])


@needs_guard
def test_a_payload_seen_twice_is_tabled_from_memory_the_third_time():
    full = synth.grouped_full_weights(SPEC, 1)
    for _ in range(2):
        SharedPayload(compat.export(full))
    items = compat.export(full)
    key = known_tables._key([name for name, _ in items])
    recalled = known_tables.recall([n for n, _ in items], [t for _, t in items])
    assert recalled is known_tables._KNOWN[key]
    same(SharedPayload(items), fresh(items))


@needs_guard
@pytest.mark.parametrize("change", ["shape", "strides", "dtype", "storage", "name", "grad",
                                    "lazy-neg", "fewer"])
def test_an_entry_with_any_fact_changed_is_tabled_anew(change):
    full = synth.grouped_full_weights(SPEC, 2)
    for _ in range(2):
        SharedPayload(compat.export(full))
    items = compat.export(full)
    name, tensor = items[5]
    changed = {
        "shape": lambda: (name, tensor.view(-1)),
        "strides": lambda: (name, tensor.t()),
        "dtype": lambda: (name, tensor.view(torch.float16)),
        "storage": lambda: (name, tensor.clone()),
        "name": lambda: ("".join(name), tensor),  # an equal string, another object
        "grad": lambda: (name, torch.nn.Parameter(tensor)),  # the same memory, needing grad
        "lazy-neg": lambda: (name, tensor._neg_view()),
        "fewer": None,
    }[change]
    items = items[:-1] if changed is None else items[:5] + [changed()] + items[6:]
    if change in ("grad", "lazy-neg"):
        for build in (SharedPayload, fresh):
            with pytest.raises(SharedPayloadError):
                build(items)
        return
    same(SharedPayload(items), fresh(items))


def test_a_sender_of_new_tensors_every_update_builds_no_guard():
    full = synth.grouped_full_weights(SPEC, 3)
    for _ in range(3):
        items = [(n, t.clone()) for n, t in compat.export(full)]
        same(SharedPayload(items), fresh(items))
    assert all(known.guard is None for known in known_tables._KNOWN.values())


def test_the_memory_of_tables_is_bounded_by_tables_and_by_entries(monkeypatch):
    full = synth.grouped_full_weights(SPEC, 4)
    per_layer = 3 * SPEC.num_experts
    monkeypatch.setattr(known_tables, "MAX_TABLES", 2)
    for layer in range(SPEC.num_layers):
        SharedPayload(compat.export(full, [layer]))
    SharedPayload(compat.export(full))  # both layers: a third payload
    assert [k[0] for k in known_tables._KNOWN] == [per_layer, 2 * per_layer]
    monkeypatch.setattr(known_tables, "MAX_ENTRIES", 2 * per_layer)
    SharedPayload(compat.export(full, [0]))
    assert [k[0] for k in known_tables._KNOWN] == [per_layer], "the oldest dropped past the entries"
