"""Stock SGLang's model loaders as implementations under test (rows of the conformance matrix).

A conformance harness that fails correct real code is worse than none, so stock SGLang runs
through the same suites as every third-party loader: when SGLang imports, the registry adds
:class:`Qwen3MoeLoader` (``sglang-qwen3-moe``) and :class:`Qwen35MoeLoader`
(``sglang-qwen3.5-moe``) as built-in implementations.

What runs is SGLang's own code, unmodified:

* the model class's ``load_weights`` - ``Qwen3MoeForCausalLM.load_weights``
  (``sglang/srt/models/qwen3_moe.py``) or ``Qwen3_5MoeForCausalLM.load_weights``
  (``sglang/srt/models/qwen3_5.py``), called as ``cls.load_weights(model, payload)``: its name
  mapping (``FusedMoE.make_expert_params_mapping``, the ``is_fused_expert`` branch for
  ``experts.gate_up_proj`` / ``experts.down_proj``, its skips and warnings) all run;
* one real ``FusedMoE`` per layer (``sglang/srt/layers/moe/fused_moe_triton/layer.py``) and
  its ``weight_loader``: expert filtering by MoE-EP rank, MoE-TP row slicing, gate/up placement
  (``load_up_proj_weight_first`` of the runner's weight layout), padding;
* the parallel placement: each (topology, rank) gets SGLang's runtime context from
  ``runtime_context.create_context(ServerArgs(tp_size, ep_size, moe_dp_size, attn_cp_size),
  ranks=SpawnRanks(world_rank=rank))``, and the layer reads MoE-TP/EP/DP sizes and ranks from it
  (checked against :func:`pytest_weightsync.reference_impl.model.layout.receiver_shard`);
* ``load_format="direct"``: SGLang's ``_model_load_weights_direct`` from
  ``model_executor/model_runner_components/weight_updater.py`` (what
  ``update_weights_from_tensor(load_format="direct")`` calls: ``default_weight_loader`` per name).

What is stand-in (the smallest object the real method body needs):

* the model object is the real class created without its ``__init__`` (``cls.__new__`` plus
  ``torch.nn.Module.__init__``): no attention, embeddings or config parsing. It holds
  ``config.num_experts``, and ``model.layers[L].mlp.experts`` = the real ``FusedMoE`` of layer L,
  so ``named_parameters()`` yields ``model.layers.{L}.mlp.experts.w13_weight`` / ``w2_weight`` -
  the full checkpoint names, as the served model sees them. Every other tensor the harness
  passes in ``params`` (e.g. the router ``model.layers.0.mlp.gate.weight``) is attached at its
  name as a plain parameter, so a loader that writes it is caught. Qwen3.5's shared-expert
  fusion (an aiter/ROCm option) is off, as on every CUDA/CPU deployment.
* the layers' parameters ARE the harness tensors: before each call the ``.data`` of every
  ``FusedMoE`` parameter is pointed at the matching tensor of ``params`` (same storage, so the
  harness's address and raw-bit checks see SGLang's writes). The ``FusedMoE`` is built with the
  padded per-rank intermediate size (``buffer_rows * moe_tp``), as SGLang sizes a padded layer.
* the gate/up order is SGLang's MoE runner: ``triton`` stores ``[gate | up]``,
  ``flashinfer_cutlass`` ``[up | gate]`` (its weight layout sets ``load_up_proj_weight_first``).
  Building a layer needs no GPU for either; no kernel runs.
* padding: SGLang has two loaders for a buffer wider than the loaded rows. The default one
  (``pad_mode="even"``) takes rank r's even slice of the checkpoint and zeroes the buffer's
  tail. The padded one (``FusedMoE.use_padded_loading``, ``pad_mode="blocked"``) takes
  ``[r * P, (r + 1) * P)`` clipped to the checkpoint; SGLang selects it on its CPU engine
  (``SGLANG_USE_CPU_ENGINE=1``) and for the flashinfer_trtllm runners. That property is cached
  per layer; for blocked receivers it is set on the layer to ``True``, as those deployments
  compute it - the loading code that then runs is SGLang's.

Engines (``ReceiverTopology.engine_layout``, redundant experts, FP8 blocks): the runner that
keeps the layout (``flashinfer_trtllm``, ``triton_kernels``), ``FusedMoE`` with ``E + R``
physical slots and SGLang's ``ExpertLocationMetadata`` of the placement, or an ``Fp8Config``;
``begin_update`` / ``end_update`` run SGLang's own ``restore_weights_before_loading`` /
``postprocess_weights`` (what ``begin_weight_update`` / ``end_weight_update`` call), so the
TRT-LLM BF16 block layout really is applied after every update and undone before the next.

Claims (:data:`Capabilities`): formats ``compat`` and ``direct`` for both, ``hf_fused`` only for
Qwen3.5 (Qwen3-MoE's ``load_weights`` has no fused-experts branch: ``experts.gate_up_proj``
matches no mapping and is skipped silently). Never ``packed`` (no stock path). Every order and
both padding modes; topologies SGLang's launcher refuses are refused (see
:func:`sglang_refusal`). SGLang has no begin/end hooks for a stream: each bucket is one
``load_weights`` call, as in ``update_weights_from_tensor``.

Whole models (``spec`` a ``ModelSpec``, ``suites/conformance/test_model.py``): the row builds
the real model class itself with every real layer
(:mod:`~pytest_weightsync.reference_impl.backends.sglang_model_tree`) and runs its
``load_weights`` - and the draft's, ``Qwen3_5ForCausalLMMTP.load_weights``, when the update's
``targets`` reach it (SGLang's ``selector``). Each row claims its family's parameters:
``sglang-qwen3-moe`` untied models with a bf16 router and no expert bias (the family's
layout; ``Qwen3MoeForCausalLM.load_weights`` has no ``tie_word_embeddings`` branch, so a tied
checkpoint would leave ``lm_head`` at its initial values), served model only;
``sglang-qwen3.5-moe`` GDN, shared experts, tied or untied, and the MTP draft. Neither
claims padded expert buffers for whole models (the real classes size ``FusedMoE`` from
``moe_intermediate_size``).

The update lifecycle (``suites/conformance/test_lifecycle.py``): both rows run ``identity``
(their ``begin_update`` / ``end_update`` are SGLang's restore and post-processing, so the
TRT-LLM block layout is undone and re-applied on every identity sync) and
``coverage_by_rank``. They claim none of ``sessions``, ``atomic``, ``version``
(:data:`LIFECYCLE_NOTE`): in SGLang 0.5.23 those live in the scheduler
(``managers/scheduler_components/weight_updater.py``: ``begin_weight_update`` refuses a second
session, ``end_weight_update`` one never begun, ``update_weights_from_tensor`` /
``_from_distributed`` refuse to run outside one; ``weight_version`` is recorded there after each
successful update call), above the model runner these rows run, and the model loader writes
every bucket in place - a failed load raises to the caller (the distributed path returns
``success=False``: "partially updated ... Please discard the whole weights",
``model_runner_components/weight_updater.py``), nothing marks the weights.

SGLang is imported inside the methods: registering these rows imports nothing heavy.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections import OrderedDict
from typing import Optional

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.backends import probe
from pytest_weightsync.reference_impl.backends.sglang import engine_context, runner_for
from pytest_weightsync.reference_impl.model import families

def _flashinfer_importable() -> bool:
    """Whether flashinfer (which SGLang's TRT-LLM BF16 post-processing calls) is installed;
    asked without importing it."""
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def engine_layouts_served() -> tuple:
    """The engine layouts whose real SGLang code runs here: ``trtllm_block`` only where
    flashinfer is installed (its permutation functions run on CPU)."""
    served = ("checkpoint", "transposed")
    return served + ("trtllm_block",) if _flashinfer_importable() else served


class SGLangPlacementError(RuntimeError):
    """SGLang placed a rank differently from the receiver topology: a harness bug or an SGLang
    change, never a property of the payload."""


def sglang_refusal(spec, receiver) -> Optional[str]:
    """Why SGLang cannot serve ``receiver`` at all, or ``None``.

    SGLang's launcher (``arg_groups/parallel_hook.py``) asserts, for ``moe_dp_size > 1`` with
    ``ep_size > 1``, that ``ep_size * moe_dp_size == tp_size`` (MoE-TP 1); ``FusedMoE``
    (``fused_moe_triton/layer.py``) asserts ``num_experts % ep_size == 0``, so vLLM's uneven
    expert placement is refused.
    """
    if receiver.moe_dp > 1 and receiver.moe_ep > 1 and receiver.moe_tp > 1:
        return (f"SGLang requires ep_size * moe_dp_size == tp_size when both exceed 1 (receiver "
                f"moe_tp={receiver.moe_tp}, moe_ep={receiver.moe_ep}, moe_dp={receiver.moe_dp})")
    if getattr(receiver, "expert_placement", "even") != "even":
        return (f"SGLang places experts evenly (FusedMoE asserts num_experts % ep_size == 0); "
                f"the receiver has vLLM's {receiver.expert_placement!r} expert placement")
    if getattr(receiver, "weight_quant", "none") == "fp8_block" and receiver.order == "up_gate":
        return ("SGLang's Fp8MoEMethod loads gate first (no load_up_proj_weight_first); only "
                "its flashinfer_trtllm runner swaps w1/w3, with an FP8 post-load layout not "
                "modelled here")
    return None


def _is_model(spec) -> bool:
    return hasattr(spec, "family")  # a ModelSpec (whole model), not an MoESpec


def _serving(family: str):
    """The ``Capabilities.topology`` predicate of the row of model ``family``: SGLang's
    launcher refusals, and for whole models the family and the engine layouts it builds."""

    def refusal(spec, receiver) -> Optional[str]:
        reason = sglang_refusal(spec, receiver)
        if reason is not None or not _is_model(spec):
            return reason
        if spec.family != family:
            return f"serves {family} models, not {spec.family}"
        if receiver.padded:
            return ("builds FusedMoE from moe_intermediate_size: padded expert buffers are "
                    "covered by the expert suites")
        if receiver.moe_dp > 1:
            return "MoE-DP > 1 (attention context parallelism) is not modelled for whole models"
        return None

    def serves(spec, receiver) -> bool:
        return refusal(spec, receiver) is None

    serves.__doc__ = refusal.__doc__ = sglang_refusal.__doc__
    serves.refusal = refusal  # the skip reason Capabilities.topology_refusal shows
    return serves
#: Shared by every SGLang model row.
_BUILD_LOCK = threading.Lock()


def _sglang_version() -> Optional[str]:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


#: Why the rows claim no part of the update lifecycle but identity and coverage (see module).
LIFECYCLE_NOTE = ("SGLang keeps the update session and the weight version in its scheduler "
                  "(scheduler_components/weight_updater.py), above the model runner this row "
                  "runs; its model loader writes each bucket in place and reports a failed one "
                  "to the caller ('partially updated ... discard the whole weights') without "
                  "marking the weights")
class _BuiltModel:
    """One receiver rank's model object (real class, minimal attributes) and its layers.

    ``expert_location``: SGLang's ``ExpertLocationMetadata`` of an EPLB receiver (``None``
    otherwise), published in the layers' runtime context while SGLang code runs."""

    def __init__(self, model, layers, context, runner, expert_location=None):
        self.model = model
        self.layers = layers
        self.context = context
        self.runner = runner
        self.expert_location = expert_location
        self._bound: dict = {}  # name -> weak reference to the harness tensor bound last

    def bind(self, params: dict) -> None:
        """Point every parameter of the model at the harness tensor of the same name.

        SGLang's post-processing may give a parameter another shape over the same storage (the
        TRT-LLM block layout), and restores by that shape before the next update. So a tensor
        bound again is viewed in the shape SGLang left; a new tensor (a fresh buffer, in the
        checkpoint layout) resets the parameter to its own shape."""
        import weakref

        import torch

        own = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in params.items():
            data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            if name in own:
                current = own[name].data
                last = self._bound.get(name)
                again = last is not None and last() is tensor
                if again and current.shape != data.shape and current.numel() == data.numel():
                    data = data.view(current.shape)
                own[name].data = data
                self._bound[name] = weakref.ref(tensor)
            else:
                _attach(self.model, name, torch.nn.Parameter(data, requires_grad=False))

    def running(self):
        """SGLang's runtime context (runner flag, expert location) while its code runs."""
        import contextlib

        from pytest_weightsync.reference_impl.backends.sglang import _activated

        stack = contextlib.ExitStack()
        stack.enter_context(_activated(self.context, self.runner))
        if self.expert_location is not None:
            stack.enter_context(self.context.resources.override(
                expert_location_metadata=self.expert_location))
        return stack


def _attach(root, name: str, param) -> None:
    """Register ``param`` at dotted ``name`` under ``root``, creating plain modules on the way
    (a layer index under ``model.layers`` reuses the existing layer module)."""
    import torch

    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, param)


def _reconstructed(payload):
    """A flattened bucket decoded as SGLang 0.5.23's ``ModelRunner`` decodes one
    (``WeightUpdater._update_weights_from_flattened_bucket``: the metadata copied into
    ``FlattenedTensorMetadata``, then ``FlattenedTensorBucket.reconstruct_tensors``); any
    other payload as it is."""
    from pytest_weightsync.wire import transport_of

    if transport_of(payload) != "flattened_bucket":
        return payload
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    if not isinstance(payload, dict):
        payload = {"flattened_tensor": payload.get_flattened_tensor(),
                   "metadata": payload.get_metadata()}
    metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                        start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                for m in payload["metadata"]]
    return FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                 metadata=metadata).reconstruct_tensors()


class _SGLangModelLoader:
    """A stock SGLang model's ``load_weights`` over real ``FusedMoE`` layers (see the module
    docstring for what is real and what is stand-in)."""

    name: str
    model_module: str
    model_class: str
    capabilities: Capabilities
    #: The engine family and release this row is (``engine`` in the JSON report).
    engine = {"family": "sglang", "version": _sglang_version()}

    #: Models kept per loader (least recently used dropped first): randomized topologies
    #: must not grow the cache without bound.
    max_models = 256

    def __init__(self) -> None:
        self._models: OrderedDict = OrderedDict()

    # -- the protocol ----------------------------------------------------------------------

    def load_weights(self, params, payload, *, format, spec, topology, rank,
                     targets=None) -> None:
        if format not in self.capabilities.formats:
            raise ValueError(f"{self.name} does not load the {format!r} format (claims "
                             f"{sorted(self.capabilities.formats)})")
        payload = _reconstructed(payload)
        if _is_model(spec):
            engine = self.model_for(spec, topology, rank)
            engine.bind(params)
            engine.load(list(payload), "direct" if format == "direct" else None,
                        spec.targets if targets is None else tuple(targets))
            return
        built = self.model_for(spec, topology, rank)
        built.bind(params)
        payload = list(payload)
        with built.running():
            if format == "direct":
                from sglang.srt.model_executor.model_runner_components.weight_updater import (
                    _model_load_weights_direct,
                )

                _model_load_weights_direct(built.model, payload)
            else:
                type(built.model).load_weights(built.model, payload)

    def begin_update(self, params, *, format, spec, topology, rank) -> None:
        """SGLang's ``begin_weight_update``: ``DefaultModelLoader.restore_weights_before_loading``
        (undoes in-place post-processing such as the TRT-LLM BF16 block layout)."""
        self._run_loader_hook("restore_weights_before_loading", params, spec, topology, rank)

    def end_update(self, params, *, format, spec, topology, rank) -> None:
        """SGLang's ``end_weight_update``: ``DefaultModelLoader.postprocess_weights`` (every
        layer's ``quant_method.process_weights_after_loading``)."""
        self._run_loader_hook("postprocess_weights", params, spec, topology, rank)

    def _run_loader_hook(self, hook: str, params, spec, topology, rank) -> None:
        import torch
        from sglang.srt.model_loader.loader import DefaultModelLoader

        built = self.model_for(spec, topology, rank)
        built.bind(params)
        device = next(iter(params.values())).device if params else torch.device("cpu")
        if _is_model(spec):  # a whole model: the served model and its draft, each its runner's
            with built.active():
                for model in built.models().values():
                    getattr(DefaultModelLoader, hook)(model, device)
            return
        with built.running():
            getattr(DefaultModelLoader, hook)(built.model, device)

    # -- building --------------------------------------------------------------------------

    def model_for(self, spec, topology, rank) -> _BuiltModel:
        """The model of receiver ``rank`` (built once per (spec, topology, rank))."""
        key = (spec, topology, rank)
        with _BUILD_LOCK:
            if key in self._models:
                self._models.move_to_end(key)
            elif _is_model(spec):
                from pytest_weightsync.reference_impl.backends.sglang_model_tree import (
                    build_engine_rank,
                )

                reason = self.capabilities.topology.refusal(spec, topology)
                if reason is not None:
                    raise SGLangPlacementError(f"{self.name}: {reason}")
                self._models[key] = build_engine_rank(spec, topology, rank)
            else:
                self._models[key] = self._build(spec, topology, rank)
                while len(self._models) > self.max_models:
                    self._models.popitem(last=False)
            return self._models[key]

    def model_cls(self):
        import importlib

        return getattr(importlib.import_module(self.model_module), self.model_class)

    def _configure(self, model, spec) -> None:
        """Attributes the real ``load_weights`` reads besides the layers."""
        from types import SimpleNamespace

        model.config = SimpleNamespace(num_experts=spec.num_experts)

    def _build(self, spec, topology, rank) -> _BuiltModel:
        import torch
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        from pytest_weightsync.reference_impl.backends.sglang import (
            _activated,
            preload_runner_modules,
        )
        from pytest_weightsync.reference_impl.model.layout import receiver_shard

        reason = sglang_refusal(spec, topology)
        if reason is not None:
            raise SGLangPlacementError(reason)
        runner = runner_for(topology)
        preload_runner_modules((runner,))
        shard = receiver_shard(spec, topology, rank)
        context = engine_context(topology, rank)
        layers = []
        # EPLB: the model builds its FusedMoE with num_experts + ep_num_redundant_experts
        # physical slots (Qwen3MoeSparseMoeBlock); its config keeps the logical count.
        slots = topology.num_physical_experts(spec) if topology.eplb else spec.num_experts
        quant_config = _quant_config(topology)
        with _activated(context, runner):
            for layer_id in range(spec.num_layers):
                layer = FusedMoE(num_experts=slots, hidden_size=spec.hidden,
                                 intermediate_size=shard.buffer_rows * topology.moe_tp,
                                 layer_id=layer_id, top_k=min(2, spec.num_experts),
                                 params_dtype=spec.dtype, quant_config=quant_config,
                                 prefix=f"model.layers.{layer_id}.mlp.experts")
                if topology.pad_mode == "blocked":
                    layer.use_padded_loading = True  # see the module docstring
                layers.append(layer)
        placed = (layers[0].moe_tp_rank, layers[0].moe_ep_rank, layers[0].num_local_experts)
        wanted = (shard.moe_tp_rank, shard.moe_ep_rank, len(shard.experts))
        if placed != wanted or context.parallel.moe_dp_rank != shard.moe_dp_rank:
            raise SGLangPlacementError(
                f"SGLang placed receiver rank {rank} of {topology} at (moe_tp_rank, moe_ep_rank, "
                f"local experts)={placed}, moe_dp_rank={context.parallel.moe_dp_rank}; the "
                f"reference layout says {wanted}, moe_dp_rank={shard.moe_dp_rank}")
        up_first = bool(getattr(_weight_layout(layers[0]), "load_up_proj_weight_first", False))
        # flashinfer_trtllm stores up first by swapping the w1/w3 shard ids in the loader
        # (FusedMoE._weight_loader_impl), not through load_up_proj_weight_first.
        up_first = up_first or bool(layers[0].use_flashinfer_trtllm_moe)
        if up_first != (topology.order == "up_gate"):
            raise SGLangPlacementError(f"runner {runner} stores up first={up_first}, receiver "
                                       f"order is {topology.order!r}")
        from pytest_weightsync.reference_impl.model.layout import receiver_param_shapes

        shapes = {name: (shape, spec.dtype)
                  for name, shape in receiver_param_shapes(spec, topology, rank).items()}
        if topology.weight_quant == "fp8_block":
            from pytest_weightsync.reference_impl.model import fp8

            shapes = fp8.param_specs(spec, topology, rank)
        for layer_id, layer in enumerate(layers):
            own = {f"model.layers.{layer_id}.mlp.experts.{n}": p
                   for n, p in layer.named_parameters()}
            for name, (want, dtype) in shapes.items():
                if not name.startswith(f"model.layers.{layer_id}."):
                    continue
                got = own.get(name)
                if got is None or tuple(got.shape) != tuple(want) or got.dtype != dtype:
                    raise SGLangPlacementError(
                        f"runner {runner} allocated {name} "
                        f"{None if got is None else (tuple(got.shape), got.dtype)} on receiver "
                        f"rank {rank} of {topology}; the reference layout says {want} {dtype}")
        expert_location = _expert_location(spec, topology, shard, context) if topology.eplb else None
        cls = self.model_cls()
        model = cls.__new__(cls)
        torch.nn.Module.__init__(model)
        self._configure(model, spec)
        model.model = torch.nn.Module()
        blocks = []
        for layer in layers:
            block = torch.nn.Module()
            block.mlp = torch.nn.Module()
            block.mlp.experts = layer
            blocks.append(block)
        model.model.layers = torch.nn.ModuleList(blocks)
        return _BuiltModel(model, layers, context, runner, expert_location)


def _quant_config(topology):
    """SGLang's ``Fp8Config`` of an FP8 block-quantized receiver (an FP8-serialized checkpoint,
    dynamic activation scales, ``weight_block_size`` = the topology's block), else ``None``."""
    if topology.weight_quant != "fp8_block":
        return None
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                     weight_block_size=list(topology.quant_block))


def _expert_location(spec, topology, shard, context):
    """SGLang's ``ExpertLocationMetadata`` of an EPLB receiver, built by the two functions its
    ``init_by_mapping`` ends with (``_compute_logical_to_all_physical_map``, ``_init_raw``) from
    the topology's physical -> logical map (the model-config lookup ``init_by_mapping`` starts
    with needs a real checkpoint config)."""
    import torch
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        _compute_logical_to_all_physical_map,
    )
    from sglang.srt.runtime_context import use_context

    physical_to_logical = torch.tensor(topology.physical_to_logical(spec), dtype=torch.int64)
    with use_context(context):
        logical_to_all = _compute_logical_to_all_physical_map(
            physical_to_logical, num_logical_experts=spec.num_experts,
            ep_size=topology.moe_ep, moe_ep_rank=shard.moe_ep_rank)
        return ExpertLocationMetadata._init_raw(
            ep_size=topology.moe_ep, physical_to_logical_map=physical_to_logical,
            logical_to_all_physical_map=logical_to_all, moe_ep_rank=shard.moe_ep_rank)


def _weight_layout(layer):
    from sglang.srt.layers.moe.fused_moe_triton.layer import _weight_layout_method

    return _weight_layout_method(layer)


class Qwen3MoeLoader(_SGLangModelLoader):
    """``Qwen3MoeForCausalLM.load_weights`` (per-expert names only: no fused-experts branch)."""

    name = "sglang-qwen3-moe"
    model_module = "sglang.srt.models." + families.get("qwen3_moe").sglang_module
    model_class = families.get("qwen3_moe").sglang_loader_class
    capabilities = Capabilities(formats=("compat", "direct"), topology=_serving("qwen3_moe"),
                                model_parts=("experts", "attention", "router", "norms",
                                             "embeddings"),
                                engine_layouts=engine_layouts_served(), redundant_experts=True,
                                weight_quants=("none", "fp8_block"),
                                transports=("tensors", "flattened_bucket"),
                                lifecycle_note=LIFECYCLE_NOTE)


class Qwen35MoeLoader(_SGLangModelLoader):
    """``Qwen3_5MoeForCausalLM.load_weights`` (per-expert and fused ``gate_up_proj`` names)."""

    name = "sglang-qwen3.5-moe"
    model_module = "sglang.srt.models." + families.get("qwen3_5_moe").sglang_module
    model_class = families.get("qwen3_5_moe").sglang_loader_class
    capabilities = Capabilities(formats=("compat", "hf_fused", "direct"),
                                topology=_serving("qwen3_5_moe"),
                                model_parts=("experts", "attention", "gdn", "router",
                                             "shared_expert", "norms", "embeddings",
                                             "tied_embeddings"),
                                targets=("target", "draft"),
                                engine_layouts=engine_layouts_served(), redundant_experts=True,
                                weight_quants=("none", "fp8_block"),
                                transports=("tensors", "flattened_bucket"),
                                lifecycle_note=LIFECYCLE_NOTE)

    def _configure(self, model, spec) -> None:
        super()._configure(model, spec)
        model.num_fused_shared_experts = 0  # aiter-only shared-expert fusion is off
        model.enable_shared_expert_fusion = False



def backend_status():
    """Whether stock SGLang imports here (:func:`~pytest_weightsync.reference_impl.backends.probe`
    of ``"sglang"``). The plugin's registry asks this by its registered name
    (``registry.OPTIONAL_PROBES``), as it reaches the rows themselves, before adding the rows of
    this module: the judge imports nothing it judges."""
    return probe("sglang")
