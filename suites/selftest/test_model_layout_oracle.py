"""The whole-model engine state, rebuilt from plain slicing arithmetic, independent of model_layout.py.

The expected state of every whole-model suite (``model_synth.expected_engine_params``), the
reference receiver and the direct sender all read ``model_layout.engine_params``. A bug there
(a KV head replicated on the wrong ranks, a vocab padding rule, a GDN component offset) would
cancel out. This module states SGLang 0.5.23's rules again, from the layer classes' weight
loaders (``QKVParallelLinear.weight_loader``: ``shard_id = tp_rank // num_kv_head_replicas``;
``MergedColumnParallelLinear``: each output size's ``1/tp`` at its offset;
``RowParallelLinear``: columns; ``mamba_v2_sharded_weight_loader``; ``VocabParallelEmbedding``:
``pad_vocab_size`` to 64, times ``tp`` when not divisible, zero tail), slices the full
checkpoint tensors with them, and requires the expected state and the reference receiver
after a compat update to equal that, bit for bit, on engines of TP 1, 2, 3 and 4.

The trainer-side oracle (``megatron_model``) is held to a round trip here (every rank's
Megatron shards gather back to the checkpoint) and to the per-kind slicing stated again.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pytest_weightsync.compare import assert_bitwise_equal
from pytest_weightsync.reference_impl.trainer import megatron_model
from pytest_weightsync.reference_impl.senders import model_senders
from pytest_weightsync.reference_impl.oracle import model_synth, synth
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, TrainerTopology
from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe

pytestmark = pytest.mark.weightsync_property("receiver_layout_oracle")

VERSION = 5
SPECS = {
    "q3-kv1": qwen3_moe(),
    "q3-kv4-tied-fp32": qwen3_moe(num_kv_heads=4, tied=True, router_dtype=torch.float32,
                                  expert_bias=True, vocab=130),
    "q35-tied": qwen3_5_moe(tied=True, linear_k_heads=4, linear_v_heads=8),
    "q35-kv1": qwen3_5_moe(num_kv_heads=1, linear_k_heads=4, linear_v_heads=8, vocab=64),
}
ENGINES = [ReceiverTopology(tp=1), ReceiverTopology(tp=2, order="up_gate"),
           ReceiverTopology(tp=4, moe_ep=2)]


def _rows(t, start, n):
    return t[start:start + n]


def _slice(t, tp, r):
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n]


def _kv(t, spec, tp, r):
    if spec.num_kv_heads >= tp:
        return _slice(t, tp, r)
    d = spec.head_dim
    head = r // (tp // spec.num_kv_heads)
    return t[head * d:(head + 1) * d]


def _vocab(t, vocab, tp, r):
    pad = 64 if (-(-vocab // 64) * 64) % tp == 0 else 64 * tp
    rows = (-(-vocab // pad) * pad) // tp
    out = torch.zeros((rows, t.shape[1]), dtype=t.dtype)
    real = t[r * rows:(r + 1) * rows]
    out[:real.shape[0]] = real
    return out


def _layer(spec, full, hp, ep, kind, tp, r) -> dict:
    """SGLang's engine tensors of one layer from its checkpoint tensors ``full``."""
    f = lambda name: full[f"{hp}.{name}"]  # noqa: E731
    out = {f"{ep}.input_layernorm.weight": f("input_layernorm.weight"),
           f"{ep}.post_attention_layernorm.weight": f("post_attention_layernorm.weight"),
           f"{ep}.mlp.gate.weight": f("mlp.gate.weight")}
    if spec.expert_bias:
        out[f"{ep}.mlp.gate.e_score_correction_bias"] = f("mlp.gate.e_score_correction_bias")
    if kind == "attention":
        a = f"{ep}.self_attn" if spec.family == "qwen3_moe" else ep
        out[f"{a}.qkv_proj.weight"] = torch.cat([
            _slice(f("self_attn.q_proj.weight"), tp, r), _kv(f("self_attn.k_proj.weight"), spec, tp, r),
            _kv(f("self_attn.v_proj.weight"), spec, tp, r)])
        out[f"{a}.o_proj.weight"] = _slice(f("self_attn.o_proj.weight").T, tp, r).T
        out[f"{a}.q_norm.weight"] = f("self_attn.q_norm.weight")
        out[f"{a}.k_norm.weight"] = f("self_attn.k_norm.weight")
    else:
        qk, v = spec.gdn_qk, spec.gdn_v
        qkv, conv = f("linear_attn.in_proj_qkv.weight"), f("linear_attn.conv1d.weight")
        parts = lambda t: (t[:qk], t[qk:2 * qk], t[2 * qk:])  # noqa: E731
        g = f"{ep}.linear_attn"
        out[f"{g}.in_proj_qkvz.weight"] = torch.cat(
            [_slice(p, tp, r) for p in parts(qkv)] + [_slice(f("linear_attn.in_proj_z.weight"), tp, r)])
        out[f"{g}.in_proj_ba.weight"] = torch.cat([_slice(f("linear_attn.in_proj_b.weight"), tp, r),
                                                  _slice(f("linear_attn.in_proj_a.weight"), tp, r)])
        out[f"{g}.conv1d.weight"] = torch.cat([_slice(p, tp, r) for p in parts(conv)])
        out[f"{g}.A_log"] = _slice(f("linear_attn.A_log"), tp, r)
        out[f"{g}.dt_bias"] = _slice(f("linear_attn.dt_bias"), tp, r)
        out[f"{g}.norm.weight"] = f("linear_attn.norm.weight")
        out[f"{g}.out_proj.weight"] = _slice(f("linear_attn.out_proj.weight").T, tp, r).T
    if spec.intermediate_shared:
        s = f"{ep}.mlp.shared_expert"
        out[f"{s}.gate_up_proj.weight"] = torch.cat([
            _slice(f("mlp.shared_expert.gate_proj.weight"), tp, r),
            _slice(f("mlp.shared_expert.up_proj.weight"), tp, r)])
        out[f"{s}.down_proj.weight"] = _slice(f("mlp.shared_expert.down_proj.weight").T, tp, r).T
        out[f"{ep}.mlp.shared_expert_gate.weight"] = f("mlp.shared_expert_gate.weight")
    return out


def oracle(spec, full, tp, r) -> dict:
    """Every non-expert engine tensor of rank ``r`` by SGLang's rules."""
    out = {"model.embed_tokens.weight": _vocab(full["model.embed_tokens.weight"], spec.vocab, tp, r),
           "model.norm.weight": full["model.norm.weight"],
           "lm_head.weight": _vocab(full["model.embed_tokens.weight" if spec.tied else "lm_head.weight"],
                                    spec.vocab, tp, r)}
    for layer in range(spec.num_layers):
        out.update(_layer(spec, full, f"model.layers.{layer}", f"model.layers.{layer}",
                          spec.layer_kind(layer), tp, r))
    for layer in range(spec.mtp_layers):
        out.update(_layer(spec, full, f"mtp.layers.{layer}", f"draft.model.layers.{layer}",
                          "attention", tp, r))
        out.update({"draft.fc.weight": full["mtp.fc.weight"],
                    "draft.pre_fc_norm_embedding.weight": full["mtp.pre_fc_norm_embedding.weight"],
                    "draft.pre_fc_norm_hidden.weight": full["mtp.pre_fc_norm_hidden.weight"],
                    "draft.model.norm.weight": full["mtp.norm.weight"]})
    return out


#: Engine TP 3, Qwen3-MoE with heads and FFN sizes that split in thirds: vocab 37 (64 padded
#: rows do not divide by 3: padded to 64 x 3) and 130 (192 rows divide by 3: padded to 64).
TP3 = [pytest.param("q3-kv1", ReceiverTopology(tp=3), dict(num_heads=6, intermediate=6),
                    id="q3-kv1-tp3"),
       pytest.param("q3-kv4-tied-fp32", ReceiverTopology(tp=3),
                    dict(num_heads=6, num_kv_heads=3, intermediate=6), id="q3-kv3-tied-fp32-tp3")]


@pytest.mark.parametrize("name, engine, resized",
                         [pytest.param(name, engine, {}, id=f"{name}-tp{engine.tp}ep{engine.moe_ep}")
                          for engine in ENGINES for name in sorted(SPECS)] + TP3)
def test_expected_state_and_receiver_match_sglang_slicing_rules(name, engine, resized):
    spec = dataclasses.replace(SPECS[name], **resized)
    weights = model_synth.full_model(spec, VERSION)
    for r in range(engine.tp):
        want = oracle(spec, weights.dense, engine.tp, r)
        expected = model_synth.expected_engine_params(spec, engine, r, VERSION)
        receiver = ModelReceiver(spec, engine, r)
        for tensor in receiver.params.values():
            synth.poison_(tensor)  # padding must be zeroed, not left
        receiver.begin_update()
        receiver.load(model_senders.export("compat", spec, engine, r, weights))
        receiver.end_update()
        dense = {n for n, p in receiver.layout.items() if p.part != "experts"}
        assert dense == set(want), sorted(dense ^ set(want))
        for param, tensor in want.items():
            assert_bitwise_equal(expected[param], tensor, name=f"expected {param}", rank=r)
            assert_bitwise_equal(receiver.params[param], tensor, name=param, rank=r)


def test_vocab_padding_leaves_a_rank_of_zero_rows_only():
    """vocab 37 on TP 4: 64 padded rows, 16 per rank; rank 3 holds no real row."""
    spec, engine = SPECS["q35-tied"], ReceiverTopology(tp=4, moe_ep=2)
    expected = model_synth.expected_engine_params(spec, engine, 3, VERSION)
    assert expected["lm_head.weight"].shape == (16, spec.hidden)
    assert not expected["lm_head.weight"].any() and not expected["model.embed_tokens.weight"].any()


@pytest.mark.parametrize("trainer", [TrainerTopology(tp=2, pp=2, ep=2, etp=2),
                                     TrainerTopology(tp=1, pp=2, ep=4, expert_impl="te_grouped")],
                         ids=lambda t: f"tp{t.tp}pp{t.pp}ep{t.ep}etp{t.etp}")
def test_trainer_shards_gather_back_to_the_checkpoint(trainer):
    spec = SPECS["q35-tied"]
    weights = model_synth.full_model(spec, VERSION)
    states = megatron_model.trainer_model_states(spec, trainer, weights)
    back = megatron_model.gather_model(spec, trainer, states)
    assert list(back.dense) == list(weights.dense)
    for name, tensor in weights.dense.items():
        assert_bitwise_equal(back.dense[name], tensor, name=name)
    for target, layers in weights.experts.items():
        for layer, experts in layers.items():
            for e, w in enumerate(experts):
                for proj in ("gate", "up", "down"):
                    assert_bitwise_equal(back.experts[target][layer][e][proj], w[proj],
                                         name=f"{target} layer {layer} expert {e} {proj}")


def test_trainer_shards_follow_megatron_layouts():
    """Per kind, restated: GDN in_proj is [q_t; k_t; v_t; z_t; b_t; a_t]; gated linear_qkv is
    per query group [q_g; gate_g; k_g; v_g] cut in contiguous runs; the vocab is padded to a
    multiple of 128 * tp; a tied model's last stage holds the embedding again (PP 2)."""
    spec, trainer = SPECS["q35-tied"], TrainerTopology(tp=2, pp=2)
    full = model_synth.full_model(spec, VERSION).dense
    states = megatron_model.trainer_model_states(spec, trainer, model_synth.full_model(spec, VERSION))
    qk, v, nv = spec.gdn_qk, spec.gdn_v, spec.linear_v_heads
    qkv, z = full["model.layers.0.linear_attn.in_proj_qkv.weight"], full["model.layers.0.linear_attn.in_proj_z.weight"]
    b, a = full["model.layers.0.linear_attn.in_proj_b.weight"], full["model.layers.0.linear_attn.in_proj_a.weight"]
    for t in range(2):
        want = torch.cat([_slice(qkv[:qk], 2, t), _slice(qkv[qk:2 * qk], 2, t), _slice(qkv[2 * qk:], 2, t),
                          _slice(z, 2, t), _slice(b, 2, t), _slice(a, 2, t)])
        assert_bitwise_equal(states[t]["decoder.layers.0.self_attention.in_proj.weight"], want,
                             name=f"in_proj tp {t}")
    q = full["model.layers.1.self_attn.q_proj.weight"]  # [q_h; gate_h] per head
    k, vv = full["model.layers.1.self_attn.k_proj.weight"], full["model.layers.1.self_attn.v_proj.weight"]
    d, per = spec.head_dim, spec.num_heads // spec.num_kv_heads
    groups = []
    for g in range(spec.num_kv_heads):
        heads = range(g * per, (g + 1) * per)
        groups += [q[2 * h * d:(2 * h + 1) * d] for h in heads]
        groups += [q[(2 * h + 1) * d:(2 * h + 2) * d] for h in heads]
        groups += [k[g * d:(g + 1) * d], vv[g * d:(g + 1) * d]]
    interleaved = torch.cat(groups)
    stage1 = 2  # layer 1 is on stage 1: ranks 2, 3 (local layer 0)
    for t in range(2):
        assert_bitwise_equal(states[stage1 + t]["decoder.layers.0.self_attention.linear_qkv.weight"],
                             _slice(interleaved, 2, t), name=f"linear_qkv tp {t}")
    embed = states[0]["embedding.word_embeddings.weight"]
    assert embed.shape[0] == megatron_model.padded_vocab(spec.vocab, 2) // 2 == 128
    assert_bitwise_equal(embed[:spec.vocab], full["model.embed_tokens.weight"][:spec.vocab],
                         name="embedding rows")
    assert "output_layer.weight" in states[stage1] and "output_layer.weight" not in states[0]


def test_qwen3_5_35b_a3b_engine_shapes():
    """The GPU shapes (docs/layout.md, DOMAIN): at TP 1 ``in_proj_qkvz`` [12288, 2048] and
    ``in_proj_ba`` [64, 2048]; one layer's experts ``w13`` [256, 1024, 2048], ``w2`` [256,
    2048, 512]; at TP 2 (the recipe's engine) each rank holds half of every GDN component."""
    from pytest_weightsync.reference_impl.model.model_layout import engine_params
    from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_35b_a3b

    spec = qwen3_5_35b_a3b(num_layers=4)
    tp1 = engine_params(spec, ReceiverTopology(tp=1), 0)
    assert tp1["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (12288, 2048)
    assert tp1["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (64, 2048)
    assert tp1["model.layers.0.mlp.experts.w13_weight"].shape == (256, 1024, 2048)
    assert tp1["model.layers.0.mlp.experts.w2_weight"].shape == (256, 2048, 512)
    assert [spec.layer_kind(layer) for layer in range(4)] == ["gdn", "gdn", "gdn", "attention"]
    tp2 = engine_params(spec, ReceiverTopology(tp=2, moe_ep=2), 1)
    assert tp2["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (6144, 2048)
    assert tp2["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (32, 2048)
    assert tp2["model.layers.0.mlp.experts.w13_weight"].shape == (128, 1024, 2048)


def test_trainer_param_shapes_are_the_shards_shapes():
    spec, trainer = SPECS["q35-tied"], TrainerTopology(tp=2, pp=2, ep=2)
    states = megatron_model.trainer_model_states(spec, trainer, model_synth.full_model(spec, VERSION))
    for rank, state in enumerate(states):
        shapes = megatron_model.trainer_param_shapes(spec, trainer, rank)
        dense = {n: (tuple(t.shape), t.dtype) for n, t in state.items() if ".mlp.experts." not in n}
        assert dense == shapes, sorted(set(dense.items()) ^ set(shapes.items()))[:4]
