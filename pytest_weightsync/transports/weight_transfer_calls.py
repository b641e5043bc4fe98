"""vLLM's weight-transfer protocol, the sender's side: its calls, words, errors and encoders.

The calls a sender makes on a vLLM 0.33 engine (:class:`TransferCall`), the fields vLLM's
update and init infos have, the errors the decoder (:mod:`pytest_weightsync.transports.weight_transfer`,
which documents the protocol) raises, and the encoders the reference sends with: IPC updates
with the harness's CPU handles (:func:`cpu_handle`, opened by :func:`open_handle` as
``rebuild_cuda_tensor`` opens a CUDA one), NCCL updates with their broadcasts, whole sessions
(:func:`transfer_stream`). Import them from :mod:`pytest_weightsync.transports.weight_transfer`,
which re-exports every name. torch is imported lazily.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

from pytest_weightsync.transports.base import WireFormatError
from pytest_weightsync.transports.shapes import checked_shape, tensor_bytes

__all__ = [
    "BACKENDS", "CALLS", "DEFAULT_BACKEND", "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS", "DRAFT_START", "FINISH", "HANDLE_ARGS", "HANDLE_DEVICE_ARG",
    "INIT", "INIT_FIELDS", "START", "Session", "TRANSPORT_NAME", "TransferCall",
    "TransferProtocolError", "TransferSessionError", "UPDATE", "UPDATE_FIELDS", "cpu_handle",
    "device_key", "dtype_name", "ipc_update", "is_call", "nccl_update", "open_handle",
    "packed_chunks", "pickled_handles", "transfer_stream",
]

#: The transport's word (:data:`pytest_weightsync.vocabulary.TRANSPORTS`).
TRANSPORT_NAME = "weight_transfer"
#: The worker's calls, in protocol order, and the draft's start.
INIT, START, DRAFT_START, UPDATE, FINISH = ("init_weight_transfer_engine", "start_weight_update",
                                            "start_draft_weight_update", "update_weights",
                                            "finish_weight_update")
CALLS = (INIT, START, DRAFT_START, UPDATE, FINISH)
#: The engines modelled (``WeightTransferConfig.backend``; vLLM's default is ``nccl``).
BACKENDS = ("ipc", "nccl")
DEFAULT_BACKEND = "nccl"
#: The fields of each engine's ``update_info`` and worker-side ``init_info`` dataclasses.
UPDATE_FIELDS = {"ipc": ("names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled",
                         "tensor_sizes"),
                 "nccl": ("names", "dtype_names", "shapes")}
INIT_FIELDS = {"ipc": ("packed",),
               "nccl": ("master_address", "master_port", "rank_offset", "world_size",
                        "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes",
                        "packed_num_buffers")}
#: The worker's defaults where the init info says nothing (``packed_tensor.py``).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
#: Index of the device in ``rebuild_cuda_tensor``'s arguments (the worker writes its own).
HANDLE_DEVICE_ARG = 6
#: ``rebuild_cuda_tensor``'s arguments, in order (a handle is a tuple of these).
HANDLE_ARGS = ("tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls",
               "dtype", "storage_device", "storage_handle", "storage_size_bytes",
               "storage_offset_bytes", "requires_grad", "ref_counter_handle",
               "ref_counter_offset", "event_handle", "event_sync_required")


class TransferProtocolError(WireFormatError):
    """A call of vLLM's weight-transfer protocol that a vLLM engine cannot read, or reads into
    something other than what the sender announced; the message names the call."""


class TransferSessionError(TransferProtocolError):
    """A call outside the protocol's order: an update outside start/finish, a second start,
    a finish without a start, a session never finished."""


@dataclass(frozen=True)
class TransferCall:
    """One call a sender makes on a vLLM engine: ``method`` (one of :data:`CALLS`), its
    argument ``info`` (``init_info`` / ``update_info``; nothing for start and finish),
    ``backend`` (init only: the engine's ``weight_transfer_config.backend``; without an init
    call it is read off the first update's fields) and, for an NCCL ``update_weights``, the
    tensors the sender broadcasts while the call runs, in order."""

    method: str
    info: Any = None
    backend: Any = None
    broadcasts: tuple = field(default=())
    #: How :func:`is_call` recognises a call.
    wire_transport = TRANSPORT_NAME

    def __repr__(self) -> str:  # handles are long tuples of bytes: summarised
        info = self.info
        if isinstance(info, dict):
            info = {k: (f"<{len(v)}>" if isinstance(v, (list, tuple, dict)) else v)
                    for k, v in info.items()}
        elif isinstance(info, list):
            info = f"<{len(info)} per-worker entries>"
        return (f"TransferCall({self.method!r}, {info!r}"
                + (f", backend={self.backend!r}" if self.backend else "")
                + (f", {len(self.broadcasts)} broadcasts" if self.broadcasts else "") + ")")


@dataclass
class Session:
    """One decoded update: the model it reached (``target`` or ``draft``) and the buckets
    vLLM's engine handed ``load_weights``, one per call it makes."""

    target: str
    buckets: list = field(default_factory=list)


def device_key(engine_rank: int) -> str:
    """The key the harness's CPU engine rank ``engine_rank`` reads its IPC handles under (a
    vLLM worker reads them under its GPU's UUID)."""
    return f"cpu-engine-rank-{engine_rank}"


# --------------------------------------------------------------------------------------------
# encoders: what the reference sends
# --------------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as vLLM's senders name dtypes."""
    return str(dtype).split(".")[-1]


#: The memory the harness's CPU handles name: token -> the tensor (weakly: a handle keeps its
#: own tensor alive, as a vLLM sender keeps its shared copies alive until the update ends).
_SHARED = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


class _Pinned(bytes):
    """A handle's token, holding the tensor it names; pickled, plain bytes."""

    def __reduce__(self):
        return bytes, (bytes(self),)


def cpu_handle(tensor, device: int = 0) -> tuple:
    """``rebuild_cuda_tensor``'s argument tuple for a copy of the CPU ``tensor``, with a token
    of this process's memory where the CUDA IPC handle would be. A copy, because the harness
    reads every call after the exporter returned, where vLLM's worker reads each before the
    sender goes on (its packed producer refills one buffer per chunk)."""
    import os

    import torch

    tensor = tensor.detach().clone()
    token = _Pinned(f"weightsync-cpu-handle-{os.getpid()}-{next(_TOKENS)}".encode())
    token.tensor = tensor
    _SHARED[bytes(token)] = tensor
    return (torch.Tensor, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
            torch.UntypedStorage, tensor.dtype, device, token,
            tensor.untyped_storage().nbytes(), 0, False, None, None, None, False)


def ipc_update(named_tensors, *, engine_ranks, packed: bool = False) -> dict:
    """The ``update_info`` of one IPC chunk of ``named_tensors`` for the harness engine ranks
    ``engine_ranks`` (every rank's key in each handle dict, as the colocated sender merges
    them): one handle per tensor, or with ``packed`` one uint8 buffer and ``tensor_sizes``."""
    import torch

    named = [(n, t.detach().contiguous()) for n, t in named_tensors]
    info = {"names": [n for n, _ in named], "dtype_names": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}
    if not packed:
        info["ipc_handles"] = [{device_key(r): cpu_handle(t) for r in engine_ranks}
                               for _, t in named]
        return info
    pieces = [tensor_bytes(t) for _, t in named]
    buffer = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    info["ipc_handles"] = {device_key(r): cpu_handle(buffer) for r in engine_ranks}
    info["tensor_sizes"] = [p.numel() for p in pieces]
    return info


def pickled_handles(info: dict) -> dict:
    """``info`` as vLLM's HTTP client sends it: ``ipc_handles`` pickled and base64-encoded into
    ``ipc_handles_pickled`` (hold ``info`` while it is read: its handles keep the memory)."""
    import base64
    import pickle

    out = {k: v for k, v in info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(info["ipc_handles"])).decode()
    return out


def nccl_update(named_tensors, *, packed: bool = False,
                buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES) -> TransferCall:
    """One NCCL ``update_weights`` call of ``named_tensors``: the announcement and the
    broadcasts a vLLM sender makes (packed: the uint8 chunks of :func:`packed_chunks`)."""
    import torch

    named = [(n, t.detach().contiguous()) for n, t in named_tensors]
    info = {"names": [n for n, _ in named], "dtype_names": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}
    if not packed:
        return TransferCall(UPDATE, info, broadcasts=tuple(t for _, t in named))
    data = [tensor_bytes(t) for _, t in named]
    chunks = packed_chunks([d.numel() for d in data], buffer_bytes)
    return TransferCall(UPDATE, info, broadcasts=tuple(torch.cat([data[i] for i in chunk])
                                                       for chunk in chunks))


def transfer_stream(chunks, *, backend: str, engine_ranks, packed: bool = False,
                    buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                    draft: bool = False) -> list:
    """A whole update as calls: init, start (or the draft's), one ``update_weights`` per
    chunk of ``chunks`` (lists of ``(name, tensor)``), finish."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}; expected one of {BACKENDS}")
    init = {"packed": packed} if backend == "ipc" else {
        "master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1,
        "world_size": 1 + len(engine_ranks), "packed": packed,
        "packed_buffer_size_bytes": buffer_bytes}
    calls = [TransferCall(INIT, init, backend=backend), TransferCall(DRAFT_START if draft
                                                                     else START)]
    for chunk in chunks:
        calls.append(TransferCall(UPDATE, ipc_update(chunk, engine_ranks=engine_ranks,
                                                     packed=packed))
                     if backend == "ipc" else nccl_update(chunk, packed=packed,
                                                          buffer_bytes=buffer_bytes))
    return calls + [TransferCall(FINISH)]


def packed_chunks(sizes, buffer_bytes: int) -> list:
    """Indices of the entries of each packed chunk, where vLLM cuts them: an entry is added,
    then the chunk closes once its bytes exceed ``buffer_bytes``; the rest is the last one."""
    chunks, current, total = [], [], 0
    for index, size in enumerate(sizes):
        current.append(index)
        total += size
        if total > buffer_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def open_handle(args, here: str = "IPC handle"):
    """The tensor a CPU handle (:func:`cpu_handle`) opens, as ``rebuild_cuda_tensor`` opens a
    CUDA one, or :class:`TransferProtocolError` before anything is read."""
    import torch

    if not isinstance(args, (tuple, list)) or len(args) != len(HANDLE_ARGS):
        raise TransferProtocolError(f"{here}: a handle of {type(args).__name__} "
                                    f"{len(args) if hasattr(args, '__len__') else ''}; an IPC "
                                    f"handle is rebuild_cuda_tensor's {len(HANDLE_ARGS)} "
                                    f"arguments")
    size, stride, offset, dtype = args[1], args[2], args[3], args[5]
    if not isinstance(dtype, torch.dtype):
        raise TransferProtocolError(f"{here}: the handle's dtype {dtype!r:.40} is no torch dtype")
    size = checked_shape(size, f"{here}: the handle's size")
    stride = checked_shape(stride, f"{here}: the handle's stride")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise TransferProtocolError(f"{here}: the handle's offset {offset!r:.40} is no offset")
    token = args[7]
    owner = _SHARED.get(bytes(token)) if isinstance(token, (bytes, bytearray)) else None
    if owner is None:
        raise TransferProtocolError(f"{here}: the handle names no live memory ({token!r:.60}): "
                                    f"freed before the engine read it, or not a CPU handle of "
                                    f"this process (weight_transfer.cpu_handle); vLLM's senders "
                                    f"keep their IPC copies alive until the update is finished")
    storage = owner.untyped_storage()
    extent = offset + sum((d - 1) * s for d, s in zip(size, stride)) + 1 if all(size) else 0
    if extent * dtype.itemsize > storage.nbytes():
        raise TransferProtocolError(f"{here}: the handle's tensor {size} of {dtype} at offset "
                                    f"{offset} reaches past its {storage.nbytes()}-byte storage")
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)



def is_call(bucket) -> bool:
    """Whether ``bucket`` is a call of this protocol (:class:`TransferCall` or its like)."""
    return getattr(type(bucket), "wire_transport", None) == TRANSPORT_NAME
