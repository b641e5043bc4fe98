"""The engines' answers to a bucket posted to every receiver rank at once.

A sender posts a bucket to every engine rank (``ReceiverProcess.post_update``) so the ranks
load side by side, and collects the answers later. Every answer must be taken before the
first error is raised - an engine left with an answer pending refuses its next request - and a
failed update must still take every answer due before it unwinds (:func:`drain`).
"""

from __future__ import annotations

from typing import Sequence


def collect(engines: Sequence) -> list:
    """Every pending engine's answer; then the first error raised, if one was."""
    reports = []
    error = None
    for engine in engines:
        if not engine.pending:
            continue
        try:
            reports.append(engine.result())
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    return reports


def drain(engines: Sequence) -> None:
    """Take every answer still due, ignoring errors: a failed update's unwinding, where the
    error already on its way is the one to report."""
    for engine in engines:
        if engine.pending:
            try:
                engine.result()
            except Exception:
                pass
