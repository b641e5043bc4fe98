"""``weight_transfer``: vLLM's weight-transfer protocol, decoded as an engine rank reads it.

A sender updating a vLLM 0.33 engine hands it calls, not buckets (``docs/vllm.md``, "The
weight-transfer protocol"): ``init_weight_transfer_engine(init_info)`` once, then per update
``start_weight_update()`` (``start_draft_weight_update()`` for the speculative draft), one
``update_weights(update_info)`` per chunk, ``finish_weight_update()``. An exporter whose
stream is that call sequence - a list of :class:`TransferCall` - is decoded here, as the
engine rank it is meant for reads it, into the buckets vLLM's engine hands ``load_weights``:

``ipc`` (``IPCWeightTransferEngine``)
    ``update_info`` = ``names``, ``dtype_names``, ``shapes`` and ``ipc_handles``: one handle
    dict per parameter ``{device: args}`` (unpacked; one ``load_weights`` call per chunk) or,
    when the init info said ``packed``, ONE handle dict of a uint8 buffer plus
    ``tensor_sizes`` (bytes per parameter, back to back from offset 0). A worker picks the
    args under its own device's key (vLLM: the physical GPU UUID; the harness's CPU engine
    rank ``r``: :func:`device_key`). ``ipc_handles_pickled`` (base64 pickle of the handles,
    the HTTP route) is read by the harness's safe unpickler, never by plain pickle.
``nccl`` (``NCCLWeightTransferEngine``)
    ``update_info`` = ``names``, ``dtype_names``, ``shapes`` (all three empty: the previous
    chunk's of the same model again), then the sender broadcasts
    (:attr:`TransferCall.broadcasts`, in order): unpacked, one tensor per name, each loaded at
    once (one ``load_weights`` call per tensor); packed, uint8 chunks cut where vLLM's consumer
    cuts them (:func:`packed_chunks`: entries are added until the bytes exceed
    ``packed_buffer_size_bytes``), one ``load_weights`` call per chunk.

``update_info`` may also be a list with one entry per engine worker (vLLM's worker reads entry
``dp_index * world_size + rank``; the harness's engine rank ``r`` reads entry ``r``).

Handles on CPU. A CUDA IPC handle is ``rebuild_cuda_tensor``'s argument tuple (index 6 the
device the worker overwrites with its own). The harness's engine ranks run in the pytest
process, on CPU, so its handle (:func:`cpu_handle`) is that same tuple with a token of a copy
held in this process where the CUDA memory handle would be; dtype, size, stride and offset are
where vLLM's code reads them. CUDA IPC handles, which only another process can open, are not
decoded here.

Everything is checked before anything is loaded, and refused with
:class:`TransferProtocolError` (a :class:`~pytest_weightsync.transports.base.WireFormatError`) naming the
call: a call outside the protocol's order (:class:`TransferSessionError`: an update outside
start/finish, a second start, a finish without start - vLLM's worker raises on each - or a
session never finished), fields vLLM's update info does not have, lists of different lengths,
a handle list shorter or longer than the names, no handle for this engine rank's device, a
handle or broadcast whose dtype, shape or bytes differ from what the call announced (vLLM's
unpacked IPC path loads the handle's tensor whatever ``dtype_names`` said; its NCCL receiver
allocates what was announced and the broadcast writes its own bytes into it), tensor sizes that
do not match the shapes, too few or too many broadcasts. ``suites/selftest/test_vllm_transfer.py``
runs vLLM's own receiving code (compiled from the wheel) on what the encoders here produce and
requires it to load exactly the buckets the decoder returns.

The calls, their words and errors and the encoders live in
:mod:`~pytest_weightsync.transports.weight_transfer_calls` (every name re-exported here).
torch is imported lazily: the plugin reads the transport registry at collection time.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_weightsync.transports import weight_transfer_calls as _calls
from pytest_weightsync.transports.base import Transport
from pytest_weightsync.transports.serialized import deserialized
from pytest_weightsync.transports.shapes import checked_shape, entry_bytes
from pytest_weightsync.transports.weight_transfer_calls import *  # noqa: F401,F403 - one import
from pytest_weightsync.transports.weight_transfer_calls import (
    BACKENDS,
    CALLS,
    DEFAULT_BACKEND,
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DRAFT_START,
    INIT,
    INIT_FIELDS,
    START,
    UPDATE,
    UPDATE_FIELDS,
    Session,
    TransferProtocolError,
    TransferSessionError,
    device_key,
    is_call,
    open_handle,
    packed_chunks,
)

__all__ = [*_calls.__all__, "TRANSPORT", "WeightTransfer", "decode_calls", "decode_stream"]

# --------------------------------------------------------------------------------------------
# the decoder
# --------------------------------------------------------------------------------------------

@dataclass
class _Engine:
    """What one engine rank knows between calls: its backend and wire parameters (from the
    init call), the open session and the last NCCL metadata of each model."""

    backend: Any = None
    packed: bool = False
    buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    session: Any = None
    last_meta: dict = field(default_factory=dict)


def decode_calls(calls, *, engine_rank: int, engine_world: int,
                 where: str = "weight transfer") -> list:
    """The :class:`Session` s engine rank ``engine_rank`` (of ``engine_world`` workers) reads
    from ``calls``, every call checked before any bucket is returned (see the module)."""
    engine, sessions = _Engine(), []
    calls = list(calls)
    for index, call in enumerate(calls):
        here = f"{where}: call {index} ({getattr(call, 'method', type(call).__name__)})"
        if not is_call(call):
            raise TransferProtocolError(f"{here}: a {type(call).__name__} among vLLM weight-"
                                        f"transfer calls; a stream on this transport is calls "
                                        f"only (TransferCall)")
        if call.method not in CALLS:
            raise TransferProtocolError(f"{here}: no such call; the protocol's calls are {CALLS}")
        if call.method == INIT:
            _init(engine, call, here)
        elif call.method in (START, DRAFT_START):
            if engine.session is not None:
                raise TransferSessionError(
                    f"{here}: start while an update is active (call {engine.session[1]} started "
                    f"it); vLLM's worker raises 'start_weight_update called while a weight "
                    f"update is already active'")
            engine.session = (Session("draft" if call.method == DRAFT_START else "target"), index)
        elif call.method == UPDATE:
            if engine.session is None:
                raise TransferSessionError(
                    f"{here}: update_weights outside a session; vLLM's worker raises "
                    f"'start_weight_update must be called before update_weights'")
            engine.session[0].buckets.extend(_update(engine, call, engine_rank, engine_world,
                                                     here))
        else:  # FINISH
            if engine.session is None:
                raise TransferSessionError(
                    f"{here}: finish without a start; vLLM's worker raises "
                    f"'finish_weight_update called without a matching start_weight_update'")
            sessions.append(engine.session[0])
            engine.session = None
    if engine.session is not None:
        raise TransferSessionError(
            f"{where}: the session started at call {engine.session[1]} was never finished "
            f"(no finish_weight_update): vLLM finalizes its layerwise reload only there, so "
            f"layers that received part of their weights are never processed")
    return sessions


def decode_stream(calls, *, engine_rank: int, engine_world: int,
                  where: str = "weight transfer") -> list:
    """Every bucket of every session of ``calls``, in order (:func:`decode_calls`)."""
    return [bucket for session in decode_calls(calls, engine_rank=engine_rank,
                                               engine_world=engine_world, where=where)
            for bucket in session.buckets]


def _fields(info, allowed, here: str, what: str) -> dict:
    if not isinstance(info, dict):
        raise TransferProtocolError(f"{here}: {what} is a {type(info).__name__}, not a dict")
    unknown = sorted(set(info) - set(allowed))
    if unknown:
        raise TransferProtocolError(f"{here}: {what} has fields {unknown} that vLLM's engine "
                                    f"does not take (it takes {list(allowed)}); vLLM refuses it "
                                    f"as invalid")
    return info


def _init(engine: _Engine, call, here: str) -> None:
    if engine.session is not None:
        raise TransferSessionError(f"{here}: init_weight_transfer_engine inside the session "
                                   f"started at call {engine.session[1]}; the harness takes it "
                                   f"between updates only")
    if call.backend not in BACKENDS:
        raise TransferProtocolError(f"{here}: backend {call.backend!r}; the modelled engines "
                                    f"are {BACKENDS}")
    info = _fields(call.info or {}, INIT_FIELDS[call.backend], here, "init_info")
    packed = info.get("packed", False)
    size = info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
    if not isinstance(packed, bool):
        raise TransferProtocolError(f"{here}: packed is a {type(packed).__name__}, not a bool")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise TransferProtocolError(f"{here}: packed_buffer_size_bytes {size!r} is not a "
                                    f"positive int")
    engine.backend, engine.packed, engine.buffer_bytes = call.backend, packed, size
    engine.last_meta.clear()  # a new NCCL engine forgets the metadata it reused


def _local(info, engine_rank: int, engine_world: int, here: str):
    """The entry of a per-worker list this rank reads, or ``info`` itself."""
    if not isinstance(info, list):
        return info, here
    if len(info) != engine_world:
        raise TransferProtocolError(
            f"{here}: update_info is a list of {len(info)} per-worker entries; vLLM's worker "
            f"reads entry [dp_index * world_size + rank], so it needs one per engine worker "
            f"({engine_world})")
    return info[engine_rank], f"{here} entry [{engine_rank}]"


def _meta(info, here: str) -> list:
    """``[(name, dtype, shape)]`` of an update's names, dtype names and shapes."""
    import torch

    names, dtypes, shapes = (info.get(k, []) for k in ("names", "dtype_names", "shapes"))
    for key, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
        if not isinstance(value, (list, tuple)):
            raise TransferProtocolError(f"{here}: {key} is a {type(value).__name__}, not a list")
    if not len(names) == len(dtypes) == len(shapes):
        raise TransferProtocolError(f"{here}: {len(names)} names, {len(dtypes)} dtype_names, "
                                    f"{len(shapes)} shapes; vLLM requires one of each per "
                                    f"parameter")
    out = []
    for i, (name, dname, shape) in enumerate(zip(names, dtypes, shapes)):
        entry = f"{here} entry {i} {name!r:.120}"
        if not isinstance(name, str):
            raise TransferProtocolError(f"{entry}: the name is a {type(name).__name__}")
        dtype = getattr(torch, dname, None) if isinstance(dname, str) else None
        if not isinstance(dtype, torch.dtype):
            raise TransferProtocolError(f"{entry}: dtype name {dname!r:.40} names no torch "
                                        f"dtype (vLLM reads getattr(torch, name))")
        out.append((name, dtype, checked_shape(shape, entry)))
    return out


def _update(engine: _Engine, call, engine_rank: int, engine_world: int, here: str) -> list:
    info, here = _local(call.info, engine_rank, engine_world, here)
    if not isinstance(info, dict):
        raise TransferProtocolError(f"{here}: update_info is a {type(info).__name__}, not a "
                                    f"dict (or a list of one per worker)")
    backend = engine.backend or ("ipc" if {"ipc_handles", "ipc_handles_pickled"} & set(info)
                                 else DEFAULT_BACKEND)
    _fields(info, UPDATE_FIELDS[backend], here, f"update_info ({backend})")
    meta = _meta(info, here)
    if backend == "ipc":
        if call.broadcasts:
            raise TransferProtocolError(f"{here}: broadcasts on the IPC engine; it reads the "
                                        f"IPC handles only")
        return [_ipc_bucket(engine, info, meta, engine_rank, here)]
    target = engine.session[0].target
    if not meta:
        meta = engine.last_meta.get(target, [])  # vLLM reuses the previous call's metadata
    else:
        engine.last_meta[target] = meta
    return _nccl_buckets(engine, call, meta, here)


def _handles(info, here: str):
    if info.get("ipc_handles_pickled") is not None:
        if info.get("ipc_handles") is not None:
            raise TransferProtocolError(f"{here}: both ipc_handles and ipc_handles_pickled; "
                                        f"vLLM refuses the pair")
        import base64
        import binascii

        try:
            data = base64.b64decode(info["ipc_handles_pickled"], validate=True)
        except (binascii.Error, ValueError, TypeError) as error:
            raise TransferProtocolError(f"{here}: ipc_handles_pickled is not base64 "
                                        f"({error})") from None
        return deserialized(data, f"{here} ipc_handles_pickled")
    if info.get("ipc_handles") is None:
        raise TransferProtocolError(f"{here}: no ipc_handles (nor ipc_handles_pickled); vLLM "
                                    f"requires one of them")
    return info["ipc_handles"]


def _open(handles, engine_rank: int, here: str):
    """The tensor ``engine_rank`` opens from one handle dict, with what the handle says."""
    key = device_key(engine_rank)
    if not isinstance(handles, dict) or key not in handles:
        found = list(handles) if isinstance(handles, dict) else type(handles).__name__
        raise TransferProtocolError(f"{here}: no IPC handle for this engine rank's device "
                                    f"{key!r} (handles for {found}); vLLM raises 'IPC handle "
                                    f"not found for GPU UUID'")
    return open_handle(handles[key], here)


def _ipc_bucket(engine: _Engine, info, meta, engine_rank: int, here: str) -> list:
    handles = _handles(info, here)
    if not engine.packed:
        if isinstance(handles, dict):
            raise TransferProtocolError(f"{here}: one handle dict for the chunk, but the init "
                                        f"info did not say packed; vLLM's unpacked engine "
                                        f"needs a list of one handle dict per parameter")
        if not isinstance(handles, (list, tuple)) or len(handles) != len(meta):
            count = len(handles) if hasattr(handles, "__len__") else type(handles).__name__
            raise TransferProtocolError(f"{here}: {count} IPC handles for {len(meta)} "
                                        f"announced parameters; vLLM requires one per name")
        out = []
        for i, ((name, dtype, shape), handle) in enumerate(zip(meta, handles)):
            entry = f"{here} entry {i} {name!r:.120}"
            tensor = _open(handle, engine_rank, entry)
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise TransferProtocolError(
                    f"{entry}: announced {dtype} {shape}, the handle holds {tensor.dtype} "
                    f"{tuple(tensor.shape)}: vLLM's unpacked IPC engine loads the handle's "
                    f"tensor whatever was announced; a sender's announcement and bytes must "
                    f"agree")
            out.append((name, tensor))
        return out
    if not isinstance(handles, dict):
        raise TransferProtocolError(f"{here}: packed, but ipc_handles is a "
                                    f"{type(handles).__name__}; vLLM's packed engine reads one "
                                    f"handle dict for the chunk's buffer")
    sizes = info.get("tensor_sizes")
    if not isinstance(sizes, (list, tuple)) or len(sizes) != len(meta):
        raise TransferProtocolError(f"{here}: packed needs tensor_sizes, one per name "
                                    f"({len(meta)}); got {sizes!r:.80}")
    import torch

    buffer = _open(handles, engine_rank, here)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TransferProtocolError(f"{here}: the packed buffer is {buffer.dtype} "
                                    f"{tuple(buffer.shape)}, not a 1-D uint8 tensor")
    return _unpacked(buffer, meta, sizes, here, copy=True)


def _unpacked(buffer, meta, sizes, here: str, copy: bool) -> list:
    """Entries of ``meta`` back to back in ``buffer`` (sizes in bytes), as vLLM unpacks them."""
    out, start = [], 0
    for i, ((name, dtype, shape), size) in enumerate(zip(meta, sizes)):
        entry = f"{here} entry {i} {name!r:.120}"
        need = entry_bytes(dtype, shape)
        if isinstance(size, bool) or not isinstance(size, int) or size != need:
            raise TransferProtocolError(f"{entry}: tensor size {size!r:.40} bytes, its shape "
                                        f"{shape} of {dtype} needs {need} (a size counted in "
                                        f"elements?)")
        if start + size > buffer.numel():
            raise TransferProtocolError(f"{entry}: bytes [{start}, {start + size}) lie past the "
                                        f"{buffer.numel()}-byte buffer")
        piece = buffer[start:start + size].view(dtype).reshape(shape)
        out.append((name, piece.clone() if copy else piece))
        start += size
    return out


def _nccl_buckets(engine: _Engine, call, meta, here: str) -> list:
    import torch

    sent = list(call.broadcasts)
    if not engine.packed:
        if len(sent) != len(meta):
            raise TransferProtocolError(
                f"{here}: {len(sent)} broadcasts for {len(meta)} announced parameters: "
                + ("the workers wait in NCCL for the rest (a hang)" if len(sent) < len(meta)
                   else "the extra ones meet no receiver"))
        out = []
        for i, ((name, dtype, shape), tensor) in enumerate(zip(meta, sent)):
            entry = f"{here} broadcast {i} {name!r:.120}"
            _check_broadcast(tensor, dtype, entry_bytes(dtype, shape), entry)
            out.append([(name, tensor.reshape(shape))])
        return out
    chunks = packed_chunks([entry_bytes(d, s) for _, d, s in meta], engine.buffer_bytes)
    if len(sent) != len(chunks):
        raise TransferProtocolError(
            f"{here}: {len(sent)} packed broadcasts where vLLM's consumer cuts "
            f"{len(meta)} parameters into {len(chunks)} chunks of at most "
            f"{engine.buffer_bytes} bytes (past the limit by one entry)")
    out = []
    for c, (chunk, tensor) in enumerate(zip(chunks, sent)):
        metas = [meta[i] for i in chunk]
        sizes = [entry_bytes(d, s) for _, d, s in metas]
        entry = f"{here} packed broadcast {c} ({metas[0][0]!r:.80}...)"
        _check_broadcast(tensor, torch.uint8, sum(sizes), entry)
        out.append(_unpacked(tensor, metas, sizes, entry, copy=False))
    return out


def _check_broadcast(tensor, dtype, nbytes: int, entry: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TransferProtocolError(f"{entry}: a {type(tensor).__name__} broadcast, not a tensor")
    got = tensor.numel() * tensor.element_size()
    if tensor.dtype != dtype or got != nbytes:
        raise TransferProtocolError(
            f"{entry}: announced {dtype}, {nbytes} bytes; broadcast {tensor.dtype} "
            f"{tuple(tensor.shape)}, {got} bytes: the workers receive into buffers of what was "
            f"announced (NCCL reads other bytes into them, or waits)")
    if not tensor.is_contiguous():
        raise TransferProtocolError(f"{entry}: a non-contiguous broadcast is sent as its "
                                    f"storage in memory order, not as the tensor")


class WeightTransfer(Transport):
    """The transport: a stream of vLLM's calls, decoded a whole session at a time."""

    name = "weight_transfer"
    docs = "docs/transports.md#weight_transfer"
    errors = (TransferProtocolError, TransferSessionError)
    whole_stream = True

    def recognises(self, item) -> bool:
        return is_call(item)

    def encode(self, stream, *, engine_rank: int, engine_tp: int, backend: str = "ipc",
               packed: bool = True, buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
               draft: bool = False, **options) -> list:
        """One session of ``stream``'s buckets, one ``update_weights`` call each, with handles
        under ``engine_rank``'s device key (IPC) or the broadcasts they announce (NCCL)."""
        return _calls.transfer_stream(stream, backend=backend, engine_ranks=[engine_rank],
                                      packed=packed, buffer_bytes=buffer_bytes, draft=draft)

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        raise TransferProtocolError(f"{where}: a call of vLLM's weight-transfer protocol is "
                                    f"decoded with the calls around it (start, updates, "
                                    f"finish), never alone")

    def decode_stream(self, items, *, engine_rank: int, engine_tp: int, where: str) -> list:
        return decode_stream(items, engine_rank=engine_rank, engine_world=engine_tp,
                             where=f"{where} (weight_transfer)")


TRANSPORT = WeightTransfer()
