"""What one update costs each implementation: a column of the conformance matrix, and a
baseline a team can guard its own loader with.

``speed`` is a report, like hardening, never a verdict: a slow loader is not a wrong one.
Each loader runs one full update of a fixed topology (:data:`PROFILE_CASE`, or its vLLM-shaped
twin for a loader restricted to vLLM topologies: :data:`PROFILE_CASES`; every format it claims)
after a warm-up update, and the update is bit-checked like ``bit_exact``; then:

- on CPU, the deterministic profile of that update: the aten operations it dispatched, the
  bytes it wrote, the temporaries it allocated (``pytest_weightsync.opcount``, exact and the
  same on every machine); then the update timed without the profiler, a warm-up round and
  :data:`CPU_ROUNDS` rounds interleaved with a plain copy of the bytes it writes: host time
  per payload entry and the ratio to that copy, median and spread (informational: they move
  with the machine). The counts ride to the report under ``speed/<implementation>/<format>``;
  ``--weightsync-save-baseline FILE`` stores them and ``--weightsync-baseline FILE`` fails the
  run when any count rose - a per-expert copy loop planted in a loader that used to batch its
  copies is caught on any machine;
- on a GPU (``gpu`` marker, skipped on CPU), the update of one real Qwen3.5-35B-A3B layer
  (:data:`GPU_CASE`) as a ratio to one plain device copy of the same bytes in the same run,
  median and spread over rounds, guarded the same way (ratios within the tolerance); for an
  exporter the same update end to end - its export from the trainer shards, the decode, the
  reference receiver's load - as ``export_gpu_ratio``.

The matrix shows the CPU profile next to the reference's (ops and bytes written relative to
the reference on the same formats).
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from pytest_weightsync import boundary, compare, cutoff
from pytest_weightsync.deadline import CallTimeoutError
from pytest_weightsync.timing import Measurement, interleaved_samples, plain_copy
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.vocabulary import FORMATS

from ..harness import claims, inputs, judge, loader
from ..harness.cases import Case

pytestmark = pytest.mark.weightsync_property("speed")

#: The profiled topology: two layers of 16 experts, MoE-TP 2 x EP 2, a layer's experts split
#: across buckets (per-expert formats), so batching, slicing and bucket handling all show.
PROFILE_CASE = Case(MoESpec(num_layers=2, num_experts=16, hidden=64, intermediate=32),
                    TrainerTopology(tp=2, ep=2, etp=2), ReceiverTopology(tp=4, moe_ep=2))
#: The receiver rank profiled (MoE-TP rank 1, MoE-EP rank 1: slices and expert offsets).
PROFILE_RANK = 3
#: Where a loader's topologies exclude :data:`PROFILE_CASE` (vLLM has no MoE-TP x EP mix: a
#: row restricted to vLLM topologies), the same model on a vLLM-shaped engine: MoE-EP over all
#: four ranks, the last one profiled (expert offsets). The first of these a loader claims is
#: its profile, so the speed column runs for every row that claims a format.
PROFILE_CASES = ((PROFILE_CASE, PROFILE_RANK),
                 (Case(PROFILE_CASE.spec, PROFILE_CASE.trainer,
                       ReceiverTopology(tp=4, moe_ep=4)), 3))
#: The GPU-timed topology: one real Qwen3.5-35B-A3B MoE layer (256 experts, hidden 2048,
#: moe_ffn 512) on engine MoE-TP rank 1 of 2 (0.75 GiB written per update): large enough that
#: the ratio measures the loader's packing and per-entry host cost, not kernel launch latency.
GPU_CASE = Case(MoESpec(num_layers=1, num_experts=256, hidden=2048, intermediate=512),
                TrainerTopology(tp=2, ep=4), ReceiverTopology(tp=2))
GPU_RANK = 1
#: Rounds of the GPU ratio.
GPU_ROUNDS = 7
#: The GPU update's bucket limit: none, one bucket per update, as the per-update benchmark
#: sends it (``bench_e2e.py --per-update``: buckets of up to 8 GiB per engine rank, which
#: hold this 0.75 GiB layer whole), so the column and the benchmark time the same stream.
GPU_BUCKET = None


def _claimed(impl, fmt, case=PROFILE_CASE):
    claims.require_claim(impl, "loader", case, fmt)


def _profiled(impl, fmt) -> tuple:
    """``(case, rank)``: the first of :data:`PROFILE_CASES` ``impl`` claims for ``fmt``
    (skipped with the first one's reason when it claims none)."""
    for case, rank in PROFILE_CASES:
        if claims.unclaimed(impl, "loader", case, fmt) is None:
            return case, rank
    _claimed(impl, fmt, PROFILE_CASES[0][0])
    raise AssertionError("unreachable: the claim check skips")


def _entries(stream) -> int:
    return sum(len(bucket) for bucket in stream)


@pytest.mark.parametrize("payload_format", FORMATS)
def test_loader_update_profile(weightsync_loader, payload_format, throughput,
                               weightsync_record_property):
    case, rank = _profiled(weightsync_loader, payload_format)
    params = inputs.receiver_params(case, rank)
    before = compare.snapshot(params)
    warm = inputs.stream(payload_format, case, rank, 1)
    loader.load_stream(weightsync_loader, params, warm, payload_format, case, rank)
    stream = inputs.stream(payload_format, case, rank, 2)
    name = f"speed/{weightsync_loader.name}/{payload_format}"
    counts = throughput.count_ops(name, lambda: loader.load_stream(
        weightsync_loader, params, stream, payload_format, case, rank))
    judge.check_rank(params, case, rank, 2, before, previous_version=1)
    entries = _entries(stream)
    payload = sum(t.numel() * t.element_size() for bucket in stream for _, t in bucket)
    timed = timed_rounds(lambda: loader.load_stream(
        weightsync_loader, params, stream, payload_format, case, rank), counts.bytes_written)
    judge.check_rank(params, case, rank, 2, before, previous_version=1)
    per_entry = [round(1e6 * t / max(1, entries), 3) for t in timed["path"]]
    weightsync_record_property("weightsync_speed", json.dumps({
        "format": payload_format, "ops": sum(counts.ops.values()),
        "bytes_written": counts.bytes_written, "allocations": counts.allocations,
        "allocated_bytes": counts.allocated_bytes, "payload_bytes": payload,
        "entries": entries, "rounds": len(per_entry), "loops": timed["loops"],
        "host_us_per_entry": statistics.median(per_entry),
        "host_us_per_entry_min": min(per_entry), "host_us_per_entry_max": max(per_entry),
        **_ratios(timed)}))


#: Timed rounds of the CPU update (each after the profiled one and a warm-up round), and the
#: least time one sample runs: a sample repeats the update until it takes that long, as
#: pytest-benchmark calibrates, so a tiny update is not timed in the clock's noise.
CPU_ROUNDS = 5
CPU_SAMPLE_SECONDS = 0.002


def timed_rounds(update, nbytes: int) -> dict:
    """Seconds per update over :data:`CPU_ROUNDS` rounds, each round interleaved with a plain
    copy of the ``nbytes`` the update writes (the same repeats), after a warm-up round."""
    once = time.perf_counter()
    update()
    single = max(time.perf_counter() - once, 1e-7)
    loops = max(1, min(1000, int(CPU_SAMPLE_SECONDS / single) + 1))
    copy = plain_copy(max(1, nbytes), "cpu")

    def repeated(fn):
        return lambda: [fn() for _ in range(loops)]

    samples = interleaved_samples({"path": repeated(update), "copy": repeated(copy)}, "cpu",
                                  repeats=CPU_ROUNDS, warmup=1)
    return {"path": [t / loops for t in samples["path"]],
            "copy": [t / loops for t in samples["copy"]], "loops": loops}


def _ratios(timed: dict) -> dict:
    """A plain copy of the written bytes over the update, per round: median, min and max."""
    return _ratio_fields("cpu_ratio", [c / p for c, p in zip(timed["copy"], timed["path"])])


def _ratio_fields(key: str, ratios: list) -> dict:
    """``key``, ``key_min``, ``key_max``: the median and spread of per-round ratios."""
    return {key: round(statistics.median(ratios), 4), f"{key}_min": round(min(ratios), 4),
            f"{key}_max": round(max(ratios), 4)}


def gpu_ratios(impl, update, written: int, name: str, throughput) -> list:
    """Per-round ratios of a plain device copy of ``written`` bytes over ``update``
    (:func:`guarded_rounds`), the median recorded under ``name`` for the baseline guard."""
    rounds = guarded_rounds(impl, {"path": update, "copy": plain_copy(written, "cuda")})
    ratios = [c / p for c, p in zip(rounds["copy"], rounds["path"])]
    throughput.record(Measurement(name, written, statistics.median(rounds["path"]),
                                  statistics.median(rounds["copy"]), "cuda",
                                  statistics.median(ratios)))
    return ratios


@pytest.mark.gpu
@pytest.mark.parametrize("payload_format", FORMATS)
def test_loader_update_throughput_on_gpu(weightsync_loader, payload_format, throughput,
                                         weightsync_record_property):
    """The update moved onto the GPU (parameters and payload on the device): its ratio to a
    plain device copy of the bytes it writes, median and spread over rounds."""
    import torch

    _claimed(weightsync_loader, payload_format, GPU_CASE)
    case, rank = GPU_CASE, GPU_RANK
    # parameters, payload and expected state all built on the device: a CPU build of this
    # real-size layer, hashed element by element and copied over, took longer than the test
    params = inputs.receiver_params(case, rank, device="cuda")
    stream = inputs.stream(payload_format, case, rank, 1, bucket=GPU_BUCKET, device="cuda")
    before = compare.snapshot(params)

    def update():
        loader.load_stream(weightsync_loader, params, stream, payload_format, case, rank)

    update()
    torch.cuda.synchronize()
    expected = inputs.expected(case, rank, 1, "cuda")
    written = sum(t.numel() * t.element_size() for t in expected.values())
    ratios = gpu_ratios(
        weightsync_loader,
        unguarded_update(weightsync_loader, params, stream, payload_format, case, rank),
        written, f"speed-gpu/{weightsync_loader.name}/{payload_format}", throughput)
    judge.check_rank(params, case, rank, 1, device="cuda")
    compare.assert_same_storage(before, params)
    weightsync_record_property("weightsync_speed", json.dumps({
        "format": payload_format, **_ratio_fields("gpu_ratio", ratios), "bytes": written}))


@pytest.mark.gpu
@pytest.mark.parametrize("payload_format", FORMATS)
def test_exporter_update_throughput_on_gpu(weightsync_exporter, payload_format, throughput,
                                           weightsync_record_property):
    """An exporter's update end to end on the GPU: its ``export_weights`` of one real layer
    for engine rank :data:`GPU_RANK` from the trainer ranks' shards (on the device), decoded as
    that rank reads it, loaded in place by the reference receiver - as a ratio to a plain
    device copy of the bytes written, median and spread over rounds; the result bit-checked
    after the rounds."""
    import torch

    from pytest_weightsync import distributed
    from pytest_weightsync.protocols import as_stream
    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer import trainer as trainer_side

    from ..harness import reference

    claims.require_claim(weightsync_exporter, "exporter", GPU_CASE, payload_format)
    case, rank = GPU_CASE, GPU_RANK
    states = trainer_side.trainer_states(case.spec, case.trainer,
                                         synth.full_weights(case.spec, 1, device="cuda"))
    params = inputs.receiver_params(case, rank, device="cuda")
    receiver = ReferenceReceiver(case.spec, case.receiver, rank, params=params)
    export, source = weightsync_exporter.export_weights, f"{weightsync_exporter.name}.export_weights"

    def update():
        result = export(states, format=payload_format, spec=case.spec, trainer=case.trainer,
                        receiver=case.receiver, rank=rank)
        stream = as_stream(distributed.decoded_stream(
            result, engine_rank=rank, engine_tp=case.receiver.tp, source=source,
            transports_met=set()), source=source)
        reference.load_update(receiver, stream, payload_format)

    update()
    torch.cuda.synchronize()
    expected = inputs.expected(case, rank, 1, "cuda")
    written = sum(t.numel() * t.element_size() for t in expected.values())
    ratios = gpu_ratios(weightsync_exporter, update, written,
                        f"speed-gpu-export/{weightsync_exporter.name}/{payload_format}",
                        throughput)
    judge.check_rank(params, case, rank, 1, device="cuda")
    weightsync_record_property("weightsync_speed", json.dumps({
        "format": payload_format, **_ratio_fields("export_gpu_ratio", ratios),
        "export_bytes": written}))


def unguarded_update(impl, params, stream, fmt, case, rank):
    """One update as ``loader.load_stream`` makes it (``begin_update``, one ``load_weights``
    per bucket, ``end_update``), the implementation's methods looked up once and called
    directly: the harness's per-call guard (a ``SIGALRM`` timer armed and disarmed around each
    call, about 15-25 us of host time) is the harness's cost, not the loader's, and the
    benchmark it is set beside (``bench_e2e.py --per-update``) calls its engines without one.
    :func:`guarded_rounds` bounds the timed rounds as a whole instead."""
    kwargs = dict(format=fmt, spec=case.spec, topology=case.receiver, rank=rank)
    begin, end = (getattr(impl, m, None) for m in ("begin_update", "end_update"))
    begin, end = (m if callable(m) else None for m in (begin, end))
    load = impl.load_weights

    def update():
        if begin is not None:
            begin(params, **kwargs)
        for bucket in stream:
            load(params, list(bucket), **kwargs)
        if end is not None:
            end(params, **kwargs)
    return update


def guarded_rounds(impl, fns: dict) -> dict:
    """:data:`GPU_ROUNDS` interleaved rounds of ``fns`` (best of 3 each, after 2 warm-up
    rounds) under one call time limit: a loader that hangs fails its test with the stack of
    the call, as every other call into it does (``suites.harness.calls``)."""
    name = getattr(impl, "name", type(impl).__name__)
    cutoff.check(name)
    what = f"{name}: timed updates (speed column)"
    try:
        return boundary.run(what, interleaved_samples, fns, "cuda", repeats=GPU_ROUNDS,
                            warmup=2, best_of=3)
    except CallTimeoutError:
        cutoff.strike(name, what)
        raise
