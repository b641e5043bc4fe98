"""Bit-exact comparison of tensors and parameter sets, with located first mismatches.

Equality here means equal raw bits: each tensor is viewed as the integer dtype of the same
width (BF16 as int16, FP32 as int32, ...), so ``-0.0 != 0.0``, NaN payloads count, and no
tolerance can hide a wrong value. Failures raise :class:`AssertionError` subclasses whose
message gives the mismatch count and the first mismatch located in model terms, through an
optional ``locate(name, index)`` callable (e.g. ``layer=0 expert=3 projection=up row=5 col=2
receiver_rank=1``); without one the raw index is shown. They derive from
:class:`pytest_weightsync.failures.LocatedFailure`, so a failing test shows that message, not
the frames above it, and the functions that raise them leave their own frames out of the
traceback of such a failure.

Snapshots hold copies and the original storages of every tensor they record; their ``repr``
names the tensors and never their data (a storage's own ``repr`` prints every byte, one per
line, and pytest computes it for the arguments of every frame that holds a snapshot).

torch is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from pytest_weightsync.failures import LocatedFailure

__all__ = [
    "BitMismatchError", "ComparisonError", "DifferenceKinds", "Locate",
    "MetadataMismatchError", "Snapshot", "StorageChangedError", "TensorRecord",
    "assert_bitwise_equal", "assert_loaded", "assert_same_storage", "assert_state_equal",
    "assert_unchanged", "difference_kinds", "first_difference", "raw_bits", "same_bits",
    "snapshot",
]

Locate = Callable[[str, tuple], object]

_INT_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class ComparisonError(LocatedFailure):
    """Base of every comparison failure."""


def _hide_frame(excinfo) -> bool:
    """``__tracebackhide__`` of the functions that raise comparison failures: their frames add
    nothing to the message of one, but do show where any other error (a bug) came from."""
    return excinfo is not None and excinfo.errisinstance(ComparisonError)


class BitMismatchError(ComparisonError):
    """Two tensors of equal shape and dtype differ in some bits. ``kinds`` says how (a
    :class:`DifferenceKinds`): a loader that canonicalized NaNs or flushed subnormals is told
    apart from one that put values in the wrong place."""

    def __init__(self, message: str, name: str, count: int, index: tuple, location=None,
                 kinds: "DifferenceKinds | None" = None):
        super().__init__(message)
        self.name, self.count, self.index, self.location = name, count, index, location
        self.kinds = kinds if kinds is not None else DifferenceKinds(value=count)


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


def same_bits(a, b) -> bool:
    """Whether ``a`` and ``b`` have one shape and hold the same bits in every element."""
    return a.shape == b.shape and bool((raw_bits(a) == raw_bits(b)).all())


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
    """``value (bits 0x....)`` of one element, for messages (only that element leaves its
    device)."""
    value = tensor[index].cpu()
    words = raw_bits(value.reshape(1)).reshape(-1)  # two words for a complex element
    width = words.element_size()
    bits = " ".join(f"0x{int(w) & ((1 << (8 * width)) - 1):0{2 * width}x}" for w in words.tolist())
    shown = float(value) if value.is_floating_point() else value.item()
    return f"{shown!r} (bits {bits})"


@dataclass(frozen=True)
class DifferenceKinds:
    """How the differing elements of two tensors differ, counted per kind.

    ``nan_payload``: both are NaN, with other payload bits (a loader that stages BF16 through
    FP32 is exact for every finite value but canonicalizes NaNs); ``zero_sign``: both are
    zero, of opposite sign; ``subnormal_flush``: expected a subnormal, got a zero (flush to
    zero in a conversion or kernel); ``value``: anything else (a wrong value, a wrong place).
    Bits stay the contract: every kind is a mismatch; the kind only says what to look for."""

    nan_payload: int = 0
    zero_sign: int = 0
    subnormal_flush: int = 0
    value: int = 0

    _WORDS = {"nan_payload": "NaN payload bits", "zero_sign": "sign of zero",
              "subnormal_flush": "subnormals flushed to zero"}
    _ONLY = {"nan_payload": "only NaN payload bits differ ({n}): both sides are NaN there",
             "zero_sign": "sign of zero differs ({n})",
             "subnormal_flush": "subnormals flushed to zero ({n})"}

    @property
    def kind(self) -> str:
        """The one kind every differing element has, or ``"mixed"``."""
        present = [k for k in ("nan_payload", "zero_sign", "subnormal_flush", "value")
                   if getattr(self, k)]
        return present[0] if len(present) == 1 else "mixed"

    def describe(self) -> str:
        kind = self.kind
        if kind in self._ONLY:
            return self._ONLY[kind].format(n=_elements(getattr(self, kind)))
        special = [f"{self._WORDS[k]} ({_elements(getattr(self, k))})" for k in self._WORDS
                   if getattr(self, k)]
        head = f"values differ ({_elements(self.value)})"
        return head + (f", besides {', '.join(special)}" if special else "")


def _elements(n: int) -> str:
    return f"{n} element{'s' if n != 1 else ''}"


#: Floating dtypes whose bits are sign, exponent, mantissa (IEEE-like), by name.
_IEEE_LIKE = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
              "float8_e4m3fnuz", "float8_e5m2fnuz")


#: IEEE binary formats (every all-ones exponent with a non-zero mantissa is a NaN), whose
#: difference kinds are classified on their bits alone.
_IEEE_BINARY = ("float16", "bfloat16", "float32", "float64")


def difference_kinds(actual, expected, diff) -> DifferenceKinds:
    """Classify the elements where ``diff`` (a bool mask of ``actual``'s shape) is set;
    integer, complex and other dtypes count every difference as ``value``.

    A failing run must cost what a passing one does: the IEEE formats are classified on their
    raw bits, and every special kind (a NaN pair, a zero of the other sign, a subnormal
    flushed) needs the expected element to be a NaN, a zero or a subnormal - an all-ones or
    all-zero exponent, a small share of any tensor - so only those differing elements are
    gathered (gathering every differing element of a misplaced block costs more than the
    test's own check). FP8 formats, with NaN encodings of their own, gather every differing
    element and ask torch."""
    import torch

    count = int(diff.sum())
    dtype = actual.dtype
    name = str(dtype).replace("torch.", "")
    if name not in _IEEE_LIKE:
        return DifferenceKinds(value=count)
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    exponent = info.bits - 1 - mantissa
    exponent_field = ((1 << exponent) - 1) << mantissa
    if name in _IEEE_BINARY:
        ab = raw_bits(actual.detach()).reshape(-1)
        eb = raw_bits(expected.detach()).reshape(-1).to(ab.device)
        field = eb & exponent_field
        candidates = diff.reshape(-1).to(ab.device) & ((field == 0) | (field == exponent_field))
        ab, eb = ab[candidates], eb[candidates]
        mantissa_field = (1 << mantissa) - 1
        a_nan = ((ab & exponent_field) == exponent_field) & ((ab & mantissa_field) != 0)
        e_nan = ((eb & exponent_field) == exponent_field) & ((eb & mantissa_field) != 0)
    else:  # FP8: e4m3fn's NaN is all ones, the fnuz types' the negative zero
        a = actual.detach()[diff.to(actual.device)]
        e = expected.detach()[diff.to(expected.device)].to(a.device)
        ab, eb = raw_bits(a), raw_bits(e)
        a_nan, e_nan = a.to(torch.float32).isnan(), e.to(torch.float32).isnan()
    magnitude = (1 << (info.bits - 1)) - 1  # the sign is masked off
    a_zero, e_zero = (ab & magnitude) == 0, (eb & magnitude) == 0
    e_subnormal = ((eb & exponent_field) == 0) & ~e_zero
    nan = a_nan & e_nan
    ordinary = ~a_nan & ~e_nan  # a NaN of the fnuz types has the bits of a negative zero
    zero = a_zero & e_zero & ordinary
    flush = e_subnormal & a_zero & ordinary
    special = nan | zero | flush
    return DifferenceKinds(nan_payload=int(nan.sum()), zero_sign=int(zero.sum()),
                           subnormal_flush=int(flush.sum()), value=count - int(special.sum()))


def first_difference(actual, expected):
    """``(count, first index, mask)`` of the elements whose raw bits differ, or ``None`` when
    all are equal. One ``torch.equal`` pass when they are; no Python loop over elements."""
    import torch

    a, e = raw_bits(actual.detach()), raw_bits(expected.detach())
    if a.device != e.device:
        a, e = a.cpu(), e.cpu()
    if torch.equal(a, e):
        return None
    diff = a != e
    if actual.is_complex():
        diff = diff.any(-1)  # the real and imaginary parts of one element
    count = int(diff.sum())
    if diff.dim() == 0:
        return count, (), diff
    flat = int(torch.argmax(diff.reshape(-1).to(torch.uint8)))  # the first True
    index = []
    for size in reversed(diff.shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return count, tuple(reversed(index)), diff


def assert_bitwise_equal(actual, expected, *, name: str = "tensor",
                         locate: Optional[Locate] = None, rank=None) -> None:
    """Raise :class:`BitMismatchError` unless ``actual`` and ``expected`` have identical bits.
    The message gives the count, the kind of difference (:class:`DifferenceKinds`) and the
    first differing element, located."""
    __tracebackhide__ = _hide_frame
    where = f"{name} on receiver rank {rank}" if rank is not None else name
    if tuple(actual.shape) != tuple(expected.shape):
        raise MetadataMismatchError(f"{where}: shape {tuple(actual.shape)}, expected "
                                    f"{tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise MetadataMismatchError(f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    found = first_difference(actual, expected)
    if found is None:
        return
    count, index, diff = found
    kinds = difference_kinds(actual, expected, diff)
    text, location = _describe(name, index, locate, rank)
    message = (f"{where}: {count} of {diff.numel()} elements differ bitwise: "
               f"{kinds.describe()}; first at {text}: got {_fmt_value(actual.detach(), index)}, "
               f"expected {_fmt_value(expected.detach(), index)}")
    raise BitMismatchError(message, name, count, index, location, kinds)


def assert_state_equal(actual: Mapping, expected: Mapping, *, locate: Optional[Locate] = None,
                       rank=None) -> None:
    """Every name of ``expected`` is in ``actual`` with identical bits, and nothing else is."""
    __tracebackhide__ = _hide_frame
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

    def __repr__(self) -> str:
        return (f"TensorRecord(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
                f"data_ptr=0x{self.data_ptr:x})")


@dataclass(frozen=True)
class Snapshot:
    """Addresses, layouts and a bit copy of a set of named tensors at one moment. It holds
    the original storages until it is dropped, so addresses stay meaningful."""

    records: Mapping[str, TensorRecord]

    #: Names shown in the repr.
    SHOWN = 3

    def __repr__(self) -> str:
        names = list(self.records)
        shown = ", ".join(repr(n) for n in names[:self.SHOWN])
        more = f", ... (+{len(names) - self.SHOWN})" if len(names) > self.SHOWN else ""
        tensors = "tensor" if len(names) == 1 else "tensors"
        return f"Snapshot({len(names)} {tensors}" + (f": {shown}{more})" if names else ")")

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
    __tracebackhide__ = _hide_frame
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
    __tracebackhide__ = _hide_frame
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
    __tracebackhide__ = _hide_frame
    if before is not None:
        assert_same_storage(before, params, rank=rank)
    assert_state_equal(params, expected, locate=locate, rank=rank)
