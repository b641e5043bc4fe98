"""TEGroupedMLP on CPU: megatron-core's own TEGroupedMLP code over a modelled Transformer Engine.

Real trainers that use grouped GEMMs hold their experts in megatron-core's ``TEGroupedMLP``,
whose ``linear_fc1`` / ``linear_fc2`` are ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` (``megatron/core/extensions/transformer_engine.py``), thin
subclasses of Transformer Engine's ``GroupedLinear``. Transformer Engine needs CUDA and is not
installed on CPU, so exactly one piece is modelled here - the TE base class - and everything
above it is megatron-core's installed code:

* :class:`GroupedLinear` models TE's ``transformer_engine.pytorch.GroupedLinear``: one
  ``weight{i}`` parameter ``[out, in]`` per local GEMM (column mode divides ``out``, row mode
  ``in`` by the TP size it is given), initialized by ``init_method``, then marked by
  ``reset_parameters`` with the partition attributes of :func:`te_weight_attributes` - the one
  home of what TE sets (cited there);
* :func:`megatron_te_grouped_linears` compiles megatron-core's ``TEGroupedLinear``,
  ``TEColumnParallelGroupedLinear`` and ``TERowParallelGroupedLinear`` from the installed
  source over that base, so megatron's own ``__init__`` decides what TE is handed: under
  explicit expert comms (expert TP > 1 or EP > 1) it divides the sizes itself and passes
  ``parallel_mode=None`` - which is why real fc1 AND fc2 weights carry ``partition_dim=0``
  (the quirk slime corrects for) - and it sets ``allreduce = not (is_expert and EP > 1)``;
* :func:`te_grouped_mlp_spec` is the ``MoELayer`` spec megatron-core's own
  ``get_moe_module_spec_for_backend`` builds for a backend whose grouped MLP is TEGroupedMLP
  over those classes, so ``GPTModel`` builds real ``TEGroupedMLP`` modules around them.

The forward pass of a TE module needs CUDA and is never run here; the parameters, their names
(``experts.linear_fc1.weight{i}``), shapes, attributes and module classes are what exporters
read. Megatron-Core is imported inside the functions.
"""

from __future__ import annotations

import functools

from pytest_weightsync.reference_impl.errors import WeightSyncError

#: Where the modelled Transformer Engine behaviour is read from (NVIDIA/TransformerEngine,
#: ``transformer_engine/pytorch/module/grouped_linear.py``, ``GroupedLinear.reset_parameters``;
#: identical at commits 3ea1356190e88a50d8c2cae17e80c4e6ae96d442 and
#: 0069563f606859d4fb5d663e1c92509a30e99f35), and the helper it calls
#: (``transformer_engine/pytorch/distributed.py``, ``set_tensor_model_parallel_attributes``,
#: which sets exactly ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``).
TE_SOURCE = ("NVIDIA/TransformerEngine transformer_engine/pytorch/module/grouped_linear.py "
             "GroupedLinear.reset_parameters @ 3ea1356190e88a50d8c2cae17e80c4e6ae96d442")
#: The Transformer Engine version the modelled base stands for, answered to megatron-core's
#: ``is_te_min_version`` probes while its classes are compiled and built (grouped linears
#: exist from TE 1.9; nothing version-dependent below is used on CPU).
MODELLED_TE_VERSION = "2.9.0"
#: ``parallel_mode`` values TE's ``GroupedLinear`` accepts (``GemmParallelModes``).
TE_PARALLEL_MODES = (None, "column", "row")


def te_weight_attributes(parallel_mode) -> dict:
    """The partition attributes Transformer Engine's ``GroupedLinear.reset_parameters`` gives
    EVERY ``weight{i}`` (see :data:`TE_SOURCE`): it calls
    ``set_tensor_model_parallel_attributes(weight{i}, is_parallel=True, dim=1 if parallel_mode
    == "row" else 0, stride=1)`` unconditionally - also when Megatron passed
    ``parallel_mode=None``, so a row-parallel fc2 built under explicit expert comms is marked
    ``partition_dim=0`` although its shards split dim 1."""
    if parallel_mode not in TE_PARALLEL_MODES:
        raise WeightSyncError(f"parallel_mode {parallel_mode!r} not supported (TE accepts "
                              f"{TE_PARALLEL_MODES})")
    return {"tensor_model_parallel": True,
            "partition_dim": 1 if parallel_mode == "row" else 0,
            "partition_stride": 1}


@functools.lru_cache(maxsize=1)
def _grouped_linear_base():
    """The modelled ``GroupedLinear``, one class per process (every compiled source that
    names ``te.pytorch.GroupedLinear`` gets this one)."""
    import torch

    class GroupedLinear(torch.nn.Module):
        """Modelled ``transformer_engine.pytorch.GroupedLinear`` (parameters and their
        attributes only; see the module docstring)."""

        def __init__(self, num_gemms, in_features, out_features, sequence_parallel=False,
                     fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                     get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                     bias=True, return_bias=False, params_dtype=None, parallel_mode=None,
                     device="cuda", ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None,
                     **_):
            super().__init__()
            if parallel_mode not in TE_PARALLEL_MODES:
                raise ValueError(f"parallel_mode {parallel_mode} not supported")
            self.num_gemms = num_gemms
            self.parallel_mode = parallel_mode
            self.tp_size = tp_size
            self.use_bias = bias
            self.sequence_parallel = tp_size > 1 and sequence_parallel
            if parallel_mode == "column":
                out_features //= tp_size
            elif parallel_mode == "row":
                in_features //= tp_size
            self.in_features, self.out_features = in_features, out_features
            dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
            where = "cpu" if device in ("cpu", None) else device
            for i in range(num_gemms):
                weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                                        device=where))
                self.register_parameter(f"weight{i}", weight)
                if init_method is not None:
                    with torch.no_grad():
                        init_method(weight)
                if bias:
                    self.register_parameter(f"bias{i}", torch.nn.Parameter(
                        torch.zeros(out_features, dtype=dtype, device=where)))
            self.reset_parameters()

        def reset_parameters(self, defer_init=False):
            if defer_init:
                return
            for i in range(self.num_gemms):
                weight = getattr(self, f"weight{i}")
                for name, value in te_weight_attributes(self.parallel_mode).items():
                    setattr(weight, name, value)

    return GroupedLinear


#: The megatron-core classes compiled from the installed source, in definition order.
MEGATRON_TE_CLASSES = ("TEGroupedLinear", "TEColumnParallelGroupedLinear",
                       "TERowParallelGroupedLinear")
#: Module-level helpers of the same file they call, compiled alongside so that their TE
#: version probes see :data:`MODELLED_TE_VERSION`.
MEGATRON_TE_HELPERS = ("_get_extra_te_kwargs",)


class MegatronSourceError(WeightSyncError):
    """The installed megatron-core no longer defines what this module compiles from it."""


def compile_megatron_source(module, names, namespace_updates: dict) -> dict:
    """``{name: object}`` of the classes and functions ``names`` of the installed megatron-core
    ``module``, compiled from its source text in a copy of its namespace updated with
    ``namespace_updates`` (the modelled Transformer Engine, version probes answering
    :data:`MODELLED_TE_VERSION`), in the order given. Tracebacks point at the installed file's
    own line numbers."""
    import ast
    import inspect
    import textwrap

    from packaging.version import Version

    source = inspect.getsource(module)
    found = {node.name: node for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names}
    missing = [name for name in names if name not in found]
    if missing:
        raise MegatronSourceError(f"megatron-core's {module.__file__} no longer defines "
                                  f"{missing}; reference_impl/trainer/ compiles them from it")
    namespace = dict(vars(module))
    namespace["is_te_min_version"] = (
        lambda version, check_equality=True: Version(MODELLED_TE_VERSION) >= Version(version))
    namespace["get_te_version"] = lambda: Version(MODELLED_TE_VERSION)
    namespace.update(namespace_updates)
    for name in names:
        node = found[name]
        code = "\n" * (node.lineno - 1) + textwrap.dedent(ast.get_source_segment(source, node))
        exec(compile(code, module.__file__, "exec"), namespace)  # noqa: S102 - installed source
        namespace[name].__module__ = module.__name__
    return {name: namespace[name] for name in names}


@functools.lru_cache(maxsize=1)
def megatron_te_grouped_linears() -> dict:
    """``{class name: class}`` of megatron-core's TE grouped linears, compiled from the installed
    ``megatron/core/extensions/transformer_engine.py`` over :class:`GroupedLinear` (TE's own
    class is absent on CPU; megatron-core only defines these where TE imports)."""
    from megatron.core.extensions import transformer_engine as te_ext

    compiled = compile_megatron_source(te_ext, MEGATRON_TE_HELPERS + MEGATRON_TE_CLASSES,
                                       {"te": modelled_te()})
    return {name: compiled[name] for name in MEGATRON_TE_CLASSES}


def modelled_te(**classes):
    """The ``te`` module megatron-core's TE extension source is compiled against on CPU: a
    namespace whose ``te.pytorch`` holds :class:`GroupedLinear`'s modelled base and
    ``classes`` (the TE base linears, for the sources that subclass them)."""
    import types

    return types.SimpleNamespace(pytorch=types.SimpleNamespace(
        GroupedLinear=_grouped_linear_base(), **classes))


def te_grouped_mlp_spec(num_experts: int):
    """The ``MoELayer`` spec of megatron-core's ``get_moe_module_spec_for_backend`` for a
    backend whose grouped MLP is ``TEGroupedMLP`` over :func:`megatron_te_grouped_linears`
    (as ``TESpecProvider.grouped_mlp_modules`` returns it where TE imports)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    classes = megatron_te_grouped_linears()

    class ModelledTESpecProvider(LocalSpecProvider):
        """Local linears everywhere but the experts: TEGroupedMLP, as with TE."""

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            return TEGroupedMLP, MLPSubmodules(
                linear_fc1=classes["TEColumnParallelGroupedLinear"],
                linear_fc2=classes["TERowParallelGroupedLinear"])

    return get_moe_module_spec_for_backend(backend=ModelledTESpecProvider(),
                                           num_experts=num_experts, moe_grouped_gemm=True)
