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

``packed`` and ``direct`` run through :func:`pytest_weightsync.reference_impl.fastcopy.copy_pairs` twice: with
the plan built in every call (``copy_pairs``) and with a plan built once and reused
(``plan``), which is what a sender that updates the same buffers repeatedly can do. On a GPU
they also run through ``torch._foreach_copy_`` for comparison.

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

from pytest_weightsync.throughput import machine_info, median_seconds_interleaved, plain_copy
from pytest_weightsync.reference_impl.fastcopy import copy_pairs, plan_copies

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

    # packed export: the whole layer
    w13 = torch.empty(E, 2 * inter, H, dtype=dtype, device=device)
    w2 = torch.empty(E, H, inter, dtype=dtype, device=device)
    pairs = packed_pairs(fc1, fc2, w13, w2)
    plan = plan_copies(pairs)
    fns = {
        "per_expert": lambda: per_expert_load(fc1, fc2, w13, w2, 1, 0),
        "packed/copy_pairs": lambda: copy_pairs(pairs),
        "packed/plan": plan.run,
    }
    if device.startswith("cuda"):
        fns["packed/foreach"] = lambda: copy_pairs(pairs, backend="foreach")
    bench("packed", fns, payload_bytes(pairs))
    check(pairs)
    del w13, w2, pairs, plan

    for tp in args.tp:
        if inter % tp:
            print(f"skipping MoE-TP {tp}: moe_ffn {inter} is not divisible by it", file=sys.stderr)
            continue
        w13 = torch.empty(E, 2 * inter // tp, H, dtype=dtype, device=device)
        w2 = torch.empty(E, H, inter // tp, dtype=dtype, device=device)
        pairs = direct_pairs(fc1, fc2, w13, w2, tp, 0)
        plan = plan_copies(pairs)
        fns = {
            "per_expert": lambda: per_expert_load(fc1, fc2, w13, w2, tp, 0),
            f"direct_tp{tp}/copy_pairs": lambda: copy_pairs(pairs),
            f"direct_tp{tp}/plan": plan.run,
        }
        if device.startswith("cuda"):
            fns[f"direct_tp{tp}/foreach"] = lambda: copy_pairs(pairs, backend="foreach")
        bench(f"direct_tp{tp}", fns, payload_bytes(pairs))
        check(pairs)
        del w13, w2, pairs, plan

    for r in rows:
        base = next(x for x in rows if x["group"] == r["group"] and x["path"] == "per_expert")
        r["speedup_vs_per_expert"] = base["seconds"] / r["seconds"]
    return dict(
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
        if r["path"] not in ("per_expert", "limit"):
            print(f"  {r['group']:<12} {r['path']:<24} x{r['speedup_vs_per_expert']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
