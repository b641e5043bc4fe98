"""One launch of each copy kernel of a full layer, for Nsight Compute.

Builds the Qwen3.5-35B-A3B layer (256 experts, hidden 2048, moe_ffn 512) at receiver MoE-TP 1
and 2, warms every plan up, then, between ``cudaProfilerStart``/``Stop``, runs once: a plain
copy of the strided rest's bytes (the yardstick), the Triton launch of the strided fc2 column
slices (MoE-TP 2), and the ``torch.cat`` runs (MoE-TP 1 and 2). Profile with

    ncu --clock-control none --profile-from-start off \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_copy_paths.py

and compare each kernel's DRAM throughput with the plain copy's.
"""

from __future__ import annotations

import sys

import torch

from bench_expert_sync import FULL_LAYER, direct_pairs, trainer_experts
from pytest_weightsync.reference_impl.kernels.fastcopy import find_runs, plan_copies


def layer_pairs(moe_tp: int):
    """Receiver rank 0's pairs of the full layer at MoE-TP ``moe_tp``, as the benchmark has them."""
    E, H, inter = FULL_LAYER["experts"], FULL_LAYER["hidden"], FULL_LAYER["moe_ffn"]
    fc1, fc2 = trainer_experts(E, H, inter, torch.bfloat16, "cuda")
    w13 = torch.empty(E, 2 * inter // moe_tp, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(E, H, inter // moe_tp, dtype=torch.bfloat16, device="cuda")
    return direct_pairs(fc1, fc2, w13, w2, moe_tp, 0)


def main() -> int:
    steps = []
    for tp in (1, 2):
        pairs = layer_pairs(tp)
        runs, rest = find_runs(pairs)
        for idx in runs:
            steps.append((f"tp{tp} cat run", plan_copies([pairs[i] for i in idx], graph=False)))
        if rest:
            strided = [pairs[i] for i in rest]
            steps.append((f"tp{tp} strided rest", plan_copies(strided, backend="triton", graph=False)))
            nbytes = sum(d.numel() * d.element_size() for d, _ in strided)
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            plain = plan_copies([(torch.empty_like(src), src)], backend="loop", graph=False)
            steps.append((f"plain copy of {nbytes >> 20} MiB", plain))
    for _, plan in steps:
        plan.run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, plan in steps:
        torch.cuda.nvtx.range_push(name)
        plan.run()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(name for name, _ in steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
