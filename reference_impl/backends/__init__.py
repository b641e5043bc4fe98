"""Real third-party components the reference is checked against, and whether they import.

The suites compare the reference with code it did not write: Megatron-Core's MoE layers on
the trainer side and SGLang's ``FusedMoE.weight_loader`` on the receiver side. Both are
optional. :func:`probe` answers, with a reason, whether one imports here; where it does not,
:func:`receiver_loader` and :func:`trainer_source` name the reference path used instead, so a
CPU-only install still runs every property against the reference.

Nothing here imports an optional package at import time; :func:`probe` imports on demand.
The adapters read the model room (what the engine's parameter tree is) and nothing else of
the reference.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors", "model")

#: Backend name -> (module whose import proves the backend usable, distribution name).
#: The module is the one the suites actually use, not the top-level package: ``sglang``
#: alone imports on machines where the MoE layer module does not.
BACKEND_MODULES = {
    "megatron": ("megatron.core.transformer.moe.moe_layer", "megatron-core"),
    "sglang": ("sglang.srt.layers.moe.fused_moe_triton.layer", "sglang"),
    "transformer_engine": ("transformer_engine.pytorch", "transformer-engine"),
    # Not ``megatron.bridge``: its package __init__ imports AutoBridge -> peft -> Transformer
    # Engine and fails on CPU; the mapping module imports once that chain is bypassed (bridge.py).
    "megatron_bridge": ("megatron.bridge.models.conversion.param_mapping", "megatron-bridge"),
    "deep_ep": ("deep_ep", "deep-ep"),
}


#: Backend name -> "module:function" called before the import (e.g. to bypass a package
#: ``__init__`` that cannot import here); an exception it raises makes the backend unavailable.
_PREPARE = {
    "megatron_bridge": "pytest_weightsync.reference_impl.backends.bridge:register_namespace_packages",
}


class UnknownBackendError(ValueError):
    """A backend name that is not one of :data:`BACKEND_MODULES`."""


@dataclass(frozen=True)
class BackendStatus:
    """Whether an optional backend imports here, and if not, why.

    ``reason`` is a sentence fit for a skip message: it names the missing package and the
    import error, e.g. ``"sglang is not importable (No module named 'sglang')"``.
    """

    name: str
    module: str
    available: bool
    reason: str
    version: str | None = None


def _distribution_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe(name: str) -> BackendStatus:
    """Import the module that backend ``name`` needs and report the outcome.

    Any exception raised by the import (not only ImportError: a package may fail at import
    time for a missing driver or a mismatched dependency) makes the backend unavailable,
    with the exception's type and message in the reason.
    """
    try:
        module, dist = BACKEND_MODULES[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKEND_MODULES))}"
        ) from None
    try:
        if name in _PREPARE:
            prepare_module, _, prepare_function = _PREPARE[name].partition(":")
            getattr(importlib.import_module(prepare_module), prepare_function)()
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        detail = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ImportError) else str(exc)
        return BackendStatus(
            name=name,
            module=module,
            available=False,
            reason=f"{name} is not importable: import {module} failed ({detail})",
            version=_distribution_version(dist),
        )
    version = _distribution_version(dist)
    return BackendStatus(
        name=name,
        module=module,
        available=True,
        reason=f"{name} {version or '(version unknown)'} imports",
        version=version,
    )


@dataclass(frozen=True)
class Selection:
    """Which implementation plays a role, and why that one."""

    role: str
    implementation: str
    reason: str


def receiver_loader(status: BackendStatus) -> Selection:
    """The receiver-side loader to use given the SGLang probe result.

    With SGLang importable the real ``FusedMoE.weight_loader`` runs; without it the reference
    receiver (:mod:`pytest_weightsync.reference_impl.engine.receiver`) loads the payload instead.
    """
    if status.name != "sglang":
        raise ValueError(f"receiver_loader needs the 'sglang' probe, got {status.name!r}")
    if status.available:
        return Selection("receiver", "sglang", status.reason)
    return Selection("receiver", "reference", f"falling back to the reference receiver: {status.reason}")


def trainer_source(status: BackendStatus) -> Selection:
    """The trainer-side shard source to use given the Megatron-Core probe result.

    With Megatron-Core importable, shards are read from real MoE layers built in gloo ranks;
    without it, the reference's synthetic shards (:mod:`pytest_weightsync.reference_impl.oracle.synth`) stand in.
    """
    if status.name != "megatron":
        raise ValueError(f"trainer_source needs the 'megatron' probe, got {status.name!r}")
    if status.available:
        return Selection("trainer", "megatron", status.reason)
    return Selection("trainer", "reference", f"falling back to synthetic reference shards: {status.reason}")


__all__ = [
    "BACKEND_MODULES",
    "BackendStatus",
    "Selection",
    "UnknownBackendError",
    "probe",
    "receiver_loader",
    "trainer_source",
]
