"""The Transformer Engine layer spec on CPU: megatron-core's own TE spec over a modelled TE.

Real Megatron RL jobs build ``GPTModel`` from ``get_gpt_layer_with_transformer_engine_spec``
(``megatron/core/models/gpt/gpt_layer_specs.py``), whose backend ``TESpecProvider``
(``megatron/core/extensions/transformer_engine_spec_provider.py``) fuses each input norm into
the following linear: attention's ``linear_qkv`` is a ``TELayerNormColumnParallelLinear``
(``self_attention.linear_qkv.layer_norm_weight`` beside ``.weight``; a dense MLP's
``mlp.linear_fc1.layer_norm_weight`` likewise), so the layer has no ``input_layernorm``
parameter. Transformer Engine needs CUDA and is absent here, so - as in
:mod:`~pytest_weightsync.reference_impl.trainer.te_grouped` - exactly the TE base classes are
modelled and everything above them is megatron-core's installed code, compiled from its source:

* :func:`te_base_classes` models ``transformer_engine.pytorch``'s ``Linear``,
  ``LayerNormLinear``, ``RMSNorm`` and ``LayerNorm``: the parameters they allocate
  (``weight`` ``[out/tp, in]`` in column mode, ``[out, in/tp]`` in row mode; ``layer_norm_weight``
  (and ``layer_norm_bias`` for LayerNorm) of the input size; a norm's ``weight``) and the
  attributes their ``reset_parameters`` set (:func:`te_linear_attributes`, cited at
  :data:`TE_LINEAR_SOURCE`);
* :func:`megatron_te_linears` compiles megatron-core's ``TENorm``, ``TELinear``,
  ``TELayerNormColumnParallelLinear``, ``TEColumnParallelLinear`` and ``TERowParallelLinear``
  over them (megatron's ``__init__`` decides what TE is handed, sets ``allreduce``, the
  partition stride, and initialises on CPU with ``use_cpu_initialization``);
* :func:`te_spec_provider` compiles megatron-core's ``TESpecProvider`` over those classes and
  :func:`te_layer_spec` runs the real ``get_gpt_layer_with_transformer_engine_spec`` with it.

One stand-in: ``TEDotProductAttention`` (parameter-free; its constructor probes CUDA
kernels) is megatron-core's local ``DotProductAttention``. No forward runs; names, shapes,
attributes and module classes are what exporters read. Megatron-Core is imported inside the
functions.
"""

from __future__ import annotations

import contextlib
import functools

#: Where the modelled TE behaviour is read from (NVIDIA/TransformerEngine, ``transformer_engine/
#: pytorch/module/linear.py`` ``Linear.reset_parameters``, ``module/layernorm_linear.py``
#: ``LayerNormLinear.reset_parameters``, ``module/rmsnorm.py``): every weight gets
#: ``set_tensor_model_parallel_attributes(weight, True, 1 if parallel_mode == "row" else 0, 1)``;
#: ``layer_norm_weight`` (and a LayerNorm's bias) only ``sequence_parallel``.
TE_LINEAR_SOURCE = ("NVIDIA/TransformerEngine transformer_engine/pytorch/module/"
                    "{linear,layernorm_linear}.py reset_parameters")
#: megatron-core's TE linears compiled from ``extensions/transformer_engine.py``, in order.
MEGATRON_TE_LINEARS = ("TENorm", "TELinear", "TELayerNormColumnParallelLinear",
                       "TEColumnParallelLinear", "TERowParallelLinear")
MEGATRON_TE_LINEAR_HELPERS = ("_get_extra_te_kwargs", "condition_init_method")


def te_linear_attributes(parallel_mode) -> dict:
    """The partition attributes TE's ``Linear`` / ``LayerNormLinear.reset_parameters`` give
    every weight (see :data:`TE_LINEAR_SOURCE`)."""
    return {"tensor_model_parallel": True,
            "partition_dim": 1 if parallel_mode == "row" else 0,
            "partition_stride": 1}


@functools.lru_cache(maxsize=1)
def te_base_classes() -> dict:
    """``{name: class}`` of the modelled ``transformer_engine.pytorch`` bases (parameters and
    their attributes only; see the module docstring)."""
    import torch

    def where(device):
        return "cpu" if device in ("cpu", None) else device

    class _Linear(torch.nn.Module):
        def _linear(self, in_features, out_features, tp_group, tp_size, parallel_mode, bias,
                    params_dtype, device, sequence_parallel, init_method):
            import torch.distributed as dist

            self.tp_size = tp_size if tp_group is None else dist.get_world_size(tp_group)
            self.parallel_mode = parallel_mode
            self.use_bias = bias
            self.sequence_parallel = self.tp_size > 1 and sequence_parallel
            if parallel_mode == "column":
                out_features //= self.tp_size
            elif parallel_mode == "row":
                in_features //= self.tp_size
            self.in_features, self.out_features = in_features, out_features
            dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
            self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                                         device=where(device)))
            if init_method is not None:
                with torch.no_grad():
                    init_method(self.weight)
            self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype,
                                                        device=where(device)))
                         if bias else None)

        def _mark_linear(self):
            for name, value in te_linear_attributes(self.parallel_mode).items():
                setattr(self.weight, name, value)
            if self.bias is not None:
                if self.parallel_mode == "row":
                    self.bias.sequence_parallel = self.sequence_parallel
                elif self.parallel_mode == "column":
                    for name, value in te_linear_attributes("column").items():
                        setattr(self.bias, name, value)

    class Linear(_Linear):
        """Modelled ``transformer_engine.pytorch.Linear``."""

        def __init__(self, in_features, out_features, sequence_parallel=False, tp_group=None,
                     tp_size=1, init_method=None, bias=True, params_dtype=None,
                     parallel_mode=None, device="cuda", **_):
            super().__init__()
            self._linear(in_features, out_features, tp_group, tp_size, parallel_mode, bias,
                         params_dtype, device, sequence_parallel, init_method)
            self.reset_parameters()

        def reset_parameters(self, defer_init=False):
            if not defer_init:
                self._mark_linear()

    class LayerNormLinear(_Linear):
        """Modelled ``transformer_engine.pytorch.LayerNormLinear``: the input norm's
        ``layer_norm_weight`` (``layer_norm_bias`` for LayerNorm) beside the linear."""

        def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False,
                     tp_group=None, tp_size=1, init_method=None, bias=True, params_dtype=None,
                     parallel_mode=None, device="cuda", normalization="LayerNorm",
                     zero_centered_gamma=False, **_):
            super().__init__()
            self.eps, self.normalization = eps, normalization
            self._linear(in_features, out_features, tp_group, tp_size, parallel_mode, bias,
                         params_dtype, device, sequence_parallel, init_method)
            dtype = self.weight.dtype
            fill = torch.zeros if zero_centered_gamma else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(fill(in_features, dtype=dtype,
                                                             device=where(device)))
            self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(in_features, dtype=dtype,
                                                                   device=where(device)))
                                    if normalization != "RMSNorm" else None)
            self.reset_parameters()

        def reset_parameters(self, defer_init=False):
            if defer_init:
                return
            self.layer_norm_weight.sequence_parallel = self.sequence_parallel
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.sequence_parallel = self.sequence_parallel
            self._mark_linear()

    def norm(with_bias):
        class Norm(torch.nn.Module):
            def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False,
                         zero_centered_gamma=False, params_dtype=None, device="cuda", **_):
                super().__init__()
                dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
                fill = torch.zeros if zero_centered_gamma else torch.ones
                self.weight = torch.nn.Parameter(fill(hidden_size, dtype=dtype,
                                                      device=where(device)))
                self.weight.sequence_parallel = sequence_parallel
                if with_bias:
                    self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype,
                                                               device=where(device)))
                    self.bias.sequence_parallel = sequence_parallel

        Norm.__name__ = Norm.__qualname__ = "LayerNorm" if with_bias else "RMSNorm"
        return Norm

    return {"Linear": Linear, "LayerNormLinear": LayerNormLinear, "RMSNorm": norm(False),
            "LayerNorm": norm(True)}


@functools.lru_cache(maxsize=1)
def megatron_te_linears() -> dict:
    """``{class name: class}`` of megatron-core's TE linears (:data:`MEGATRON_TE_LINEARS`),
    compiled from the installed ``extensions/transformer_engine.py`` over
    :func:`te_base_classes`."""
    from megatron.core.extensions import transformer_engine as te_ext

    from pytest_weightsync.reference_impl.trainer.te_grouped import (
        compile_megatron_source,
        modelled_te,
    )

    compiled = compile_megatron_source(te_ext, MEGATRON_TE_LINEAR_HELPERS + MEGATRON_TE_LINEARS,
                                       {"te": modelled_te(**te_base_classes()), "HAVE_TE": True})
    return {name: compiled[name] for name in MEGATRON_TE_LINEARS}


@functools.lru_cache(maxsize=1)
def te_spec_provider():
    """megatron-core's ``TESpecProvider``, compiled from its installed source over
    :func:`megatron_te_linears` and the TE grouped linears of ``te_grouped``
    (``TEDotProductAttention``: megatron-core's ``DotProductAttention``, parameter-free)."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from pytest_weightsync.reference_impl.trainer.te_grouped import (
        compile_megatron_source,
        megatron_te_grouped_linears,
    )

    names = dict(megatron_te_linears())
    names.update(megatron_te_grouped_linears())
    names.update(TEDotProductAttention=DotProductAttention, TEActivationOp=None)
    return compile_megatron_source(provider, ("TESpecProvider",), names)["TESpecProvider"]


@contextlib.contextmanager
def _provider_in_gpt_layer_specs():
    """``gpt_layer_specs.TESpecProvider`` answered by :func:`te_spec_provider` (the module only
    binds it where Transformer Engine imports)."""
    from megatron.core.models.gpt import gpt_layer_specs

    missing = object()
    before = getattr(gpt_layer_specs, "TESpecProvider", missing)
    gpt_layer_specs.TESpecProvider = te_spec_provider()
    try:
        yield gpt_layer_specs
    finally:
        if before is missing:
            del gpt_layer_specs.TESpecProvider
        else:
            gpt_layer_specs.TESpecProvider = before


def te_layer_spec(num_experts: int, grouped: bool, **options):
    """megatron-core's ``get_gpt_layer_with_transformer_engine_spec(num_experts,
    moe_grouped_gemm=grouped, **options)``, run with :func:`te_spec_provider`."""
    with _provider_in_gpt_layer_specs() as gpt_layer_specs:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped, **options)


def te_mtp_block_spec(config, layer):
    """megatron-core's ``get_gpt_mtp_block_spec(config, layer, use_transformer_engine=True)``
    over :func:`te_spec_provider`."""
    with _provider_in_gpt_layer_specs() as gpt_layer_specs:
        return gpt_layer_specs.get_gpt_mtp_block_spec(config, layer, use_transformer_engine=True)
