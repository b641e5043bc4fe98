"""Choosing a sync path a receiver can take, and saying why.

The fast paths need the receiver's cooperation: ``direct`` needs a rank-local load format and
a sender that can emit the receiver's exact layout (gate/up order, padded shape); ``packed``
needs the receiver to accept fused names in its gate/up order. When the requested path is not
possible the next compatible one is taken (direct -> packed -> compat), and the choice carries
the reason for every path it skipped, so a silent fallback can be reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_weightsync.protocols import FORMATS, Capabilities
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, WeightSyncError

# ``Capabilities`` is the one class of :mod:`pytest_weightsync.protocols`: path selection
# reads its ``formats`` (what the receiver accepts), ``orders`` (gate/up orders the fused
# paths can be produced in) and ``padded`` (whether padded direct buffers can be produced).
__all__ = ["Capabilities", "NoCompatiblePathError", "PathChoice", "select_path", "why_not"]


class NoCompatiblePathError(WeightSyncError):
    """No path, from the requested one down, is supported."""


@dataclass(frozen=True)
class PathChoice:
    path: str
    requested: str
    skipped: tuple = field(default=())  # (path, reason) for each path passed over

    @property
    def fell_back(self) -> bool:
        return self.path != self.requested

    def __str__(self) -> str:
        if not self.fell_back:
            return f"{self.path} (as requested)"
        why = "; ".join(f"{p}: {reason}" for p, reason in self.skipped)
        return f"{self.path} (fell back from {self.requested}: {why})"


def why_not(path: str, caps: Capabilities, receiver: ReceiverTopology):
    """Reason ``path`` is impossible for this receiver, or ``None`` when it is possible."""
    if path not in caps.formats:
        return f"receiver does not accept the {path} format (accepts {sorted(caps.formats)})"
    if path in ("direct", "packed") and receiver.order not in caps.orders:
        return (f"receiver gate/up order {receiver.order!r} cannot be produced "
                f"(supported: {sorted(caps.orders)})")
    if path == "direct" and receiver.padded and not caps.padded:
        return (f"receiver buffers are padded (intermediate_padded="
                f"{receiver.intermediate_padded}) and padded direct export is unsupported")
    return None


def select_path(requested: str, caps: Capabilities, receiver: ReceiverTopology) -> PathChoice:
    """The first possible path from ``requested`` down :data:`~pytest_weightsync.vocabulary.FORMATS`, with reasons."""
    if requested not in FORMATS:
        raise WeightSyncError(f"unknown sync path {requested!r}; expected one of {FORMATS}")
    skipped = []
    for path in FORMATS[FORMATS.index(requested):]:
        reason = why_not(path, caps, receiver)
        if reason is None:
            return PathChoice(path, requested, tuple(skipped))
        skipped.append((path, reason))
    raise NoCompatiblePathError(
        f"no sync path from {requested!r} down is possible: "
        + "; ".join(f"{p}: {r}" for p, r in skipped))
