"""Freeing CUDA storages that were shared many times, without overflowing the stack.

Every ``_share_cuda_`` of a storage (each CUDA tensor pickled for another process: SGLang's
per-tensor wire shares a trainer buffer once per tensor viewing it, every update) wraps the
storage's data pointer in a new reference-counted context whose deleter, when it runs, frees
the context it wrapped (``torch/csrc/StorageSharing.cpp``, ``CudaIPCTypes.cpp``). Freeing the
storage therefore unwinds one nested C++ deleter call per share ever made: a trainer buffer
shared 20,000 times (the benchmark's per-tensor rows over both MoE-TP sizes) needs more stack
than the main thread's 8 MiB, and the process dies with a segmentation fault - at interpreter
exit when nothing freed the buffer earlier.

:func:`release` drops the last references in a thread whose stack is large enough, and lets
torch free the blocks whose consumers are gone (``torch.cuda.ipc_collect``) there too, so the
unwinding happens on that stack. Whoever holds such storages hands them over once their
receivers are done (closed or answered).
"""

from __future__ import annotations

import gc
import threading

#: Stack of the releasing thread: room for about a million nested deleters.
STACK_BYTES = 512 << 20


def release(holder: list) -> None:
    """Empty ``holder`` (the only references to the storages to free) in a thread with a
    :data:`STACK_BYTES` stack, collect garbage and torch's IPC blocks there, and return
    once done; what the thread raised is raised here."""
    errors: list = []

    def run() -> None:
        try:
            holder.clear()
            gc.collect()
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.ipc_collect()
        except BaseException as exc:  # raised again in the caller's thread
            errors.append(exc)

    previous = threading.stack_size(STACK_BYTES)
    try:
        thread = threading.Thread(target=run, name="weightsync-release")
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if errors:
        raise errors[0]
