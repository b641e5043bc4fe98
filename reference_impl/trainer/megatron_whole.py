"""A real Megatron-Core ``GPTModel`` of a whole model in one trainer rank, filled from the oracle.

:mod:`~pytest_weightsync.reference_impl.trainer.megatron_state` builds the expert-only trainer; this
builds every parameter of a :class:`~pytest_weightsync.reference_impl.model.model_spec.ModelSpec`
the same way (``megatron.training.get_model``: a ``GPTModel`` per stage
from megatron-core's Transformer Engine layer spec over the modelled TE, or its local spec,
``Float16Module``, DDP with the distributed
optimizer's contiguous buffers) under the real ``parallel_state``:

* GQA attention (``num_query_groups`` KV heads, ``kv_channels`` = head dim) with q/k RMS norms
  (``qk_layernorm``) and, for Qwen3.5, the attention output gate (``attention_output_gate``:
  ``linear_qkv`` per group ``[q_g; gate_g; k_g; v_g]``);
* the MoE block: router (``moe_router_enable_expert_bias`` registers the float32
  ``expert_bias`` buffer, with the sigmoid score function Megatron requires for it), routed
  experts (SequentialMLP, or TEGroupedMLP over the modelled Transformer Engine linears), the
  shared expert and its gate (``moe_shared_expert_gate``);
* norms, the embedding and the output layer with Megatron's padded vocabulary
  (``make_vocab_size_divisible_by`` 128 x TP), tied (``share_embeddings_and_output_weights``:
  with PP > 1 the last stage holds a copy) or untied, rotary positions (no parameters);
* pipeline stages of equal size or uneven (``num_layers_in_first_pipeline_stage``); each
  ``TransformerLayer.layer_number`` is global;
* the settings that decide which parameters exist are Megatron-Bridge's for the family
  (its record's ``megatron_config`` and ``megatron_model``,
  :mod:`~pytest_weightsync.reference_impl.model.families`): RMSNorm without bias, no linear or qkv biases, q/k norms, rotary
  positions - held to the installed Bridge's registries, every rank, by
  ``suites/selftest/test_trainer_model_names.py``.

Every parameter is then overwritten in place with the oracle's shard
(:func:`pytest_weightsync.reference_impl.trainer.megatron_model.trainer_model_state`): the real names
are mapped to the oracle's (:func:`modelled_name`: the local spec keeps the input norm apart
where the Transformer Engine spec Megatron-Bridge maps from fuses it into ``linear_qkv``) and
each shape and dtype must agree, or :class:`~pytest_weightsync.reference_impl.trainer.megatron_state.
MegatronPlacementError` names the parameter. Two deviations from megatron-core 0.16.1, both in
``docs/backends.md``: a float32 router keeps its weight in float32 (Megatron casts it to
``params_dtype`` and computes in float32 with ``moe_router_dtype="fp32"``; GLM-4.5 /
DeepSeek-V3 checkpoints and the trainers that refit them hold it in float32), and the expert
bias is returned to float32 after ``Float16Module`` as the router's own
``_maintain_float32_expert_bias`` does before every use. The constructor runs with two CPU
stand-ins (:func:`_on_cpu`). MODELLED: the Gated DeltaNet mixer of Qwen3.5's GDN layers
(megatron-core's ``GatedDeltaNet`` needs the ``fla`` kernels): :func:`modelled_gated_delta_net`,
in a real ``TransformerLayer`` beside a real MoE block. The MTP draft is megatron-core's own
``MultiTokenPredictionBlock`` on the last stage (:func:`mtp_block_spec`), with the embedding
copy ``GPTModel`` builds for it there when PP > 1.
"""

from __future__ import annotations

import contextlib

from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.trainer.megatron_state import (
    MegatronPlacementError,
    _ddp_buffers_on_cpu,
    fill_in_place,
    layer_spec as layer_spec_of,
    name_prefix,
    unwrapped,
    wrapped,
)

#: The builtin families' rotary bases, a view of their records' ``megatron_model`` (the model
#: reads the spec's record): Megatron-Bridge 0.3.1's ``Qwen3NextModelProvider`` (the
#: Qwen3.5-MoE layout) inherits ``Qwen3MoEModelProvider``'s settings and changes the rotary
#: base; its gated attention and shared-expert gate follow the spec (``attn_output_gate``,
#: ``intermediate_shared``). ``layernorm_zero_centered_gamma`` is left off: it changes what
#: the norm weights mean (Bridge maps GDN ``out_norm`` as ``hf - 1``), not which parameters
#: exist, and the oracle fills every norm with the checkpoint's own values.
ROTARY_BASE = {name: families.get(name).megatron_model["rotary_base"]
               for name in families.names()}

#: The oracle names its input norm as the Transformer Engine spec fuses it.
_LOCAL_TO_MODELLED = ((".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),)


def modelled_name(local_name: str) -> str:
    """The oracle's (``megatron_model``) name of a real local-spec parameter name (wrapper
    prefix removed)."""
    for real, modelled in _LOCAL_TO_MODELLED:
        if local_name.endswith(real):
            return local_name[:-len(real)] + modelled
    return local_name


def _sharded(tensor, dim: int):
    """``tensor`` as a TP-sharded Megatron parameter along ``dim`` (the attributes
    ``ColumnParallelLinear`` / ``RowParallelLinear`` set)."""
    import torch

    param = torch.nn.Parameter(tensor)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    return param


def modelled_gated_delta_net(spec, tp: int):
    """A ``ModuleSpec`` of the MODELLED Gated DeltaNet mixer: megatron-core's
    ``GatedDeltaNet`` imports the ``fla`` kernels, absent here. It holds what the Transformer
    Engine spec of Megatron-Bridge's Qwen3-Next / Qwen3.5 maps (``in_proj`` with its fused
    input norm ``layer_norm_weight``, ``conv1d``, ``A_log`` (float32), ``dt_bias``,
    ``out_norm``, ``out_proj``) with this rank's TP shapes - computed here from the spec,
    not read from the oracle - and the partition attributes Megatron's parallel linears set
    (column: dim 0, ``out_proj`` row: dim 1; norms replicated)."""
    import torch
    from megatron.core.transformer.spec_utils import ModuleSpec

    qk, v, heads, hidden = spec.gdn_qk, spec.gdn_v, spec.linear_v_heads, spec.hidden
    bf = spec.dtype

    class ModelledGatedDeltaNet(torch.nn.Module):
        def __init__(self, config, layer_number=None, **_):
            super().__init__()
            self.layer_number = layer_number
            self.in_proj = torch.nn.Module()
            self.in_proj.weight = _sharded(
                torch.empty((2 * qk + 2 * v + 2 * heads) // tp, hidden, dtype=bf), 0)
            self.in_proj.layer_norm_weight = torch.nn.Parameter(torch.empty(hidden, dtype=bf))
            self.conv1d = torch.nn.Module()
            self.conv1d.weight = _sharded(
                torch.empty((2 * qk + v) // tp, 1, spec.conv_kernel, dtype=bf), 0)
            self.A_log = _sharded(torch.empty(heads // tp, dtype=torch.float32), 0)
            self.dt_bias = _sharded(torch.empty(heads // tp, dtype=bf), 0)
            self.out_norm = torch.nn.Module()
            self.out_norm.weight = torch.nn.Parameter(torch.empty(spec.linear_v_dim, dtype=bf))
            self.out_proj = torch.nn.Module()
            self.out_proj.weight = _sharded(torch.empty(hidden, v // tp, dtype=bf), 1)

    return ModuleSpec(module=ModelledGatedDeltaNet)


def megatron_gated_delta_net(config):
    """megatron-core's own Gated DeltaNet mixer (``megatron/core/ssm/gated_delta_net.py``)
    with the Transformer Engine spec's linears (``get_gated_delta_net_module_spec``): the
    names and shapes are its source's. Its constructor refuses to run without the ``fla``
    kernels, which only its forward uses: :func:`_constructed_without_fla` builds it with that
    check answered (no forward runs here)."""
    import dataclasses

    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )

    from pytest_weightsync.reference_impl.trainer.te_spec import te_spec_provider

    real = get_gated_delta_net_module_spec(config, backend=te_spec_provider()())
    return dataclasses.replace(real, module=_constructed_without_fla(real.module))


def _constructed_without_fla(cls):
    """``cls`` (megatron-core's ``GatedDeltaNet``) built with its module's ``HAVE_FLA``
    answering True for the constructor's duration."""
    import sys

    module = sys.modules[cls.__module__]

    class GatedDeltaNet(cls):
        def __init__(self, *args, **kwargs):
            before = module.HAVE_FLA
            module.HAVE_FLA = True
            try:
                super().__init__(*args, **kwargs)
            finally:
                module.HAVE_FLA = before

    GatedDeltaNet.__qualname__ = cls.__qualname__
    GatedDeltaNet.__module__ = cls.__module__
    return GatedDeltaNet


def _attention_layer_spec(spec, topo, layer_spec: str):
    """The attention ``TransformerLayer`` spec of ``layer_spec`` (``"te"``: megatron-core's
    Transformer Engine spec over the modelled TE, what real jobs build; ``"local"``: its local
    spec) and the final norm's module."""
    if layer_spec == "te":
        from pytest_weightsync.reference_impl.trainer.te_spec import megatron_te_linears, te_layer_spec

        return (te_layer_spec(spec.num_experts, grouped=topo.expert_impl == "te_grouped",
                              qk_layernorm=True), megatron_te_linears()["TENorm"])
    if layer_spec != "local":
        raise MegatronPlacementError(f"layer spec {layer_spec!r}: expected 'te' or 'local'")
    from megatron.core.transformer.transformer_block import LayerNormImpl

    return (layer_spec_of(spec.experts, topo, qk_layernorm=True, normalization="RMSNorm"),
            LayerNormImpl)


def block_spec(spec, topo, config, layer_spec: str = "te"):
    """This stage's ``TransformerBlockSubmodules``: megatron-core's layer spec (``layer_spec``)
    for each attention layer; for each GDN layer the same with its Gated DeltaNet mixer (its
    input norm fused into ``in_proj``): megatron-core's own on the Transformer Engine spec
    (:func:`megatron_gated_delta_net`), :func:`modelled_gated_delta_net` on the local one."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    attention, final_norm = _attention_layer_spec(spec, topo, layer_spec)
    mixer = (megatron_gated_delta_net(config) if layer_spec == "te" and spec.linear_k_heads
             else modelled_gated_delta_net(spec, topo.tp))
    gdn = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, input_layernorm=IdentityOp, self_attention=mixer))
    offset = get_transformer_layer_offset(config)
    layers = range(offset, offset + get_num_layers_to_build(config))
    return TransformerBlockSubmodules(
        layer_specs=[attention if spec.layer_kind(layer) == "attention" else gdn
                     for layer in layers], layer_norm=final_norm)


def mtp_block_spec(spec, topo, config, layer_spec: str = "te"):
    """The MTP block's spec on the stage that builds it (the last: megatron-core's
    ``get_gpt_mtp_block_spec`` over ``layer_spec`` - ``enorm``, ``hnorm``, ``eh_proj``, one
    attention ``TransformerLayer`` with its own MoE block, ``final_layernorm``), else
    ``None``."""
    if not spec.mtp_layers:
        return None
    attention, _ = _attention_layer_spec(spec, topo, layer_spec)
    if layer_spec == "te":
        from pytest_weightsync.reference_impl.trainer.te_spec import te_mtp_block_spec

        return te_mtp_block_spec(config, attention)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, attention, use_transformer_engine=False)


def transformer_config(spec, topo):
    """The real ``TransformerConfig`` of the whole model ``spec`` under ``topo``."""
    import torch

    from pytest_weightsync.reference_impl.backends.megatron import moe_transformer_config

    settings = dict(spec.family_record.megatron_config)  # RMSNorm, q/k norms, no qkv bias
    del settings["add_bias_linear"], settings["gated_linear_unit"]  # moe_transformer_config's own
    return moe_transformer_config(
        hidden=spec.hidden, ffn=spec.intermediate, experts=spec.num_experts,
        topk=min(2, spec.num_experts), tp=topo.tp, ep=topo.ep, etp=topo.etp, dtype=spec.dtype,
        grouped=topo.expert_impl == "te_grouped", cpu_init=True, heads=spec.num_heads,
        num_layers=spec.num_layers, num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim, **settings,
        attention_output_gate=spec.attn_output_gate,
        moe_router_pre_softmax=spec.num_experts == 1,
        moe_router_enable_expert_bias=spec.expert_bias,
        moe_router_score_function="sigmoid" if spec.expert_bias else "softmax",
        moe_router_dtype="fp32" if spec.router_dtype == torch.float32 else None,
        moe_shared_expert_intermediate_size=spec.intermediate_shared or None,
        moe_shared_expert_gate=bool(spec.intermediate_shared),
        pipeline_model_parallel_size=topo.pp,
        num_layers_in_first_pipeline_stage=topo.first_stage_layers,
        pipeline_dtype=spec.dtype, mtp_num_layers=spec.mtp_layers or None,
        # the Gated DeltaNet sizes megatron-core's GatedDeltaNet reads; its initialisation
        # draws from the CUDA RNG tracker, and every value is the oracle's anyway
        **({"linear_conv_kernel_dim": spec.conv_kernel, "linear_key_head_dim": spec.linear_k_dim,
            "linear_value_head_dim": spec.linear_v_dim,
            "linear_num_key_heads": spec.linear_k_heads,
            "linear_num_value_heads": spec.linear_v_heads, "perform_initialization": False}
           if spec.linear_k_heads else {}),
    )


def _keep_float32(spec):
    """What the trainer holds in float32 after ``Float16Module`` (see the module docstring)."""
    import torch

    def restore(chunk):
        for module in chunk.modules():
            kind = type(module).__name__
            if kind in ("ModelledGatedDeltaNet", "GatedDeltaNet"):
                module.A_log.data = module.A_log.data.to(torch.float32)
            if kind != "TopKRouter":
                continue
            if spec.router_dtype == torch.float32:
                module.weight.data = module.weight.data.to(torch.float32)
            module._maintain_float32_expert_bias()

    return restore


@contextlib.contextmanager
def _on_cpu():
    """For the ``GPTModel`` constructor: the router allocates its expert bias at
    ``torch.cuda.current_device()`` and a tied model's stages move the shared embedding
    ``.cuda()`` before all-reducing it over the embedding group; here both stay on CPU
    (the all-reduce itself runs, over gloo)."""
    import torch

    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        with _ddp_buffers_on_cpu():
            yield
    finally:
        torch.Tensor.cuda = original


def build_model(spec, topo, config, layer_spec: str = "te", ddp_options=None) -> list:
    """This rank's model chunks (one DDP-wrapped ``GPTModel`` of its stage, built from
    ``layer_spec``; ``ddp_options``: more of ``DistributedDataParallelConfig``). Needs
    :func:`~pytest_weightsync.reference_impl.trainer.megatron_state.megatron_parallel_state`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from pytest_weightsync.reference_impl.trainer.megatron_model import padded_vocab

    with _on_cpu():
        chunk = GPTModel(config=config,
                         transformer_layer_spec=block_spec(spec, topo, config, layer_spec),
                         vocab_size=padded_vocab(spec.vocab, topo.tp), max_sequence_length=8,
                         pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(),
                         **{**spec.family_record.megatron_model,
                            "share_embeddings_and_output_weights": spec.tied},
                         mtp_block_spec=mtp_block_spec(spec, topo, config, layer_spec))
    return [wrapped(chunk, config, before_ddp=_keep_float32(spec), ddp_options=ddp_options)]


def model_state(model) -> dict:
    """What a whole-model exporter reads: the chunk's ``named_parameters()`` and the routers'
    ``expert_bias`` buffers (in ``state_dict()``, not a parameter), real objects."""
    (chunk,) = model
    state = dict(chunk.named_parameters())
    state.update((name, buf) for name, buf in chunk.named_buffers()
                 if name.endswith(".router.expert_bias"))
    return state


def write_model(state: dict, modelled: dict, rank: int) -> None:
    """Copy the oracle's state ``modelled`` (``{oracle name: tensor}``, local numbering) into
    the real tensors of ``state`` in place; every real tensor must get exactly one value of
    its own shape and dtype."""
    prefix = name_prefix(state)
    targets, used = {}, set()
    for name, tensor in state.items():
        own = modelled_name(name[len(prefix):]) if name.startswith(prefix) else None
        value = modelled.get(own)
        if value is None:
            raise MegatronPlacementError(f"rank {rank}: the oracle holds no tensor for Megatron's "
                                         f"{name!r} (read as {own!r})")
        targets[name] = (own, value)
        used.add(own)
    unbuilt = sorted(set(modelled) - used)
    if unbuilt:
        raise MegatronPlacementError(f"rank {rank}: the Megatron model has no parameter for the "
                                     f"oracle's {unbuilt[:4]}")
    fill_in_place(state, targets, rank, "the oracle's")


def check_stage(spec, topo, rank: int, model) -> None:
    """The stage's layers are numbered (globally) where the reference layout puts them; the
    MTP block's transformer layers follow the decoder's last (``num_layers + 1``, ...)."""
    from pytest_weightsync.reference_impl.model.layout import trainer_shard

    chunk = unwrapped(model[0])
    layers = [layer.layer_number for layer in chunk.decoder.layers]
    want = [layer + 1 for layer in trainer_shard(spec.experts, topo, rank).layers]
    mtp = getattr(chunk, "mtp", None)
    if mtp is not None:
        layers += [layer.transformer_layer.layer_number for layer in mtp.layers]
        want += [spec.num_layers + 1 + layer for layer in range(spec.mtp_layers)]
    if layers != want:
        raise MegatronPlacementError(f"rank {rank}: Megatron built layer numbers {layers}, the "
                                     f"reference layout gives this stage {want} (1-based)")


def whole_model_state(spec, topo, rank: int, weights, config, layer_spec: str = "te",
                      ddp_options=None) -> tuple[list, dict]:
    """``(model chunks, model_state)`` of trainer rank ``rank``: the real model of
    ``layer_spec``, its stage checked, every tensor set to the oracle's shard of ``weights``
    (a ``ModelWeights``)."""
    from pytest_weightsync.reference_impl.trainer.megatron_model import trainer_model_state

    model = build_model(spec, topo, config, layer_spec, ddp_options)
    check_stage(spec, topo, rank, model)
    state = model_state(model)
    write_model(state, trainer_model_state(spec, topo, rank, weights), rank)
    return model, state
