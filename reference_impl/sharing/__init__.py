"""How a tensor's memory is shared between a trainer process and an engine process.

SGLang's per-tensor serialization with CUDA IPC handles or shared memory (:mod:`.ipc`), CUDA
IPC events that order a staged bucket on the device (:mod:`.ipc_events`), a payload shared once
per model with its table pickled once (:mod:`.shared_payload`), the tables of payloads built
before (:mod:`.known_tables`), the chain of shares it keeps (:mod:`.share_chain`) and the
native checks that a tensor object is as it was (:mod:`.tensor_guard`, which the engine's plan
cache uses too). This room knows tensors, storages and handles, not models and not
wire formats: a bucket's format on the wire (pairs, flattened, serialized, broadcast, vLLM's
calls) is a *transport*, one module each in ``pytest_weightsync.transports``.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors",)
