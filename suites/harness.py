"""Running one sync scenario end to end and checking every receiver rank bit for bit.

Shared by the expert-sync suites (matrix, versions, bad payloads, mutations, multi-rank) so
they all apply the same conformance check: parameters at unchanged addresses and bit-identical
to the independently computed expected state, first mismatch located in model terms.

An update travels as a stream of buckets cut at a byte limit the way real senders cut it
(:func:`pytest_weightsync.reference_impl.buckets.split_buckets`). :data:`BUCKET_LIMITS` names
the limits the suites drive, each derived from the model size so it means the same thing on
every case: one tensor per bucket, a limit that splits a layer's experts over buckets, one
that puts several layers in one bucket, and the whole update in one bucket.
"""

from __future__ import annotations

import functools

from pytest_weightsync import compare
from pytest_weightsync.reference_impl import senders, synth, trainer
from pytest_weightsync.reference_impl.buckets import split_buckets
from pytest_weightsync.reference_impl.layout import locate_receiver_element
from pytest_weightsync.reference_impl.receiver import ReferenceReceiver

PATHS = ("compat", "hf_fused", "packed", "direct")
#: load_format each path's payload is loaded with.
LOAD_FORMAT = {"compat": None, "hf_fused": None, "packed": None, "direct": "direct"}
#: Named bucket limits (see :func:`bucket_bytes`).
BUCKET_LIMITS = ("tensor", "split_layer", "multi_layer", "whole")


def bucket_bytes(limit, spec):
    """Byte limit of the named bucket ``limit`` for ``spec`` (an int or ``None`` passes through):

    ``"tensor"``       0: one tensor per bucket;
    ``"split_layer"``  2.5 experts' worth: a layer's experts straddle buckets (per-expert
                       payloads), a fused tensor travels alone;
    ``"multi_layer"``  1.75 layers' worth: one bucket holds all of one layer and part of the
                       next, in every format;
    ``"whole"``        ``None``: the whole update in one bucket.
    """
    if limit is None or isinstance(limit, int):
        return limit
    expert = 3 * spec.intermediate * spec.hidden * spec.dtype.itemsize
    if limit == "tensor":
        return 0
    if limit == "split_layer":
        return int(2.5 * expert)
    if limit == "multi_layer":
        return int(1.75 * spec.num_experts * expert)
    if limit == "whole":
        return None
    raise ValueError(f"unknown bucket limit {limit!r}; expected an int, None or one of "
                     f"{BUCKET_LIMITS}")


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
    """The ``path`` payload receiver ``rank`` gets, as one bucket (all but direct are rank
    independent)."""
    return senders.export(path, case.spec, case.receiver, rank, full, layers)


def stream(path, case, rank, full, bucket="split_layer", layers=None):
    """The ``path`` payload of ``layers`` (default all) for receiver ``rank`` as a bucket
    stream cut at ``bucket`` (a name of :data:`BUCKET_LIMITS`, an int or ``None``)."""
    return split_buckets(payload(path, case, rank, full, layers), bucket_bytes(bucket, case.spec))


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


def sync_and_check(case, path, version, receivers=None, full=None, bucket="split_layer"):
    """Send ``version`` along ``path`` to every receiver rank as a bucket stream cut at
    ``bucket`` (between ``begin_update()`` and ``end_update()``), then check every rank.
    Returns the receivers for further updates."""
    receivers = fresh_receivers(case) if receivers is None else receivers
    full = gathered_weights(case, version) if full is None else full
    for rec in receivers:
        before = compare.snapshot(rec.params)
        rec.begin_update()
        for chunk in stream(path, case, rec.rank, full, bucket):
            rec.load(chunk, load_format=LOAD_FORMAT[path])
        rec.end_update()
        check_rank(rec, case, version, before)
    return receivers
