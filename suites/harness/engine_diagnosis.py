"""Naming the known bugs of engine receivers (post-load layouts, redundant experts).

:func:`suites.harness.diagnosis.diagnose` hands over here for a receiver that does not keep the
checkpoint layout. Each check compares the wrong parameter with what one bug would have left,
computed from the coordinates (``engine_layout``, ``synth``) - never from the loader:

* post-load layouts: the checkpoint layout left in the buffer (the transform not run after
  this update: a raw write into a transformed buffer), or the transform applied twice;
* transposed: the checkpoint layout laid untransposed into the transposed buffer;
* redundant experts: a physical copy left unwritten while another copy of the same expert
  holds the new bits (only the first copy written), or a slot holding another expert's
  weights (written by a stale placement);
* FP8 blocks: a scale that belongs to the neighbouring block, or block scales of the previous
  version beside new weights (derived scales not rebuilt).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from pytest_weightsync.compare import same_bits
from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.model.layout import parse_receiver_name, receiver_shard


def _slots(actual, target) -> list[int]:
    return [s for s in range(actual.shape[0]) if same_bits(actual[s], target[s])]


def diagnose(name, actual, expected, case, rank, version, before=None,
             previous=None) -> Optional[str]:
    """A one-line name for a recognizable wrong engine parameter ``name``, else ``None``."""
    spec, topo = case.spec, case.receiver
    if topo.weight_quant == "fp8_block":
        return _fp8(name, actual, expected, case, rank, previous)
    if topo.engine_layout in engine_layout.POST_LOAD:
        return _post_load(name, actual, expected, case, rank, version)
    if topo.engine_layout == "transposed":
        checkpoint = synth.expected_receiver_params(spec, topo, rank, version)[name]
        if actual.numel() == checkpoint.numel() and same_bits(actual.reshape(checkpoint.shape),
                                                           checkpoint):
            return (f"written untransposed: {name} holds the checkpoint layout "
                    f"{tuple(checkpoint.shape)} laid into the transposed buffer "
                    f"{tuple(actual.shape)} the triton_kernels engine reads")
        return None
    if topo.eplb:
        return _redundant(name, actual, expected, case, rank, version, before)
    return None


def _post_load(name, actual, expected, case, rank, version) -> Optional[str]:
    spec, topo = case.spec, case.receiver
    checkpoint = synth.expected_receiver_params(spec, topo, rank, version)[name]
    param = "w13" if name.endswith("w13_weight") else "w2"
    rows, cols = engine_layout.source_rows(param, tuple(expected.shape[1:]),
                                           expected.element_size())
    twice = expected[:, rows, cols]
    raw, doubled = _slots(actual, checkpoint), _slots(actual, twice)
    n = actual.shape[0]
    if raw:
        return (f"checkpoint layout in a {topo.engine_layout} engine: {len(raw)} of {n} local "
                f"experts of {name} hold the loaded rows as written (e.g. slot {raw[0]}) - the "
                f"post-load layout was not applied after this update (a raw write into a "
                f"transformed buffer)")
    if doubled:
        return (f"post-load layout applied twice: {len(doubled)} of {n} local experts of {name} "
                f"(e.g. slot {doubled[0]}) hold the {topo.engine_layout} permutation of rows "
                f"that already held it (the transform re-run on transformed weights)")
    return None


def _redundant(name, actual, expected, case, rank, version, before) -> Optional[str]:
    spec, topo = case.spec, case.receiver
    shard = receiver_shard(spec, topo, rank)
    layer = parse_receiver_name(name).layer
    wrong = [s for s in range(actual.shape[0]) if not same_bits(actual[s], expected[s])]
    for slot in wrong:
        expert = shard.logical_expert(layer, slot)
        physical = shard.experts[slot]
        right = [s for s in shard.slots_of(layer, expert) if s not in wrong]
        row = list(topo.physical_to_logical(spec)[layer])
        copies = [p for p, logical in enumerate(row) if logical == expert]
        if before is not None and same_bits(actual[slot], before[slot]) and right:
            return (f"only the first physical copy written: {name} slot {slot} (physical expert "
                    f"{physical}) of logical expert {expert} kept the bits it held before the "
                    f"update while slot {right[0]} (physical {shard.experts[right[0]]}) holds "
                    f"the new ones; every copy must be written")
        if (before is not None and same_bits(actual[slot], before[slot])
                and len(copies) > 1 and physical != copies[0]):
            return (f"only the first physical copy written: {name} slot {slot} holds physical "
                    f"expert {physical}, copy {copies.index(physical) + 1} of logical expert "
                    f"{expert} (its copies: physical {copies}), and kept the bits it held "
                    f"before the update; every copy must be written, on every rank")
        for other in range(spec.num_experts):
            if other == expert:
                continue
            row[physical] = other
            probe = replace(topo, placement=tuple(tuple(row) if L == layer else r
                                                  for L, r in enumerate(
                                                      topo.physical_to_logical(spec))))
            held = synth.expected_engine_params(spec, probe, rank, version)[name]
            if same_bits(actual[slot], held[slot]):
                return (f"written by a stale placement: {name} slot {slot} (physical expert "
                        f"{physical}) holds logical expert {other}'s weights, the current "
                        f"placement gives it expert {expert} (a map from before a rebalance)")
    return None


def _fp8(name, actual, expected, case, rank, previous) -> Optional[str]:
    from pytest_weightsync.reference_impl.model import fp8

    if not name.endswith(fp8.SCALE_SUFFIX):
        if previous is not None and same_bits(actual, previous):
            return (f"stale FP8 weights: {name} holds the previous version's float8 weights "
                    f"(never written by this update)")
        return None
    if previous is not None and same_bits(actual, previous):
        return (f"stale block scales: {name} holds the previous version's scales while this "
                f"update's weights are new (derived scales not rebuilt: new weights read with "
                f"stale fp8 scales)")
    from pytest_weightsync.compare import raw_bits

    # w13's scale rows are two halves (gate, up): a shift stays inside each projection
    pieces = (actual.chunk(2, dim=1) if name.endswith(f"w13_weight{fp8.SCALE_SUFFIX}")
              else (actual,))
    wanted = (expected.chunk(2, dim=1) if len(pieces) == 2 else (expected,))
    for dim, axis in ((1, "row"), (2, "column")):
        for shift in (1, -1):
            equal = total = 0
            for a_piece, e_piece in zip(pieces, wanted):
                n = a_piece.shape[dim]
                if n < 2:
                    continue
                a = raw_bits(a_piece.narrow(dim, max(shift, 0), n - 1))
                e = raw_bits(e_piece.narrow(dim, max(-shift, 0), n - 1))
                equal += int((a == e).sum())
                total += a.numel()
            # the blocks inside each projection hold their neighbour's scale (edges aside)
            if total and equal / total >= 0.9:
                return (f"scale of the neighbouring block: {equal} of {total} inner blocks of "
                        f"{name} hold the scale of the block {'before' if shift > 0 else 'after'}"
                        f" them along the block {axis}s (scales shifted by one block)")
    return None
