"""Bad payloads are refused by name, and refused whole: no receiver parameter changes.

Each case starts from a valid chunk of the next version and breaks one thing, keeping the
valid entries *before* the broken one, so a loader that writes while it validates would have
already changed parameters. After the error, every parameter of every receiver rank must be
bit-identical to its snapshot, at the same address.
"""

from __future__ import annotations

import pytest
import torch

from harness import gathered_weights, payload, sync_and_check
from matrix import Case
from pytest_weightsync import compare
from reference_impl import receiver as rx
from reference_impl.layout import MoESpec, ReceiverTopology, TrainerTopology, hf_expert_name

CASE = Case(MoESpec(num_layers=2, num_experts=4, hidden=8, intermediate=8),
            TrainerTopology(ep=2, etp=2, tp=2),
            ReceiverTopology(tp=4, moe_ep=2, intermediate_padded=5))


def _replace(entries, name, tensor):
    return [(n, tensor if n == name else t) for n, t in entries]


def _last_local_expert(rank):
    return CASE.spec.num_experts // CASE.receiver.moe_ep * ((rank // 2) % 2 + 1) - 1


def wrong_shape_compat(p, rank):
    name = hf_expert_name(0, 3, "up")
    return _replace(p, name, torch.zeros(9, 8, dtype=torch.bfloat16))


def wrong_shape_packed(p, rank):
    name = "model.layers.0.mlp.experts.w2_weight"
    return _replace(p, name, torch.zeros(3, 8, 8, dtype=torch.bfloat16))


def wrong_shape_direct(p, rank):
    name = "model.layers.1.mlp.experts.w13_weight"
    t = dict(p)[name]
    return _replace(p, name, torch.zeros(t.shape[0], t.shape[1] - 2, t.shape[2], dtype=t.dtype))


def wrong_dtype(p, rank):
    name = hf_expert_name(1, 2, "down")
    return _replace(p, name, dict(p)[name].float())


def unknown_name(p, rank):
    return p + [("model.layers.0.mlp.experts.0.gate_proj.bias", torch.zeros(8, dtype=torch.bfloat16))]


def attention_name(p, rank):
    return p + [("model.layers.0.self_attn.q_proj.weight", torch.zeros(8, 8, dtype=torch.bfloat16))]


def layer_out_of_range(p, rank):
    return p + [(hf_expert_name(2, 0, "gate"), torch.zeros(8, 8, dtype=torch.bfloat16))]


def duplicate_name(p, rank):
    return p + [p[0]]


def missing_expert(p, rank):
    drop = hf_expert_name(1, _last_local_expert(rank), "up")
    return [(n, t) for n, t in p if n != drop]


def expert_out_of_range(p, rank):
    return p + [(hf_expert_name(0, 4, "gate"), torch.zeros(8, 8, dtype=torch.bfloat16))]


def mixed_formats(p, rank):
    full = gathered_weights(CASE, 1)
    return p + payload("packed", CASE, rank, full, [1])


def non_contiguous_direct(p, rank):
    name = "model.layers.0.mlp.experts.w13_weight"
    t = dict(p)[name]
    strided = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert strided.shape == t.shape and not strided.is_contiguous()
    return _replace(p, name, strided)


def wrong_device(p, rank):
    name = hf_expert_name(0, 1, "gate")
    return _replace(p, name, torch.empty(8, 8, dtype=torch.bfloat16, device="meta"))


def not_a_tensor(p, rank):
    name = hf_expert_name(0, 1, "down")
    return _replace(p, name, dict(p)[name].tolist())


def per_expert_as_direct(p, rank):
    return p


BAD = [
    # (id, path the valid chunk comes from, load_format, corruption, error, message fragment)
    ("wrong-shape-compat", "compat", None, wrong_shape_compat, rx.PayloadShapeError,
     "model.layers.0.mlp.experts.3.up_proj.weight': shape (9, 8), expected (8, 8)"),
    ("wrong-shape-packed", "packed", None, wrong_shape_packed, rx.PayloadShapeError,
     "w2_weight': shape (3, 8, 8), expected (4, 8, 8)"),
    ("wrong-shape-direct", "direct", "direct", wrong_shape_direct, rx.PayloadShapeError,
     "w13_weight': shape (2, 8, 8), expected (2, 10, 8)"),
    ("wrong-dtype", "compat", None, wrong_dtype, rx.PayloadDtypeError,
     "experts.2.down_proj.weight': dtype torch.float32, receiver holds torch.bfloat16"),
    ("unknown-name", "compat", None, unknown_name, rx.UnknownNameError,
     "unknown name 'model.layers.0.mlp.experts.0.gate_proj.bias'"),
    ("non-expert-name", "compat", None, attention_name, rx.UnknownNameError,
     "self_attn.q_proj.weight"),
    ("layer-out-of-range", "compat", None, layer_out_of_range, rx.ExpertOutOfRangeError,
     "layer 2 out of range (num_layers=2)"),
    ("duplicate-name", "compat", None, duplicate_name, rx.DuplicateEntryError,
     "duplicate payload entry 'model.layers.0.mlp.experts.0.gate_proj.weight'"),
    ("duplicate-packed", "packed", None, duplicate_name, rx.DuplicateEntryError,
     "duplicate payload entry 'model.layers.0.mlp.experts.w13_weight'"),
    ("missing-expert", "compat", None, missing_expert, rx.MissingExpertError,
     "layer 1 w13_weight on receiver rank"),
    ("expert-out-of-range", "compat", None, expert_out_of_range, rx.ExpertOutOfRangeError,
     "expert 4 out of range (num_experts=4)"),
    ("packed-and-per-expert-mixed", "compat", None, mixed_formats, rx.MixedFormatError,
     "packed and per-expert names mixed in one chunk"),
    ("non-contiguous-direct", "direct", "direct", non_contiguous_direct, rx.TensorLayoutError,
     "non-contiguous tensor"),
    ("wrong-device", "compat", None, wrong_device, rx.TensorLayoutError,
     "tensor on device meta"),
    ("not-a-tensor", "compat", None, not_a_tensor, rx.PayloadTypeError, "not a torch.Tensor"),
    ("per-expert-names-as-direct", "compat", "direct", per_expert_as_direct, rx.UnknownNameError,
     "load_format='direct' takes the receiver's own parameter names"),
]


@pytest.mark.weightsync_property("bad_payload_refused")
@pytest.mark.parametrize("path, load_format, corrupt, error, fragment",
                         [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_payload_is_refused_and_changes_nothing(path, load_format, corrupt, error, fragment):
    receivers = sync_and_check(CASE, "compat", version=0)
    full = gathered_weights(CASE, version=1)
    for rec in receivers:
        chunk = corrupt(payload(path, CASE, rec.rank, full), rec.rank)
        before = compare.snapshot(rec.params)
        with pytest.raises(error) as info:
            rec.load(chunk, load_format=load_format)
        assert isinstance(info.value, rx.PayloadError) and isinstance(info.value, ValueError)
        assert fragment in str(info.value), str(info.value)
        compare.assert_unchanged(before, rec.params, rank=rec.rank)


def test_missing_expert_message_names_the_expert():
    receivers = sync_and_check(CASE, "compat", version=0)
    rec = receivers[3]  # moe_ep_rank 1: experts 2..3
    chunk = missing_expert(payload("compat", CASE, 3, gathered_weights(CASE, 1)), 3)
    with pytest.raises(rx.MissingExpertError, match=r"expert 3 up_proj.*experts 2\.\.3"):
        rec.load(chunk)


def test_unknown_load_format_is_refused():
    rec = rx.ReferenceReceiver(CASE.spec, CASE.receiver, 0)
    with pytest.raises(rx.PayloadError, match="unknown load_format 'flattened'"):
        rec.load([], load_format="flattened")


def test_update_that_skips_a_layer_is_reported():
    receivers = sync_and_check(CASE, "compat", version=0)
    full = gathered_weights(CASE, 1)
    rec = receivers[1]
    rec.begin_update()
    rec.load(payload("direct", CASE, 1, full, [0]), load_format="direct")
    with pytest.raises(rx.IncompleteUpdateError,
                       match=r"2 parameter\(s\) not updated.*model\.layers\.1\.mlp\.experts\.w13_weight"):
        rec.end_update()


def test_non_local_experts_alone_change_nothing():
    """SGLang ignores experts of other EP ranks: a chunk with only those is a no-op, not an
    error, and not a partial write."""
    receivers = sync_and_check(CASE, "compat", version=0)
    full = gathered_weights(CASE, 1)
    from reference_impl import compat

    rec = receivers[0]  # experts 0..1
    before = compare.snapshot(rec.params)
    plan = rec.load(compat.export(full, experts=[2, 3]))
    assert plan.ignored == 2 * 2 * 3 and not plan.touched
    compare.assert_unchanged(before, rec.params, rank=0)


@pytest.mark.weightsync_property("bad_payload_refused")
@pytest.mark.parametrize("misfit, fragment", [
    ("missing", "has no parameter 'model.layers.0.mlp.experts.w2_weight'"),
    ("shape", "w13_weight"),
    ("dtype", "torch.float32"),
    ("not-a-tensor", "w13_weight"),
])
def test_receiver_built_over_misfit_params_is_refused(misfit, fragment):
    """A receiver wrapped around a caller's parameters checks every one of them up front."""
    spec = MoESpec(num_layers=1, num_experts=2, hidden=8, intermediate=4)
    topo = ReceiverTopology()
    params = dict(rx.ReferenceReceiver(spec, topo, 0).params)
    w13, w2 = "model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"
    if misfit == "missing":
        del params[w2]
    elif misfit == "shape":
        params[w13] = torch.zeros(2, 9, 8, dtype=spec.dtype)
    elif misfit == "dtype":
        params[w13] = params[w13].float()
    else:
        params[w13] = params[w13].tolist()
    with pytest.raises(rx.ReceiverParamsError, match="receiver rank 0") as info:
        rx.ReferenceReceiver(spec, topo, 0, params=params)
    assert fragment in str(info.value)


@pytest.mark.weightsync_property("bad_payload_refused")
def test_direct_export_of_a_layer_missing_experts_is_refused():
    from reference_impl import direct, synth
    from reference_impl.layout import WeightSyncError

    spec = MoESpec(num_layers=1, num_experts=4, hidden=8, intermediate=4)
    experts = synth.full_weights(spec, 1)[0][:3]
    with pytest.raises(WeightSyncError, match="needs all 4 experts .* got 3"):
        direct.export_layer(spec, ReceiverTopology(), 0, 0, experts)
