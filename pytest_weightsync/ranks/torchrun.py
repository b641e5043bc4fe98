"""Running under an external launcher (``torchrun``, ``srun`` with env rendezvous).

When every pytest process is already one rank of a job, spawning more ranks would be wrong:
the tests must run in the job's own process group. This module detects that case from the
environment, joins the group once (``env://``), and runs ``rank_pool`` functions locally,
gathering every rank's outcome with ``all_gather_object`` so every process sees the same
results - or the same error.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, Callable

from pytest_weightsync.ranks import context as _context
from pytest_weightsync.ranks.errors import RankFailed, RankOutcome, RankSkipped

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def active(environ=None) -> bool:
    """True when RANK, WORLD_SIZE and MASTER_ADDR are all set: an external launcher runs us."""
    environ = os.environ if environ is None else environ
    return all(environ.get(name) for name in _REQUIRED)


def world_size(environ=None) -> int:
    environ = os.environ if environ is None else environ
    return int(environ["WORLD_SIZE"])


def ensure_initialized(backend: str) -> None:
    """Join the launcher's process group once; later calls (and other tests) reuse it.

    ``backend`` is ``gloo``, ``nccl`` or ``auto``; auto uses NCCL for CUDA tensors and gloo
    for CPU tensors in one group (``cpu:gloo,cuda:nccl``) where CUDA is available, since
    tests of one session mix both.
    """
    import torch
    import torch.distributed as dist

    device = "cpu"
    if not dist.is_initialized():
        if backend == "auto":
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if "nccl" in backend:
            count = torch.cuda.device_count()
            if count == 0:
                raise RuntimeError(
                    f"backend {backend!r} needs a CUDA GPU, this torchrun rank sees none "
                    f"(RANK={os.environ['RANK']}, "
                    f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
                )
            local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % count
            torch.cuda.set_device(local)
        dist.init_process_group(backend, init_method="env://")
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        device = f"cuda:{torch.cuda.current_device()}"
    if _context.current() is None:
        _context._set_current(
            _context.RankContext(
                dist.get_rank(), dist.get_world_size(), str(dist.get_backend()), device, "torchrun"
            )
        )


def run_local(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list:
    """Run ``fn`` in this rank and gather every rank's result (or error) to every rank."""
    import torch.distributed as dist

    try:
        outcome = ("ok", fn(*args, **kwargs))
    except BaseException as exc:
        outcomes = sys.modules.get("_pytest.outcomes")
        if outcomes is not None and isinstance(exc, outcomes.Skipped):
            outcome = ("skip", str(exc.msg))
        else:
            # The pool's own formatting: an exception whose __str__ raises is still reported
            # (by type and repr) instead of breaking this rank out of the gather below.
            from pytest_weightsync.ranks.worker import _format, _summary

            outcome = ("error", _summary(exc), _format(exc))
    try:
        pickle.dumps(outcome)
    except Exception as exc:
        outcome = ("error", f"its return value cannot be pickled: {exc}", "")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    errors = [
        RankOutcome(rank, "error", o[1], o[2]) for rank, o in enumerate(gathered) if o[0] == "error"
    ]
    if errors:
        name = getattr(fn, "__qualname__", repr(fn))
        raise RankFailed(
            f"{len(errors)} of {len(gathered)} ranks failed in {name} (torchrun world)", errors
        )
    for rank, o in enumerate(gathered):
        if o[0] == "skip":
            raise RankSkipped(o[1], rank)
    return [o[1] for o in gathered]
