"""How payloads travel between a trainer process and an engine process.

SGLang's per-tensor serialization with CUDA IPC handles or shared memory (:mod:`.ipc`) and a
payload shared once per model, its table pickled once (:mod:`.shared_payload`). The wire
formats' byte-level decoders live with the plugin (``pytest_weightsync.wire``) because the
suites decode every exporter's result with them. Transport knows tensors and bytes, not models.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors",)
