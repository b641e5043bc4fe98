"""Shapes and bytes as every decoder and encoder of a transport reads them.

One home for the three rules each wire format needs: what a shape on the wire may be (as
SGLang's ``reshape`` / ``torch.empty`` take it), how many bytes an entry spans, and a tensor's
bytes whatever its strides. torch is imported lazily.
"""

from __future__ import annotations

from pytest_weightsync.transports.base import WireFormatError

__all__ = ["checked_shape", "entry_bytes", "tensor_bytes"]


def checked_shape(shape, what: str) -> tuple:
    """``shape`` as a tuple of non-negative ints, or :class:`WireFormatError` (``what`` says
    whose shape). Taken as SGLang's receivers take it (``reshape``, ``torch.empty``): a tuple,
    list or ``torch.Size`` of ints (anything with ``__index__``, a numpy int included, bool
    excluded), or one such int for a 1-D shape. A float (even ``2.0``), a bool, a str, a set or
    a mapping is refused where ``int()`` would quietly truncate or reorder it (``(2.9, 8)``
    read as ``(2, 8)``); a negative size, which ``reshape`` would infer, is refused as no size
    a sender can mean."""
    import operator

    import torch

    if isinstance(shape, bool):
        raise WireFormatError(f"{what}: shape {shape!r} is a bool, not a sequence of ints")
    if not isinstance(shape, (tuple, list, torch.Size)):
        try:
            return checked_shape((operator.index(shape),), what)
        except TypeError:
            raise WireFormatError(f"{what}: shape {shape!r:.80} is a {type(shape).__name__}, "
                                  f"not a tuple, list or torch.Size of ints") from None
    dims = []
    for d in shape:
        if isinstance(d, bool) or isinstance(d, (float, complex)):
            raise WireFormatError(f"{what}: shape {tuple(shape)!r:.80} holds the "
                                  f"{type(d).__name__} {d!r}, not an int (an engine's reshape "
                                  f"raises on it)")
        try:
            size = operator.index(d)
        except TypeError:
            raise WireFormatError(f"{what}: shape {tuple(shape)!r:.80} holds a "
                                  f"{type(d).__name__} {d!r:.40}, not an int") from None
        if size < 0:
            raise WireFormatError(f"{what}: negative size {size} in shape {tuple(shape)!r:.80}")
        dims.append(size)
    return tuple(dims)


def entry_bytes(dtype, shape) -> int:
    """Bytes of one entry of ``dtype`` and ``shape`` on the wire (what the metadata's
    ``start_idx`` / ``end_idx`` must span; what a flattened broadcast packs densely)."""
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= int(d)
    return nbytes


def tensor_bytes(tensor):
    """``tensor``'s bytes as one 1-D uint8 tensor, whatever its strides (a copy where its
    elements are not already one unit-stride run: ``.contiguous()`` keeps a size-1 dim's
    stride, and viewing that as bytes raises)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8)
