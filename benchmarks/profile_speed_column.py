"""Where the conformance speed column's GPU update spends its time, per format.

The speed column (``suites/conformance/test_speed.py::test_loader_update_throughput_on_gpu``)
times one full update of one Qwen3.5-35B-A3B layer into engine MoE-TP rank 1 of 2 through the
registered reference loader, against a plain copy of the bytes it writes, in one bucket per
update (``test_speed.GPU_BUCKET``; ``--bucket`` picks another limit). This script runs the
same update outside pytest and prints, per format, the stream's shape (buckets, entries), the
ratio, the host time of one update (before and after it waits for the device) and the top of a
``cProfile`` of repeated updates, so the host work per call and per entry can be read off.

    python benchmarks/profile_speed_column.py --device cuda [--formats packed,compat] [--top 25]
    python benchmarks/profile_speed_column.py --device cpu   # tiny layer, plan cache forced on

On CPU the layer is shrunk (hidden 64, moe_ffn 32; the same 256 experts, buckets and entries)
and the loader's plan cache, which the reference keeps only for GPU parameters, is forced on,
so the host path of a cache hit can be profiled without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from pytest_weightsync.reference_impl import impl as reference
from pytest_weightsync.reference_impl.engine.plan_cache import LoadCache
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, TrainerTopology
from pytest_weightsync.suites.conformance import test_speed
from pytest_weightsync.suites.harness import inputs, loader
from pytest_weightsync.suites.harness.cases import Case
from pytest_weightsync.timing import interleaved_samples, plain_copy
from pytest_weightsync.vocabulary import FORMATS


def case_for(device: str) -> Case:
    hidden, inter = (2048, 512) if device == "cuda" else (64, 32)
    return Case(MoESpec(num_layers=1, num_experts=256, hidden=hidden, intermediate=inter),
                TrainerTopology(tp=2, ep=4), ReceiverTopology(tp=2))


def force_plan_cache(impl) -> None:
    """Keep a plan cache for CPU parameters too (the reference keeps one for GPU ones only)."""
    caches = {}

    def cache_for(receiver, spec, topology):
        key = tuple((n, t.data_ptr()) for n, t in receiver.params.items())
        return caches.setdefault(key, LoadCache())
    impl._plan_cache_for = cache_for


def profile(fmt: str, device: str, top: int, bucket) -> None:
    case, rank = case_for(device), 1
    impl = reference.ReferenceImplementation()
    if device != "cuda":
        force_plan_cache(impl)
    params = {n: t.to(device) for n, t in inputs.receiver_params(case, rank).items()}
    stream = [[(n, t.to(device)) for n, t in b]
              for b in inputs.stream(fmt, case, rank, 1, bucket=bucket)]
    entries = sum(len(b) for b in stream)

    loader.load_stream(impl, params, stream, fmt, case, rank)  # the column's guarded warm-up
    # then the update the column times: the loader's own calls, without the per-call guard
    update = test_speed.unguarded_update(impl, params, stream, fmt, case, rank)
    update()
    written = sum(t.numel() * t.element_size() for t in inputs.expected(case, rank, 1).values())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    host = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        update()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0, time.perf_counter() - t0))
    line = (f"{fmt:<9} buckets {len(stream):>4} entries {entries:>4} "
            f"host {1e3 * statistics.median(h for h, _ in host):7.3f} ms "
            f"(+wait {1e3 * statistics.median(w for _, w in host):7.3f} ms)")
    if device == "cuda":
        rounds = interleaved_samples({"path": update, "copy": plain_copy(written, device)},
                                     device, repeats=7, warmup=2, best_of=3)
        ratios = [c / p for c, p in zip(rounds["copy"], rounds["path"])]
        line += (f" path {1e3 * statistics.median(rounds['path']):.3f} ms copy "
                 f"{1e3 * statistics.median(rounds['copy']):.3f} ms ratio "
                 f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    print(line, flush=True)
    if top:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            update()
        sync()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print("\n".join(out.getvalue().splitlines()[:top + 12]), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--top", type=int, default=0, help="cProfile rows per format (0: none)")
    p.add_argument("--bucket", default="whole",
                   help="the stream's bucket limit (a name of BUCKET_LIMITS; the speed column: whole)")
    args = p.parse_args(argv)
    for fmt in args.formats.split(","):
        profile(fmt, args.device, args.top, args.bucket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
