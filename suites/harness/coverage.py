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

Exporters are judged on their stream first (:func:`stream_findings`): every tensor the
update owes carried exactly once, in its dtype - a tensor carried twice, never carried, or
cut to bf16 is named there - then loaded by the reference whole-model receiver and judged
as above.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

import torch

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.oracle import model_synth
from pytest_weightsync.reference_impl.model.layout import (
    stage_layers,
    parse_receiver_name,
    receiver_shard,
)
from pytest_weightsync.reference_impl.model.locate import locate_receiver_element
from pytest_weightsync.reference_impl.model.model_layout import (
    DRAFT_PREFIX,
    VOCAB_PADDING,
    engine_params,
    locate_engine_element,
    split_engine_name,
    vocab_shard,
)
from pytest_weightsync.reference_impl.model.model_spec import MTP_PREFIX, expert_spec_of, hf_params

from . import judge, model_inputs

#: Most findings listed in one report (the count is always given).
MAX_FINDINGS = 12
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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


# --------------------------------------------------------------------------------------------
# Exporters: the stream, then the state it leaves
# --------------------------------------------------------------------------------------------


def _unit(name: str, fmt: str):
    """What one payload name carries: a dense tensor (its name) or expert pieces."""
    own = name
    target = "target"
    if fmt == "direct" and name.startswith(DRAFT_PREFIX):
        target, own = "draft", name[len(DRAFT_PREFIX):]
    elif name.startswith(MTP_PREFIX):
        target, own = "draft", "model." + name[len(MTP_PREFIX):]
    parsed = parse_receiver_name(own)
    if parsed is None:
        return (name,)
    if parsed.kind == "expert":
        return (target, parsed.layer, parsed.expert, parsed.projection)
    return (target, parsed.layer, "all", parsed.projection)


def _layer_of(name: str) -> Optional[int]:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _where(name: str, index: tuple) -> str:
    """``layer=L parameter=NAME row=R col=C`` of element ``index`` of payload tensor ``name``
    (a fused expert tensor's leading index is the expert)."""
    index = tuple(int(i) for i in index)
    layer = _layer_of(name)
    head = f"layer={layer} " if layer is not None else ""
    if len(index) == 3:
        head += f"expert={index[0]} "
        index = index[1:]
    row = index[0] if index else 0
    col = index[1] if len(index) > 1 else 0
    return f"{head}parameter={name} row={row} col={col}"


def _first_difference(got, want) -> Optional[str]:
    if tuple(got.shape) != tuple(want.shape):
        return None
    diff = _bits(got.to(want.dtype)) != _bits(want)
    return _first(diff) if bool(diff.any()) else None


def _shared_sent_as_routed(missing: list, seen: dict) -> Optional[str]:
    """The pattern of a shared expert sent under a routed expert's name (sglang#26015: shared
    experts fused into the routed expert ids): a shared-expert tensor never written whose
    values a routed expert of its layer carries (whole, or as one expert of a fused tensor)."""
    for name, want in missing:
        head, sep, _ = name.partition(".mlp.shared_expert.")
        if not sep:
            continue
        for entries in seen.values():
            b, e, got_name, got = entries[0]
            if not got_name.startswith(head + ".mlp.experts."):
                continue
            slots = ([got] if tuple(got.shape) == tuple(want.shape) else
                     list(got) if tuple(got.shape[1:]) == tuple(want.shape) else [])
            for slot, value in enumerate(slots):
                if value.dtype == want.dtype and _same(value, want):
                    where = "" if len(slots) == 1 else f" (expert {slot} of it)"
                    return (f"the pattern of a shared expert sent as a routed expert: {got_name}"
                            f"{where} (bucket {b} entry {e}) holds the values of {name}")
    return None


def _even_split_numbering(case, stages) -> Optional[tuple]:
    """``(layers sent twice, layers never sent)`` by an exporter that numbers stage s's local
    layer i as ``s * (num_layers // pp) + i`` on an uneven pipeline, where that differs from
    the true numbering; ``None`` on even stages (the assumption then holds)."""
    per_stage = case.spec.num_layers // case.trainer.pp
    if case.trainer.pp < 2 or all(len(r) == per_stage for r in stages):
        return None
    named = [s * per_stage + i for s, r in enumerate(stages) for i in range(len(r))]
    twice = sorted({n for n in named if named.count(n) > 1})
    never = sorted(set(range(case.spec.num_layers)) - set(named))
    return (twice, never) if twice and never else None


def stream_findings(case, rank, stream, fmt, version) -> list[str]:
    """What an exporter's ``stream`` for engine ``rank`` gets wrong against the whole-model
    payload it owes: tensors carried twice, never carried, unknown, or in another dtype /
    shape. Empty when it carries every owed tensor exactly once."""
    owed = {_unit(name, fmt): (name, tensor)
            for name, tensor in model_inputs.owed(case, rank, fmt, version)}
    seen: dict = {}
    problems = []
    for b, bucket in enumerate(stream):
        for e, (name, tensor) in enumerate(bucket):
            seen.setdefault(_unit(name, fmt), []).append((b, e, name, tensor))
    twice = {u: v for u, v in seen.items() if len(v) > 1}
    missing = [u for u in owed if u not in seen]
    unknown = [u for u in seen if u not in owed]
    if twice:
        unit, sample = next(iter(twice.items()))
        name, tensor = owed.get(unit, (sample[0][2], None))
        wrong = []
        for b, e, got_name, t in sample:
            index = _first_difference(t, tensor) if tensor is not None else None
            if index is not None:
                wrong.append(f"bucket {b} entry {e} holds other values, first at "
                             f"{_where(got_name, index)}")
        layers = sorted({_layer_of(v[0][2]) for v in twice.values()} - {None})
        problems.append(f"written twice: {len(twice)} tensor(s), e.g. {sample[0][2]} (by "
                        + " and ".join(f"bucket {b} entry {e}" for b, e, _, _ in sample)
                        + (f"; {'; '.join(wrong)}" if wrong else "")
                        + ")" + (f", layers {layers}" if layers else ""))
    if missing:
        names = [owed[u][0] for u in missing]
        layers = sorted({_layer_of(n) for n in names} - {None})
        problems.append(f"never written: {len(missing)} tensor(s), e.g. {names[:4]}"
                        + (f", layers {layers}" if layers else "")
                        + f"; first at {_where(names[0], (0, 0))}")
        if twice:
            dup_layers = sorted({_layer_of(v[0][2]) for v in twice.values()} - {None})
            stages = stage_layers(case.spec.num_layers, case.trainer)
            longest = max(len(r) for r in stages)
            even = _even_split_numbering(case, stages)
            if even is not None and (dup_layers, sorted(set(layers))) == even:
                problems.append(f"the pattern of an even pipeline split assumed: the "
                                f"{case.trainer.pp} stages hold {[len(r) for r in stages]} "
                                f"layers, but each stage numbered its layers from stage x "
                                f"{case.spec.num_layers // case.trainer.pp} (num_layers // pp), "
                                f"so layers {dup_layers} arrive more than once and layers "
                                f"{sorted(set(layers))} never (take each layer's "
                                f"layer_number, or megatron-core's "
                                f"get_transformer_layer_offset)")
            elif case.trainer.pp > 1 and dup_layers and max(dup_layers) < longest and \
                    set(layers) >= set(range(longest, case.spec.num_layers)):
                problems.append(f"the pattern of pipeline-stage-local layer numbering: each of "
                                f"the {case.trainer.pp} stages named its layers from 0, so layers "
                                f"{dup_layers} arrive more than once and layers "
                                f"{sorted(set(layers))} never")
    shared = _shared_sent_as_routed([owed[u] for u in missing], seen)
    if shared is not None:
        problems.append(shared)
    if unknown:
        problems.append(f"not owed by this update: {[seen[u][0][2] for u in unknown][:4]}")
    for unit, entries in seen.items():
        if unit not in owed:
            continue
        name, want = owed[unit]
        for b, e, got_name, got in entries[:1]:
            if got.dtype != want.dtype:
                index = _first_difference(got, want)
                where = (f", first wrong after casting back at {_where(got_name, index)}"
                         if index is not None else "")
                what = ("a float32 tensor cut to bf16" if want.dtype == torch.float32
                        and got.dtype == torch.bfloat16 else "its dtype changed")
                problems.append(f"{got_name} (bucket {b} entry {e}) arrives as {got.dtype}; the "
                                f"engine holds {want.dtype} ({what}{where})")
            elif tuple(got.shape) != tuple(want.shape):
                problems.append(f"{got_name} (bucket {b} entry {e}) has shape {tuple(got.shape)}, "
                                f"expected {tuple(want.shape)}")
    return problems


def tied_stream_problem(rank, stream, fmt) -> Optional[str]:
    """What a tied model's ``stream`` for engine ``rank`` gets wrong about its one source:
    checkpoint formats carry ``model.embed_tokens.weight`` once and no ``lm_head.weight``
    (with PP > 1 the last stage's copy of the embedding is not a second source); direct
    carries both engine tensors, equal. ``None`` when right."""
    names = [name for bucket in stream for name, _ in bucket]
    tensors = {name: t for bucket in stream for name, t in bucket}
    embeds = names.count("model.embed_tokens.weight")
    heads = names.count("lm_head.weight")
    want_heads = 1 if fmt == "direct" else 0
    if embeds != 1 or heads != want_heads:
        return (f"tied embeddings, engine rank {rank}, {fmt}: the stream carries "
                f"model.embed_tokens.weight {embeds} time(s) and lm_head.weight {heads} time(s); "
                f"one source means 1 and {want_heads}")
    if fmt == "direct" and not compare.same_bits(tensors["lm_head.weight"],
                                               tensors["model.embed_tokens.weight"]):
        return (f"tied embeddings, engine rank {rank}: the direct lm_head.weight differs from "
                f"model.embed_tokens.weight")
    return None


def draft_stream_problem(case, rank, stream, fmt, version=1) -> Optional[str]:
    """What an exporter's ``stream`` for engine ``rank`` gets wrong about the draft (MTP)
    model the trainer holds: no draft tensor at all (sglang#27718: one update path never
    reaches the draft), or only part of the ``mtp.*`` (direct: ``draft.*``) tensors owed.
    ``None`` when every draft tensor is there."""
    from pytest_weightsync.reference_impl.model.model_layout import DRAFT_PREFIX
    from pytest_weightsync.reference_impl.model.model_spec import MTP_PREFIX

    from . import model_inputs

    prefix = DRAFT_PREFIX if fmt == "direct" else MTP_PREFIX
    sent = {name for bucket in stream for name, _ in bucket if name.startswith(prefix)}
    if not sent:
        return (f"the draft (MTP) model was never updated: the {fmt} stream for engine rank "
                f"{rank} carries no {prefix}* tensor")
    owed = [n for n, _ in model_inputs.owed(case, rank, fmt, version) if n.startswith(prefix)]
    missing = sorted(set(owed) - sent)
    if missing:
        return (f"the draft (MTP) model is updated in part: the {fmt} stream for engine rank "
                f"{rank} lacks {len(missing)} of its {len(owed)} tensors, e.g. {missing[:4]}")
    return None


def judge_model_stream(case, rank, stream, fmt, version, head: str, previous_version=None,
                       prop: str = "coverage", stale_copies: Optional[str] = None):
    """An exporter's ``stream`` for engine ``rank``: its coverage, then a fresh poisoned
    reference receiver's state after loading it (``previous_version``: a value of that
    version is named stale; ``stale_copies``: where the trainer still held that version when
    the exporter was called - such a value is then a stale trainer shard, said to lie
    there), reported under the property ``prop``. Raises :class:`judge.ConformanceError`."""
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.model.layout import WeightSyncError
    from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver
    from pytest_weightsync.vocabulary import LOAD_FORMAT

    problems = stream_findings(case, rank, stream, fmt, version)
    if problems:
        raise judge.ConformanceError(f"{head}: stream coverage for engine rank {rank} of "
                                     f"{case.id}:\n" + "\n".join(f"  - {p}" for p in problems))
    receiver = ModelReceiver(case.spec, case.receiver, rank, targets=case.targets)
    for tensor in receiver.params.values():
        synth.poison_(tensor)
    before = compare.snapshot(receiver.params)
    try:
        receiver.begin_update()
        for bucket in stream:
            receiver.load(list(bucket), load_format=LOAD_FORMAT[fmt])
        receiver.end_update()
    except WeightSyncError as error:
        raise judge.ConformanceError(f"{head}: the reference receiver refused the stream: "
                                     f"{judge.quoted(error)}") from None
    check_model_rank(receiver.params, case, rank, version, before,
                     previous_version=previous_version, head=f"{head}: ", prop=prop,
                     stale_copies=stale_copies)
    return receiver
