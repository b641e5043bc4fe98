"""The reference implementation behind the conformance protocols (``pytest_weightsync.protocols``).

It is registered like any third-party implementation (entry point ``weightsync.loaders``,
name ``reference``), so the conformance matrix shows it next to the implementations it is the
yardstick for. Both roles delegate to the reference modules: loading to
:class:`pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver` (SGLang ``FusedMoE``
placement, stricter than SGLang on bad input), exporting to the trainer gather and the
compat / hf_fused / packed / direct sender paths.

Streams: ``begin_update(params, ...)`` opens an update on ``params``, every ``load_weights``
call on that same params dict in between is one bucket of it, and ``end_update`` checks the
update carried every (layer, expert, projection) the rank owns. ``load_weights`` outside an
update is a one-bucket update whose completeness is not checked. An open update is bound to
the ``format``, ``spec``, ``topology`` and ``rank`` it was opened with: a bucket or an
``end_update`` that names others is refused (:class:`UpdateMismatchError`), since loading
rank 1's bucket into an update of rank 0 would place the wrong experts without a word.

The update lifecycle (``docs/validate-your-loader.md``, claimed in ``Capabilities.lifecycle``):
``weight_version(params, ...)`` is the number of updates completed on ``params``, or ``None``
while they hold no complete version - never updated, an update open (its buckets land in
place), after an update that failed (a refused bucket, an incomplete ``end_update``) or was
abandoned, after a bucket loaded outside an update and after a level-2 ``sleep`` (which
discards the weights; level 1 offloads them and ``wake_up`` restores every bit) - until the
next update completes. A
stream written in place cannot be rolled back without a second copy of the model, so a failed
update marks the parameters unusable instead.

Between calls only the update's small state is kept (which pieces arrived, the bucket count)
and weak references to the parameters: no receiver, no tensor. An update that is never ended
is released by the next ``begin_update`` on those parameters, or as soon as the caller drops
them, so a trainer that abandons updates (an exception between buckets, a retry) cannot pile
up models in memory.

Whole models: when ``spec`` is a :class:`~pytest_weightsync.reference_impl.model.model_spec.ModelSpec`
the loader is the whole-model receiver
(:class:`~pytest_weightsync.reference_impl.engine.model_receiver.ModelReceiver`: every engine
parameter, the draft's included) and ``targets`` (an optional keyword: the models the update
reaches, default all) is bound to the update like the other arguments; the exporter gathers
every parameter from the trainer states (:func:`~pytest_weightsync.reference_impl.trainer.megatron_model.gather_model`)
and sends the whole model (:mod:`~pytest_weightsync.reference_impl.senders.model_senders`).

Heavy modules are imported inside the methods: discovering implementations (which imports this
module) must stay cheap.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.vocabulary import EXPERT_PLACEMENTS, MODEL_PARTS, TARGETS
from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.senders.formats import PayloadFormatError, check_format


_NAME_KIND = {"compat": "expert", "packed": "fused", "direct": "fused", "hf_fused": "hf_fused"}
_KIND_WORDS = {"compat": "per-expert Hugging Face", "packed": "fused w13/w2",
               "direct": "fused w13/w2", "hf_fused": "fused gate_up_proj/down_proj"}


class UpdateMismatchError(WeightSyncError):
    """``load_weights`` / ``end_update`` on parameters whose open update was begun with another
    format, spec, topology or rank; the message names both."""


def _check_format(fmt: str, payload, where) -> None:
    from pytest_weightsync.reference_impl.model.layout import parse_receiver_name

    check_format(fmt)
    for index, item in enumerate(payload):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            parsed = parse_receiver_name(item[0])
            if parsed is not None and parsed.kind != _NAME_KIND[fmt]:
                raise PayloadFormatError(
                    f"{where(index, item[0])} is not a name of the {fmt} format "
                    f"(the {fmt} format carries {_KIND_WORDS[fmt]} names)")


def _check_payload_type(payload) -> None:
    from pytest_weightsync.reference_impl.engine.receiver import PayloadTypeError

    if payload is None:
        raise PayloadTypeError("payload is None; expected a list of (name, tensor) pairs")
    if isinstance(payload, (str, bytes, dict)) or not hasattr(payload, "__iter__"):
        raise PayloadTypeError(f"payload is a {type(payload).__name__}; expected a list of "
                               f"(name, tensor) pairs")


def _decoded(payload):
    """A flattened bucket (``load_format="flattened_bucket"``) as its ``(name, tensor)``
    pairs, decoded and checked whole before anything is written; anything else as it is."""
    from pytest_weightsync import wire
    from pytest_weightsync.reference_impl.engine.receiver import PayloadError

    if wire.transport_of(payload) != "flattened_bucket":
        return payload
    try:
        return wire.decode_flattened(payload)
    except wire.WireFormatError as error:
        raise PayloadError(str(error)) from None


#: GPU parameter sets whose copy plans the reference keeps (see ``_plan_cache_for``).
PLAN_CACHES = 4

#: The begin_update arguments an open update is bound to, in message order.
_BOUND = ("format", "spec", "topology", "rank", "targets")


def is_model_spec(spec) -> bool:
    """Whether ``spec`` describes a whole model (a ``ModelSpec``) rather than experts only
    (asked several times per loader call: the class is imported once, on first use)."""
    global _MODEL_SPEC
    if _MODEL_SPEC is None:
        from pytest_weightsync.reference_impl.model.model_spec import ModelSpec

        _MODEL_SPEC = ModelSpec
    return isinstance(spec, _MODEL_SPEC)


_MODEL_SPEC = None


def _targets(spec, targets):
    if targets is None:
        return tuple(spec.targets) if is_model_spec(spec) else None
    return tuple(targets)


@dataclass
class _OpenUpdate:
    """What is kept of an update between calls: the receiver's update state, the arguments it
    was begun with, and weak references to the parameters (so dropping them frees both)."""

    state: object
    bound: dict
    refs: tuple
    token: int

    def holds(self, params) -> bool:
        """Whether ``params`` still maps the update's names to the very tensors it began on."""
        return all(name in params and params[name] is ref() for name, ref in self.refs)

    def mismatch(self, call: str, given: dict) -> str | None:
        differ = [key for key in _BOUND if given[key] != self.bound[key]]
        if not differ:
            return None
        now = ", ".join(f"{key}={given[key]!r}" for key in differ)
        then = ", ".join(f"{key}={self.bound[key]!r}" for key in differ)
        return (f"{call}({now}) on params whose open update was begun with {then}: an update "
                f"is one receiver rank's stream in one format; end_update() it (or begin_update "
                f"again) before loading another")


@dataclass
class _Held:
    """What is known of the version ``params`` hold: how many updates completed on them, and
    whether they hold the last one's values (weak references to the parameters, as
    :class:`_OpenUpdate`)."""

    refs: tuple
    token: int
    completed: int = 0
    usable: bool = False

    holds = _OpenUpdate.holds


class ReferenceImplementation:
    """Loader and exporter of every format, gate/up order, padding and topology."""

    name = "reference"
    capabilities = Capabilities(model_parts=MODEL_PARTS, targets=TARGETS,
                                engine_layouts=("checkpoint", "trtllm_block", "transposed"),
                                redundant_experts=True, weight_quants=("none", "fp8_block"),
                                expert_placements=EXPERT_PLACEMENTS,
                                quantizers=("sender", "loader"),
                                transports=("tensors", "flattened_bucket"),
                                lifecycle=("sessions", "atomic", "version", "sleep"),
                                serving=("sglang", "vllm"), lora=("sglang", "vllm"))
    #: How the distributed exporter puts its buckets on the wire (one of
    #: ``distributed_export.REFERENCE_TRANSPORTS``); the self-tests run every one.
    transport = "tensors"

    def __init__(self):
        self._open: dict[int, _OpenUpdate] = {}  # id(params) -> the update open on them
        self._held: dict[int, _Held] = {}  # id(params) -> the version they hold
        self._plan_caches: OrderedDict = OrderedDict()  # GPU parameter set -> its LoadCache
        self._asleep: dict[int, tuple] = {}  # id(params) -> (level, offloaded copies or None)
        self._tokens = itertools.count()

    def __getstate__(self) -> dict:
        """A copy sent to another process (the harness pickles the implementation to trainer
        ranks) keeps its settings but starts with no update state: the tables hold weak
        references to parameters of this process, which the copy never sees."""
        tables = ("_open", "_held", "_plan_caches", "_asleep", "_tokens")
        return {k: v for k, v in self.__dict__.items() if k not in tables}

    def __setstate__(self, state: dict) -> None:
        ReferenceImplementation.__init__(self)  # the tables only: a subclass's own __init__
        self.__dict__.update(state)             # may take arguments its state already holds

    def _plan_cache_for(self, receiver, spec, topology):
        """The copy-plan cache of ``receiver``'s parameters when they live on a GPU: a bucket is
        still validated and planned in full on every call, but a copy plan seen before at the
        same addresses is replayed (a CUDA graph from its second run) instead of launching one
        copy per piece (:mod:`pytest_weightsync.reference_impl.engine.plan_cache`). Checkpoint-layout
        expert receivers only; on CPU nothing is cached (the profile counts every copy). At most
        :data:`PLAN_CACHES` parameter sets are kept, least recently used dropped first: a cache
        keeps its last payload alive."""
        if is_model_spec(spec) or (topology.engine_layout, topology.weight_quant,
                                   topology.redundant_experts) != ("checkpoint", "none", 0):
            return None
        first = next(iter(receiver.params.values()), None)
        if first is None or first.device.type != "cuda":
            return None
        key = tuple((name, t.data_ptr(), t.shape, t.dtype) for name, t in receiver.params.items())
        cache = self._plan_caches.get(key)
        if cache is not None:
            self._plan_caches.move_to_end(key)
            return cache
        from pytest_weightsync.reference_impl.engine.plan_cache import LoadCache

        cache = self._plan_caches[key] = LoadCache()
        while len(self._plan_caches) > PLAN_CACHES:
            self._plan_caches.popitem(last=False)
        return cache

    def _receiver(self, params, spec, topology, rank, targets=None):
        if is_model_spec(spec):
            from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver

            return ModelReceiver(spec, topology, rank, params=params, targets=targets)
        from pytest_weightsync.reference_impl.engine.engine_receivers import make_receiver

        return make_receiver(spec, topology, rank, params=params)

    def _release_with(self, token: int, key: int, table: str = "_open"):
        """A weakref callback that drops entry ``token`` of ``table`` (open updates, held
        versions) once one of its parameters dies (never a newer entry that reused the key)."""
        owner = weakref.ref(self)

        def release(_ref):
            entries = getattr(owner(), table, None)
            if entries is not None and getattr(entries.get(key), "token", None) == token:
                del entries[key]
        return release

    def _find_held(self, params):
        entry = self._held.get(id(params))
        if entry is not None and not entry.holds(params):
            del self._held[id(params)]
            entry = None
        return entry

    def weight_version(self, params, *, spec, topology, rank, targets=None):
        """How many updates completed on ``params``; ``None`` while they hold no complete
        version (see the module docstring)."""
        held = self._find_held(params)
        if held is None or not held.usable or self._find_open(params) is not None:
            return None
        return held.completed

    def _find_open(self, params):
        entry = self._open.get(id(params))
        if entry is not None and not entry.holds(params):
            del self._open[id(params)]  # another dict now lives at that id: the old one is gone
            entry = None
        return entry

    def begin_update(self, params, *, format, spec, topology, rank, targets=None) -> None:
        """Open an update (a stream of ``load_weights`` buckets) on ``params``; an update still
        open on any of these parameters is discarded."""
        check_format(format)
        targets = _targets(spec, targets)
        receiver = self._receiver(params, spec, topology, rank, targets)
        receiver.begin_update()
        own = dict(receiver.named_parameters())  # the stored tensors (not planning views)
        tensors = {id(t) for t in own.values()}
        for key, entry in list(self._open.items()):
            if any(id(ref()) in tensors for _, ref in entry.refs):
                del self._open[key]
        token, key = next(self._tokens), id(params)
        release = self._release_with(token, key)
        refs = tuple((name, weakref.ref(tensor, release)) for name, tensor in own.items())
        bound = dict(format=format, spec=spec, topology=topology, rank=rank, targets=targets)
        self._open[key] = _OpenUpdate(receiver.update_state, bound, refs, token)
        held = self._find_held(params)
        if held is None:
            release = self._release_with(token, key, "_held")
            held = self._held[key] = _Held(tuple((name, weakref.ref(tensor, release))
                                                 for name, tensor in own.items()), token)
        held.usable = False  # written in place from now on: no complete version until the end

    def end_update(self, params, *, format, spec, topology, rank, targets=None) -> None:
        """Close the update on ``params``; raises
        :class:`pytest_weightsync.reference_impl.engine.receiver.MissingExpertError` naming every
        (layer, expert, projection) no bucket carried, :class:`UpdateMismatchError` (the update
        stays open) when the arguments are not those of its ``begin_update``."""
        from pytest_weightsync.reference_impl.engine.receiver import IncompleteUpdateError

        entry = self._find_open(params)
        if entry is None:
            raise IncompleteUpdateError("end_update() on params without begin_update()")
        targets = _targets(spec, targets)
        problem = entry.mismatch("end_update", dict(format=format, spec=spec,
                                                    topology=topology, rank=rank, targets=targets))
        if problem is not None:
            raise UpdateMismatchError(problem)
        del self._open[id(params)]
        receiver = self._receiver(params, spec, topology, rank, targets)
        receiver.resume_update(entry.state)
        receiver.end_update()  # raises for an incomplete update: the params stay unusable
        held = self._find_held(params)
        if held is not None:
            held.completed += 1
            held.usable = True

    def load_weights(self, params, payload, *, format, spec, topology, rank, targets=None) -> None:
        """Validate the whole bucket, then copy it into ``params`` in place. ``params`` that do
        not fit the topology raise :class:`pytest_weightsync.reference_impl.engine.receiver.ReceiverParamsError`;
        a bucket for an update begun with other arguments :class:`UpdateMismatchError`."""
        targets = _targets(spec, targets)
        entry = self._find_open(params)
        if entry is not None:
            problem = entry.mismatch("load_weights", dict(format=format, spec=spec,
                                                          topology=topology, rank=rank,
                                                          targets=targets))
            if problem is not None:
                entry.state.count_refused()  # the sender's bucket numbering goes on
                raise UpdateMismatchError(problem)
        receiver = self._receiver(params, spec, topology, rank, targets)
        receiver.plan_cache = self._plan_cache_for(receiver, spec, topology)
        if entry is not None:
            receiver.resume_update(entry.state)
        cached = receiver.plan_cache is not None
        try:
            payload = _decoded(payload)
            _check_payload_type(payload)
            payload = list(payload)
            if not cached:
                _check_format(format, payload, receiver.describe_entry)
        except BaseException:
            receiver.refuse_bucket()
            raise
        load_format = "direct" if format == "direct" else None
        if cached:  # the format check runs unless the cache recognises a bucket that passed it
            receiver.load(payload, load_format=load_format, check_tag=("format", format),
                          check=lambda items: _check_format(format, items, receiver.describe_entry))
        else:
            receiver.load(payload, load_format=load_format)
        held = self._find_held(params) if entry is None else None
        if held is not None:  # a bucket outside an update: written, but no complete version
            held.usable = False

    def sleep(self, params, *, level, spec, topology, rank, targets=None) -> None:
        """Give the memory of ``params`` back, as an engine between updates: level 1 offloads
        a copy first (restored by :meth:`wake_up`), level 2 discards. Here the tensors stay
        allocated (their addresses are kept, as vLLM's allocator re-maps them) and their
        contents are overwritten, as released memory holds anything."""
        import torch

        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}; expected 1 (offload) or 2 (discard)")
        if id(params) in self._asleep:
            raise RuntimeError("sleep() on params that are asleep already; wake_up() first")
        if self._find_open(params) is not None:
            raise RuntimeError("sleep() during an open update; end_update() it first")
        receiver = self._receiver(params, spec, topology, rank, _targets(spec, targets))
        own = dict(receiver.named_parameters())  # what this loader writes (no router weight)
        offloaded = {n: t.detach().clone() for n, t in own.items()} if level == 1 else None
        with torch.no_grad():
            for tensor in own.values():
                if tensor.is_floating_point() and tensor.element_size() > 1:
                    tensor.fill_(float("nan"))
                else:  # FP8 and integer tensors: bytes of zeros
                    tensor.view(torch.uint8).zero_()
        self._asleep[id(params)] = (level, offloaded)

    def wake_up(self, params, *, spec, topology, rank, targets=None) -> None:
        """Take the memory of ``params`` again: after level 1 every tensor holds its bits
        again; after level 2 they hold nothing usable, and no version is complete until a
        complete update (the receiver's ``end_update`` refuses an incomplete one)."""
        if id(params) not in self._asleep:
            raise RuntimeError("wake_up() on params that are not asleep")
        _, offloaded = self._asleep.pop(id(params))
        if offloaded is not None:
            receiver = self._receiver(params, spec, topology, rank, _targets(spec, targets))
            for name, tensor in receiver.named_parameters():
                tensor.detach().copy_(offloaded[name])
            return
        held = self._find_held(params)
        if held is not None:
            held.usable = False

    def open_serving_engine(self, *, spec, version, dialect, seed: int = 0):
        """The reference serving engine (:mod:`pytest_weightsync.reference_impl.serving.engine`)."""
        from pytest_weightsync.reference_impl.serving.engine import ServingEngine

        return ServingEngine(spec, version=version, dialect=dialect, seed=seed)

    def refit_engine(self, engine, buckets, *, version) -> None:
        """The reference refit sequence (:mod:`pytest_weightsync.reference_impl.serving.orchestrator`)."""
        from pytest_weightsync.reference_impl.serving.orchestrator import refit

        refit(engine, buckets, version=version)

    def load_adapter(self, params, slots, payload, *, adapter, topology, rank, slot, layout):
        """The reference adapter loader (:mod:`pytest_weightsync.reference_impl.engine.adapter_receiver`)."""
        from pytest_weightsync.reference_impl.engine.adapter_receiver import load_adapter

        load_adapter(params, slots, payload, adapter=adapter, topology=topology, rank=rank,
                     slot=slot, layout=layout)

    def evict_adapter(self, slots, *, adapter, topology, rank, slot, layout):
        from pytest_weightsync.reference_impl.engine.adapter_receiver import evict_adapter

        evict_adapter(slots, slot=slot)

    def export_adapter(self, trainer_states, *, adapter, trainer, receiver, rank,
                       bucket_bytes=None):
        """The reference adapter exporter (:mod:`pytest_weightsync.reference_impl.senders.adapter_export`)."""
        from pytest_weightsync.reference_impl.senders.adapter_export import export_adapter

        return export_adapter(trainer_states, adapter=adapter, trainer=trainer, receiver=receiver,
                              rank=rank, bucket_bytes=bucket_bytes)

    def merge_adapter(self, base, tensors, *, adapter):
        """The merged path (:mod:`pytest_weightsync.reference_impl.senders.adapter_merge`)."""
        from pytest_weightsync.reference_impl.senders.adapter_merge import merge_adapter

        return merge_adapter(base, tensors, adapter=adapter)

    def export_weights(self, trainer_states, *, format, spec, trainer, receiver, rank):
        """Gather the full expert weights from every trainer rank's shards, then build the
        ``format`` payload receiver ``rank`` gets (one bucket); a direct payload that is
        exactly trainer rank ``rank``'s shards (``distributed_export.shards_are_engine_params``)
        is taken from that rank alone, nothing gathered."""
        from pytest_weightsync.reference_impl.senders import formats as senders
        from pytest_weightsync.reference_impl.trainer.trainer import gather_full_weights

        check_format(format)
        if is_model_spec(spec):
            from pytest_weightsync.reference_impl.trainer import megatron_model
            from pytest_weightsync.reference_impl.senders import model_senders

            weights = megatron_model.gather_model(spec, trainer, trainer_states)
            return model_senders.export(format, spec, receiver, rank, weights)
        from pytest_weightsync.reference_impl.senders import distributed_export as dist_export

        if (format == "direct" and len(trainer_states) == trainer.world_size
                and rank < trainer.world_size
                and dist_export.shards_are_engine_params(spec, trainer, receiver)):
            # trainer rank `rank` feeds engine rank `rank` and holds exactly its parameters
            # (a wrong number of states goes on to the gather, which names it)
            return dist_export.local_direct_payload(spec, trainer_states[rank], trainer)
        return senders.export(format, spec, receiver, rank,
                              gather_full_weights(spec, trainer, trainer_states))

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer, receiver,
                                   delivery, bucket_bytes, model=None, engine=None):
        """Run in every trainer rank: gather over Megatron's TP/EP/ETP/PP groups, then send on
        :attr:`transport` (:mod:`pytest_weightsync.reference_impl.senders.distributed_export`; whole
        models: :mod:`pytest_weightsync.reference_impl.senders.distributed_model_export`; ``engine``:
        where a broadcast goes, :mod:`pytest_weightsync.transports.broadcast`)."""
        check_format(format)
        kwargs = dict(config=config, format=format, spec=spec, trainer=trainer,
                      receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes)
        if is_model_spec(spec):  # whole models travel as (name, tensor) pairs
            from pytest_weightsync.reference_impl.senders import distributed_model_export

            return distributed_model_export.export_weights_distributed(model_state, model=model,
                                                                       **kwargs)
        from pytest_weightsync.reference_impl.senders.distributed_export import export_weights_distributed

        return export_weights_distributed(model_state, transport=self.transport, engine=engine,
                                          **kwargs)
