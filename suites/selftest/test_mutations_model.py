"""The whole-model suite catches the refit bugs public code shipped, names them and says where.

Each mutant is a correct whole-model loader (the reference receiver, loading each bucket as a
lenient engine does: no completeness check of its own, so only the suite can notice) or the
reference exporter, with one bug planted; the shipped conformance test it must fail is run
on it directly. The failure must name the bug pattern and locate the first wrong element in
checkpoint terms (``layer=L parameter=NAME row=R col=C``; no layer for tensors outside the
layers):

* an exporter naming layers by the pipeline stage's local index (NeMo-RL#3259);
* a float32 router cut to bf16 - on the wire (exporter) and inside a loader (miles#811,
  prime-rl#3524);
* ``e_score_correction_bias`` left unmapped (Megatron-Bridge#4199);
* a tied ``lm_head`` not updated (vllm#51665);
* the draft never updated - by the loader and by the exporter (sglang#27718), and by an
  engine that receives each bucket once and hands the one stream to every selected runner,
  the target's runner consuming it before the draft's reads it;
* a frozen draft re-processed after an update of the served model (miles#1926);
* GDN ``in_proj_ba`` split evenly across TP (vllm#36242, Megatron-LM#1989);
* the shared expert written as routed expert 0 (sglang#26015);
* a loader that replays the previous update's tensors: named stale, not never written;
* with fewer KV heads than TP ranks, the wrong KV head replica taken (rank % heads);
* an even pipeline split assumed on uneven stages (layer = stage x num_layers // pp + i);
* mixed dtypes flattened densely, offsets not aligned to each item size (verl#7318): refused
  by the decoder every suite shares, naming the entry and its byte offset;
* a bucket packed in one dtype, the float32 router and bias cut to bf16 on the way;
* the vocabulary padded to a multiple of 64 alone: SGLang's rule on TP 1, 2 and 4, wrong on
  engine TP 3 (padded to 64 x TP there).
"""

from __future__ import annotations

import re

import pytest
import torch

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver
from pytest_weightsync.vocabulary import MODEL_PARTS, TARGETS

from ..conformance import test_model as suite
from ..harness import judge
from ..harness.model_cases import MODEL_CASES

pytestmark = pytest.mark.weightsync_property("mutation")

(Q3_PP2, Q35_TIED_PP2, Q35_TP4, Q3_FP32_BIAS, Q35_FROZEN, Q3_KV2_TP4_UNEVEN,
 Q3_TP3) = MODEL_CASES
#: A located element: (layer, for per-layer tensors), parameter, row, col.
LOCATED = re.compile(r"(layer=\d+ )?(expert=\d+ )?parameter=\S+ row=\d+ col=\d+")


class LenientLoader:
    """Loads every bucket through the reference whole-model receiver, as an engine that does
    not check completeness (SGLang's ``load_weights`` does not); mutants change ``bucket`` or
    the receiver."""

    name = "lenient"
    capabilities = Capabilities(model_parts=MODEL_PARTS, targets=TARGETS)
    receiver_cls = ModelReceiver

    def bucket(self, payload, spec, topology, rank):
        return payload

    def load_weights(self, params, payload, *, format, spec, topology, rank, targets=None):
        receiver = self.receiver_cls(spec, topology, rank, params=params, targets=targets)
        receiver.load(self.bucket(list(payload), spec, topology, rank),
                      "direct" if format == "direct" else None)


class ReplaysFirstUpdate(LenientLoader):
    """Keeps the tensors of the first update it saw and loads them again on every later one
    (a cached bucket replayed): each parameter is written, with the previous version."""

    def __init__(self):
        self.first = {}

    def bucket(self, payload, spec, topology, rank):
        kept = self.first.setdefault(rank, {})
        for name, tensor in payload:
            kept.setdefault(name, tensor.clone())
        return [(name, kept[name]) for name, _ in payload]


class WrongKvReplica(LenientLoader):
    """With fewer KV heads than TP ranks, rank r takes KV head r % kv_heads instead of
    r // (tp / kv_heads): its K and V rows are rewritten so the slice it reads holds that head."""

    def bucket(self, payload, spec, topology, rank):
        replicas = topology.tp // spec.num_kv_heads
        right, wrong = rank // replicas, rank % spec.num_kv_heads
        d = spec.head_dim
        out = []
        for name, tensor in payload:
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                tensor = tensor.clone()
                tensor[right * d:(right + 1) * d] = tensor[wrong * d:(wrong + 1) * d].clone()
            out.append((name, tensor))
        return out


class VocabPaddedAlone(LenientLoader):
    """Cuts the embedding and ``lm_head`` rows as if the vocabulary were padded to a multiple of
    64 alone (rank r takes ``padded / tp`` rows from row r x that), the rest of its shard zeros:
    SGLang's rule wherever that multiple divides by TP, wrong on TP 3."""

    VOCAB = ("model.embed_tokens.weight", "lm_head.weight")

    def load_weights(self, params, payload, *, format, spec, topology, rank, targets=None):
        payload = list(payload)
        super().load_weights(params, payload, format=format, spec=spec, topology=topology,
                             rank=rank, targets=targets)
        rows = -(-spec.vocab // 64) * 64 // topology.tp
        for name, full in payload:
            if name in self.VOCAB:
                param = params[name]
                part = full[rank * rows:min(spec.vocab, (rank + 1) * rows, rank * rows
                                               + param.shape[0])]
                param.zero_()
                param[:part.shape[0]].copy_(part)


class BiasUnmapped(LenientLoader):
    def bucket(self, payload, spec, topology, rank):
        return [(n, t) for n, t in payload if not n.endswith("e_score_correction_bias")]


class RouterThroughBf16(LenientLoader):
    def bucket(self, payload, spec, topology, rank):
        return [(n, t.to(torch.bfloat16).to(t.dtype) if n.endswith("mlp.gate.weight") else t)
                for n, t in payload]


class DraftDropped(LenientLoader):
    def bucket(self, payload, spec, topology, rank):
        return [(n, t) for n, t in payload if not n.startswith(("mtp.", "draft."))]


class DraftFedAnExhaustedStream(LenientLoader):
    """Receives a bucket once and feeds it to every selected runner in turn, as SGLang's
    speculative worker loads one received update into the target and the draft runner; but
    the bucket travels as one iterator, and the target's runner drains it."""

    def load_weights(self, params, payload, *, format, spec, topology, rank, targets=None):
        received = iter(payload)
        for target in (targets or spec.targets):
            draft = target == "draft"
            runner = [(n, t) for n, t in received
                      if n.startswith(("mtp.", "draft.")) == draft]
            super().load_weights(params, runner, format=format, spec=spec, topology=topology,
                                 rank=rank, targets=targets)


class FrozenDraftReprocessed(LenientLoader):
    """After each bucket the draft's post-load transform runs again (here a row permutation
    of every 2-D draft weight), whether or not the update reaches the draft."""

    def load_weights(self, params, payload, **kwargs):
        super().load_weights(params, payload, **kwargs)
        with torch.no_grad():
            for name, tensor in params.items():
                if name.startswith("draft.") and tensor.dim() == 2:
                    tensor.copy_(tensor.flip(0))


class _HeadLeftAlone(ModelReceiver):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.uses = {name: tuple(u for u in uses if u.engine != "lm_head.weight")
                     for name, uses in self.uses.items()}
        self.zeroed_by = {n: [e for e in es if e != "lm_head.weight"]
                          for n, es in self.zeroed_by.items()}


class TiedHeadNotUpdated(LenientLoader):
    receiver_cls = _HeadLeftAlone


class BaSplitEvenly(LenientLoader):
    """Writes ``in_proj_ba`` as the rank's even 1/tp of ``[b; a]`` once both arrived."""

    def __init__(self):
        self.seen = {}

    def load_weights(self, params, payload, **kwargs):
        super().load_weights(params, payload, **kwargs)
        tp, rank = kwargs["topology"].tp, kwargs["rank"]
        for name, tensor in payload:
            for part in ("in_proj_b.", "in_proj_a."):
                if part in name:
                    self.seen[(id(params), name.replace(part, "in_proj_ba."), part)] = tensor
        for (key, engine, part), b in list(self.seen.items()):
            a = self.seen.get((key, engine, "in_proj_a."))
            if part != "in_proj_b." or a is None or key != id(params):
                continue
            fused = torch.cat([b, a])
            n = fused.shape[0] // tp
            with torch.no_grad():
                params[engine].copy_(fused[rank * n:(rank + 1) * n])


class SharedAsRoutedZero(LenientLoader):
    """Routes ``mlp.shared_expert.*`` to routed expert 0 (its own expert 0 dropped)."""

    def bucket(self, payload, spec, topology, rank):
        out = []
        for name, tensor in payload:
            if ".mlp.experts.0." in name:
                continue
            out.append((name.replace(".mlp.shared_expert.", ".mlp.experts.0.")
                        if ".mlp.shared_expert." in name else name, tensor))
        return out


class Exporter(ReferenceImplementation):
    def rewrite(self, payload, spec, trainer):
        return payload

    def export_weights(self, trainer_states, *, format, spec, trainer, receiver, rank):
        payload = super().export_weights(trainer_states, format=format, spec=spec,
                                         trainer=trainer, receiver=receiver, rank=rank)
        return self.rewrite(list(payload), spec, trainer)


class StageLocalLayerNames(Exporter):
    """Every pipeline stage names its layers from 0."""

    def rewrite(self, payload, spec, trainer):
        per_stage = spec.num_layers // trainer.pp
        return [(re.sub(r"(?<=layers\.)(\d+)", lambda m: str(int(m.group(1)) % per_stage), n), t)
                if n.startswith("model.layers.") else (n, t) for n, t in payload]


class EvenStageLayerNames(Exporter):
    """Numbers stage s's local layer i as ``s * (num_layers // pp) + i``: right on even
    pipelines, wrong on uneven ones (Megatron's ``num_layers_in_first_pipeline_stage``)."""

    def rewrite(self, payload, spec, trainer):
        from pytest_weightsync.reference_impl.model.layout import stage_layers

        per_stage = spec.num_layers // trainer.pp
        renumber = {layer: s * per_stage + i
                    for s, r in enumerate(stage_layers(spec.num_layers, trainer))
                    for i, layer in enumerate(r)}
        return [(re.sub(r"(?<=layers\.)(\d+)", lambda m: str(renumber[int(m.group(1))]), n), t)
                if n.startswith("model.layers.") else (n, t) for n, t in payload]


class MixedDtypesPackedUnaligned(Exporter):
    """Sends each update as one flattened bucket packed densely: a 3-byte int8 version stamp
    first, so the bf16 and float32 tensors after it start at odd byte offsets (verl#7318)."""

    def export_weights(self, trainer_states, **kwargs):
        from pytest_weightsync import wire

        payload = super().export_weights(trainer_states, **kwargs)
        stamped = [("weight_version", torch.ones(3, dtype=torch.int8)), *payload]
        pieces, metadata, offset = [], [], 0
        for name, tensor in stamped:
            data = wire.tensor_bytes(tensor)
            metadata.append(wire.FlattenedEntry(name, tuple(tensor.shape), tensor.dtype,
                                                offset, offset + data.numel(), data.numel()))
            pieces.append(data)
            offset += data.numel()
        return [{"flattened_tensor": torch.cat(pieces), "metadata": metadata}]


class OneDtypeBucket(Exporter):
    """Packs a bucket into one flattened buffer of one dtype: the float32 router and expert
    bias go in as bfloat16 beside the bf16 weights (a packer that groups by the first
    tensor's dtype)."""

    def export_weights(self, trainer_states, **kwargs):
        from pytest_weightsync import wire

        payload = super().export_weights(trainer_states, **kwargs)
        return [wire.flattened_bucket([(n, t.to(torch.bfloat16)) for n, t in payload])]


class RouterCutToBf16(Exporter):
    def rewrite(self, payload, spec, trainer):
        return [(n, t.to(torch.bfloat16) if n.endswith("mlp.gate.weight") else t)
                for n, t in payload]


class DraftNotExported(Exporter):
    def rewrite(self, payload, spec, trainer):
        return [(n, t) for n, t in payload if not n.startswith(("mtp.", "draft."))]


def _fails(test, impl, case, fmt, *patterns):
    with pytest.raises(judge.ConformanceError) as info:
        test(impl, case, fmt)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, message[:2000]
    assert LOCATED.search(message), message[:2000]
    return message


@pytest.mark.parametrize("fmt", ["compat", "direct"])
def test_stage_local_layer_names_are_named_and_located(fmt):
    _fails(suite.test_exporter_stream_carries_every_parameter_once, StageLocalLayerNames(),
           Q3_PP2, fmt, "written twice", "pipeline-stage-local layer numbering",
           "holds other values")


def test_router_cut_to_bf16_on_the_wire():
    _fails(suite.test_exporter_stream_carries_every_parameter_once, RouterCutToBf16(),
           Q3_FP32_BIAS, "compat", "arrives as torch.bfloat16", "a float32 tensor cut to bf16")


def test_router_staged_through_bf16_by_a_loader():
    _fails(suite.test_loader_writes_every_parameter_from_its_source, RouterThroughBf16(),
           Q3_FP32_BIAS, "hf_fused", "float32 parameters cast through bfloat16",
           "cast through bf16: model.layers.0.mlp.gate.weight")


def test_a_replayed_previous_update_is_named_stale_not_never_written():
    message = _fails(suite.test_loader_second_version_lands_bit_exact_in_place,
                     ReplaysFirstUpdate(), Q3_PP2, "compat", "stale: ",
                     "holds version 1's values")
    assert "never written" not in message, message[:2000]


def test_the_wrong_kv_head_replica_is_named():
    message = _fails(suite.test_loader_writes_every_parameter_from_its_source, WrongKvReplica(),
                     Q3_KV2_TP4_UNEVEN, "compat", "the wrong KV head replica chosen",
                     "wrong KV replica: model.layers.0.self_attn.qkv_proj.weight: its K and V "
                     "rows are KV head 1's", "rank 1 holds KV head 0 (rank // 2)")
    assert "engine rank 1" in message


def test_vocab_padded_to_64_alone_is_named_on_tp3_only():
    """Padding to 64 alone is SGLang's rule while 64's multiple divides by TP (TP 1, 2, 4):
    the same loader passes there and fails, named and located, on the TP 3 case."""
    suite.test_loader_writes_every_parameter_from_its_source(VocabPaddedAlone(), Q3_PP2, "compat")
    message = _fails(suite.test_loader_writes_every_parameter_from_its_source, VocabPaddedAlone(),
                     Q3_TP3, "compat", "the vocabulary padded to a multiple of 64 alone",
                     "vocab padded to 64 only: model.embed_tokens.weight: it holds vocabulary "
                     "rows [0, 21) then zeros: the vocabulary padded to 64 rows, 21 per rank",
                     "SGLang pads to a multiple of 64 x 3 (192 rows, 64 per rank: rank 0 holds "
                     "rows [0, 37))")
    assert "lm_head.weight" in message


def test_expert_bias_unmapped():
    _fails(suite.test_loader_writes_every_parameter_from_its_source, BiasUnmapped(),
           Q3_FP32_BIAS, "compat", "e_score_correction_bias not mapped",
           "parameter=model.layers.0.mlp.gate.e_score_correction_bias row=0 col=0")


@pytest.mark.parametrize("test", [suite.test_loader_writes_every_parameter_from_its_source,
                                  suite.test_loader_tied_embedding_reaches_both_views],
                         ids=["coverage", "tied_embeddings"])
def test_tied_lm_head_not_updated(test):
    message = _fails(test, TiedHeadNotUpdated(), Q35_TIED_PP2, "compat", "tied lm_head not updated")
    assert "lm_head.weight" in message


def test_draft_never_updated_by_the_loader():
    _fails(suite.test_loader_updates_the_draft_when_reached_and_leaves_a_frozen_one, DraftDropped(),
           Q35_TIED_PP2, "compat", "the draft (MTP) model was never updated",
           "parameter=mtp.")


def test_one_received_stream_drained_by_the_target_runner_leaves_the_draft_stale():
    _fails(suite.test_loader_updates_the_draft_when_reached_and_leaves_a_frozen_one,
           DraftFedAnExhaustedStream(), Q35_TIED_PP2, "compat",
           "the draft (MTP) model was never updated", "parameter=mtp.")


def test_a_frozen_draft_reprocessed_after_an_update_is_named():
    _fails(suite.test_loader_updates_the_draft_when_reached_and_leaves_a_frozen_one,
           FrozenDraftReprocessed(), Q35_FROZEN, "compat",
           "frozen written: draft.fc.weight: the update reaches ['target']", "parameter=mtp.fc")


def test_draft_never_exported():
    with pytest.raises(judge.ConformanceError, match="the draft \\(MTP\\) model was never updated"):
        suite.test_exporter_sends_the_draft(DraftNotExported(), Q35_TIED_PP2, "compat")
    _fails(suite.test_exporter_stream_carries_every_parameter_once, DraftNotExported(),
           Q35_TIED_PP2, "hf_fused", "never written", "mtp.fc.weight")


def test_gdn_in_proj_ba_split_evenly():
    _fails(suite.test_loader_writes_every_parameter_from_its_source, BaSplitEvenly(), Q35_FROZEN,
           "compat", "fused components split evenly across TP",
           "even TP split: model.layers.0.linear_attn.in_proj_ba.weight",
           "[in_proj_b_r; in_proj_a_r]")


def test_shared_expert_written_as_routed_expert_zero():
    _fails(suite.test_loader_writes_every_parameter_from_its_source, SharedAsRoutedZero(),
           Q35_FROZEN, "compat", "shared as routed", "routed expert 0 holds the shared expert",
           "never written: model.layers.0.mlp.shared_expert.gate_up_proj.weight")


def test_an_even_pipeline_split_assumed_on_uneven_stages_is_named():
    """3 layers on 2 stages (2 + 1): numbering stage 1's layer as 1 x (3 // 2) + 0 sends
    layer 1 twice and layer 2 never."""
    _fails(suite.test_exporter_stream_carries_every_parameter_once, EvenStageLayerNames(),
           Q3_KV2_TP4_UNEVEN, "compat", "the pattern of an even pipeline split assumed",
           "layers [1] arrive more than once and layers [2] never")


def test_mixed_dtypes_flattened_at_unaligned_offsets_are_refused_and_named():
    with pytest.raises(judge.ConformanceError) as info:
        suite.test_exporter_stream_carries_every_parameter_once(
            MixedDtypesPackedUnaligned(), Q3_FP32_BIAS, "compat")
    message = str(info.value)
    assert "verl#7318" in message and "entry 1" in message, message[:2000]


def test_a_bucket_packed_in_one_dtype_is_named():
    _fails(suite.test_exporter_stream_carries_every_parameter_once, OneDtypeBucket(),
           Q3_FP32_BIAS, "compat", "arrives as torch.bfloat16", "a float32 tensor cut to bf16")

