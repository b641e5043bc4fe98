"""Reference implementation of Megatron-Core -> SGLang MoE weight synchronization.

The yardstick other implementations are measured against: plain functions over tensors and
small frozen dataclasses, one module per capability (see docs/architecture.md). Names below
are exported lazily, so ``import pytest_weightsync.reference_impl`` stays cheap and torch is imported only when
a tensor-level name is first used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "MoESpec": "layout",
    "TrainerTopology": "layout",
    "ReceiverTopology": "layout",
    "ExpertWeights": "layout",
    "WeightSyncError": "layout",
    "TopologyError": "layout",
    "receiver_shard": "layout",
    "trainer_shard": "layout",
    "locate_receiver_element": "layout",
    "ReferenceReceiver": "receiver",
    "ModelSpec": "model_spec",
    "ModelReceiver": "model_receiver",
    "PayloadError": "receiver",
    "select_path": "select",
    "Capabilities": "select",
    "copy_pairs": "fastcopy",
    "inline_logprob_eligibility": "inline_logprob",
}
_MODULES = ("synth", "compat", "packed", "direct", "trainer", "receiver", "layout", "select",
            "fastcopy", "gather_plan", "bf16_gather", "component_gather", "inline_logprob",
            "loss_inputs", "model_spec", "model_layout", "model_synth", "model_senders",
            "model_receiver", "megatron_model")

__all__ = sorted(_EXPORTS) + list(_MODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        value = getattr(module, name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
