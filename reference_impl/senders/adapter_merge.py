"""The merged LoRA path: the adapter merged into the base on the trainer, then an ordinary sync.

``W' = W + (alpha / r) * (B @ A)`` for every targeted linear, computed as a bf16 trainer merges
it: ``B @ A`` in float32, times the scaling in float32, added to ``W`` in float32, rounded once
to ``W``'s dtype (rounding ``B @ A`` to bf16 first, or scaling after the add, gives other bits;
the conformance suite names the pattern). Every input is checked - each targeted base weight and
both of its A and B present, shapes and dtypes as the adapter says - before anything is computed;
nothing is modified in place. The merged weights then travel as any checkpoint tensors do.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pytest_weightsync.reference_impl.errors import PayloadError
from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec, lora_params

__all__ = ["merge_adapter"]


def _checked(tensors: Mapping, name: str, shape: tuple, dtype, what: str) -> torch.Tensor:
    tensor = tensors.get(name)
    if not isinstance(tensor, torch.Tensor):
        raise PayloadError(f"{what} {name!r} is missing (got {type(tensor).__name__})")
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise PayloadError(f"{what} {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the "
                           f"adapter needs {tuple(shape)} {dtype}")
    return tensor


def merge_adapter(base: Mapping, tensors: Mapping, *, adapter: AdapterSpec) -> dict:
    """Base checkpoint name -> the merged weight, for every linear ``adapter`` targets."""
    params = lora_params(adapter)
    checked = []
    for param in params.values():
        out_dim, in_dim = param.b_shape[0], param.a_shape[1]
        w = _checked(base, param.base, (out_dim, in_dim), adapter.dtype, "base weight")
        a = _checked(tensors, param.a_name, param.a_shape, adapter.dtype, "lora_A")
        b = _checked(tensors, param.b_name, param.b_shape, adapter.dtype, "lora_B")
        checked.append((param.base, w, a, b))
    unknown = sorted(set(tensors) - {n for p in params.values() for n in (p.a_name, p.b_name)})
    if unknown:
        raise PayloadError(f"{len(unknown)} adapter tensors target no module of the adapter, "
                           f"first {unknown[0]!r}")
    scale = torch.tensor(adapter.scaling, dtype=torch.float32)
    return {name: (w.float() + torch.mm(b.float(), a.float()) * scale).to(w.dtype)
            for name, w, a, b in checked}
