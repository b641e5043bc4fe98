"""What an implementation claims (:class:`Capabilities`) and why a case is refused to it.

The protocol (:mod:`pytest_weightsync.protocols`) says what an implementation IS: its roles,
their signatures and what they receive. This module says what one SUPPORTS: the declared
formats, orders, topologies, trainer layouts, model parts and lifecycle claims, checked when
the implementation is built, and the refusal logic the registry, the claims probe and the
suites share to skip a case it does not claim (never passing it). They live apart so that
the refusal rules can grow with new axes without touching the protocol a third party reads;
``pytest_weightsync.protocols`` re-exports :class:`Capabilities` and :class:`ClaimError`,
their documented import path.

Nothing here imports torch: the registry uses these definitions at collection time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from pytest_weightsync.vocabulary import (
    DELIVERIES,
    ENGINE_LAYOUTS,
    EXPERT_IMPLS,
    EXPERT_MODULES,
    EXPERT_PLACEMENTS,
    FORMATS,
    LAYER_SPECS,
    LIFECYCLE,
    LOADER_TRANSPORTS,
    LORA_LAYOUTS,
    MODEL_PARTS,
    ORDERS,
    PAUSE_MODES,
    QUANTIZERS,
    RECEIVER_AXES,
    SERVING_DIALECTS,
    TARGETS,
    TRAINER_AXES,
    WEIGHT_QUANTS,
)

__all__ = ["Capabilities", "ClaimError"]


class ClaimError(TypeError):
    """A capability predicate raised instead of answering: a usage error of the implementation
    that declared it (the plugin reports it once, at collection, naming the implementation)."""


@dataclass(frozen=True)
class Capabilities:
    """What an implementation claims; everything else is skipped with the reason (or, where
    the real sync would route around it, sent down the fallback path) - never passed.

    ``formats``
        Payload formats it loads (loader) or produces (exporter); a subset of :data:`FORMATS`.
    ``orders``
        Receiver gate/up orders it handles. A loader that lacks a receiver's order is not run
        on that receiver. An exporter that lacks it cannot produce fused (packed, direct)
        payloads for it, so the sync falls back to ``compat``.
    ``padded``
        Whether it handles padded receiver buffers (``intermediate_padded``). A loader
        without it is not run on padded receivers; an exporter without it cannot emit a
        direct payload for one (the sync falls back to ``packed``).
    ``max_moe_tp``, ``max_moe_ep``, ``max_moe_dp``
        Largest receiver MoE parallel sizes it supports (``None``: no limit).
    ``topology``
        Optional predicate ``topology(spec, receiver) -> bool`` for anything finer.
    ``engine_layouts``
        What the engine may hold between updates (:data:`ENGINE_LAYOUTS`,
        ``ReceiverTopology.engine_layout``); default only ``checkpoint``, the layout loaders
        write. A loader that claims ``trtllm_block`` restores the checkpoint layout in
        ``begin_update`` and re-applies the block layout in ``end_update``; one that claims
        ``transposed`` gets ``[E, H, 2I]`` / ``[E, I, H]`` parameters.
    ``redundant_experts``
        Whether it handles EPLB receivers (physical expert slots != logical experts,
        ``ReceiverTopology.redundant_experts`` / ``placement``): every physical copy written,
        by the placement of the call's topology. Default ``False``.
    ``expert_placements``
        How the receiver may spread experts over its MoE-EP ranks (:data:`EXPERT_PLACEMENTS`,
        ``ReceiverTopology.expert_placement``): ``even`` (SGLang, ``E % ep == 0``) and
        ``linear_uneven`` (vLLM's ``determine_expert_map``: the first ``E % ep`` ranks hold one
        expert more, so local expert counts differ between ranks). Default only ``even``: an
        SGLang loader is not run on vLLM's uneven placement.
    ``weight_quants``
        Receiver weight quantizations it handles (:data:`WEIGHT_QUANTS`); default ``none``.
    ``quantizers``
        For a quantized receiver, who may quantize (:data:`QUANTIZERS`): ``sender`` (it loads
        FP8 weights plus ``weight_scale_inv``), ``loader`` (it quantizes model-dtype weights
        itself). Default ``sender``.

    ``transports``
        Loaders: the wire formats (:data:`TRANSPORTS`) a ``load_weights`` payload may arrive
        on. Every loader takes ``tensors`` (a list of ``(name, tensor)`` pairs); one that
        claims ``flattened_bucket`` is also handed buckets as SGLang's ``ModelRunner`` gets
        them with ``load_format="flattened_bucket"`` - ``{"flattened_tensor": uint8 tensor,
        "metadata": [FlattenedTensorMetadata]}`` (:mod:`pytest_weightsync.wire`) - and must
        decode them itself. (Serialized updates and broadcasts are decoded by the engine's
        TP worker before its loader runs: exporters send them, loaders never see them.)

    Trainer-side claims (exporters only; an unclaimed trainer layout skips with the reason):

    ``expert_impls``
        Megatron-Core expert modules it reads (subset of :data:`EXPERT_IMPLS`), e.g. an
        exporter that only knows TEGroupedMLP's ``linear_fc1.weight{i}`` names claims
        ``{"te_grouped"}``.
    ``max_trainer_tp``, ``max_trainer_ep``, ``max_trainer_etp``, ``max_trainer_pp``
        Largest trainer parallel sizes it supports (``None``: no limit);
        ``max_trainer_pp=1`` says it does not support pipeline parallelism.
    ``deliveries``
        Distributed exporters: which of :data:`DELIVERIES` it implements.
    ``trainer_topology``
        Optional predicate ``trainer_topology(spec, trainer) -> bool`` for anything finer.
    ``layer_specs``
        Whole-model distributed exporters: the Megatron-Core layer specs whose parameter names
        it reads (subset of :data:`LAYER_SPECS`: ``te``, the Transformer Engine spec real jobs
        build, input norms fused as ``self_attention.linear_qkv.layer_norm_weight``; ``local``,
        ``input_layernorm.weight``). Default both.

    Whole-model claims (``suites/conformance/test_model.py``; the default claims none, so an
    expert-only implementation is not run on whole-model cases):

    ``model_parts``
        Parameter groups of a whole model it handles (subset of :data:`MODEL_PARTS`). A
        whole-model case runs only when every group its model has
        (``ModelSpec.parts``) is claimed.
    ``targets``
        Engine models an update can reach that it handles (subset of :data:`TARGETS`): a
        model with an MTP draft is run with the draft updated only when ``"draft"`` is
        claimed (loaders always run the frozen-draft case of such a model).

    Update-lifecycle claims (engine-side loaders, ``suites/conformance/test_lifecycle.py``):

    ``lifecycle``
        Which of :data:`LIFECYCLE` it promises: ``sessions`` (its ``begin_update`` /
        ``end_update`` keep the session: misuse refused or handled, never corrupting),
        ``atomic`` (a failed update leaves the old bits or the engine marked unusable, never
        a silent mix), ``version`` (it defines ``weight_version``), ``sleep`` (it defines
        ``sleep`` / ``wake_up``: level 1 restores every bit, level 2 leaves no complete version
        until a complete update). Default none: the ``identity`` and ``coverage_by_rank``
        properties run for every loader, the others only where claimed.
    ``lifecycle_note``
        Why what is not claimed is not (shown with those skips), e.g. that a layer above the
        loader keeps the session.

    Refit-under-load claims (serving engines and orchestrators,
    ``suites/conformance/test_serving.py``):

    ``serving``
        The control planes (:data:`SERVING_DIALECTS`) a serving engine speaks, or an
        orchestrator drives; default none (an engine claiming none is not run).
    ``pause_modes``
        The pause modes it implements, ``"<dialect>:<mode>"`` (:data:`PAUSE_MODES`, e.g.
        ``"sglang:retract"``); default every mode of every claimed dialect. The ``in_flight``
        and ``flush_after_pause`` properties run each one.
    ``logprob_tolerance``
        ``None`` (the default): its log-probs equal the trainer-side forward of the reported
        version bit for bit (deterministic kernels shared with the oracle's forward); else the
        largest absolute difference it claims, printed with the result.

    LoRA claims (adapter loaders, ``suites/conformance/test_lora.py``):

    ``lora``
        The adapter layouts (:data:`LORA_LAYOUTS`) it loads into; default none.

    A predicate that raises is a :class:`ClaimError` naming it: the plugin probes every
    predicate at collection time and stops with one usage error naming the implementation.
    """

    formats: frozenset = frozenset(FORMATS)
    orders: frozenset = frozenset(ORDERS)
    padded: bool = True
    max_moe_tp: Optional[int] = None
    max_moe_ep: Optional[int] = None
    max_moe_dp: Optional[int] = None
    topology: Optional[Callable[[Any, Any], bool]] = field(default=None, compare=False)
    engine_layouts: frozenset = frozenset(("checkpoint",))
    redundant_experts: bool = False
    expert_placements: frozenset = frozenset(("even",))
    weight_quants: frozenset = frozenset(("none",))
    quantizers: frozenset = frozenset(("sender",))
    expert_impls: frozenset = frozenset(EXPERT_IMPLS)
    max_trainer_tp: Optional[int] = None
    max_trainer_ep: Optional[int] = None
    max_trainer_etp: Optional[int] = None
    max_trainer_pp: Optional[int] = None
    deliveries: frozenset = frozenset(DELIVERIES)
    trainer_topology: Optional[Callable[[Any, Any], bool]] = field(default=None, compare=False)
    layer_specs: frozenset = frozenset(LAYER_SPECS)
    model_parts: frozenset = frozenset()
    targets: frozenset = frozenset({"target"})
    transports: frozenset = frozenset({"tensors"})
    lifecycle: frozenset = frozenset()
    lifecycle_note: str = field(default="", compare=False)
    serving: frozenset = frozenset()
    pause_modes: Optional[frozenset] = None
    logprob_tolerance: Optional[float] = None
    lora: frozenset = frozenset()

    def __post_init__(self) -> None:
        for name, allowed in (("formats", FORMATS), ("orders", ORDERS),
                              ("expert_impls", EXPERT_IMPLS), ("deliveries", DELIVERIES),
                              ("layer_specs", LAYER_SPECS),
                              ("model_parts", MODEL_PARTS), ("targets", TARGETS),
                              ("engine_layouts", ENGINE_LAYOUTS),
                              ("expert_placements", EXPERT_PLACEMENTS),
                              ("weight_quants", WEIGHT_QUANTS), ("quantizers", QUANTIZERS),
                              ("transports", LOADER_TRANSPORTS), ("lifecycle", LIFECYCLE),
                              ("lora", LORA_LAYOUTS)):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            value = frozenset(value)
            unknown = sorted(value - set(allowed))
            if unknown:
                raise ValueError(f"Capabilities.{name}: unknown value(s) {unknown}; "
                                 f"expected a subset of {allowed}")
            object.__setattr__(self, name, value)
        self._check_serving()
        if "tensors" not in self.transports:
            raise ValueError(f"Capabilities.transports must include 'tensors' (every loader is "
                             f"handed (name, tensor) pairs), got {sorted(self.transports)}")
        for name in (*(f"max_{axis}" for axis in RECEIVER_AXES),
                     *(f"max_trainer_{axis}" for axis in TRAINER_AXES)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Capabilities.{name} must be None or an int >= 1, got {value!r}")
        for name, args in (("topology", "(spec, receiver)"), ("trainer_topology", "(spec, trainer)")):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Capabilities.{name} must be a callable {args} -> bool, "
                                f"got {value!r}")

    def _check_serving(self) -> None:
        serving = frozenset((self.serving,) if isinstance(self.serving, str) else self.serving)
        unknown = sorted(serving - set(SERVING_DIALECTS))
        if unknown:
            raise ValueError(f"Capabilities.serving: unknown dialect(s) {unknown}; expected a "
                             f"subset of {SERVING_DIALECTS}")
        object.__setattr__(self, "serving", serving)
        every = {f"{d}:{m}" for d in serving for m in PAUSE_MODES[d]}
        modes = every if self.pause_modes is None else frozenset(
            (self.pause_modes,) if isinstance(self.pause_modes, str) else self.pause_modes)
        unknown = sorted(set(modes) - every)
        if unknown:
            raise ValueError(f"Capabilities.pause_modes: {unknown} are no pause modes of the "
                             f"claimed dialects (expected a subset of {sorted(every)})")
        object.__setattr__(self, "pause_modes", frozenset(modes))
        tol = self.logprob_tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not tol >= 0):
            raise ValueError(f"Capabilities.logprob_tolerance must be None or a number >= 0, "
                             f"got {tol!r}")

    def serving_refusal(self, dialect: str, mode: Optional[str] = None) -> Optional[str]:
        """Why a serving case of ``dialect`` (and pause ``mode``) is not run; ``None`` when
        claimed."""
        if dialect not in self.serving:
            return f"does not claim the {dialect} control plane (claims {sorted(self.serving)})"
        if mode is not None and f"{dialect}:{mode}" not in self.pause_modes:
            return (f"does not claim pause mode {dialect}:{mode} (claims "
                    f"{sorted(self.pause_modes)})")
        return None

    @staticmethod
    def _ask(predicate, name: str, spec, topology) -> bool:
        """``predicate(spec, topology)``; anything it raises becomes a :class:`ClaimError`."""
        try:
            return bool(predicate(spec, topology))
        except Exception as exc:
            raise ClaimError(f"its Capabilities.{name} predicate "
                             f"{str(getattr(predicate, '__qualname__', predicate))[-100:]} raised "
                             f"{type(exc).__name__}: {exc!s:.200} (for {topology!r:.160}); a "
                             f"predicate must return True or False") from exc

    def topology_refusal(self, role: str, spec, receiver) -> Optional[str]:
        """Why this implementation, in ``role``, is not run on ``receiver`` at all; ``None``
        when it claims it. (An exporter's order and padding gaps are routed, not refused.)"""
        for axis in RECEIVER_AXES:
            limit = getattr(self, f"max_{axis}")
            if limit is not None and getattr(receiver, axis) > limit:
                return f"claims {axis} <= {limit}, receiver has {axis}={getattr(receiver, axis)}"
        reason = self._engine_refusal(receiver)
        if reason is not None:
            return reason
        if role == "loader":
            if receiver.order not in self.orders:
                return (f"claims gate/up orders {sorted(self.orders)}, receiver order is "
                        f"{receiver.order!r}")
            if receiver.padded and not self.padded:
                return (f"does not claim padded buffers (receiver intermediate_padded="
                        f"{receiver.intermediate_padded})")
        if self.topology is not None and not self._ask(self.topology, "topology", spec, receiver):
            why = getattr(self.topology, "refusal", None)  # optional (spec, receiver) -> str
            detail = why(spec, receiver) if callable(why) else None
            return "its topology predicate refuses this receiver" + (f": {detail}" if detail else "")
        return None

    def _engine_refusal(self, receiver) -> Optional[str]:
        """Why the engine side of ``receiver`` (layout after loading, redundant experts,
        weight quantization) is not claimed; ``None`` when it is. Topologies from before these
        fields existed (no such attributes) are plain checkpoint-layout engines."""
        layout = getattr(receiver, "engine_layout", "checkpoint")
        if layout not in self.engine_layouts:
            return (f"claims engine layouts {sorted(self.engine_layouts)}, the receiver engine "
                    f"holds {layout!r}")
        if getattr(receiver, "eplb", False) and not self.redundant_experts:
            return ("does not claim redundant experts (EPLB: the receiver has "
                    f"{getattr(receiver, 'redundant_experts', 0)} redundant physical slots "
                    f"or an explicit placement)")
        placement = getattr(receiver, "expert_placement", "even")
        if placement not in self.expert_placements:
            return (f"claims expert placements {sorted(self.expert_placements)}, the receiver "
                    f"places experts {placement!r} (vLLM's linear map: the first "
                    f"num_experts % moe_ep ranks hold one expert more)")
        quant = getattr(receiver, "weight_quant", "none")
        if quant not in self.weight_quants:
            return (f"claims weight quantizations {sorted(self.weight_quants)}, the receiver "
                    f"holds {quant!r}")
        return None

    def quantizer_refusal(self, quantizer: str) -> Optional[str]:
        """Why a quantized receiver is not fed with weights quantized by ``quantizer``
        (:data:`QUANTIZERS`); ``None`` when claimed."""
        if quantizer not in self.quantizers:
            return (f"does not claim weights quantized by the {quantizer} (claims "
                    f"{sorted(self.quantizers)})")
        return None

    def trainer_refusal(self, spec, trainer) -> Optional[str]:
        """Why this exporter is not run on trainer layout ``trainer`` at all; ``None`` when it
        claims it."""
        impl = getattr(trainer, "expert_impl", "sequential")
        if impl not in self.expert_impls:
            module = EXPERT_MODULES.get(impl, impl)
            return (f"claims trainer expert modules {sorted(self.expert_impls)}, the trainer "
                    f"holds its experts in {module} ({impl!r})")
        for axis in TRAINER_AXES:
            limit = getattr(self, f"max_trainer_{axis}")
            size = getattr(trainer, axis)
            if limit is not None and size > limit:
                if axis == "pp" and limit == 1:
                    return f"does not support pipeline parallelism (trainer has pp={size})"
                return f"claims trainer {axis} <= {limit}, trainer has {axis}={size}"
        if self.trainer_topology is not None and not self._ask(
                self.trainer_topology, "trainer_topology", spec, trainer):
            return "its trainer_topology predicate refuses this trainer layout"
        return None

    def model_refusal(self, spec, targets) -> Optional[str]:
        """Why this implementation is not run on a whole-model case of ``spec`` (a
        ``ModelSpec``) whose update reaches ``targets``; ``None`` when it claims it."""
        if not self.model_parts:
            return "claims no whole-model parameters (an expert-only implementation)"
        missing = sorted(set(spec.parts) - self.model_parts)
        if missing:
            return (f"does not claim the model's parameter groups {missing} (claims "
                    f"{sorted(self.model_parts)})")
        lacking = [t for t in TARGETS if t in targets and t not in self.targets]
        if lacking:
            return f"does not claim updates of the {' and '.join(lacking)} model"
        return None

    def lifecycle_refusal(self, claim: str) -> Optional[str]:
        """Why a lifecycle property needing ``claim`` (:data:`LIFECYCLE`) is not run; ``None``
        when it is claimed."""
        if claim not in self.lifecycle:
            note = f": {self.lifecycle_note}" if self.lifecycle_note else ""
            return (f"does not claim {claim!r} of the update lifecycle (Capabilities.lifecycle "
                    f"claims {sorted(self.lifecycle)}){note}")
        return None

    def transport_refusal(self, transport: str) -> Optional[str]:
        """Why a loader is not handed buckets on ``transport``; ``None`` when it claims it."""
        if transport not in self.transports:
            return (f"does not claim the {transport} transport (claims "
                    f"{sorted(self.transports)})")
        return None

    def layer_spec_refusal(self, layer_spec: str) -> Optional[str]:
        """Why a whole-model exporter is not run on a trainer built from ``layer_spec``;
        ``None`` when it claims it."""
        if layer_spec not in self.layer_specs:
            return (f"claims Megatron layer specs {sorted(self.layer_specs)}, the trainer is "
                    f"built from the {layer_spec!r} spec")
        return None

    def delivery_refusal(self, delivery: str) -> Optional[str]:
        """Why a distributed exporter is not run with ``delivery``; ``None`` when it claims it."""
        if delivery not in self.deliveries:
            return f"does not claim {delivery!r} delivery (claims {sorted(self.deliveries)})"
        return None

    def format_refusal(self, role: str, fmt: str, receiver) -> Optional[str]:
        """Why ``fmt`` cannot be used on ``receiver``; ``None`` when it can."""
        if fmt not in self.formats:
            return f"does not claim the {fmt} format (claims {sorted(self.formats)})"
        if role == "exporter" and fmt in ("packed", "direct") and receiver.order not in self.orders:
            return (f"cannot produce a {fmt} payload in gate/up order {receiver.order!r} "
                    f"(claims {sorted(self.orders)})")
        if role == "exporter" and fmt == "direct" and receiver.padded and not self.padded:
            return "cannot produce a direct payload for padded receiver buffers"
        return None

    def routing(self, role: str) -> "Capabilities":
        """What path selection (``pytest_weightsync.reference_impl.senders.select``, which reads
        ``formats``, ``orders`` and ``padded`` of this same class) sees for ``role``. A
        loader's order and padding gaps are topology refusals, so here they are open."""
        if role == "loader":
            return replace(self, orders=frozenset(ORDERS), padded=True)
        return self
