"""Bit-exact comparison of tensors and parameter sets, with located first mismatches.

Equality here means equal raw bits: each tensor is viewed as the integer dtype of the same
width (BF16 as int16, FP32 as int32, ...), so ``-0.0 != 0.0``, NaN payloads count, and no
tolerance can hide a wrong value. Failures raise :class:`AssertionError` subclasses whose
message gives the mismatch count and the first mismatch located in model terms, through an
optional ``locate(name, index)`` callable (e.g. ``layer=0 expert=3 projection=up row=5 col=2
receiver_rank=1``); without one the raw index is shown.

torch is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

Locate = Callable[[str, tuple], object]

_INT_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class ComparisonError(AssertionError):
    """Base of every comparison failure."""


class BitMismatchError(ComparisonError):
    """Two tensors of equal shape and dtype differ in some bits."""

    def __init__(self, message: str, name: str, count: int, index: tuple, location=None):
        super().__init__(message)
        self.name, self.count, self.index, self.location = name, count, index, location


class MetadataMismatchError(ComparisonError):
    """Shape, dtype or device differ, or a parameter is missing / unexpected."""


class StorageChangedError(ComparisonError):
    """A parameter was reallocated (its ``data_ptr`` or layout changed) instead of written
    in place."""


def raw_bits(tensor):
    """``tensor`` viewed as the signed/unsigned integer dtype of the same element size."""
    import torch

    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    size = tensor.element_size()
    if size not in _INT_BY_SIZE:
        raise TypeError(f"cannot compare raw bits of dtype {tensor.dtype} ({size}-byte elements)")
    return tensor.view(getattr(torch, _INT_BY_SIZE[size]))


def _describe(name: str, index: tuple, locate: Optional[Locate], rank):
    location = None
    if locate is not None:
        try:
            location = locate(name, index)
        except Exception as exc:  # a broken locator must not hide the mismatch itself
            location = f"<locate failed: {exc!r}>"
    if location is None:
        where = f"{name}{list(index)}"
        if rank is not None:
            where += f" on receiver rank {rank}"
        return where, None
    return f"{location} ({name}{list(index)})", location


def _fmt_value(tensor, index) -> str:
    """``value (bits 0x....)`` of one element, for messages."""
    value = tensor[index]
    bits = int(raw_bits(value.reshape(1))[0]) & ((1 << (8 * tensor.element_size())) - 1)
    shown = value.item() if not value.is_floating_point() else float(value)
    return f"{shown!r} (bits 0x{bits:0{2 * tensor.element_size()}x})"


def assert_bitwise_equal(actual, expected, *, name: str = "tensor",
                         locate: Optional[Locate] = None, rank=None) -> None:
    """Raise :class:`BitMismatchError` unless ``actual`` and ``expected`` have identical bits."""
    import torch

    where = f"{name} on receiver rank {rank}" if rank is not None else name
    if tuple(actual.shape) != tuple(expected.shape):
        raise MetadataMismatchError(f"{where}: shape {tuple(actual.shape)}, expected "
                                    f"{tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise MetadataMismatchError(f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    a = raw_bits(actual.detach()).cpu()
    e = raw_bits(expected.detach()).cpu()
    diff = a != e
    count = int(diff.sum())
    if count == 0:
        return
    index = tuple(int(i) for i in torch.nonzero(diff)[0]) if diff.dim() else ()
    text, location = _describe(name, index, locate, rank)
    message = (f"{where}: {count} of {diff.numel()} elements differ bitwise; first at {text}: "
               f"got {_fmt_value(actual.detach().cpu(), index)}, expected "
               f"{_fmt_value(expected.detach().cpu(), index)}")
    raise BitMismatchError(message, name, count, index, location)


def assert_state_equal(actual: Mapping, expected: Mapping, *, locate: Optional[Locate] = None,
                       rank=None) -> None:
    """Every name of ``expected`` is in ``actual`` with identical bits, and nothing else is."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        where = f" on receiver rank {rank}" if rank is not None else ""
        raise MetadataMismatchError(f"parameter names differ{where}: missing "
                                    f"{missing[:4]}, unexpected {extra[:4]}")
    for name in expected:
        assert_bitwise_equal(actual[name], expected[name], name=name, locate=locate, rank=rank)


@dataclass(frozen=True)
class TensorRecord:
    data_ptr: int
    shape: tuple
    stride: tuple
    dtype: object
    device: object
    copy: object
    #: The original storage, kept alive so the allocator cannot hand its address to a
    #: reallocated replacement (which would make a changed parameter look unchanged).
    storage: object = None


@dataclass(frozen=True)
class Snapshot:
    """Addresses, layouts and a bit copy of a set of named tensors at one moment. It holds
    the original storages until it is dropped, so addresses stay meaningful."""

    records: Mapping[str, TensorRecord]

    @classmethod
    def take(cls, named: Iterable) -> "Snapshot":
        named = named.items() if isinstance(named, Mapping) else named
        return cls({name: TensorRecord(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype,
                                       t.device, t.detach().clone(), t.untyped_storage())
                    for name, t in named})

    def tensors(self) -> dict:
        return {name: rec.copy for name, rec in self.records.items()}


def snapshot(named) -> Snapshot:
    """:meth:`Snapshot.take` of a mapping or iterable of ``(name, tensor)``."""
    return Snapshot.take(named)


def assert_same_storage(before: Snapshot, after: Mapping, *, rank=None) -> None:
    """Every parameter still exists at the same address with the same shape, stride, dtype and
    device, and no parameter was added: loads must write in place."""
    after = dict(after.items() if isinstance(after, Mapping) else after)
    where = f" on receiver rank {rank}" if rank is not None else ""
    missing = sorted(set(before.records) - set(after))
    extra = sorted(set(after) - set(before.records))
    if missing or extra:
        raise StorageChangedError(f"parameter set changed{where}: removed {missing[:4]}, "
                                  f"added {extra[:4]}")
    for name, rec in before.records.items():
        t = after[name]
        now = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        was = (rec.data_ptr, rec.shape, rec.stride, rec.dtype, rec.device)
        if now != was:
            raise StorageChangedError(
                f"{name}{where} was reallocated or re-laid-out instead of written in place: "
                f"(data_ptr, shape, stride, dtype, device) was {was}, now {now}")


def assert_unchanged(before: Snapshot, after: Mapping, *, exclude: Iterable[str] = (),
                     locate: Optional[Locate] = None, rank=None) -> None:
    """Parameters (all but ``exclude``) still hold the bits and storage they held at
    ``before``: nothing outside a payload, or nothing at all after a refused one, changed."""
    assert_same_storage(before, after, rank=rank)
    excluded = set(exclude)
    after = dict(after.items() if isinstance(after, Mapping) else after)
    for name, rec in before.records.items():
        if name not in excluded:
            assert_bitwise_equal(after[name], rec.copy, name=name, locate=locate, rank=rank)


def assert_loaded(params: Mapping, expected: Mapping, *, before: Optional[Snapshot] = None,
                  locate: Optional[Locate] = None, rank=None) -> None:
    """The conformance check of one receiver rank after an update: parameters still at their
    addresses (when ``before`` is given) and bit-identical to ``expected``."""
    if before is not None:
        assert_same_storage(before, params, rank=rank)
    assert_state_equal(params, expected, locate=locate, rank=rank)
