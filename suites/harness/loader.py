"""Driving a loader (``load_weights``) through an update, as an engine's update path does.

An update is a bucket stream, one ``load_weights`` call per bucket, framed by the loader's
optional ``begin_update`` / ``end_update`` hooks (``pytest_weightsync.protocols``). Every
bucket the harness sends a loader with hooks is inside a session (a loader may refuse
``load_weights`` outside one, as vLLM's worker does): a payload of part of the model
(:func:`load_part`) travels as the last buckets of a full update whose other layers carry the
bits the parameters already hold. A loader without hooks gets such a payload alone - for it,
each ``load_weights`` call stands alone.

Real senders reuse their buffers: the flattened bucket or IPC buffer of one bucket is refilled
with the next bucket's bytes as soon as the engine's ``load`` returns. With ``refill=True``
each bucket's tensors are overwritten (:func:`suites.harness.inputs.refill_`) right after
``load_weights`` returns, so a loader that keeps references and copies later (at
``end_update``) copies garbage; :func:`load_and_check` names that pattern.
"""

from __future__ import annotations

from pytest_weightsync import compare

from . import calls, inputs


def frames_updates(impl) -> bool:
    """Whether ``impl`` frames its updates (defines ``begin_update`` and ``end_update``)."""
    return all(callable(getattr(impl, m, None)) for m in ("begin_update", "end_update"))


def load_stream(impl, params, stream, fmt, case, rank, *, framed=True, refill=False,
                transport="tensors") -> None:
    """Load ``stream`` (a list of buckets) into ``params`` through ``impl``; with ``refill``,
    each bucket's tensors are overwritten as soon as its ``load_weights`` call returns. Each
    bucket is handed over on ``transport`` (one a loader may claim, e.g. ``flattened_bucket``:
    SGLang's flattened bucket), encoded by the transport itself; the refill overwrites every
    tensor the encoded bucket holds (a flattened bucket's one flat buffer)."""
    from pytest_weightsync import transports

    wire = transports.get(transport)
    kwargs = dict(format=fmt, spec=case.spec, topology=case.receiver, rank=rank)
    if framed:
        calls.call_optional(impl, "begin_update", params, **kwargs)
    for bucket in stream:
        item = list(bucket) if wire.name == transports.FALLBACK else \
            wire.encode([list(bucket)], engine_rank=rank, engine_tp=case.receiver.tp)[0]
        calls.call(impl, "load_weights", params, item, **kwargs)
        if refill:
            inputs.refill_(_held_tensors(item))
    if framed:
        calls.call_optional(impl, "end_update", params, **kwargs)


def _held_tensors(item) -> list:
    """``(name, tensor)`` of every tensor a bucket on the wire holds: its pairs, or a dict's
    tensor values (a flattened bucket's flat buffer)."""
    import torch

    if isinstance(item, dict):
        return [(k, v) for k, v in item.items() if isinstance(v, torch.Tensor)]
    return list(item)


def load(impl, params, fmt, case, rank, version, *, bucket=inputs.DEFAULT_BUCKET,
         refill=False, transport="tensors"):
    """Send ``version`` to ``impl`` as a full update: a bucket stream cut at ``bucket`` on
    ``transport``, framed by the loader's hooks."""
    stream = inputs.stream(fmt, case, rank, version, bucket=bucket)
    load_stream(impl, params, stream, fmt, case, rank, refill=refill, transport=transport)


def load_part(impl, params, fmt, case, rank, version, layers, *, held_version,
              bucket=inputs.DEFAULT_BUCKET) -> None:
    """Send ``version`` of ``layers`` only. A loader without hooks gets those buckets alone.
    A loader with hooks gets them inside a session: the LAST buckets of a full update whose
    other layers carry ``held_version`` - what ``params`` hold already (the caller loaded it
    in full before), so a correct loader changes nothing there, and whatever the part writes
    outside its layers stays visible (nothing is sent after it)."""
    part = inputs.stream(fmt, case, rank, version, layers, bucket=bucket)
    if not frames_updates(impl):
        load_stream(impl, params, part, fmt, case, rank, framed=False)
        return
    others = [layer for layer in range(case.spec.num_layers) if layer not in set(layers)]
    rest = inputs.stream(fmt, case, rank, held_version, others, bucket=bucket) if others else []
    load_stream(impl, params, [*rest, *part], fmt, case, rank)


def load_and_check(impl, params, fmt, case, rank, version, *, before, bucket,
                   previous_version=None, transport="tensors") -> None:
    """One full update of ``version`` whose buckets are refilled after each ``load_weights``
    returns, then judged (:func:`suites.harness.judge.check_rank`). When that fails and the
    same update, not refilled, into fresh buffers passes, the loader read a bucket's tensors
    after its ``load_weights`` call returned: the failure is named "deferred copy"."""
    from . import judge

    held = compare.snapshot(params) if previous_version is not None else None
    load(impl, params, fmt, case, rank, version, bucket=bucket, refill=True, transport=transport)
    try:
        judge.check_rank(params, case, rank, version, before, previous_version=previous_version)
    except judge.ConformanceError as error:
        if held is not None and not any(not compare.same_bits(params[name], record.copy)
                                        for name, record in held.records.items()):
            raise judge.ConformanceError(
                f"served by layout, values stale: {impl.name} took a full update to version "
                f"{version} - every tensor under the names, shapes and dtypes of the previous "
                f"one, into the same parameters at the same addresses, every element a new "
                f"value - and changed not one element of the {len(held.records)} parameters: "
                f"something keyed by layout (names, shapes, dtypes, addresses), not by "
                f"content, served version {previous_version}'s weights (vllm#59647)\n{error}",
                error.mismatch) from None
        fresh = inputs.receiver_params(case, rank)
        fresh_before = compare.snapshot(fresh)
        try:
            load(impl, fresh, fmt, case, rank, version, bucket=bucket, transport=transport)
            judge.check_rank(fresh, case, rank, version, fresh_before)
        except AssertionError:
            raise error from None
        raise judge.ConformanceError(
            f"deferred copy: {impl.name} read bucket tensors after its load_weights call "
            f"returned (it kept references and copied later without cloning); the same update "
            f"lands when the buckets are left alone, but a real sender refills its buffer for "
            f"the next bucket as soon as load returns (ms-swift#10204)\n{error}",
            error.mismatch) from None
