"""What a receiver refuses before it writes a byte: the entry checks every receiver shares.

:class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver`, its engine-layout
and FP8 variants and the whole-model receiver all ask the same questions of a payload entry (a
``(str, Tensor)`` pair of a dense, readable kind, on the receiver's device, of the shape its
name requires) and of the parameters they are handed (:func:`checked_params`), and refuse with
the same :class:`PayloadError` subclasses. They live here, apart from any receiver's placement,
so a receiver variant asks them without inheriting one; ``receiver`` re-exports every name.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from pytest_weightsync.reference_impl.engine import tensor_checks
from pytest_weightsync.reference_impl.engine.checked_memo import CheckedMemo
from pytest_weightsync.reference_impl.errors import PayloadError, WeightSyncError, shown

__all__ = [
    "CHECKED",
    "DuplicateEntryError",
    "ExpertOutOfRangeError",
    "LazyViewError",
    "MemoryOverlapError",
    "MixedFormatError",
    "NestedTensorError",
    "PayloadDtypeError",
    "PayloadShapeError",
    "PayloadTypeError",
    "ReceiverParamsError",
    "TensorLayoutError",
    "TensorStorageError",
    "TensorSubclassError",
    "UnknownNameError",
    "UnloadableTensorError",
    "checked_params",
    "entry_fits",
    "entry_pair",
    "entry_readable_on",
    "extent",
]


class PayloadTypeError(PayloadError, TypeError):
    """The payload, or an entry of it, is not a ``(str, torch.Tensor)`` pair."""


class UnknownNameError(PayloadError):
    """A name that is no expert weight of this model (or not valid for the load format)."""


class ExpertOutOfRangeError(PayloadError):
    """An expert id ``>= num_experts`` (or a layer id ``>= num_layers``)."""


class DuplicateEntryError(PayloadError):
    """The same (layer, expert, projection) carried twice in one update."""


class MixedFormatError(PayloadError):
    """Names of two formats (per-expert, packed, hf_fused) in one bucket."""


class PayloadDtypeError(PayloadError):
    """A tensor whose dtype differs from the receiver parameter's."""


class PayloadShapeError(PayloadError):
    """A tensor whose shape differs from what its name requires."""


class TensorLayoutError(PayloadError):
    """A sparse or otherwise non-dense tensor, or a tensor on the wrong device."""


class MemoryOverlapError(PayloadError):
    """A source tensor sharing memory with a receiver parameter the same bucket writes: copying
    would read bytes it has already overwritten."""


# Refusals of tensors that are no plain dense tensor over readable memory (subclasses such as
# DTensor and FakeTensor, nested tensors, lazy neg/conj views, freed storage); re-exported so
# every payload error of the receiver is reachable from this module.
UnloadableTensorError = tensor_checks.UnloadableTensorError
TensorSubclassError = tensor_checks.TensorSubclassError
NestedTensorError = tensor_checks.NestedTensorError
LazyViewError = tensor_checks.LazyViewError
TensorStorageError = tensor_checks.TensorStorageError


def _refuse(problem, where: str) -> None:
    """Raise the payload error of a :mod:`tensor_checks` problem, prefixed by the entry."""
    if problem is not None:
        cls, reason = problem
        raise cls(f"{where}: {reason}")


def entry_pair(index: int, item, where_of) -> tuple[str, "torch.Tensor", str]:
    """``(name, tensor, where)`` of payload entry ``index`` once it is a ``(str, Tensor)`` pair
    of a dense, readable kind (every receiver asks this first, before reading the name);
    ``where_of(index[, name])`` words the entry for messages."""
    if not (isinstance(item, tuple) and len(item) == 2):
        raise PayloadTypeError(f"{where_of(index)} is a {type(item).__name__}, not a "
                               f"(name, tensor) pair")
    name, tensor = item
    if not isinstance(name, str):
        raise PayloadTypeError(f"{where_of(index)}: the name is a {type(name).__name__} "
                               f"{shown(name)}, not a str")
    where = where_of(index, name)
    if not isinstance(tensor, torch.Tensor):
        raise PayloadTypeError(f"{where} is a {type(tensor).__name__}, not a torch.Tensor")
    _refuse(tensor_checks.kind_problem(tensor), where)
    if tensor.layout != torch.strided:
        raise TensorLayoutError(f"{where}: {tensor.layout} tensor; only dense (strided) "
                                f"tensors can be loaded")
    return name, tensor, where


def entry_fits(tensor, shape, load_format: str, where: str, what: str = "") -> None:
    """Refuse an entry whose shape is not ``shape`` (``what`` says whose). Its strides are
    free in every format: ``load_format='direct'`` copies each tensor whole as SGLang's
    ``default_weight_loader`` does (the shape checked, then ``param.copy_``), so a strided
    view - a rank's fc2 columns of a trainer buffer - loads as a contiguous tensor would."""
    if tuple(tensor.shape) != tuple(shape):
        raise PayloadShapeError(f"{where}: shape {tuple(tensor.shape)}, expected "
                                f"{tuple(shape)}{what}")


def entry_readable_on(tensor, device, rank: int, where: str) -> None:
    """Refuse an entry on another device than receiver ``rank``'s parameters, or whose storage
    cannot be read (freed, too small): asked after the device, since a meta tensor is a wrong
    device and not a freed one."""
    if tensor.device != device:
        raise TensorLayoutError(f"{where}: tensor on device {tensor.device}, receiver rank "
                                f"{rank} parameters are on {device}")
    _refuse(tensor_checks.storage_problem(tensor), where)


class ReceiverParamsError(WeightSyncError):
    """Existing parameters handed to :class:`ReferenceReceiver` do not match its topology."""


def extent(tensor: torch.Tensor) -> Optional[tuple[int, int]]:
    """Byte range ``[start, end)`` the elements of ``tensor`` can occupy; ``None`` if empty."""
    if tensor.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    start = tensor.data_ptr()
    return start, start + span * tensor.element_size()


#: Receivers built per call over the same parameters check them once
#: (:mod:`~pytest_weightsync.reference_impl.engine.checked_memo`).
CHECKED = CheckedMemo()


def checked_params(params: Mapping[str, torch.Tensor], wants: Mapping[str, tuple],
                   rank: int, needs: str) -> dict[str, torch.Tensor]:
    """``params`` restricted to the names of ``wants`` (``{name: (shape, dtype)}``), each a
    dense, readable tensor of its shape and dtype, all on one device (``needs`` words what asks
    for them). Raises :class:`ReceiverParamsError` naming the first misfit."""
    if type(params) is not dict and not isinstance(params, Mapping):
        raise ReceiverParamsError(f"receiver rank {rank} params is a {type(params).__name__}, "
                                  f"not a mapping of name -> tensor")
    checked = {}
    for name, (shape, dtype) in wants.items():
        if name not in params:
            raise ReceiverParamsError(f"receiver rank {rank} has no parameter {name!r}")
        tensor = params[name]
        if not isinstance(tensor, torch.Tensor):
            raise ReceiverParamsError(f"receiver rank {rank} parameter {name!r} is a "
                                      f"{type(tensor).__name__}, not a torch.Tensor")
        problem = tensor_checks.kind_problem(tensor)
        if problem is None and tensor.layout != torch.strided:
            problem = (None, f"a {tensor.layout} tensor; parameters must be dense (strided)")
        if problem is None and not tensor.is_meta:
            problem = tensor_checks.storage_problem(tensor)
        if problem is not None:
            raise ReceiverParamsError(f"receiver rank {rank} parameter {name!r}: {problem[1]}")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ReceiverParamsError(
                f"receiver rank {rank} parameter {name!r} is {tuple(tensor.shape)} "
                f"{tensor.dtype}; {needs} needs {tuple(shape)} {dtype}")
        checked[name] = tensor
    devices = {t.device for t in checked.values()} if len(checked) > 1 else ()
    if len(devices) > 1:
        raise ReceiverParamsError(f"receiver rank {rank} parameters are spread over devices "
                                  f"{sorted(map(str, devices))}; they must share one")
    return checked
