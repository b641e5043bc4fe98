"""The real SGLang model classes of a whole model, built on CPU for one engine rank.

Where :mod:`~pytest_weightsync.reference_impl.backends.sglang_models` builds only the routed
experts (real ``FusedMoE`` layers under a stand-in model object), this module constructs the
served model class itself - ``Qwen3MoeForCausalLM`` (``sglang/srt/models/qwen3_moe.py``) or
``Qwen3_5MoeForConditionalGeneration`` with ``language_model_only`` (``models/qwen3_5.py``) -
and the MTP draft ``Qwen3_5ForCausalLMMTP`` (``models/qwen3_5_mtp.py``), as the family's record
(:mod:`~pytest_weightsync.reference_impl.model.families`) names them, with every real layer
they hold: ``VocabParallelEmbedding``, ``QKVParallelLinear``, ``RowParallelLinear``,
``MergedColumnParallelLinear``, the GDN layer with its packed-checkpoint and
``mamba_v2_sharded_weight_loader`` loaders, ``FusedMoE``, ``ReplicatedLinear``,
``ParallelLMHead``. Their ``load_weights`` and weight loaders then run unmodified.

What is arranged around the real code, and why:

* parallel placement: SGLang's runtime context of (engine, rank)
  (``sglang_models._context``: ``create_context(ServerArgs(tp_size, ep_size, ...))``), with
  its process-group handles (``tp_group``, ``attn_tp_group``, ``moe_tp_group``, ...) stated by
  ``get_parallel().override`` as :class:`_GroupPlacement` objects that carry only the rank and
  size SGLang reads at construction (``rank_in_group``, ``world_size``; the layers resolve
  their TP slice from them exactly as from a ``GroupCoordinator``); no collective runs in a
  load. The pipeline group is a single stage.
* the rotary embedding: on a machine where neither CUDA nor SGLang's CPU engine is detected,
  ``RotaryEmbedding.__init__`` imports a fallback kernel from ``vllm._custom_ops``; a module
  whose ``rotary_embedding`` raises stands in for it during construction only (rotary
  embeddings hold no weights; no forward runs).
* parameters ARE the harness tensors: before each load every SGLang parameter's ``.data`` is
  pointed at the harness tensor of the same engine name, after checking that the two trees
  hold the same names, shapes and dtypes - a parameter SGLang has and the engine layout lacks
  (or the reverse) is an :class:`SGLangPlacementError`.
* tied embeddings: at pipeline size 1 SGLang aliases ``lm_head`` to ``embed_tokens``; the
  harness engine holds ``lm_head`` as a buffer of its own, so a real ``ParallelLMHead`` is
  built in its place, as SGLang does on the last pipeline stage, and the real
  ``load_weights`` fills it from ``model.embed_tokens.weight`` (its ``tie_word_embeddings``
  branch).
* the draft: its ``embed_tokens`` and ``lm_head`` are bound to the served model's tensors, as
  the speculative worker's ``set_embed_and_head`` makes them.
* ``load_format="direct"``: SGLang's ``_model_load_weights_direct`` per model; the harness's
  ``draft.`` prefix picks the draft model (SGLang updates each runner with ``selector``).

Not modelled here (the expert rows cover them): padded expert buffers (the real classes size
``FusedMoE`` from ``moe_intermediate_size``) and MoE-DP. SGLang is imported inside the
functions.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from typing import Optional

from pytest_weightsync.reference_impl.model.model_layout import DRAFT_PREFIX


class SGLangPlacementError(RuntimeError):
    """SGLang's parameter tree differs from the engine layout, or placed a rank otherwise."""


class _GroupPlacement:
    """The rank and size of one SGLang process group, as its layers read them at
    construction (``get_group_rank_size``: ``rank_in_group``, ``world_size``)."""

    def __init__(self, rank: int, size: int):
        self.rank_in_group, self.world_size = rank, size
        self.ranks = list(range(size))
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.cpu_group = self.device_group = None

    def __repr__(self) -> str:
        return f"_GroupPlacement(rank={self.rank_in_group}, size={self.world_size})"


def _group_placements(parallel) -> dict:
    sized = {"tp": "tp", "attn_tp": "attn_tp", "attn_cp": "attn_cp", "moe_ep": "moe_ep",
             "moe_tp": "moe_tp", "moe_dp": "moe_dp"}
    groups = {f"{name}_group": _GroupPlacement(getattr(parallel, f"{key}_rank"),
                                               getattr(parallel, f"{key}_size"))
              for name, key in sized.items()}
    groups["world_group"] = _GroupPlacement(parallel.tp_rank, parallel.tp_size)
    groups["pp_group"] = _GroupPlacement(0, 1)
    return groups


@contextlib.contextmanager
def _rotary_kernel_stand_in():
    """``vllm._custom_ops`` with a ``rotary_embedding`` that raises, only while building."""
    if "vllm" in sys.modules or "vllm._custom_ops" in sys.modules:
        yield
        return
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    ops = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("no rotary kernel: this model was built to load weights, not to run")

    ops.rotary_embedding = rotary_embedding
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops
    try:
        yield
    finally:
        sys.modules.pop("vllm", None)
        sys.modules.pop("vllm._custom_ops", None)


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def hf_config(spec):
    """The Hugging Face config object SGLang's model class of ``spec`` is built from."""
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden,
                  moe_intermediate_size=spec.intermediate, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  head_dim=spec.head_dim, num_experts=spec.num_experts,
                  num_experts_per_tok=min(2, spec.num_experts), tie_word_embeddings=spec.tied)
    import importlib

    record = spec.family_record
    module, name = record.sglang_config
    config_cls = getattr(importlib.import_module(module), name)
    if not record.sglang_text_config:
        return config_cls(intermediate_size=spec.intermediate, decoder_sparse_step=1,
                          mlp_only_layers=[], **common)
    text = dict(common, shared_expert_intermediate_size=spec.intermediate_shared,
                full_attention_interval=spec.full_attention_interval,
                linear_num_key_heads=spec.linear_k_heads,
                linear_num_value_heads=spec.linear_v_heads,
                linear_key_head_dim=spec.linear_k_dim, linear_value_head_dim=spec.linear_v_dim,
                linear_conv_kernel_dim=spec.conv_kernel, mtp_num_hidden_layers=spec.mtp_layers)
    import warnings

    with warnings.catch_warnings():  # SGLang's text config passes the deprecated rope_scaling
        warnings.filterwarnings("ignore", message=".*rope_scaling.*", category=FutureWarning)
        config = config_cls(text_config=text, tie_word_embeddings=spec.tied)
    config.language_model_only = True
    config.encoder_only = False
    return config


@dataclass
class SGLangEngineRank:
    """One engine rank's real SGLang models (served, draft) and the context they run in."""

    target: object
    draft: Optional[object]
    context: object
    groups: dict
    runner: str

    @contextlib.contextmanager
    def active(self):
        from pytest_weightsync.reference_impl.backends.sglang import _activated

        with _activated(self.context, self.runner), self.context.parallel.override(**self.groups):
            yield

    def models(self) -> dict:
        return {"target": self.target, **({"draft": self.draft} if self.draft is not None else {})}

    def own_parameters(self) -> dict:
        """``{engine name: Parameter}`` of every distinct parameter of both models; the draft's
        shared ``embed_tokens`` / ``lm_head`` are left out (they are the served model's)."""
        out = {name: p for name, p in self.target.named_parameters()}
        if self.draft is not None:
            shared = ("model.embed_tokens.weight", "lm_head.weight")
            out.update({DRAFT_PREFIX + name: p for name, p in self.draft.named_parameters()
                        if name not in shared})
        return out

    def bind(self, params: dict) -> None:
        """Point every SGLang parameter at the harness tensor of its engine name."""
        import torch

        own = self.own_parameters()
        missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
        if missing or extra:
            raise SGLangPlacementError(f"SGLang's parameter tree and the engine layout differ: "
                                       f"SGLang has {missing[:6]} the layout lacks, the layout "
                                       f"has {extra[:6]} SGLang lacks")
        for name, param in own.items():
            tensor = params[name]
            data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            if tuple(param.shape) != tuple(data.shape) or param.dtype != data.dtype:
                raise SGLangPlacementError(f"{name}: SGLang holds {tuple(param.shape)} "
                                           f"{param.dtype}, the engine layout {tuple(data.shape)} "
                                           f"{data.dtype}")
            param.data = data
        if self.draft is not None:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                param = dict(self.draft.named_parameters(remove_duplicate=False)).get(name)
                if param is not None:
                    param.data = params[name].data if isinstance(params[name], torch.nn.Parameter) \
                        else params[name]

    def load(self, payload: list, load_format: Optional[str], targets) -> None:
        """One bucket through SGLang's update path: every selected model's ``load_weights``
        (``load_format=None``) or ``_model_load_weights_direct`` (``"direct"``)."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            _model_load_weights_direct,
        )

        with self.active():
            for target, model in self.models().items():
                if target not in targets:
                    continue
                if load_format == "direct":
                    prefix = DRAFT_PREFIX if target == "draft" else ""
                    pairs = [(n[len(prefix):], t) for n, t in payload
                             if n.startswith(DRAFT_PREFIX) == (target == "draft")]
                    _model_load_weights_direct(model, pairs)
                else:
                    type(model).load_weights(model, payload)


def build_engine_rank(spec, topology, rank: int) -> SGLangEngineRank:
    """The real SGLang models of engine ``rank`` of ``topology`` for ``spec``."""
    import importlib

    import torch

    from pytest_weightsync.reference_impl.backends.sglang import (
        RUNNER_FOR_ORDER,
        engine_context,
        preload_runner_modules,
    )

    runner = RUNNER_FOR_ORDER[topology.order]
    preload_runner_modules((runner,))
    context = engine_context(topology, rank)
    groups = _group_placements(context.parallel)
    config = hf_config(spec)
    record = spec.family_record
    model_cls = getattr(importlib.import_module(f"sglang.srt.models.{record.sglang_module}"),
                        record.sglang_class)
    engine = SGLangEngineRank(None, None, context, groups, runner)
    with _rotary_kernel_stand_in(), _default_dtype(spec.dtype), engine.active():
        engine.target = model_cls(config)
        if spec.tied and record.sglang_tied_head_buffer:
            from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

            engine.target.lm_head = ParallelLMHead(spec.vocab, spec.hidden, prefix="lm_head")
        if spec.mtp_layers:
            module, cls = record.sglang_draft
            engine.draft = getattr(importlib.import_module(f"sglang.srt.models.{module}"),
                                   cls)(config)
    for model in engine.models().values():
        for param in model.parameters():
            with torch.no_grad():
                param.fill_(float("nan"))
    return engine
