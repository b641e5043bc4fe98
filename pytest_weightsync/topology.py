"""What a test's topology id means, in words: the model, the trainer and the engine it runs.

Case ids are short so node ids stay readable (``L4E8H8I2-T.tp2ep4etp1pp2seq-R.tp1ep2dp1gu``,
``q35L2E4H8I4V37h4kv2-tied-mtp1-R.tp4ep2ug-T.tp2pp2ep1etp1te-distributed-multi_layer``);
the report, ``--weightsync-list`` and the JSON spell them out with :func:`describe`, read
from the case object a test is parametrized with (duck-typed: anything with ``spec``,
``receiver`` and an ``id``, as ``suites.harness`` builds them), and explain the grammar once
(:data:`LEGEND`). No torch here: dtypes are named by their ``str``.
"""

from __future__ import annotations

from typing import Optional

#: The parts of a topology id, for readers of the JSON report and ``--weightsync-list``.
LEGEND = {
    "L/E/H/I": "layers, routed experts, hidden size, expert intermediate size (q3 / q35: a "
               "whole Qwen3-MoE / Qwen3.5-MoE model, then V vocab, h attention heads, kv KV heads)",
    "T.tp ep etp pp": "trainer tensor, expert, expert-tensor and pipeline parallel sizes; "
                      "seq / te: SequentialMLP or TEGroupedMLP experts; firstN: N layers on "
                      "the first pipeline stage",
    "R.tp ep dp": "engine MoE tensor-parallel, expert-parallel and data-parallel sizes "
                  "(whole models: engine TP and MoE-EP); gu / ug: w13 holds [gate; up] or "
                  "[up; gate]; padNb/padNe: intermediate padded to N per rank (blocked / even)",
    "engine tags": "-trtllm_block, -transposed: engine layouts kept between updates; -eplbR: R "
                   "redundant experts; -fp8bNxN: FP8 block-quantized weights; -linear_uneven: "
                   "vLLM's expert placement (the first E % ep ranks hold one expert more)",
    "model tags": "tied: tied embeddings; mtpN: an N-layer MTP draft; r32: float32 router; "
                  "bias: expert bias; frozen_draft: the update reaches the target only",
    "delivery": "colocated: each trainer rank returns its engine rank's stream; distributed: "
                "trainer rank 0 sends every stream; -bN / whole / multi_layer / split_layer / "
                "tensor: the bucket limit the exporter is given",
}

_SPEC_FIELDS = ("family", "num_layers", "num_experts", "hidden", "intermediate", "vocab",
                "num_heads", "num_kv_heads", "head_dim", "intermediate_shared", "tied",
                "mtp_layers", "expert_bias", "router_dtype", "dtype")
_TRAINER_FIELDS = ("tp", "ep", "etp", "pp", "expert_impl", "first_stage_layers")
_ENGINE_FIELDS = ("tp", "moe_ep", "moe_dp", "order", "intermediate_padded", "pad_mode",
                  "engine_layout", "redundant_experts", "weight_quant", "quant_block",
                  "expert_placement")


def case_of(params: dict):
    """The topology case among a test's parameters, or ``None``."""
    for value in params.values():
        if isinstance(getattr(value, "id", None), str) and hasattr(value, "spec") \
                and hasattr(value, "receiver"):
            return value
    return None


#: Fields shown even at their defaults (the sizes a reader looks for first).
_ALWAYS = {"num_layers", "num_experts", "hidden", "intermediate", "tp", "ep", "etp", "pp",
           "moe_ep", "moe_dp", "order"}


def _defaults(obj) -> dict:
    import dataclasses

    if not dataclasses.is_dataclass(obj):
        return {}
    return {f.name: f.default for f in dataclasses.fields(obj)
            if f.default is not dataclasses.MISSING}


def _fields(obj, names) -> dict:
    """The fields of ``obj`` among ``names`` that are set: not ``None`` and, but for the sizes
    in :data:`_ALWAYS`, not at the dataclass's default."""
    defaults, out = _defaults(obj), {}
    for name in names:
        value = getattr(obj, name, None)
        if value is None or (name not in _ALWAYS and name in defaults
                             and value == defaults[name]):
            continue
        out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def describe(case) -> dict:
    """The topology of ``case`` in words: ``model``, ``trainer`` and ``engine`` fields that
    are set, and the delivery and bucket limit of a distributed case."""
    spec = case.spec
    out = {"model": _fields(spec, _SPEC_FIELDS)}
    trainer = getattr(case, "trainer", None)
    if trainer is not None:
        out["trainer"] = _fields(trainer, _TRAINER_FIELDS)
    out["engine"] = _fields(case.receiver, _ENGINE_FIELDS)
    for name in ("delivery", "bucket", "bucket_bytes"):
        value = getattr(case, name, None)
        if value is not None:
            out[name] = value
    frozen = getattr(case, "frozen", None)
    if frozen:
        out["frozen"] = list(frozen)
    return out


def summary(described: dict) -> str:
    """One line of :func:`describe`'s words, for the terminal."""
    model, trainer, engine = (described.get(k, {}) for k in ("model", "trainer", "engine"))
    parts = [f"{model.get('family', 'experts')}: {model.get('num_layers')} layers x "
             f"{model.get('num_experts')} experts (hidden {model.get('hidden')}, intermediate "
             f"{model.get('intermediate')})"]
    if "num_heads" in model:
        parts.append(f"{model['num_heads']} heads / {model.get('num_kv_heads')} KV heads, "
                     f"vocab {model.get('vocab')}")
    flags = [word for key, word in (("tied", "tied embeddings"), ("expert_bias", "expert bias"),
                                    ("router_dtype", f"router {model.get('router_dtype')}"),
                                    ("mtp_layers", f"{model.get('mtp_layers')}-layer MTP draft"))
             if key in model]
    if flags:
        parts.append(", ".join(flags))
    if trainer:
        parts.append("trainer " + " ".join(f"{k}={v}" for k, v in trainer.items()))
    parts.append("engine " + " ".join(f"{k}={v}" for k, v in engine.items()))
    if "delivery" in described:
        parts.append(f"{described['delivery']} delivery")
    return "; ".join(parts)


def topology_of(item) -> Optional[object]:
    """The topology case a collected test is parametrized with, or ``None``."""
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else case_of(callspec.params)
