"""Which tensors' bytes can be read as plain memory: the one rule the judge and the reference share.

Reading a tensor's elements straight out of its storage (``copy_``, ``torch.cat(out=)``,
integer views of the bits, an engine viewing a flattened bucket's bytes) is only meaningful,
and only safe, for a dense tensor that owns readable memory: a plain ``torch.Tensor`` or an
``nn.Parameter`` over one. Everything else that still passes ``isinstance(t, torch.Tensor)``
fails somewhere inside the copy, after earlier copies already ran, or worse:

* tensor subclasses: ``DTensor`` (what FSDP2 trainers hold: ``copy_`` into a plain tensor
  raises "mixed torch.Tensor and DTensor"), ``FakeTensor`` (no data at all, from
  ``FakeTensorMode`` / ``torch.compile`` tracing), wrapper subclasses, uninitialized lazy
  parameters; functionalized and functorch-wrapped tensors are plain ``Tensor`` objects whose
  storage is not their data;
* nested tensors (``torch.nested``): strided layout, but ``shape`` itself raises;
* lazy negation / conjugation views (``_neg_view``, ``conj()``): the stored bits are not the
  values, and bit views of them raise;
* storage that was freed (``untyped_storage().resize_(0)``, what FSDP resharding and CPU
  offloading do to a parameter's flat buffer) or is smaller than the view: reading it is a
  use after free, and a bucket copied with ``torch.cat`` segfaults the process.

The rule lives in the plugin because the judge needs it (:mod:`pytest_weightsync.wire` refuses
a flattened bucket whose bytes cannot be read) and the judge imports nothing it judges; the
reference receiver words the same problems as its own payload errors
(``reference_impl/engine/tensor_checks.py``). :func:`kind_problem` is asked first (it needs
nothing but the tensor's type and flags; a nested tensor's ``shape`` would raise),
:func:`storage_problem` after the device check (a meta tensor is a wrong device, not a freed
one). Both return ``(kind, reason)``: ``kind`` one of :data:`KINDS`, ``reason`` the sentence a
message carries. Plugin modules import this one lazily (it imports torch).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

__all__ = ["KINDS", "PLAIN_TYPES", "Problem", "kind_problem", "storage_problem", "view_bytes"]

#: The only tensor types whose bytes are read directly.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

#: What a problem is about: a subclass or wrapper, a nested tensor, a lazy neg/conj view, or
#: storage that was freed or shrunk.
KINDS = ("subclass", "nested", "lazy_view", "storage")

Problem = Optional[tuple[str, str]]


def _type_name(tensor) -> str:
    cls = type(tensor)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_dtensor(tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # loaded whenever a DTensor exists
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(tensor, cls)


def _is_fake(tensor) -> bool:
    module = sys.modules.get("torch._subclasses.fake_tensor")
    cls = getattr(module, "FakeTensor", None) if module is not None else None
    return cls is not None and isinstance(tensor, cls)


def _subclass_reason(tensor) -> str:
    if _is_dtensor(tensor):
        placements = getattr(tensor, "placements", None)
        return (f"a DTensor (torch.distributed.tensor, placements {placements}): its local "
                f"shard is not the tensor; send full_tensor() (or the shard a per-rank format "
                f"asks for, as a plain tensor)")
    if _is_fake(tensor):
        return ("a FakeTensor (FakeTensorMode / torch.compile tracing): it has no data; "
                "export outside the fake mode")
    if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
        return f"an uninitialized lazy parameter ({_type_name(tensor)}): it has no data yet"
    return (f"a tensor subclass ({_type_name(tensor)}); only plain torch.Tensor and "
            f"nn.Parameter can be loaded (their bytes are read directly): send "
            f"torch.Tensor(...) of its data")


def kind_problem(tensor: torch.Tensor) -> Problem:
    """Why ``tensor`` is no plain dense tensor, from its type and flags only; ``None`` if it is."""
    if type(tensor) not in PLAIN_TYPES:
        return "subclass", _subclass_reason(tensor)
    if torch._is_functional_tensor(tensor):
        return ("subclass", "a functionalized tensor (a wrapper whose storage is not its "
                            "data); send the tensor outside functionalization")
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return ("subclass", "a functorch-wrapped tensor (inside vmap / grad transforms); "
                            "send the tensor outside the transform")
    if tensor.is_nested:
        return ("nested", "a nested tensor (torch.nested): it has no single shape; send each "
                          "component as its own tensor")
    if tensor.is_neg():
        return ("lazy_view", "a lazy negation view (is_neg()): its stored bits are the negated "
                             "values; send tensor.resolve_neg()")
    if tensor.is_conj():
        return ("lazy_view", "a lazy conjugation view (is_conj()): its stored bits are the "
                             "unconjugated values; send tensor.resolve_conj()")
    return None


def view_bytes(tensor: torch.Tensor) -> int:
    """Bytes of storage the view needs: up to one past its furthest element (0 when empty)."""
    if tensor.is_contiguous():  # its furthest element is numel - 1 past its offset
        return (tensor.storage_offset() * tensor.element_size() + tensor.nbytes
                if tensor.numel() else 0)
    if tensor.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return (tensor.storage_offset() + span) * tensor.element_size()


def storage_problem(tensor: torch.Tensor) -> Problem:
    """Why ``tensor``'s storage cannot be read (freed, too small, no data); ``None`` if it can.
    Call it on plain dense tensors (after :func:`kind_problem`) off the meta device."""
    needed = view_bytes(tensor)
    if needed == 0:
        return None
    try:
        storage = tensor.untyped_storage()
        held = storage.nbytes()
        address = storage.data_ptr()
    except (RuntimeError, NotImplementedError) as exc:
        return "storage", f"its storage cannot be read ({type(exc).__name__}: {exc})"
    if held == 0 or address == 0:
        return ("storage",
                f"its storage was freed ({held} bytes left, the view needs {needed}; e.g. "
                f"untyped_storage().resize_(0) by FSDP resharding or CPU offloading): reading "
                f"it would be a use after free")
    if held < needed:
        return ("storage",
                f"its storage holds {held} bytes but the view (storage offset "
                f"{tensor.storage_offset()}, shape {tuple(tensor.shape)}, strides "
                f"{tensor.stride()}) reaches byte {needed}: the storage was shrunk under it")
    return None
