"""The wire formats' encoders and decoders in one import, for senders and their tests.

Each transport lives in its own module of :mod:`pytest_weightsync.transports` (the formats, what
each decoder refuses and why, ``docs/transports.md``); this module is the stable surface senders
import (``wire.flattened_bucket``, ``wire.serialized_update``, ``wire.decode_flattened`` ...) and
the one-step decode of a bucket (:func:`decode_bucket`). It defines nothing of its own.
torch is imported lazily.
"""

from __future__ import annotations

from pytest_weightsync import transports
from pytest_weightsync.transports.base import WireFormatError
from pytest_weightsync.transports.flattened import (
    FLATTENED_KEYS,
    FlattenedEntry,
    decode_flattened,
    flattened_bucket,
    metadata_type,
)
from pytest_weightsync.transports.serialized import (
    SAFE_GLOBALS,
    SERIALIZED_LOAD_FORMATS,
    TensorUpdate,
    UnsafePayloadError,
    decode_serialized,
    serialize,
    serialized_update,
)
from pytest_weightsync.transports.shapes import checked_shape, entry_bytes, tensor_bytes

__all__ = [
    "FLATTENED_KEYS", "FlattenedEntry", "SAFE_GLOBALS", "SERIALIZED_LOAD_FORMATS",
    "TensorUpdate", "UnsafePayloadError", "WireFormatError", "checked_shape", "decode_bucket",
    "decode_flattened", "decode_serialized", "entry_bytes", "flattened_bucket",
    "metadata_type", "serialize", "serialized_update", "tensor_bytes", "transport_of",
]


def transport_of(bucket) -> str:
    """The name of the transport ``bucket`` travels on (:func:`pytest_weightsync.transports.of`)."""
    return transports.of(bucket).name


def decode_bucket(bucket, *, engine_rank: int, engine_tp: int, where: str) -> tuple[list, str]:
    """``([(name, tensor)], transport name)`` of one bucket of a stream for ``engine_rank``; a
    ``tensors`` bucket comes back as it is (its pairs are checked by the stream checks)."""
    transport = transports.of(bucket)
    return (transport.decode(bucket, engine_rank=engine_rank, engine_tp=engine_tp, where=where),
            transport.name)
