"""The root of every error the project raises on bad input.

It lives in a module of its own, free of torch, so torch-free modules (``fastcopy``,
``inline_logprob``) can derive their errors from it without making a plugin import pull torch
in. :mod:`pytest_weightsync.reference_impl.model.layout` re-exports it under the same name.
"""

from __future__ import annotations


#: Longest name (characters) quoted in an error message; longer ones are cut with an ellipsis.
MAX_NAME_CHARS = 200


def shown(name) -> str:
    """``repr`` of a name for a message, cut to :data:`MAX_NAME_CHARS` characters."""
    if isinstance(name, (str, bytes)) and len(name) > MAX_NAME_CHARS:
        return f"{name[:MAX_NAME_CHARS]!r}... ({len(name)} chars)"
    return repr(name)


class WeightSyncError(ValueError):
    """Base of every error the reference implementation raises on bad input (a
    :class:`ValueError`, so callers that catch ``ValueError`` keep working)."""


class PayloadError(WeightSyncError):
    """A payload bucket a receiver refuses; nothing of it was written. The message names the
    entry index and the reason."""
