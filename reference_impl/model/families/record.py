"""The :class:`ModelFamily` record: what one model family is, field by field.

Apart from the registry (the package) so that the family modules, which each build one
record, import this and not the package that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from pytest_weightsync.reference_impl.errors import WeightSyncError

__all__ = ["LAYER_RULES", "ModelFamily", "UnknownModelFamily"]

#: How a family decides a served layer's kind (:meth:`ModelFamily.layer_kind`): every layer
#: full attention, or full attention every ``full_attention_interval``-th layer and Gated
#: DeltaNet in between.
LAYER_RULES = ("all_attention", "attention_every_interval")


class UnknownModelFamily(WeightSyncError):
    """A model family name no record is registered under."""


def _frozen(mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class ModelFamily:
    """Everything the layouts, the trainer model and the engine models need to know about one
    model family; the sizes are the :class:`~..model_spec.ModelSpec`'s.

    Checkpoint facts come first (the reference every other layout is checked against), then
    one group per engine or trainer that serves or trains the family."""

    #: The family's word (``ModelSpec.family``); a builtin one is in ``MODEL_FAMILIES``.
    name: str
    #: Short tag the spec ids start with (``q3L2E4...``): ids name cases and report rows.
    id_prefix: str
    #: Which of :data:`LAYER_RULES` places attention and GDN layers: it decides which
    #: checkpoint tensors a layer holds, so every layout reads it through ``layer_kind``.
    layer_rule: str = "all_attention"
    #: Parameter groups (``MODEL_PARTS``) every model of the family has beyond the common
    #: ones (experts, attention, router, norms, embeddings): a case needs a loader claiming
    #: them all.
    extra_parts: frozenset = frozenset()
    #: Full attention gates its output: ``q_proj`` holds ``[q_h; gate_h]`` per head, which
    #: doubles its rows and changes the trainer's query-group interleave.
    attn_output_gate: bool = False
    #: ``ModelSpec`` fields that must be ints >= 1 for this family (its GDN and shared-expert
    #: sizes): a spec without them describes a model the family never is.
    required_fields: tuple = ()
    #: ``ModelSpec`` field -> the only value the family allows (what it does not have), and
    #: the message a spec breaking it gets.
    fixed_fields: Mapping = field(default_factory=dict)
    fixed_message: str = ""
    #: The fields the ``fixed_message`` error shows (the values that tell the mistake).
    fixed_shown: tuple = ()
    #: Prefix the family's VL checkpoints put before ``model.`` (``model.language_model.``),
    #: or ``""``: loaders map it away, names here never carry it.
    vl_prefix: str = ""

    # -- SGLang 0.5.23 -----------------------------------------------------------------------
    #: ``sglang.srt.models.<module>`` and the class the engine serves (the model tree builds
    #: it) and the class whose ``load_weights`` the loader row calls.
    sglang_module: str = ""
    sglang_class: str = ""
    sglang_loader_class: str = ""
    #: ``(module, class)`` of SGLang's draft (MTP) model, or ``None``: no draft.
    sglang_draft: Optional[tuple] = None
    #: What SGLang's decoder layer puts before ``qkv_proj`` / ``o_proj`` / the q/k norms:
    #: ``"self_attn."`` (Qwen3-MoE) or ``""`` (Qwen3.5 holds them on the layer).
    sglang_attention_prefix: str = "self_attn."
    #: ``(module, class)`` of the Hugging Face config SGLang's class is built from, and
    #: whether its sizes sit in a ``text_config`` (VL configs) rather than at the top.
    sglang_config: tuple = ("transformers", "")
    sglang_text_config: bool = False
    #: A tied model's SGLang class shares ``embed_tokens`` as its head; the engine here holds
    #: ``lm_head`` as a buffer of its own (as SGLang's last pipeline stage does).
    sglang_tied_head_buffer: bool = False

    # -- vLLM 0.33.0 -------------------------------------------------------------------------
    #: ``(file under vllm/model_executor/models/, class)`` of the served model and of the
    #: draft (``None``: no draft).
    vllm_model: tuple = ("", "")
    vllm_draft: Optional[tuple] = None
    #: Where vLLM's attention parameters sit on the layer (``self_attn.`` for both Qwens):
    #: vLLM's names are SGLang's with :attr:`sglang_attention_prefix` replaced by it.
    vllm_attention_prefix: str = "self_attn."
    #: Checkpoint substring -> (engine substring, shard id): the ``orig_to_new_stacked`` of
    #: the inner model's ``hf_to_vllm_mapper``, applied in this order.
    vllm_stacked: Mapping = field(default_factory=dict)
    #: Checkpoint prefix renames of the served model's outer mapper (``None``: not loaded).
    vllm_served_prefixes: Mapping = field(default_factory=dict)
    #: class -> {attribute: class it holds}: the module tree vLLM's engine names walk.
    vllm_module_tree: Mapping = field(default_factory=dict)

    # -- Megatron-Core 0.16 / Megatron-Bridge 0.3.1 -------------------------------------------
    #: ``(source under megatron/bridge, class)`` of the Bridge that converts the family: its
    #: ``mapping_registry()`` names every Megatron parameter a real model of it has.
    bridge: tuple = ("", "")
    #: Bridge's provider class of the family (``qwen_provider.py``).
    bridge_provider: str = ""
    #: ``TransformerConfig`` settings outside the sizes (they decide which parameters exist:
    #: norms, q/k norms, biases) and ``GPTModel`` arguments (positions, rotary base).
    megatron_config: Mapping = field(default_factory=dict)
    megatron_model: Mapping = field(default_factory=dict)

    #: The fields of a small spec of the family (CPU suites): ``ModelSpec(family=name,
    #: **small_spec)`` is a model every layout of it can build.
    small_spec: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_rule not in LAYER_RULES:
            raise UnknownModelFamily(f"ModelFamily.layer_rule must be one of {LAYER_RULES} "
                                     f"(got layer_rule={self.layer_rule!r})")
        for name in ("fixed_fields", "vllm_stacked", "vllm_served_prefixes", "megatron_config",
                     "megatron_model", "small_spec"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "vllm_module_tree", _frozen(
            {cls: _frozen(attrs) for cls, attrs in self.vllm_module_tree.items()}))
        object.__setattr__(self, "extra_parts", frozenset(self.extra_parts))

    @property
    def gdn(self) -> bool:
        """Some served layers are Gated DeltaNet layers (their sizes must shard too)."""
        return self.layer_rule == "attention_every_interval"

    @property
    def has_draft(self) -> bool:
        """A model of the family may carry an MTP draft (``mtp_layers`` is not fixed at 0):
        converters and engines then name the draft's tensors too."""
        return self.fixed_fields.get("mtp_layers", 1) != 0

    @property
    def layer_parts(self) -> tuple:
        """The kinds of per-layer tensors a model of the family has: attention, and the GDN
        mixer and shared expert where the family has them."""
        return ("attention",) + tuple(p for p in ("gdn", "shared_expert")
                                      if p in self.extra_parts)

    @property
    def vllm_roots(self) -> tuple:
        """vLLM's root classes: the served model's and the draft's (``None``: no draft)."""
        return (self.vllm_model[1], self.vllm_draft[1] if self.vllm_draft else None)

    def layer_kind(self, interval: int, layer: int) -> str:
        """``"attention"`` or ``"gdn"`` for served layer ``layer`` of a model whose
        ``full_attention_interval`` is ``interval``."""
        if self.layer_rule == "all_attention":
            return "attention"
        return "attention" if (layer + 1) % interval == 0 else "gdn"
