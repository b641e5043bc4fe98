"""The oracle's device path gives the CPU oracle's bits, and a GPU run never builds on the host.

The GPU suites build weights, payload inputs and expected states on their device, where the
oracle (:mod:`pytest_weightsync.reference_impl.oracle.synth`) takes its batched path: one set
of launches per batch of experts instead of one per expert and projection. That path runs
only off the CPU, so no CPU run would otherwise execute it. Here it is forced on the CPU
(``synth._on_cpu`` patched to answer no, the one switch between the paths) and checked equal,
bit for bit, to the per-expert CPU path and, on a sample, to the hash's plain-Python
definition - for every kind of tensor the GPU suites use: expert weights, receiver parameters
(padded, up/gate, expert parallel), engine layouts (transposed, TRT-LLM block, EPLB with
redundant experts), whole-model checkpoints and engine parameters (draft included). FP8 is
not built on a GPU by any GPU suite; its oracle keeps its per-expert path.

Then on the ``meta`` device at the real Qwen3.5-35B-A3B sizes: every evaluation of the hash
the GPU suites' builders make receives device tensors (nothing is hashed on the host and
copied over), batched (a handful of calls per layer, not one per expert).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_35b_a3b, qwen3_5_moe
from pytest_weightsync.reference_impl.oracle import model_synth, synth

h = importlib.import_module("pytest_weightsync.suites.selftest.gpu_harness")
cases = importlib.import_module("pytest_weightsync.suites.harness.cases")
inputs = importlib.import_module("pytest_weightsync.suites.harness.inputs")
judge = importlib.import_module("pytest_weightsync.suites.harness.judge")
_values = importlib.import_module("pytest_weightsync.suites.selftest.test_mutations_values")

SPEC = MoESpec(num_layers=2, num_experts=6, hidden=48, intermediate=40)
#: The receiver topologies of the GPU suites (test_gpu_ipc, test_gpu_repeated, test_gpu_model).
TOPOLOGIES = [ReceiverTopology(tp=1), ReceiverTopology(tp=2, moe_ep=2, order="up_gate"),
              ReceiverTopology(tp=2, intermediate_padded=24), ReceiverTopology(tp=2),
              ReceiverTopology(tp=4, moe_ep=2, order="up_gate", intermediate_padded=28)]
TOPOLOGY_IDS = ["tp1", "tp2-ep2-ug", "tp2-pad24", "tp2", "tp4-ep2-ug-pad28"]


@pytest.fixture
def device_path(monkeypatch):
    """Run the oracle's device path on the CPU, batches of two experts (several batches and
    a short last one per layer, as on a GPU at real sizes)."""
    monkeypatch.setattr(synth, "_on_cpu", lambda device: False)
    monkeypatch.setattr(synth, "BATCH_ELEMENTS", 2 * SPEC.hidden * SPEC.intermediate)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (what, name)
        assert torch.equal(_bits(got[name]), _bits(tensor)), f"{what}: {name} differs"


def _flat_weights(full: dict) -> dict:
    return {f"{layer}/{e}/{p}": w[p] for layer, experts in full.items()
            for e, w in enumerate(experts) for p in ("gate", "up", "down")}


def _cpu_path(build):
    """``build()`` on the per-expert CPU path, its block cache emptied first (no block the
    device path left behind can answer)."""
    synth.clear_block_cache()
    return build()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("finite", [False, True], ids=["full-spread", "finite"])
def test_expert_weights_on_the_device_path_are_the_cpu_bits(monkeypatch, dtype, finite):
    spec = MoESpec(SPEC.num_layers, SPEC.num_experts, SPEC.hidden, SPEC.intermediate, dtype)
    want = _cpu_path(lambda: synth.full_weights(spec, 3, 5, finite=finite))
    monkeypatch.setattr(synth, "_on_cpu", lambda device: False)
    monkeypatch.setattr(synth, "BATCH_ELEMENTS", 4 * spec.hidden * spec.intermediate)
    got = synth.full_weights(spec, 3, 5, finite=finite)
    _assert_same(_flat_weights(got), _flat_weights(want), f"{dtype} finite={finite}")
    # each expert tensor owns its storage, as on the CPU path (senders see the same layout)
    storages = {t.untyped_storage().data_ptr() for t in _flat_weights(got).values()}
    assert len(storages) == len(_flat_weights(got))
    assert all(t.is_contiguous() for t in _flat_weights(got).values())


def test_the_device_path_equals_the_plain_python_hash_on_a_sample(device_path):
    full = synth.full_weights(SPEC, 7, 3, layers=[1])
    for expert, projection, row, col in ((0, "gate", 0, 0), (5, "down", 47, 39),
                                         (3, "up", 17, 29), (4, "down", 2, 31)):
        got = int(_bits(full[1][expert][projection])[row, col]) & 0xFFFF
        assert got == _values._hash_in_python(3, 7, 1, expert, projection, row, col)


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=TOPOLOGY_IDS)
@pytest.mark.parametrize("finite", [False, True], ids=["full-spread", "finite"])
def test_receiver_params_on_the_device_path_are_the_cpu_bits(monkeypatch, topo, finite):
    want = [_cpu_path(lambda: h.expected_params(SPEC, topo, r, 9, "cpu", 5, finite=finite))
            for r in range(topo.world_size)]
    monkeypatch.setattr(synth, "_on_cpu", lambda device: False)
    monkeypatch.setattr(synth, "BATCH_ELEMENTS", 2 * SPEC.hidden * SPEC.intermediate)
    for rank in range(topo.world_size):
        got = h.expected_params(SPEC, topo, rank, 9, "cpu", 5, finite=finite)
        _assert_same(got, want[rank], f"{topo} rank {rank}")


@pytest.mark.parametrize("case", cases.ENGINE_CASES, ids=lambda c: c.id)
def test_engine_layouts_on_the_device_path_are_the_cpu_bits(monkeypatch, case):
    """Transposed, TRT-LLM block and EPLB engines (redundant experts: one slot per physical
    copy), as test_gpu_engine_layouts builds them, before and after a rebalance."""
    topos = [case.receiver, cases.rebalanced(case.receiver, case.spec, 1)]
    build = [(t, r) for t in topos for r in range(t.world_size)]
    want = [_cpu_path(lambda: synth.expected_engine_params(case.spec, t, r, 2, finite=True))
            for t, r in build]
    monkeypatch.setattr(synth, "_on_cpu", lambda device: False)
    monkeypatch.setattr(synth, "BATCH_ELEMENTS", 3 * case.spec.hidden * case.spec.intermediate)
    for (t, r), expected in zip(build, want):
        got = synth.expected_engine_params(case.spec, t, r, 2, device="cpu", finite=True)
        _assert_same(got, expected, f"{case.id} {t} rank {r}")


@pytest.mark.parametrize("receiver", [ReceiverTopology(tp=1), ReceiverTopology(tp=2, moe_ep=2),
                                      ReceiverTopology(tp=4, order="up_gate")],
                         ids=["tp1", "tp2-ep2", "tp4-ug"])
def test_whole_models_on_the_device_path_are_the_cpu_bits(monkeypatch, receiver):
    """The checkpoint and every engine parameter of test_gpu_model's engines (draft experts
    included), at a small Qwen3.5-MoE's shapes."""
    spec = qwen3_5_moe(linear_k_heads=4, linear_v_heads=8)
    ranks = sorted({0, receiver.world_size - 1})
    full = _cpu_path(lambda: model_synth.full_model(spec, 2))
    want = {r: _cpu_path(lambda: model_synth.expected_engine_params(spec, receiver, r, 2))
            for r in ranks}
    monkeypatch.setattr(synth, "_on_cpu", lambda device: False)
    monkeypatch.setattr(synth, "BATCH_ELEMENTS", 2 * spec.hidden * spec.intermediate)
    got = model_synth.full_model(spec, 2, device="cpu")
    _assert_same(got.dense, full.dense, "dense checkpoint tensors")
    assert sorted(got.experts) == sorted(full.experts)
    for target in full.experts:
        _assert_same(_flat_weights(got.experts[target]), _flat_weights(full.experts[target]),
                     f"{target} experts")
    for rank in ranks:
        _assert_same(model_synth.expected_engine_params(spec, receiver, rank, 2, device="cpu"),
                     want[rank], f"engine rank {rank}")


def test_conformance_inputs_and_judge_on_a_device_are_the_cpu_bits(monkeypatch):
    """The GPU speed column's inputs (``device=``): the payload stream and the expected state
    built on the device equal the CPU-built ones, and the judge passes them there."""
    case = cases.Case(SPEC, TrainerTopology(tp=2, ep=2), ReceiverTopology(tp=2))
    formats = ("direct", "packed", "compat")
    want = {fmt: _cpu_path(lambda: inputs.stream(fmt, case, 1, 4, bucket=None))
            for fmt in formats}
    want_expected = _cpu_path(lambda: inputs.expected_uncached(case, 1, 4))
    monkeypatch.setattr(synth, "_on_cpu", lambda device: False)
    monkeypatch.setattr(synth, "BATCH_ELEMENTS", 2 * SPEC.hidden * SPEC.intermediate)
    for fmt in formats:
        got = inputs.stream(fmt, case, 1, 4, bucket=None, device="cpu")
        assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in want[fmt]]
        for bucket, other in zip(got, want[fmt]):
            _assert_same(dict(bucket), dict(other), f"{fmt} stream")
    expected = inputs.expected_uncached(case, 1, 4, "cpu")
    _assert_same(expected, want_expected, "expected state")
    params = inputs.receiver_params(case, 1)
    for name, tensor in expected.items():
        params[name].copy_(tensor)
    judge.check_rank(params, case, 1, 4, device="cpu")
    _bits(params[next(iter(expected))]).view(-1)[3] ^= 1
    with pytest.raises(judge.ConformanceError, match="rank 1"):
        judge.check_rank(params, case, 1, 4, device="cpu", cached=False)


def _count_hashes(monkeypatch) -> list:
    """Record the device of every evaluation of the hash (its coordinate tensors)."""
    seen, real = [], synth._bits_at

    def counted(key, version, r, c, finite):
        seen.append((r.device.type, c.device.type,
                     key.device.type if isinstance(key, torch.Tensor) else "scalar"))
        return real(key, version, r, c, finite)

    monkeypatch.setattr(synth, "_bits_at", counted)
    return seen


def test_gpu_builders_hash_on_their_device_in_batches_at_real_sizes(monkeypatch):
    """At the GPU suites' sizes (the Qwen3.5 layer of test_gpu_ipc, the four layers and draft
    of test_gpu_model) on ``meta``: every hash evaluation is on the device, a few per layer."""
    seen = _count_hashes(monkeypatch)
    layer, topo = h.QWEN35_LAYER, ReceiverTopology(tp=2)
    full = h.full_weights(layer, 1, "meta")
    assert full[0][255].gate.device.type == "meta"
    h.expected_params(layer, topo, 1, 1, "meta")
    batches = -(-layer.num_experts // synth.experts_per_batch(layer.intermediate * layer.hidden))
    assert len(seen) <= 2 * 3 * batches, len(seen)  # not one per expert and projection (1536)
    spec = qwen3_5_35b_a3b(num_layers=4)
    model_synth.full_model(spec, 1, device="meta")
    model_synth.expected_engine_params(spec, ReceiverTopology(tp=4, order="up_gate"), 3, 1,
                                       device="meta")
    assert seen and {(r, c) for r, c, _ in seen} == {("meta", "meta")}, set(seen)
    assert {k for _, _, k in seen} <= {"meta", "scalar"}, set(seen)
    # two builds of every expert layer (target and draft) and the dense tensors: fewer calls
    # than one build of the experts alone takes on the per-expert path
    assert len(seen) < (spec.num_layers + spec.mtp_layers) * 3 * spec.num_experts, len(seen)


_KERNEL_CHECK = """
import torch
from pytest_weightsync.reference_impl.oracle import synth, synth_kernel
keys = torch.tensor([0, 1, -1, 0x2545F491, -0x61C88647, 12345], dtype=torch.int32)
rows = torch.tensor([0, 1, 2, 3, 1000, 2**20 + 7, 2**31 - 1, 2**31 + 5, 2**33 + 3,
                     *range(64, 90)]).to(torch.int32)
cols = torch.tensor([0, 1, 511, 2047, 12345, *range(100, 130)]).to(torch.int32)
for finite in (False, True):
    for version in (0, 1, 263, 0xABCDE):
        got = synth_kernel.launch(keys, version, rows, cols, finite, synth.version_mask(version))
        want = synth._bits_at(keys.reshape(-1, 1, 1), version, rows.reshape(1, -1, 1),
                              cols.reshape(1, 1, -1), finite)
        assert torch.equal(got, want), (finite, version, int((got != want).sum()))
print("same bits")
"""


def test_the_fused_gpu_kernel_computes_the_same_hash_in_the_interpreter():
    """The fused kernel the oracle uses on CUDA (``synth_kernel``), run by Triton's
    interpreter on the CPU: the torch-ops hash's bits for keys of both signs, coordinates past
    ``2**31``, several programs and a partial last one, both bit spreads. (On a GPU it is
    checked again against the torch ops before its first use there.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "same bits" in done.stdout, done.stderr[-3000:]
