"""An SGLang-style LoRA adapter loader: an adapter's A and B into one engine rank's slot.

An RL trainer that syncs a LoRA adapter instead of the merged model hands the engine the
adapter's tensors as Megatron-Bridge exports them (``<module>.lora_A.weight`` ``[r, in]``,
``<module>.lora_B.weight`` ``[out, r]``, unsharded, routed experts per expert). SGLang keeps
adapters in per-slot buffers, one A and one B per engine module, slot first:

* fused column-parallel modules stack their sources: ``qkv_proj`` A holds q, k, v along the rank
  dim (x3), ``gate_up_proj`` gate, up (x2); B holds this TP rank's rows of each source where the
  base parameter holds them (q by rank, k/v by KV head - a head shared by ``tp / kv_heads``
  ranks when there are fewer KV heads than ranks; the example's model loader owns that rule);
* row-parallel modules (``o_proj``, ``down_proj``) take A's columns of this rank, B whole;
* routed experts live in ``[E_local, ...]`` buffers of this EP rank, with the intermediate rows
  of its MoE-TP rank, and their B is multiplied by ``alpha / r`` as it is copied; dense modules
  keep the scaling per slot in ``scalings``.

The buffer names come from ``slots`` (the engine's), the sizes from ``adapter.model`` and
``topology``. Every tensor is checked and placed before anything is written - a name it cannot
place, a shape or dtype the adapter's rank and model do not give, an A without its B, a tensor
this rank needs that never arrived: a ``ValueError`` naming the tensor, and the slot as it was.
A load overwrites the slot whole (no mix of two versions); the staged tensors and the base
weights (``params``) are never written.
"""

from __future__ import annotations

import re

import torch

from pytest_weightsync.protocols import Capabilities
from weightsync_example_loader.loader import ExampleLoader, named_pairs
from weightsync_example_loader.model_loader import ModelLoading

_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp\.shared_expert|mlp\.experts\.(\d+))"
                   r"\.(q|k|v|o|gate|up|down)_proj\.lora_(A|B)\.weight$")
_BUFFER = re.compile(r"^model\.layers\.(\d+)\.(?:(?:self_attn\.)?(qkv_proj|o_proj)|mlp\.shared_"
                     r"expert\.(gate_up_proj|down_proj)|mlp\.experts\.(gate_up|down))\.lora_[AB]$")
#: source projection -> (SGLang's stacked module, index in its stack; None: row-parallel)
_STACK = {"q": ("qkv_proj", 0), "k": ("qkv_proj", 1), "v": ("qkv_proj", 2), "o": ("o_proj", None),
          "gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", None)}
#: stacked module -> the source projections it holds
_SOURCES = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"),
            "down_proj": ("down",), "gate_up": ("gate", "up"), "down": ("down",)}
SCALINGS = "scalings"


class AdapterPayloadError(ValueError):
    """An adapter this loader refuses; nothing was written."""


def _narrow(name, tensor, dim, start, size):
    if start < 0 or start + size > tensor.shape[dim]:
        raise AdapterPayloadError(f"{name}: [{start}, {start + size}) of dim {dim} is outside "
                                  f"{tuple(tensor.shape)}")
    return tensor.narrow(dim, start, size)


class ExampleAdapterLoader:
    """Loads adapters into SGLang's per-slot LoRA buffers (``Capabilities.lora``)."""

    name = "example-adapter"
    capabilities = Capabilities(lora={"sglang"})

    def load_adapter(self, params, slots, payload, *, adapter, topology, rank, slot,
                     layout) -> None:
        """Write the adapter in ``payload`` into ``slot``: planned and checked whole first, so
        a refused adapter leaves the slot (and the other slots) as they were."""
        if layout != "sglang":
            raise AdapterPayloadError(f"this loader reads SGLang's adapter buffers, not {layout!r}")
        copies = self.plan(slots, list(payload), adapter, topology, rank, slot)
        with torch.no_grad():
            for buffer in slots.values():
                buffer[slot].zero_()  # the previous adapter of the slot goes whole
            slots[SCALINGS][slot] = adapter.scaling
            for dst, src, scaled in copies:
                if scaled:  # into the slot, out of place: the staged B stays unscaled
                    torch.mul(src, adapter.scaling, out=dst)
                else:
                    dst.copy_(src)

    def evict_adapter(self, slots, *, slot, **_) -> None:
        """Free ``slot``: every buffer of it zeroed."""
        with torch.no_grad():
            for buffer in slots.values():
                buffer[slot].zero_()

    # -- validation and planning --------------------------------------------------------------

    def plan(self, slots, payload, adapter, topology, rank, slot):
        """Every ``(destination view, source view, scaled)`` copy of the adapter, or an error."""
        if SCALINGS not in slots or not 0 <= slot < slots[SCALINGS].shape[0]:
            raise AdapterPayloadError(f"slot {slot} is not one of the engine's adapter slots")
        tensors = {}
        for name, tensor in named_pairs(payload, AdapterPayloadError):
            where = self._parse(name, adapter)
            want = self._full_shape(adapter, where)
            if tuple(tensor.shape) != want or tensor.dtype != adapter.dtype:
                raise AdapterPayloadError(f"{name!r} is {tuple(tensor.shape)} {tensor.dtype}; an "
                                          f"adapter of rank {adapter.rank} needs {want} "
                                          f"{adapter.dtype}")
            tensors[name] = (where, tensor)
        for name in tensors:
            partner = name[:-len("A.weight")] + ("B" if name.endswith("A.weight") else "A")
            partner += ".weight"
            if partner not in tensors:
                raise AdapterPayloadError(f"{name!r} arrived without {partner!r}")
        missing = sorted(self._needed(slots, adapter, topology, rank) - set(tensors))
        if missing:
            raise AdapterPayloadError(f"the adapter lacks {len(missing)} tensors this rank "
                                      f"holds, first {missing[0]!r}")
        copies = []
        for name, (where, tensor) in tensors.items():
            for dst, src, scaled in self._place(slots, name, where, tensor, adapter, topology,
                                                rank, slot):
                if dst.shape != src.shape or dst.dtype != src.dtype:
                    raise AdapterPayloadError(f"{name!r}: its part {tuple(src.shape)} does not "
                                              f"fit the engine's {tuple(dst.shape)} {dst.dtype}")
                copies.append((dst, src, scaled))
        return copies

    @staticmethod
    def _parse(name, adapter):
        """``(layer, group, expert, projection, "A" | "B")`` of an adapter tensor's name."""
        m = _NAME.match(name)
        if m is None:
            hint = (" (the 3-D expert layout; this loader reads the per-expert names "
                    "'...mlp.experts.<e>.gate_proj.lora_A.weight')"
                    if re.search(r"\.mlp\.experts\.(gate_up|down)_proj\.", name) else "")
            raise AdapterPayloadError(f"{name!r} is no lora_A / lora_B this loader can place"
                                      f"{hint}")
        layer, group, expert, proj, which = m.groups()
        if int(layer) >= adapter.model.num_layers:
            raise AdapterPayloadError(f"{name!r}: layer {layer} outside the model")
        if f"{proj}_proj" not in adapter.modules:
            raise AdapterPayloadError(f"{name!r}: the adapter does not target {proj}_proj")
        if expert is not None and (not adapter.experts
                                   or int(expert) >= adapter.model.num_experts):
            raise AdapterPayloadError(f"{name!r}: not an expert the adapter has LoRA for")
        return int(layer), group, None if expert is None else int(expert), proj, which

    @staticmethod
    def _full_shape(adapter, where):
        """The unsharded shape of an A (``[r, in]``) or B (``[out, r]``), from the model."""
        spec, r = adapter.model, adapter.rank
        _, group, expert, proj, which = where
        if group == "self_attn":
            q, kv, _ = ModelLoading._sizes(spec)["qkv_proj"]
            inner = spec.num_heads * spec.head_dim  # o_proj's input: no output gate
            out_in = {"q": (q, spec.hidden), "k": (kv, spec.hidden), "v": (kv, spec.hidden),
                      "o": (spec.hidden, inner)}[proj]
        else:
            inter = spec.intermediate if expert is not None else spec.intermediate_shared
            out_in = (spec.hidden, inter) if proj == "down" else (inter, spec.hidden)
        return (r, out_in[1]) if which == "A" else (out_in[0], r)

    @staticmethod
    def _needed(slots, adapter, topology, rank):
        """The tensor names this rank's buffers take: every targeted source of every buffer."""
        first, local, _, _ = ExampleLoader.placement(adapter.model, topology, rank)
        needed = set()
        for buffer in slots:
            if buffer == SCALINGS:
                continue
            m = _BUFFER.match(buffer)
            if m is None:
                raise AdapterPayloadError(f"engine buffer {buffer!r} is not one this loader knows")
            layer, attn, shared, experts = m.groups()
            module = attn or shared or experts
            group = "self_attn" if attn else "mlp.shared_expert" if shared else None
            heads = ([group] if group else
                     [f"mlp.experts.{e}" for e in range(first, first + local)])
            for head in heads:
                for proj in _SOURCES[module]:
                    if f"{proj}_proj" in adapter.modules:
                        needed |= {f"model.layers.{layer}.{head}.{proj}_proj.lora_{w}.weight"
                                   for w in "AB"}
        return needed

    def _place(self, slots, name, where, tensor, adapter, topology, rank, slot):
        """``[(dst, src, scaled)]`` of one tensor on this rank (none: another EP rank's expert)."""
        layer, group, expert, proj, which = where
        r, spec = adapter.rank, adapter.model

        def buffer(candidates):
            for base in candidates:
                if f"{base}.lora_{which}" in slots:
                    return slots[f"{base}.lora_{which}"][slot]
            raise AdapterPayloadError(f"{name!r}: the engine has no buffer "
                                      f"{candidates[0]}.lora_{which}")

        if expert is not None:
            first, local, row_start, rows = ExampleLoader.placement(spec, topology, rank)
            if not first <= expert < first + local:
                return []
            kind = "down" if proj == "down" else "gate_up"
            dst = buffer([f"model.layers.{layer}.mlp.experts.{kind}"])[expert - first]
            if proj == "down":  # row-parallel: A's columns of this MoE-TP rank, B whole
                if which == "A":
                    return [(dst, _narrow(name, tensor, 1, row_start, rows), False)]
                return [(dst, tensor, True)]
            half = _STACK[proj][1]
            if which == "A":
                return [(_narrow(name, dst, 0, half * r, r), tensor, False)]
            return [(_narrow(name, dst, 0, half * rows, rows),
                     _narrow(name, tensor, 0, row_start, rows), True)]

        module, stack = _STACK[proj]
        prefix = f"model.layers.{layer}."
        candidates = ([f"{prefix}self_attn.{module}", f"{prefix}{module}"]
                      if group == "self_attn" else [f"{prefix}mlp.shared_expert.{module}"])
        dst = buffer(candidates)
        if stack is None:  # row-parallel: A's columns of this TP rank, B whole
            if which == "A":
                cols = dst.shape[1]
                return [(dst, _narrow(name, tensor, 1, rank * cols, cols), False)]
            return [(dst, tensor, False)]
        if which == "A":  # column-parallel: A whole, at its place in the stack
            return [(_narrow(name, dst, 0, stack * r, r), tensor, False)]
        offset, start, take = ModelLoading()._component(spec, module, stack, tensor,
                                                        topology.tp, rank)
        return [(_narrow(name, dst, 0, offset, take), _narrow(name, tensor, 0, start, take),
                 False)]
