"""Handing tensors from a trainer process to a receiver process without copying them.

This is how SGLang's ``update_weights_from_tensor`` gets weights from a colocated trainer:
the trainer pickles its tensors with ``multiprocessing``'s ``ForkingPickler`` and
``torch.multiprocessing``'s reductions (``MultiprocessingSerializer.serialize``), which for a
CUDA tensor writes a CUDA IPC handle of its memory block, not its bytes; receiver rank ``r``
unpickles entry ``r`` of the list (``rebuild_cuda_tensor`` opens the handle), moves the tensor
to its device (a no-op on the same device) and loads it. CPU tensors travel the same way
through shared memory, which is what lets the protocol be exercised on a machine without GPU.

Two details decide whether this can run for thousands of updates:

* the device travels as the GPU's UUID, not its index (SGLang patches torch's reductions the
  same way), so a receiver whose ``CUDA_VISIBLE_DEVICES`` numbers GPUs differently still opens
  the handle on the right one;
* handles must be released. The receiver drops every rebuilt tensor once its copies have
  finished (closing its mappings); the trainer keeps its payload alive until the receiver
  answered, then drops it and calls :func:`collect` (``torch.cuda.ipc_collect``), which frees
  blocks whose consumers are done. A receiver that keeps a payload makes the trainer's
  allocated memory grow by one payload per update.

The engine side of this protocol, one receiver rank in its own spawned process, is
:class:`pytest_weightsync.reference_impl.engine.process.ReceiverProcess`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Optional

import torch
from torch.multiprocessing import reductions

from pytest_weightsync.reference_impl.errors import WeightSyncError

#: Position of ``storage_device`` in the arguments of ``reductions.rebuild_cuda_tensor``.
_DEVICE_ARG = 6


class IpcError(WeightSyncError):
    """A payload that cannot be shared or rebuilt (non-tensor entry, unknown GPU)."""


# --------------------------------------------------------------------------------------------
# Serialization (trainer side) and rebuilding (receiver side)
# --------------------------------------------------------------------------------------------


#: GPU index -> UUID and back, as this process numbers its GPUs (fixed for its lifetime:
#: ``CUDA_VISIBLE_DEVICES`` is read once). Asked once per shared storage on both sides, so
#: looked up once.
_UUIDS: dict = {}
_INDICES: dict = {}


def _device_uuid(index: int) -> str:
    uuid = _UUIDS.get(index)
    if uuid is None:
        uuid = _UUIDS[index] = str(torch.cuda.get_device_properties(index).uuid)
    return uuid


def _device_index(uuid_or_index) -> int:
    if isinstance(uuid_or_index, int):
        return uuid_or_index
    index = _INDICES.get(uuid_or_index)
    if index is not None:
        return index
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid_or_index:
            _INDICES[uuid_or_index] = index
            return index
    raise IpcError(f"no visible GPU has UUID {uuid_or_index!r} (this process sees "
                   f"{torch.cuda.device_count()} GPU(s)); the sender's GPU must be visible")


def rebuild_cuda_tensor_by_uuid(*args):
    """``reductions.rebuild_cuda_tensor`` with the device given as a GPU UUID."""
    args = list(args)
    args[_DEVICE_ARG] = _device_index(args[_DEVICE_ARG])
    return reductions.rebuild_cuda_tensor(*args)


def _share_storage(storage: torch.UntypedStorage) -> tuple:
    """One CUDA IPC share of ``storage`` (torch's ``_share_cuda_``): its device as a UUID,
    handle, size and offset in bytes, reference counter handle and offset, event handle and
    whether the event is to be waited for, in ``_share_cuda_``'s order: what both
    reductions below send of a storage."""
    device, *rest = storage._share_cuda_()
    return (_device_uuid(device), *rest)


def _reduce_tensor(tensor: torch.Tensor):
    """torch's ``reduce_tensor`` with the device as a UUID. A plain dense CUDA tensor (the
    whole storages of a shared payload, a per-tensor wire's views) is reduced here to the
    same rebuild arguments in one ``_share_cuda_`` call: torch's own reduction also wraps
    the storage in a ``TypedStorage``, imports, checks names and hooks and files the handle
    in a producer-side cache that no rebuild reads (``rebuild_cuda_tensor`` looks up
    ``(handle, offset)``) - Python work per storage, rank and update on the per-update
    path's critical host thread."""
    if (type(tensor) is torch.Tensor and tensor.is_cuda and tensor.layout is torch.strided
            and not tensor.requires_grad and not tensor.is_quantized and not tensor.is_nested
            and not tensor.has_names()):
        device, handle, size_bytes, offset_bytes, *rest = _share_storage(tensor.untyped_storage())
        return rebuild_cuda_tensor_by_uuid, (
            torch.Tensor, tensor.size(), tensor.stride(), tensor.storage_offset(),
            torch.storage.TypedStorage, tensor.dtype, device, handle, size_bytes, offset_bytes,
            False, *rest)
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = list(args)
        args[_DEVICE_ARG] = _device_uuid(args[_DEVICE_ARG])
        return rebuild_cuda_tensor_by_uuid, tuple(args)
    return rebuild, args


def rebuild_storage_by_uuid(device, handle, size_bytes, offset_bytes, counter_handle,
                            counter_offset, event_handle, event_sync):
    """One whole shared storage as a flat byte tensor (what :func:`_reduce_storage` wrote):
    ``rebuild_cuda_tensor``'s work for a storage that travels once per message, without its
    per-process cache of storages by handle (a storage already open here is found by the
    caching allocator's own map of opened handles, below this call) and without the typed
    storage and tensor wrappers it builds around it - Python work per storage, rank and
    update on the engine's critical path (a bucket of two storages rebuilt in 0.17-0.21 ms
    against 0.24-0.41 ms on an H100 host, docs/performance.md)."""
    index = _device_index(device)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, handle, size_bytes, offset_bytes, counter_handle, counter_offset, event_handle,
        event_sync)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (size_bytes,), (1,))


def _reduce_storage(tensor: torch.Tensor):
    """A whole storage as a flat byte tensor (a shared payload's ``wholes``), rebuilt by
    :func:`rebuild_storage_by_uuid`; any other tensor as :func:`_reduce_tensor` does.

    The rebuild arguments say that no event needs waiting for: the caller orders the
    receiver's reads after its writes itself (a shared payload waits for them on the host, or
    the receiver's stream waits for the sender's interprocess event), and the event torch
    records with each share lands on the side stream the shares are made on, where nothing
    is queued - it ordered nothing. Waiting for it made each engine rank open it and make its
    stream wait for a record in the trainer's context, which the GPU runs only once it
    switches to that context: with two engine ranks on one GPU, a switch in the middle of
    the other rank's copies per storage (per-update at MoE-TP 2 on one H100: 0.83-0.86 of
    the copy limit with the wait, 0.87-0.88 without; docs/performance.md)."""
    if (type(tensor) is torch.Tensor and tensor.is_cuda and tensor.dtype is torch.uint8
            and tensor.dim() == 1 and tensor.storage_offset() == 0 and tensor.is_contiguous()
            and not tensor.requires_grad):
        storage = tensor.untyped_storage()
        if tensor.numel() == storage.nbytes() > 0:
            *shared, _event_sync = _share_storage(storage)
            return rebuild_storage_by_uuid, (*shared, False)
    return _reduce_tensor(tensor)


class _TensorPickler(ForkingPickler):
    """``ForkingPickler`` with torch's reductions, CUDA devices named by UUID."""

    def __init__(self, *args, storages: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_storage if storages else _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor


def tensor_pickler(buf, *, storages: bool = False) -> _TensorPickler:
    """A pickler writing tensors as IPC handles (CUDA, devices named by UUID) or shared memory
    (CPU) into ``buf``: what :func:`serialize` and shared payloads use. ``storages``: the
    CUDA tensors are whole storages as flat bytes, each once (a shared payload's), rebuilt
    by :func:`rebuild_storage_by_uuid`, and the caller orders the receiver's reads after
    its writes (see :func:`_reduce_storage`)."""
    return _TensorPickler(buf, storages=storages)


def serialize(named_tensors) -> bytes:
    """One receiver rank's payload ``[(name, tensor), ...]`` as bytes holding handles, not data.

    The caller must keep the tensors alive (and unmodified) until the receiver has loaded them.
    """
    named_tensors = list(named_tensors)
    for i, item in enumerate(named_tensors):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise IpcError(f"payload entry {i} is not a (name, tensor) pair: {item!r:.80}")
        if item[1].requires_grad:
            raise IpcError(f"payload entry {item[0]!r} requires grad; send tensor.detach()")
    buf = io.BytesIO()
    _TensorPickler(buf).dump(named_tensors)
    return buf.getvalue()


def serialize_per_rank(payloads) -> list[bytes]:
    """SGLang's ``serialized_named_tensors``: one entry per receiver rank, rank ``r`` reads
    entry ``r`` (rank-local payloads for the direct path, the same payload for the others)."""
    return [serialize(p) for p in payloads]


def deserialize(data: bytes, device=None) -> list[tuple[str, torch.Tensor]]:
    """Rebuild a payload in the receiver; with ``device``, move each tensor there (a no-op when
    it already is, as in SGLang's ``_unwrap_tensor``). Drop the tensors when done with them:
    that closes the IPC mappings."""
    named = ForkingPickler.loads(data)
    if device is None:
        return named
    device = torch.device(device)
    return [(name, tensor.to(device)) for name, tensor in named]


def collect(device) -> None:
    """Trainer side, after the receiver answered: free shared blocks nobody uses any more."""
    if torch.device(device).type == "cuda":
        torch.cuda.ipc_collect()


def payload_bytes(named_tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in named_tensors)


# --------------------------------------------------------------------------------------------
# Memory as each process sees it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryStats:
    """``allocated``: bytes of live tensors of this process on the device (CUDA only);
    ``device_free``: free bytes of the whole device (CUDA only, every process counts);
    ``open_fds``: open file descriptors; ``shared_fds``: those of them that are shared-memory
    handles (``/dev/shm`` files, memfds: what CPU tensors shared between processes hold), the
    count a leak of payload mappings grows - the whole count also moves with a library opening
    a log file or a socket on first use."""

    allocated: Optional[int]
    device_free: Optional[int]
    open_fds: int
    shared_fds: int = -1


def _descriptors() -> tuple[int, int]:
    """(open descriptors, shared-memory ones) of this process; (-1, -1) without /proc."""
    from pytest_weightsync.ranks.hygiene import descriptor_targets

    if not os.path.isdir("/proc/self/fd"):
        return -1, -1
    targets = descriptor_targets().values()
    return len(targets), sum(t.startswith(("/dev/shm/", "memfd:")) for t in targets)


def memory_stats(device) -> MemoryStats:
    device = torch.device(device)
    fds, shared = _descriptors()
    if device.type != "cuda":
        return MemoryStats(None, None, fds, shared)
    torch.cuda.synchronize(device)
    return MemoryStats(torch.cuda.memory_allocated(device), torch.cuda.mem_get_info(device)[0],
                       fds, shared)
