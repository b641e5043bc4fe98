"""The root of every error the project raises on bad input.

It lives in a module of its own, free of torch, so torch-free modules (``fastcopy``,
``inline_logprob``) can derive their errors from it without making a plugin import pull torch
in. :mod:`pytest_weightsync.reference_impl.layout` re-exports it under the same name.
"""

from __future__ import annotations


class WeightSyncError(ValueError):
    """Base of every error the reference implementation raises on bad input (a
    :class:`ValueError`, so callers that catch ``ValueError`` keep working)."""


class PayloadError(WeightSyncError):
    """A payload bucket a receiver refuses; nothing of it was written. The message names the
    entry index and the reason."""
