"""Throughput of the expert-sync sender paths against one plain copy of the same bytes.

Paths, for one MoE layer whose experts are separate per-expert allocations on the trainer
(Megatron SequentialMLP: fc1 ``[2I, H]`` = [gate; up], fc2 ``[H, I]``):

- ``limit``: one contiguous copy of the same number of bytes (what a path can at best reach);
- ``per_expert_tpK``: the compatible load, a Python loop of ``narrow`` + ``copy_`` per expert and
  shard (gate, up, down) like SGLang's ``FusedMoE.weight_loader``, into receiver rank 0 of
  MoE-TP K;
- ``packed``: the whole layer into ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (gate first);
- ``direct_tpK``: receiver rank 0's own ``w13 [E, 2I/K, H]``/``w2 [E, H, I/K]`` slices copied
  straight from the trainer tensors (strided column slices of fc2 when K > 1).

``packed`` and ``direct`` run through :mod:`pytest_weightsync.reference_impl.kernels.fastcopy` with the
plan built in every call (``copy_pairs``) and with a plan built once and reused (``plan``: what
a sender that updates the same buffers repeatedly does; on a GPU it replays a CUDA graph), plus
``plan/eager`` (reused, no graph). On a GPU, for comparison: ``triton`` (every pair through the
Triton kernel, no runs), ``foreach`` (``torch._foreach_copy_``) and ``torch`` (``torch.cat`` /
``torch.stack`` of the sources into the fused buffers, where they are whole tensors). For
``direct_tpK`` with K > 1 the ``parts`` group splits the plan into its contiguous runs and its
strided rest, each against a plain copy of its own bytes. ``--sweep`` also times the strided
rest under a grid of Triton launch shapes.

Every row reports GB/s of payload, the ratio to the ``limit`` for the same bytes measured in
the same run (interleaved, median of ``--repeats``), and the speedup over the per-expert loop
of the same receiver MoE-TP. Single-threaded (``torch.set_num_threads(1)``).

    python benchmarks/bench_expert_sync.py --device cpu --json bench-cpu.json
    python benchmarks/bench_expert_sync.py --device cuda --json bench-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pytest_weightsync.timing import machine_info, median_seconds_interleaved, plain_copy
from pytest_weightsync.reference_impl.kernels.fastcopy import copy_pairs, find_runs, plan_copies

#: Qwen3.5-35B-A3B: 256 experts, hidden 2048, moe_ffn 512 (one layer = 1.5 GiB in bf16).
FULL_LAYER = dict(experts=256, hidden=2048, moe_ffn=512)
#: CPU default: the full layer's per-expert shapes, 16 experts (96 MiB, ~15 ms a copy).
CPU_LAYER = dict(experts=16, hidden=2048, moe_ffn=512)


def trainer_experts(experts: int, hidden: int, moe_ffn: int, dtype, device):
    """Per-expert separate allocations: fc1 ``[2I, H]`` (gate rows then up rows), fc2 ``[H, I]``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    fc1 = [
        torch.randint(-(2**15), 2**15, (2 * moe_ffn, hidden), generator=g, dtype=torch.int16)
        .view(dtype)
        .to(device)
        for _ in range(experts)
    ]
    fc2 = [
        torch.randint(-(2**15), 2**15, (hidden, moe_ffn), generator=g, dtype=torch.int16)
        .view(dtype)
        .to(device)
        for _ in range(experts)
    ]
    return fc1, fc2


def packed_pairs(fc1, fc2, w13, w2):
    """The packed export: every expert of the layer, receiver gate/up order (gate first)."""
    pairs = [(w13[e], fc1[e]) for e in range(len(fc1))]
    pairs += [(w2[e], fc2[e]) for e in range(len(fc2))]
    return pairs


def direct_pairs(fc1, fc2, w13, w2, moe_tp: int, rank: int):
    """Receiver rank ``rank`` of MoE-TP ``moe_tp``: its slice of gate, up and down per expert."""
    inter = fc2[0].shape[1]
    part = inter // moe_tp
    lo = rank * part
    pairs = []
    for e in range(len(fc1)):
        if moe_tp == 1:
            pairs.append((w13[e], fc1[e]))
        else:
            pairs.append((w13[e, :part], fc1[e][lo : lo + part]))
            pairs.append((w13[e, part:], fc1[e][inter + lo : inter + lo + part]))
        pairs.append((w2[e], fc2[e][:, lo : lo + part] if moe_tp > 1 else fc2[e]))
    return pairs


def per_expert_load(fc1, fc2, w13, w2, moe_tp: int, rank: int):
    """The compatible path: a loop like SGLang's weight_loader over (gate, up, down) per expert."""
    inter = fc2[0].shape[1]
    part = inter // moe_tp
    for e in range(len(fc1)):
        gate, up = fc1[e][:inter], fc1[e][inter:]
        expert13 = w13[e]
        expert13.narrow(0, 0, part).copy_(gate.narrow(0, part * rank, part))
        expert13.narrow(0, part, part).copy_(up.narrow(0, part * rank, part))
        w2[e].copy_(fc2[e].narrow(1, part * rank, part))


def payload_bytes(pairs) -> int:
    return sum(d.numel() * d.element_size() for d, _ in pairs)


def run(args) -> dict:
    torch.set_num_threads(1)
    device = args.device
    dtype = torch.bfloat16
    E, H, inter = args.experts, args.hidden, args.moe_ffn
    fc1, fc2 = trainer_experts(E, H, inter, dtype, device)
    rows = []

    def bench(group: str, fns: dict, nbytes: int):
        fns = dict(fns)
        fns["limit"] = plain_copy(nbytes, device)
        times = median_seconds_interleaved(fns, device, repeats=args.repeats, warmup=args.warmup)
        for name, sec in times.items():
            rows.append(
                dict(
                    group=group,
                    path=name,
                    nbytes=nbytes,
                    seconds=sec,
                    gbps=nbytes / sec / 1e9,
                    ratio_to_limit=times["limit"] / sec,
                )
            )
        print_rows([r for r in rows if r["group"] == group])

    cuda = device.startswith("cuda")

    def sweep(group: str, pairs, nbytes: int):
        """The strided rest under a grid of launch shapes, each graph-captured like a reused
        plan; prints the best shapes (what TritonCopyLaunch's defaults should be)."""
        fns = {}
        for tile in (2048, 4096, 8192, 16384):
            for tpp in (1, 2, 4):
                for warps in (2, 4, 8):
                    opts = dict(tile=tile, tiles_per_program=tpp, num_warps=warps)
                    plan = plan_copies(pairs, backend="triton", graph=True, triton_options=opts)
                    fns[f"tile{tile}/tpp{tpp}/w{warps}"] = plan.run
        bench(f"{group}/sweep", fns, nbytes)
        best = sorted((r for r in rows if r["group"] == f"{group}/sweep" and r["path"] != "limit"),
                      key=lambda r: -r["ratio_to_limit"])[:5]
        print("best launch shapes for the strided rest:", ", ".join(
            f"{r['path']} {r['ratio_to_limit']:.3f}" for r in best))

    def plan_rows(group: str, pairs, per_expert, torch_fn=None):
        plan = plan_copies(pairs)
        eager = plan_copies(pairs, graph=False)
        fns = {
            "per_expert": per_expert,
            f"{group}/copy_pairs": lambda: copy_pairs(pairs),
            f"{group}/plan": plan.run,
            f"{group}/plan/eager": eager.run,
        }
        if cuda:
            fns[f"{group}/triton"] = plan_copies(pairs, backend="triton", graph=False).run
            fns[f"{group}/foreach"] = lambda: copy_pairs(pairs, backend="foreach")
            if torch_fn is not None:
                fns[f"{group}/torch"] = torch_fn
        steps[group] = [vars(s) for s in plan.steps]
        return fns, plan

    steps: dict[str, list] = {}

    # packed export: the whole layer
    w13 = torch.empty(E, 2 * inter, H, dtype=dtype, device=device)
    w2 = torch.empty(E, H, inter, dtype=dtype, device=device)
    pairs = packed_pairs(fc1, fc2, w13, w2)

    def torch_packed():
        torch.cat(fc1, out=w13.view(E * 2 * inter, H))
        torch.stack(fc2, out=w2)

    fns, plan = plan_rows("packed", pairs, lambda: per_expert_load(fc1, fc2, w13, w2, 1, 0), torch_packed)
    bench("packed", fns, payload_bytes(pairs))
    check(pairs)
    graphed = {"packed": plan.captured}
    del w13, w2, pairs, plan, fns

    for tp in args.tp:
        if inter % tp:
            print(f"skipping MoE-TP {tp}: moe_ffn {inter} is not divisible by it", file=sys.stderr)
            continue
        w13 = torch.empty(E, 2 * inter // tp, H, dtype=dtype, device=device)
        w2 = torch.empty(E, H, inter // tp, dtype=dtype, device=device)
        pairs = direct_pairs(fc1, fc2, w13, w2, tp, 0)
        group = f"direct_tp{tp}"

        def torch_direct(tp=tp, w13=w13, w2=w2):
            if tp == 1:
                torch.cat(fc1, out=w13.view(-1, H))
                torch.stack(fc2, out=w2)
            else:
                part = inter // tp
                torch.stack([x for f in fc1 for x in (f[:part], f[inter:inter + part])], out=w13.view(2 * E, part, H))
                torch.stack([f[:, :part] for f in fc2], out=w2)

        fns, plan = plan_rows(group, pairs, lambda: per_expert_load(fc1, fc2, w13, w2, tp, 0), torch_direct)
        bench(group, fns, payload_bytes(pairs))
        check(pairs)
        graphed[group] = plan.captured
        if tp > 1:
            run_idx, rest_idx = find_runs(pairs)
            contiguous = [pairs[i] for run in run_idx for i in run]
            strided = [pairs[i] for i in rest_idx]
            parts = {}
            for name, sub in (("runs", contiguous), ("rest", strided)):
                if sub:
                    parts[f"{group}/{name}"] = (plan_copies(sub).run, payload_bytes(sub))
            for name, (fn, nbytes) in parts.items():
                bench(name, {name: fn}, nbytes)
            if args.sweep and strided and cuda:
                sweep(f"{group}/rest", strided, payload_bytes(strided))
        del w13, w2, pairs, plan, fns

    for r in rows:
        base = next((x for x in rows if x["group"] == r["group"] and x["path"] == "per_expert"), None)
        if base is not None:
            r["speedup_vs_per_expert"] = base["seconds"] / r["seconds"]
    return dict(
        steps=steps,
        graphed=graphed,
        shape=dict(experts=E, hidden=H, moe_ffn=inter, dtype=str(dtype)),
        device=device,
        repeats=args.repeats,
        machine=machine_info(),
        backend=plan_copies([(torch.empty(1, device=device), torch.empty(1, device=device))]).backend,
        results=rows,
    )


def check(pairs) -> None:
    """Every benchmarked path wrote the same bits (the last one ran last; compare all pairs)."""
    for i, (d, s) in enumerate(pairs):
        if not torch.equal(d.view(torch.int16), s.view(torch.int16)):
            raise AssertionError(f"pair {i}: destination differs from its source after the benchmark")


def print_rows(rows) -> None:
    for r in rows:
        print(
            f"{r['group']:<12} {r['path']:<24} {r['nbytes'] / 2**20:9.1f} MiB "
            f"{r['gbps']:9.2f} GB/s  {r['ratio_to_limit']:6.3f} of limit"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--moe-ffn", type=int)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="receiver MoE-TP sizes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--sweep", action="store_true", help="also time Triton launch shapes on the strided rest")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be at least 5")
    default = FULL_LAYER if args.device == "cuda" else CPU_LAYER
    for k in ("experts", "hidden", "moe_ffn"):
        if getattr(args, k) is None:
            setattr(args, k, default[k])
    result = run(args)
    print("\nspeedup over the per-expert loop of the same receiver MoE-TP:")
    for r in result["results"]:
        if r["path"] not in ("per_expert", "limit") and "speedup_vs_per_expert" in r:
            print(f"  {r['group']:<12} {r['path']:<24} x{r['speedup_vs_per_expert']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
