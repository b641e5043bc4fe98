"""``serialized``: one ``update_weights_from_tensor`` request, one entry per engine TP rank.

A :class:`TensorUpdate` (or SGLang's ``UpdateWeightsFromTensorReqInput``, or anything with the
same two attributes): ``serialized_named_tensors`` holds ONE ENTRY PER ENGINE TP RANK - SGLang's
TP worker deserializes ``serialized_named_tensors[tp_rank]`` - each one a
``MultiprocessingSerializer`` payload (``ForkingPickler`` bytes, or their base64 ``str``) of a
``tensors`` list whose tensors may be ``LocalSerializedTensor`` s (``values``: one serialized
tensor per TP rank, verl and ``sglang.srt.weight_sync.utils``), or of a flattened bucket dict
when ``load_format="flattened_bucket"``. CPU tensors travel as shared-memory handles, CUDA
tensors as CUDA IPC handles, exactly as ``ForkingPickler`` sends them.

The decoder refuses an update without an entry for every engine rank, and a payload that names
any global outside :data:`SAFE_GLOBALS` (refused before it is called, as SGLang's
``SafeUnpickler`` refuses it). The request is *replica-wide*: every engine rank of the replica
reads its own entry, and each CPU tensor's descriptor can be fetched once, so the harness reads
every entry exactly once (:meth:`Serialized.release` reads and drops what nobody will).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pytest_weightsync.transports.base import Transport, WireFormatError
from pytest_weightsync.transports import flattened as _flattened
from pytest_weightsync.transports.flattened import FlattenedEntry, decode_flattened

__all__ = [
    "SAFE_GLOBALS", "SERIALIZED_LOAD_FORMATS", "Serialized", "TRANSPORT", "TensorUpdate",
    "UnsafePayloadError", "decode_serialized", "deserialized", "read_entries", "serialize", "serialized_update",
]

#: ``load_format`` values a serialized update may carry (``None``: the model's own
#: ``load_weights``; ``"direct"``: copied by engine parameter name).
SERIALIZED_LOAD_FORMATS = (None, "direct", "flattened_bucket")


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
    ("pytest_weightsync.transports.flattened", "FlattenedEntry"),
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


def deserialized(data, where: str):
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
    payload = deserialized(entries[engine_rank], here)
    if load_format == "flattened_bucket":
        if not _flattened.is_flattened(payload):
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
            value = deserialized(values[engine_rank], f"{here} {name!r:.120} value "
                                                       f"[{engine_rank}]")
        if not isinstance(value, torch.Tensor):
            raise WireFormatError(f"{here}: {name!r:.120} carries a {type(value).__name__}, "
                                  f"not a tensor")
        out.append((name, value))
    return out, load_format


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
    entries = [serialize(_flattened.flattened_bucket(named, meta_type=meta_type) if flattened else
                         [(n, t.detach()) for n, t in named], as_str=as_str)
               for named in per_rank_named_tensors]
    return TensorUpdate(entries, "flattened_bucket" if flattened else None)


class Serialized(Transport):
    """The transport: recognised by its two attributes; replica-wide (see the module)."""

    name = "serialized"
    docs = "docs/transports.md#serialized"
    replica_wide = True

    def recognises(self, item) -> bool:
        return hasattr(item, "serialized_named_tensors") and hasattr(item, "load_format")

    def encode(self, stream, *, engine_rank: int, engine_tp: int, flattened: bool = False,
               as_str: bool = False, meta_type=None, **options) -> list:
        """Each bucket a request whose entry for ``engine_rank`` holds it (the other ranks'
        entries are empty: ``stream`` is one engine rank's)."""
        meta_type = FlattenedEntry if meta_type is None else meta_type
        return [serialized_update([bucket if r == engine_rank else [] for r in range(engine_tp)],
                                  flattened=flattened, as_str=as_str, meta_type=meta_type)
                for bucket in stream]

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        pairs, _ = decode_serialized(item, engine_rank=engine_rank, engine_tp=engine_tp,
                                     where=where)
        return pairs

    def release(self, item, entries=None) -> None:
        """Read, and drop, the entries ``entries`` (engine ranks; default all) of ``item``
        that exist: an entry nobody fetches would hold its sender's descriptors
        (``multiprocessing.resource_sharer``, or a shared-memory file it keeps a reference
        on) for the life of that process. Best effort: what cannot be read is skipped."""
        read_entries(item, entries, where=None)

    def identity(self, item) -> Optional[str]:
        """A digest of the entries' bytes and the load format; ``None`` when the entries are
        not bytes (judged by the decoder, in this rank)."""
        import hashlib

        digest = hashlib.sha1(repr(getattr(item, "load_format", None)).encode())
        try:
            for entry in item.serialized_named_tensors:
                digest.update(entry.encode() if isinstance(entry, str) else bytes(entry))
                digest.update(b"\0")
        except (TypeError, ValueError):
            return None
        return digest.hexdigest()


def read_entries(item, entries=None, *, where: Optional[str] = None) -> None:
    """Read, and drop, the entries ``entries`` (engine ranks; default all) of ``item`` that
    exist, as an engine's TP workers would - also of an update that was refused, what the
    workers would still have read. ``where``: what cannot be read is raised naming it;
    ``None``: best effort. The process-wide sharer is never stopped: the code under test may
    still be serving from it."""
    from pytest_weightsync.ranks.hygiene import harness_sockets

    payloads = getattr(item, "serialized_named_tensors", None)
    if not isinstance(payloads, (list, tuple)):
        return
    for index in range(len(payloads)) if entries is None else entries:
        if not 0 <= index < len(payloads):
            continue
        try:
            with harness_sockets():
                decode_serialized(item, engine_rank=index, engine_tp=len(payloads),
                                  where=where or "refused update")
        except Exception:  # noqa: BLE001 - best effort only after a refusal
            if where is not None:
                raise


TRANSPORT = Serialized()
