"""Which tensors a receiver can read as plain bytes, decided before anything is written.

A loader copies a payload tensor's elements straight out of its storage (``copy_``,
``torch.cat(out=)``, integer views of the bits). That is only meaningful, and only safe, for a
dense tensor that owns readable memory; tensor subclasses (``DTensor``, ``FakeTensor``,
functionalized and functorch-wrapped tensors ...), nested tensors, lazy neg/conj views and
freed or shrunk storage fail somewhere inside the copy, after earlier copies and padding
zeroing already ran, or worse (a freed ``direct`` bucket copied with ``torch.cat`` segfaults
the process).

The rule itself is :mod:`pytest_weightsync.readable`, the one home the judge (which must not
import the reference it judges) and the receiver share; this module words its problems as the
receiver's errors. :func:`kind_problem` is asked first (it needs nothing but the tensor's type
and flags; a nested tensor's ``shape`` would raise), :func:`storage_problem` after the device
check (a meta tensor is a wrong device, not a freed one). Both return the error class and the
reason, so the receiver words a :class:`~pytest_weightsync.reference_impl.errors.PayloadError`
for a payload entry and a ``ReceiverParamsError`` for a parameter it was handed.
"""

from __future__ import annotations

from typing import Optional

from pytest_weightsync import readable
from pytest_weightsync.readable import PLAIN_TYPES, view_bytes
from pytest_weightsync.reference_impl.errors import PayloadError

__all__ = ["ERRORS", "PLAIN_TYPES", "LazyViewError", "NestedTensorError", "Problem",
           "TensorStorageError", "TensorSubclassError", "UnloadableTensorError", "kind_problem",
           "storage_problem", "view_bytes"]


class UnloadableTensorError(PayloadError):
    """A ``torch.Tensor`` whose elements cannot be read as plain bytes of its storage."""


class TensorSubclassError(UnloadableTensorError, TypeError):
    """A tensor subclass or wrapper (``DTensor``, ``FakeTensor``, a functionalized tensor ...)
    instead of a plain tensor or ``nn.Parameter``."""


class NestedTensorError(UnloadableTensorError):
    """A nested (ragged) tensor: it has no single shape to load."""


class LazyViewError(UnloadableTensorError):
    """A lazy negation or conjugation view: its stored bits are not its values."""


class TensorStorageError(UnloadableTensorError):
    """A tensor whose storage was freed or is smaller than the view over it."""


Problem = Optional[tuple[type, str]]

#: :data:`pytest_weightsync.readable.KINDS` -> the error the receiver raises for it.
ERRORS = {"subclass": TensorSubclassError, "nested": NestedTensorError,
          "lazy_view": LazyViewError, "storage": TensorStorageError}


def kind_problem(tensor) -> Problem:
    """Why ``tensor`` is no plain dense tensor, from its type and flags only; ``None`` if it is."""
    problem = readable.kind_problem(tensor)
    return None if problem is None else (ERRORS[problem[0]], problem[1])


def storage_problem(tensor) -> Problem:
    """Why ``tensor``'s storage cannot be read (freed, too small, no data); ``None`` if it can.
    Call it on plain dense tensors (after :func:`kind_problem`) off the meta device."""
    problem = readable.storage_problem(tensor)
    return None if problem is None else (ERRORS[problem[0]], problem[1])
