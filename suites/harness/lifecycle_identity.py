"""``identity``: the engine's own weights sent back change no bit (SkyRL#1680, vllm#48284,
prime-rl#2714).

Every rank gets one update of the oracle's finite weights, then :data:`IDENTITY_SYNCS`
identity syncs of them, each a full framed update cut at another bucket limit: every parameter
bit-identical after every sync, the engine's post-load processing included, the reference MoE
forward (:mod:`~pytest_weightsync.reference_impl.oracle.moe_forward`) on a fixed input
unchanged and equal to the forward over the oracle's weights, and no warning raised or logged
while loading.
"""

from __future__ import annotations

from typing import Optional

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import (
    fused_name,
    parse_receiver_name,
    receiver_shard,
)
from pytest_weightsync.vocabulary import BUCKET_LIMITS

from . import diagnosis, inputs
from .judge import ConformanceError
from .lifecycle_engine import (
    IDENTITY_VERSION,
    EngineRank,
    changed,
    identity_expected,
    identity_update,
    kind,
    load_warnings,
    post_load_timing,
)

#: Identity syncs after the first update (the issue's N >= 3).
IDENTITY_SYNCS = 3
#: Tokens of the fixed forward input.
FORWARD_TOKENS = 5


def forward(case, rank: int, params) -> "torch.Tensor":
    """The reference MoE forward of ``rank``'s experts on a fixed input, every layer stacked
    ``[L, T, H]`` (float32): read from the engine's parameters in its layout
    (:func:`~pytest_weightsync.reference_impl.model.engine_layout.checkpoint_view`)."""
    import torch

    from pytest_weightsync.reference_impl.oracle.moe_forward import moe_forward

    spec, topo = case.spec, case.receiver
    shard = receiver_shard(spec, topo, rank)
    view = engine_layout.checkpoint_view(spec, topo, rank, {
        name: t for name, t in params.items() if parse_receiver_name(name) is not None})
    gen = torch.Generator().manual_seed(20260937)
    hidden = torch.randn(FORWARD_TOKENS, spec.hidden, generator=gen).to(spec.dtype)
    outs = []
    for layer in range(spec.num_layers):
        logits = torch.randn(FORWARD_TOKENS, spec.num_experts, generator=gen)
        outs.append(moe_forward(hidden, logits, view[fused_name(layer, "w13")],
                                view[fused_name(layer, "w2")], top_k=min(2, spec.num_experts),
                                expert_start=shard.experts.start, order=topo.order,
                                out_dtype=torch.float32))
    return torch.stack(outs)


def _forward_difference(got, want) -> Optional[str]:
    found = compare.first_difference(got, want)
    if found is None:
        return None
    count, index, _ = found
    return (f"{count} of {got.numel()} outputs differ, first at layer={index[0]} "
            f"token={index[1]} col={index[2]}: got {float(got[index])!r}, expected "
            f"{float(want[index])!r}")


def _identity_mismatch(engine, name, want, before, what) -> ConformanceError:
    """The located difference of ``name`` from ``want``, headed by the pattern it shows."""
    case, rank = engine.case, engine.rank
    try:
        compare.assert_bitwise_equal(engine.params[name], want, name=name, rank=rank,
                                     locate=inputs.locator(case, rank))
    except compare.BitMismatchError as error:
        hint = post_load_timing(engine, IDENTITY_VERSION, finite=True)
        if hint is not None and hint in what:
            hint = None  # it heads the message already
        elif hint is None and case.receiver.default_engine:
            hint = diagnosis.diagnose(name, engine.params[name], want, case, rank,
                                      before.records[name].copy if before else None)
        return ConformanceError(f"{what}\n" + (f"{hint}\n" if hint else "") + str(error),
                                error)
    raise AssertionError(f"{name} equals what it was compared with (a harness bug)")


def check_identity(impl, case, fmt: str) -> None:
    """Every rank: one update to the finite weights, then :data:`IDENTITY_SYNCS` identity
    syncs of them, each a full framed update at another bucket limit (see the module
    docstring)."""
    for rank in range(case.receiver.world_size):
        engine = EngineRank(impl, case, rank, fmt)
        identity_update(engine, "split_layer")
        compare.assert_same_storage(engine.poisoned, engine.params, rank=rank)
        expected = identity_expected(case, rank)
        for name, record in engine.poisoned.records.items():
            want = expected.get(name, record.copy)  # the router weight: untouched
            if not compare.same_bits(engine.params[name], want):
                timing = post_load_timing(engine, IDENTITY_VERSION, finite=True)
                raise _identity_mismatch(engine, name, want, engine.poisoned, (
                    f"{timing} - " if timing else "") + f"the first update, before any "
                    f"identity sync, did not land on {engine.where}")
        held = compare.snapshot(engine.params)
        want = forward(case, rank, expected)  # over the oracle's weights
        first = forward(case, rank, engine.params)
        assert compare.same_bits(first, want) and bool(want.abs().sum() > 0), (
            f"the forward over {engine.where}'s bit-exact weights is zero or differs from the "
            f"forward over the oracle's: {_forward_difference(first, want)} (a harness bug)")
        for sync in range(1, IDENTITY_SYNCS + 1):
            with load_warnings() as caught:
                identity_update(engine, BUCKET_LIMITS[sync % len(BUCKET_LIMITS)])
            compare.assert_same_storage(held, engine.params, rank=rank)
            moved = changed(held, engine.params)
            if moved:
                raise _identity_failure(engine, sync, moved, held, want)
            if caught:
                raise ConformanceError(
                    f"identity sync {sync} of {IDENTITY_SYNCS} on {engine.where} left every bit "
                    f"as it was but warned while loading ({len(caught)}): {caught[:3]} - a sync "
                    f"of the engine's own weights must load without a warning (SkyRL's "
                    f"regression: no 'Failed to load weights')")


def _identity_failure(engine, sync, moved, held, want) -> ConformanceError:
    case, rank = engine.case, engine.rank
    fwd = _forward_difference(forward(case, rank, engine.params), want)
    fused = [n for n in moved if n.endswith("w13_weight")]
    head = post_load_timing(engine, IDENTITY_VERSION, finite=True) or (
        f"identity sync corrupted a fused parameter: {kind(fused[0])}" if fused
        else f"identity sync corrupted {kind(moved[0])}")
    name = (fused or moved)[0]
    return _identity_mismatch(engine, name, held.records[name].copy, held, (
        f"{head} - identity sync {sync} of {IDENTITY_SYNCS} (the engine's own weights sent "
        f"back) changed {len(moved)} of {len(held.records)} parameter(s) of {engine.where}: "
        f"{[kind(n) for n in moved[:4]]}; the forward on a fixed input "
        f"{'changed: ' + fwd if fwd else 'did not change'} (SkyRL#1680, vllm#48284, "
        f"prime-rl#2714)"))
