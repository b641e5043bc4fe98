"""The wire formats real senders put a bucket on, and the harness's own decoder for each.

A bucket is what one engine call receives. Real senders use five shapes of it
(:data:`pytest_weightsync.vocabulary.TRANSPORTS`), and a distributed exporter may return any
of them in its streams:

``tensors``
    a list of ``(name, tensor)`` pairs (``update_weights_from_tensor`` with in-process
    tensors).
``flattened_bucket``
    ``{"flattened_tensor": T, "metadata": [m, ...]}``: what ``update_weights_from_tensor(...,
    load_format="flattened_bucket")`` hands ``ModelRunner`` (slime's colocated path). ``T`` is
    one 1-D ``uint8`` tensor holding every tensor's bytes; each ``m`` has SGLang's
    ``FlattenedTensorMetadata`` fields ``name, shape, dtype, start_idx, end_idx, numel`` (byte
    offsets into ``T``). SGLang's ``FlattenedTensorBucket`` object is accepted as well.
``serialized``
    a :class:`TensorUpdate` (or SGLang's ``UpdateWeightsFromTensorReqInput``, or anything
    with the same two attributes): ``serialized_named_tensors`` holds ONE ENTRY PER ENGINE TP
    RANK - SGLang's TP worker deserializes ``serialized_named_tensors[tp_rank]`` - each one a
    ``MultiprocessingSerializer`` payload (``ForkingPickler`` bytes, or their base64 ``str``)
    of a ``tensors`` list whose tensors may be ``LocalSerializedTensor`` s (``values``: one
    serialized tensor per TP rank, verl and ``sglang.srt.weight_sync.utils``), or of a
    ``flattened_bucket`` dict when ``load_format="flattened_bucket"``. CPU tensors travel as
    shared-memory handles, CUDA tensors as CUDA IPC handles, exactly as ``ForkingPickler``
    sends them.
``broadcast``
    names, dtypes and shapes, then a broadcast of each tensor (or of one flattened bucket)
    from the sender: :mod:`pytest_weightsync.broadcast`.
``weight_transfer``
    vLLM's protocol: a stream of calls (init, start, ``update_weights`` chunks of names,
    dtypes, shapes and IPC handles or NCCL broadcasts, finish), decoded a whole stream at a
    time by :mod:`pytest_weightsync.weight_transfer`.

The decoders check what a real engine would trip over, before anything is loaded, and name
the bucket and entry: a flat tensor whose storage was freed or is smaller than the tensor, a
metadata range outside the flat tensor, a shape that is not a sequence of non-negative ints
(SGLang's ``reshape`` raises on ``(2.9, 8)``, where ``int()`` would quietly read ``(2, 8)``),
a byte count that does not match the shape and dtype, an offset that is not a multiple of the
entry's item size (mixed dtypes packed without alignment: SGLang's ``reconstruct_tensors``
cannot view it, verl#7318), a serialized update without an entry for every engine rank, a
serialized payload that names any global outside :data:`SAFE_GLOBALS` (refused before it is
called, as SGLang's ``SafeUnpickler`` refuses it). The encoders
(:func:`flattened_bucket`, :func:`serialized_update`) are what the reference exporter sends:
they take strided, transposed, 0-d and empty tensors (``tensor.flatten().view(torch.uint8)``
raises on a strided 1-D view, verl#6919 / sglang#39535), align every offset, and encode an
empty bucket (``FlattenedTensorBucket(named_tensors=[])`` raises on the rank with nothing to
send, slime#2134). ``suites/selftest/test_wire.py`` holds them against SGLang's own code.

torch is imported lazily: the plugin reads :data:`FLATTENED_KEYS` at collection time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

__all__ = [
    "FLATTENED_KEYS", "FlattenedEntry", "SAFE_GLOBALS", "SERIALIZED_LOAD_FORMATS",
    "TensorUpdate", "UnsafePayloadError", "WireFormatError", "checked_shape", "decode_bucket",
    "decode_flattened", "decode_serialized", "entry_bytes", "flattened_bucket",
    "metadata_type", "serialize", "serialized_update", "tensor_bytes", "transport_of",
]

#: The two keys of a flattened bucket, as ``ModelRunner`` reads them.
FLATTENED_KEYS = ("flattened_tensor", "metadata")
#: ``load_format`` values a serialized update may carry (``None``: the model's own
#: ``load_weights``; ``"direct"``: copied by engine parameter name).
SERIALIZED_LOAD_FORMATS = (None, "direct", "flattened_bucket")


class WireFormatError(ValueError):
    """A bucket on the wire that an engine cannot decode, or decodes into something other
    than what the sender meant. The message names the bucket, the entry and the reason."""


@dataclass(frozen=True)
class TensorUpdate:
    """One ``update_weights_from_tensor`` request: ``serialized_named_tensors`` (one entry per
    engine TP rank) and its ``load_format``. Field names are SGLang's
    (``UpdateWeightsFromTensorReqInput``), so SGLang's own request object is accepted too."""

    serialized_named_tensors: Sequence
    load_format: Optional[str] = None

    def __repr__(self) -> str:  # each entry is a pickled bucket, megabytes long: sized only
        sizes = [len(e) if isinstance(e, (bytes, str)) else type(e).__name__
                 for e in self.serialized_named_tensors]
        return (f"TensorUpdate({len(sizes)} entries, lengths {sizes}, "
                f"load_format={self.load_format!r})")


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


def transport_of(bucket) -> str:
    """Which of :data:`~pytest_weightsync.vocabulary.TRANSPORTS` ``bucket`` is sent as
    (anything that is neither a flattened bucket nor a serialized update is ``tensors``; the
    stream checks say whether it really is a list of pairs)."""
    if _is_flattened(bucket):
        return "flattened_bucket"
    if hasattr(bucket, "serialized_named_tensors") and hasattr(bucket, "load_format"):
        return "serialized"
    if getattr(type(bucket), "wire_transport", None) == "weight_transfer":
        return "weight_transfer"  # a call of vLLM's protocol (pytest_weightsync.weight_transfer)
    return "tensors"


def _is_flattened(bucket) -> bool:
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


#: The globals a serialized payload may name: what ``ForkingPickler`` (and plain pickle) write
#: for tensors, storages and their shared-memory / CUDA IPC handles, the containers and dtypes
#: they use, and the metadata classes of a flattened bucket. Every one is also in SGLang
#: 0.5.23's ``SafeUnpickler.ALLOWED_GLOBALS`` except :class:`FlattenedEntry` (a named tuple of
#: plain fields), so nothing SGLang refuses runs here; SGLang's request classes, ``functools``,
#: ``itertools``, sockets and NPU rebuilds are left out, since no weights payload needs them.
#: ``torch.<dtype>`` globals are admitted by :func:`_safe_global` for every ``torch.dtype``.
SAFE_GLOBALS = frozenset({
    *(("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float",
                               "frozenset", "int", "list", "range", "set", "slice", "str",
                               "tuple")),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("copyreg", "__newobj_ex__"),
    ("_codecs", "encode"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "_UntypedStorage"), ("torch.storage", "TypedStorage"),
    *(("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2",
                                    "_rebuild_tensor_v3", "_rebuild_parameter",
                                    "_rebuild_parameter_with_state", "_rebuild_qtensor",
                                    "_rebuild_sparse_tensor",
                                    "_rebuild_meta_tensor_no_storage",
                                    "_rebuild_wrapper_subclass",
                                    "_rebuild_device_tensor_from_cpu_tensor")),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.serialization", "_get_layout"),
    *(("torch.multiprocessing.reductions", n)
      for n in ("rebuild_tensor", "rebuild_meta_tensor", "rebuild_cuda_tensor",
                "rebuild_nested_tensor", "rebuild_sparse_coo_tensor",
                "rebuild_sparse_compressed_tensor", "rebuild_storage_fd",
                "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
                "rebuild_typed_storage_child")),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    *(("torch", n) for n in ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
                             "per_channel_symmetric", "per_channel_affine_float_qparams")),
    ("pytest_weightsync.wire", "FlattenedEntry"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater",
     "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
})


class UnsafePayloadError(WireFormatError):
    """A serialized payload naming a global outside :data:`SAFE_GLOBALS` (``os.system``,
    ``builtins.eval``, ``torch.load`` ...): refused when the unpickler meets the name, before
    anything it names is called."""


def _safe_global(module: str, name: str) -> bool:
    if (module, name) in SAFE_GLOBALS:
        return True
    if module != "torch":
        return False
    import torch

    # vars(), not getattr(): torch's module __getattr__ imports submodules by name
    return isinstance(vars(torch).get(name), torch.dtype)


def _load_torch_storage(data: bytes):
    """``torch.storage._load_from_bytes`` (what plain pickle writes for a storage) without its
    unrestricted nested ``torch.load``: ``weights_only`` loading, a storage or nothing, as
    SGLang's ``SafeUnpickler`` reads it."""
    import io
    import pickle

    import torch

    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def _unpickle(data):
    """``data`` unpickled with every global checked against :data:`SAFE_GLOBALS` before it is
    imported (the standard library's ``pickle.loads`` would import and call any)."""
    import io
    import pickle

    class SafeUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch.storage", "_load_from_bytes"):
                return _load_torch_storage
            if not _safe_global(module, name):
                raise UnsafePayloadError(f"{module}.{name}")
            return super().find_class(module, name)

    return SafeUnpickler(io.BytesIO(bytes(data))).load()


def _deserialized(data, where: str):
    """What ``MultiprocessingSerializer.deserialize`` returns for ``data`` (bytes, or their
    base64 ``str``), read by an unpickler that admits only :data:`SAFE_GLOBALS`, as SGLang's
    ``SafeUnpickler`` admits only its allow-list."""
    import base64
    import binascii

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions it rebuilds

    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as error:
            raise WireFormatError(f"{where}: a str payload that is not base64 ({error})") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"{where}: a {type(data).__name__}, not MultiprocessingSerializer "
                              f"bytes (or their base64 str)")
    try:
        return _unpickle(data)
    except UnsafePayloadError as error:
        raise UnsafePayloadError(
            f"{where}: the payload names the global {error}, which no weights payload needs; "
            f"refused before it was called (an unpickler that admits every global runs "
            f"whatever the sender pickled; SGLang's SafeUnpickler refuses it too)") from None
    except Exception as error:
        raise WireFormatError(f"{where}: cannot be deserialized: {type(error).__name__}: "
                              f"{str(error)[:300]}") from None


def decode_serialized(update, *, engine_rank: int, engine_tp: int,
                      where: str = "serialized update") -> tuple[list, Optional[str]]:
    """``([(name, tensor)], load_format)`` that engine TP rank ``engine_rank`` of
    ``engine_tp`` reads from a serialized update (its own entry, its own value of each
    ``LocalSerializedTensor``), or :class:`WireFormatError` naming what it could not read."""
    import torch

    entries = update.serialized_named_tensors
    load_format = update.load_format
    if load_format not in SERIALIZED_LOAD_FORMATS:
        raise WireFormatError(f"{where}: load_format {load_format!r}; expected one of "
                              f"{SERIALIZED_LOAD_FORMATS}")
    if isinstance(entries, (str, bytes)) or not hasattr(entries, "__len__") or \
            len(entries) != engine_tp:
        count = len(entries) if hasattr(entries, "__len__") else type(entries).__name__
        raise WireFormatError(f"{where}: serialized_named_tensors holds {count} entries; "
                              f"SGLang's TP worker reads entry [tp_rank], so it needs one per "
                              f"engine TP rank ({engine_tp})")
    here = f"{where}, entry [{engine_rank}]"
    payload = _deserialized(entries[engine_rank], here)
    if load_format == "flattened_bucket":
        if not _is_flattened(payload):
            raise WireFormatError(f"{here}: load_format='flattened_bucket' but the payload is a "
                                  f"{type(payload).__name__}, not a flattened bucket dict")
        return decode_flattened(payload, where=here), load_format
    if isinstance(payload, (str, bytes)) or not hasattr(payload, "__iter__"):
        raise WireFormatError(f"{here}: the payload is a {type(payload).__name__}, not a list "
                              f"of (name, tensor) pairs")
    out = []
    for j, pair in enumerate(payload):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise WireFormatError(f"{here}: entry {j} is not a (name, tensor) pair: "
                                  f"{pair!r:.80}")
        name, value = pair
        values = getattr(value, "values", None)
        if not isinstance(value, torch.Tensor) and isinstance(values, (list, tuple)):
            if len(values) != engine_tp:
                raise WireFormatError(f"{here}: {name!r:.120} is a LocalSerializedTensor of "
                                      f"{len(values)} values; it needs one per engine TP rank "
                                      f"({engine_tp})")
            value = _deserialized(values[engine_rank], f"{here} {name!r:.120} value "
                                                       f"[{engine_rank}]")
        if not isinstance(value, torch.Tensor):
            raise WireFormatError(f"{here}: {name!r:.120} carries a {type(value).__name__}, "
                                  f"not a tensor")
        out.append((name, value))
    return out, load_format


def decode_bucket(bucket, *, engine_rank: int, engine_tp: int, where: str) -> tuple[list, str]:
    """``([(name, tensor)], transport)`` of one bucket of a stream for ``engine_rank``; a
    ``tensors`` bucket comes back as it is (its pairs are checked by the stream checks)."""
    transport = transport_of(bucket)
    if transport == "flattened_bucket":
        return decode_flattened(bucket, where=where), transport
    if transport == "serialized":
        pairs, _ = decode_serialized(bucket, engine_rank=engine_rank, engine_tp=engine_tp,
                                     where=where)
        return pairs, transport
    if transport == "weight_transfer":
        raise WireFormatError(f"{where}: a call of vLLM's weight-transfer protocol is decoded "
                              f"with the calls around it (start, updates, finish), never alone "
                              f"(pytest_weightsync.weight_transfer.decode_stream)")
    return bucket, transport


# --- encoders: what the reference sends ------------------------------------------------------

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


def serialize(obj, *, as_str: bool = False):
    """``obj`` as ``MultiprocessingSerializer.serialize`` writes it: ``ForkingPickler``
    bytes (tensors as shared-memory or CUDA IPC handles), base64 ``str`` with ``as_str``."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if as_str else data


def serialized_update(per_rank_named_tensors: Sequence, *, flattened: bool = False,
                      as_str: bool = False, meta_type=FlattenedEntry) -> TensorUpdate:
    """A :class:`TensorUpdate` with one serialized entry per engine TP rank
    (``per_rank_named_tensors[r]`` for rank ``r``), each a ``tensors`` list or, with
    ``flattened``, a flattened bucket (``load_format="flattened_bucket"``, metadata of
    ``meta_type``)."""
    entries = [serialize(flattened_bucket(named, meta_type=meta_type) if flattened else
                         [(n, t.detach()) for n, t in named], as_str=as_str)
               for named in per_rank_named_tensors]
    return TensorUpdate(entries, "flattened_bucket" if flattened else None)
