"""Ordering GPU work across processes without waiting on the host: CUDA IPC events.

A colocated sender that stages a bucket (refills a staging buffer) and an engine that copies
from it share one GPU but not one CUDA context, so no stream order holds between them. Waiting
on the host for it - the trainer synchronizing its stream before it sends the bucket, the
engine synchronizing before it answers so the buffer can be refilled - leaves the device idle
for a round trip per bucket and splits the work into many short bursts of each context. An
interprocess event (``cudaIpcGetEventHandle``) carries the order instead: the trainer records
one after its staging copy and sends its handle with the bucket, the engine's stream waits for
it on the device before the engine's copy; the engine records one after its copy, and the
trainer's stream waits for that before refilling the buffer. The host never blocks.

Events are made once (:class:`EventPool`, trainer side) and reused every update: a wait sees
the record issued before it, and each record here is issued before the message that makes the
other side wait for it. The receiving side opens each handle once (:class:`OpenedEvents`):
opening one costs a driver call, and an event opened twice would be two imports of one event.
"""

from __future__ import annotations

from typing import Optional

import torch


class EventPool:
    """Interprocess events of one device, by key, created on first use and kept."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._events: dict = {}
        self._handles: dict = {}

    def get(self, key) -> "torch.cuda.Event":
        event = self._events.get(key)
        if event is None:
            with torch.cuda.device(self.device):
                event = self._events[key] = torch.cuda.Event(interprocess=True)
                event.record()  # created now, on this device; a wait before any record passes
        return event

    def handle(self, key) -> bytes:
        """The handle another process opens to wait for or record ``key``'s event."""
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = self.get(key).ipc_handle()
        return handle

    def synchronize(self, keys) -> None:
        """Block the host until the last record of each key's event has run on the device
        (the work another process queued before recording it through the handle)."""
        for key in keys:
            self.get(key).synchronize()

    def __len__(self) -> int:
        return len(self._events)


class OpenedEvents:
    """Events another process exported, each opened once (keyed by its handle)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._events: dict = {}

    def get(self, handle: bytes) -> "torch.cuda.Event":
        event = self._events.get(handle)
        if event is None:
            event = self._events[handle] = torch.cuda.Event.from_ipc_handle(self.device, handle)
        return event

    def wait(self, handle: Optional[bytes]) -> None:
        """Make this device's current stream wait for the last record of ``handle``'s event."""
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(self.get(handle))

    def record(self, handle: Optional[bytes]) -> None:
        """Record ``handle``'s event after everything queued so far on the current stream."""
        if handle is not None:
            self.get(handle).record(torch.cuda.current_stream(self.device))

    def clear(self) -> None:
        """Forget every opened event (a sender that made them may be gone: an event it
        destroyed must not be recorded or waited for through a handle kept here)."""
        self._events.clear()
