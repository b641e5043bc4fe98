"""How expert weights are named on each side, and how a name is read back.

Hugging Face per-expert names, SGLang's fused ``w13``/``w2`` parameters and its fused-expert
checkpoint names, Megatron-Core's SequentialMLP and TEGroupedMLP names; and the strict parsers
that turn a receiver-side or Megatron name back into coordinates (whole-string matches, ASCII
ids without leading zeros), with :func:`name_problem` saying why a refused name is none. Kept
apart from the ownership math so a new spelling touches only this module;
:mod:`.layout` re-exports it.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from pytest_weightsync.reference_impl.model.moe_spec import TopologyError
from pytest_weightsync.vocabulary import EXPERT_IMPLS

__all__ = [
    "ParsedName",
    "fused_name",
    "hf_expert_name",
    "hf_fused_name",
    "megatron_expert_name",
    "name_problem",
    "parse_megatron_name",
    "parse_receiver_name",
]

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
