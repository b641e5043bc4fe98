"""The whole-model trainer state's own rules, without ranks: names, fills, uneven stages.

The real build runs in ranks (``suites/conformance/test_model_distributed.py``); these are the
parts that must fail loudly or agree with the layout on their own: a real tensor the oracle
does not hold, a shape or dtype that differs, an oracle tensor the model lacks; the stages of
an uneven pipeline; the MTP stage's copy of the embedding.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.reference_impl.trainer import megatron_whole
from pytest_weightsync.reference_impl.model.layout import TopologyError, TrainerTopology, stage_layers
from pytest_weightsync.reference_impl.trainer.megatron_model import trainer_params
from pytest_weightsync.reference_impl.trainer.megatron_state import MegatronPlacementError
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe

NORM = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"


def _state(**shapes):
    return {f"module.module.{name}": torch.zeros(shape, dtype=torch.bfloat16)
            for name, shape in shapes.items()}


def test_local_spec_names_map_to_the_oracle():
    assert megatron_whole.modelled_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert megatron_whole.modelled_name("decoder.final_layernorm.weight") == \
        "decoder.final_layernorm.weight"


def test_the_fill_writes_in_place_and_fails_loudly_on_any_disagreement():
    state = _state(**{"decoder.layers.0.input_layernorm.weight": (4,)})
    target = next(iter(state.values()))
    megatron_whole.write_model(state, {NORM: torch.ones(4, dtype=torch.bfloat16)}, rank=1)
    assert torch.equal(target, torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(MegatronPlacementError, match=r"rank 1: .*input_layernorm.weight is "
                                                     r"\(4,\) torch.bfloat16 .* \(5,\)"):
        megatron_whole.write_model(state, {NORM: torch.ones(5, dtype=torch.bfloat16)}, rank=1)
    with pytest.raises(MegatronPlacementError, match="torch.float32"):
        megatron_whole.write_model(state, {NORM: torch.ones(4)}, rank=1)
    with pytest.raises(MegatronPlacementError, match="has no parameter for the oracle's"):
        megatron_whole.write_model(state, {NORM: torch.ones(4, dtype=torch.bfloat16),
                                           "decoder.final_layernorm.weight": torch.ones(4)},
                                   rank=1)
    with pytest.raises(MegatronPlacementError, match="the oracle holds no tensor"):
        megatron_whole.write_model(state, {}, rank=1)


def test_uneven_stages_follow_megatrons_first_stage_split():
    topo = TrainerTopology(pp=2, ep=2, first_stage_layers=2)
    assert stage_layers(3, topo) == (range(0, 2), range(2, 3))
    assert stage_layers(4, TrainerTopology(pp=2)) == (range(0, 2), range(2, 4))
    stages = {p.name: p.stage for p in trainer_params(qwen3_moe(num_layers=3), topo)}
    assert stages["decoder.layers.1.mlp.router.weight"] == 0  # layer 1, stage 0
    assert "decoder.layers.2.mlp.router.weight" not in stages  # stage 1 numbers from 0
    with pytest.raises(TopologyError, match="split evenly"):
        stage_layers(4, TrainerTopology(pp=3, first_stage_layers=1))
    with pytest.raises(TopologyError, match="pp > 1"):
        TrainerTopology(first_stage_layers=1)


def test_the_mtp_stage_holds_a_copy_of_the_embedding_read_once():
    from pytest_weightsync.reference_impl.trainer.megatron_model import (
        EMBEDDING,
        is_shared_embedding_copy,
    )

    spec = qwen3_5_moe()  # untied, one MTP layer
    params = trainer_params(spec, TrainerTopology(pp=2))
    embeddings = [p for p in params if p.name == EMBEDDING]
    assert [p.stage for p in embeddings] == [0, 1]
    assert [is_shared_embedding_copy(spec, p) for p in embeddings] == [False, True]
    assert [p.stage for p in trainer_params(spec, TrainerTopology()) if p.name == EMBEDDING] \
        == [0]
    assert [p.stage for p in trainer_params(qwen3_5_moe(mtp_layers=0), TrainerTopology(pp=2))
            if p.name == EMBEDDING] == [0]


def test_every_built_in_case_runs_in_one_warm_pool():
    from ..harness.model_distributed import MODEL_DIST_CASES, WORLD

    assert {c.id: c.world for c in MODEL_DIST_CASES} == {c.id: WORLD for c in MODEL_DIST_CASES}


def test_the_built_in_cases_hold_every_trainer_topology_of_the_distributed_matrix():
    from ..harness.cases import DIST_CASES
    from ..harness.model_distributed import MODEL_DIST_CASES

    def grid(t):
        return t.tp, t.ep, t.etp, t.pp, t.expert_impl

    whole = {grid(c.case.trainer) for c in MODEL_DIST_CASES}
    assert {grid(c.trainer) for c in DIST_CASES} <= whole
    assert {(c.case.trainer.pp > 1, c.case.spec.tied, bool(c.case.spec.mtp_layers))
            for c in MODEL_DIST_CASES if c.case.trainer.pp > 1} >= {
        (True, True, True), (True, False, True), (True, True, False), (True, False, False)}


def test_the_built_in_cases_build_the_te_spec_and_keep_the_local_one():
    from pytest_weightsync.vocabulary import LAYER_SPECS

    from ..harness.model_distributed import MODEL_DIST_CASES

    specs = [c.layer_spec for c in MODEL_DIST_CASES]
    assert set(specs) == set(LAYER_SPECS)
    assert specs.count("te") > len(specs) // 2  # what real jobs build is the default
    assert all(c.id.endswith("-localspec") == (c.layer_spec == "local") for c in MODEL_DIST_CASES)


def test_an_exporter_that_reads_only_te_names_is_not_run_on_a_local_spec_case():
    from pytest_weightsync.protocols import Capabilities

    caps = Capabilities(layer_specs=frozenset({"te"}))
    assert caps.layer_spec_refusal("te") is None
    assert "built from the 'local' spec" in caps.layer_spec_refusal("local")
    with pytest.raises(ValueError):
        Capabilities(layer_specs=frozenset({"transformer_engine"}))
