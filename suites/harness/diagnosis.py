"""Naming the bug a wrong receiver parameter looks like, from what the bug would have left.

:mod:`.judge` found a parameter that differs from the expected state; this module compares it
with what each known bug leaves - computed from the oracle at layout coordinates, never from
the implementation - and returns one line naming the pattern, or ``None``: never written,
stale (the previous version), gate/up halves swapped, padding not zeroed, experts misplaced
(interleaved trainer numbering, round-robin engine routing, a wrong EP rank base, vLLM's
uneven EP map miscounted). Receivers that keep an engine layout go to :mod:`.engine_diagnosis`
first. A pattern is named only where the side under test can have caused it (``side``): in
the loader suites the payload is the harness's own, so a loader's wrong expert offset is never
blamed on the trainer's numbering.
"""

from __future__ import annotations

from pytest_weightsync.compare import same_bits
from pytest_weightsync.reference_impl.model.layout import receiver_shard

from . import engine_diagnosis


def _interleave(p: int, experts: int):
    """``g -> (g % p) * (experts // p) + g // p``: where blocked numbering over ``p`` groups
    puts what round-robin numbering calls ``g`` (and the reverse for ``experts // p``)."""
    return lambda g: (g % p) * (experts // p) + g // p


#: Who the judged receiver rank's wrong result can come from (``side``): ``loader`` - the
#: implementation under test is the loader, the payload is the harness's own (built from the
#: oracle), so a trainer-side pattern cannot be the cause; ``exporter`` - the implementation
#: under test produced the payload and the receiver is the reference, so it can have numbered
#: the trainer's experts wrong or routed them to the wrong engine rank; ``None`` - either
#: (self-tests that plant a bug on one side or the other).
SIDES = ("loader", "exporter", None)


def expert_placement(name, actual, case, rank, version, side="loader"):
    """A one-line name when the local expert slots of ``name`` on receiver ``rank`` hold the
    right values of the WRONG experts, else ``None``: which expert each slot holds is read off
    every expert's expected values (a twin topology that holds all experts in the same rows),
    and a permutation that is interleaved (round-robin) instead of blocked numbering is named
    - on the trainer side (global id = local * EP + ep_rank instead of ep_rank * local_experts
    + local) or on the engine side (engine EP rank r given experts r, r + EP, ... instead of
    its block) - as is a block at the wrong EP rank base (engine EP rank r's block taken from
    r * k instead of r * local_experts). Only a pattern of the ``side`` under test is named
    (:data:`SIDES`): a loader is never told its trainer numbering is wrong."""
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
    uneven = uneven_ep_miscount(case, rank, shard, holds)
    if uneven is not None:
        return uneven
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
    base = _ep_rank_base(holds, shard, side)
    if base is not None:
        names.append(base)
    if side != "loader" and trainer.ep > 1 and all(
            holds[e] == _interleave(trainer.ep, experts)(e) for e in holds):
        names.append(f"interleaved trainer expert numbering (global id = local * EP + ep_rank "
                     f"over trainer EP {trainer.ep}, instead of ep_rank * local_experts + local)")
    if receiver.moe_ep > 1 and all(
            holds[e] == _interleave(experts // receiver.moe_ep, experts)(e) for e in holds):
        names.append(f"round-robin engine expert routing (engine EP rank r given experts r, "
                     f"r + {receiver.moe_ep}, ... instead of its block of "
                     f"{experts // receiver.moe_ep})")
    pattern = " or ".join(names) if names else "a permutation of the experts"
    return f"experts misplaced: {where} - {pattern}"


def uneven_ep_miscount(case, rank, shard, holds):
    """For vLLM's uneven expert placement (``expert_placement="linear_uneven"``: the first
    ``E % EP`` EP ranks hold one expert more): a name when the rank's slots hold exactly what
    one of the usual miscounts puts there, else ``None``. ``holds`` maps the expert each slot
    should hold to the expert whose values it holds (absent: none of them, e.g. never
    written). The miscounts: the remainder given to the last rank, and rank e's first expert
    computed as ``e * E // EP`` (the even formula)."""
    spec, receiver = case.spec, case.receiver
    if getattr(receiver, "expert_placement", "even") != "linear_uneven":
        return None
    num, ep, ep_rank = spec.num_experts, receiver.moe_ep, shard.moe_ep_rank
    base, extra = divmod(num, ep)
    right = list(shard.experts)
    floor_start = ep_rank * num // ep
    miscounts = (
        (range(ep_rank * base, (ep_rank + 1) * base + (extra if ep_rank == ep - 1 else 0)),
         "the remainder given to the last EP rank"),
        (range(floor_start, floor_start + len(right)),
         f"EP rank e's first expert computed as e * E // EP ({ep_rank} * {num} // {ep} = "
         f"{floor_start}), the even formula"),
    )
    named, shown = [], None
    for wrong, words in miscounts:
        if list(wrong) == right:
            continue
        predicted = [wrong[s] if s < len(wrong) else None for s in range(len(right))]
        if all(holds.get(g) == p for g, p in zip(right, predicted)):
            named.append(words)
            shown = ", ".join("-" if p is None else str(p) for p in predicted)
            if None in predicted:
                shown += "; -: no expert's values"
    if not named:
        return None
    return (f"uneven EP placement miscounted: receiver rank {rank} (EP rank {ep_rank} of {ep}) "
            f"holds experts [{shown}] where vLLM's map gives it {right} (the first "
            f"{extra} of {ep} ranks hold {base + 1} of the {num} experts, the others {base}) - "
            + " or ".join(named))


def _ep_rank_base(holds: dict, shard, side) -> str | None:
    """A name when every slot of MoE-EP rank ``r`` (``r > 0``) holds the consecutive experts of
    a block that starts at ``r * k`` for some ``k`` other than its local expert count - the
    offset computed from the wrong number of experts per rank - else ``None``."""
    local, r = list(shard.experts), shard.moe_ep_rank
    held = [holds.get(e) for e in local]
    if r == 0 or None in held or len(holds) != len(local):
        return None
    start, n = held[0], len(local)
    if held != list(range(start, start + n)) or start == local[0] or start % r:
        return None
    who = {"loader": "the loader ", "exporter": "the exporter "}.get(side, "")
    block = lambda a, b: f"expert {a}" if a == b else f"experts {a}..{b}"  # noqa: E731
    return (f"wrong EP rank base: {who}gave engine MoE-EP rank {r} {block(start, start + n - 1)} "
            f"(base {r} * {start // r}) instead of its block's {block(local[0], local[-1])} "
            f"(base {r} * {n}, its {n} local expert{'s' if n > 1 else ''})")


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


def diagnose(name, actual, expected, case, rank, before=None, previous=None, version=None,
             side="loader"):
    """A one-line name for a recognizable wrong result of parameter ``name``, else ``None``;
    ``side`` says which side of the sync is under test (:data:`SIDES`)."""
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
        return expert_placement(name, actual, case, rank, version, side)
    return None
