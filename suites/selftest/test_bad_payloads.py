"""Bad payloads are refused by name, and refused whole: no receiver parameter changes.

Each case starts from a valid bucket of the next version and breaks one thing, keeping the
valid entries *before* the broken one, so a loader that writes while it validates would have
already changed parameters. After the error, every parameter of every receiver rank must be
bit-identical to its snapshot, at the same address. Every refusal is a ``PayloadError`` (a
``WeightSyncError``, a ``ValueError``) naming the entry index and the reason, in a message of
bounded length. Completeness is a property of a whole update, checked at ``end_update``.
"""

from __future__ import annotations

import pytest
import torch

from ..harness.cases import Case
from ..harness.inputs import gathered_weights, payload
from ..harness.reference import sync_and_check
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology, hf_expert_name

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


def expert_out_of_range(p, rank):
    return p + [(hf_expert_name(0, 4, "gate"), torch.zeros(8, 8, dtype=torch.bfloat16))]


def mixed_formats(p, rank):
    full = gathered_weights(CASE, 1)
    return p + payload("packed", CASE, rank, layers=[1], full=full)


def mixed_hf_fused(p, rank):
    full = gathered_weights(CASE, 1)
    return payload("hf_fused", CASE, rank, layers=[0], full=full) + p


def strided_direct(p, rank):
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
     "'model.layers.0.mlp.experts.0.gate_proj.bias': unknown name"),
    ("non-expert-name", "compat", None, attention_name, rx.UnknownNameError,
     "self_attn.q_proj.weight"),
    ("layer-out-of-range", "compat", None, layer_out_of_range, rx.ExpertOutOfRangeError,
     "layer 2 out of range (num_layers=2)"),
    ("duplicate-name", "compat", None, duplicate_name, rx.DuplicateEntryError,
     "payload entry 24 'model.layers.0.mlp.experts.0.gate_proj.weight': duplicate: layer 0 "
     "expert 0 gate_proj was already carried by entry 0"),
    ("duplicate-packed", "packed", None, duplicate_name, rx.DuplicateEntryError,
     "payload entry 4 'model.layers.0.mlp.experts.w13_weight': duplicate"),
    ("duplicate-hf-fused", "hf_fused", None, duplicate_name, rx.DuplicateEntryError,
     "payload entry 4 'model.layers.0.mlp.experts.gate_up_proj': duplicate"),
    ("expert-out-of-range", "compat", None, expert_out_of_range, rx.ExpertOutOfRangeError,
     "expert 4 out of range (num_experts=4)"),
    ("packed-and-per-expert-mixed", "compat", None, mixed_formats, rx.MixedFormatError,
     "names of different formats mixed in one bucket: compat (payload entry 0 "),
    ("hf-fused-and-per-expert-mixed", "compat", None, mixed_hf_fused, rx.MixedFormatError,
     "hf_fused (payload entry 0 'model.layers.0.mlp.experts.gate_up_proj'), compat"),
    ("wrong-device", "compat", None, wrong_device, rx.TensorLayoutError,
     "tensor on device meta"),
    ("not-a-tensor", "compat", None, not_a_tensor, rx.PayloadTypeError, "not a torch.Tensor"),
    ("per-expert-names-as-direct", "compat", "direct", per_expert_as_direct, rx.UnknownNameError,
     "payload entry 0 'model.layers.0.mlp.experts.0.gate_proj.weight': load_format='direct' "
     "takes the receiver's own parameter names"),
    ("hf-fused-names-as-direct", "hf_fused", "direct", per_expert_as_direct, rx.UnknownNameError,
     "not hf_fused names"),
    ("wrong-shape-hf-fused", "hf_fused", None,
     lambda p, rank: _replace(p, "model.layers.1.mlp.experts.down_proj",
                              torch.zeros(4, 8, 9, dtype=torch.bfloat16)),
     rx.PayloadShapeError, "down_proj': shape (4, 8, 9), expected (4, 8, 8)"),
]


@pytest.mark.weightsync_property("bad_payload_refused")
@pytest.mark.parametrize("path, load_format, corrupt, error, fragment",
                         [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_payload_is_refused_and_changes_nothing(path, load_format, corrupt, error, fragment):
    receivers = sync_and_check(CASE, "compat", version=0)
    full = gathered_weights(CASE, version=1)
    for rec in receivers:
        chunk = corrupt(payload(path, CASE, rec.rank, full=full), rec.rank)
        before = compare.snapshot(rec.params)
        with pytest.raises(error) as info:
            rec.load(chunk, load_format=load_format)
        assert isinstance(info.value, rx.PayloadError) and isinstance(info.value, ValueError)
        assert fragment in str(info.value), str(info.value)
        compare.assert_unchanged(before, rec.params, rank=rec.rank)


def test_strided_direct_tensor_is_loaded_as_sglang_loads_it():
    """``load_format='direct'`` checks the shape and copies whatever the strides are, as
    SGLang's ``default_weight_loader`` does (``param.copy_``; run on real SGLang in
    ``test_sglang_backend``): a strided payload lands exactly as its contiguous copy would."""
    full = gathered_weights(CASE, version=1)
    for rec in sync_and_check(CASE, "compat", version=0):
        chunk = payload("direct", CASE, rec.rank, full=full)
        twin = rx.ReferenceReceiver(CASE.spec, CASE.receiver, rec.rank)
        twin.load(chunk, load_format="direct")
        rec.load(strided_direct(chunk, rec.rank), load_format="direct")
        for name, param in twin.params.items():
            assert torch.equal(param.view(torch.int16), rec.params[name].view(torch.int16)), name


def test_unknown_load_format_is_refused():
    rec = rx.ReferenceReceiver(CASE.spec, CASE.receiver, 0)
    with pytest.raises(rx.PayloadError, match="unknown load_format 'flattened'"):
        rec.load([], load_format="flattened")


def test_update_that_skips_a_layer_is_reported_at_end_update():
    receivers = sync_and_check(CASE, "compat", version=0)
    full = gathered_weights(CASE, 1)
    rec = receivers[1]
    rec.begin_update()
    rec.load(payload("direct", CASE, 1, layers=[0], full=full), load_format="direct")
    with pytest.raises(rx.MissingExpertError,
                       match=r"6 expert projection\(s\) this rank owns were never loaded: "
                             r"layer 1 expert 0 gate_proj, layer 1 expert 0 up_proj, "
                             r"layer 1 expert 0 down_proj, layer 1 expert 1 gate_proj"):
        rec.end_update()


def test_update_missing_one_up_proj_names_it_at_end_update():
    """A bucket may carry part of a layer's experts (a later bucket brings the rest): nothing
    is refused per bucket; the update as a whole is, naming the missing piece."""
    receivers = sync_and_check(CASE, "compat", version=0)
    rec = receivers[3]  # moe_ep_rank 1: experts 2..3
    drop = hf_expert_name(1, 3, "up")
    chunk = [(n, t) for n, t in payload("compat", CASE, 3, full=gathered_weights(CASE, 1)) if n != drop]
    rec.begin_update()
    rec.load(chunk)
    with pytest.raises(rx.MissingExpertError) as info:
        rec.end_update()
    message = str(info.value)
    assert "1 expert projection(s) this rank owns were never loaded: layer 1 expert 3 up_proj;" \
        in message, message
    assert "receiver rank 3" in message and "previous version" in message
    assert isinstance(info.value, rx.IncompleteUpdateError)


def test_missing_piece_list_is_bounded():
    rec = rx.ReferenceReceiver(CASE.spec, CASE.receiver, 0)
    rec.begin_update()
    with pytest.raises(rx.MissingExpertError) as info:
        rec.end_update()
    message = str(info.value)
    assert "12 expert projection(s)" in message and "(4 more)" in message
    assert len(message) < 600


def test_end_update_without_begin_is_refused():
    rec = rx.ReferenceReceiver(CASE.spec, CASE.receiver, 0)
    with pytest.raises(rx.IncompleteUpdateError, match="without begin_update"):
        rec.end_update()


def test_non_local_experts_alone_change_nothing():
    """SGLang ignores experts of other EP ranks: a chunk with only those is a no-op, not an
    error, and not a partial write."""
    receivers = sync_and_check(CASE, "compat", version=0)
    full = gathered_weights(CASE, 1)
    from pytest_weightsync.reference_impl.senders import compat

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
    from pytest_weightsync.reference_impl.senders import direct
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.model.layout import WeightSyncError

    spec = MoESpec(num_layers=1, num_experts=4, hidden=8, intermediate=4)
    experts = synth.full_weights(spec, 1)[0][:3]
    with pytest.raises(WeightSyncError, match="needs all 4 experts .* got 3"):
        direct.export_layer(spec, ReceiverTopology(), 0, 0, experts)


# --- reliability: every bad input is a PayloadError naming the entry, nothing written ---------


def _valid_bucket(path, rank=0, layers=None):
    return payload(path, CASE, rank, layers=layers, full=gathered_weights(CASE, 1))


def _sparse(p, rank):
    name = hf_expert_name(0, 0, "gate")
    return _replace(p, name, dict(p)[name].to_sparse())


def _renamed(p, old, new):
    return [(new if n == old else n, t) for n, t in p]


GATE_0_0 = hf_expert_name(0, 0, "gate")
W13_0 = "model.layers.0.mlp.experts.w13_weight"

STRANGE = [
    # (id, path, load_format, corruption, fragment)
    ("payload-none", "compat", None, lambda p, r: None, "payload is None"),
    ("payload-dict", "compat", None, lambda p, r: dict(p), "payload is a dict"),
    ("payload-int", "compat", None, lambda p, r: 7, "payload is a int"),
    ("entry-not-a-pair", "compat", None, lambda p, r: p + [("only a name",)],
     "payload entry 24 is a tuple, not a (name, tensor) pair"),
    ("entry-a-list", "compat", None, lambda p, r: p[:3] + [list(p[3])], "payload entry 3 is a list"),
    ("bytes-name", "compat", None, lambda p, r: p + [(GATE_0_0.encode(), p[0][1])],
     "payload entry 24: the name is a bytes"),
    ("sparse-tensor", "compat", None, _sparse, "payload entry 0 " + repr(GATE_0_0) + ": torch.sparse_coo"),
    ("leading-zero-expert", "compat", None,
     lambda p, r: _renamed(p, hf_expert_name(1, 2, "up"), "model.layers.1.mlp.experts.02.up_proj.weight"),
     "unknown name: id '02' has a leading zero"),
    ("unicode-digit-layer", "compat", None,
     lambda p, r: _renamed(p, hf_expert_name(1, 2, "up"), "model.layers.\u0661.mlp.experts.2.up_proj.weight"),
     "has non-ASCII digits"),
    ("trailing-newline", "compat", None,
     lambda p, r: _renamed(p, hf_expert_name(1, 2, "up"), hf_expert_name(1, 2, "up") + "\n"),
     "leading or trailing whitespace"),
    ("huge-id", "compat", None,
     lambda p, r: p + [(f"model.layers.0.mlp.experts.{'9' * 5000}.up_proj.weight", p[0][1])],
     "id of 5000 digits"),
    ("empty-name", "compat", None, lambda p, r: p + [("", p[0][1])], "payload entry 24 '': unknown name"),
    ("respelled-direct-name", "direct", "direct",
     lambda p, r: _renamed(p, W13_0, "model.layers.00.mlp.experts.w13_weight"),
     "id '00' has a leading zero"),
    ("hf-fused-name-in-direct", "direct", "direct",
     lambda p, r: _renamed(p, W13_0, "model.layers.0.mlp.experts.gate_up_proj"),
     "load_format='direct' takes the receiver's own parameter names"),
]


@pytest.mark.weightsync_property("bad_payload_refused")
@pytest.mark.parametrize("path, load_format, corrupt, fragment",
                         [pytest.param(*b[1:], id=b[0]) for b in STRANGE])
def test_strange_input_is_a_payload_error_naming_the_entry(path, load_format, corrupt, fragment):
    rec = sync_and_check(CASE, "compat", version=0)[0]
    chunk = corrupt(_valid_bucket(path), 0)
    before = compare.snapshot(rec.params)
    with pytest.raises(rx.PayloadError) as info:
        rec.load(chunk, load_format=load_format)
    assert fragment in str(info.value), str(info.value)
    compare.assert_unchanged(before, rec.params, rank=0)


def test_long_name_is_cut_in_the_message():
    rec = rx.ReferenceReceiver(CASE.spec, CASE.receiver, 0)
    name = "model.layers.0.mlp.experts." + "x" * 10_000
    with pytest.raises(rx.UnknownNameError) as info:
        rec.load([(name, torch.zeros(8, 8, dtype=torch.bfloat16))])
    message = str(info.value)
    assert "payload entry 0 'model.layers.0.mlp.experts.xxx" in message
    assert "... (10027 chars)" in message and len(message) < 700


def test_source_aliasing_its_own_destination_is_refused():
    rec = sync_and_check(CASE, "compat", version=0)[2]
    chunk = _valid_bucket("direct", 2)
    chunk = [(n, rec.params[n] if n == W13_0 else t) for n, t in chunk]
    before = compare.snapshot(rec.params)
    with pytest.raises(rx.MemoryOverlapError, match=r"payload entry 0 '.*w13_weight': its memory "
                                                    r"overlaps receiver parameter '.*layers\.0.*w13"):
        rec.load(chunk, load_format="direct")
    compare.assert_unchanged(before, rec.params, rank=2)


def test_source_aliasing_another_written_parameter_is_refused():
    """The last entry reads layer 1's w13, which the same bucket writes (earlier entries):
    copying in order would load already-overwritten bytes. Refused before any write."""
    rec = sync_and_check(CASE, "compat", version=0)[0]
    alias = rec.params["model.layers.1.mlp.experts.w13_weight"][0, :8, :]
    chunk = _replace(_valid_bucket("compat"), hf_expert_name(0, 0, "gate"), alias)
    before = compare.snapshot(rec.params)
    with pytest.raises(rx.MemoryOverlapError, match="payload entry 0 .*layers.1.mlp.experts.w13"):
        rec.load(chunk)
    compare.assert_unchanged(before, rec.params, rank=0)


def test_source_aliasing_a_parameter_the_bucket_does_not_write_is_loaded():
    rec = sync_and_check(CASE, "compat", version=0)[0]
    alias = rec.params["model.layers.1.mlp.experts.w13_weight"][0, :8, :]
    expected = alias[:4].clone()  # rank 0 keeps rows 0..3 of gate
    chunk = _replace(_valid_bucket("compat", layers=[0]), hf_expert_name(0, 0, "gate"), alias)
    rec.load(chunk)
    compare.assert_bitwise_equal(rec.params[W13_0][0, :4], expected, name="gate rows")


@pytest.mark.parametrize("path", ["compat", "hf_fused", "packed", "direct"])
def test_padded_requires_grad_parameters_load_in_place(path):
    """Model parameters are ``nn.Parameter(requires_grad=True)``; in-place writes to their
    views (padding zeroed included) must run under no_grad or autograd refuses them."""
    from pytest_weightsync.vocabulary import LOAD_FORMAT

    from ..harness.inputs import stream
    from ..harness.reference import check_receiver
    from pytest_weightsync.reference_impl.oracle import synth

    for rank in range(CASE.receiver.tp):
        plain = rx.ReferenceReceiver(CASE.spec, CASE.receiver, rank).params
        params = {n: torch.nn.Parameter(synth.poison_(t), requires_grad=True)
                  for n, t in plain.items()}
        rec = rx.ReferenceReceiver(CASE.spec, CASE.receiver, rank, params=params)
        before = compare.snapshot(params)
        rec.begin_update()
        for bucket in stream(path, CASE, rank, full=gathered_weights(CASE, 2)):
            rec.load(bucket, load_format=LOAD_FORMAT[path])
        rec.end_update()
        check_receiver(rec, CASE, 2, before)
        assert all(p.requires_grad and p.grad is None for p in params.values())


def test_every_public_error_class_derives_from_weight_sync_error():
    import importlib
    import inspect
    import pkgutil

    import pytest_weightsync.reference_impl as package
    from pytest_weightsync.reference_impl.model.layout import WeightSyncError

    checked, wrong = [], []
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        if info.ispkg or ".backends." in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # e.g. triton_copy without triton
            continue
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and not name.startswith("_")
                    and obj.__module__ == module.__name__):
                checked.append(f"{info.name}.{name}")
                if not issubclass(obj, WeightSyncError):
                    wrong.append(f"{info.name}.{name}")
    assert len(checked) >= 20, checked
    assert not wrong, f"error classes outside the WeightSyncError hierarchy: {wrong}"
