"""``tensors``: a bucket is a list of ``(name, tensor)`` pairs.

What ``update_weights_from_tensor`` takes with in-process tensors, and the reference's default.
It is also the fallback of :func:`pytest_weightsync.transports.of`: an item no other transport
recognises is taken for pairs, and the stream checks (:func:`pytest_weightsync.protocols.as_stream`)
say whether it really is a list of them.
"""

from __future__ import annotations

from pytest_weightsync.transports.base import Transport

__all__ = ["TRANSPORT", "Tensors"]


class Tensors(Transport):
    name = "tensors"
    docs = "docs/transports.md#tensors"
    loader_facing = True

    def recognises(self, item) -> bool:
        return True  # the fallback: consulted after every other transport

    def encode(self, stream, *, engine_rank: int, engine_tp: int, **options) -> list:
        return list(stream)

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        return item


TRANSPORT = Tensors()
