"""The whole-model engine layout is SGLang's: its real model classes, built on CPU, agree.

For each model and engine below, the real ``Qwen3MoeForCausalLM`` /
``Qwen3_5MoeForConditionalGeneration`` (and the MTP draft ``Qwen3_5ForCausalLMMTP``) are
constructed per engine rank in SGLang's runtime context
(:mod:`~pytest_weightsync.reference_impl.backends.sglang_model_tree`): their parameter tree
must be the layout's (names, shapes, dtypes: ``bind`` refuses any difference), and the real
``load_weights`` over a checkpoint stream must leave the very bits the reference whole-model
receiver leaves. Two facts of SGLang's loaders the row claims rest on are pinned too:
``Qwen3MoeForCausalLM.load_weights`` never fills ``lm_head`` from a tied checkpoint, and the
draft's ``load_weights`` takes only ``mtp.*`` tensors (and the shared embedding).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.models.qwen3_5", reason="sglang (Qwen3.5 model) is not importable")

import torch  # noqa: E402

from pytest_weightsync.compare import assert_bitwise_equal, snapshot  # noqa: E402
from pytest_weightsync.reference_impl.senders import model_senders  # noqa: E402
from pytest_weightsync.reference_impl.oracle import model_synth, synth
from pytest_weightsync.reference_impl.backends.sglang_model_tree import (  # noqa: E402
    SGLangPlacementError,
    build_engine_rank,
)
from pytest_weightsync.reference_impl.senders.buckets import split_buckets  # noqa: E402
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology  # noqa: E402
from pytest_weightsync.reference_impl.model.model_layout import engine_params  # noqa: E402
from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver  # noqa: E402
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe  # noqa: E402

pytestmark = [pytest.mark.weightsync_backend("sglang"),
              pytest.mark.weightsync_property("receiver_layout")]

VERSION = 9
CASES = [
    pytest.param(qwen3_moe(num_kv_heads=4), ReceiverTopology(tp=4), id="q3-kv4-tp4"),
    pytest.param(qwen3_5_moe(linear_k_heads=4, linear_v_heads=8), ReceiverTopology(tp=4, moe_ep=4),
                 id="q35-kv2-tp4-ep4"),
    pytest.param(qwen3_5_moe(tied=True, vocab=200), ReceiverTopology(tp=2, moe_ep=2, order="up_gate"),
                 id="q35-tied-tp2-ep2"),
    # 64 padded vocabulary rows do not divide by 3: SGLang pads to 64 x 3 (64 rows per rank)
    pytest.param(qwen3_moe(num_heads=6, intermediate=6), ReceiverTopology(tp=3), id="q3-kv1-tp3"),
]


def _poisoned(spec, engine, rank):
    params = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in engine_params(spec, engine, rank).items()}
    for t in params.values():
        synth.poison_(t)
    return params


@pytest.mark.parametrize("spec, engine", CASES)
def test_real_model_tree_and_load_weights_match_the_reference(spec, engine):
    weights = model_synth.full_model(spec, VERSION)
    for rank in range(engine.tp):
        real = build_engine_rank(spec, engine, rank)
        for fmt in ("compat", "direct"):
            params = _poisoned(spec, engine, rank)
            real.bind(params)  # raises on any name, shape or dtype SGLang and the layout disagree on
            for bucket in split_buckets(model_senders.export(fmt, spec, engine, rank, weights), 512):
                real.load(bucket, "direct" if fmt == "direct" else None, spec.targets)
            reference = ModelReceiver(spec, engine, rank)
            reference.begin_update()
            reference.load(model_senders.export(fmt, spec, engine, rank, weights),
                           "direct" if fmt == "direct" else None)
            reference.end_update()
            for name, tensor in reference.params.items():
                assert_bitwise_equal(params[name], tensor, name=f"{fmt} {name}", rank=rank)


def test_layout_missing_a_parameter_is_refused_at_bind():
    spec, engine = qwen3_5_moe(), ReceiverTopology(tp=2)
    real = build_engine_rank(spec, engine, 0)
    params = _poisoned(spec, engine, 0)
    del params["model.layers.0.linear_attn.A_log"]
    with pytest.raises(SGLangPlacementError, match="linear_attn.A_log"):
        real.bind(params)
    params = _poisoned(spec, engine, 0)
    params["model.layers.0.linear_attn.A_log"] = params["model.layers.0.linear_attn.A_log"].to(torch.bfloat16)
    with pytest.raises(SGLangPlacementError, match="float32"):
        real.bind(params)


def test_qwen3_moe_load_weights_leaves_a_tied_lm_head_unwritten():
    """Why ``sglang-qwen3-moe`` does not claim tied embeddings: its ``load_weights`` has no
    ``tie_word_embeddings`` branch, so a tied checkpoint (no ``lm_head.weight``) leaves
    ``lm_head`` as it was, while ``embed_tokens`` is loaded."""
    spec, engine = qwen3_moe(tied=True), ReceiverTopology(tp=1)
    real = build_engine_rank(spec, engine, 0)
    params = _poisoned(spec, engine, 0)
    before = snapshot(params)
    real.bind(params)
    real.load(model_senders.export("compat", spec, engine, 0, model_synth.full_model(spec, VERSION)),
              None, spec.targets)
    expected = model_synth.expected_engine_params(spec, engine, 0, VERSION)
    assert_bitwise_equal(params["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    assert_bitwise_equal(params["lm_head.weight"], before.records["lm_head.weight"].copy)


def test_draft_load_weights_takes_only_mtp_tensors():
    """SGLang updates the draft runner with the same tensors as the served model; the draft's
    ``load_weights`` keeps ``mtp.*`` (and the shared embedding): a served-model stream leaves
    every draft parameter as it was."""
    spec, engine = qwen3_5_moe(), ReceiverTopology(tp=1)
    real = build_engine_rank(spec, engine, 0)
    params = _poisoned(spec, engine, 0)
    before = snapshot(params)
    real.bind(params)
    served = model_senders.export("compat", spec, engine, 0, model_synth.full_model(spec, VERSION),
                                  ("target",))
    real.load(served, None, ("draft",))
    for name, rec in before.records.items():
        if name.startswith("draft."):
            assert_bitwise_equal(params[name], rec.copy, name=name)
