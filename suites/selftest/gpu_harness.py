"""Device-generic scenario steps shared by the GPU suites (and run on CPU by their CPU tests).

Every step takes a ``device``: the GPU suites pass ``"cuda"``, the CPU tests of the same logic
pass ``"cpu"``, so what runs on the GPU machine is the code that was exercised here.

The oracle is :mod:`pytest_weightsync.reference_impl.oracle.synth`: expected receiver parameters are
evaluated at the layout's coordinates, never sliced from what a sender produced. Weights,
expected parameters and the poison pattern are all built on the target device (the Qwen3.5
layer is ~800M elements: minutes for a CPU thread, milliseconds on the GPU); the device
path's bits equal the CPU path's (checked on CPU by tests/test_gpu_suites_cpu.py and on the
GPU by suites/selftest/test_gpu_repeated.py).

Scenarios that run a forward pass use ``finite=True`` weights (finite normal values: a
forward over NaN or inf would hide a stale weight behind a NaN output); the IPC updates,
which only copy, use the full spread of bit patterns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.oracle import moe_forward, synth
from pytest_weightsync.reference_impl.senders import formats as senders
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    fused_name,
    receiver_shard,
)
from pytest_weightsync.reference_impl.model.locate import locate_receiver_element
from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver
from pytest_weightsync.vocabulary import LOAD_FORMAT  # noqa: F401 - the GPU suites read it here

#: The formats the GPU suites drive (hf_fused moves the same bytes as packed).
PATHS = ("compat", "packed", "direct")
#: Qwen3.5-35B-A3B: one MoE layer of 256 experts, hidden 2048, moe_ffn 512 (1.5 GiB in BF16).
QWEN35_LAYER = MoESpec(num_layers=1, num_experts=256, hidden=2048, intermediate=512)


@dataclass(frozen=True)
class Scenario:
    """A model, a receiver engine layout and the forward used to check outputs."""

    spec: MoESpec
    topo: ReceiverTopology
    tokens: int = 16
    top_k: int = 2
    seed: int = 0

    def __str__(self) -> str:
        t = self.topo
        pad = f"-pad{t.intermediate_padded}{t.pad_mode[0]}" if t.padded else ""
        return (f"L{self.spec.num_layers}E{self.spec.num_experts}H{self.spec.hidden}"
                f"I{self.spec.intermediate}-tp{t.tp}ep{t.moe_ep}dp{t.moe_dp}-{t.order}{pad}")


# --------------------------------------------------------------------------------------------
# Weights, on the device
# --------------------------------------------------------------------------------------------


def resolve(device) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``: receivers compare devices exactly, and a tensor made
    on ``"cuda"`` reports its index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def full_weights(spec: MoESpec, version: int, device, seed: int = 0, *,
                 finite: bool = False) -> dict:
    """``synth.full_weights`` built on ``device`` (same bits on every device)."""
    return synth.full_weights(spec, version, seed, device=resolve(device), finite=finite)


def expected_params(spec: MoESpec, topo: ReceiverTopology, rank: int, version: int, device,
                    seed: int = 0, *, finite: bool = False) -> dict:
    """``synth.expected_receiver_params`` built on ``device``."""
    return synth.expected_receiver_params(spec, topo, rank, version, seed,
                                          device=resolve(device), finite=finite)


def payload(path: str, spec: MoESpec, topo: ReceiverTopology, rank: int, full: dict,
            layers=None) -> list:
    """What receiver ``rank`` gets along ``path`` (compat and packed are rank independent)."""
    return senders.export(path, spec, topo, rank, full, layers)


# --------------------------------------------------------------------------------------------
# Receivers and checks
# --------------------------------------------------------------------------------------------


def make_receivers(spec: MoESpec, topo: ReceiverTopology, device) -> list:
    """One receiver per rank on ``device``, every buffer poisoned (nothing passes by luck)."""
    receivers = [ReferenceReceiver(spec, topo, r, resolve(device)) for r in range(topo.world_size)]
    for receiver in receivers:
        for tensor in receiver.params.values():
            synth.poison_(tensor)
    return receivers


def update(receivers: list, path: str, full: dict) -> None:
    """One complete update of every rank: one chunk per layer, inside an update session."""
    for receiver in receivers:
        receiver.begin_update()
        for layer in range(receiver.spec.num_layers):
            receiver.load(payload(path, receiver.spec, receiver.topo, receiver.rank, full, [layer]),
                          load_format=LOAD_FORMAT[path])
        receiver.end_update()


def locator(spec: MoESpec, topo: ReceiverTopology, rank: int):
    return functools.partial(locate_receiver_element, spec, topo, rank)


def assert_bits_equal(actual, expected, name: str, locate=None, rank=None) -> None:
    """Raw-bit equality, decided on the tensors' device; located message on failure."""
    if (actual.shape == expected.shape and actual.dtype == expected.dtype
            and torch.equal(compare.raw_bits(actual), compare.raw_bits(expected))):
        return
    compare.assert_bitwise_equal(actual, expected, name=name, locate=locate, rank=rank)
    raise AssertionError(f"{name}: torch.equal of raw bits failed but the located comparison "
                         f"found no difference")  # pragma: no cover - would be a torch bug


def assert_params_exact(params: dict, spec: MoESpec, topo: ReceiverTopology, rank: int,
                        version: int, seed: int = 0, *, finite: bool = False) -> dict:
    """Every parameter of receiver ``rank`` holds exactly ``version`` (padding zero).
    Returns the expected tensors (on the parameters' device) for further use."""
    device = next(iter(params.values())).device
    expected = expected_params(spec, topo, rank, version, device, seed, finite=finite)
    assert sorted(params) == sorted(expected), f"rank {rank}: parameter names differ"
    for name, tensor in expected.items():
        assert_bits_equal(params[name], tensor, name, locator(spec, topo, rank), rank)
    return expected


def addresses(params: dict) -> dict:
    return {name: (t.data_ptr(), tuple(t.shape), tuple(t.stride())) for name, t in params.items()}


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def forward_inputs(scenario: Scenario, device) -> tuple:
    """``(hidden [T, H] in the model dtype, router logits per layer [T, E] float32)``, seeded."""
    spec = scenario.spec
    gen = torch.Generator().manual_seed(1_000_003 + scenario.seed)
    hidden = (torch.randn(scenario.tokens, spec.hidden, generator=gen) * 0.5).to(spec.dtype)
    logits = [torch.randn(scenario.tokens, spec.num_experts, generator=gen)
              for _ in range(spec.num_layers)]
    device = resolve(device)
    return hidden.to(device), [t.to(device) for t in logits]


def _forward_call(run, params: dict, scenario: Scenario, rank: int, layer: int, hidden, logits):
    """``run`` (eager forward or graph capture) over receiver ``rank``'s ``layer`` params."""
    shard = receiver_shard(scenario.spec, scenario.topo, rank)
    return run(
        hidden, logits, params[fused_name(layer, "w13")], params[fused_name(layer, "w2")],
        top_k=scenario.top_k, expert_start=shard.experts.start, order=scenario.topo.order,
        out_dtype=torch.float32)


def forward(params: dict, scenario: Scenario, rank: int, layer: int, hidden, logits):
    """Receiver ``rank``'s partial MoE output of ``layer`` over ``params`` (float32)."""
    return _forward_call(moe_forward.moe_forward, params, scenario, rank, layer, hidden, logits)


def capture(params: dict, scenario: Scenario, rank: int, layer: int, hidden, logits):
    """A CUDA graph of :func:`forward` over the live parameters (same call, same kernels)."""
    return _forward_call(moe_forward.capture_forward, params, scenario, rank, layer, hidden, logits)


def count_differing(a, b) -> int:
    return int((compare.raw_bits(a) != compare.raw_bits(b)).sum())


# --------------------------------------------------------------------------------------------
# The scenario both the CUDA-graph and the repeated-update suites run
# --------------------------------------------------------------------------------------------


@dataclass
class UpdateLog:
    """What a run of updates checked: per update, how many output elements changed since the
    previous version (a stale forward would show 0)."""

    versions: list
    outputs_checked: int
    graph_checks: int
    changed_elements: list


def run_updates(scenario: Scenario, path: str, versions, device, *, graphs: bool = False
                ) -> UpdateLog:
    """Update every receiver rank in place to each of ``versions`` along ``path``; after each:

    * parameters bit-exact to the oracle, at the addresses they had before the first update;
    * the forward over the live parameters bit-equal to the same forward over separately built
      expected tensors (eager, same kernels and shapes);
    * with ``graphs``: CUDA graphs captured over the live parameters after the *first* update
      replay to exactly that eager output after every later one;
    * the output differs from the previous version's (the forward really reads the update).
    """
    spec, topo = scenario.spec, scenario.topo
    receivers = make_receivers(spec, topo, device)
    before = [addresses(r.params) for r in receivers]
    hidden, logits = forward_inputs(scenario, device)
    captured, previous = {}, {}
    log = UpdateLog(list(versions), 0, 0, [])
    for step, version in enumerate(versions):
        full = full_weights(spec, version, device, scenario.seed, finite=True)
        update(receivers, path, full)
        del full
        changed = 0
        for receiver in receivers:
            rank = receiver.rank
            where = f"{path} path, update {step} (version {version}), receiver rank {rank}"
            assert addresses(receiver.params) == before[rank], (
                f"{where}: a parameter was reallocated (address, shape or stride changed)")
            expected = assert_params_exact(receiver.params, spec, topo, rank, version,
                                           scenario.seed, finite=True)
            for layer in range(spec.num_layers):
                key = (rank, layer)
                eager = forward(expected, scenario, rank, layer, hidden, logits[layer])
                live = forward(receiver.params, scenario, rank, layer, hidden, logits[layer])
                assert_bits_equal(live, eager, f"{where} layer {layer}: forward over the live "
                                  f"parameters vs over the expected weights")
                log.outputs_checked += 1
                if graphs:
                    if key not in captured:
                        captured[key] = capture(receiver.params, scenario, rank, layer, hidden,
                                                logits[layer])
                    replayed = captured[key].replay().clone()
                    assert_bits_equal(replayed, eager, f"{where} layer {layer}: CUDA graph "
                                      f"captured before this update, replayed after it, vs an "
                                      f"eager forward with the new weights")
                    log.graph_checks += 1
                if key in previous:
                    diff = count_differing(eager, previous[key])
                    assert diff > 0, (f"{where} layer {layer}: output identical to the previous "
                                      f"version's: the check cannot see a stale update")
                    changed += diff
                previous[key] = eager
        log.changed_elements.append(changed)
    return log


# --------------------------------------------------------------------------------------------
# Trainer process -> receiver processes, over CUDA IPC (shared memory on CPU)
# --------------------------------------------------------------------------------------------


@dataclass
class IpcLog:
    """Per update: payload bytes sent to all ranks, the trainer's memory after releasing the
    payload, and every receiver rank's report."""

    payload_bytes: list
    trainer: list
    receivers: list


def run_ipc_updates(processes: list, spec: MoESpec, topo: ReceiverTopology, path: str, versions,
                    device, *, seed: int = 0, check: bool = True,
                    keep_payloads: bool = False) -> IpcLog:
    """The trainer side of SGLang's ``update_weights_from_tensor``, once per version.

    ``processes[r]`` (a :class:`pytest_weightsync.reference_impl.engine.process.ReceiverProcess`) is receiver rank ``r``.
    Each update: build every rank's payload on ``device``, serialize it (handles, not bytes),
    let rank ``r`` rebuild entry ``r`` and load it, then drop the payload and collect released
    blocks. Checks receiver parameter addresses after every update and, with ``check``, every
    parameter bit for bit (read back through IPC views on CUDA)."""
    from pytest_weightsync.reference_impl.sharing import ipc

    assert len(processes) == topo.world_size, "one receiver process per receiver rank"
    ptrs = [p.configure(spec, topo, r, keep_payloads=keep_payloads)
            for r, p in enumerate(processes)]
    log = IpcLog([], [], [])
    for step, version in enumerate(versions):
        full = full_weights(spec, version, device, seed)
        payloads = [payload(path, spec, topo, r, full) for r in range(topo.world_size)]
        del full
        data = ipc.serialize_per_rank(payloads)
        reports = [p.update(data[r], LOAD_FORMAT[path]) for r, p in enumerate(processes)]
        log.payload_bytes.append(sum(ipc.payload_bytes(p) for p in payloads))
        del payloads, data
        ipc.collect(device)
        log.trainer.append(ipc.memory_stats(device))
        log.receivers.append(reports)
        for rank, report in enumerate(reports):
            assert dict(report.param_ptrs) == ptrs[rank], (
                f"update {step} (version {version}): receiver rank {rank} reallocated a "
                f"parameter: addresses {dict(report.param_ptrs)} != {ptrs[rank]}")
        if check:
            for rank, process in enumerate(processes):
                params = process.params()
                assert_params_exact(params, spec, topo, rank, version, seed)
                del params
    return log


# --------------------------------------------------------------------------------------------
# Engines that do not keep the checkpoint layout (post-load layouts, redundant experts)
# --------------------------------------------------------------------------------------------


@dataclass
class EngineLog:
    """What :func:`run_engine_updates` checked: parameters and per-slot expert outputs."""

    updates: int
    params_checked: int
    outputs_checked: int


def run_engine_updates(case, path: str, device, *, updates: int = 3, tokens: int = 8
                       ) -> EngineLog:
    """``updates`` complete updates of every rank of an engine case (``cases.ENGINE_CASES``)
    along ``path``, an EPLB engine rebalanced before each later one (``cases.rebalanced``).
    After each: every parameter bit-exact in the engine's layout at an unchanged address, and
    every local slot's expert output, computed from the engine buffer read through the layout
    coordinates (``engine_layout.checkpoint_view``), bit-equal to the same forward over the
    expected weights of the logical expert the slot holds (every physical copy serves)."""
    from pytest_weightsync.reference_impl.model import engine_layout
    from pytest_weightsync.reference_impl.engine.engine_receivers import make_receiver

    from ..harness import cases, inputs

    spec, device = case.spec, resolve(device)
    topo = case.receiver
    receivers = [make_receiver(spec, topo, r, device) for r in range(topo.world_size)]
    for receiver in receivers:
        for _, tensor in receiver.named_parameters():
            synth.poison_(tensor)
    before = [addresses(dict(r.named_parameters())) for r in receivers]
    gen = torch.Generator().manual_seed(7)
    hidden = (torch.randn(tokens, spec.hidden, generator=gen) * 0.5).to(spec.dtype).to(device)
    log = EngineLog(0, 0, 0)
    for step in range(updates):
        version = step + 1
        new = cases.rebalanced(case.receiver, spec, step)
        if new != topo:
            inputs.rebalance([dict(r.named_parameters()) for r in receivers], spec, topo, new)
            receivers = [make_receiver(spec, new, r, device, dict(old.named_parameters()))
                         for r, old in enumerate(receivers)]
            topo = new
        full = full_weights(spec, version, device, finite=True)
        update(receivers, path, full)
        del full
        for receiver in receivers:
            rank, params = receiver.rank, dict(receiver.named_parameters())
            where = f"{path} path, update {step} (version {version}), receiver rank {rank}"
            assert addresses(params) == before[rank], f"{where}: a parameter was reallocated"
            want = synth.expected_engine_params(spec, topo, rank, version,
                                                        device=device, finite=True)
            for name, tensor in want.items():
                assert_bits_equal(params[name], tensor, f"{where} {name}",
                                  locator(spec, topo, rank), rank)
                log.params_checked += 1
            live = engine_layout.checkpoint_view(spec, topo, rank, params)
            canonical = synth.expected_receiver_params(spec, topo, rank, version,
                                                       device=device, finite=True)
            for layer in range(spec.num_layers):
                w13, w2 = fused_name(layer, "w13"), fused_name(layer, "w2")
                got = moe_forward.expert_outputs(hidden, live[w13], live[w2], topo.order)
                ref = moe_forward.expert_outputs(hidden, canonical[w13], canonical[w2],
                                                 topo.order)
                assert_bits_equal(got, ref, f"{where} layer {layer}: every slot's expert "
                                  f"output from the engine buffer vs the expected weights")
                log.outputs_checked += got.shape[0]
        log.updates += 1
    return log


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------


@dataclass
class ModelLog:
    """What :func:`run_model_updates` checked."""

    updates: int
    params_checked: int
    elements_checked: int


def run_model_updates(spec, receiver: ReceiverTopology, fmt: str, device, *, updates: int = 3,
                      ranks=None, bucket: str = "split_layer") -> ModelLog:
    """Whole-model refits of engine ranks ``ranks`` (default: the first and the last - the
    one that holds vocab padding) along ``fmt`` on ``device``: every engine parameter of the
    served model and its draft poisoned first, then ``updates`` complete updates through the
    reference whole-model receiver, each a new version of every checkpoint tensor, cut into
    buckets at the named limit. After each, every parameter bit-exact at an unchanged address
    (one never written keeps the poison, a stale one the previous version), located in
    checkpoint terms on failure. Checkpoint, payloads and expected values are built on
    ``device`` (Qwen3.5-35B-A3B's layers are ~800M expert elements each)."""
    from pytest_weightsync.reference_impl.senders import model_senders
    from pytest_weightsync.reference_impl.oracle import model_synth
    from pytest_weightsync.reference_impl.senders.buckets import split_buckets
    from pytest_weightsync.reference_impl.model.layout import TrainerTopology
    from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver

    from ..harness import coverage, model_inputs
    from ..harness.model_cases import ModelCase

    device = resolve(device)
    case = ModelCase(spec, receiver, TrainerTopology(), spec.targets)
    ranks = sorted({0, receiver.world_size - 1}) if ranks is None else list(ranks)
    receivers = {r: ModelReceiver(spec, receiver, r, device=device) for r in ranks}
    for rec in receivers.values():
        for tensor in rec.params.values():
            synth.poison_(tensor)
    before = {r: addresses(rec.params) for r, rec in receivers.items()}
    limit = model_inputs.bucket_bytes(bucket, spec)
    log = ModelLog(0, 0, 0)
    for step in range(updates):
        version = step + 1
        full = model_synth.full_model(spec, version, device=device)
        for rank, rec in receivers.items():
            payload = model_senders.export(fmt, spec, receiver, rank, full)
            rec.begin_update()
            for chunk in split_buckets(payload, limit):
                rec.load(chunk, load_format=LOAD_FORMAT[fmt])
            rec.end_update()
            del payload
        del full
        for rank, rec in receivers.items():
            where = f"{fmt} whole-model update {step} (version {version}), engine rank {rank}"
            assert addresses(rec.params) == before[rank], f"{where}: a parameter was reallocated"
            want = model_synth.expected_engine_params(spec, receiver, rank, version,
                                                      device=device)
            assert set(want) == set(rec.params), f"{where}: {sorted(set(want) ^ set(rec.params))[:4]}"
            locate = coverage.locator(case, rank)
            for name, tensor in want.items():
                try:
                    assert_bits_equal(rec.params[name], tensor, name, locate, rank)
                except AssertionError as error:
                    raise AssertionError(f"{where}: {error}") from None
                log.params_checked += 1
                log.elements_checked += tensor.numel()
            del want
        log.updates += 1
    return log
