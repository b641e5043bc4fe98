"""What an implementation under test looks like: a receiver-side loader and/or a sender-side
exporter, each declaring what it supports.

An *implementation* is any object with a ``name`` (``str``), a ``capabilities``
(:class:`Capabilities`) and at least one of the two roles:

``load_weights(params, payload, *, format, spec, topology, rank) -> None``
    The receiver side (what runs inside SGLang/vLLM). ``params`` is the receiver rank's
    pre-allocated parameters, ``{name: tensor}`` (``model.layers.{L}.mlp.experts.w13_weight``
    ``[E_local, 2 * I_buf, H]`` and ``...w2_weight`` ``[E_local, H, I_buf]``, plus unrelated
    parameters it must leave alone). ``payload`` is a list of ``(name, tensor)`` in
    ``format``: ``"compat"`` (full Hugging Face per-expert tensors), ``"packed"`` (unsharded
    ``w13``/``w2`` of every expert, in the receiver's gate/up order) or ``"direct"`` (this
    rank's own parameter names and exact shapes). ``spec`` is a
    :class:`pytest_weightsync.reference_impl.model.layout.MoESpec`, ``topology`` a
    :class:`pytest_weightsync.reference_impl.model.layout.ReceiverTopology`, ``rank`` the receiver rank (its index in
    the engine's TP group). It writes in place (the tensors in ``params`` keep their
    storage) and refuses bad input with a ``ValueError``/``TypeError`` naming the problem,
    before writing anything of that call. One call is one BUCKET of an update: ``hf_fused``
    (``experts.gate_up_proj`` / ``experts.down_proj`` of every expert) is a fourth format,
    and a bucket may hold part of a layer's experts or several layers. One engine rank's
    ``params`` is the same dict holding the same tensor objects in every call the harness
    makes for it (every hook below, every update), so a loader may keep per-rank state keyed
    by them (weakly: another dict, even at a reused ``id()``, is another engine rank).

``begin_update(params, *, format, spec, topology, rank)`` / ``end_update(params, *, format,
spec, topology, rank)`` (optional)
    A loader MAY define them; the harness then calls ``begin_update`` before the buckets of
    one full update of ``params`` and ``end_update`` after the last one, so the loader can
    track the update across buckets (duplicates, completeness) and refuse an incomplete one at
    ``end_update``. ``end_update`` closes the session whether it completes the update or
    refuses to. Every bucket the harness sends such a loader is inside a session (a one-layer
    payload travels as the last buckets of a full update whose other layers carry the bits
    they hold), and an update it abandons - a lost sender - is closed with ``end_update``
    before the next ``begin_update``: the loader may refuse a second ``begin_update`` while an
    update is open and a ``load_weights`` or ``end_update`` without one (vLLM's worker does).
    Without them each ``load_weights`` call stands alone.

``weight_version(params, *, spec, topology, rank)`` (optional; claimed by ``"version"`` in
``Capabilities.lifecycle``)
    The version the engine's ``params`` hold: a value that moves exactly once per completed
    update (an identity update too; an ``int`` moves by one) and nowhere else - not at
    ``begin_update``, not at a bucket, not by a failed or abandoned update. While an update
    is open it is ``None`` or the last complete version (SGLang's label stays until the next
    is published), never the new one. Once no update is open it names a complete version only
    while the parameters hold it bit for bit, and is ``None`` otherwise ("unusable until a
    full update"): never updated, after a failed or abandoned update or a bucket outside a
    session that changed them, after a level-2 sleep. The
    lifecycle contract (``docs/validate-your-loader.md``, "The update lifecycle") says what an
    engine-side loader may claim (:data:`LIFECYCLE`).

``sleep(params, *, level, spec, topology, rank)`` / ``wake_up(params, *, spec, topology,
rank)`` (optional; claimed by ``"sleep"`` in ``Capabilities.lifecycle``)
    The engine gives the memory of ``params`` back between updates and takes it again (vLLM's
    ``sleep(level)`` / ``wake_up``, SGLang's ``release_memory_occupation`` /
    ``resume_memory_occupation``). Level 1 offloads: after ``wake_up`` every parameter holds
    its bits again, at its address. Level 2 discards what an update brings back, and nothing
    else: on an experts-only engine the routed experts' ``w13_weight`` / ``w2_weight`` (the
    router weight keeps its bits), on a whole-model engine every parameter a whole-model
    update carries; after ``wake_up`` no complete version is held (``weight_version`` says
    ``None``) and the next update must be complete.

``export_weights(trainer_states, *, format, spec, trainer, receiver, rank) -> payload``
    The sender side (what runs in the trainer). ``trainer_states`` is every trainer rank's
    Megatron-Core expert state dict, in rank order (``trainer`` is the
    :class:`pytest_weightsync.reference_impl.model.layout.TrainerTopology` they follow). It returns the ``format``
    payload, a list of ``(name, tensor)``, for receiver ``rank`` of ``receiver``. The harness
    checks after every call that no trainer shard was modified.

``export_weights_distributed(model_state, *, config, format, spec, trainer, receiver, delivery,
bucket_bytes[, model][, engine]) -> streams``
    The sender side as a real trainer runs it: called once per update in EVERY rank of a
    ``torch.distributed`` (gloo) job of ``trainer.world_size`` ranks, after the harness ran
    Megatron-Core's ``parallel_state.initialize_model_parallel`` for ``trainer`` (the exporter
    finds its EP/ETP/PP groups there, as real exporters do) and built the rank's model as
    ``megatron.training.get_model`` builds it. ``model`` (optional keyword: passed only to a
    method that accepts it) is that model: the list of this rank's model chunks, each a
    megatron-core ``DistributedDataParallel`` around ``Float16Module`` around a ``GPTModel``
    of this PP stage, whose ``decoder.layers`` are real ``TransformerLayer`` s with a global
    ``layer_number`` (1-based, PP offset included), ``chunk.config`` the
    ``TransformerConfig``; non-expert parameters keep Megatron's initialization.
    ``model_state`` is the chunk's ``named_parameters()`` - real ``nn.Parameter`` objects -
    plus, for whole models, each router's float32 ``expert_bias`` BUFFER (a plain tensor of
    ``state_dict()``, not a parameter; see below); the experts are named
    ``module.module.decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc1.weight``
    (SequentialMLP) or ``...mlp.experts.linear_fc1.weight{i}`` (TEGroupedMLP), local layer and
    expert numbering, every one carrying ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` as Megatron sets them (``get_model`` gives the router and norms the
    defaults ``False`` / ``-1`` / ``1``) and expert weights ``allreduce``; TEGroupedMLP weights
    carry what Transformer Engine sets: ``tensor_model_parallel=True`` and, under explicit
    expert comms (ETP > 1 or EP > 1, where Megatron hands TE ``parallel_mode=None``),
    ``partition_dim=0`` for fc1 AND fc2 (fc2's shards really split dim 1). ``config`` is the
    model's ``TransformerConfig``. It does its own collectives and returns bucket streams (a
    stream is a list of buckets, a bucket a list of ``(name, tensor)``, see :func:`as_stream`)
    in ``format`` for the engine ranks it feeds, each bucket within ``bucket_bytes`` (``None``:
    no limit) or over it by ONE UNIT only - the tensors converted from one source parameter
    (one fused ``linear_fc1`` becoming ``gate_proj`` + ``up_proj`` is one unit; every other
    tensor is a unit of its own): without its largest unit a bucket must fit. A bucket over
    by more is a finding of the report's ``bucket_limit`` column, not a failure:

    * ``delivery="colocated"``: every trainer rank returns one stream, for the engine rank
      colocated with it, :func:`colocated_engine_rank` (``trainer_rank % receiver.tp``; a
      trainer world larger than the engine means several engine replicas, each fed whole);
      or serialized updates for every engine rank of its replica (a gather source); or
      ``None``, nothing from this rank (its engine rank then gets only what others sent it);
    * ``delivery="distributed"``: trainer rank 0 returns ``{engine_rank: stream}`` for every
      engine rank of ``receiver``, or each pipeline stage's source rank broadcasts its stage
      over its ``engine``; every other rank returns ``None``.

    A bucket may travel on any wire format of :data:`TRANSPORTS`
    (:mod:`pytest_weightsync.wire`): a list of ``(name, tensor)`` pairs, a flattened bucket
    (``{"flattened_tensor", "metadata"}``, SGLang's ``load_format="flattened_bucket"``) or a
    serialized update (``serialized_named_tensors``: one ``MultiprocessingSerializer`` entry
    per engine TP rank, as ``update_weights_from_tensor`` takes it); the harness decodes each
    with its own decoder into what the engine rank reads. ``engine`` (optional keyword) is,
    in each pipeline stage's source rank under distributed delivery (TP rank 0 of DP rank 0;
    trainer rank 0 without PP), a
    :class:`pytest_weightsync.transports.broadcast.BroadcastEngine` (``None`` elsewhere): an exporter
    that calls its ``update_weights_from_distributed(names, dtypes, shapes[, load_format])``
    and then ``torch.distributed.broadcast(tensor, src=0, group=engine.group)`` for each tensor
    returns ``None``, and what the engine ranks received is its stream.

    Between two calls the harness writes the next version of the weights into the same
    parameters in place (an optimizer step), so every call must read the parameters afresh.
    It must leave every parameter of ``model_state`` bit-identical and where it was (the same
    object in the model, the same storage: rebinding ``param.data`` fails, named "rebound"),
    checked after each call.

Whole models (``suites/conformance/test_model.py``, for implementations whose
:class:`Capabilities` claim ``model_parts``): ``spec`` is a
``pytest_weightsync.reference_impl.model.model_spec.ModelSpec``; a loader's ``params`` is the
engine rank's whole parameter tree (``reference_impl.model.model_layout.engine_params``: SGLang's
names and TP shapes, the MTP draft's under ``draft.``), ``payload`` carries every checkpoint
tensor (``compat``, ``hf_fused``) or every engine parameter (``direct``), and the optional
keyword ``targets`` names the models the update reaches (``("target", "draft")`` or
``("target",)``: a frozen draft); an exporter's ``trainer_states`` are whole Megatron state
dicts (``reference_impl.trainer.megatron_model``). A distributed exporter that claims whole models
is also run in real ranks (``suites/conformance/test_model_distributed.py``): its
``model_state`` is the stage's whole real ``GPTModel`` - every parameter plus each router's
float32 ``expert_bias`` buffer - and ``trainer.first_stage_layers`` may make the stages
uneven (a layer's global number is its ``TransformerLayer.layer_number - 1``). See
``docs/validate-your-loader.md``.

Two roles judge what happens around the copy while an engine serves (``docs/refit-under-load.md``,
``suites/conformance/test_serving.py``):

``open_serving_engine(*, spec, version, dialect, seed=0)``
    A serving engine holding whole model ``spec`` at ``version`` (also its first published
    label), speaking the control plane ``dialect`` (:data:`SERVING_DIALECTS`, claimed in
    ``Capabilities.serving``): ``dialect``, ``submit(prompt, max_new_tokens) -> rid``,
    ``step()`` (one scheduler iteration), ``request(rid)`` (``output``, ``logprobs``, ``token_versions``,
    ``prompt_versions``, ``cached_tokens``, ``status``, ``abort_reason``, ``retractions``),
    ``weight_version``, ``pause_generation(mode, clear_cache=None)``, ``continue_generation()``
    / ``resume_generation()``, ``flush_cache()`` / ``reset_prefix_cache()``,
    ``update_weights(buckets, *, load_format=None, flush_cache=True, weight_version=None)``,
    ``update_weight_version(new_version, abort_all_requests=True)``.
``refit_engine(engine, buckets, *, version)``
    An RL framework's refit sequence (an *orchestrator*): given such an engine with requests
    in flight, it pauses, updates with ``buckets``, flushes, publishes ``version`` and resumes
    in its own order.

Three roles sync LoRA adapters instead of weights (``docs/lora.md``,
``suites/conformance/test_lora.py``), claimed with ``Capabilities.lora``:

``load_adapter(params, slots, payload, *, adapter, topology, rank, slot, layout)``
    The engine side: writes the adapter in ``payload`` (``lora_A`` / ``lora_B`` tensors named as
    Megatron-Bridge exports them, ``<module>.lora_A.weight``, unsharded) into slot ``slot`` of the engine rank's adapter buffers ``slots``, laid
    out as ``layout`` (:data:`LORA_LAYOUTS`) holds them; ``params`` (the base weights) must stay
    bit-identical. ``evict_adapter(slots, *, ...)`` (optional) frees the slot.
``export_adapter(trainer_states, *, adapter, trainer, receiver, rank[, bucket_bytes])``
    The trainer side: from every trainer rank's Megatron-Bridge adapter shards
    (``...linear_qkv.adapter.linear_in.weight`` ..., ``reference_impl/trainer/lora_state.py``),
    the adapter engine rank ``rank`` loads, as a bucket stream (pairs or any transport).
``merge_adapter(base, tensors, *, adapter)``
    The merged path: every targeted base weight with the adapter merged into it.

What an implementation claims, :class:`Capabilities`, and the refusal logic over it live in
:mod:`pytest_weightsync.capabilities`; both names stay importable from here.

Nothing here imports torch: the registry uses these definitions at collection time.
"""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Mapping,
    MutableMapping,
    Optional,
    Protocol,
    Sequence,
    Union,
    runtime_checkable,
)

if TYPE_CHECKING:  # annotations only: nothing here may import torch at run time
    import torch

    #: One bucket: ``(name, tensor)`` pairs; a stream: a list of buckets.
    Bucket = Sequence[tuple[str, "torch.Tensor"]]
    Stream = Sequence[Bucket]

#: The layout types the suites pass (``pytest_weightsync.reference_impl.model.layout``: ``MoESpec``,
#: ``ReceiverTopology``, ``TrainerTopology``). Named here, not imported: the plugin never
#: imports the reference implementation.
MoESpec = ReceiverTopology = TrainerTopology = Any

from pytest_weightsync.vocabulary import (  # noqa: F401 - re-exported for implementations
    DELIVERIES,
    ENGINE_LAYOUTS,
    EXPERT_PLACEMENTS,
    LOADER_TRANSPORTS,
    LORA_LAYOUTS,
    EXPERT_IMPLS,
    EXPERT_MODULES,
    FORMATS,
    LAYER_SPECS,
    LIFECYCLE,
    MODEL_PARTS,
    ORDERS,
    QUANTIZERS,
    RECEIVER_AXES,
    ROLES,
    TARGETS,
    TRAINER_AXES,
    TRANSPORTS,
    WEIGHT_QUANTS,
)

#: Capabilities (what an implementation claims) and its refusal logic live in
#: :mod:`pytest_weightsync.capabilities`; this is their documented import path.
from pytest_weightsync.capabilities import Capabilities, ClaimError  # noqa: E402

#: The public surface third parties import from here, the vocabulary's words above included.
__all__ = [
    "DELIVERIES", "ENGINE_LAYOUTS", "EXPERT_IMPLS", "EXPERT_MODULES", "EXPERT_PLACEMENTS",
    "FORMATS", "LAYER_SPECS", "LIFECYCLE", "LOADER_TRANSPORTS", "LORA_LAYOUTS", "MODEL_PARTS",
    "ORDERS", "QUANTIZERS", "RECEIVER_AXES", "ROLES", "TARGETS", "TRAINER_AXES", "TRANSPORTS",
    "WEIGHT_QUANTS",
    "Capabilities",
    "ClaimError",
    "DistributedWeightExporter",
    "SIGNATURES",
    "WeightExporter",
    "WeightLoader",
    "accepts_keyword",
    "as_stream",
    "colocated_engine_rank",
    "protocol_problems",
    "roles_of",
    "signature_problem",
]

#: How the harness calls each protocol method: ``(positional parameters, keyword-only
#: parameters, optional keywords)``. The registry checks every implementation's methods
#: against this at registration (``inspect.signature``), so a wrong signature is one usage
#: error naming the method instead of a TypeError per test. An optional keyword is passed
#: only to a method that accepts it (by name or through ``**kwargs``): newer harness inputs
#: reach the implementations that ask for them without breaking the others.
SIGNATURES = {
    "load_weights": (("params", "payload"), ("format", "spec", "topology", "rank"), ("targets",)),
    "begin_update": (("params",), ("format", "spec", "topology", "rank"), ("targets",)),
    "end_update": (("params",), ("format", "spec", "topology", "rank"), ("targets",)),
    "weight_version": (("params",), ("spec", "topology", "rank"), ("targets",)),
    "sleep": (("params",), ("level", "spec", "topology", "rank"), ("targets",)),
    "wake_up": (("params",), ("spec", "topology", "rank"), ("targets",)),
    "export_weights": (("trainer_states",), ("format", "spec", "trainer", "receiver", "rank"), ()),
    "export_weights_distributed": (
        ("model_state",),
        ("config", "format", "spec", "trainer", "receiver", "delivery", "bucket_bytes"),
        ("model", "engine")),
    "open_serving_engine": ((), ("spec", "version", "dialect"), ("seed",)),
    "refit_engine": (("engine", "buckets"), ("version",), ()),
    "load_adapter": (("params", "slots", "payload"),
                     ("adapter", "topology", "rank", "slot", "layout"), ()),
    "evict_adapter": (("slots",), ("adapter", "topology", "rank", "slot", "layout"), ()),
    "export_adapter": (("trainer_states",), ("adapter", "trainer", "receiver", "rank"),
                       ("bucket_bytes",)),
    "merge_adapter": (("base", "tensors"), ("adapter",), ()),
}


def colocated_engine_rank(trainer_rank: int, receiver_tp: int) -> int:
    """The engine rank colocated with ``trainer_rank`` (the rank it feeds under
    ``delivery="colocated"``): ``trainer_rank % receiver_tp``."""
    return trainer_rank % receiver_tp


@runtime_checkable
class WeightLoader(Protocol):
    """Receiver side; see the module docstring for what each argument holds. ``begin_update``
    and ``end_update`` (same keywords, no payload) are optional."""

    name: str
    capabilities: Capabilities

    def load_weights(self, params: "MutableMapping[str, torch.Tensor]", payload: "Bucket", *,
                     format: str, spec: MoESpec, topology: ReceiverTopology,
                     rank: int) -> None: ...


@runtime_checkable
class WeightExporter(Protocol):
    """Sender side; see the module docstring for what each argument holds."""

    name: str
    capabilities: Capabilities

    def export_weights(self, trainer_states: "Sequence[Mapping[str, torch.Tensor]]", *,
                       format: str, spec: MoESpec, trainer: TrainerTopology,
                       receiver: ReceiverTopology, rank: int) -> "Union[Bucket, Stream]": ...


@runtime_checkable
class DistributedWeightExporter(Protocol):
    """Sender side run in every trainer rank; see the module docstring. It may also take the
    optional keyword ``model`` (:data:`SIGNATURES`)."""

    name: str
    capabilities: Capabilities

    def export_weights_distributed(
            self, model_state: "Mapping[str, torch.Tensor]", *, config: Any, format: str,
            spec: MoESpec, trainer: TrainerTopology, receiver: ReceiverTopology,
            delivery: str, bucket_bytes: Optional[int],
    ) -> "Union[Bucket, Stream, Mapping[int, Stream], None]": ...


def as_stream(result, *, source: str = "export") -> list[list]:
    """An exporter's result as a bucket stream: a list of buckets, each a list of
    ``(name, tensor)``. One bucket (a list of pairs) is a stream of one; an empty result is an
    empty stream. Anything else raises :class:`TypeError` naming ``source``. (No torch here:
    the tensors themselves are checked by whoever loads the buckets.)"""
    items = list(result) if result is not None else None
    if items is None:
        raise TypeError(f"{source} returned None; expected a list of (name, tensor) pairs or a "
                        f"list of such lists (one per bucket)")
    if not items:
        return []
    if all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items):
        return [items]
    stream = []
    for index, bucket in enumerate(items):
        if isinstance(bucket, (str, bytes)) or not hasattr(bucket, "__iter__"):
            raise TypeError(f"{source}: bucket {index} is a {type(bucket).__name__}, not a list "
                            f"of (name, tensor) pairs")
        bucket = list(bucket)
        for j, pair in enumerate(bucket):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(f"{source}: bucket {index} entry {j} is not a (name, tensor) "
                                f"pair: {pair!r:.80}")
        stream.append(bucket)
    return stream


def roles_of(obj) -> tuple[str, ...]:
    """The roles ``obj`` provides (the keys of :data:`ROLES` whose method it has), in that order."""
    return tuple(role for role, method in ROLES.items() if callable(getattr(obj, method, None)))


def protocol_problems(obj) -> list[str]:
    """Everything that keeps ``obj`` from being an implementation; empty when it is one."""
    problems = []
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name.strip():
        problems.append(f"'name' must be a non-empty str, got {name!r}")
    elif any(ch.isspace() or ch in "[]" for ch in name):
        problems.append(f"'name' {name!r} must not contain whitespace or brackets (it becomes "
                        f"part of test ids)")
    caps = getattr(obj, "capabilities", None)
    if not isinstance(caps, Capabilities):
        problems.append(f"'capabilities' must be a pytest_weightsync.protocols.Capabilities, "
                        f"got {type(caps).__name__}")
    for method in SIGNATURES:
        problem = signature_problem(obj, method)
        if problem is not None:
            problems.append(problem)
    for claim, methods in (("sessions", ("begin_update", "end_update")),
                           ("atomic", ("begin_update", "end_update")),
                           ("version", ("weight_version",)),
                           ("sleep", ("sleep", "wake_up", "begin_update", "end_update"))):
        lacking = [m for m in methods if not callable(getattr(obj, m, None))]
        if isinstance(caps, Capabilities) and claim in caps.lifecycle and lacking:
            problems.append(f"Capabilities.lifecycle claims {claim!r} but it has no "
                            f"{' / '.join(lacking)}")
    if not roles_of(obj):
        problems.append("it has none of load_weights(params, payload, *, format, spec, "
                        "topology, rank), export_weights(trainer_states, *, format, spec, "
                        "trainer, receiver, rank) and export_weights_distributed(model_state, *, "
                        "config, format, spec, trainer, receiver, delivery, bucket_bytes)")
    return problems


def signature_problem(obj, method: str):
    """Why ``obj.<method>`` cannot be called the way the harness calls it (see
    :data:`SIGNATURES`), or ``None`` when it can (or ``obj`` has no such method)."""
    import inspect

    fn = getattr(obj, method, None)
    if fn is None:
        return None
    if not callable(fn):
        return f"{method} is a {type(fn).__name__}, not a method"
    positional, keywords, _ = SIGNATURES[method]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: nothing to check before calling it
    try:
        sig.bind(*positional, **{k: None for k in keywords})
    except TypeError as error:
        wanted = ", ".join(positional) + ", *, " + ", ".join(keywords)
        return (f"{method}{sig} cannot be called as {method}({wanted}): {error} (see "
                f"pytest_weightsync.protocols)")
    return None


def accepts_keyword(fn, name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (by name or through ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (
        p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)) for p in params)
