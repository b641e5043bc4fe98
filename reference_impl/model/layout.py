"""The one layout model every sync path shares: shapes, names and who owns what.

Megatron-Core holds MoE experts sharded by expert parallelism (EP: whole experts per rank),
expert tensor parallelism (ETP: rows of fc1 / columns of fc2) and pipeline parallelism
(PP: contiguous layers per stage). SGLang's ``FusedMoE`` holds them as two fused parameters
per layer, ``w13_weight [E_local, 2 * I_local, H]`` and ``w2_weight [E_local, H, I_local]``,
sharded by MoE-EP and MoE-TP. Every question of the form "which experts, which rows, which
rank, which name" is answered here and nowhere else, so a path that disagrees with another
path disagrees with this module, and a new topology reaches every path at once.

Everything here is pure: frozen dataclasses and functions of them. Impossible combinations
raise :class:`TopologyError` naming the constraint and the values that broke it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.vocabulary import (
    ENGINE_LAYOUTS,
    EXPERT_IMPLS,
    EXPERT_PLACEMENTS,
    ORDERS,
    PAD_MODES,
    WEIGHT_QUANTS,
)

#: Projections of one gated expert, in Hugging Face terms.
PROJECTIONS = ("gate", "up", "down")
#: A projection's position in :data:`PROJECTIONS` (the order checkpoints list them in).
PROJECTION_INDEX = {p: i for i, p in enumerate(PROJECTIONS)}
#: Receiver orders of the two halves of ``w13_weight``; how padded buffers slice the
#: intermediate dimension (see ``ReceiverTopology``); trainer expert modules.
GATE_UP_ORDERS = ORDERS
#: The two fused receiver parameters of one layer.
RECEIVER_PARAMS = ("w13", "w2")


class TopologyError(WeightSyncError):
    """A model shape / parallel layout combination that cannot exist."""


def _require(ok: bool, constraint: str, **values) -> None:
    if not ok:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise TopologyError(f"{constraint} (got {shown})")


def gate_up_halves(order: str) -> tuple[str, str]:
    """The projections held by the first and second half of ``w13``, in that order:
    ``("gate", "up")`` for ``"gate_up"``, ``("up", "gate")`` for ``"up_gate"``."""
    _require(order in GATE_UP_ORDERS, f"gate/up order must be one of {GATE_UP_ORDERS}",
             order=order)
    return ("gate", "up") if order == "gate_up" else ("up", "gate")


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoESpec:
    """Shape of the routed experts of a model: ``num_layers`` MoE layers of ``num_experts``
    gated experts each, ``gate_proj``/``up_proj`` ``[intermediate, hidden]`` and
    ``down_proj`` ``[hidden, intermediate]``."""

    num_layers: int
    num_experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype = torch.bfloat16
    gated: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "hidden", "intermediate"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"MoESpec.{name} must be an int >= 1",
                     **{name: value})
        _require(isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point,
                 "MoESpec.dtype must be a floating torch.dtype", dtype=self.dtype)
        _require(self.gated, "only gated (SwiGLU: gate_proj + up_proj) experts are modelled; "
                 "MoESpec.gated must be True", gated=self.gated)

    def hf_shape(self, projection: str) -> tuple[int, int]:
        """Shape of one unsharded Hugging Face expert projection."""
        if projection in ("gate", "up"):
            return (self.intermediate, self.hidden)
        if projection == "down":
            return (self.hidden, self.intermediate)
        raise WeightSyncError(f"unknown projection {projection!r}; expected one of {PROJECTIONS}")


@dataclass(frozen=True)
class ExpertWeights:
    """The three unsharded Hugging Face tensors of one expert."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __getitem__(self, projection: str) -> torch.Tensor:
        return getattr(self, projection)


#: Full (unsharded) expert weights, as every sender path takes them:
#: ``{global_layer: (ExpertWeights of expert 0, of expert 1, ...)}``.
FullWeights = dict[int, tuple[ExpertWeights, ...]]


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

#: A layer or expert id in a name: ASCII digits, no leading zero, at most 9 digits (so int()
#: never sees thousands of digits). ``\d`` would accept non-ASCII digits and a ``$`` anchor a
#: trailing newline; every pattern below is used with ``re.fullmatch`` instead.
_ID = r"(0|[1-9][0-9]{0,8})"
_MOE = r"model\.layers\." + _ID + r"\.mlp\.experts\."
_HF_EXPERT = re.compile(_MOE + _ID + r"\.(gate|up|down)_proj\.weight", re.ASCII)
_FUSED = re.compile(_MOE + r"(w13|w2)_weight", re.ASCII)
_HF_FUSED = re.compile(_MOE + r"(gate_up|down)_proj", re.ASCII)
_MEGATRON_SEQ = re.compile(
    r"decoder\.layers\." + _ID + r"\.mlp\.experts\.local_experts\." + _ID + r"\.linear_fc(1|2)\.weight",
    re.ASCII)
_MEGATRON_TE = re.compile(r"decoder\.layers\." + _ID + r"\.mlp\.experts\.linear_fc(1|2)\.weight" + _ID,
                          re.ASCII)
#: What a name that looks like an expert name but is not one is judged by (for messages).
_LOOSE_ID = re.compile(r"(?:model\.layers\.|\.experts\.)([^.]*)")


def hf_expert_name(layer: int, expert: int, projection: str) -> str:
    """Per-expert Hugging Face name, e.g. ``model.layers.0.mlp.experts.3.gate_proj.weight``."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"


def fused_name(layer: int, param: str) -> str:
    """SGLang ``FusedMoE`` parameter name (``param`` is ``"w13"`` or ``"w2"``). The packed
    payload uses the same names with the global, unsharded shape."""
    return f"model.layers.{layer}.mlp.experts.{param}_weight"


def hf_fused_name(layer: int, param: str) -> str:
    """Name of SGLang's fused-expert checkpoint format (``param`` is ``"gate_up"`` or
    ``"down"``): ``model.layers.{L}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first) and ``...experts.down_proj`` ``[E, H, I]``."""
    return f"model.layers.{layer}.mlp.experts.{param}_proj"


def megatron_expert_name(impl: str, local_layer: int, local_expert: int, fc: int) -> str:
    """Megatron-Core parameter name of one local expert's ``linear_fc{fc}`` on a PP stage."""
    if impl == "sequential":
        return (f"decoder.layers.{local_layer}.mlp.experts.local_experts.{local_expert}"
                f".linear_fc{fc}.weight")
    if impl == "te_grouped":
        return f"decoder.layers.{local_layer}.mlp.experts.linear_fc{fc}.weight{local_expert}"
    raise TopologyError(f"unknown expert_impl {impl!r}; expected one of {EXPERT_IMPLS}")


class ParsedName(NamedTuple):
    #: "expert" (per-expert HF), "fused" (w13/w2: packed or direct), "hf_fused"
    #: (gate_up_proj/down_proj of every expert)
    kind: str
    layer: int
    expert: Optional[int]  # per-expert names only
    #: "gate"/"up"/"down" (expert), "w13"/"w2" (fused), "gate_up"/"down" (hf_fused)
    projection: Optional[str]


def parse_receiver_name(name) -> Optional[ParsedName]:
    """Parse a receiver-side name; ``None`` when it is not an expert weight name. The whole
    string must match (no trailing newline), ids are ASCII digits without leading zeros."""
    if not isinstance(name, str):
        return None
    m = _HF_EXPERT.fullmatch(name)
    if m:
        return ParsedName("expert", int(m.group(1)), int(m.group(2)), m.group(3))
    m = _FUSED.fullmatch(name)
    if m:
        return ParsedName("fused", int(m.group(1)), None, m.group(2))
    m = _HF_FUSED.fullmatch(name)
    if m:
        return ParsedName("hf_fused", int(m.group(1)), None, m.group(2))
    return None


def name_problem(name: str) -> str:
    """Why ``name`` (which :func:`parse_receiver_name` refused) is no expert weight name: an
    id with a leading zero, non-ASCII digits or too many digits, or simply an unknown name."""
    for token in _LOOSE_ID.findall(name):
        if token and token.isdigit():
            if not token.isascii():
                return f"id {token!r} has non-ASCII digits"
            if len(token) > 9:
                return f"id of {len(token)} digits (at most 9)"
            if len(token) > 1 and token.startswith("0"):
                return f"id {token!r} has a leading zero"
    if name != name.strip():
        return "leading or trailing whitespace"
    return ("not an expert weight name of any format (expected model.layers.{L}.mlp.experts."
            "{e}.{gate,up,down}_proj.weight, ...experts.{w13,w2}_weight or "
            "...experts.{gate_up,down}_proj)")


def parse_megatron_name(name: str) -> Optional[tuple[int, int, int]]:
    """``(local_layer, local_expert, fc)`` of a Megatron expert parameter name, else ``None``.
    Both SequentialMLP and TEGroupedMLP spellings are accepted."""
    m = _MEGATRON_SEQ.fullmatch(name)
    if m:
        return int(m.group(1)), int(m.group(2)), int(m.group(3))
    m = _MEGATRON_TE.fullmatch(name)
    if m:
        return int(m.group(1)), int(m.group(3)), int(m.group(2))
    return None


# --------------------------------------------------------------------------------------------
# Trainer (Megatron-Core) topology
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerTopology:
    """Megatron-Core parallel sizes that matter for experts.

    ``dp`` is the dense data-parallel size; ``None`` picks the smallest one for which the
    expert grid fits (``tp * dp`` divisible by ``etp * ep``). Rank order follows Megatron's
    default ``tp-cp-ep-dp-pp``: within a PP stage the dense TP rank is ``r % tp`` and the
    expert ranks are ``etp_rank = r % etp``, ``ep_rank = (r // etp) % ep``,
    ``edp_rank = r // (etp * ep)``; the PP stage is ``rank // (world_size // pp)``.

    ``first_stage_layers`` (``None``: every stage holds ``num_layers // pp``) gives the first
    pipeline stage that many layers and splits the rest evenly over the other stages, as
    Megatron-Core's ``num_layers_in_first_pipeline_stage`` does (uneven pipelines: a stage
    offset that is not ``stage * num_layers // pp``).
    """

    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    expert_impl: str = "sequential"
    first_stage_layers: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp", "pp"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1,
                     f"TrainerTopology.{name} must be an int >= 1", **{name: value})
        _require(self.expert_impl in EXPERT_IMPLS,
                 f"TrainerTopology.expert_impl must be one of {EXPERT_IMPLS}",
                 expert_impl=self.expert_impl)
        if self.dp is None:
            expert_grid = self.etp * self.ep
            object.__setattr__(self, "dp", math.lcm(self.tp, expert_grid) // self.tp)
        _require(isinstance(self.dp, int) and self.dp >= 1, "TrainerTopology.dp must be >= 1",
                 dp=self.dp)
        _require((self.tp * self.dp) % (self.etp * self.ep) == 0,
                 "ranks per pipeline stage (tp * dp) must be divisible by etp * ep",
                 tp=self.tp, dp=self.dp, etp=self.etp, ep=self.ep)
        first = self.first_stage_layers
        _require(first is None or (isinstance(first, int) and first >= 1 and self.pp > 1),
                 "TrainerTopology.first_stage_layers must be None or an int >= 1 with pp > 1",
                 first_stage_layers=first, pp=self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        return self.tp * self.dp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.etp * self.ep)


@dataclass(frozen=True)
class TrainerShard:
    """What trainer rank ``rank`` holds: global layers, global experts, fc1/fc2 intermediate
    rows ``[row_start, row_start + rows)`` of each of gate, up (fc1) and down columns (fc2)."""

    rank: int
    pp_rank: int
    tp_rank: int
    etp_rank: int
    ep_rank: int
    edp_rank: int
    layers: range
    experts: range
    row_start: int
    rows: int

    def global_layer(self, local_layer: int) -> int:
        return self.layers[local_layer]

    def global_expert(self, local_expert: int) -> int:
        """EP renumbering: ``ep_rank * num_local_experts + local_index``."""
        return self.experts[local_expert]


def validate_trainer(spec: MoESpec, topo: TrainerTopology) -> None:
    _require(spec.num_experts % topo.ep == 0,
             "num_experts must be divisible by the trainer's expert parallel size (ep)",
             num_experts=spec.num_experts, ep=topo.ep)
    _require(spec.intermediate % topo.etp == 0,
             "intermediate must be divisible by the trainer's expert tensor parallel size (etp)",
             intermediate=spec.intermediate, etp=topo.etp)
    stage_layers(spec.num_layers, topo)  # validates


def stage_layers(num_layers: int, topo: TrainerTopology) -> tuple[range, ...]:
    """The global layers of each pipeline stage, in stage order (contiguous runs): an even
    split, or ``topo.first_stage_layers`` on the first stage and the rest split evenly."""
    first = topo.first_stage_layers
    if first is None:
        _require(num_layers % topo.pp == 0,
                 "num_layers must be divisible by the trainer's pipeline parallel size (pp)",
                 num_layers=num_layers, pp=topo.pp)
        sizes = [num_layers // topo.pp] * topo.pp
    else:
        rest = num_layers - first
        _require(rest >= topo.pp - 1 and rest % (topo.pp - 1) == 0,
                 "the layers after the first stage's must split evenly over the other stages",
                 num_layers=num_layers, first_stage_layers=first, pp=topo.pp)
        sizes = [first] + [rest // (topo.pp - 1)] * (topo.pp - 1)
    starts = [sum(sizes[:i]) for i in range(topo.pp)]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes))


def trainer_shard(spec: MoESpec, topo: TrainerTopology, rank: int) -> TrainerShard:
    """Ownership of trainer rank ``rank`` (global rank in ``range(topo.world_size)``)."""
    validate_trainer(spec, topo)
    _require(0 <= rank < topo.world_size, "trainer rank must be in range(world_size)",
             rank=rank, world_size=topo.world_size)
    pp_rank, r = divmod(rank, topo.stage_size)
    etp_rank = r % topo.etp
    ep_rank = (r // topo.etp) % topo.ep
    edp_rank = r // (topo.etp * topo.ep)
    experts_per_rank = spec.num_experts // topo.ep
    rows = spec.intermediate // topo.etp
    return TrainerShard(
        rank=rank, pp_rank=pp_rank, tp_rank=r % topo.tp, etp_rank=etp_rank, ep_rank=ep_rank,
        edp_rank=edp_rank,
        layers=stage_layers(spec.num_layers, topo)[pp_rank],
        experts=range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank),
        row_start=etp_rank * rows, rows=rows,
    )


def trainer_groups(spec: MoESpec, topo: TrainerTopology, kind: str) -> list[list[int]]:
    """Rank lists of every ``kind`` group (``"etp"``, ``"ep"``, ``"edp"``, ``"pp"``), in the
    order each group's members are indexed (member i has ``{kind}_rank == i``)."""
    shards = [trainer_shard(spec, topo, r) for r in range(topo.world_size)]
    coords = ("pp_rank", "etp_rank", "ep_rank", "edp_rank")
    member = {"etp": "etp_rank", "ep": "ep_rank", "edp": "edp_rank", "pp": "pp_rank"}
    _require(kind in member, "group kind must be one of etp, ep, edp, pp", kind=kind)
    key_fields = [c for c in coords if c != member[kind]]
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for s in shards:
        key = tuple(getattr(s, c) for c in key_fields)
        groups.setdefault(key, []).append((getattr(s, member[kind]), s.rank))
    return [[rank for _, rank in sorted(members)] for _, members in sorted(groups.items())]


# --------------------------------------------------------------------------------------------
# Receiver (SGLang FusedMoE; vLLM's uneven expert placement) topology
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiverTopology:
    """One SGLang engine's MoE layout (and vLLM's uneven expert placement, see
    ``expert_placement``).

    ``moe_tp = tp // moe_ep // moe_dp``; within the TP group ``moe_tp_rank = r % moe_tp`` and
    ``moe_ep_rank = (r // moe_tp) % moe_ep`` (EP-only / DeepEP style is ``moe_tp == 1``).

    ``order``: which half of ``w13_weight`` holds gate (``"gate_up"``: SGLang's default;
    ``"up_gate"``: runners with ``load_up_proj_weight_first``, e.g. flashinfer_cutlass).

    ``intermediate_padded``: rows per rank of each w13 half (and columns of w2) when the
    buffers are padded; ``None`` means unpadded (``intermediate // moe_tp``). ``pad_mode``:
    ``"even"`` (SGLang's default loader: rank r takes the even slice
    ``[r * I/moe_tp, (r+1) * I/moe_tp)`` and zeroes the tail of its buffer) or ``"blocked"``
    (SGLang's padded loader on CPU / trtllm: rank r takes ``[r * P, min((r+1) * P, I))`` with
    ``P = intermediate_padded``, so uneven intermediate sizes are allowed).

    The fields below default to today's checkpoint-layout engine; each models what an engine
    really holds (docs/layout.md):

    ``engine_layout``: what the parameters hold between updates (``ENGINE_LAYOUTS``):
    ``"checkpoint"``, ``"trtllm_block"`` (post-processed after every update, restored before
    the next; needs order ``up_gate``, blocked padding to a multiple of 128, hidden a multiple
    of 64, BF16) or ``"transposed"`` (triton_kernels: ``w13 [E, H, 2I]``, ``w2 [E, I, H]``,
    order ``gate_up``).

    ``redundant_experts`` / ``placement``: EPLB. The engine holds ``num_experts +
    redundant_experts`` physical expert slots, ``(E + R) / moe_ep`` per rank; ``placement[L][p]``
    is the logical expert physical slot ``p`` of layer ``L`` holds (SGLang's
    ``ExpertLocationMetadata.physical_to_logical_map``; ``None``: SGLang's trivial map,
    ``p % num_experts``). Every physical copy holds its logical expert's weights. A rebalance
    between updates is a new topology with another placement.

    ``weight_quant`` / ``quant_block``: ``"fp8_block"`` holds float8_e4m3fn weights plus one
    float32 ``weight_scale_inv`` per ``quant_block = (block_n, block_k)`` block (SGLang
    ``Fp8MoEMethod``; its default block is 128 x 128).

    ``expert_placement`` (:data:`~pytest_weightsync.vocabulary.EXPERT_PLACEMENTS`): which
    experts each MoE-EP rank holds. ``"even"`` is SGLang's: ``num_experts % moe_ep == 0`` and
    EP rank ``e`` holds ``[e * E/moe_ep, (e+1) * E/moe_ep)``. ``"linear_uneven"`` is vLLM's
    ``determine_expert_map`` (linear strategy), which also takes ``E % moe_ep != 0``: EP rank
    ``e`` holds ``E // moe_ep`` experts plus one for the first ``E % moe_ep`` ranks, starting
    at ``e * (E // moe_ep) + min(e, E % moe_ep)``, so local expert counts (and the ``w13`` /
    ``w2`` shapes) differ between ranks. Only vLLM's engine shape has it: all-EP MoE
    (``moe_tp == 1``, ``moe_dp == 1``), gate first, unpadded, checkpoint layout, no EPLB
    (``vllm_layout.vllm_topology`` gives that vLLM engine). Not to be confused with
    ``placement``, EPLB's physical -> logical map.
    """

    tp: int = 1
    moe_ep: int = 1
    moe_dp: int = 1
    order: str = "gate_up"
    intermediate_padded: Optional[int] = None
    pad_mode: str = "even"
    engine_layout: str = "checkpoint"
    redundant_experts: int = 0
    placement: Optional[tuple] = None
    weight_quant: str = "none"
    quant_block: tuple = (128, 128)
    expert_placement: str = "even"

    def __post_init__(self) -> None:
        for name in ("tp", "moe_ep", "moe_dp"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1,
                     f"ReceiverTopology.{name} must be an int >= 1", **{name: value})
        _require(self.tp % (self.moe_ep * self.moe_dp) == 0,
                 "receiver tp must be divisible by moe_ep * moe_dp (moe_tp = tp // moe_ep // moe_dp)",
                 tp=self.tp, moe_ep=self.moe_ep, moe_dp=self.moe_dp)
        _require(self.order in GATE_UP_ORDERS, f"ReceiverTopology.order must be one of {GATE_UP_ORDERS}",
                 order=self.order)
        _require(self.pad_mode in PAD_MODES, f"ReceiverTopology.pad_mode must be one of {PAD_MODES}",
                 pad_mode=self.pad_mode)
        _require(self.intermediate_padded is None
                 or (isinstance(self.intermediate_padded, int) and self.intermediate_padded >= 1),
                 "ReceiverTopology.intermediate_padded must be None or an int >= 1",
                 intermediate_padded=self.intermediate_padded)
        _require(self.pad_mode == "even" or self.intermediate_padded is not None,
                 "pad_mode='blocked' needs intermediate_padded", pad_mode=self.pad_mode,
                 intermediate_padded=self.intermediate_padded)
        _require(self.engine_layout in ENGINE_LAYOUTS,
                 f"ReceiverTopology.engine_layout must be one of {ENGINE_LAYOUTS}",
                 engine_layout=self.engine_layout)
        if self.engine_layout == "trtllm_block":
            # FusedMoE with a flashinfer_trtllm runner: w1/w3 shard ids swapped on load (up
            # first), padded loading, intermediate rounded up to a multiple of 128.
            _require(self.order == "up_gate" and self.pad_mode == "blocked"
                     and self.intermediate_padded % 128 == 0,
                     "engine_layout='trtllm_block' is SGLang's flashinfer_trtllm BF16 layout: "
                     "order 'up_gate', pad_mode 'blocked', intermediate_padded a multiple of 128",
                     order=self.order, pad_mode=self.pad_mode,
                     intermediate_padded=self.intermediate_padded)
        if self.engine_layout == "transposed":
            _require(self.order == "gate_up", "engine_layout='transposed' is SGLang's "
                     "triton_kernels runner, which loads gate first (order 'gate_up')",
                     order=self.order)
        _require(isinstance(self.redundant_experts, int) and self.redundant_experts >= 0,
                 "ReceiverTopology.redundant_experts must be an int >= 0",
                 redundant_experts=self.redundant_experts)
        if self.placement is not None:
            ok = (isinstance(self.placement, tuple)
                  and all(isinstance(row, tuple) and all(isinstance(v, int) for v in row)
                          for row in self.placement))
            _require(ok, "ReceiverTopology.placement must be a tuple (per layer) of tuples of "
                     "logical expert ids (hashable, like the rest of the topology)",
                     placement=type(self.placement).__name__)
        _require(self.weight_quant in WEIGHT_QUANTS,
                 f"ReceiverTopology.weight_quant must be one of {WEIGHT_QUANTS}",
                 weight_quant=self.weight_quant)
        _require(isinstance(self.quant_block, tuple) and len(self.quant_block) == 2
                 and all(isinstance(b, int) and b >= 1 for b in self.quant_block),
                 "ReceiverTopology.quant_block must be a pair of ints >= 1 (block_n, block_k)",
                 quant_block=self.quant_block)
        special = [name for name, on in (("engine_layout", self.engine_layout != "checkpoint"),
                                         ("redundant experts", self.eplb),
                                         ("weight_quant", self.weight_quant != "none")) if on]
        _require(len(special) <= 1, "one of engine_layout, redundant experts (EPLB) and "
                 "weight_quant per receiver topology (their combinations are not modelled)",
                 set=special)
        _require(self.expert_placement in EXPERT_PLACEMENTS,
                 f"ReceiverTopology.expert_placement must be one of {EXPERT_PLACEMENTS}",
                 expert_placement=self.expert_placement)
        if self.expert_placement == "linear_uneven":
            _require(self.moe_tp == 1 and self.moe_dp == 1 and not self.padded
                     and self.order == "gate_up" and not special,
                     "expert_placement='linear_uneven' is vLLM's expert map, on vLLM's expert-"
                     "parallel engine only: moe_tp 1, moe_dp 1 (EP over every rank), order "
                     "'gate_up', unpadded, checkpoint layout, no EPLB, no weight_quant",
                     moe_tp=self.moe_tp, moe_dp=self.moe_dp,
                     intermediate_padded=self.intermediate_padded, order=self.order,
                     set=special)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.moe_ep // self.moe_dp

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def padded(self) -> bool:
        return self.intermediate_padded is not None

    @property
    def eplb(self) -> bool:
        """Whether physical expert slots differ from logical experts (redundant copies or an
        explicit placement)."""
        return self.redundant_experts > 0 or self.placement is not None

    @property
    def default_engine(self) -> bool:
        """Whether this is the plain checkpoint-layout engine every suite has always run."""
        return (self.engine_layout == "checkpoint" and not self.eplb
                and self.weight_quant == "none")

    def num_physical_experts(self, spec: "MoESpec") -> int:
        """Expert slots of the whole engine: ``num_experts + redundant_experts``."""
        return spec.num_experts + self.redundant_experts

    def physical_to_logical(self, spec: "MoESpec") -> tuple:
        """``placement``, or SGLang's trivial map (``ExpertLocationMetadata.init_trivial``:
        physical slot ``p`` holds logical expert ``p % num_experts``), one row per layer."""
        if self.placement is not None:
            return self.placement
        n = self.num_physical_experts(spec)
        return tuple(tuple(p % spec.num_experts for p in range(n))
                     for _ in range(spec.num_layers))


@dataclass(frozen=True)
class ReceiverShard:
    """What receiver rank ``rank`` owns: experts ``experts`` (global ids, stored at local slots
    ``0..len-1``) and intermediate rows ``[row_start, row_start + rows)`` of gate, up and down,
    stored in a buffer of ``buffer_rows`` rows per half (the tail beyond ``rows`` is zero)."""

    rank: int
    moe_tp_rank: int
    moe_ep_rank: int
    moe_dp_rank: int
    experts: range
    row_start: int
    rows: int
    buffer_rows: int
    #: EPLB only: per layer, the logical expert each local slot holds (``experts`` then
    #: holds physical slot ids, as SGLang's ``FusedMoE`` built with E + R experts sees them).
    slot_logical: Optional[tuple] = None

    def local_expert(self, expert: int) -> Optional[int]:
        """Global -> local expert slot; ``None`` for an expert this rank does not hold."""
        if expert in self.experts:
            return expert - self.experts.start
        return None

    def logical_expert(self, layer: int, slot: int) -> int:
        """The (logical) expert whose weights local ``slot`` of ``layer`` holds."""
        if self.slot_logical is None:
            return self.experts[slot]
        return self.slot_logical[layer][slot]

    def slot_experts(self, layer: int) -> tuple:
        """The logical expert of every local slot of ``layer``, in slot order."""
        if self.slot_logical is None:
            return tuple(self.experts)
        return self.slot_logical[layer]

    def slots_of(self, layer: int, expert: int) -> list[int]:
        """Every local slot of ``layer`` holding logical ``expert`` (all its physical copies on
        this rank; empty when the rank holds none)."""
        return [slot for slot, e in enumerate(self.slot_experts(layer)) if e == expert]

    def half_offset(self, projection: str, order: str) -> int:
        """Row offset of ``projection`` (gate/up) inside one expert's ``w13`` buffer."""
        first, _ = gate_up_halves(order)
        if projection not in ("gate", "up"):
            raise WeightSyncError(f"w13 holds gate and up, not {projection!r}")
        return 0 if projection == first else self.buffer_rows


def _validate_engine(spec: MoESpec, topo: ReceiverTopology) -> None:
    """The constraints of the non-checkpoint receiver fields that involve the model shape."""
    if topo.eplb:
        physical = topo.num_physical_experts(spec)
        _require(physical % topo.moe_ep == 0,
                 "num_experts + redundant_experts must be divisible by the receiver's moe_ep",
                 num_experts=spec.num_experts, redundant_experts=topo.redundant_experts,
                 moe_ep=topo.moe_ep)
        rows = topo.physical_to_logical(spec)
        _require(len(rows) == spec.num_layers and all(len(r) == physical for r in rows),
                 "placement needs one row per layer of num_experts + redundant_experts slots",
                 layers=len(rows), slots=sorted({len(r) for r in rows}),
                 num_layers=spec.num_layers, physical=physical)
        for layer, row in enumerate(rows):
            _require(all(0 <= e < spec.num_experts for e in row),
                     "placement holds logical expert ids in range(num_experts)",
                     layer=layer, row=row)
            _require(len(set(row)) == spec.num_experts, "every logical expert needs at least "
                     "one physical slot in every layer", layer=layer,
                     missing=sorted(set(range(spec.num_experts)) - set(row)))
    if topo.engine_layout == "trtllm_block":
        _require(spec.dtype == torch.bfloat16 and spec.hidden % 64 == 0,
                 "engine_layout='trtllm_block' (TRT-LLM BF16) needs bfloat16 weights and hidden "
                 "a multiple of 64 (128-byte column blocks; w2 rows shuffled in blocks of 32)",
                 dtype=spec.dtype, hidden=spec.hidden)
    if topo.weight_quant == "fp8_block":
        block_n, block_k = topo.quant_block
        _require(block_n == block_k, "fp8_block: only square blocks are modelled (SGLang's "
                 "default weight_block_size is [128, 128])", quant_block=topo.quant_block)
        rows = topo.intermediate_padded or spec.intermediate // max(topo.moe_tp, 1)
        _require(rows % block_n == 0 and (topo.moe_tp == 1 or rows % block_k == 0),
                 "fp8_block: rows per MoE-TP rank must be divisible by block_n (and by block_k "
                 "when moe_tp > 1), as SGLang's create_fp8_moe_weight_ requires",
                 rows=rows, quant_block=topo.quant_block, moe_tp=topo.moe_tp)
        _require(not topo.padded, "fp8_block receivers are unpadded here",
                 intermediate_padded=topo.intermediate_padded)


def validate_receiver(spec: MoESpec, topo: ReceiverTopology) -> None:
    _validate_engine(spec, topo)
    experts = topo.num_physical_experts(spec) if topo.eplb else spec.num_experts
    if topo.expert_placement == "linear_uneven":
        _require(spec.num_experts >= topo.moe_ep,
                 "expert_placement='linear_uneven' needs at least one expert per EP rank "
                 "(vLLM's Qwen MoE blocks refuse more ranks than experts)",
                 num_experts=spec.num_experts, moe_ep=topo.moe_ep)
    else:
        _require(experts % topo.moe_ep == 0,
                 "num_experts must be divisible by the receiver's moe_ep (SGLang's even "
                 "placement; vLLM's uneven one is expert_placement='linear_uneven')",
                 num_experts=spec.num_experts, moe_ep=topo.moe_ep)
    if topo.pad_mode == "blocked":
        _require(topo.intermediate_padded * topo.moe_tp >= spec.intermediate,
                 "blocked padding needs intermediate_padded * moe_tp >= intermediate",
                 intermediate_padded=topo.intermediate_padded, moe_tp=topo.moe_tp,
                 intermediate=spec.intermediate)
        return
    _require(spec.intermediate % topo.moe_tp == 0,
             "intermediate must be divisible by the receiver's moe_tp "
             "(or use pad_mode='blocked' with intermediate_padded)",
             intermediate=spec.intermediate, moe_tp=topo.moe_tp)
    if topo.intermediate_padded is not None:
        _require(topo.intermediate_padded >= spec.intermediate // topo.moe_tp,
                 "intermediate_padded must be >= intermediate // moe_tp",
                 intermediate_padded=topo.intermediate_padded,
                 intermediate=spec.intermediate, moe_tp=topo.moe_tp)


def ep_experts(num_experts: int, moe_ep: int, ep_rank: int, placement: str = "even") -> range:
    """The experts (or EPLB physical slots) EP rank ``ep_rank`` of ``moe_ep`` holds, in local
    slot order: an even block (``placement`` ``"even"``, ``num_experts % moe_ep == 0``), or
    vLLM's linear map (``"linear_uneven"``): ``num_experts // moe_ep`` each, one more on the
    first ``num_experts % moe_ep`` ranks, contiguous in rank order."""
    base, extra = divmod(num_experts, moe_ep)
    if placement == "even":
        _require(extra == 0, "an even placement needs num_experts divisible by moe_ep",
                 num_experts=num_experts, moe_ep=moe_ep)
        return range(ep_rank * base, (ep_rank + 1) * base)
    _require(placement == "linear_uneven", f"expert placement must be one of {EXPERT_PLACEMENTS}",
             placement=placement)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (1 if ep_rank < extra else 0))


def receiver_shard(spec: MoESpec, topo: ReceiverTopology, rank: int) -> ReceiverShard:
    """Ownership of receiver rank ``rank`` (its rank inside the engine's TP group)."""
    validate_receiver(spec, topo)
    _require(0 <= rank < topo.tp, "receiver rank must be in range(tp)", rank=rank, tp=topo.tp)
    moe_tp_rank = rank % topo.moe_tp
    moe_ep_rank = (rank // topo.moe_tp) % topo.moe_ep
    moe_dp_rank = rank // (topo.moe_tp * topo.moe_ep)
    physical = topo.num_physical_experts(spec) if topo.eplb else spec.num_experts
    if topo.pad_mode == "blocked":
        buffer_rows = topo.intermediate_padded
        start = min(buffer_rows * moe_tp_rank, spec.intermediate)
        rows = min(buffer_rows, spec.intermediate - start)
    else:
        rows = spec.intermediate // topo.moe_tp
        start = rows * moe_tp_rank
        buffer_rows = topo.intermediate_padded if topo.intermediate_padded is not None else rows
    experts = ep_experts(physical, topo.moe_ep, moe_ep_rank, topo.expert_placement)
    slot_logical = None
    if topo.eplb:
        slot_logical = tuple(tuple(row[p] for p in experts)
                             for row in topo.physical_to_logical(spec))
    return ReceiverShard(
        rank=rank, moe_tp_rank=moe_tp_rank, moe_ep_rank=moe_ep_rank, moe_dp_rank=moe_dp_rank,
        experts=experts, row_start=start, rows=rows, buffer_rows=buffer_rows,
        slot_logical=slot_logical,
    )


def receiver_param_shapes(spec: MoESpec, topo: ReceiverTopology, rank: int) -> dict[str, tuple]:
    """Names and shapes of every pre-allocated receiver parameter on ``rank``."""
    shard = receiver_shard(spec, topo, rank)
    e_local = len(shard.experts)
    shapes = {}
    transposed = topo.engine_layout == "transposed"
    for layer in range(spec.num_layers):
        w13 = (e_local, 2 * shard.buffer_rows, spec.hidden)
        w2 = (e_local, spec.hidden, shard.buffer_rows)
        if transposed:  # triton_kernels allocates both transposed
            w13, w2 = (w13[0], w13[2], w13[1]), (w2[0], w2[2], w2[1])
        shapes[fused_name(layer, "w13")] = w13
        shapes[fused_name(layer, "w2")] = w2
    return shapes


def packed_shape(spec: MoESpec, param: str) -> tuple[int, int, int]:
    """Global (unsharded, all experts) shape of a packed ``w13``/``w2`` payload tensor."""
    if param == "w13":
        return (spec.num_experts, 2 * spec.intermediate, spec.hidden)
    if param == "w2":
        return (spec.num_experts, spec.hidden, spec.intermediate)
    raise WeightSyncError(f"unknown fused parameter {param!r}; expected one of {RECEIVER_PARAMS}")


# --------------------------------------------------------------------------------------------
# Locating an element (for messages)
# --------------------------------------------------------------------------------------------
