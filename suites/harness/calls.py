"""Every call the suites make into an implementation, in one place.

Each call goes through the boundary of the pytest process (:mod:`pytest_weightsync.boundary`):
it is bounded by the call time limit (:mod:`pytest_weightsync.deadline`), so a hung loader
fails its test with the stack of the call instead of stopping the run, and whatever it raises
that would reach past its test (``SystemExit``, a ``KeyboardInterrupt`` of its own, a
``pytest.skip``) fails the test instead. A timed-out call counts against its implementation,
which is cut off after ``--weightsync-max-call-timeouts`` of them
(:mod:`pytest_weightsync.cutoff`): a call into a cut-off implementation is not made, its test
is reported as not run. Optional keywords (``pytest_weightsync.protocols.SIGNATURES``) reach
only the methods that accept them.
"""

from __future__ import annotations

from pytest_weightsync import boundary, cutoff
from pytest_weightsync.deadline import CallTimeoutError
from pytest_weightsync.protocols import SIGNATURES, accepts_keyword


def call(impl, method: str, *args, **kwargs):
    """``impl.<method>(*args, **kwargs)`` at the boundary (see the module docstring);
    keywords the protocol marks optional are dropped for a method that does not take them."""
    fn = getattr(impl, method)
    optional = SIGNATURES.get(method, ((), (), ()))[2]
    for name in optional:
        if name in kwargs and not accepts_keyword(fn, name):
            del kwargs[name]
    name = getattr(impl, "name", type(impl).__name__)
    cutoff.check(name)
    what = f"{name}.{method}"
    try:
        return boundary.run(what, fn, *args, **kwargs)
    except CallTimeoutError:
        cutoff.strike(name, what)
        raise


def call_optional(impl, method: str, *args, **kwargs):
    """:func:`call` when ``impl`` defines ``method`` (an optional hook), else nothing."""
    if callable(getattr(impl, method, None)):
        return call(impl, method, *args, **kwargs)
    return None
