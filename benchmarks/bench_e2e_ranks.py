"""The colocated update with one trainer rank and one engine rank per GPU, against a plain copy
on every GPU at once.

``bench_e2e.py`` runs every engine rank of MoE-TP N on one GPU: their copies share that GPU's
time slices, which no colocated deployment does (each GPU holds one trainer rank and one
engine rank). Here, at MoE-TP N, N trainer-rank processes run side by side, process ``r`` on
GPU ``r`` (CPU: all on the host) with

* the trainer's expert weights (``bench_e2e.ExpertsPart``: the whole gathered model, or with
  ``--trainer-etp`` the ETP shards, of which it sends its own),
* one engine process, receiver rank ``r`` of MoE-TP N, on the same device,
* ``ColocatedSender(receivers=[r])`` and ``ColocatedSync`` over that one engine: it builds,
  stages and shares rank ``r``'s payload only (registered once, or ``--per-update``: SGLang's
  ``update_weights_from_tensor``, every bucket serialized again every update),
* a plain copy of the bytes its engine receives (``written_bytes / N``).

The ranks start every update and every plain copy together (a barrier). Per round the
update's time is the slowest rank's and the limit the slowest rank's plain copy; the ratio is
their quotient, reported as median [min, max] over rounds. After every update each rank's
engine digest goes to this process, which adds them up and compares the sum with the
trainer's digest (every rank holds the same trainer weights); after the last each engine
checks every bit against the oracle and parameter addresses may never change.

    python benchmarks/bench_e2e_ranks.py --device cuda --tp 2 --layers 8 --per-update --trainer-etp
    python benchmarks/bench_e2e_ranks.py --device cpu --tp 2          # tiny, a CPU check

Options are ``bench_e2e.py``'s (``--per-tensor`` and ``--ranks-in-turn`` do not apply). On CUDA
MoE-TP N needs N visible GPUs.
"""

from __future__ import annotations

import argparse
import io
import contextlib
import json
import multiprocessing
import os
import queue as queue_errors
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_e2e  # noqa: E402


def rank_main(rank: int, tp: int, options: dict, barrier, results) -> None:
    """One trainer rank: its weights, engine and sender on device ``rank``; puts ``("ok",
    rank, rows, digest logs, printed text)`` or ``("error", rank, traceback)`` on ``results``."""
    import torch

    from pytest_weightsync.reference_impl.engine.process import ReceiverProcess
    from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology

    engine = None
    try:
        torch.set_num_threads(1)
        args = argparse.Namespace(**options)
        device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        spec = MoESpec(num_layers=args.layers, num_experts=args.experts, hidden=args.hidden,
                       intermediate=args.moe_ffn)
        topo = ReceiverTopology(tp=tp)
        poll_s = args.engine_poll_ms / 1e3 if device.type == "cuda" else 0.0
        engine = ReceiverProcess(str(device), timeout=args.timeout, poll_s=poll_s)
        engine.start()
        ptrs = {rank: engine.configure(spec, topo, rank)}
        logs: list = []
        args.receivers, args.barrier, args.digest_log, args.progress = (rank,), barrier.wait, logs, None
        rows, failures, masks = [], [], bench_e2e.Masks()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            part = bench_e2e.ExpertsPart(spec, device)
            limit = bench_e2e.PlainCopy(part.written_bytes(topo) // tp, device, args.chunk_mib << 20)
            if args.registered:
                rows += bench_e2e.registered_rows(part, [engine], topo, tp, args, masks, limit,
                                                  ptrs, failures)
            if args.per_update:
                rows += bench_e2e.per_update_rows(part, [engine], topo, tp, args, masks, limit,
                                                  ptrs, failures)
            del part
            bench_e2e.release(device)
            sub = bench_e2e.shard_rows_args(args, tp)
            if sub is not None:
                rows += bench_e2e.trainer_etp_rows(spec, [engine], topo, tp, sub, masks, limit,
                                                   ptrs, failures)
        results.put(("ok", rank, rows, logs, printed.getvalue()))
    except BaseException:
        barrier.abort()  # the other ranks stop at their next barrier instead of waiting
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if engine is not None:
            engine.close()


def combine(per_rank: list, digest_logs: list) -> tuple[list, list]:
    """One row per (path, format) from every rank's rows: per round the slowest rank's update
    and plain copy, the stages' slowest rank, the bits of every rank, the digests added up."""
    rows, failures = [], []
    for index, ranks in enumerate(zip(*per_rank)):
        first = ranks[0]
        walls = [max(r["walls_s"][k] for r in ranks) for k in range(len(first["walls_s"]))]
        plains = [max(r["plain_copies_s"][k] for r in ranks) for k in range(len(walls))]
        ratios = [p / w for p, w in zip(plains, walls)]
        problems = [f"rank {rank}: {r['bits']}" for rank, r in enumerate(ranks) if r["bits"] != "exact"]
        logs = [log[index] for log in digest_logs]
        for update, per_rank_digests in enumerate(zip(*logs), start=1):
            got = [d for engines, _ in per_rank_digests for d in engines]
            total = (sum(d[0] for d in got), sum(d[1] for d in got))
            expected = {tuple(trainer) for _, trainer in per_rank_digests}
            if len(expected) != 1 or total != next(iter(expected)):
                problems.append(f"update {update}: engines' digests add up to {total}, "
                                f"the trainer's {sorted(expected)}")
                break
        row = dict(first, rank_per_gpu=True, gpus=len(ranks),
                   entries=sum(r["entries"] for r in ranks), storages=sum(r["storages"] for r in ranks),
                   staged_bytes=sum(r["staged_bytes"] for r in ranks),
                   walls_s=walls, plain_copies_s=plains,
                   wall_s=statistics.median(walls), plain_copy_s=statistics.median(plains),
                   ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                   bits="exact" if not problems else "; ".join(problems),
                   per_rank=[{k: r[k] for k in ("export_s", "serialize_s", "receive_s", "load_s",
                                                "synchronize_s", "wall_s", "plain_copy_s")}
                             for r in ranks])
        for key in ("export_s", "serialize_s", "receive_s", "load_s", "synchronize_s"):
            row[key] = max(r[key] for r in ranks)
        if problems:
            failures.append(f"{row['path']} {row['format']} MoE-TP {row['moe_tp']}"
                            f"{bench_e2e._etp_label(row['trainer_etp'])}"
                            f", one rank per GPU: {row['bits']}")
        rows.append(row)
    return rows, failures


def run_ranks(args, tp: int) -> tuple[list, list]:
    """MoE-TP ``tp`` with one trainer rank per device (see the module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(tp, timeout=args.timeout)
    results = ctx.Queue()
    options = {k: v for k, v in vars(args).items() if k not in ("progress", "json")}
    # Not daemonic: each rank starts its engine process.
    procs = [ctx.Process(target=rank_main, args=(rank, tp, options, barrier, results),
                         name=f"bench-e2e-rank{rank}") for rank in range(tp)]
    got: dict = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.timeout * (4 + 3 * (args.warmup + args.repeats))
        while len(got) < tp:
            try:
                message = results.get(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except queue_errors.Empty:
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"rank process(es) {dead or 'still running'} gave no result")
                continue
            got[message[1]] = message
    finally:
        for proc in procs:
            proc.join(timeout=30 if len(got) == tp else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    errors = [m for m in got.values() if m[0] == "error"]
    if errors:  # the first rank that failed by itself, not at a barrier another rank broke
        own = [m for m in errors if "BrokenBarrierError" not in m[2]] or errors
        raise RuntimeError(f"rank {own[0][1]} failed:\n{own[0][2]}")
    for rank in range(tp):
        for line in got[rank][4].splitlines():
            print(f"    rank {rank}: {line}")
    return combine([got[r][2] for r in range(tp)], [got[r][3] for r in range(tp)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_e2e.add_arguments(p)
    args = p.parse_args(argv)
    bench_e2e.check_arguments(p, args)
    if args.per_tensor or args.ranks_in_turn:
        p.error("--per-tensor and --ranks-in-turn do not apply to one engine rank per GPU")
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp):
        p.error(f"MoE-TP {max(args.tp)} with one rank per GPU needs {max(args.tp)} GPUs, "
                f"{torch.cuda.device_count()} visible")
    rows, failures = [], []
    for tp in args.tp:
        got, bad = run_ranks(args, tp)
        for row in got:
            bench_e2e.print_row(row)
        rows += got
        failures += bad
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=rows, failures=failures, rank_per_gpu=True,
                           machine=bench_e2e.machine_info()), f, indent=2)
        print(f"wrote {args.json}")
    if failures:
        print("BIT CHECK FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
