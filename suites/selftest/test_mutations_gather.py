"""Planted bugs in the component gather are caught by its suite's own tests, located.

Each mutant replaces one function of
:mod:`pytest_weightsync.reference_impl.trainer.component_gather` with a realistic wrong version and
runs an unchanged test function of ``test_component_gather``; the failure must name the
first wrong row, its component and the TP rank's block it came from.
"""

from __future__ import annotations

import pytest
import torch

from . import test_component_gather as suite
from pytest_weightsync.reference_impl.trainer import component_gather as cg

pytestmark = pytest.mark.weightsync_property("mutation_detected")

LOCATED = r"row \d+ \(component '[^']+', row \d+ of TP rank \d+'s block\)"


def shard_major(shards, layout):
    """Every rank's shard concatenated rank after rank (shard-major, not component-major)."""
    split = [cg.split_components(s, layout, len(shards)) for s in shards]
    return torch.cat([split[r][c] for r in range(len(shards)) for c in range(len(layout.sizes))])


def off_by_one_split(shard, layout, tp):
    """Component boundaries one row late: the first component takes a row of the second."""
    sizes = list(cg._check_shard(shard, layout, tp, "shard"))
    sizes[0] += 1
    sizes[-1] -= 1
    return tuple(torch.split(shard, sizes, dim=0))


@pytest.mark.parametrize("name", ["gdn_in_proj", "qkv"])
@pytest.mark.parametrize("mutant, attr", [(shard_major, "assemble_components"),
                                          (off_by_one_split, "split_components")],
                         ids=["shard_major", "off_by_one_split"])
def test_component_gather_mutant_is_located(monkeypatch, mutant, attr, name):
    monkeypatch.setattr(cg, attr, mutant)
    monkeypatch.setattr(suite, attr, mutant, raising=False)
    with pytest.raises(AssertionError, match=LOCATED):
        suite.test_single_process_assembly_restores_the_unsharded_tensor(name, 2)
