"""The reference implementation behind the conformance protocols (``pytest_weightsync.protocols``).

It is registered like any third-party implementation (entry point ``weightsync.loaders``,
name ``reference``), so the conformance matrix shows it next to the implementations it is the
yardstick for. Both roles delegate to the reference modules: loading to
:class:`reference_impl.receiver.ReferenceReceiver` (SGLang ``FusedMoE`` semantics,
all-or-nothing validation), exporting to the trainer gather and the compat / packed / direct
sender paths.

Heavy modules are imported inside the methods: discovering implementations (which imports this
module) must stay cheap.
"""

from __future__ import annotations

from pytest_weightsync.protocols import FORMATS, Capabilities


class PayloadFormatError(ValueError):
    """An unknown format, or a payload name that does not belong to the declared format."""


_NAME_KIND = {"compat": "expert", "packed": "fused", "direct": "fused"}


def _check_format(fmt: str, payload) -> None:
    from reference_impl.layout import parse_receiver_name

    if fmt not in FORMATS:
        raise PayloadFormatError(f"unknown payload format {fmt!r}; expected one of {FORMATS}")
    for item in payload:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            parsed = parse_receiver_name(item[0])
            if parsed is not None and parsed.kind != _NAME_KIND[fmt]:
                raise PayloadFormatError(
                    f"{item[0]!r} is not a name of the {fmt} format (the {fmt} format carries "
                    f"{'per-expert Hugging Face' if fmt == 'compat' else 'fused w13/w2'} names)")


class ReferenceImplementation:
    """Loader and exporter of every format, gate/up order, padding and topology."""

    name = "reference"
    capabilities = Capabilities()

    def load_weights(self, params, payload, *, format, spec, topology, rank) -> None:
        """Validate the whole payload, then copy it into ``params`` in place. ``params`` that do
        not fit the topology raise :class:`reference_impl.receiver.ReceiverParamsError`."""
        from reference_impl.receiver import ReferenceReceiver

        payload = list(payload)
        _check_format(format, payload)
        receiver = ReferenceReceiver(spec, topology, rank, params=params)
        receiver.load(payload, load_format="direct" if format == "direct" else None)

    def export_weights(self, trainer_states, *, format, spec, trainer, receiver, rank):
        """Gather the full expert weights from every trainer rank's shards, then build the
        ``format`` payload receiver ``rank`` gets."""
        from reference_impl import compat, direct, packed
        from reference_impl.trainer import gather_full_weights

        if format not in FORMATS:
            raise PayloadFormatError(f"unknown payload format {format!r}; expected one of {FORMATS}")
        full = gather_full_weights(spec, trainer, trainer_states)
        if format == "compat":
            return compat.export(full)
        if format == "packed":
            return packed.export(spec, full, receiver.order)
        return direct.export(spec, receiver, rank, full)
