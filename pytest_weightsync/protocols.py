"""What an implementation under test looks like: a receiver-side loader and/or a sender-side
exporter, each declaring what it supports.

An *implementation* is any object with a ``name`` (``str``), a ``capabilities``
(:class:`Capabilities`) and at least one of the two roles:

``load_weights(params, payload, *, format, spec, topology, rank) -> None``
    The receiver side (what runs inside SGLang/vLLM). ``params`` is the receiver rank's
    pre-allocated parameters, ``{name: tensor}`` (``model.layers.{L}.mlp.experts.w13_weight``
    ``[E_local, 2 * I_buf, H]`` and ``...w2_weight`` ``[E_local, H, I_buf]``, plus unrelated
    parameters it must leave alone). ``payload`` is a list of ``(name, tensor)`` in
    ``format``: ``"compat"`` (full Hugging Face per-expert tensors), ``"packed"`` (unsharded
    ``w13``/``w2`` of every expert, in the receiver's gate/up order) or ``"direct"`` (this
    rank's own parameter names and exact shapes). ``spec`` is a
    :class:`reference_impl.layout.MoESpec`, ``topology`` a
    :class:`reference_impl.layout.ReceiverTopology`, ``rank`` the receiver rank (its index in
    the engine's TP group). It writes in place (the tensors in ``params`` keep their
    storage) and refuses bad input with a ``ValueError``/``TypeError`` naming the problem,
    before writing anything.

``export_weights(trainer_states, *, format, spec, trainer, receiver, rank) -> payload``
    The sender side (what runs in the trainer). ``trainer_states`` is every trainer rank's
    Megatron-Core expert state dict, in rank order (``trainer`` is the
    :class:`reference_impl.layout.TrainerTopology` they follow). It returns the ``format``
    payload, a list of ``(name, tensor)``, for receiver ``rank`` of ``receiver``.

Nothing here imports torch: the registry uses these definitions at collection time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

#: Payload formats, fastest first (the order ``reference_impl.select`` falls back along).
FORMATS = ("direct", "packed", "compat")
#: Receiver orders of the two halves of ``w13_weight``.
ORDERS = ("gate_up", "up_gate")
#: The two roles an implementation can play, by the method that provides each.
ROLES = {"loader": "load_weights", "exporter": "export_weights"}


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
    """

    formats: frozenset = frozenset(FORMATS)
    orders: frozenset = frozenset(ORDERS)
    padded: bool = True
    max_moe_tp: Optional[int] = None
    max_moe_ep: Optional[int] = None
    max_moe_dp: Optional[int] = None
    topology: Optional[Callable[[Any, Any], bool]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, allowed in (("formats", FORMATS), ("orders", ORDERS)):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            value = frozenset(value)
            unknown = sorted(value - set(allowed))
            if unknown:
                raise ValueError(f"Capabilities.{name}: unknown value(s) {unknown}; "
                                 f"expected a subset of {allowed}")
            object.__setattr__(self, name, value)
        for name in ("max_moe_tp", "max_moe_ep", "max_moe_dp"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Capabilities.{name} must be None or an int >= 1, got {value!r}")
        if self.topology is not None and not callable(self.topology):
            raise TypeError(f"Capabilities.topology must be a callable (spec, receiver) -> bool, "
                            f"got {self.topology!r}")

    def topology_refusal(self, role: str, spec, receiver) -> Optional[str]:
        """Why this implementation, in ``role``, is not run on ``receiver`` at all; ``None``
        when it claims it. (An exporter's order and padding gaps are routed, not refused.)"""
        for axis in ("moe_tp", "moe_ep", "moe_dp"):
            limit = getattr(self, f"max_{axis}")
            if limit is not None and getattr(receiver, axis) > limit:
                return f"claims {axis} <= {limit}, receiver has {axis}={getattr(receiver, axis)}"
        if role == "loader":
            if receiver.order not in self.orders:
                return (f"claims gate/up orders {sorted(self.orders)}, receiver order is "
                        f"{receiver.order!r}")
            if receiver.padded and not self.padded:
                return (f"does not claim padded buffers (receiver intermediate_padded="
                        f"{receiver.intermediate_padded})")
        if self.topology is not None and not self.topology(spec, receiver):
            return "its topology predicate refuses this receiver"
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

    def routing(self, role: str):
        """These claims as ``reference_impl.select.Capabilities`` (what path selection reads).
        A loader's order and padding gaps are topology refusals, so here they are open."""
        from reference_impl.select import Capabilities as SelectCapabilities

        if role == "loader":
            return SelectCapabilities(formats=self.formats, orders=frozenset(ORDERS), padded=True)
        return SelectCapabilities(formats=self.formats, orders=self.orders, padded=self.padded)


@runtime_checkable
class WeightLoader(Protocol):
    """Receiver side; see the module docstring for what each argument holds."""

    name: str
    capabilities: Capabilities

    def load_weights(self, params, payload, *, format, spec, topology, rank) -> None: ...


@runtime_checkable
class WeightExporter(Protocol):
    """Sender side; see the module docstring for what each argument holds."""

    name: str
    capabilities: Capabilities

    def export_weights(self, trainer_states, *, format, spec, trainer, receiver, rank): ...


def roles_of(obj) -> tuple[str, ...]:
    """The roles ``obj`` provides (``"loader"``, ``"exporter"``), in that order."""
    return tuple(role for role, method in ROLES.items() if callable(getattr(obj, method, None)))


def protocol_problems(obj) -> list[str]:
    """Everything that keeps ``obj`` from being an implementation; empty when it is one."""
    problems = []
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name.strip():
        problems.append(f"'name' must be a non-empty str, got {name!r}")
    elif any(ch.isspace() or ch in "[]" for ch in name):
        problems.append(f"'name' {name!r} must not contain whitespace or brackets (it becomes "
                        f"part of test ids)")
    caps = getattr(obj, "capabilities", None)
    if not isinstance(caps, Capabilities):
        problems.append(f"'capabilities' must be a pytest_weightsync.protocols.Capabilities, "
                        f"got {type(caps).__name__}")
    if not roles_of(obj):
        problems.append("it has neither load_weights(params, payload, *, format, spec, topology, "
                        "rank) nor export_weights(trainer_states, *, format, spec, trainer, "
                        "receiver, rank)")
    return problems
