"""The real SGLang ``FusedMoE`` for one receiver rank, built on CPU in a single process.

The reference receiver models what SGLang does with a weight payload (which experts a rank
keeps, where gate and up land in ``w13_weight``, which slice of the intermediate dimension a
MoE-TP rank takes). This module runs SGLang's own code for the same job so the suites can
hold the model to it:

* :func:`build_fused_moe` constructs ``sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE``
  for a given (MoE-TP size/rank, MoE-EP size/rank) and MoE runner. SGLang reads parallel
  sizes from its runtime context; each layer gets a private context
  (``runtime_context.create_context``) activated only while SGLang code runs
  (``use_context``), so building layers for several ranks in one process never leaks
  placement from one into another or into the process-wide context.
* :meth:`FusedMoEReceiver.load_hf` feeds HF-named tensors through the real
  ``FusedMoE.weight_loader``, routed the way Qwen3.5's ``load_weights`` routes expert names
  (per-expert ``experts.{e}.gate_proj.weight`` or packed ``experts.gate_up_proj``).
* :meth:`FusedMoEReceiver.load_direct` feeds rank-local tensors through SGLang's
  ``default_weight_loader``, which is what ``load_format="direct"`` calls.

The SGLang internals this depends on are listed in ``docs/backends.md``. SGLang is imported
inside the functions, so importing this module is cheap and never fails.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

#: MoE runner backend -> receiver layout it implies for unquantized weights.
#: ``triton``: w13 = [gate | up]; ``flashinfer_cutlass``: w13 = [up | gate]
#: (``load_up_proj_weight_first``); ``triton_kernels``: both parameters stored transposed.
RUNNERS = ("triton", "flashinfer_cutlass", "triton_kernels", "flashinfer_trtllm")

_PARAM_NAMES = ("w13_weight", "w2_weight")


class ReceiverTopologyError(ValueError):
    """A (MoE-TP, MoE-EP, experts, intermediate) combination the receiver cannot hold."""


class PayloadNameError(ValueError):
    """A payload name that is not an expert weight of the receiver layer."""


@dataclass(frozen=True)
class ReceiverPlacement:
    """One SGLang receiver rank: its MoE-TP and MoE-EP sizes and ranks (MoE-DP 1).

    SGLang derives these from ``tp_size``, ``ep_size`` and the rank's TP rank:
    ``moe_tp_size = tp_size // ep_size``, ``moe_tp_rank = tp_rank % moe_tp_size``,
    ``moe_ep_rank = tp_rank // moe_tp_size``. :attr:`tp_rank` inverts that, and
    :func:`build_fused_moe` checks that SGLang agrees.
    """

    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    moe_ep_size: int = 1
    moe_ep_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank in (("moe_tp_size", "moe_tp_rank"), ("moe_ep_size", "moe_ep_rank")):
            s, r = getattr(self, size), getattr(self, rank)
            if not isinstance(s, int) or s < 1:
                raise ReceiverTopologyError(f"ReceiverPlacement.{size} must be a positive int, got {s!r}")
            if not isinstance(r, int) or not 0 <= r < s:
                raise ReceiverTopologyError(f"ReceiverPlacement.{rank}={r!r} is outside [0, {size}={s})")

    @property
    def tp_size(self) -> int:
        return self.moe_tp_size * self.moe_ep_size

    @property
    def tp_rank(self) -> int:
        return self.moe_ep_rank * self.moe_tp_size + self.moe_tp_rank

    @classmethod
    def all_ranks(cls, moe_tp_size: int, moe_ep_size: int) -> tuple["ReceiverPlacement", ...]:
        """Every rank of one engine, in TP-rank order."""
        return tuple(
            cls(moe_tp_size, tp_rank % moe_tp_size, moe_ep_size, tp_rank // moe_tp_size)
            for tp_rank in range(moe_tp_size * moe_ep_size)
        )


@dataclass
class FusedMoEReceiver:
    """A real SGLang ``FusedMoE`` layer plus the private runtime context it was built in."""

    layer: object
    context: object
    placement: ReceiverPlacement
    runner: str
    prefix: str
    num_experts: int
    _loaded_fused: bool = field(default=False, repr=False)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Activate this layer's runtime context (and runner flag) while SGLang code runs."""
        with _activated(self.context, self.runner):
            yield

    @property
    def params(self) -> dict:
        """``{"w13_weight": Parameter, "w2_weight": Parameter}`` of the real layer."""
        return {name: getattr(self.layer, name) for name in _PARAM_NAMES}

    @property
    def up_first(self) -> bool:
        """Whether SGLang loads up before gate into ``w13_weight`` for this layer."""
        from sglang.srt.layers.moe.fused_moe_triton.layer import _weight_layout_method

        return bool(getattr(_weight_layout_method(self.layer), "load_up_proj_weight_first", False))

    @property
    def transposed(self) -> bool:
        """Whether the layer stores weights transposed (the ``triton_kernels`` runner)."""
        return bool(self.layer.use_triton_kernels)

    @property
    def num_local_experts(self) -> int:
        return int(self.layer.num_local_experts)

    def weight_loader(self, param_name: str, tensor, shard_id: str, expert_id: int) -> None:
        """Call the real ``FusedMoE.weight_loader`` for one expert projection."""
        param = self.params[param_name]
        with self.active():
            param.weight_loader(param, tensor, f"{self.prefix}.experts.{param_name}", shard_id, expert_id)

    def load_hf(self, named_tensors: Iterable[tuple[str, object]]) -> list[str]:
        """Load HF-named expert tensors the way SGLang's Qwen3.5 ``load_weights`` does.

        Accepts per-expert names ``{prefix}.experts.{e}.{gate,up,down}_proj.weight`` and packed
        names ``{prefix}.experts.gate_up_proj`` ``[E, 2I, H]`` / ``{prefix}.experts.down_proj``
        ``[E, H, I]``. The mapping table is SGLang's own
        (``FusedMoE.make_expert_params_mapping``); the routing loop transcribes
        ``Qwen3_5ForCausalLM.load_weights`` (sglang 0.5.23), which keeps it nested and so cannot
        be called alone. Like SGLang, once a packed name is seen in one call, later names are
        routed with the packed table. Returns the mapped parameter names, in load order.
        """
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        per_expert_mapping = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj",
            num_experts=self.num_experts,
        )
        fused_mapping = [
            ("experts.w13_weight", "experts.gate_up_proj", 0, "w1"),
            ("experts.w2_weight", "experts.down_proj", 0, "w2"),
        ]
        params_dict = {f"{self.prefix}.experts.{name}": p for name, p in self.params.items()}
        mapping, is_fused = per_expert_mapping, False
        loaded = []
        with self.active():
            for name, weight in named_tensors:
                if not name.startswith(self.prefix + "."):
                    raise PayloadNameError(f"{name!r} is not under the receiver layer prefix {self.prefix!r}")
                if "experts.gate_up_proj" in name or "experts.down_proj" in name:
                    is_fused, mapping = True, fused_mapping
                for param_name, weight_name, expert_id, shard_id in mapping:
                    if weight_name not in name:
                        continue
                    name_mapped = name.replace(weight_name, param_name)
                    if name_mapped not in params_dict:
                        raise PayloadNameError(
                            f"{name!r} maps to {name_mapped!r}, which is not a parameter of the layer"
                        )
                    param = params_dict[name_mapped]
                    if is_fused:
                        if "experts.gate_up_proj" in name:
                            gate, up = weight.chunk(2, dim=-2)
                            _load_all_experts(param, name_mapped, gate, "w1", self.num_experts)
                            _load_all_experts(param, name_mapped, up, "w3", self.num_experts)
                        elif "experts.down_proj" in name:
                            _load_all_experts(param, name_mapped, weight, shard_id, self.num_experts)
                        else:
                            raise PayloadNameError(
                                f"{name!r}: per-expert name after a packed name in the same load "
                                "call; SGLang would route it with the packed table"
                            )
                    else:
                        param.weight_loader(param, weight, name_mapped, shard_id=shard_id, expert_id=expert_id)
                    loaded.append(name_mapped)
                    break
                else:
                    raise PayloadNameError(f"{name!r} is not an expert weight name SGLang maps")
        return loaded

    def load_direct(self, named_tensors: Iterable[tuple[str, object]]) -> list[str]:
        """Load rank-local tensors by SGLang parameter name through ``default_weight_loader``.

        This is what ``update_weights_from_tensor(load_format="direct")`` does: no slicing,
        no expert filtering, exact shapes. Names are ``{prefix}.experts.w13_weight`` /
        ``{prefix}.experts.w2_weight``.
        """
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        params_dict = {f"{self.prefix}.experts.{name}": p for name, p in self.params.items()}
        loaded = []
        with self.active():
            for name, weight in named_tensors:
                if name not in params_dict:
                    raise PayloadNameError(
                        f"{name!r} is not a parameter of the receiver layer; expected one of {sorted(params_dict)}"
                    )
                default_weight_loader(params_dict[name], weight)
                loaded.append(name)
        return loaded


def _load_all_experts(param, name: str, stacked, shard_id: str, num_experts: int) -> None:
    """Qwen3.5's ``load_fused_expert_weights``: every expert, the EP filter drops non-local."""
    for expert_id in range(num_experts):
        param.weight_loader(param, stacked[expert_id], name, shard_id, expert_id)


@contextlib.contextmanager
def _activated(context, runner: str) -> Iterator[None]:
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.runtime_context import use_context

    backend = {
        "triton": MoeRunnerBackend.TRITON,
        "flashinfer_cutlass": MoeRunnerBackend.FLASHINFER_CUTLASS,
        "triton_kernels": MoeRunnerBackend.TRITON_KERNELS,
        "flashinfer_trtllm": MoeRunnerBackend.FLASHINFER_TRTLLM,
    }[runner]
    with use_context(context):
        with context.flags.moe.override(runner_backend=backend):
            yield


#: Modules SGLang imports lazily when a layer with that runner is built. Each registers its
#: fused functions in a process-wide table at import time, so importing one twice (after
#: something dropped it from ``sys.modules``) fails with "already registered".
RUNNER_MODULES = {
    "triton": (),
    "flashinfer_cutlass": ("sglang.srt.layers.moe.moe_runner.flashinfer_cutlass",),
    "triton_kernels": (),
    "flashinfer_trtllm": (),
}


def preload_runner_modules(runners: Iterable[str] = RUNNERS) -> None:
    """Import the runner modules ``runners`` need, once, before anything snapshots sys.modules.

    pytester's in-process runs restore ``sys.modules`` afterwards; a runner module first
    imported inside such a run would be dropped while its registrations stay, and the next
    layer built with that runner would fail. Importing them beforehand keeps them alive.
    """
    import importlib

    for runner in runners:
        for module in RUNNER_MODULES[runner]:
            importlib.import_module(module)


def build_fused_moe(
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    placement: ReceiverPlacement,
    runner: str = "triton",
    dtype=None,
    layer_id: int = 0,
    prefix: str | None = None,
) -> FusedMoEReceiver:
    """Construct the real ``FusedMoE`` of one receiver rank on CPU.

    ``prefix`` defaults to ``model.layers.{layer_id}.mlp``, the HF module path of the layer's
    experts. Parameters are filled with NaN after construction so a loader that misses an
    element is caught by a bit comparison. Raises :class:`ReceiverTopologyError` for
    combinations SGLang would assert on (experts not divisible by MoE-EP, intermediate size
    not divisible by MoE-TP, unknown runner).
    """
    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.runtime_context import SpawnRanks, create_context
    from sglang.srt.server_args import ServerArgs

    if runner not in RUNNERS:
        raise ReceiverTopologyError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if num_experts < 1 or num_experts % placement.moe_ep_size:
        raise ReceiverTopologyError(
            f"num_experts={num_experts} is not a positive multiple of moe_ep_size={placement.moe_ep_size}"
        )
    if intermediate_size < 1 or intermediate_size % placement.moe_tp_size:
        raise ReceiverTopologyError(
            f"intermediate_size={intermediate_size} is not a positive multiple of "
            f"moe_tp_size={placement.moe_tp_size}"
        )
    dtype = torch.bfloat16 if dtype is None else dtype
    server_args = ServerArgs(
        model_path="dummy", tp_size=placement.tp_size, ep_size=placement.moe_ep_size, device="cpu"
    )
    context = create_context(server_args, role="test", ranks=SpawnRanks(world_rank=placement.tp_rank))
    parallel = context.parallel
    seen = (parallel.moe_tp_size, parallel.moe_tp_rank, parallel.moe_ep_size, parallel.moe_ep_rank)
    wanted = (placement.moe_tp_size, placement.moe_tp_rank, placement.moe_ep_size, placement.moe_ep_rank)
    if seen != wanted:
        raise ReceiverTopologyError(
            f"SGLang placed tp_rank {placement.tp_rank} of tp_size {placement.tp_size} at "
            f"(moe_tp_size, moe_tp_rank, moe_ep_size, moe_ep_rank)={seen}, expected {wanted}"
        )
    with _activated(context, runner):
        layer = FusedMoE(
            num_experts=num_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            layer_id=layer_id,
            top_k=min(2, num_experts),
            params_dtype=dtype,
        )
    with torch.no_grad():
        for name in _PARAM_NAMES:
            getattr(layer, name).fill_(float("nan"))
    return FusedMoEReceiver(
        layer=layer,
        context=context,
        placement=placement,
        runner=runner,
        prefix=prefix if prefix is not None else f"model.layers.{layer_id}.mlp",
        num_experts=num_experts,
    )


#: Receiver gate/up order -> the SGLang MoE runner whose weight layout stores it.
RUNNER_FOR_ORDER = {"gate_up": "triton", "up_gate": "flashinfer_cutlass"}
#: Receiver engine layout -> the SGLang MoE runner that keeps it (checkpoint: by order).
RUNNER_FOR_ENGINE_LAYOUT = {"trtllm_block": "flashinfer_trtllm", "transposed": "triton_kernels"}


def runner_for(topology) -> str:
    """The SGLang MoE runner of a receiver topology."""
    layout = getattr(topology, "engine_layout", "checkpoint")
    return RUNNER_FOR_ENGINE_LAYOUT.get(layout) or RUNNER_FOR_ORDER[topology.order]


_CONTEXTS: dict = {}


def engine_context(receiver, rank: int):
    """SGLang's runtime context of TP rank ``rank`` of ``receiver``, created by SGLang from its
    own server arguments (cached: contexts are immutable once published)."""
    key = (receiver.tp, receiver.moe_ep, receiver.moe_dp, rank)
    if key not in _CONTEXTS:
        from sglang.srt.runtime_context import SpawnRanks, create_context
        from sglang.srt.server_args import ServerArgs

        extra = {"moe_dp_size": receiver.moe_dp}
        if receiver.moe_dp > 1:  # SGLang: attn_cp_size != moe_dp_size only with moe_dp_size 1
            extra["attn_cp_size"] = receiver.moe_dp
        server_args = ServerArgs(model_path="dummy", device="cpu", tp_size=receiver.tp,
                                 ep_size=receiver.moe_ep, **extra)
        _CONTEXTS[key] = create_context(server_args, role="test",
                                        ranks=SpawnRanks(world_rank=rank))
    return _CONTEXTS[key]
