"""Driving a loader (``load_weights``) through an update, as an engine's update path does.

An update is a bucket stream, one ``load_weights`` call per bucket, framed by the loader's
optional ``begin_update`` / ``end_update`` hooks (``pytest_weightsync.protocols``). A partial
update (``layers`` given) is not an update of the whole model, so it is sent unframed.
"""

from __future__ import annotations

from . import calls, inputs


def load_stream(impl, params, stream, fmt, case, rank, *, framed=True) -> None:
    """Load ``stream`` (a list of buckets) into ``params`` through ``impl``."""
    kwargs = dict(format=fmt, spec=case.spec, topology=case.receiver, rank=rank)
    if framed:
        calls.call_optional(impl, "begin_update", params, **kwargs)
    for bucket in stream:
        calls.call(impl, "load_weights", params, list(bucket), **kwargs)
    if framed:
        calls.call_optional(impl, "end_update", params, **kwargs)


def load(impl, params, fmt, case, rank, version, layers=None, *, bucket=inputs.DEFAULT_BUCKET):
    """Send ``version`` (of ``layers``, default all) to ``impl`` as a bucket stream cut at
    ``bucket``; a full update is framed by the loader's hooks."""
    stream = inputs.stream(fmt, case, rank, version, layers, bucket=bucket)
    load_stream(impl, params, stream, fmt, case, rank, framed=layers is None)
