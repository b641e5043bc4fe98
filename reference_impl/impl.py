"""The reference implementation behind the conformance protocols (``pytest_weightsync.protocols``).

It is registered like any third-party implementation (entry point ``weightsync.loaders``,
name ``reference``), so the conformance matrix shows it next to the implementations it is the
yardstick for. Both roles delegate to the reference modules: loading to
:class:`pytest_weightsync.reference_impl.receiver.ReferenceReceiver` (SGLang ``FusedMoE``
placement, stricter than SGLang on bad input), exporting to the trainer gather and the
compat / hf_fused / packed / direct sender paths.

Streams: ``begin_update(params, ...)`` opens an update on ``params`` (one receiver kept per
params dict, keyed by its id, until ``end_update``), every ``load_weights`` call on those
params in between is one bucket of it, and ``end_update`` checks the update carried every
(layer, expert, projection) the rank owns. ``load_weights`` outside an update is a one-bucket
update whose completeness is not checked.

Heavy modules are imported inside the methods: discovering implementations (which imports this
module) must stay cheap.
"""

from __future__ import annotations

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.errors import shown
from pytest_weightsync.reference_impl.senders import PayloadFormatError, check_format


_NAME_KIND = {"compat": "expert", "packed": "fused", "direct": "fused", "hf_fused": "hf_fused"}
_KIND_WORDS = {"compat": "per-expert Hugging Face", "packed": "fused w13/w2",
               "direct": "fused w13/w2", "hf_fused": "fused gate_up_proj/down_proj"}


def _check_format(fmt: str, payload) -> None:
    from pytest_weightsync.reference_impl.layout import parse_receiver_name

    check_format(fmt)
    for index, item in enumerate(payload):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            parsed = parse_receiver_name(item[0])
            if parsed is not None and parsed.kind != _NAME_KIND[fmt]:
                raise PayloadFormatError(
                    f"payload entry {index} {shown(item[0])} is not a name of the {fmt} format "
                    f"(the {fmt} format carries {_KIND_WORDS[fmt]} names)")


class ReferenceImplementation:
    """Loader and exporter of every format, gate/up order, padding and topology."""

    name = "reference"
    capabilities = Capabilities()

    def __init__(self):
        self._open: dict[int, tuple] = {}  # id(params) -> (params, receiver)

    def _receiver(self, params, spec, topology, rank):
        from pytest_weightsync.reference_impl.receiver import ReferenceReceiver

        return ReferenceReceiver(spec, topology, rank, params=params)

    def begin_update(self, params, *, format, spec, topology, rank) -> None:
        """Open an update (a stream of ``load_weights`` buckets) on ``params``."""
        check_format(format)
        receiver = self._receiver(params, spec, topology, rank)
        receiver.begin_update()
        self._open[id(params)] = (params, receiver)

    def end_update(self, params, *, format, spec, topology, rank) -> None:
        """Close the update on ``params``; raises
        :class:`pytest_weightsync.reference_impl.receiver.MissingExpertError` naming every
        (layer, expert, projection) no bucket carried."""
        from pytest_weightsync.reference_impl.receiver import IncompleteUpdateError

        entry = self._open.pop(id(params), None)
        if entry is None or entry[0] is not params:
            raise IncompleteUpdateError("end_update() on params without begin_update()")
        entry[1].end_update()

    def load_weights(self, params, payload, *, format, spec, topology, rank) -> None:
        """Validate the whole bucket, then copy it into ``params`` in place. ``params`` that do
        not fit the topology raise :class:`pytest_weightsync.reference_impl.receiver.ReceiverParamsError`."""
        from pytest_weightsync.reference_impl.receiver import PayloadTypeError

        if payload is None:
            raise PayloadTypeError("payload is None; expected a list of (name, tensor) pairs")
        if isinstance(payload, (str, bytes, dict)) or not hasattr(payload, "__iter__"):
            raise PayloadTypeError(f"payload is a {type(payload).__name__}; expected a list of "
                                   f"(name, tensor) pairs")
        payload = list(payload)
        _check_format(format, payload)
        entry = self._open.get(id(params))
        if entry is not None and entry[0] is params:
            receiver = entry[1]
        else:
            receiver = self._receiver(params, spec, topology, rank)
        receiver.load(payload, load_format="direct" if format == "direct" else None)

    def export_weights(self, trainer_states, *, format, spec, trainer, receiver, rank):
        """Gather the full expert weights from every trainer rank's shards, then build the
        ``format`` payload receiver ``rank`` gets (one bucket)."""
        from pytest_weightsync.reference_impl import senders
        from pytest_weightsync.reference_impl.trainer import gather_full_weights

        check_format(format)
        return senders.export(format, spec, receiver, rank,
                              gather_full_weights(spec, trainer, trainer_states))

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer, receiver,
                                   delivery, bucket_bytes):
        """Run in every trainer rank: gather over Megatron's EP/ETP/PP groups, then send
        (:mod:`pytest_weightsync.reference_impl.distributed_export`)."""
        from pytest_weightsync.reference_impl.distributed_export import export_weights_distributed

        check_format(format)
        return export_weights_distributed(model_state, config=config, format=format, spec=spec,
                                          trainer=trainer, receiver=receiver, delivery=delivery,
                                          bucket_bytes=bucket_bytes)
