"""The whole-model distributed check catches planted exporter bugs in real ranks, and names them.

Each mutant is the reference distributed whole-model exporter, run in real Megatron ranks
(:mod:`suites.harness.model_distributed`), with one bug public RL stacks shipped: every
pipeline stage publishing its layers under stage-local numbers (NeMo-RL#3259: the first
writer wins, the later stages' layers are never refit), a float32 router gathered through a
bf16 buffer (miles#811, prime-rl#3524), the expert bias left out of the name map
(Megatron-Bridge#4199), a tied ``lm_head`` not sent (vllm#51665), a GDN ``in_proj_ba``
split evenly across engine TP ranks, the MTP draft never exported (sglang#27718), the
shared expert sent as routed expert 0 (sglang#26015), and a tied model's source read from
the last stage's ``output_layer.weight``, which the MTP stage never reads. The suite's own judging of the first update must fail,
name the pattern and locate it (parameter, layer).
"""

from __future__ import annotations

import re

import pytest

from ..harness import judge
from ..harness import model_distributed as md
from pytest_weightsync.reference_impl.impl import ReferenceImplementation


def _case(fragment: str):
    return next(c for c in md.MODEL_DIST_CASES if fragment in c.id)


#: PP 2 with 2 + 1 layers: stage 1's layer 2 is its local layer 0.
UNEVEN_PP = _case("-first2-")
#: A float32 router and float32 expert bias on dense TP 2.
FP32_ROUTER = _case("-r32-")
#: Qwen3.5 on PP 2 (a GDN stage), tied, engine TP 4.
Q35_TIED_PP2 = _case("q35")


class _Planted(ReferenceImplementation):
    """The reference distributed whole-model exporter with its gathered checkpoint and its
    payloads open to a planted bug."""

    def gathered(self, weights):
        return weights

    def payload(self, pairs, spec, trainer, stage_starts, *, full, receiver, engine_rank):
        return pairs

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from pytest_weightsync.reference_impl.senders import distributed_model_export as dme
        from pytest_weightsync.reference_impl.senders import model_senders
        from pytest_weightsync.reference_impl.senders.distributed_export import engine_streams

        weights = self.gathered(dme.gather_model(spec, trainer, model_state, config=config,
                                                 model=model))
        starts = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(starts, dme.layer_offset(config, model),
                               group=ps.get_pipeline_model_parallel_group())

        def export(fmt, spec, receiver, engine_rank, full):
            pairs = model_senders.export(fmt, spec, receiver, engine_rank, full)
            return self.payload(pairs, spec, trainer, starts, full=full, receiver=receiver,
                                engine_rank=engine_rank)

        return engine_streams(weights, format=format, spec=spec, receiver=receiver,
                              delivery=delivery, bucket_bytes=bucket_bytes, export=export)


class StageLocalLayerNumbers(_Planted):
    """Each stage names its layers from 0 (the module index, not ``layer_number - 1``)."""

    name = "mutant-model-dist-stage-local-layers"

    def payload(self, pairs, spec, trainer, stage_starts, **_):
        def local(match):
            layer = int(match.group(1))
            return str(layer - max(s for s in stage_starts if s <= layer))

        return [(re.sub(r"(?<=^model\.layers\.)(\d+)", local, n), t) for n, t in pairs]


class RouterGatheredAsBf16(_Planted):
    """The float32 router weight travels through a bf16 gather buffer."""

    name = "mutant-model-dist-router-bf16"

    def gathered(self, weights):
        import torch

        for name, tensor in weights.dense.items():
            if name.endswith("mlp.gate.weight"):
                weights.dense[name] = tensor.to(torch.bfloat16)
        return weights


class BiasUnmapped(_Planted):
    """The router's ``expert_bias`` buffer is not in the exporter's name map (it reads
    ``named_parameters()`` only)."""

    name = "mutant-model-dist-bias-unmapped"

    def payload(self, pairs, spec, trainer, stage_starts, **_):
        return [(n, t) for n, t in pairs if not n.endswith("e_score_correction_bias")]


class TiedHeadNotSent(_Planted):
    """A tied model's ``lm_head`` engine tensor is left out of the direct payload (the
    embedding is sent once and the head assumed to follow)."""

    name = "mutant-model-dist-tied-head-not-sent"

    def payload(self, pairs, spec, trainer, stage_starts, **_):
        return [(n, t) for n, t in pairs if n != "lm_head.weight"]


class BaSplitEvenly(_Planted):
    """The direct ``in_proj_ba`` of each engine rank is an even 1/tp of ``[b; a]`` instead of
    ``[b_r; a_r]``."""

    name = "mutant-model-dist-ba-split-evenly"

    def payload(self, pairs, spec, trainer, stage_starts, *, full, receiver, engine_rank):
        import torch

        out = []
        for name, tensor in pairs:
            if name.endswith("linear_attn.in_proj_ba.weight"):
                layer = name[:-len("in_proj_ba.weight")]
                fused = torch.cat([full.dense[layer + "in_proj_b.weight"],
                                   full.dense[layer + "in_proj_a.weight"]])
                n = fused.shape[0] // receiver.tp
                tensor = fused[engine_rank * n:(engine_rank + 1) * n].clone()
            out.append((name, tensor))
        return out


class DraftNotExported(_Planted):
    """The MTP block is left out of the update (sglang#27718: one update path never reaches
    the draft)."""

    name = "mutant-model-dist-draft-not-exported"

    def payload(self, pairs, spec, trainer, stage_starts, **_):
        return [(n, t) for n, t in pairs if not n.startswith(("mtp.", "draft."))]


class SharedAsRoutedZero(_Planted):
    """The shared expert is sent under routed expert 0's names (sglang#26015: shared experts
    fused into the routed expert ids), routed expert 0 itself dropped."""

    name = "mutant-model-dist-shared-as-routed-zero"

    def payload(self, pairs, spec, trainer, stage_starts, **_):
        return [(n.replace(".mlp.shared_expert.", ".mlp.experts.0."), t) for n, t in pairs
                if ".mlp.experts.0." not in n]


class TiedSourceFromLastStageHead(_Planted):
    """A tied model's one source read where the head lives: the last stage's
    ``output_layer.weight`` - the embedding's copy without an MTP block, but with one that
    stage's head is the MTP embedding copy and ``output_layer.weight`` is never read."""

    name = "mutant-model-dist-tied-source-from-head"

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None):
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from pytest_weightsync.reference_impl.trainer.trainer import all_gather_bits

        name = next((n for n in model_state if n.endswith("output_layer.weight")), None)
        head = None
        if name is not None:
            shards = all_gather_bits(model_state[name].detach(),
                                     ps.get_tensor_model_parallel_group())
            head = torch.cat(shards)[:spec.vocab].clone()
        heads = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(heads, head, group=ps.get_pipeline_model_parallel_group())
        self._head = next(h for h in heads if h is not None)
        return super().export_weights_distributed(
            model_state, config=config, format=format, spec=spec, trainer=trainer,
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes, model=model)

    def gathered(self, weights):
        weights.dense["model.embed_tokens.weight"] = self._head
        return weights


def _fails(rank_pool, impl, mcase, formats) -> str:
    with pytest.raises(judge.ConformanceError) as info:
        md.judge_update(md.run(rank_pool, impl, mcase, formats), 0)
    return str(info.value)


def test_stage_local_layer_numbers_are_killed_named_and_located(rank_pool):
    message = _fails(rank_pool, StageLocalLayerNumbers(), UNEVEN_PP, ["compat"])
    assert ("the pattern of pipeline-stage-local layer numbering: each of the 2 stages named "
            "its layers from 0, so layers [0] arrive more than once and layers [2] never"
            ) in message, message
    assert "written twice" in message and "model.layers.0." in message, message
    assert re.search(r"never written: \d+ tensor\(s\), e\.g\. \['model\.layers\.2\.", message), \
        message
    assert "layers [2]" in message, message


@pytest.mark.parametrize("fmt", ["compat", "direct"])
def test_fp32_router_cast_to_bf16_is_killed_and_named(rank_pool, fmt):
    message = _fails(rank_pool, RouterGatheredAsBf16(), FP32_ROUTER, [fmt])
    want = "a float32 tensor cut to bf16" if fmt == "compat" else "cast through bf16"
    assert want in message, message
    assert "model.layers.0.mlp.gate.weight" in message, message


def test_expert_bias_unmapped_is_killed_and_located(rank_pool):
    message = _fails(rank_pool, BiasUnmapped(), FP32_ROUTER, ["compat"])
    assert re.search(r"never written: 2 tensor\(s\), e\.g\. \['model\.layers\.0\.mlp\.gate\."
                     r"e_score_correction_bias', 'model\.layers\.1\.mlp\.gate\."
                     r"e_score_correction_bias'\], layers \[0, 1\]", message), message


def _stream_check_fails(rank_pool, mutant, case, fmts, check, expected: str) -> None:
    """The stream check ``check`` of ``mutant``'s run fails, saying ``expected``."""
    result = md.run(rank_pool, mutant, case, fmts)
    with pytest.raises(judge.ConformanceError) as info:
        check(result)
    assert expected in str(info.value), str(info.value)


def test_tied_lm_head_not_sent_is_killed_and_named(rank_pool):
    _stream_check_fails(rank_pool, TiedHeadNotSent(), Q35_TIED_PP2, ["direct"], md.check_tied,
                        "tied embeddings, engine rank 0, direct: the stream carries "
                        "model.embed_tokens.weight 1 time(s) and lm_head.weight 0 time(s)")
    message = _fails(rank_pool, TiedHeadNotSent(), Q35_TIED_PP2, ["direct"])
    assert "never written: 1 tensor(s), e.g. ['lm_head.weight']" in message, message


def test_gdn_in_proj_ba_split_evenly_is_killed_named_and_located(rank_pool):
    message = _fails(rank_pool, BaSplitEvenly(), Q35_TIED_PP2, ["direct"])
    assert "fused components split evenly across TP" in message, message
    assert "even TP split: model.layers.0.linear_attn.in_proj_ba.weight" in message, message
    assert "layer=0" in message, message


def test_draft_never_exported_is_killed_and_named(rank_pool):
    _stream_check_fails(rank_pool, DraftNotExported(), Q35_TIED_PP2, ["compat"], md.check_draft,
                        "the draft (MTP) model was never updated: the compat stream for engine "
                        "rank 0 carries no mtp.* tensor")
    message = _fails(rank_pool, DraftNotExported(), Q35_TIED_PP2, ["compat"])
    assert re.search(r"never written: \d+ tensor\(s\), e\.g\. \['mtp\.", message), message


def test_shared_expert_as_routed_expert_zero_is_killed_named_and_located(rank_pool):
    message = _fails(rank_pool, SharedAsRoutedZero(), Q35_TIED_PP2, ["compat"])
    assert "the pattern of a shared expert sent as a routed expert: model.layers.0.mlp." \
           "experts.0." in message, message
    assert "holds the values of model.layers.0.mlp.shared_expert." in message, message
    assert re.search(r"never written: \d+ tensor\(s\), e\.g\. \['model\.layers\.0\.mlp\."
                     r"shared_expert\.", message), message


def test_tied_source_read_from_the_unused_head_of_the_mtp_stage_is_killed_and_located(rank_pool):
    message = _fails(rank_pool, TiedSourceFromLastStageHead(), Q35_TIED_PP2, ["compat"])
    assert "model.embed_tokens.weight" in message, message
    assert re.search(r"parameter=model\.embed_tokens\.weight row=\d+ col=\d+", message), message
