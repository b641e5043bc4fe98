"""Running one sync scenario end to end and checking every receiver rank bit for bit.

Shared by the expert-sync suites (matrix, versions, bad payloads, mutations, multi-rank) so
they all apply the same conformance check: parameters at unchanged addresses and bit-identical
to the independently computed expected state, first mismatch located in model terms.
"""

from __future__ import annotations

import functools

from pytest_weightsync import compare
from reference_impl import compat, direct, packed, synth, trainer
from reference_impl.layout import locate_receiver_element
from reference_impl.receiver import ReferenceReceiver

PATHS = ("compat", "packed", "direct")
#: load_format each path's payload is loaded with.
LOAD_FORMAT = {"compat": None, "packed": None, "direct": "direct"}


def locator(case, rank):
    """``locate(name, index)`` for compare messages on receiver ``rank``."""
    return functools.partial(locate_receiver_element, case.spec, case.receiver, rank)


def gathered_weights(case, version):
    """Full HF weights as the sender sees them: synthesized, sliced into every trainer rank's
    Megatron shards, then gathered back (single-process form)."""
    full = synth.full_weights(case.spec, version)
    states = trainer.trainer_states(case.spec, case.trainer, full)
    return trainer.gather_full_weights(case.spec, case.trainer, states)


def payload(path, case, rank, full, layers=None):
    """The ``path`` payload receiver ``rank`` gets (compat and packed are rank independent)."""
    if path == "compat":
        return compat.export(full, layers)
    if path == "packed":
        return packed.export(case.spec, full, case.receiver.order, layers)
    if path == "direct":
        return direct.export(case.spec, case.receiver, rank, full, layers)
    raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")


def fresh_receivers(case, receiver_cls=ReferenceReceiver):
    """One receiver per rank, every buffer (padding included) poisoned so nothing passes by
    luck of zero-initialisation."""
    receivers = [receiver_cls(case.spec, case.receiver, r) for r in range(case.receiver.tp)]
    for rec in receivers:
        for tensor in rec.params.values():
            synth.poison_(tensor)
    return receivers


def check_rank(receiver, case, version, before=None):
    """The conformance check of one receiver rank after a complete update to ``version``."""
    expected = synth.expected_receiver_params(case.spec, case.receiver, receiver.rank, version)
    compare.assert_loaded(receiver.params, expected, before=before,
                          locate=locator(case, receiver.rank), rank=receiver.rank)


def sync_and_check(case, path, version, receivers=None, full=None):
    """Send ``version`` along ``path`` to every receiver rank (one chunk per layer, between
    ``begin_update()`` and ``end_update()``), then check every rank. Returns the receivers
    for further updates."""
    receivers = fresh_receivers(case) if receivers is None else receivers
    full = gathered_weights(case, version) if full is None else full
    for rec in receivers:
        before = compare.snapshot(rec.params)
        rec.begin_update()
        for layer in range(case.spec.num_layers):
            rec.load(payload(path, case, rec.rank, full, [layer]), load_format=LOAD_FORMAT[path])
        rec.end_update()
        check_rank(rec, case, version, before)
    return receivers
