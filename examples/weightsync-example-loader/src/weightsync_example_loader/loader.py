"""An SGLang-style MoE expert loader, and a copy of it with the gate/up halves swapped.

The receiver holds, per layer, ``w13_weight [E_local, 2 * I / moe_tp, H]`` and
``w2_weight [E_local, H, I / moe_tp]``. Like SGLang's ``FusedMoE.weight_loader``, this loader
maps each global expert to its local slot, narrows the rank's MoE-TP slice out of the full
tensor and copies it into the fused buffer: gate (``w1``) into the first half of ``w13`` and
up (``w3``) into the second, unless the runner loads up first. Every entry is validated before
the first byte is written, so a refused payload leaves the parameters as they were.

``SwappedGateUpLoader`` inverts that placement - the bug a flipped
``load_up_proj_weight_first`` produces - and the conformance suites name it.
"""

from __future__ import annotations

import re

import torch

from pytest_weightsync.protocols import Capabilities

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(w13|w2)_weight$")
#: SGLang's shard ids of the three expert projections.
SHARD_ID = {"gate": "w1", "up": "w3", "down": "w2"}


class ExpertPayloadError(ValueError):
    """A payload this loader refuses; nothing was written."""


def named_pairs(payload, error: type):
    """Each ``(name, tensor)`` of a bucket, once it is checked to be such a pair and carried
    once (a second entry of a name raises ``error``)."""
    seen = set()
    for i, item in enumerate(payload):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"payload entry {i} is not a (str, torch.Tensor) pair")
        name, tensor = item
        if name in seen:
            raise error(f"duplicate payload entry {name!r}")
        seen.add(name)
        yield name, tensor


class ExampleLoader:
    """Loads compat, packed and direct payloads into unpadded fused expert buffers."""

    name = "example"
    capabilities = Capabilities(formats={"compat", "packed", "direct"},
                                orders={"gate_up", "up_gate"}, padded=False)

    def load_weights(self, params, payload, *, format, spec, topology, rank) -> None:
        copies = self.plan(params, list(payload), format, spec, topology, rank)
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)

    # -- placement ----------------------------------------------------------------------------

    @staticmethod
    def placement(spec, topology, rank):
        """``(first_expert, num_local_experts, row_start, rows)`` of receiver ``rank``, from
        SGLang's rule: ``moe_tp_rank = r % moe_tp``, ``moe_ep_rank = (r // moe_tp) % moe_ep``."""
        moe_tp = topology.tp // topology.moe_ep // topology.moe_dp
        moe_tp_rank = rank % moe_tp
        moe_ep_rank = (rank // moe_tp) % topology.moe_ep
        local = spec.num_experts // topology.moe_ep
        rows = spec.intermediate // moe_tp
        return moe_ep_rank * local, local, moe_tp_rank * rows, rows

    def w13_offset(self, shard_id: str, rows: int, order: str) -> int:
        """Row offset of ``w1`` (gate) or ``w3`` (up) inside one expert's ``w13``."""
        up_first = order == "up_gate"
        if shard_id == "w1":
            return rows if up_first else 0
        return 0 if up_first else rows

    # -- validation and planning --------------------------------------------------------------

    def plan(self, params, payload, fmt, spec, topology, rank):
        """Every ``(destination view, source view)`` copy of the payload, or an error."""
        first, local, row_start, rows = self.placement(spec, topology, rank)
        entries = []
        for name, tensor in named_pairs(payload, ExpertPayloadError):
            if tensor.dtype != spec.dtype:
                raise ExpertPayloadError(f"{name!r}: dtype {tensor.dtype}, parameters are "
                                         f"{spec.dtype}")
            entries.append((name, tensor))
        if fmt == "compat":
            return self._plan_per_expert(params, entries, spec, topology, first, local,
                                         row_start, rows)
        if fmt == "packed":
            return self._plan_packed(params, entries, spec, topology, first, local, row_start,
                                     rows)
        if fmt == "direct":
            return self._plan_direct(params, entries)
        raise ExpertPayloadError(f"unknown payload format {fmt!r}")

    def _param(self, params, layer, which, shape):
        name = f"model.layers.{layer}.mlp.experts.{which}_weight"
        param = params.get(name)
        if param is None or tuple(param.shape) != shape:
            raise ExpertPayloadError(f"receiver parameter {name!r} is missing or not {shape}")
        return param

    def _expert_copies(self, params, spec, topology, layer, slot, projection, full, row_start,
                       rows):
        """SGLang's per-expert ``weight_loader``: narrow the TP slice, copy into its place."""
        if projection == "down":
            w2 = params[f"model.layers.{layer}.mlp.experts.w2_weight"]
            return [(w2[slot].narrow(1, 0, rows), full.narrow(1, row_start, rows))]
        w13 = params[f"model.layers.{layer}.mlp.experts.w13_weight"]
        offset = self.w13_offset(SHARD_ID[projection], rows, topology.order)
        return [(w13[slot].narrow(0, offset, rows), full.narrow(0, row_start, rows))]

    def _check_buffers(self, params, spec, layer, local, rows):
        self._param(params, layer, "w13", (local, 2 * rows, spec.hidden))
        self._param(params, layer, "w2", (local, spec.hidden, rows))

    def _plan_per_expert(self, params, entries, spec, topology, first, local, row_start, rows):
        owned = range(first, first + local)
        found = {}
        for name, tensor in entries:
            m = _PER_EXPERT.match(name)
            if m is None:
                raise ExpertPayloadError(f"unknown name {name!r} for the compat format "
                                         f"(expected model.layers.L.mlp.experts.E.*_proj.weight)")
            layer, expert, projection = int(m.group(1)), int(m.group(2)), m.group(3)
            if layer >= spec.num_layers or expert >= spec.num_experts:
                raise ExpertPayloadError(f"{name!r}: layer/expert out of range (num_layers="
                                         f"{spec.num_layers}, num_experts={spec.num_experts})")
            want = spec.hf_shape(projection)
            if tuple(tensor.shape) != want:
                raise ExpertPayloadError(f"{name!r}: shape {tuple(tensor.shape)}, expected {want}")
            if expert in owned:  # other ranks' experts are ignored, as in SGLang
                found.setdefault((layer, "w2" if projection == "down" else "w13"), {})[
                    (expert, projection)] = tensor
        copies = []
        # Like SGLang's per-expert weight_loader, every tensor is placed on its own: a bucket
        # may hold any subset of the experts (trainers cut buckets by bytes, not by layer).
        for (layer, which), got in sorted(found.items()):
            self._check_buffers(params, spec, layer, local, rows)
            for (expert, projection), tensor in sorted(got.items()):
                copies += self._expert_copies(params, spec, topology, layer, expert - first,
                                              projection, tensor, row_start, rows)
        return copies

    def _plan_packed(self, params, entries, spec, topology, first, local, row_start, rows):
        copies = []
        size = spec.intermediate
        halves = ("gate", "up") if topology.order == "gate_up" else ("up", "gate")
        for name, tensor in entries:
            m = _FUSED.match(name)
            if m is None:
                raise ExpertPayloadError(f"unknown name {name!r} for the packed format")
            layer, which = int(m.group(1)), m.group(2)
            if layer >= spec.num_layers:
                raise ExpertPayloadError(f"{name!r}: layer {layer} out of range")
            want = ((spec.num_experts, 2 * size, spec.hidden) if which == "w13"
                    else (spec.num_experts, spec.hidden, size))
            if tuple(tensor.shape) != want:
                raise ExpertPayloadError(f"{name!r}: shape {tuple(tensor.shape)}, expected {want} "
                                         f"(every expert, unsharded)")
            self._check_buffers(params, spec, layer, local, rows)
            for slot in range(local):
                expert = tensor[first + slot]
                if which == "w2":
                    copies += self._expert_copies(params, spec, topology, layer, slot, "down",
                                                  expert, row_start, rows)
                    continue
                for half, projection in enumerate(halves):
                    copies += self._expert_copies(params, spec, topology, layer, slot, projection,
                                                  expert.narrow(0, half * size, size),
                                                  row_start, rows)
        return copies

    def _plan_direct(self, params, entries):
        copies = []
        for name, tensor in entries:
            if _FUSED.match(name) is None or name not in params:
                raise ExpertPayloadError(f"unknown name {name!r} for the direct format (expected "
                                         f"this rank's own w13/w2 parameter names)")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ExpertPayloadError(f"{name!r}: shape {tuple(tensor.shape)}, the parameter "
                                         f"is {tuple(params[name].shape)}")
            copies.append((params[name], tensor))
        return copies


class SwappedGateUpLoader(ExampleLoader):
    """The same loader with the bug: gate goes where up belongs and up where gate belongs."""

    name = "example-swapped"

    def w13_offset(self, shard_id: str, rows: int, order: str) -> int:
        up_first = order == "gate_up"  # inverted
        if shard_id == "w1":
            return rows if up_first else 0
        return 0 if up_first else rows
