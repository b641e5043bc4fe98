"""Judging a receiver rank after an update: the one conformance check every suite applies.

The expected state comes from the synthetic value function at layout coordinates
(:func:`suites.harness.inputs.expected`) - never from the implementation's own output. Every
parameter must keep its address; the parameters the update owed must equal the expected state
in every bit; every other parameter (the router weight included) must be bit-identical to
what it held before. A mismatch is reported with its first differing (layer, expert,
projection, row, col) and, when the pattern is a known bug, a first line naming it (gate/up
halves swapped, stale values, elements never written, padding not zeroed).
"""

from __future__ import annotations

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.layout import receiver_shard

from . import inputs

#: Kinds of bit difference (``compare.DifferenceKinds``) that no placement bug produces, and
#: what does produce them.
VALUE_CONVERSIONS = {
    "nan_payload": "e.g. it stages BF16 through FP32 or another dtype, which canonicalizes NaNs",
    "zero_sign": "e.g. an arithmetic op such as x + 0 or a sum that loses the sign of zero",
    "subnormal_flush": "e.g. a kernel or dtype round trip that flushes subnormals to zero",
}
#: Longest implementation message quoted inside a conformance failure (a loader that raises
#: with megabytes of text must not flood the terminal, the junit file or the JSON report).
MAX_QUOTED = 2000


class ConformanceError(AssertionError):
    """An implementation's result differs from the reference; the message says where and,
    when recognizable, which bug it looks like. ``mismatch`` is the located
    :class:`pytest_weightsync.compare.BitMismatchError` behind it, when there is one."""

    def __init__(self, message: str, mismatch=None):
        super().__init__(message)
        self.mismatch = mismatch

    @property
    def location(self):
        return getattr(self.mismatch, "location", None)


def quoted(error: BaseException, limit: int = MAX_QUOTED) -> str:
    """``Type: message`` of an implementation's exception, cut to ``limit`` characters."""
    text = f"{type(error).__name__}: {error}"
    if len(text) > limit:
        text = text[:limit] + f"... [{len(text) - limit} more characters]"
    return text


def same_bits(a, b) -> bool:
    return a.shape == b.shape and bool((compare.raw_bits(a) == compare.raw_bits(b)).all())


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

    from pytest_weightsync.reference_impl import synth

    spec, receiver = case.spec, case.receiver
    if spec.num_experts < 2 or not name.endswith(("w13_weight", "w2_weight")):
        return None
    shard = receiver_shard(spec, receiver, rank)
    twin = dataclasses.replace(receiver, tp=receiver.moe_tp, moe_ep=1, moe_dp=1)
    every = synth.expected_receiver_params(spec, twin, shard.moe_tp_rank, version).get(name)
    if every is None or tuple(every.shape[1:]) != tuple(actual.shape[1:]):
        return None
    holds = {}
    for slot, expert in enumerate(shard.experts):
        found = [e for e in range(spec.num_experts) if same_bits(actual[slot], every[e])]
        if len(found) != 1:
            return None  # not (only) a misplacement
        holds[expert] = found[0]
    wrong = {g: h for g, h in holds.items() if g != h}
    if not wrong:
        return None
    g, h = next(iter(wrong.items()))
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
    return (f"experts misplaced: receiver rank {rank}'s slot for expert {g} holds expert {h}'s "
            f"values ({len(wrong)} of {len(holds)} local experts) - {pattern}")


def diagnose(name, actual, expected, case, rank, before=None, previous=None, version=None):
    """A one-line name for a recognizable wrong result of parameter ``name``, else ``None``."""
    if not case.receiver.default_engine:
        from . import engine_diagnosis

        named = engine_diagnosis.diagnose(name, actual, expected, case, rank, version,
                                          before, previous)
        if named is not None:
            return named
    if before is not None and same_bits(actual, before):
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


def check_rank(params, case, rank, version, before=None, touched=None, previous_version=None,
               *, cached=True):
    """Receiver ``rank`` after loading ``version`` into the parameters in ``touched`` (default
    every parameter the update owes): every parameter at its old address, the touched ones
    bit-identical to the expected state, every other one (the router weight included)
    bit-identical to ``before`` (a :func:`pytest_weightsync.compare.snapshot` taken before the
    update; without one only the values are judged). ``cached=False`` computes the expected
    state afresh: self-tests that plant a bug in the value function or the layout model need
    it computed under the plant."""
    if before is not None:
        compare.assert_same_storage(before, params, rank=rank)
    expected_of = inputs.expected if cached else inputs.expected_uncached
    expected = expected_of(case, rank, version)
    touched = list(expected) if touched is None else list(touched)
    locate = inputs.locator(case, rank)
    missing = [name for name in touched if name not in params]
    if missing:
        raise ConformanceError(f"receiver rank {rank}: parameters {missing[:4]} are missing from "
                               f"the parameter set ({len(missing)} in all)")
    for name in touched:
        try:
            compare.assert_bitwise_equal(params[name], expected[name], name=name, locate=locate,
                                         rank=rank)
        except compare.BitMismatchError as error:
            previous = (expected_of(case, rank, previous_version)[name]
                        if previous_version is not None else None)
            old = before.records[name].copy if before is not None else None
            kind = getattr(getattr(error, "kinds", None), "kind", "value")
            if not case.receiver.default_engine:  # engine bugs first; bit kinds are BF16's
                hint = diagnose(name, params[name], expected[name], case, rank, old, previous,
                                version)
            elif kind in VALUE_CONVERSIONS:
                hint = (f"not a placement bug: {error.kinds.describe()} - the loader converts "
                        f"values on the way ({VALUE_CONVERSIONS[kind]})")
            else:
                hint = diagnose(name, params[name], expected[name], case, rank, old, previous,
                                version)
            raise ConformanceError((f"{hint}\n" if hint else "") + str(error), error) from None
    for name, record in (before.records.items() if before is not None else ()):
        if name in touched:
            continue
        try:
            compare.assert_bitwise_equal(params[name], record.copy, name=name, locate=locate,
                                         rank=rank)
        except compare.BitMismatchError as error:
            raise ConformanceError(f"wrote outside the payload: {name} was not in it and "
                                   f"changed\n{error}", error) from None
