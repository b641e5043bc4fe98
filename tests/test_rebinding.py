"""The in-rank storage check: a parameter moved to other storage, or replaced in the model,
is named "rebound"; values rewritten in place are not (that is the values check's job)."""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.distributed import (
    DistributedExportError,
    check_storage_unchanged,
    first_rebinding,
    storage_snapshot,
)


def _model():
    module = torch.nn.Linear(4, 3, bias=False)
    return [module], dict(module.named_parameters())


def test_in_place_writes_keep_the_storage():
    model, state = _model()
    before = storage_snapshot(state)
    with torch.no_grad():
        state["weight"].mul_(2)
    assert first_rebinding(before, state, model) is None


def test_reassigned_data_is_named_rebound():
    model, state = _model()
    before = storage_snapshot(state)
    state["weight"].data = state["weight"].data.clone()
    with pytest.raises(DistributedExportError, match=r"^call rebound owner's parameter weight: "
                                                     r"data_ptr 0x[0-9a-f]+ -> 0x[0-9a-f]+ "
                                                     r"\(param\.data reassigned"):
        check_storage_unchanged(before, state, model, call="call", owner="owner")


def test_a_transposed_rebinding_and_a_replaced_parameter_are_named():
    model, state = _model()
    before = storage_snapshot(state)
    state["weight"].data = state["weight"].data.t().contiguous().t()
    assert first_rebinding(before, state, model).startswith("weight: data_ptr")
    model, state = _model()
    before = storage_snapshot(state)
    model[0].weight = torch.nn.Parameter(state["weight"].detach().clone())
    assert "the model now holds another Parameter object" in first_rebinding(before, state, model)
