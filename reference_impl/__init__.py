"""The reference weight sync from Megatron-Core trainers to SGLang (and vLLM-style) engines.

The yardstick other implementations are measured against, in rooms by role (the plan is
``docs/architecture.md``):

==============  ==========================================================================
``model/``      what a model is: the expert layout and ownership math, whole-model specs,
                engine layouts, the FP8 block layout and quantizer
``oracle/``     expected values, computed at layout coordinates: never from a sender's or
                a receiver's code
``trainer/``    the trainer side as Megatron-Core / TE build it, and the gathers over it
``senders/``    payload formats and exporters (single process, distributed, colocated)
``sharing/``    how a tensor's memory is shared between processes (IPC handles, shared payloads)
``engine/``     receivers as SGLang builds them, and the receiver process
``serving/``    a model served while it is refitted: scheduler, prefix cache, control planes
``kernels/``    copy machinery every room may use (planned copies, Triton kernels)
``rl/``         inline-logprob eligibility and loss inputs
``backends/``   adapters to the real Megatron-Core, Megatron-Bridge and SGLang
==============  ==========================================================================

At this level: :mod:`.errors` (the error hierarchy every room derives from) and :mod:`.impl`
(``ReferenceImplementation``, the registered entry point ``reference``). The names below are
exported lazily, so ``import pytest_weightsync.reference_impl`` stays cheap and torch is
imported only when a tensor-level name is first used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "MoESpec": "model.layout",
    "TrainerTopology": "model.layout",
    "ReceiverTopology": "model.layout",
    "ExpertWeights": "model.layout",
    "TopologyError": "model.layout",
    "receiver_shard": "model.layout",
    "trainer_shard": "model.layout",
    "locate_receiver_element": "model.locate",
    "ModelSpec": "model.model_spec",
    "WeightSyncError": "errors",
    "PayloadError": "errors",
    "ReferenceReceiver": "engine.receiver",
    "ModelReceiver": "engine.model_receiver",
    "select_path": "senders.select",
    "Capabilities": "senders.select",
    "copy_pairs": "kernels.fastcopy",
    "inline_logprob_eligibility": "rl.inline_logprob",
    "ReferenceImplementation": "impl",
}
#: The rooms, in the order a reader meets them (``docs/architecture.md``).
ROOMS = ("model", "oracle", "trainer", "senders", "sharing", "engine", "serving", "kernels",
         "rl", "backends")

__all__ = sorted(_EXPORTS) + list(ROOMS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        value = getattr(module, name)
    elif name in ROOMS:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
