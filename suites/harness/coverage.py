"""Judging a whole-model update: the coverage report.

What the tools that catch refit-coverage bugs do (SGLang's weight checker ``reset_tensors``,
slime/miles ``--check-weight-update-equal``, NeMo-RL's parameter count): every engine
parameter is poisoned before the update and every one is compared after it. Here each is
compared bit for bit with the expected state (the value function at layout coordinates:
``model_synth``), and one that differs is classified, so the report says what went wrong
and where (parameter, layer, row, col):

``never written``       it still holds (some of) its pre-update bits;
``stale``               it holds the previous version;
``stale trainer shard`` part of it holds the previous version, the rest the new one: the
                        exporter read a trainer whose DP shards were not all gathered yet
                        (distributed optimizer with ``overlap_param_gather``, read between
                        the optimizer step and the param all-gather);
``from another source`` it holds another parameter's values (another layer's: a pipeline
                        stage's local layer numbering; the other target's);
``cast through bf16``   a float32 parameter holds its values rounded to bfloat16;
``even TP split``       a fused component parameter holds an even split of its components'
                        concatenation (GDN ``in_proj_ba`` / ``in_proj_qkvz``, ``conv1d``, the
                        shared expert's ``gate_up_proj``);
``shared as routed``    a routed expert slot holds the shared expert;
``vocab padded to 64 only``
                        an embedding or ``lm_head`` holds its rows cut as if the vocabulary
                        were padded to a multiple of 64 alone, where that does not divide by TP
                        (SGLang's ``VocabParallelEmbedding`` then pads to 64 x TP);
``wrong KV replica``    a ``qkv_proj`` holds another KV head's K and V rows (fewer KV heads
                        than TP ranks: rank r serves head r // (TP / KV heads));
``frozen written``      a parameter of a target the update does not reach changed;
``wrong values``        anything else, first element located.

The head line names the pattern when one explains the findings (the draft never updated, a
tied ``lm_head`` not updated, the expert bias left at its initial values, every layer written
from another layer).

Exporters are judged on their stream first (:mod:`.stream_coverage`), then on the state the
reference whole-model receiver holds after loading it, judged here.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.oracle import model_synth
from pytest_weightsync.reference_impl.model.layout import parse_receiver_name, receiver_shard
from pytest_weightsync.reference_impl.model.locate import locate_receiver_element
from pytest_weightsync.reference_impl.model.model_layout import (
    DRAFT_PREFIX,
    VOCAB_PADDING,
    engine_params,
    locate_engine_element,
    split_engine_name,
    vocab_shard,
)
from pytest_weightsync.reference_impl.model.model_spec import expert_spec_of, hf_params

from . import judge, model_inputs

#: Most findings listed in one report (the count is always given).
MAX_FINDINGS = 12


class Finding(NamedTuple):
    param: str
    kind: str
    detail: str
    location: object = None

    def __str__(self) -> str:
        where = f" (first at {self.location})" if self.location is not None else ""
        return f"{self.kind}: {self.param}: {self.detail}{where}"


def locator(case, rank):
    """``locate(engine name, index)`` in checkpoint terms, experts included."""
    spec, topo = case.spec, case.receiver
    layout = engine_params(spec, topo, rank)

    def locate(name, index):
        p = layout.get(name)
        if p is None:
            return None
        if p.part != "experts":
            return locate_engine_element(spec, topo, rank, name, index, layout)
        target, own = split_engine_name(name)
        where = locate_receiver_element(expert_spec_of(spec, target), topo, rank, own, index)
        if where is not None and target == "draft":
            return f"draft {where}"
        return where

    return locate


def _first(mask: torch.Tensor) -> tuple:
    flat = int(torch.argmax(mask.reshape(-1).to(torch.uint8)))
    index = []
    for size in reversed(mask.shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _bits(t):
    return compare.raw_bits(t.detach())


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(_bits(a), _bits(b)))


def _even_split(case, rank, p, version) -> Optional[torch.Tensor]:
    """What ``p`` holds when its components' concatenation is split evenly across TP."""
    tp = case.receiver.tp
    if p.axis != 0 or len(p.segments) < 2 or p.part not in ("gdn", "shared_expert", "attention"):
        return None
    catalogue = hf_params(case.spec)
    blocks = []
    for seg in p.segments:
        if seg.source is None:
            return None
        offset = seg.start - rank * seg.size
        if offset < 0 or offset + seg.size * tp > catalogue[seg.source].shape[0]:
            return None  # a replicated KV head: not a 1/tp slice
        src = catalogue[seg.source]
        cols = torch.arange(math.prod(src.shape[1:]))
        blocks.append(model_synth.values_at(seg.source, src.dtype, version,
                                            torch.arange(offset, offset + seg.size * tp), cols))
    full = torch.cat(blocks, dim=0)
    n = p.shape[0]
    return full[rank * n:(rank + 1) * n].reshape(p.shape)


def _vocab_padded_alone(case, rank, p, version) -> Optional[tuple]:
    """``(tensor, (first, end) of the vocabulary rows it holds, rows per rank, padded rows)``:
    what a vocabulary parameter of engine
    ``rank`` holds when its rows are cut as if the vocabulary were padded to a multiple of
    :data:`VOCAB_PADDING` alone (rank r from row r x padded / TP, the rest of its shard zeros)
    where that multiple does not divide by TP; ``None`` elsewhere (there it is SGLang's rule)."""
    tp, vocab = case.receiver.tp, case.spec.vocab
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if p.part != "embeddings" or not p.segments or p.segments[0].source is None or padded % tp == 0:
        return None
    source, rows = p.segments[0].source, padded // tp
    start = min(rank * rows, vocab)
    real = min(vocab, start + rows, start + p.shape[0]) - start
    out = torch.zeros(p.shape, dtype=p.dtype)
    if real > 0:
        cols = torch.arange(math.prod(p.shape[1:]))
        out[:real] = model_synth.values_at(source, p.dtype, version,
                                           torch.arange(start, start + real),
                                           cols).reshape(real, *p.shape[1:])
    return out, (start, start + real), rows, padded


def _kv_replica(case, rank, p, actual, version) -> Optional[str]:
    """What a ``qkv_proj`` of engine ``rank`` holds when its K and V rows are another KV
    head's, with fewer KV heads than TP ranks (each head replicated on ``tp / kv_heads``
    consecutive ranks: SGLang's ``shard_id = tp_rank // num_kv_head_replicas``); else ``None``."""
    spec, tp = case.spec, case.receiver.tp
    if p.part != "attention" or len(p.segments) != 3 or spec.num_kv_heads >= tp:
        return None
    q, k, v = p.segments
    if k.source is None or not k.source.endswith("k_proj.weight"):
        return None
    catalogue = hf_params(spec)
    cols = torch.arange(math.prod(catalogue[k.source].shape[1:]))
    rows = actual.reshape(actual.shape[0], -1)
    held = []
    for seg, offset in ((k, q.size), (v, q.size + k.size)):
        for head in range(spec.num_kv_heads):
            want = model_synth.values_at(seg.source, catalogue[seg.source].dtype, version,
                                         torch.arange(head * seg.size, (head + 1) * seg.size), cols)
            if _same(rows[offset:offset + seg.size], want.reshape(seg.size, -1)):
                held.append(head)
                break
        else:
            return None
    expected = k.start // spec.head_dim
    if held[0] != held[1] or held[0] == expected:
        return None
    replicas = tp // spec.num_kv_heads
    return (f"its K and V rows are KV head {held[0]}'s; with {spec.num_kv_heads} KV heads over "
            f"TP {tp} each head serves {replicas} consecutive ranks, so rank {rank} holds KV head "
            f"{expected} (rank // {replicas})")


def _shared_as_routed(case, rank, name, actual, version) -> Optional[str]:
    """``"expert e"`` when a routed-expert slot of ``name`` holds the shared expert."""
    spec = case.spec
    if not spec.intermediate_shared or spec.intermediate_shared != spec.intermediate:
        return None
    target, own = split_engine_name(name)
    parsed = parse_receiver_name(own)
    shard = receiver_shard(expert_spec_of(spec, target), case.receiver, rank)
    prefix = f"model.layers.{parsed.layer}" if target == "target" else f"mtp.layers.{parsed.layer}"
    full = model_inputs.weights(spec, version).dense
    lo, hi = shard.row_start, shard.row_start + shard.rows
    if parsed.projection == "w13":
        block = torch.zeros(actual.shape[1:], dtype=actual.dtype)
        for proj in ("gate", "up"):
            off = shard.half_offset(proj, case.receiver.order)
            block[off:off + shard.rows] = full[f"{prefix}.mlp.shared_expert.{proj}_proj.weight"][lo:hi]
    else:
        block = torch.zeros(actual.shape[1:], dtype=actual.dtype)
        block[:, :shard.rows] = full[f"{prefix}.mlp.shared_expert.down_proj.weight"][:, lo:hi]
    for slot in range(actual.shape[0]):
        if _same(actual[slot], block):
            return f"expert {shard.experts[slot]}"
    return None


def state_findings(params, case, rank, version, before, previous_version=None,
                   stale_copies: Optional[str] = None) -> list[Finding]:
    """Every engine parameter of ``rank`` that is not what an update of ``case.targets`` to
    ``version`` leaves (``before``: the :func:`compare.snapshot` taken before the update)."""
    expected = model_inputs.expected(case, rank, version)
    previous = (model_inputs.expected(case, rank, previous_version)
                if previous_version is not None else None)
    layout = engine_params(case.spec, case.receiver, rank)
    locate = locator(case, rank)
    findings = []
    for name, p in layout.items():
        actual = params[name]
        old = before.records[name].copy
        if p.target in case.frozen:
            if not _same(actual, old):
                diff = _bits(actual) != _bits(old)
                findings.append(Finding(name, "frozen written",
                                        f"the update reaches {list(case.targets)}, yet "
                                        f"{int(diff.sum())} of {diff.numel()} elements changed",
                                        locate(name, _first(diff))))
            continue
        want = expected[name]
        if _same(actual, want):
            continue
        wrong = _bits(actual) != _bits(want)
        untouched = wrong & (_bits(actual) == _bits(old))
        if (previous is not None and _same(actual, old) and _same(actual, previous[name])):
            findings.append(Finding(name, "stale", f"it holds version {previous_version}'s values: "
                                    "none of its elements changed in this update (not written, "
                                    "or written again with the previous version's values)",
                                    locate(name, _first(wrong))))
            continue
        if bool(untouched.any()):
            count = int(untouched.sum())
            what = ("it still holds its pre-update bits" if count == wrong.numel() else
                    f"{count} of {wrong.numel()} elements still hold their pre-update bits")
            findings.append(Finding(name, "never written", what, locate(name, _first(untouched))))
            continue
        if previous is not None and _same(actual, previous[name]):
            if stale_copies:  # the harness left trainer memory at that version: say where
                findings.append(Finding(name, "stale trainer shard", f"it holds version "
                                        f"{previous_version}'s values: {stale_copies}",
                                        locate(name, _first(wrong))))
                continue
            findings.append(Finding(name, "stale", "it holds the previous version's values"))
            continue
        if previous is not None:
            held = wrong & (_bits(actual) == _bits(previous[name]))
            if bool(held.any()) and torch.equal(held, wrong):
                where = f": {stale_copies}" if stale_copies else ""
                findings.append(Finding(
                    name, "stale trainer shard",
                    f"{int(wrong.sum())} of {wrong.numel()} elements hold version "
                    f"{previous_version}'s values, the rest the new version's{where}",
                    locate(name, _first(wrong))))
                continue
        other = next((o for o, t in expected.items()
                      if o != name and t.shape == actual.shape and _same(actual, t)), None)
        if other is not None:
            findings.append(Finding(name, "from another source", f"it holds the values of "
                                    f"{other}", locate(name, _first(wrong))))
            continue
        if want.dtype == torch.float32 and _same(actual, want.to(torch.bfloat16).to(torch.float32)):
            findings.append(Finding(name, "cast through bf16", "its float32 values are rounded "
                                    "to bfloat16 (the low 16 mantissa bits are lost on the way)",
                                    locate(name, _first(wrong))))
            continue
        replica = _kv_replica(case, rank, p, actual, version)
        if replica is not None:
            findings.append(Finding(name, "wrong KV replica", replica, locate(name, _first(wrong))))
            continue
        alone = _vocab_padded_alone(case, rank, p, version)
        if alone is not None and _same(actual, alone[0]):
            tp, (held, rows, padded) = case.receiver.tp, alone[1:]
            owed = vocab_shard(case.spec.vocab, tp, rank)
            findings.append(Finding(
                name, "vocab padded to 64 only",
                f"it holds vocabulary rows [{held[0]}, {held[1]}) then zeros: the vocabulary "
                f"padded to {padded} rows, {rows} per rank; {padded} does not divide by TP {tp}, "
                f"so SGLang pads to a multiple of {VOCAB_PADDING} x {tp} ({owed.rows * tp} rows, "
                f"{owed.rows} per rank: rank {rank} holds rows [{owed.start}, "
                f"{owed.start + owed.real}))", locate(name, _first(wrong))))
            continue
        naive = _even_split(case, rank, p, version)
        if naive is not None and _same(actual, naive):
            parts = list(dict.fromkeys(s.source.rsplit(".", 2)[-2] for s in p.segments))
            findings.append(Finding(name, "even TP split", f"it holds rank {rank}'s even 1/"
                                    f"{case.receiver.tp} of the concatenation [{'; '.join(parts)}]"
                                    f", not [{'_r; '.join(parts)}_r] (SGLang shards each "
                                    f"component)", locate(name, _first(wrong))))
            continue
        if p.part == "experts":
            slot = _shared_as_routed(case, rank, name, actual, version)
            if slot is not None:
                findings.append(Finding(name, "shared as routed", f"routed {slot} holds the shared "
                                        f"expert's values", locate(name, _first(wrong))))
                continue
        try:
            compare.assert_bitwise_equal(actual, want, name=name, locate=locate, rank=rank)
        except compare.BitMismatchError as error:
            findings.append(Finding(name, "wrong values", str(error).split(": ", 1)[-1]))
    return findings


def _pattern(case, findings) -> Optional[str]:
    """A name for the bug the findings show, when one explains them."""
    layout = {f.param: f for f in findings}
    kinds = {f.kind for f in findings}
    spec = case.spec
    draft = [n for n in layout if n.startswith(DRAFT_PREFIX)]
    if "draft" in case.targets and draft and all(layout[n].kind == "never written" for n in draft):
        count = sum(1 for n in engine_params(spec, case.receiver, 0) if n.startswith(DRAFT_PREFIX))
        if len(draft) == count:
            return (f"the draft (MTP) model was never updated: all {count} of its parameters "
                    f"still hold their pre-update bits")
    if spec.tied and "lm_head.weight" in layout and "model.embed_tokens.weight" not in layout:
        return ("tied lm_head not updated: lm_head.weight differs from model.embed_tokens.weight, "
                "its one source (tied embeddings: both views must equal after every update)")
    bias = [n for n in layout if n.endswith("e_score_correction_bias")]
    if bias and all(layout[n].kind == "never written" for n in bias):
        return (f"e_score_correction_bias not mapped: {len(bias)} layer(s) keep its initial "
                f"values")
    if kinds == {"from another source"} or (
            "from another source" in kinds and kinds <= {"from another source", "never written"}):
        return ("parameters written from another layer or target (e.g. a pipeline stage's local "
                "layer numbering: each stage names its layers from 0)")
    if "stale trainer shard" in kinds:
        return ("stale trainer shard: parameters read where the trainer still held the "
                "previous version (each finding says where, and what reads it fresh)")
    if "cast through bf16" in kinds:
        return "float32 parameters cast through bfloat16"
    if "vocab padded to 64 only" in kinds:
        return (f"the vocabulary padded to a multiple of {VOCAB_PADDING} alone: on TP "
                f"{case.receiver.tp} SGLang pads it to a multiple of {VOCAB_PADDING} x TP "
                f"(VocabParallelEmbedding, when {VOCAB_PADDING}'s multiple does not divide by TP)")
    if "even TP split" in kinds:
        return "fused components split evenly across TP ranks (components mixed)"
    if "shared as routed" in kinds:
        return "the shared expert written as a routed expert"
    if "wrong KV replica" in kinds:
        return ("the wrong KV head replica chosen: with fewer KV heads than TP ranks, rank r "
                "holds KV head r // (TP / KV heads)")
    return None


def report(case, rank, findings, head: str = "", prop: str = "coverage") -> str:
    """The findings of engine ``rank`` under one head line naming the property judged
    (``prop``), the case and the pattern that explains them, if one does."""
    n = len(engine_params(case.spec, case.receiver, rank))
    pattern = _pattern(case, findings)
    lines = [f"{head}{prop} on engine rank {rank} of {case.id}: {len(findings)} of {n} "
             f"parameters wrong" + (f" - {pattern}" if pattern else "")]
    lines += [f"  - {f}" for f in findings[:MAX_FINDINGS]]
    if len(findings) > MAX_FINDINGS:
        lines.append(f"  ... ({len(findings) - MAX_FINDINGS} more)")
    return "\n".join(lines)


def check_model_rank(params, case, rank, version, before, previous_version=None, head="",
                     prop: str = "coverage", stale_copies: Optional[str] = None) -> None:
    """Engine ``rank`` after an update of ``case.targets`` to ``version``: every parameter at
    its old address, every parameter of the updated targets bit-exact, every parameter of a
    frozen target bit-identical; raise :class:`judge.ConformanceError` with the report, headed
    by the property ``prop`` the calling test judges."""
    compare.assert_same_storage(before, params, rank=rank)
    findings = state_findings(params, case, rank, version, before, previous_version,
                              stale_copies)
    if findings:
        raise judge.ConformanceError(report(case, rank, findings, head, prop))
