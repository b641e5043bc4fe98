"""One MoE layer as the copy-path suites move it: trainer experts in, receiver rank's pairs out.

Megatron's SequentialMLP keeps each expert in separate allocations: fc1 ``[2I, H]`` = [gate; up]
and fc2 ``[H, I]``. SGLang's fused buffers on one receiver rank of MoE-TP ``K`` are
``w13 [E, 2I/K, H]`` (that rank's gate rows, then its up rows) and ``w2 [E, H, I/K]`` (a column
slice of fc2: strided when ``K > 1``). The pair lists here are what the reference senders hand
to ``fastcopy``: ``packed`` copies whole per-expert tensors, ``direct_tpK`` the rank's slices.

Values are random 16-bit patterns viewed as bf16 (NaN payloads, infinities, subnormals and
signed zeros among them), so a copy that converts through float cannot pass a bit check.
"""

from __future__ import annotations

import torch


def trainer_experts(experts: int, hidden: int, inter: int, device="cpu", seed: int = 0):
    """``(fc1 list, fc2 list)``: one separate allocation per expert and projection pair."""
    g = torch.Generator(device=device).manual_seed(seed)

    def bits(*shape):
        return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16, device=device).view(
            torch.bfloat16
        )

    return [bits(2 * inter, hidden) for _ in range(experts)], [bits(hidden, inter) for _ in range(experts)]


def receiver_buffers(experts: int, hidden: int, inter: int, moe_tp: int, device="cpu"):
    """Zeroed ``w13 [E, 2I/K, H]`` and ``w2 [E, H, I/K]`` of one receiver rank."""
    part = inter // moe_tp
    w13 = torch.zeros(experts, 2 * part, hidden, dtype=torch.bfloat16, device=device)
    w2 = torch.zeros(experts, hidden, part, dtype=torch.bfloat16, device=device)
    return w13, w2


def receiver_pairs(fc1, fc2, w13, w2, moe_tp: int, rank: int = 0):
    """``(dst, src)`` pairs of receiver ``rank``: its gate rows, up rows and fc2 columns."""
    inter = fc2[0].shape[1]
    part = inter // moe_tp
    lo = rank * part
    pairs = []
    for e in range(len(fc1)):
        pairs.append((w13[e, :part], fc1[e][lo : lo + part]))
        pairs.append((w13[e, part:], fc1[e][inter + lo : inter + lo + part]))
        pairs.append((w2[e], fc2[e][:, lo : lo + part]))
    return pairs


def layer_pairs(path: str, experts: int, hidden: int, inter: int, device="cpu"):
    """The pairs of one layer for ``path``: ``packed`` (every expert's whole fc1 and fc2 into
    unsharded buffers) or ``direct_tpK`` (receiver rank 0 of MoE-TP K)."""
    fc1, fc2 = trainer_experts(experts, hidden, inter, device)
    if path == "packed":
        w13, w2 = receiver_buffers(experts, hidden, inter, 1, device)
        return [pair for e in range(experts) for pair in ((w13[e], fc1[e]), (w2[e], fc2[e]))]
    moe_tp = int(path.removeprefix("direct_tp"))
    return receiver_pairs(fc1, fc2, *receiver_buffers(experts, hidden, inter, moe_tp, device), moe_tp)


def layer_bytes(path: str, experts: int, hidden: int, inter: int) -> int:
    """Bytes of the receiver buffers ``path`` fills, from the shapes alone (bf16)."""
    moe_tp = 1 if path == "packed" else int(path.removeprefix("direct_tp"))
    return experts * 3 * (inter // moe_tp) * hidden * 2


def per_expert_load(fc1, fc2, w13, w2, moe_tp: int, rank: int = 0) -> None:
    """The compatible path: SGLang ``weight_loader`` style narrow + copy per (expert, shard)."""
    inter = fc2[0].shape[1]
    part = inter // moe_tp
    for e in range(len(fc1)):
        gate, up = fc1[e][:inter], fc1[e][inter:]
        w13[e].narrow(0, 0, part).copy_(gate.narrow(0, part * rank, part))
        w13[e].narrow(0, part, part).copy_(up.narrow(0, part * rank, part))
        w2[e].copy_(fc2[e].narrow(1, part * rank, part))


def nbytes(pairs) -> int:
    return sum(d.numel() * d.element_size() for d, _ in pairs)


def assert_bits_equal(pairs, experts: int) -> None:
    """Every destination holds its source's bits; names the pair, its expert (pairs are
    listed expert by expert) and the first differing element."""
    per_expert = len(pairs) // experts
    for i, (d, s) in enumerate(pairs):
        diff = (d.view(torch.int16) != s.view(torch.int16)).nonzero()
        assert diff.numel() == 0, (
            f"pair {i} (expert {i // per_expert}): first differing element at {diff[0].tolist()}"
        )
