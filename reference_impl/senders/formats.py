"""One entry point to the sender paths: the ``fmt`` payload a receiver rank gets.

The reference exporters (single-process and distributed) and the suites' harnesses all pick
the sender by wire format here, so a format is added, or an unknown one refused, in one place.
The format modules (and torch) are imported on first use: importing this module stays cheap.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from pytest_weightsync.protocols import FORMATS
from pytest_weightsync.reference_impl.errors import PayloadError, shown


class PayloadFormatError(PayloadError):
    """An unknown format, or a payload name that does not belong to the declared format."""


def check_format(fmt) -> None:
    """Raise :class:`PayloadFormatError` unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise PayloadFormatError(f"unknown payload format {shown(fmt)}; expected one of {FORMATS}")


def export(fmt: str, spec, receiver, rank: int, full: Mapping[int, Sequence],
           layers: Optional[Iterable[int]] = None, alloc=None) -> list:
    """The ``fmt`` payload of ``layers`` (default all) for receiver ``rank`` of ``receiver``
    (a :class:`~pytest_weightsync.reference_impl.model.layout.ReceiverTopology`), built from the full
    expert weights ``full``; one bucket of ``(name, tensor)`` pairs. Only ``direct`` depends on
    the rank. Staging tensors (a payload tensor that is no view of the trainer's memory) come
    from ``alloc(shape, dtype, device, zero)``, default fresh ones
    (:class:`~pytest_weightsync.reference_impl.senders.zerocopy.StagingPool`: the same memory
    every update)."""
    check_format(fmt)
    from pytest_weightsync.reference_impl.senders import compat, direct, hf_fused, packed

    layers = None if layers is None else list(layers)  # read twice: by the check and the export
    _check_gathered(fmt, full, layers)
    if fmt == "compat":
        return compat.export(full, layers)
    if fmt == "hf_fused":
        return hf_fused.export(full, layers, alloc=alloc)
    if fmt == "packed":
        return packed.export(spec, full, receiver.order, layers, alloc=alloc)
    return direct.export(spec, receiver, rank, full, layers, alloc=alloc)


def layer_payload(fmt: str, spec, receiver, rank: int, full: Mapping[int, Sequence], layer: int,
                  alloc=None) -> tuple[list, list]:
    """One layer of the ``fmt`` payload for receiver ``rank`` and the ``(dst, src)`` pairs
    still to be copied into it: fused tensors are views of the trainer's memory where it
    already has their layout (:mod:`pytest_weightsync.reference_impl.senders.zerocopy`), else staging
    tensors from ``alloc(shape, dtype, device, zero)`` (default: fresh ones) that the pairs
    fill; ``compat`` sends the trainer's tensors themselves (no pairs)."""
    check_format(fmt)
    from pytest_weightsync.reference_impl.senders import compat, direct, hf_fused, packed

    _check_gathered(fmt, full, (layer,))
    if fmt == "compat":
        return compat.export(full, [layer]), []
    if fmt == "hf_fused":
        return hf_fused.layer_payload(layer, full[layer], alloc=alloc)
    if fmt == "packed":
        return packed.layer_payload(spec, layer, full[layer], receiver.order, alloc=alloc)
    return direct.layer_payload(spec, receiver, rank, layer, full[layer], alloc=alloc)


def _check_gathered(fmt: str, full, layers: Optional[Iterable[int]]) -> None:
    """Refuse full weights that are no mapping of layer index to that layer's experts, and a
    layer held as a trainer's ETP shards for a format that needs whole experts: only
    ``direct`` reads the shards themselves. ``layers`` None: every layer of ``full``."""
    if not isinstance(full, Mapping):
        raise PayloadFormatError(f"the full weights must be a mapping of layer index to that "
                                 f"layer's experts, got {type(full).__name__}")
    if fmt == "direct":
        return
    from pytest_weightsync.reference_impl.model.moe_spec import EtpGroupedExperts

    for layer in full if layers is None else layers:
        if isinstance(full.get(layer), EtpGroupedExperts):
            raise PayloadFormatError(
                f"layer {layer} is held as ETP shards (EtpGroupedExperts), which only the "
                f"direct format reads; the {fmt} format needs whole experts: send "
                f"its .gather()")


def rank_independent(fmt: str) -> bool:
    """Whether every receiver rank gets the same ``fmt`` payload (all but ``direct``)."""
    check_format(fmt)
    return fmt != "direct"
