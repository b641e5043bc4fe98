"""Tables of shared payloads built before, recognised instead of built again.

A stateless sender builds each update's payload afresh, but what it builds is the same every
update: the same names (a format's names are made once per process) and views of the same
trainer memory. :class:`~pytest_weightsync.reference_impl.sharing.shared_payload.SharedPayload`
then builds the same table again - a row per entry, 768 per layer for ``compat``, about 2 us
each on a CPU and twice that on a GPU host (2026-12-06). A table depends only on each entry's
name, storage, dtype, device, storage offset, shape and strides, so a payload whose entries
still have all of those as a payload that was tabled before gets that table.

The check is a handful of passes in C: the very name objects, every tensor's address and
storage offset in lists, its type, dtype, device, sizes, strides and flags (requires grad, lazy
conjugate or negative bits) through the native guard that the receiver's plan cache uses
(:func:`~pytest_weightsync.reference_impl.sharing.tensor_guard.native_metadata_guard`), and each
storage's address and size. Nothing here holds a tensor: an entry whose objects were freed and
replaced by others with the same facts gets the same, still correct, table. Where torch has no
native guard nothing is recognised.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any, Optional

import torch

from pytest_weightsync.reference_impl.sharing.tensor_guard import PTRS_EQUAL, native_metadata_guard

#: Payload tables remembered, and their entries in all (least recently used dropped first
#: past either): more than a whole model's buckets for every receiver rank of one engine, and
#: a few tens of MB of addresses at most.
MAX_TABLES = 256
MAX_ENTRIES = 1 << 20

_REQUIRES_GRAD = attrgetter("requires_grad")


@dataclass
class KnownTable:
    """One payload's table and the facts it was built from (see the module docstring)."""

    names: list
    ptrs: list
    offsets: list
    indices: list
    guard: Any  # None until the payload came back (see remember)
    firsts: list  # per shared storage: the index of the first entry that lives in it
    storage_ptrs: list
    storage_sizes: list
    table: bytes
    nbytes: int

    def holds(self, names: list, tensors: list) -> bool:
        """Whether ``names`` and ``tensors`` have every fact this table was built from."""
        if len(names) != len(self.names) or not all(map(is_, names, self.names)):
            return False
        if PTRS_EQUAL is not None:
            same_ptrs = PTRS_EQUAL(tensors, self.ptrs, self.indices)
        else:
            same_ptrs = list(map(torch.Tensor.data_ptr, tensors)) == self.ptrs
        if (not same_ptrs or list(map(torch.Tensor.storage_offset, tensors)) != self.offsets
                or any(map(_REQUIRES_GRAD, tensors)) or not self.guard.check(*tensors)):
            return False
        for first, ptr, size in zip(self.firsts, self.storage_ptrs, self.storage_sizes):
            storage = tensors[first].untyped_storage()
            if storage.data_ptr() != ptr or storage.nbytes() != size:
                return False
        return True


_KNOWN: "OrderedDict[tuple, KnownTable]" = OrderedDict()


def _key(names: list) -> Optional[tuple]:
    return (len(names), names[0], names[-1]) if names else None


def recall(names: list, tensors: list) -> Optional[KnownTable]:
    """The table built before for entries with every fact of these, or ``None``."""
    key = _key(names)
    known = _KNOWN.get(key) if key is not None else None
    if known is None or known.guard is None or not known.holds(names, tensors):
        return None
    _KNOWN.move_to_end(key)
    return known


def remember(names: list, tensors: list, offsets: list, firsts: list, storage_ptrs: list,
             storage_sizes: list, table: bytes, nbytes: int) -> None:
    """Keep the table of a payload just built (one that passed every check).

    A native guard over thousands of tensors costs several times the table (10 ms for 3,072 on
    a CPU), so it is made only for a payload seen a second time at the same addresses: a
    sender that allocates new tensors every update pays a list of addresses per payload, not
    a guard."""
    key = _key(names)
    if key is None:
        return
    ptrs = list(map(torch.Tensor.data_ptr, tensors))
    seen = _KNOWN.get(key)
    again = (seen is not None and seen.ptrs == ptrs and seen.offsets == offsets
             and seen.table == table and len(seen.names) == len(names)
             and all(map(is_, names, seen.names)))
    guard = native_metadata_guard(tensors) if again else None
    _KNOWN[key] = KnownTable(list(names), ptrs, list(offsets), list(range(len(tensors))), guard,
                             list(firsts), list(storage_ptrs), list(storage_sizes), table, nbytes)
    _KNOWN.move_to_end(key)
    entries = sum(len(known.names) for known in _KNOWN.values())
    while len(_KNOWN) > 1 and (len(_KNOWN) > MAX_TABLES or entries > MAX_ENTRIES):
        entries -= len(_KNOWN.popitem(last=False)[1].names)
