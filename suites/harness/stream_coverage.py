"""Judging a whole-model exporter: its stream first, then the state it leaves.

An exporter's stream for one engine rank is judged before anything loads it
(:func:`stream_findings`): every tensor the update owes carried exactly once, in its dtype -
a tensor carried twice, never carried, unknown or cut to bf16 is named there, with the
pattern that explains it (pipeline-stage-local or even-split layer numbering, a shared expert
sent as a routed one). Tied embeddings and the draft (MTP) model have their own stream checks.
Only a stream that owes nothing is loaded by the reference whole-model receiver, whose state
the coverage report of :mod:`.coverage` then judges. This module exists apart from that
report because it reads payload names, not engine parameters: a new wire or export pattern
changes it, a new engine layout changes the other.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.model.layout import parse_receiver_name, stage_layers
from pytest_weightsync.reference_impl.model.model_layout import DRAFT_PREFIX
from pytest_weightsync.reference_impl.model.model_spec import MTP_PREFIX

from . import judge, model_inputs
from .coverage import _bits, _first, _same, check_model_rank

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
