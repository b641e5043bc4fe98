"""What the suites hand implementations: synthetic weights, payloads, bucket streams, buffers.

Every payload is built by the reference sender paths (``pytest_weightsync.reference_impl.
senders``) from the synthetic value function (``synth``), sliced into trainer shards and
gathered back the way a trainer would. Receiver buffers are poisoned before every test, so
nothing passes by luck of a zero-initialized buffer.

An update travels as a stream of buckets cut at a byte limit the way real senders cut it
(:func:`pytest_weightsync.reference_impl.senders.buckets.split_buckets`). :data:`BUCKET_LIMITS` names
the limits the suites drive, each derived from the model size so it means the same thing on
every case: one tensor per bucket, a limit that splits a layer's experts over buckets, one
that puts several layers in one bucket, and the whole update in one bucket.
"""

from __future__ import annotations

import functools

from pytest_weightsync.reference_impl.senders import formats as senders
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.trainer import trainer
from pytest_weightsync.reference_impl.senders.buckets import split_buckets
from pytest_weightsync.reference_impl.model.layout import receiver_param_shapes
from pytest_weightsync.reference_impl.model.locate import locate_receiver_element
from pytest_weightsync.vocabulary import BUCKET_LIMITS

from .memo import memo

#: The bucket limit a full update is cut at unless a test says otherwise: a layer's experts
#: straddle buckets, as in real senders' streams.
DEFAULT_BUCKET = "split_layer"
#: A parameter every real receiver also holds (the MoE router); loaders must leave it alone.
SENTINEL = "model.layers.0.mlp.gate.weight"


def bucket_bytes(limit, spec):
    """Byte limit of the named bucket ``limit`` for ``spec`` (an int or ``None`` passes through):

    ``"tensor"``       0: one tensor per bucket;
    ``"split_layer"``  2.5 experts' worth: a layer's experts straddle buckets (per-expert
                       payloads), a fused tensor travels alone;
    ``"multi_layer"``  1.75 layers' worth: one bucket holds all of one layer and part of the
                       next, in every format;
    ``"whole"``        ``None``: the whole update in one bucket.
    """
    if limit is None or isinstance(limit, int):
        return limit
    expert = 3 * spec.intermediate * spec.hidden * spec.dtype.itemsize
    if limit == "tensor":
        return 0
    if limit == "split_layer":
        return int(2.5 * expert)
    if limit == "multi_layer":
        return int(1.75 * spec.num_experts * expert)
    if limit == "whole":
        return None
    raise ValueError(f"unknown bucket limit {limit!r}; expected an int, None or one of "
                     f"{BUCKET_LIMITS}")


def locator(case, rank):
    """``locate(name, index)`` for compare messages on receiver ``rank`` (an FP8 scale is
    located by its block)."""
    if case.receiver.weight_quant == "fp8_block":
        from pytest_weightsync.reference_impl.model import fp8

        return functools.partial(fp8.locate, case.spec, case.receiver, rank)
    return functools.partial(locate_receiver_element, case.spec, case.receiver, rank)


def gathered_weights(case, version, device=None):
    """Full HF weights as the sender sees them: synthesized, sliced into every trainer rank's
    Megatron shards, then gathered back (single-process form). ``device``: where all of it
    is built (default the CPU); a GPU run passes its own, so a real-size layer is never
    hashed element by element on the host and copied over."""
    full = synth.full_weights(case.spec, version, device=device)
    states = trainer.trainer_states(case.spec, case.trainer, full)
    return trainer.gather_full_weights(case.spec, case.trainer, states)


@memo(16)
def _clean_trainer_states(case, version):
    from pytest_weightsync.reference_impl.trainer import trainer as trainer_side

    return trainer_side.trainer_states(case.spec, case.trainer, synth.full_weights(case.spec, version))


def trainer_states(case, version):
    """Every trainer rank's Megatron expert shards of ``version``, as fresh tensors (an
    exporter that modifies its input is caught after its call and cannot corrupt the next
    test's input)."""
    return [{name: t.clone() for name, t in state.items()}
            for state in _clean_trainer_states(case, version)]


@memo(64)
def cached_gathered(case, version, device=None):
    """:func:`gathered_weights`, kept for the next test of the same case (read only)."""
    return gathered_weights(case, version, device)


def expected_uncached(case, rank, version, device=None):
    """The state receiver ``rank`` must hold after a complete update to ``version``, computed
    from the synthetic value function at layout coordinates - in the engine's layout for
    receivers that do not keep the checkpoint layout (``engine_layout``) - on ``device``
    (default the CPU; the value function's bits are the same on every device)."""
    if case.receiver.weight_quant == "fp8_block":
        from pytest_weightsync.reference_impl.oracle import fp8 as fp8_oracle

        return fp8_oracle.expected_params(case.spec, case.receiver, rank, version,
                                          device=device)
    if not case.receiver.default_engine:
        return synth.expected_engine_params(case.spec, case.receiver, rank, version,
                                            device=device)
    return synth.expected_receiver_params(case.spec, case.receiver, rank, version,
                                          device=device)


@memo(256)
def expected(case, rank, version, device=None):
    """:func:`expected_uncached`, kept for the next test of the same case (read only)."""
    return expected_uncached(case, rank, version, device)


def payload(fmt, case, rank, version=None, layers=None, *, full=None, device=None):
    """The ``fmt`` payload of ``version`` (of ``layers``, default all) for receiver ``rank``
    as one bucket of fresh tensors: an implementation that scribbles on its input cannot
    corrupt the next test's input. ``full`` (gathered weights) replaces ``version``;
    ``device``: where the weights of ``version`` are built (default the CPU)."""
    if full is None:
        if version is None:
            raise TypeError("payload() needs a version or the full weights")
        full = cached_gathered(case, version, device)
    chunk = senders.export(fmt, case.spec, case.receiver, rank, full, layers)
    return [(name, tensor.clone()) for name, tensor in chunk]


def stream(fmt, case, rank, version=None, layers=None, *, bucket=DEFAULT_BUCKET, full=None,
           device=None):
    """:func:`payload` cut into buckets at ``bucket`` (a name of :data:`BUCKET_LIMITS`, an
    int, or ``None`` for one bucket)."""
    return split_buckets(payload(fmt, case, rank, version, layers, full=full, device=device),
                         bucket_bytes(bucket, case.spec))


#: Seed of the pattern bucket tensors are refilled with after ``load_weights`` returns (not
#: the receiver buffers' poison, so a deferred copy is told from a buffer never written).
REFILL_SEED = 0x5E7


def refill_(bucket) -> None:
    """Overwrite every tensor of ``bucket`` in place, as a sender that reuses its staging
    buffer for the next bucket does."""
    import torch

    for _, tensor in bucket:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            synth.poison_(tensor, seed=REFILL_SEED)


def receiver_params(case, rank, device=None):
    """Receiver ``rank``'s pre-allocated parameters as an engine holds them: the expert
    ``w13``/``w2`` of every layer plus a router weight (:data:`SENTINEL`), all poisoned, on
    ``device`` (default the CPU)."""
    import torch

    spec = case.spec
    if case.receiver.weight_quant == "fp8_block":
        from pytest_weightsync.reference_impl.model import fp8

        params = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype)
                  in fp8.param_specs(spec, case.receiver, rank).items()}
    else:
        params = {name: torch.empty(shape, dtype=spec.dtype, device=device)
                  for name, shape in receiver_param_shapes(spec, case.receiver, rank).items()}
    params[SENTINEL] = torch.empty(spec.num_experts, spec.hidden, dtype=spec.dtype, device=device)
    for tensor in params.values():
        synth.poison_(tensor)
    return params


def fresh_receivers(case, receiver_cls=None):
    """One reference receiver per rank (of the class its engine layout needs), every buffer
    (padding included) poisoned."""
    from pytest_weightsync.reference_impl.engine.engine_receivers import receiver_class

    receiver_cls = receiver_class(case.receiver) if receiver_cls is None else receiver_cls
    receivers = [receiver_cls(case.spec, case.receiver, r) for r in range(case.receiver.tp)]
    for rec in receivers:
        for _, tensor in rec.named_parameters():
            synth.poison_(tensor)
    return receivers


def rebalance(params_by_rank, spec, old, new) -> None:
    """Move expert weights between physical slots the way an EPLB rebalance does (SGLang's
    expert location updater copies each slot's new expert from a slot, on any rank, that held
    it): afterwards every slot of ``new`` holds what some slot of the same logical expert held
    under ``old``. ``params_by_rank`` is every receiver rank's parameters, in rank order."""
    import torch

    from pytest_weightsync.reference_impl.model.layout import fused_name, receiver_shard

    shards_old = [receiver_shard(spec, old, r) for r in range(old.world_size)]
    shards_new = [receiver_shard(spec, new, r) for r in range(new.world_size)]
    for layer in range(spec.num_layers):
        for param in ("w13", "w2"):
            name = fused_name(layer, param)
            sources = [params[name].clone() for params in params_by_rank]
            for rank, shard in enumerate(shards_new):
                for slot, expert in enumerate(shard.slot_experts(layer)):
                    # the same MoE-TP rows: a rank's peer of equal moe_tp_rank
                    src = next((r, s) for r, sh in enumerate(shards_old)
                               if sh.moe_tp_rank == shard.moe_tp_rank
                               for s in sh.slots_of(layer, expert))
                    with torch.no_grad():
                        params_by_rank[rank][name][slot].copy_(sources[src[0]][src[1]])


@memo(16)
def fp8_quantized(case, version):
    """Every projection of ``version`` of an FP8 case's weights, quantized by the reference
    quantizer: ``{(layer, expert, projection): fp8.Quantized}`` (read only)."""
    from pytest_weightsync.reference_impl.model import fp8
    from pytest_weightsync.reference_impl.oracle import fp8 as fp8_oracle

    return fp8.quantize_full(fp8_oracle.source_weights(case.spec, case.receiver, version),
                             fp8.block_of(case.receiver))


def fp8_stream(fmt, case, rank, version, quantizer, *, bucket=DEFAULT_BUCKET):
    """The update of an FP8 block-quantized receiver ``rank`` to ``version``, cut into buckets:
    quantized by the ``sender`` (``fmt`` ``compat``: per-expert FP8 names plus
    ``weight_scale_inv``; ``direct``: the rank's four parameters per layer) or left to the
    ``loader`` (``compat`` in the model dtype). Fresh tensors."""
    from pytest_weightsync.reference_impl.oracle import fp8 as fp8_oracle
    from pytest_weightsync.reference_impl.senders import compat, fp8 as fp8_sender

    if quantizer == "loader":
        payload = compat.export(fp8_oracle.source_weights(case.spec, case.receiver, version))
    elif fmt == "direct":
        payload = fp8_sender.export_direct(case.spec, case.receiver, rank,
                                           fp8_quantized(case, version))
    else:
        payload = fp8_sender.export_compat(fp8_quantized(case, version))
    payload = [(name, tensor.clone()) for name, tensor in payload]
    return split_buckets(payload, bucket_bytes(bucket, case.spec))
