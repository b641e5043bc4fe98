"""What a transport is: the one seam every wire format plugs into.

A *transport* is how one bucket of an update travels from a trainer to an engine: a list of
pairs, a flattened bucket, a serialized request, a broadcast, vLLM's weight-transfer calls, or
a format a third party adds. Each has a :class:`Transport` object in its own module of
:mod:`pytest_weightsync.transports`, holding both ends of the wire: ``encode`` (what a sender
puts on it; the reference's exporters use it) and ``decode`` (what the engine rank it was sent
to reads, checked before anything is loaded; every suite decodes exporters' results with it).
The harness never branches on a transport's name: it asks the registry which transport an item
travels on (:func:`pytest_weightsync.transports.of`) and reads the answer's attributes.

torch is never imported here: the plugin reads the registry at collection time.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Transport", "TransportRegistryError", "WireFormatError"]


class WireFormatError(ValueError):
    """A bucket on the wire that an engine cannot decode, or decodes into something other
    than what the sender meant. The message names the bucket, the entry and the reason."""


class TransportRegistryError(ValueError):
    """A transport name nobody registered, or an entry point in ``weightsync.transports`` that
    does not load into a :class:`Transport` of its own name."""


class Transport:
    """One wire format, both ends. Subclass it (or give an object the same attributes) and
    register an instance under the entry-point group ``weightsync.transports``.

    Required: :attr:`name`, :attr:`docs`, :meth:`recognises`, :meth:`encode`,
    :meth:`decode`. The flags say how the harness must route an item; their defaults fit a
    transport whose every bucket is one self-contained object that reaches one engine rank."""

    #: The transport's word (the builtin ones are :data:`~pytest_weightsync.vocabulary.TRANSPORTS`).
    name: str = ""
    #: Where a user reads what it is and what its decoder refuses (``docs/<file>.md#<anchor>``).
    docs: str = ""
    #: What its decoder raises for a sender's misuse (each a :class:`WireFormatError`).
    errors: tuple = (WireFormatError,)
    #: A loader's ``load_weights`` may be handed it as it is (SGLang's TP worker hands these on;
    #: :data:`~pytest_weightsync.vocabulary.LOADER_TRANSPORTS`).
    loader_facing: bool = False
    #: Decoded a stream at a time, never a bucket alone (a session of calls).
    whole_stream: bool = False
    #: One item reaches every engine rank of its replica, each reading its own entry of it.
    replica_wide: bool = False
    #: Travels beside the exporter's result, on a channel the harness opens and hands the
    #: exporter as ``engine``; nothing of it is in the result.
    channel: bool = False

    def recognises(self, item) -> bool:
        """Whether ``item`` (one element of an exporter's stream) travels on this transport.
        Decided from its type and attributes only: nothing is read or unpickled."""
        return False

    def encode(self, stream, *, engine_rank: int, engine_tp: int, **options) -> list:
        """``stream`` (buckets of ``(name, tensor)`` pairs meant for engine rank
        ``engine_rank`` of ``engine_tp``) as the items a sender returns on this transport."""
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        """The ``(name, tensor)`` pairs engine rank ``engine_rank`` reads from ``item``, or one
        of :attr:`errors` naming ``where``, the entry and the reason - raised before anything
        is returned, so nothing is loaded from a bucket an engine would refuse."""
        raise NotImplementedError(f"{type(self).__name__}.decode")

    def decode_stream(self, items, *, engine_rank: int, engine_tp: int, where: str) -> list:
        """Every bucket (a list of pairs) engine rank ``engine_rank`` reads from ``items``;
        by default each item decoded alone, named by its index."""
        return [self.decode(item, engine_rank=engine_rank, engine_tp=engine_tp,
                            where=f"{where}: bucket {index} ({self.name})")
                for index, item in enumerate(items)]

    def release(self, item, entries=None) -> None:
        """Let go of what ``item`` holds for the engine ranks ``entries`` (default: all) that
        will not read it now (a refused update): a replica-wide item's shared memory is
        handed out once, to a reader; nobody else frees it. Best effort, never raises."""

    def identity(self, item) -> Optional[str]:
        """What identifies ``item`` when several trainer ranks return the same replica-wide
        item (its bytes); ``None``: this rank's alone."""
        return None

    def __repr__(self) -> str:
        return f"<transport {self.name!r} ({self.docs})>"
