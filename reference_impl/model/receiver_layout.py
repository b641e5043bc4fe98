"""Who owns what on the engine: SGLang ``FusedMoE`` sharding, and vLLM's uneven placement.

:class:`ReceiverTopology` (MoE-EP, MoE-TP and MoE-DP, the gate/up order, padded buffers, the
engine layouts, EPLB's redundant experts, FP8 blocks, the expert placement) and
:class:`ReceiverShard` (which experts and rows one engine rank keeps, and where in ``w13``),
with the checks that refuse what cannot exist and the parameter shapes a rank holds. The
trainer side has its own module (:mod:`.trainer_layout`); :mod:`.layout` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.model.expert_names import fused_name
from pytest_weightsync.reference_impl.model.moe_spec import (
    GATE_UP_ORDERS,
    RECEIVER_PARAMS,
    MoESpec,
    _require,
    gate_up_halves,
)
from pytest_weightsync.vocabulary import (
    ENGINE_LAYOUTS,
    EXPERT_PLACEMENTS,
    PAD_MODES,
    WEIGHT_QUANTS,
)

__all__ = [
    "ReceiverShard",
    "ReceiverTopology",
    "ep_experts",
    "packed_shape",
    "receiver_param_shapes",
    "receiver_shard",
    "validate_receiver",
]

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
