"""The whole-model reference receiver refuses bad buckets by name, before writing anything.

Each bad bucket is the valid compat (or direct) bucket of a small Qwen3.5-MoE engine rank with
one defect; the receiver must raise the named :class:`PayloadError` and leave every parameter
bit-identical, and ``end_update`` must name what an update never carried.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.compare import assert_unchanged, snapshot
from pytest_weightsync.reference_impl.engine import model_receiver as mr
from pytest_weightsync.reference_impl.senders import model_senders
from pytest_weightsync.reference_impl.oracle import model_synth, synth
from pytest_weightsync.reference_impl.engine import receiver as er
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe

pytestmark = pytest.mark.weightsync_property("reference_strictness")

SPEC = qwen3_5_moe(tied=True, router_dtype=torch.float32)
ENGINE = ReceiverTopology(tp=2)
WEIGHTS = model_synth.full_model(SPEC, 1)


def _receiver(targets=None):
    receiver = mr.ModelReceiver(SPEC, ENGINE, 1, targets=targets)
    for tensor in receiver.params.values():
        synth.poison_(tensor)
    return receiver


def _bucket(fmt="compat", targets=None):
    return [(n, t.clone()) for n, t in model_senders.export(fmt, SPEC, ENGINE, 1, WEIGHTS, targets)]


def _replace(bucket, name, tensor):
    return [(n, tensor if n == name else t) for n, t in bucket]


ROUTER = "model.layers.0.mlp.gate.weight"
BAD = {
    "fp32 router as bf16": (lambda b: _replace(b, ROUTER, dict(b)[ROUTER].to(torch.bfloat16)),
                            mr.PayloadDtypeError, "torch.float32"),
    "short in_proj_b": (lambda b: _replace(b, "model.layers.0.linear_attn.in_proj_b.weight",
                                           dict(b)["model.layers.0.linear_attn.in_proj_b.weight"][:2]),
                        er.PayloadShapeError, "in_proj_b"),
    "tied lm_head as a second source": (lambda b: b + [("lm_head.weight",
                                                        dict(b)["model.embed_tokens.weight"].clone())],
                                        mr.TiedSourceError, "one source"),
    "unknown name": (lambda b: b + [("model.layers.0.mlp.gate.bias", torch.zeros(4))],
                     mr.UnknownNameError, "not a tensor of this model's checkpoint"),
    "duplicate": (lambda b: b + [b[3]], mr.DuplicateEntryError, "duplicate"),
    "expert out of range": (lambda b: b + [("model.layers.0.mlp.experts.9.gate_proj.weight",
                                            torch.zeros(4, 8, dtype=torch.bfloat16))],
                            er.ExpertOutOfRangeError, "expert 9"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_bucket_is_refused_before_writing(kind):
    make, error, words = BAD[kind]
    receiver = _receiver()
    before = snapshot(receiver.params)
    with pytest.raises(error, match=words):
        receiver.load(make(_bucket()))
    assert_unchanged(before, receiver.params)


def test_a_frozen_draft_refuses_draft_tensors():
    receiver = _receiver(targets=("target",))
    before = snapshot(receiver.params)
    with pytest.raises(mr.FrozenTargetError, match="draft"):
        receiver.load(_bucket())
    assert_unchanged(before, receiver.params)


def test_direct_names_are_engine_names():
    receiver = _receiver()
    checkpoint = [(n, t) for n, t in _bucket("compat") if "self_attn.q_proj" in n]
    with pytest.raises(mr.UnknownNameError, match="the engine's own names"):
        receiver.load(checkpoint, load_format="direct")


def test_end_update_names_every_tensor_never_carried():
    receiver = _receiver()
    receiver.begin_update()
    bucket = [(n, t) for n, t in _bucket() if not n.startswith("mtp.")
              and not n.endswith("A_log")]
    receiver.load(bucket)
    with pytest.raises(mr.MissingParameterError) as info:
        receiver.end_update()
    message = str(info.value)
    assert "model.layers.0.linear_attn.A_log" in message and "mtp.fc.weight" in message
    assert "draft experts" in message


def test_one_update_is_one_load_format():
    receiver = _receiver()
    receiver.begin_update()
    receiver.load(_bucket("direct")[:2], load_format="direct")
    with pytest.raises(mr.MixedLoadFormatError):
        receiver.load(_bucket()[2:4])
