"""Where am I? The rank context of the current process.

Code under test sometimes needs to know whether it runs inside a rank and which one (to pick
a device, to shard an input) without threading the numbers through every call. The launcher
sets the context once per rank process, right after the process group is up, so reading it is
a plain attribute access and never imports torch.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RankContext:
    """The identity of one rank: its place in the world and the device it should use.

    ``device`` is a string (``"cpu"`` or ``"cuda:<i>"``) so the context stays importable and
    comparable without torch; pass it to ``torch.device`` where a device object is needed.
    ``launcher`` says who started the rank: ``"pool"`` (spawned by :class:`RankPool`) or
    ``"torchrun"`` (an external launcher, run in-process).
    """

    rank: int
    world_size: int
    backend: str
    device: str
    launcher: str = "pool"


_current: RankContext | None = None


def current() -> RankContext | None:
    """The :class:`RankContext` of this process, or None outside any rank."""
    return _current


def _set_current(context: RankContext | None) -> None:
    global _current
    _current = context
