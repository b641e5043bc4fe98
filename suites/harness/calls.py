"""Every call the suites make into an implementation, in one place.

Each call is bounded by the call time limit (:mod:`pytest_weightsync.deadline`): a hung
loader fails its test with the stack of the call instead of stopping the run. Optional
keywords (``pytest_weightsync.protocols.SIGNATURES``) reach only the methods that accept them.
"""

from __future__ import annotations

from pytest_weightsync.deadline import deadline
from pytest_weightsync.protocols import SIGNATURES, accepts_keyword


def call(impl, method: str, *args, **kwargs):
    """``impl.<method>(*args, **kwargs)`` under the call time limit; keywords the protocol
    marks optional are dropped for a method that does not take them."""
    fn = getattr(impl, method)
    optional = SIGNATURES.get(method, ((), (), ()))[2]
    for name in optional:
        if name in kwargs and not accepts_keyword(fn, name):
            del kwargs[name]
    with deadline(f"{getattr(impl, 'name', type(impl).__name__)}.{method}"):
        return fn(*args, **kwargs)


def call_optional(impl, method: str, *args, **kwargs):
    """:func:`call` when ``impl`` defines ``method`` (an optional hook), else nothing."""
    if callable(getattr(impl, method, None)):
        return call(impl, method, *args, **kwargs)
    return None
