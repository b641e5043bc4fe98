"""Skips ``gpu``-marked weightsync tests, with a reason naming what is missing, where CUDA is
absent. Only weightsync tests (:func:`pytest_weightsync.activation.is_weightsync_item`): a
foreign project's test with a ``gpu`` marker of its own keeps its meaning (it may run on
another accelerator, or check the device itself).

torch is imported only when a gpu-marked test is about to run, so a CPU-only session that
deselects them (``-m "not gpu"``) never pays for it.
"""

from __future__ import annotations

import functools

import pytest

from pytest_weightsync.activation import is_weightsync_item
from pytest_weightsync.vocabulary import SKIP_NO_DEVICE


class NoDevice(pytest.skip.Exception):
    """Skip: the test needs GPUs this machine does not have. A conformance verdict lists such
    cases as not run here without counting them as left out (nothing claimed was deselected:
    the hardware is absent), so a CPU machine can certify the CPU conformance set."""

    __module__ = "builtins"
    kind = SKIP_NO_DEVICE


@functools.lru_cache(maxsize=None)
def _visible_gpus() -> tuple[int, str]:
    """Return (count, why-zero) for the GPUs this process can use."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return 0, f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        built = getattr(torch.version, "cuda", None)
        if built is None:
            return 0, f"torch {torch.__version__} is a CPU-only build"
        return 0, f"CUDA is not available (torch {torch.__version__} built for CUDA {built}; no driver or device)"
    return torch.cuda.device_count(), ""


def required_gpus(item: pytest.Item) -> int | None:
    """Number of GPUs a test asks for through its ``gpu`` marker, or None if unmarked."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return None
    n = marker.kwargs.get("n", marker.args[0] if marker.args else 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: gpu marker needs a positive int n, got {n!r}")
    return n


def pytest_runtest_setup(item: pytest.Item) -> None:
    needed = required_gpus(item)
    if needed is None or not is_weightsync_item(item):
        return
    have, why = _visible_gpus()
    if have == 0:
        raise NoDevice(f"needs {needed} CUDA GPU(s): {why}", pytrace=False)
    if have < needed:
        raise NoDevice(f"needs {needed} CUDA GPUs, {have} visible", pytrace=False)
