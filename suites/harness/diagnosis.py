"""Naming the bug a wrong receiver parameter looks like, from what the bug would have left.

:mod:`.judge` found a parameter that differs from the expected state; this module compares it
with what each known bug leaves - computed from the oracle at layout coordinates, never from
the implementation - and returns one line naming the pattern, or ``None``: never written,
stale (the previous version), gate/up halves swapped, padding not zeroed, experts misplaced
(interleaved trainer numbering, round-robin engine routing). Receivers that keep an engine
layout go to :mod:`.engine_diagnosis` first.
"""

from __future__ import annotations

from pytest_weightsync.compare import same_bits
from pytest_weightsync.reference_impl.model.layout import receiver_shard

from . import engine_diagnosis


def _interleave(p: int, experts: int):
    """``g -> (g % p) * (experts // p) + g // p``: where blocked numbering over ``p`` groups
    puts what round-robin numbering calls ``g`` (and the reverse for ``experts // p``)."""
    return lambda g: (g % p) * (experts // p) + g // p


def expert_placement(name, actual, case, rank, version):
    """A one-line name when the local expert slots of ``name`` on receiver ``rank`` hold the
    right values of the WRONG experts, else ``None``: which expert each slot holds is read off
    every expert's expected values (a twin topology that holds all experts in the same rows),
    and a permutation that is interleaved (round-robin) instead of blocked numbering is named
    - on the trainer side (global id = local * EP + ep_rank instead of ep_rank * local_experts
    + local) or on the engine side (engine EP rank r given experts r, r + EP, ... instead of
    its block)."""
    import dataclasses

    from pytest_weightsync.reference_impl.oracle import synth

    spec, receiver = case.spec, case.receiver
    if spec.num_experts < 2 or not name.endswith(("w13_weight", "w2_weight")):
        return None
    shard = receiver_shard(spec, receiver, rank)
    twin = dataclasses.replace(receiver, tp=receiver.moe_tp, moe_ep=1, moe_dp=1)
    every = synth.expected_receiver_params(spec, twin, shard.moe_tp_rank, version).get(name)
    if every is None or tuple(every.shape[1:]) != tuple(actual.shape[1:]):
        return None
    holds, strays = {}, []
    for slot, expert in enumerate(shard.experts):
        found = [e for e in range(spec.num_experts) if same_bits(actual[slot], every[e])]
        if len(found) > 1:
            return None  # experts with equal values: which one a slot holds is not known
        if found:
            holds[expert] = found[0]
        else:
            strays.append(expert)
    wrong = {g: h for g, h in holds.items() if g != h}
    if not wrong:
        return None
    g, h = next(iter(wrong.items()))
    where = (f"receiver rank {rank}'s slot for expert {g} holds expert {h}'s values "
             f"({len(wrong)} of {len(shard.experts)} local experts)")
    shift = _shift(wrong, strays, list(shard.experts))
    if shift is not None:
        return f"expert offset {shift}: {where}"
    if strays:
        return None  # not (only) a misplacement
    trainer, experts = case.trainer, spec.num_experts
    names = []
    if trainer.ep > 1 and all(holds[e] == _interleave(trainer.ep, experts)(e) for e in holds):
        names.append(f"interleaved trainer expert numbering (global id = local * EP + ep_rank "
                     f"over trainer EP {trainer.ep}, instead of ep_rank * local_experts + local)")
    if receiver.moe_ep > 1 and all(
            holds[e] == _interleave(experts // receiver.moe_ep, experts)(e) for e in holds):
        names.append(f"round-robin engine expert routing (engine EP rank r given experts r, "
                     f"r + {receiver.moe_ep}, ... instead of its block of "
                     f"{experts // receiver.moe_ep})")
    pattern = " or ".join(names) if names else "a permutation of the experts"
    return f"experts misplaced: {where} - {pattern}"


def _by(d: int) -> str:
    return {1: "one", -1: "minus one"}.get(d, f"{d:+d}")


def _shift(wrong: dict, strays: list, local: list):
    """How a constant expert offset moved the experts, or ``None``: every wrong slot of global
    expert ``g`` holds expert ``g - d`` (the rest never written: ``strays``), or, with every
    slot holding some expert, the rank's experts rotated by ``d`` local slots."""
    differences = {g - h for g, h in wrong.items()}
    if strays and len(differences) == 1:
        d = differences.pop()
        g = next(iter(wrong))
        shown = ", ".join(str(e) for e in strays[:4]) + (" ..." if len(strays) > 4 else "")
        return (f"shifted by {_by(d)} (expert e holds expert e{-d:+d}'s values, e.g. expert {g}; "
                f"expert(s) {shown} never written)")
    if strays or any(h not in local for h in wrong.values()):
        return None
    n = len(local)
    rotations = {(local.index(g) - local.index(h)) % n for g, h in wrong.items()}
    if len(rotations) == 1 and len(wrong) == n:
        d = rotations.pop()
        return (f"shifted by {_by(d)} within the rank (local slot s holds local expert "
                f"s{-d:+d} modulo its {n} experts)")
    return None


def diagnose(name, actual, expected, case, rank, before=None, previous=None, version=None):
    """A one-line name for a recognizable wrong result of parameter ``name``, else ``None``."""
    if not case.receiver.default_engine:
        named = engine_diagnosis.diagnose(name, actual, expected, case, rank, version,
                                          before, previous)
        if named is not None:
            return named
    if before is not None and same_bits(actual, before):
        if previous is not None and same_bits(actual, previous):
            return ("stale: it still holds the previous version's values - none of its elements "
                    "changed in this update (not written, or written again with the previous "
                    "version's values)")
        return "never written: it still holds the bits it held before the update"
    if previous is not None and same_bits(actual, previous):
        return "stale: it still holds the previous version's values, not the new ones"
    if not case.receiver.default_engine:
        return None
    shard = receiver_shard(case.spec, case.receiver, rank)
    buf, rows = shard.buffer_rows, shard.rows
    if name.endswith("w13_weight") and rows > 0:
        first, second = ("gate", "up") if case.receiver.order == "gate_up" else ("up", "gate")
        a_first, a_second = actual[:, :rows], actual[:, buf:buf + rows]
        e_first, e_second = expected[:, :rows], expected[:, buf:buf + rows]
        swapped = [slot for slot in range(actual.shape[0])
                   if same_bits(a_first[slot], e_second[slot])
                   and same_bits(a_second[slot], e_first[slot])]
        if swapped:
            experts = [shard.experts[s] for s in swapped]
            return (f"gate/up halves swapped: the {first} rows of w13 hold {second}_proj values "
                    f"and the {second} rows hold {first}_proj values (receiver order "
                    f"{case.receiver.order!r}; {len(swapped)} of {actual.shape[0]} local experts, "
                    f"e.g. expert {experts[0]})")
    if buf > rows:
        if name.endswith("w2_weight"):
            real_ok = same_bits(actual[:, :, :rows], expected[:, :, :rows])
        else:
            real_ok = (same_bits(actual[:, :rows], expected[:, :rows])
                       and same_bits(actual[:, buf:buf + rows], expected[:, buf:buf + rows]))
        if real_ok:
            return f"padding not zeroed: the real rows are right, the tail beyond {rows} is not"
    if version is not None:
        return expert_placement(name, actual, case, rank, version)
    return None
