"""An example distributed exporter, written the way RL trainers' Megatron -> HF exporters are,
and a copy of it with the bug real exporters have shipped.

It runs in every trainer rank (``export_weights_distributed``), reads the rank's own
``named_parameters()`` of the DDP-wrapped Megatron model, and uses Megatron-Core's
``parallel_state`` process groups to gather what it needs:

* over the expert tensor parallel (ETP) group: each rank's ``linear_fc1`` is
  ``[gate_r; up_r]`` (its rows of gate on top of its rows of up), so the gathered shards are
  split in two and regrouped into ``[gate_0; gate_1; ...]`` and ``[up_0; up_1; ...]``;
  ``linear_fc2`` shards are columns of ``down`` and are joined along dim 1;
* over the expert parallel (EP) group: whole experts, global id = ``ep_rank * local + i``;
* over the pipeline (PP) group: whole layers, global layer = ``pp_rank * local + l``.

Then it names the weights for SGLang (per-expert ``compat`` names, or each engine rank's own
``w13_weight`` / ``w2_weight`` for ``load_format="direct"``) and cuts them into buckets.

``UnregroupedFc1Exporter`` concatenates the ETP shards of ``linear_fc1`` as if ``[gate; up]``
were split contiguously - right when ETP is 1, wrong for every ETP > 1 layout. The
conformance suite names the first wrong (layer, expert, projection, row, col).
"""

from __future__ import annotations

import re

import torch

from pytest_weightsync.protocols import Capabilities

_SEQUENTIAL = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\."
                         r"linear_fc([12])\.weight$")
_TE_GROUPED = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")


def _local_experts(model_state):
    """``{(local_layer, local_expert, fc): tensor}`` from either Megatron expert spelling."""
    found = {}
    for name, param in model_state.items():
        m = _SEQUENTIAL.search(name)
        if m:
            found[int(m.group(1)), int(m.group(2)), int(m.group(3))] = param.detach()
            continue
        m = _TE_GROUPED.search(name)
        if m:
            found[int(m.group(1)), int(m.group(3)), int(m.group(2))] = param.detach()
    if not found:
        raise ValueError("no Megatron expert weights in the model state")
    return found


def _all_gather(tensor, group):
    """all_gather of the raw bytes (gloo has no bfloat16 all_gather on every build)."""
    import torch.distributed as dist

    tensor = tensor.contiguous()
    raw = tensor.view(-1).view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, raw, group=group)
    return [o.view(tensor.dtype).view(tensor.shape) for o in out]


class ExampleDistributedExporter:
    """Distributed exporter of compat, packed and (unpadded) direct payloads, both gate/up
    orders."""

    name = "example-exporter"
    capabilities = Capabilities(formats={"compat", "packed", "direct"}, padded=False)

    # -- gathering --------------------------------------------------------------------------

    def join_fc1(self, shards):
        """Full ``[gate; up]`` of one expert from its ETP shards, each ``[gate_r; up_r]``."""
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat(gates + ups, dim=0)

    def gather(self, model_state):
        """``{(layer, expert): (fc1 [2I, H], fc2 [H, I])}`` for every layer and expert."""
        from megatron.core import parallel_state as mpu

        local = _local_experts(model_state)
        n_layers = 1 + max(k[0] for k in local)
        n_experts = 1 + max(k[1] for k in local)
        etp = mpu.get_expert_tensor_parallel_group()
        fc1 = torch.stack([torch.stack([self.join_fc1(_all_gather(local[l, e, 1], etp))
                                        for e in range(n_experts)]) for l in range(n_layers)])
        fc2 = torch.stack([torch.stack([torch.cat(_all_gather(local[l, e, 2], etp), dim=1)
                                        for e in range(n_experts)]) for l in range(n_layers)])
        # experts: EP ranks in order; layers: PP stages in order
        fc1, fc2 = (torch.cat(_all_gather(t, mpu.get_expert_model_parallel_group()), dim=1)
                    for t in (fc1, fc2))
        fc1, fc2 = (torch.cat(_all_gather(t, mpu.get_pipeline_model_parallel_group()), dim=0)
                    for t in (fc1, fc2))
        return fc1, fc2  # [L, E, 2I, H], [L, E, H, I]

    # -- naming ------------------------------------------------------------------------------

    @staticmethod
    def compat(fc1, fc2):
        out = []
        for layer in range(fc1.shape[0]):
            for expert in range(fc1.shape[1]):
                gate, up = fc1[layer, expert].chunk(2, dim=0)
                prefix = f"model.layers.{layer}.mlp.experts.{expert}"
                out += [(f"{prefix}.gate_proj.weight", gate), (f"{prefix}.up_proj.weight", up),
                        (f"{prefix}.down_proj.weight", fc2[layer, expert])]
        return out

    @staticmethod
    def packed(fc1, fc2, receiver):
        """Unsharded ``w13_weight`` / ``w2_weight`` of every expert, halves in the receiver's
        gate/up order (for an engine-side loader that takes SGLang's fused names)."""
        inter = fc2.shape[-1]
        out = []
        for layer in range(fc1.shape[0]):
            gate, up = fc1[layer, :, :inter], fc1[layer, :, inter:]
            halves = (gate, up) if receiver.order == "gate_up" else (up, gate)
            out += [(f"model.layers.{layer}.mlp.experts.w13_weight",
                     torch.cat(halves, dim=1).contiguous()),
                    (f"model.layers.{layer}.mlp.experts.w2_weight", fc2[layer].contiguous())]
        return out

    @staticmethod
    def direct(fc1, fc2, receiver, engine_rank):
        """SGLang's FusedMoE layout of ``engine_rank``: its experts, its MoE-TP rows."""
        moe_tp = receiver.tp // receiver.moe_ep // receiver.moe_dp
        tp_rank, ep_rank = engine_rank % moe_tp, (engine_rank // moe_tp) % receiver.moe_ep
        n_local = fc1.shape[1] // receiver.moe_ep
        experts = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
        inter = fc2.shape[-1]
        rows = inter // moe_tp
        lo, hi = tp_rank * rows, (tp_rank + 1) * rows
        out = []
        for layer in range(fc1.shape[0]):
            gate, up = fc1[layer, experts, :inter], fc1[layer, experts, inter:]
            halves = (gate, up) if receiver.order == "gate_up" else (up, gate)
            w13 = torch.cat([h[:, lo:hi] for h in halves], dim=1)
            out += [(f"model.layers.{layer}.mlp.experts.w13_weight", w13.contiguous()),
                    (f"model.layers.{layer}.mlp.experts.w2_weight",
                     fc2[layer, experts, :, lo:hi].contiguous())]
        return out

    @staticmethod
    def buckets(named, bucket_bytes):
        if bucket_bytes is None:
            return [named]
        out, current, size = [], [], 0
        for name, tensor in named:
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > bucket_bytes:
                out.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += nbytes
        return out + ([current] if current else [])

    # -- the role ----------------------------------------------------------------------------

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes):
        import torch.distributed as dist

        fc1, fc2 = self.gather(model_state)

        def stream(engine_rank):
            if format == "compat":
                named = self.compat(fc1, fc2)
            elif format == "packed":
                named = self.packed(fc1, fc2, receiver)
            elif format == "direct":
                named = self.direct(fc1, fc2, receiver, engine_rank)
            else:
                raise ValueError(f"{self.name} does not produce the {format} format")
            return self.buckets(named, bucket_bytes)

        rank = dist.get_rank()
        if delivery == "colocated":
            return stream(rank % receiver.tp)
        if rank != 0:
            return None
        return {r: stream(r) for r in range(receiver.tp)}


class UnregroupedFc1Exporter(ExampleDistributedExporter):
    """The same exporter with the bug: the ETP shards of ``linear_fc1`` are concatenated as
    they come, as if each rank held a contiguous slice of ``[gate; up]``."""

    name = "example-unregrouped"

    def join_fc1(self, shards):
        return torch.cat(list(shards), dim=0)
