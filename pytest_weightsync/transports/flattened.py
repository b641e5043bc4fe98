"""``flattened_bucket``: every tensor's bytes in one uint8 tensor, with metadata per entry.

``{"flattened_tensor": T, "metadata": [m, ...]}`` is what ``update_weights_from_tensor(...,
load_format="flattened_bucket")`` hands ``ModelRunner`` (slime's colocated path). ``T`` is one
1-D ``uint8`` tensor holding every tensor's bytes; each ``m`` has SGLang's
``FlattenedTensorMetadata`` fields ``name, shape, dtype, start_idx, end_idx, numel`` (byte
offsets into ``T``). SGLang's ``FlattenedTensorBucket`` object is accepted as well.

The decoder refuses, naming the bucket and entry, what a real engine would trip over: a flat
tensor whose storage was freed or is smaller than the tensor, a metadata range outside it, a
shape that is not a sequence of non-negative ints, a byte count that does not match the shape
and dtype, an offset that is not a multiple of the entry's item size (mixed dtypes packed
without alignment: SGLang's ``reconstruct_tensors`` cannot view it, verl#7318). The encoder
takes strided, transposed, 0-d and empty tensors (``tensor.flatten().view(torch.uint8)`` raises
on a strided 1-D view, verl#6919 / sglang#39535), aligns every offset, and encodes an empty
bucket (``FlattenedTensorBucket(named_tensors=[])`` raises on the rank with nothing to send,
slime#2134). ``suites/selftest/test_wire.py`` holds both against SGLang's own code.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from pytest_weightsync.transports.base import Transport, WireFormatError
from pytest_weightsync.transports.shapes import checked_shape, entry_bytes, tensor_bytes

__all__ = [
    "FLATTENED_KEYS", "FlattenedBucket", "FlattenedEntry", "TRANSPORT", "decode_flattened",
    "flattened_bucket", "is_flattened", "metadata_type",
]

#: The two keys of a flattened bucket, as ``ModelRunner`` reads them.
FLATTENED_KEYS = ("flattened_tensor", "metadata")


class FlattenedEntry(NamedTuple):
    """SGLang's ``FlattenedTensorMetadata`` fields, for senders without SGLang installed
    (``start_idx`` / ``end_idx`` / ``numel`` in bytes). A real engine's unpickler admits
    only SGLang's own class: :func:`metadata_type` picks that one where it imports."""

    name: str
    shape: tuple
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def is_flattened(bucket) -> bool:
    """Whether ``bucket`` is a flattened bucket: a dict with :data:`FLATTENED_KEYS`, or an
    object with SGLang's ``FlattenedTensorBucket`` accessors."""
    if isinstance(bucket, dict):
        return set(FLATTENED_KEYS) <= set(bucket)
    return callable(getattr(bucket, "get_flattened_tensor", None)) and \
        callable(getattr(bucket, "get_metadata", None))


def _flat_and_metadata(bucket, where: str):
    if isinstance(bucket, dict):
        return bucket["flattened_tensor"], bucket["metadata"]
    try:
        return bucket.get_flattened_tensor(), bucket.get_metadata()
    except Exception as error:
        raise WireFormatError(f"{where}: the flattened bucket's get_flattened_tensor() / "
                              f"get_metadata() raised {type(error).__name__}: {error}") from None


_META_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx")


def _meta_fields(meta, where: str) -> tuple:
    try:
        if isinstance(meta, dict):
            return tuple(meta[f] for f in _META_FIELDS)
        return tuple(getattr(meta, f) for f in _META_FIELDS)
    except (KeyError, AttributeError) as error:
        raise WireFormatError(f"{where}: metadata entry {meta!r:.120} lacks {error} (a "
                              f"FlattenedTensorMetadata has {', '.join(_META_FIELDS)}, numel)"
                              ) from None


def _flat_problem(flat) -> Optional[str]:
    """Why the bytes of a 1-D uint8 ``flat`` cannot be read (a tensor subclass, the meta
    device, storage freed or smaller than the tensor); ``None`` if they can."""
    from pytest_weightsync import readable

    problem = readable.kind_problem(flat)
    if problem is None and flat.device.type == "meta":
        return "on the meta device: it has no bytes to read"
    if problem is None:
        problem = readable.storage_problem(flat)
    return None if problem is None else problem[1]


def decode_flattened(bucket, *, where: str = "flattened bucket") -> list:
    """``[(name, tensor)]`` of a flattened bucket (views into its flat tensor, as SGLang's
    ``reconstruct_tensors`` returns them), or :class:`WireFormatError` naming the first entry
    an engine could not decode or would decode into other bytes than the metadata says."""
    import torch

    flat, metadata = _flat_and_metadata(bucket, where)
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        what = (f"a {tuple(flat.shape)} {flat.dtype} tensor" if isinstance(flat, torch.Tensor)
                else f"a {type(flat).__name__}")
        raise WireFormatError(f"{where}: flattened_tensor is {what}; a flattened bucket "
                              f"carries one 1-D uint8 tensor of every entry's bytes")
    if flat.numel() and flat.stride(0) != 1:
        raise WireFormatError(f"{where}: flattened_tensor has stride {flat.stride(0)}; its "
                              f"bytes must be contiguous for an engine to view them")
    problem = _flat_problem(flat)
    if problem is not None:
        raise WireFormatError(f"{where}: flattened_tensor ({flat.numel()} bytes): {problem}")
    if isinstance(metadata, (str, bytes)) or not hasattr(metadata, "__iter__"):
        raise WireFormatError(f"{where}: metadata is a {type(metadata).__name__}, not a list "
                              f"of FlattenedTensorMetadata")
    out = []
    for index, meta in enumerate(metadata):
        name, shape, dtype, start, end = _meta_fields(meta, f"{where} entry {index}")
        entry = f"{where} entry {index} {name!r:.120}"
        if not isinstance(name, str):
            raise WireFormatError(f"{entry}: the name is a {type(name).__name__}, not a str")
        if not isinstance(dtype, torch.dtype):
            raise WireFormatError(f"{entry}: dtype {dtype!r} is not a torch.dtype")
        shape = checked_shape(shape, entry)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in (start, end)):
            raise WireFormatError(f"{entry}: start_idx {start!r:.40} / end_idx {end!r:.40} are "
                                  f"not byte offsets (ints)")
        nbytes = entry_bytes(dtype, shape)
        if not 0 <= start <= end <= flat.numel():
            raise WireFormatError(f"{entry}: bytes [{start}, {end}) lie outside the "
                                  f"{flat.numel()}-byte flattened_tensor")
        if end - start != nbytes:
            raise WireFormatError(f"{entry}: metadata spans {end - start} bytes [{start}, "
                                  f"{end}), its shape {shape} of {dtype} needs {nbytes} (an "
                                  f"offset or size counted in elements, not bytes?)")
        if (flat.storage_offset() + start) % dtype.itemsize:
            raise WireFormatError(
                f"{entry}: byte offset {start} is not a multiple of the {dtype} item size "
                f"{dtype.itemsize}; SGLang's reconstruct_tensors cannot view these bytes as "
                f"{dtype} (mixed dtypes packed without aligning each offset, verl#7318)")
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


def metadata_type():
    """SGLang's ``FlattenedTensorMetadata`` where SGLang imports (the only metadata class its
    unpickler admits), else :class:`FlattenedEntry`."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except Exception:  # not installed, or it does not import here
        return FlattenedEntry
    return FlattenedTensorMetadata


def _aligned(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


def flattened_bucket(named_tensors, *, meta_type=FlattenedEntry) -> dict:
    """``{"flattened_tensor", "metadata"}`` of ``named_tensors``: every tensor's bytes (any
    strides, 0-d and empty ones included) at an offset aligned to its item size, so any
    mixture of dtypes reconstructs; an empty list gives an empty bucket. ``meta_type``: the
    metadata class (:func:`metadata_type` for a payload a real engine unpickles)."""
    import torch

    pieces, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        start = _aligned(offset, tensor.element_size())
        if start > offset:
            pieces.append(torch.zeros(start - offset, dtype=torch.uint8, device=tensor.device))
        data = tensor_bytes(tensor)
        pieces.append(data)
        metadata.append(meta_type(name, tuple(tensor.shape), tensor.dtype, start,
                                  start + data.numel(), data.numel()))
        offset = start + data.numel()
    device = pieces[0].device if pieces else "cpu"
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    return {"flattened_tensor": flat, "metadata": metadata}


class FlattenedBucket(Transport):
    """The transport: recognised by its keys (or accessors), encoded and decoded above."""

    name = "flattened_bucket"
    docs = "docs/transports.md#flattened_bucket"
    loader_facing = True

    def recognises(self, item) -> bool:
        return is_flattened(item)

    def encode(self, stream, *, engine_rank: int, engine_tp: int, meta_type=None,
               **options) -> list:
        meta_type = FlattenedEntry if meta_type is None else meta_type
        return [flattened_bucket(bucket, meta_type=meta_type) for bucket in stream]

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        return decode_flattened(item, where=where)


TRANSPORT = FlattenedBucket()
