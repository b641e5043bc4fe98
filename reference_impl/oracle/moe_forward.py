"""A plain torch MoE forward over one receiver rank's fused expert parameters.

It answers one question for the suites: does a receiver that was updated in place compute
what a model holding the new weights computes? So it reads the receiver's own ``w13_weight
[E_local, 2 * I_buf, H]`` and ``w2_weight [E_local, H, I_buf]`` (SGLang ``FusedMoE`` layout,
gate/up order as the receiver stores it, zero padding tolerated) and nothing else.

The computation is deliberately dense and shape-static so that a CUDA graph can be captured
over it: top-k routing of given router logits (softmax in FP32, ``torch.topk``, optional
renormalisation), every local expert applied to every token with two batched matmuls, SiLU of
the gate times the up projection, then a weighted sum in which experts that a token did not
pick have weight zero. No data-dependent shapes, no ``.item()``, no ``nonzero``: nothing waits
for the device, so the same function runs eagerly, under ``torch.cuda.graph`` capture, and on
``meta`` tensors (which is how the CPU tests prove the absence of host syncs).

Under MoE tensor parallelism a rank's result is its partial sum (the engine all-reduces it);
under MoE expert parallelism experts of other ranks contribute nothing here. Bit-exactness
across runs holds for the same kernels and shapes: compare an eager run with a graph replay of
the same call, or an eager run over the live parameters with one over separately built
expected tensors of the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pytest_weightsync.reference_impl.model.layout import GATE_UP_ORDERS, WeightSyncError, gate_up_halves


class MoEForwardError(WeightSyncError):
    """Inputs of inconsistent shape, dtype or device, or an impossible routing request."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise MoEForwardError(message)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(weights [T, k] float32, expert ids [T, k] int64)``.

    Softmax over all experts in FP32, the ``top_k`` largest, renormalised to sum to one when
    ``renormalize`` (Qwen3 MoE's ``norm_topk_prob``)."""
    _check(router_logits.dim() == 2, f"router_logits must be [tokens, experts], got shape "
           f"{tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    _check(isinstance(top_k, int) and 1 <= top_k <= num_experts,
           f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def local_combine_weights(weights: torch.Tensor, ids: torch.Tensor, expert_start: int,
                          num_local: int) -> torch.Tensor:
    """Per-(local expert, token) routing weight ``[E_local, T]`` (zero where not picked).

    Built by comparison, not scatter: each token picks an expert at most once, so every entry
    is one routing weight or zero, exactly, on every device."""
    local_ids = torch.arange(expert_start, expert_start + num_local, device=ids.device)
    picked = ids.unsqueeze(-1) == local_ids  # [T, k, E_local]
    combine = (picked.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1)  # [T, E_local]
    return combine.transpose(0, 1)


def expert_outputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   order: str = "gate_up") -> torch.Tensor:
    """Every local expert applied to every token: ``[E_local, T, H]`` in the weights' dtype.

    ``w13`` rows are ``[first half; second half]`` of ``I_buf`` rows each; ``order`` says which
    half is the gate (``"gate_up"``: the first, SGLang's default; ``"up_gate"``: the second,
    e.g. the flashinfer_cutlass runner)."""
    _check(order in GATE_UP_ORDERS, f"order must be one of {GATE_UP_ORDERS}, got {order!r}")
    num_local, two_i, h = w13.shape
    x = hidden.to(w13.dtype).unsqueeze(0).expand(num_local, -1, -1)  # [E, T, H]
    gate_up = torch.bmm(x, w13.transpose(1, 2))  # [E, T, 2I]
    halves = dict(zip(gate_up_halves(order), gate_up.split(two_i // 2, dim=-1)))
    gate, up = halves["gate"], halves["up"]
    act = F.silu(gate) * up
    return torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]


def moe_forward(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, *, top_k: int, expert_start: int = 0, order: str = "gate_up",
                renormalize: bool = True, out_dtype: Optional[torch.dtype] = None
                ) -> torch.Tensor:
    """This rank's MoE output ``[T, H]`` for ``hidden [T, H]`` routed by ``router_logits [T, E]``.

    ``w13 [E_local, 2 * I_buf, H]`` and ``w2 [E_local, H, I_buf]`` hold global experts
    ``expert_start .. expert_start + E_local - 1``. Accumulates in FP32 and returns
    ``out_dtype`` (default: ``hidden.dtype``)."""
    _check(hidden.dim() == 2, f"hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    _check(w13.dim() == 3 and w2.dim() == 3,
           f"w13 and w2 must be 3-D [E_local, ...], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_local, two_i, h = w13.shape
    tokens = hidden.shape[0]
    _check(two_i % 2 == 0, f"w13 dim 1 must be 2 * I_buf (even), got {two_i}")
    _check(hidden.shape[1] == h, f"hidden size {hidden.shape[1]} does not match w13's {h}")
    _check(tuple(w2.shape) == (num_local, h, two_i // 2),
           f"w2 shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: expected "
           f"{(num_local, h, two_i // 2)}")
    _check(w13.dtype == w2.dtype, f"w13 dtype {w13.dtype} differs from w2 dtype {w2.dtype}")
    _check(router_logits.dim() == 2 and router_logits.shape[0] == tokens,
           f"router_logits must be [tokens={tokens}, experts], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    _check(isinstance(expert_start, int) and 0 <= expert_start
           and expert_start + num_local <= num_experts,
           f"local experts {expert_start}..{expert_start + num_local - 1} do not fit in the "
           f"router's {num_experts} experts")
    devices = {hidden.device, router_logits.device, w13.device, w2.device}
    _check(len(devices) == 1, f"inputs are on different devices: {sorted(map(str, devices))}")
    weights, ids = route(router_logits, top_k, renormalize)
    combine = local_combine_weights(weights, ids, expert_start, num_local)  # [E, T]
    y = expert_outputs(hidden, w13, w2, order)  # [E, T, H]
    out = (y.to(torch.float32) * combine.unsqueeze(-1)).sum(dim=0)
    return out.to(hidden.dtype if out_dtype is None else out_dtype)


@dataclass
class CapturedForward:
    """A CUDA graph of one :func:`moe_forward` call over fixed input and parameter tensors.

    ``replay()`` recomputes ``output`` in place from whatever those tensors hold *now*: after
    an in-place weight update it must equal an eager forward with the new weights, which is
    exactly what breaks when an update reallocates a parameter instead of writing into it."""

    graph: object
    output: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def capture_forward(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, *, warmup: int = 2, **kwargs) -> CapturedForward:
    """Warm up on a side stream (as ``torch.cuda.graphs`` requires), then capture.

    The warm-up runs are real forwards; they leave the parameters untouched."""
    _check(w13.is_cuda, f"CUDA graph capture needs CUDA tensors, got {w13.device}")
    stream = torch.cuda.Stream(device=w13.device)
    stream.wait_stream(torch.cuda.current_stream(w13.device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            moe_forward(hidden, router_logits, w13, w2, **kwargs)
    torch.cuda.current_stream(w13.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = moe_forward(hidden, router_logits, w13, w2, **kwargs)
    return CapturedForward(graph, output)
