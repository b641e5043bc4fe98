"""One record per model family: every fact that differs between Qwen3-MoE and Qwen3.5-MoE.

A whole model's layouts - its checkpoint (:mod:`..model_spec`), SGLang's and vLLM's engine
parameters (:mod:`..model_layout`, :mod:`..vllm_layout`), the Megatron trainer's
(``trainer/megatron_model``, ``trainer/megatron_whole``) and SGLang's real model tree
(``backends/sglang_model_tree``) - are one piece of code for every family; what a family
changes is read from its :class:`ModelFamily` record, so adding a family is its record (one
module here), its section of ``docs/model-families.md`` and its tests - no branch elsewhere.

The builtin records are :data:`~pytest_weightsync.vocabulary.MODEL_FAMILIES`' words
(``qwen3_moe``, ``qwen3_5_moe``); :func:`registered` adds a test-only one for a block.
Plain data, no torch: the model room's other modules read it, and so may anyone.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from pytest_weightsync.reference_impl.model.families import qwen3_5_moe as _q35
from pytest_weightsync.reference_impl.model.families import qwen3_moe as _q3
from pytest_weightsync.reference_impl.model.families.record import (
    LAYER_RULES,
    ModelFamily,
    UnknownModelFamily,
)

__all__ = ["LAYER_RULES", "ModelFamily", "UnknownModelFamily", "get", "is_registered", "names",
           "register", "registered", "unregister"]

_REGISTRY: dict[str, ModelFamily] = {}


def register(record: ModelFamily) -> ModelFamily:
    """Add ``record`` under its name (a name may hold one record)."""
    if not isinstance(record, ModelFamily):
        raise UnknownModelFamily(f"a model family must be a ModelFamily (got {record!r})")
    if record.name in _REGISTRY:
        raise UnknownModelFamily(f"model family {record.name!r} is already registered")
    _REGISTRY[record.name] = record
    return record


def unregister(name: str) -> None:
    """Remove a non-builtin record (a builtin one stays: every suite reads it)."""
    if name in _BUILTIN:
        raise UnknownModelFamily(f"model family {name!r} is builtin and stays registered")
    _REGISTRY.pop(name, None)


@contextlib.contextmanager
def registered(record: ModelFamily) -> Iterator[ModelFamily]:
    """``record`` registered for the block (test-only families). Layouts are cached per
    spec, so a name is best used for one record per process."""
    register(record)
    try:
        yield record
    finally:
        unregister(record.name)


def get(name: str) -> ModelFamily:
    """The record of family ``name``; :class:`UnknownModelFamily` for an unknown name."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownModelFamily(f"unknown model family {name!r}: registered families are "
                                 f"{names()}") from None


def is_registered(name) -> bool:
    """Whether ``name`` has a record (``ModelSpec`` validation asks without catching)."""
    return isinstance(name, str) and name in _REGISTRY


def names() -> tuple:
    """Registered family names, builtins first (``MODEL_FAMILIES`` order)."""
    return tuple(_REGISTRY)


for _record in (_q3.RECORD, _q35.RECORD):
    register(_record)
_BUILTIN = frozenset(_REGISTRY)
