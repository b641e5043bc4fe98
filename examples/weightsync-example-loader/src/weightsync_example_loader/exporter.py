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

``TEGroupedExporter`` is written the way slime's exporter is: it walks the model object it is
handed (``model=``: the DDP-wrapped chunks), finds its experts in ``TEGroupedMLP`` modules by
Transformer Engine's names (``linear_fc1.weight{i}``), takes global layer ids from
``TransformerLayer.layer_number`` and global expert ids from the module's own
``num_local_experts``, and decides its ETP gathers from each parameter's
``tensor_model_parallel`` / ``partition_dim`` - correcting TE's quirk: under explicit expert
communication Megatron hands TE ``parallel_mode=None``, so ``linear_fc2`` reports
``partition_dim=0`` although its shards split dim 1.
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

    def gather_stage(self, local):
        """``(fc1 [L_stage, E, 2I, H], fc2 [L_stage, E, H, I])`` of this stage's layers (local
        numbering) from ``local`` (:func:`_local_experts`): ETP shards joined, then every EP
        rank's experts in EP-rank order. Collective over the ETP and EP groups."""
        from megatron.core import parallel_state as mpu

        n_layers = 1 + max(k[0] for k in local)
        n_experts = 1 + max(k[1] for k in local)
        etp = mpu.get_expert_tensor_parallel_group()
        fc1 = torch.stack([torch.stack([self.join_fc1(_all_gather(local[l, e, 1], etp))
                                        for e in range(n_experts)]) for l in range(n_layers)])
        fc2 = torch.stack([torch.stack([torch.cat(_all_gather(local[l, e, 2], etp), dim=1)
                                        for e in range(n_experts)]) for l in range(n_layers)])
        ep = mpu.get_expert_model_parallel_group()
        return tuple(torch.cat(_all_gather(t, ep), dim=1) for t in (fc1, fc2))

    def gather(self, model_state):
        """``(fc1 [L, E, 2I, H], fc2 [L, E, H, I])`` of every layer and expert."""
        from megatron.core import parallel_state as mpu

        fc1, fc2 = self.gather_stage(_local_experts(model_state))
        # layers: PP stages in order (every stage holds as many)
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
        fc1, fc2 = self.gather(model_state)
        return self.streams(fc1, fc2, format=format, receiver=receiver, delivery=delivery,
                            bucket_bytes=bucket_bytes)

    def streams(self, fc1, fc2, *, format, receiver, delivery, bucket_bytes):
        """What this rank returns for ``delivery``, from the full ``fc1`` / ``fc2`` stacks."""

        def named(engine_rank):
            if format == "compat":
                return self.compat(fc1, fc2)
            if format == "packed":
                return self.packed(fc1, fc2, receiver)
            if format == "direct":
                return self.direct(fc1, fc2, receiver, engine_rank)
            raise ValueError(f"{self.name} does not produce the {format} format")

        return self.deliver(named, receiver=receiver, delivery=delivery,
                            bucket_bytes=bucket_bytes)

    def deliver(self, named, *, receiver, delivery, bucket_bytes):
        """This rank's result for ``delivery`` from ``named(engine_rank)`` (that engine rank's
        ``(name, tensor)`` list): colocated, the stream of the rank's own engine rank; else
        ``{engine rank: stream}`` from rank 0 and nothing from the others."""
        import torch.distributed as dist

        rank = dist.get_rank()
        if delivery == "colocated":
            return self.buckets(named(rank % receiver.tp), bucket_bytes)
        if rank != 0:
            return None
        return {r: self.buckets(named(r), bucket_bytes) for r in range(receiver.tp)}


class UnregroupedFc1Exporter(ExampleDistributedExporter):
    """The same exporter with the bug: the ETP shards of ``linear_fc1`` are concatenated as
    they come, as if each rank held a contiguous slice of ``[gate; up]``."""

    name = "example-unregrouped"

    def join_fc1(self, shards):
        return torch.cat(list(shards), dim=0)


class TEGroupedExporter(ExampleDistributedExporter):
    """A TEGroupedMLP-only exporter that reads the model object (see the module docstring)."""

    name = "example-te-exporter"
    capabilities = Capabilities(formats={"compat", "packed", "direct"}, padded=False,
                                expert_impls={"te_grouped"})

    @staticmethod
    def partition_dim(name, param):
        """The dim this TP-sharded weight is split along: its own ``partition_dim``, except
        TE's row-parallel ``linear_fc2``, marked 0 under explicit expert comms."""
        return 1 if name == "linear_fc2" else param.partition_dim

    def gather_weight(self, name, param, group, world):
        if world == 1 or not getattr(param, "tensor_model_parallel", False):
            return param.detach()
        shards = _all_gather(param.detach(), group)
        if name == "linear_fc1":  # gated: every shard is [gate_r; up_r]
            return self.join_fc1(shards)
        return torch.cat(shards, dim=self.partition_dim(name, param))

    def gather_model(self, model):
        """``(fc1 [L, E, 2I, H], fc2 [L, E, H, I])`` from the model's TEGroupedMLP modules."""
        from megatron.core import parallel_state as mpu

        etp_group = mpu.get_expert_tensor_parallel_group()
        etp = mpu.get_expert_tensor_parallel_world_size()
        layers, fc1, fc2 = [], [], []
        for chunk in model:
            for module in chunk.modules():
                if type(module).__name__ != "TransformerLayer":
                    continue
                experts = module.mlp.experts
                if type(experts).__name__ != "TEGroupedMLP":
                    raise ValueError(f"{self.name} reads TEGroupedMLP experts, layer "
                                     f"{module.layer_number} holds {type(experts).__name__}")
                layers.append(module.layer_number - 1)
                stacks = {}
                for fc in ("linear_fc1", "linear_fc2"):
                    linear = getattr(experts, fc)
                    stacks[fc] = torch.stack([
                        self.gather_weight(fc, getattr(linear, f"weight{i}"), etp_group, etp)
                        for i in range(experts.num_local_experts)])
                fc1.append(stacks["linear_fc1"])
                fc2.append(stacks["linear_fc2"])
        fc1, fc2 = torch.stack(fc1), torch.stack(fc2)  # [L_stage, e_local, ...]
        # experts: each EP rank's block, in EP-rank order (ep_rank * num_local_experts + i)
        ep = mpu.get_expert_model_parallel_group()
        fc1, fc2 = (torch.cat(_all_gather(t, ep), dim=1) for t in (fc1, fc2))
        # layers: every stage's, placed by their global layer numbers
        pp = mpu.get_pipeline_model_parallel_group()
        ids = torch.cat(_all_gather(torch.tensor(layers, dtype=torch.int64), pp))
        fc1, fc2 = (torch.cat(_all_gather(t, pp), dim=0) for t in (fc1, fc2))
        order = torch.argsort(ids)
        return fc1[order], fc2[order]

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None):
        if model is None:
            raise ValueError(f"{self.name} reads the model object (model=); none was given")
        fc1, fc2 = self.gather_model(model)
        return self.streams(fc1, fc2, format=format, receiver=receiver, delivery=delivery,
                            bucket_bytes=bucket_bytes)


class TrustingPartitionDimExporter(TEGroupedExporter):
    """The TEGroupedMLP exporter with the bug: it trusts ``partition_dim`` on ``linear_fc2``
    too, so under explicit expert comms (TE reports 0) it joins fc2's ETP shards along dim 0."""

    name = "example-te-trusting"

    @staticmethod
    def partition_dim(name, param):
        return param.partition_dim
