"""One transport contract for every suite: a correct exporter on each transport that
``docs/transports.md`` allows passes the expert-only and the whole-model suites, single-process
and distributed alike, because every suite decodes through one step
(:func:`pytest_weightsync.distributed.decoded_stream`).

The exporter is the reference with its pairs re-encoded on the wire: flattened buckets (every
offset aligned, fp32 router and ``e_score_correction_bias`` packed beside bf16), serialized
updates (of pairs and of flattened buckets), vLLM's weight-transfer calls (IPC handles,
packed), and - distributed delivery only - broadcasts to the engine ranks (one flattened buffer
per bucket). Whole-model streams are cut at the suites' realistic limits, so each update
travels in many buckets. To keep the CPU run short the transports rotate over the updates of
one run (each update of a run is judged: a new version written in place before it), not one
run per transport.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.vocabulary import TRANSPORTS

from ..conformance import test_exporter as expert_suite
from ..conformance import test_model as model_suite
from ..harness import distributed as dh
from ..harness import inputs
from ..harness import model_distributed as md
from ..harness.cases import ANCHORS
from ..harness.model_cases import MODEL_CASES

pytestmark = pytest.mark.weightsync_property("mutation_detected")

#: What each single-process run sends (``serialized`` twice: pairs and flattened buckets).
SINGLE = ("tensors", "flattened_bucket", "serialized", "serialized_flattened", "weight_transfer")
#: The float32 router and expert bias beside bf16 (tied, engine TP 2 x MoE-EP 2, trainer PP 2).
MIXED = next(c for c in MODEL_CASES if c.spec.expert_bias and not c.frozen)
#: Whole-model distributed cases with the float32 router and bias: colocated and distributed.
DIST_MIXED = [c for c in md.MODEL_DIST_CASES if c.case.spec.expert_bias][:2]
#: The transports of each distributed run's updates, in order (compat, direct, compat).
ROTATIONS = {"colocated": ("serialized", "weight_transfer", "flattened_bucket"),
             "distributed": ("broadcast", "serialized_flattened", "weight_transfer")}


def encode(transport: str, stream: list, engine_rank: int, engine_tp: int):
    """``stream`` (buckets of pairs) for ``engine_rank`` on ``transport``: any registered
    transport (``_flattened``: one flat buffer per bucket), encoded by the transport itself."""
    from pytest_weightsync.reference_impl.senders.distributed_export import wire_transport

    wire, options = wire_transport(transport)
    if wire.replica_wide:
        # copies: pickling a CPU tensor for another process moves its storage to shared
        # memory, the trainer's own parameter storage included (the suite names it rebound)
        stream = [[(name, tensor.clone()) for name, tensor in bucket] for bucket in stream]
    if wire.whole_stream:  # vLLM's calls: IPC handles, packed into small buffers
        options = dict(options, backend="ipc", packed=True, buffer_bytes=256)
    return wire.encode(stream, engine_rank=engine_rank, engine_tp=engine_tp, **options)


def _family(transport: str) -> str:
    """The registered transport a reference transport name sends on (``*_flattened``: its
    one-buffer option)."""
    from pytest_weightsync.reference_impl.senders.distributed_export import wire_transport

    return wire_transport(transport)[0].name


class OnEveryWire(ReferenceImplementation):
    """The reference, its pairs sent on :attr:`carrier` (single process) or on the next
    transport of :attr:`rotation` at each distributed call."""

    name = "reference-on-every-wire"
    carrier = "tensors"
    rotation = ("tensors",)
    calls = 0

    def export_weights(self, trainer_states, *, format, spec, trainer, receiver, rank):
        from pytest_weightsync.reference_impl.senders.buckets import split_buckets

        payload = super().export_weights(trainer_states, format=format, spec=spec,
                                         trainer=trainer, receiver=receiver, rank=rank)
        experts = getattr(spec, "experts", spec)
        stream = split_buckets(list(payload), inputs.bucket_bytes("split_layer", experts))
        return encode(self.carrier, stream, rank, receiver.tp)

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None, engine=None):
        import torch.distributed as dist

        from pytest_weightsync.reference_impl.senders.distributed_export import wire_transport

        transport = self.rotation[self.calls % len(self.rotation)]
        self.calls += 1
        result = super().export_weights_distributed(
            model_state, config=config, format=format, spec=spec, trainer=trainer,
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes, model=model)
        if result is None:
            return None
        if delivery == "colocated":
            return encode(transport, result, dist.get_rank() % receiver.tp, receiver.tp)
        wire, _ = wire_transport(transport)
        if wire.channel:  # every engine rank gets engine rank 0's compat stream
            wire.encode(result[0], engine_rank=0, engine_tp=receiver.tp, engine=engine,
                        flattened=True)
            return None
        return {r: encode(transport, s, r, receiver.tp) for r, s in result.items()}


@pytest.mark.parametrize("carrier", SINGLE)
def test_a_single_process_exporter_passes_both_suites_on_every_transport(carrier):
    """Expert-only (ETP 2, MoE-TP 2) and whole model (fp32 router and bias beside bf16, many
    buckets), every engine rank, one format each in rotation."""
    passes_single_process_suites(carrier, ("compat", "direct")[SINGLE.index(carrier) % 2])


def passes_single_process_suites(carrier: str, fmt: str) -> None:
    """The expert-only and the whole-model single-process suites, run on ``carrier``."""
    impl = OnEveryWire()
    impl.carrier = carrier
    expert_suite.test_exporter_payload_lands_bit_exact(impl, ANCHORS[1], fmt)
    model_suite.test_exporter_stream_carries_every_parameter_once(impl, MIXED, fmt)


@pytest.mark.parametrize("mcase", DIST_MIXED, ids=[c.delivery for c in DIST_MIXED])
def test_a_distributed_exporter_passes_the_whole_model_suite_on_every_transport(rank_pool,
                                                                               mcase):
    dh.require_megatron()
    impl = OnEveryWire()
    impl.rotation = ROTATIONS[mcase.delivery]
    result = md.run(rank_pool, impl, mcase, ["compat", "direct"])
    for index in range(len(result.updates)):
        assert md.judge_update(result, index)


def test_every_transport_runs_through_every_suite():
    """Read off the parametrizations above (and the expert-only distributed suite's transport
    cases, ``test_wire_distributed.py``), not off what ran: under xdist the cases run apart.
    Every transport reaches the four suites it may be sent to; ``broadcast`` only the
    distributed ones (a single-process exporter has no engine to broadcast to)."""
    from .test_wire_distributed import TRANSPORT_CASES

    scopes: dict = {}
    for carrier in SINGLE:
        scopes.setdefault(_family(carrier), set()).update(
            {"expert single-process", "whole-model single-process"})
    for mcase in DIST_MIXED:
        for transport in ROTATIONS[mcase.delivery]:
            scopes.setdefault(_family(transport), set()).add("whole-model distributed")
    for param in TRANSPORT_CASES:
        for transport in param.values[2]:
            scopes.setdefault(_family(transport), set()).add("expert distributed")
    # pairs: the distributed suites' own default, run by every conformance case
    scopes["tensors"] |= {"whole-model distributed", "expert distributed"}
    assert set(scopes) == set(TRANSPORTS), scopes
    every = {"expert single-process", "whole-model single-process", "whole-model distributed",
             "expert distributed"}
    assert {t: s for t, s in scopes.items() if t != "broadcast"} == \
        {t: every for t in TRANSPORTS if t != "broadcast"}
    assert scopes["broadcast"] == {"whole-model distributed", "expert distributed"}
    assert {m.delivery for m in DIST_MIXED} == {"colocated", "distributed"}
