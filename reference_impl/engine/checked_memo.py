"""Parameters checked before, recognised unchanged: :func:`checked_params` at the cost of a look.

A loader that keeps no receiver between calls (the reference keeps only weak references to the
parameters, so a caller that drops them frees them) builds one per call: ``begin_update``,
every ``load_weights`` bucket and ``end_update`` each check the parameters again (type, flags,
storage, shape, dtype, device). On a GPU that is tens of microseconds per call, host time that
sits in front of every copy of the per-update protocol, where one update of a layer's experts
copies in a few hundred.

:class:`CheckedMemo` keeps, per parameters mapping, weak references to the tensors a check
passed and what the check read of each (:func:`_state`); the next check of the very same
tensors, each as it was, returns the same result without running again. Anything a check reads
that a tensor object can change in place (``.data =``, ``set_``, ``resize_``, a storage freed
with ``untyped_storage().resize_(0)``, a lazy neg/conj view swapped in) changes the recorded
state, so the full check runs and names the problem. Only plain ``dict`` mappings are
recognised (another mapping's ``__getitem__`` may answer differently each time), and the memo
holds no tensor: entries whose tensors died are found dead and rebuilt.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Mapping

import torch

from pytest_weightsync.reference_impl.sharing.tensor_guard import native_metadata_guard

#: Parameter mappings remembered at once (least recently used forgotten first).
MAX_ENTRIES = 64

_DISPATCH_KEYS = getattr(torch._C, "_dispatch_keys", None)


def _state(tensor: torch.Tensor) -> tuple:
    """What a parameters check reads of ``tensor`` that the object can change in place: its
    exact type, dispatch keys (functional, functorch, nested, neg, conj, layout, device kind),
    dtype, device, shape, strides, storage offset, and its storage's address and size."""
    storage = tensor.untyped_storage()
    kind = (_DISPATCH_KEYS(tensor) if _DISPATCH_KEYS is not None
            else (tensor.layout, tensor.is_neg(), tensor.is_conj(), tensor.is_nested,
                  torch._is_functional_tensor(tensor),
                  torch._C._functorch.is_functorch_wrapped_tensor(tensor)))
    return (type(tensor), kind, tensor.dtype, tensor.device, tensor.shape, tensor.stride(),
            tensor.storage_offset(), storage.data_ptr(), storage.nbytes())


def _where(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.storage_offset()


class _Entry:
    """One check that passed: the tensors (weakly), and what it read of them: with the native
    guard (:func:`~pytest_weightsync.reference_impl.sharing.tensor_guard.native_metadata_guard`)
    their addresses and storage offsets beside it (a storage freed, shrunk or swapped moves
    the address), else :func:`_state` of each."""

    __slots__ = ("wants", "rank", "needs", "names", "refs", "guard", "states")

    def __init__(self, wants, rank, needs, checked: dict):
        tensors = list(checked.values())
        self.wants, self.rank, self.needs = wants, rank, needs
        self.names = tuple(checked)
        self.refs = tuple(map(weakref.ref, tensors))
        self.guard = native_metadata_guard(tensors)
        self.states = tuple(map(_where if self.guard is not None else _state, tensors))

    def same(self, params: dict, wants, rank, needs):
        """The earlier result, or ``None`` when anything it read may differ now."""
        if rank != self.rank or needs != self.needs or wants != self.wants:
            return None
        checked = {}
        for name, ref in zip(self.names, self.refs):
            tensor = params.get(name)
            if tensor is None or tensor is not ref():
                return None
            checked[name] = tensor
        tensors = checked.values()
        try:
            if self.guard is not None:
                same = (self.guard.check(*tensors)
                        and tuple(map(_where, tensors)) == self.states)
            else:
                same = tuple(map(_state, tensors)) == self.states
        except Exception:  # a tensor swapped for one that cannot be read: the check words it
            return None
        return checked if same else None


class CheckedMemo:
    """Results of a parameters check, kept per mapping (see the module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()  # id(params) -> _Entry

    def __len__(self) -> int:
        return len(self._entries)

    def checked(self, check: Callable, params: Mapping, wants: Mapping, rank: int,
                needs: str) -> dict:
        """``check(params, wants, rank, needs)``, or its earlier result when ``params`` (a
        plain dict) still maps the same names to the very tensors it passed, each as it was."""
        if type(params) is not dict:
            return check(params, wants, rank, needs)
        key = id(params)
        entry = self._entries.get(key)
        if entry is not None:
            found = entry.same(params, wants, rank, needs)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        checked = check(params, wants, rank, needs)  # raises for a misfit: nothing is kept
        self._entries[key] = _Entry(dict(wants), rank, needs, checked)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return checked

    def clear(self) -> None:
        self._entries.clear()
