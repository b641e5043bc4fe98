"""Loading every parameter of a Qwen3-MoE / Qwen3.5-MoE model, the way SGLang's models do.

A model loader maps checkpoint names onto the engine's fused parameters with a table like
SGLang's ``stacked_params_mapping`` (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``,
``gate_proj``/``up_proj`` -> ``gate_up_proj``, ``in_proj_qkv``/``in_proj_z`` ->
``in_proj_qkvz``, ``in_proj_b``/``in_proj_a`` -> ``in_proj_ba``), and each engine layer takes
its tensor-parallel slice the way its class does:

* fused column layers: each component's own ``1/tp`` at the component's offset - rank ``r``
  holds ``[q_r; k_r; v_r]``, ``[gate_r; up_r]``, ``[b_r; a_r]``; with fewer KV heads than
  ranks a KV head is shared by ``tp / kv_heads`` consecutive ranks;
* row-parallel layers (``o_proj``, ``out_proj``, the shared expert's ``down_proj``): columns;
* ``A_log``/``dt_bias``: a contiguous ``1/tp``; GDN ``conv1d``: ``[q_r; k_r; v_r]``;
* embeddings: the vocabulary padded to a multiple of 64 (``64 * tp`` when needed), rows past
  the vocabulary zeroed; a tied ``lm_head`` is filled from ``embed_tokens``;
* everything else (norms, the router and its bias, the shared expert's gate, the draft's
  ``fc``) is replicated.

The draft (MTP) model's tensors come under ``mtp.`` and land in the ``draft.``-prefixed
engine parameters; routed experts go through the expert loader. Every copy is planned, and
every entry validated, before the first byte is written.
"""

from __future__ import annotations

import re

from weightsync_example_loader.loader import named_pairs

_LAYER = re.compile(r"^(draft\.)?model\.layers\.(\d+)\.(.+)$")
#: checkpoint name part -> (engine name part, component index)
_STACKED = (
    (".q_proj.", ".qkv_proj.", 0), (".k_proj.", ".qkv_proj.", 1), (".v_proj.", ".qkv_proj.", 2),
    ("shared_expert.gate_proj.", "shared_expert.gate_up_proj.", 0),
    ("shared_expert.up_proj.", "shared_expert.gate_up_proj.", 1),
    (".in_proj_qkv.", ".in_proj_qkvz.", "qkv"), (".in_proj_z.", ".in_proj_qkvz.", 3),
    (".in_proj_b.", ".in_proj_ba.", 0), (".in_proj_a.", ".in_proj_ba.", 1),
)
_ROW_PARALLEL = (".o_proj.", ".out_proj.", "shared_expert.down_proj.")


class ModelPayloadError(ValueError):
    """A whole-model payload this loader refuses; nothing was written."""


def engine_name(name: str) -> str:
    """The engine parameter a checkpoint tensor (before the stacked mapping) belongs to."""
    if name.startswith("mtp."):
        rest = name[len("mtp."):]
        if rest.startswith(("fc.", "pre_fc_norm")):
            return "draft." + rest
        return "draft.model." + rest
    return name


class ModelLoading:
    """The whole-model half of the example loader (mixed into ``ExampleSync``)."""

    @staticmethod
    def _sizes(spec):
        """Rows of each fused component, unsharded, by the engine parameter's last part."""
        q = spec.num_heads * spec.head_dim * (2 if spec.family == "qwen3_5_moe" else 1)
        kv = spec.num_kv_heads * spec.head_dim
        qk = spec.linear_k_heads * spec.linear_k_dim
        v = spec.linear_v_heads * spec.linear_v_dim
        nv = spec.linear_v_heads
        return {"qkv_proj": (q, kv, kv), "gate_up_proj": (spec.intermediate_shared,) * 2,
                "in_proj_qkvz": (qk, qk, v, v), "in_proj_ba": (nv, nv), "conv1d": (qk, qk, v)}

    @staticmethod
    def _vocab(spec, tp, rank):
        pad = 64
        if (-(-spec.vocab // pad) * pad) % tp:
            pad *= tp
        rows = (-(-spec.vocab // pad) * pad) // tp
        start = min(rank * rows, spec.vocab)
        return start, min(start + rows, spec.vocab) - start, rows

    def _component_rows(self, spec, engine, component, tensor, tp, rank):
        """``[(dst offset, rows of tensor)]``: what fused engine parameter ``engine`` of
        ``rank`` takes from checkpoint tensor ``tensor``, its component ``component`` (an
        index, or ``"qkv"`` for a GDN ``in_proj_qkv`` / ``conv1d``: ``[q; k; v]`` in one
        tensor, three components)."""
        key = engine.rsplit(".", 2)[-2]
        if component == "qkv":
            qk = spec.linear_k_heads * spec.linear_k_dim
            parts = list(enumerate(tensor.split([qk, qk, tensor.shape[0] - 2 * qk])))
        else:
            parts = [(component, tensor)]
        out = []
        for index, part in parts:
            offset, start, take = self._component(spec, key, index, part, tp, rank)
            out.append((offset, part.narrow(0, start, take)))
        return out

    def _component(self, spec, key, index, part, tp, rank):
        """``(dst offset, src start, rows)`` of fused component ``index`` on ``rank``: every
        component is placed on its own, as SGLang's ``weight_loader(param, w, shard_id)``."""
        sizes = self._sizes(spec)[key]
        replicated_kv = key == "qkv_proj" and spec.num_kv_heads < tp

        def local(j):
            if replicated_kv and j > 0:
                return spec.head_dim
            return sizes[j] // tp

        offset = sum(local(j) for j in range(index))
        take = local(index)
        if replicated_kv and index > 0:
            start = (rank // (tp // spec.num_kv_heads)) * spec.head_dim
        else:
            start = rank * take
        if part.shape[0] != sizes[index]:
            raise ModelPayloadError(f"{key} component {index}: {part.shape[0]} rows, expected "
                                    f"{sizes[index]}")
        return offset, start, take

    def plan_model(self, params, payload, fmt, spec, topology, rank, targets):
        """Every ``(dst, src)`` copy of a whole-model bucket, plus zero fills, after checks."""
        tp = topology.tp
        targets = tuple(spec.targets) if targets is None else tuple(targets)
        copies, zeros, experts = [], [], {"target": [], "draft": []}
        for name, tensor in named_pairs(payload, ModelPayloadError):
            target = "draft" if name.startswith(("mtp.", "draft.")) else "target"
            if target not in targets:
                raise ModelPayloadError(f"{name!r}: the update does not reach the {target} model")
            engine = name if fmt == "direct" else engine_name(name)
            if ".mlp.experts." in engine:
                own = engine[len("draft."):] if target == "draft" else engine
                experts[target].append((own, tensor))
                continue
            if fmt == "direct":
                if engine not in params or tuple(params[engine].shape) != tuple(tensor.shape):
                    raise ModelPayloadError(f"{name!r}: not an engine parameter of this shape")
                if params[engine].dtype != tensor.dtype:
                    raise ModelPayloadError(f"{name!r}: dtype {tensor.dtype}, the engine holds "
                                            f"{params[engine].dtype}")
                copies.append((params[engine], tensor))
                continue
            if spec.family == "qwen3_5_moe":
                engine = engine.replace(".self_attn.", ".")
            if engine == "lm_head.weight" and spec.tied:
                raise ModelPayloadError("lm_head.weight of a tied model: embed_tokens is its source")
            component = None
            for part, fused_part, index in _STACKED:
                if part in engine and ".mlp.experts." not in engine:
                    engine, component = engine.replace(part, fused_part), index
                    break
            if engine.endswith(".conv1d.weight"):
                component = "qkv"
            if engine not in params:
                raise ModelPayloadError(f"{name!r}: no engine parameter {engine!r}")
            if params[engine].dtype != tensor.dtype:
                raise ModelPayloadError(f"{name!r}: dtype {tensor.dtype}, the engine holds "
                                        f"{params[engine].dtype}")
            if component is not None:
                for offset, rows in self._component_rows(spec, engine, component, tensor, tp,
                                                         rank):
                    copies.append((params[engine].narrow(0, offset, rows.shape[0]), rows))
                continue
            dst = params[engine]
            if engine.endswith(("embed_tokens.weight", "lm_head.weight")):
                heads = [dst] + ([params["lm_head.weight"]] if spec.tied else [])
                start, real, rows = self._vocab(spec, tp, rank)
                for head in heads:
                    copies.append((head.narrow(0, 0, real), tensor.narrow(0, start, real)))
                    zeros.append(head.narrow(0, real, rows - real))
            elif any(part in engine for part in _ROW_PARALLEL):
                n = dst.shape[1]
                copies.append((dst, tensor.narrow(1, rank * n, n)))
            elif engine.endswith((".A_log", ".dt_bias")):
                n = dst.shape[0]
                copies.append((dst, tensor.narrow(0, rank * n, n)))
            else:
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ModelPayloadError(f"{name!r}: shape {tuple(tensor.shape)}, the "
                                            f"replicated {engine!r} is {tuple(dst.shape)}")
                copies.append((dst, tensor))
        return copies, zeros, experts
