"""Native checks that tensor objects are as they were: one C++ pass over a list.

Two caches trust tensor objects they checked before as long as each is still what it was: the
plan cache (a payload list of the very tensors of a validated bucket,
:mod:`~pytest_weightsync.reference_impl.engine.plan_cache`) and the parameters check
(:mod:`~pytest_weightsync.reference_impl.engine.checked_memo`). Comparing a Python tuple per
tensor costs a few microseconds each; torch has two private native passes that cost a tenth of
that: TorchDynamo's ``TensorGuards`` (type, dtype, device, sizes, strides, dispatch keys, what
a compiled graph checks of its inputs on every call) and the data-pointer comparison of
CUDA-graph trees. Both are private API: they are probed on first use and every caller keeps the
Python comparison they stand in for.
"""

from __future__ import annotations

from typing import Optional

import torch

#: ``PTRS_EQUAL(tensors, ptrs, indices)``: whether ``tensors[i].data_ptr() == ptrs[i]`` for
#: every ``i`` of ``indices`` (``None`` where this torch has none).
PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

#: Whether the native guard behaved as probed (``None``: not probed yet).
_GUARD_OK: Optional[bool] = None


def _probe(guards) -> bool:
    """The guard passes the tensors it was made from and fails a transposed, a cast, a resized
    one, one of another type and a lazy negation view of the same storage."""
    try:
        probe = [torch.zeros(2, 3), torch.zeros(4)]
        made = guards(*probe, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        return (made.check(*probe) is True
                and made.check(probe[0].t(), probe[1]) is False
                and made.check(probe[0], torch.nn.Parameter(probe[1])) is False
                and made.check(probe[0], probe[1].double()) is False
                and made.check(probe[0], torch.zeros(5)) is False
                and made.check(probe[0], probe[1]._neg_view()) is False)
    except Exception:  # a torch whose private API differs: the Python comparison stays
        return False


def native_metadata_guard(tensors: list):
    """A native check of ``tensors``' exact types, dtype, device, sizes, strides and dispatch
    keys as they are now (``guard.check(*tensors)``), or ``None`` where this torch has none
    that behaves as probed. It refuses a list that holds one object twice (graph inputs are
    distinct), so such a list gets none."""
    global _GUARD_OK
    guards = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                     "TensorGuards", None)
    if guards is None:
        return None
    if _GUARD_OK is None:
        _GUARD_OK = _probe(guards)
    if not _GUARD_OK or len(set(map(id, tensors))) != len(tensors):
        return None
    try:
        return guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:
        return None
