"""A LoRA adapter of a whole model: which modules it targets, its rank and scaling, its names.

RL with LoRA syncs the adapter, not the merged model: for every targeted linear ``W [out, in]``
a ``lora_A [r, in]`` and a ``lora_B [out, r]``; the served model computes
``W x + (alpha / r) * B (A x)``. :class:`AdapterSpec` says which linears of a
:class:`~pytest_weightsync.reference_impl.model.model_spec.ModelSpec` an adapter targets
(``all-linear`` or a subset of :data:`LORA_MODULES`, routed experts only with expert LoRA) and
:func:`lora_params` lists every A/B pair with its PEFT name (``base_model.model.<module>.lora_A.weight``,
what PEFT writes and SGLang's / vLLM's tensor loaders read) and shape. Routed experts are named
per expert (``...mlp.experts.{e}.gate_proj``: the flat PEFT layout a fused-MoE LoRA loader reads);
how an engine stacks, slices and scales them is the engine's layout
(:mod:`pytest_weightsync.reference_impl.model.adapter_layout`), never this module's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

from pytest_weightsync.reference_impl.model.model_spec import ModelSpec, layer_prefix
from pytest_weightsync.reference_impl.model.moe_spec import _require

__all__ = ["ALL_LINEAR", "AdapterSpec", "LORA_MODULES", "LoraParam", "lora_params", "peft_name"]

#: The linear modules an adapter may target, by their Hugging Face leaf names.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: PEFT's ``target_modules="all-linear"`` over these models: every linear but the LM head and
#: the router.
ALL_LINEAR = "all-linear"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter of ``model``: rank ``rank``, ``alpha`` (the scaling is ``alpha / rank``),
    ``targets`` (``"all-linear"`` or a tuple of :data:`LORA_MODULES`), ``experts`` (whether the
    routed experts' ``gate/up/down_proj`` carry LoRA too), in ``dtype`` (the model's)."""

    model: ModelSpec
    rank: int
    alpha: float
    targets: object = ALL_LINEAR
    experts: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.rank, int) and self.rank >= 1, "AdapterSpec.rank must be an "
                 "int >= 1", rank=self.rank)
        _require(isinstance(self.alpha, (int, float)) and self.alpha > 0,
                 "AdapterSpec.alpha must be a number > 0", alpha=self.alpha)
        if self.targets != ALL_LINEAR:
            targets = tuple(self.targets)
            _require(bool(targets) and set(targets) <= set(LORA_MODULES),
                     f"AdapterSpec.targets must be {ALL_LINEAR!r} or a subset of "
                     f"{LORA_MODULES}", targets=targets)
            object.__setattr__(self, "targets", tuple(m for m in LORA_MODULES if m in targets))

    @property
    def modules(self) -> tuple:
        """The targeted leaf names."""
        return LORA_MODULES if self.targets == ALL_LINEAR else self.targets

    @property
    def scaling(self) -> float:
        """``alpha / rank``: what ``B A`` is multiplied by, exactly once."""
        return self.alpha / self.rank

    @property
    def dtype(self):
        return self.model.dtype

    @property
    def id(self) -> str:
        targets = "all" if self.targets == ALL_LINEAR else "+".join(
            t.replace("_proj", "") for t in self.targets)
        return (f"r{self.rank}a{self.alpha:g}-{targets}{'-experts' if self.experts else ''}-"
                f"{self.model.id}")


class LoraParam(NamedTuple):
    """One targeted linear: its base checkpoint tensor ``base`` (``[out, in]``), the PEFT names
    of its ``lora_A [r, in]`` and ``lora_B [out, r]``, its group (``attention``, ``mlp``,
    ``shared_expert``, ``experts``), layer and (routed experts) expert."""

    base: str
    a_name: str
    b_name: str
    a_shape: tuple
    b_shape: tuple
    module: str
    part: str
    layer: int
    expert: Optional[int]


def peft_name(base: str, which: str) -> str:
    """The name of ``base``'s (``...q_proj.weight``) ``lora_A`` / ``lora_B`` as Megatron-Bridge
    exports it (``<module>.lora_A.weight``, no ``base_model.model.`` prefix: vLLM strips one
    where it is given, ``lora_facts``)."""
    _require(which in ("A", "B"), "which must be 'A' or 'B'", which=which)
    module = base[:-len(".weight")] if base.endswith(".weight") else base
    return f"{module}.lora_{which}.weight"


@functools.lru_cache(maxsize=64)
def lora_params(adapter: AdapterSpec) -> Mapping[str, LoraParam]:
    """Every A/B pair of ``adapter`` by base name, in checkpoint order (the served model's
    layers; attention layers only for ``q/k/v/o``; the shared expert's MLP; the routed
    experts per expert with ``experts``)."""
    spec, r, H = adapter.model, adapter.rank, adapter.model.hidden
    out = []

    def add(base, module, out_dim, in_dim, part, layer, expert=None):
        out.append(LoraParam(base, peft_name(base, "A"), peft_name(base, "B"), (r, in_dim),
                             (out_dim, r), module, part, layer, expert))

    shapes = {"q_proj": (spec.q_rows, H), "k_proj": (spec.kv_rows, H),
              "v_proj": (spec.kv_rows, H), "o_proj": (H, spec.num_heads * spec.head_dim)}
    for layer in range(spec.num_layers):
        p = layer_prefix("target", layer)
        if spec.layer_kind(layer) == "attention":
            for module in _ATTENTION:
                if module in adapter.modules:
                    add(f"{p}.self_attn.{module}.weight", module, *shapes[module], "attention",
                        layer)
        if spec.intermediate_shared:
            I = spec.intermediate_shared
            for module in _MLP:
                if module in adapter.modules:
                    dims = (H, I) if module == "down_proj" else (I, H)
                    add(f"{p}.mlp.shared_expert.{module}.weight", module, *dims,
                        "shared_expert", layer)
        if adapter.experts:
            I = spec.intermediate
            for expert in range(spec.num_experts):
                for module in _MLP:
                    if module in adapter.modules:
                        dims = (H, I) if module == "down_proj" else (I, H)
                        add(f"{p}.mlp.experts.{expert}.{module}.weight", module, *dims,
                            "experts", layer, expert)
    return MappingProxyType({p.base: p for p in out})
