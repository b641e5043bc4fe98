"""Throughput of the owner-balanced BF16 expert gather, as a share of one plain all_gather.

Every rank holds ``experts / world`` experts (expert parallelism), each an fc1 ``[2F, H]`` and an
fc2 ``[H, F]`` tensor, laid out one after another in one flat buffer as a trainer's parameter
buffer would hold them. The baseline moves the same bytes with one
``all_gather_into_tensor`` of that whole buffer; the gather moves them through the chunk plan
within each sync buffer budget. Both write into outputs of the same layout, so the run also
checks that the gather's bytes equal the baseline's. Two paths: ``direct`` (point-to-point
from the flat buffer straight into the outputs, no sync buffer) and ``staged`` (pack, in-place
all_gather into pre-allocated receive buffers, unpack). Reported: median of ``--runs`` timed runs
after ``--warmup`` (CUDA events on GPU), algorithm bandwidth and ratio gather / baseline.

    python benchmarks/bench_gather.py                      # 2 GPUs, NCCL, one Qwen3.5-35B-A3B layer
    python benchmarks/bench_gather.py --device cpu         # gloo, a small shape
    torchrun --nproc-per-node 2 benchmarks/bench_gather.py --json gather.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

MIB = 1 << 20
GPU_DEFAULTS = dict(experts=256, hidden=2048, moe_ffn=512, budget_mib=[256, 64])
CPU_DEFAULTS = dict(experts=16, hidden=256, moe_ffn=128, budget_mib=[4, 1])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--experts", type=int, help="experts of the layer (default: 256 on GPU, 16 on CPU)")
    p.add_argument("--hidden", type=int, help="hidden size H (default: 2048 on GPU, 256 on CPU)")
    p.add_argument("--moe-ffn", type=int, help="expert intermediate size F (default: 512 on GPU, 128 on CPU)")
    p.add_argument("--budget-mib", type=float, nargs="+", help="sync buffer budgets in MiB (default: 256 64 on GPU, 4 1 on CPU)")
    p.add_argument("--in-flight", type=int, default=2, help="rounds in flight (default: 2)")
    p.add_argument(
        "--path",
        nargs="+",
        choices=("direct", "staged"),
        default=["direct", "staged"],
        help="gather paths to measure: direct point-to-point from the flat buffers, or staged "
        "through pre-allocated all_gather receive buffers (default: both)",
    )
    p.add_argument("--runs", type=int, default=7, help="timed runs per measurement (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.runs < 5:
        p.error("--runs must be >= 5 (the median of at least five runs is reported)")
    return args


def resolve_defaults(args: argparse.Namespace, on_gpu: bool) -> argparse.Namespace:
    for name, value in (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


class Timer:
    """Times a callable between barriers: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        import torch.distributed as dist

        torch = self.torch
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def build_layer(args, rank: int, world: int, device):
    """This rank's flat expert buffer, its per-expert views, and the matching output views."""
    import torch

    if args.experts % world:
        raise ValueError(f"--experts {args.experts} does not divide by the world size {world}")
    local_experts = args.experts // world
    fc1, fc2 = (2 * args.moe_ffn, args.hidden), (args.hidden, args.moe_ffn)
    per_expert = 2 * args.moe_ffn * args.hidden + args.hidden * args.moe_ffn
    per_rank = local_experts * per_expert
    gen = torch.Generator(device=device).manual_seed(rank)
    src = torch.randint(-(2**15), 2**15, (per_rank,), dtype=torch.int32, device=device, generator=gen)
    src = src.to(torch.int16).view(torch.bfloat16)
    baseline_out = torch.empty(world * per_rank, dtype=torch.bfloat16, device=device)
    gather_out = torch.empty_like(baseline_out)
    local, out = {}, {}
    for owner in range(world):
        for i in range(local_experts):
            g = owner * local_experts + i
            base = i * per_expert
            for name, shape, offset in (("fc1", fc1, 0), ("fc2", fc2, fc1[0] * fc1[1])):
                numel = shape[0] * shape[1]
                key = f"{name}.e{g}"
                out[key] = gather_out[owner * per_rank + base + offset :][:numel].view(shape)
                if owner == rank:
                    local[key] = src[base + offset :][:numel].view(shape)
    return src, local, baseline_out, gather_out, out


def measure(args, rank: int, world: int, device) -> list[dict]:
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer.bf16_gather import plan_from_local, prepare_gather

    src, local, baseline_out, gather_out, out = build_layer(args, rank, world, device)
    timer = Timer(device)
    payload = baseline_out.numel() * baseline_out.element_size()

    def plain():
        dist.all_gather_into_tensor(baseline_out, src)

    rows = []
    for budget_mib, path in [(b, p) for b in args.budget_mib for p in args.path]:
        budget = int(budget_mib * MIB)
        plan = plan_from_local(local, budget, max_in_flight=args.in_flight)
        prepared = prepare_gather(plan, local, out=out, direct=path == "direct")
        gather_out.zero_()
        for _ in range(args.warmup):
            plain()
            prepared.run()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        held = prepared.run().stats.peak_buffer_bytes
        # bytes the run itself allocates on top of the buffers it holds (CPU: not measurable)
        during = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
        identical = torch.equal(gather_out.view(torch.int16), baseline_out.view(torch.int16))
        plain_s, gather_s = [], []
        for _ in range(args.runs):
            plain_s.append(timer(plain))
            gather_s.append(timer(prepared.run))
        del prepared
        t_plain, t_gather = statistics.median(plain_s), statistics.median(gather_s)
        rows.append(
            dict(
                budget_mib=budget_mib,
                path=path,
                rounds=len(plan.rounds),
                payload_mib=payload / MIB,
                plain_gbps=payload / t_plain / 1e9,
                gather_gbps=payload / t_gather / 1e9,
                ratio=t_plain / t_gather,
                plain_ms=t_plain * 1e3,
                gather_ms=t_gather * 1e3,
                buffer_mib=held / MIB,
                run_alloc_mib=during / MIB,
                within_budget=held + during <= budget,
                bit_identical=identical,
            )
        )
    return rows


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    cols = ("budget_mib", "path", "rounds", "payload_mib", "plain_gbps", "gather_gbps", "ratio", "buffer_mib", "run_alloc_mib", "within_budget", "bit_identical")
    print(" | ".join(f"{c:>13}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]:>13.3f}" if isinstance(row[c], float) else f"{row[c]!s:>13}" for c in cols))


def rank_main(rank: int, world: int, args, init_file: str | None) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if init_file is None:
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        store = dist.FileStore(init_file, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device if use_cuda else None)
    try:
        args = resolve_defaults(args, use_cuda)
        rows = measure(args, rank, world, device)
        if rank == 0:
            name = torch.cuda.get_device_name(device) if use_cuda else "CPU"
            header = (
                f"gather of {args.experts} experts (H {args.hidden}, F {args.moe_ffn}, bf16) over {world} x {name}, "
                f"{backend}, {args.in_flight} in flight, median of {args.runs} runs"
            )
            print_table(rows, header)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(header=header, world_size=world, backend=backend, args=vars(args), results=rows), f, indent=2)
        failed = [r for r in rows if not (r["bit_identical"] and r["within_budget"])]
        if failed:
            raise SystemExit(f"rank {rank}: gather not bit-identical or over budget: {failed}")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args.world_size, args, os.path.join(tmp, "store")), nprocs=args.world_size)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
