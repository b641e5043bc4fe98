"""What the whole-model suites hand implementations, and how they drive an update.

Engine parameters are every parameter of an engine rank (``model_layout.engine_params``: the
served model and its draft), poisoned before every test. Payloads come from the reference
whole-model senders over the synthetic checkpoint; trainer states from the trainer-side
oracle (``megatron_model``). Expected states come from the value function at layout
coordinates (``model_synth.expected_engine_params``).
"""

from __future__ import annotations


from pytest_weightsync.reference_impl.trainer import megatron_model
from pytest_weightsync.reference_impl.senders import model_senders
from pytest_weightsync.reference_impl.oracle import model_synth, synth
from pytest_weightsync.reference_impl.senders.buckets import split_buckets
from pytest_weightsync.reference_impl.model.model_layout import engine_params as layout_params

from . import calls, inputs
from .memo import memo


@memo(16)
def weights(spec, version):
    """The synthetic checkpoint of ``spec`` at ``version`` (read only)."""
    return model_synth.full_model(spec, version)


def expected_uncached(case, rank, version):
    return model_synth.expected_engine_params(case.spec, case.receiver, rank, version)


@memo(64)
def expected(case, rank, version):
    """What engine ``rank`` holds after a complete update of every target to ``version``."""
    return expected_uncached(case, rank, version)


@memo(64)
def _poisoned(spec, receiver, rank) -> dict:
    import torch

    params = {name: torch.empty(p.shape, dtype=p.dtype)
              for name, p in layout_params(spec, receiver, rank).items()}
    for tensor in params.values():
        synth.poison_(tensor)
    return params


def engine_params(case, rank) -> dict:
    """Engine ``rank``'s whole parameter tree, every tensor poisoned (fresh tensors)."""
    return {name: t.clone() for name, t in _poisoned(case.spec, case.receiver, rank).items()}


def bucket_bytes(limit, spec):
    """A named bucket limit (``suites/harness/inputs.py``) sized by the model's experts."""
    return inputs.bucket_bytes(limit, spec.experts)


def payload(fmt, case, rank, version, *, full=None):
    """The whole-model ``fmt`` payload of the case's targets for engine ``rank``, as fresh
    tensors (a loader that scribbles on its input cannot corrupt the next test's)."""
    full = weights(case.spec, version) if full is None else full
    chunk = model_senders.export(fmt, case.spec, case.receiver, rank, full, case.targets)
    return [(name, tensor.clone()) for name, tensor in chunk]


def stream(fmt, case, rank, version, *, bucket=inputs.DEFAULT_BUCKET, full=None):
    """:func:`payload` cut into buckets at ``bucket``."""
    return split_buckets(payload(fmt, case, rank, version, full=full),
                         bucket_bytes(bucket, case.spec))


def load_stream(impl, params, stream, fmt, case, rank) -> None:
    """One framed whole-model update through ``impl`` (``targets`` reaches the methods that
    take it)."""
    kwargs = dict(format=fmt, spec=case.spec, topology=case.receiver, rank=rank,
                  targets=case.targets)
    calls.call_optional(impl, "begin_update", params, **kwargs)
    for bucket in stream:
        calls.call(impl, "load_weights", params, list(bucket), **kwargs)
    calls.call_optional(impl, "end_update", params, **kwargs)


def load(impl, params, fmt, case, rank, version, *, bucket=inputs.DEFAULT_BUCKET) -> None:
    load_stream(impl, params, stream(fmt, case, rank, version, bucket=bucket), fmt, case, rank)


@memo(16)
def _trainer_states(case, version):
    return megatron_model.trainer_model_states(case.spec, case.trainer,
                                               model_synth.full_model(case.spec, version))


def trainer_states(case, version) -> list:
    """Every trainer rank's whole Megatron state dict of ``version``, as fresh tensors (an
    exporter that writes into a shard cannot reach the cached ones)."""
    return [{name: t.clone() for name, t in state.items()}
            for state in _trainer_states(case, version)]


@memo(128)
def owed(case, rank, fmt, version) -> tuple:
    """``(name, tensor)`` of every tensor a whole-model ``fmt`` update of ``case.targets``
    owes engine ``rank`` (the reference senders' payload; read only)."""
    return tuple(model_senders.export(fmt, case.spec, case.receiver, rank,
                                      weights(case.spec, version), case.targets))
