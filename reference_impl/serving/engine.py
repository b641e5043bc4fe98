"""The reference serving engine: a scheduler, a prefix cache and a control plane around a refit.

A small CPU model (:mod:`pytest_weightsync.reference_impl.oracle.token_forward`, over the
engine's own parameters read back by :mod:`.weights_view`) served the way SGLang and vLLM serve:
requests wait, are admitted, prefilled (reusing cached prefix blocks) and decoded one token per
:meth:`ServingEngine.step`, greedily, with the log-prob of every token and the label of the
weights that computed it. Updates land through the reference's whole-model receiver
(:class:`~pytest_weightsync.reference_impl.engine.model_receiver.ModelReceiver`), in place.

The control plane speaks both dialects (``dialect="sglang"`` or ``"vllm"``; the rules and their
sources are :mod:`pytest_weightsync.reference_impl.backends.control_plane`):

* ``pause_generation(mode)``: SGLang's ``abort`` (every request ended, reason given),
  ``retract`` (running requests back to the waiting queue, their KV dropped and recomputed under
  the weights of the resume) and ``in_place`` (requests keep their KV; nothing runs); vLLM's
  ``abort``, ``wait`` (in-flight requests run to the end first) and ``keep`` (as ``in_place``),
  with ``clear_cache`` resetting the prefix cache once paused;
* ``continue_generation()`` / ``resume_generation()``; either without a pause is refused;
* ``flush_cache()`` / ``reset_prefix_cache()``: ``False`` while a running request holds cached
  KV. Unlike SGLang 0.5.23 the reference also flushes after ``retract`` (the retracted
  requests hold no KV), where SGLang's ``is_fully_idle`` rule refuses and its update's
  ``assert flush_cache_success`` kills the scheduler (sglang#33784);
* ``update_weights(buckets, load_format=None, flush_cache=True, weight_version=None)``: the
  flush is decided before anything is written (refused with :class:`FlushRefused` while requests
  hold KV); the label is published when the update completes, never before; an update without a
  label leaves none (``weight_version`` is ``None``: the weights' version is unknown) until one
  is published;
* ``update_weight_version(new_version, abort_all_requests=True)``: SGLang's default ends every
  in-flight request; ``abort_all_requests=False`` publishes the label only (miles#2296).

Misuse (an unknown mode, a resume without a pause, a step during an update) raises a
:class:`ServingError` and leaves the engine usable.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Optional

from pytest_weightsync.reference_impl.backends import control_plane as rules
from pytest_weightsync.reference_impl.engine.model_receiver import ModelReceiver
from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
from pytest_weightsync.reference_impl.oracle import token_forward
from pytest_weightsync.reference_impl.oracle.token_forward import KVCache
from pytest_weightsync.reference_impl.serving.prefix_cache import PrefixCache
from pytest_weightsync.reference_impl.serving.weights_view import engine_weights

__all__ = ["DEFAULT_PAUSE_MODE", "DIALECTS", "FlushRefused", "PAUSE_RULES", "Request",
           "ServingEngine", "ServingError"]

#: The control planes the engine speaks.
DIALECTS = ("sglang", "vllm")
#: Each dialect's pause modes and what each does with a request in flight (the facts, with
#: their sources, are ``control_plane``'s).
PAUSE_RULES = {"sglang": rules.SGLANG_PAUSE_MODE_RULES, "vllm": rules.VLLM_PAUSE_MODE_RULES}
DEFAULT_PAUSE_MODE = {"sglang": rules.SGLANG_DEFAULT_PAUSE_MODE,
                      "vllm": rules.VLLM_DEFAULT_PAUSE_MODE}


class ServingError(WeightSyncError):
    """Misuse of a serving engine's control plane: refused, the engine still usable."""


class FlushRefused(ServingError):
    """A cache flush asked for while running requests hold cached KV."""


@dataclass
class Request:
    """One request as the engine reports it: ``output`` tokens, the ``logprobs`` of each (the
    float32 value, exactly), ``token_versions`` (the label of the weights that computed each
    output token), ``prompt_versions`` (the label of the weights whose KV each prompt token
    holds now - a reused prefix keeps its own), ``cached_tokens`` (prompt tokens reused from
    the prefix cache at the last prefill), ``status`` (``waiting``, ``running``, ``finished``,
    ``aborted``) and ``abort_reason``."""

    rid: str
    prompt: tuple
    max_new_tokens: int
    output: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    token_versions: list = field(default_factory=list)
    prompt_versions: list = field(default_factory=list)
    cached_tokens: int = 0
    status: str = "waiting"
    abort_reason: Optional[str] = None
    retractions: int = 0
    cache: Optional[KVCache] = field(default=None, repr=False)
    blocks: list = field(default_factory=list, repr=False)

    @property
    def done(self) -> bool:
        return self.status in ("finished", "aborted")


class ServingEngine:
    """One engine process serving a model of ``spec`` (attention-only MoE), its weights at
    ``version`` (also the first published label) - see the module."""

    def __init__(self, spec, *, version=1, seed: int = 0, dialect: str = "sglang",
                 block_size: int = 4, max_running: int = 8, prefix_caching: bool = True):
        if dialect not in DIALECTS:
            raise ServingError(f"dialect {dialect!r}; expected one of {DIALECTS}")
        token_forward.check_modelled(spec)
        self.spec, self.seed, self.dialect = spec, seed, dialect
        self.topo = ReceiverTopology(tp=1)
        self.receiver = ModelReceiver(spec, self.topo, 0)
        self.prefix = PrefixCache(block_size) if prefix_caching else None
        self.max_running = max_running
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.requests: dict = {}
        self.paused: Optional[str] = None
        self.updating = False
        self._ids = itertools.count()
        self.label = None
        self.update_weights(initial_update(spec, version, seed), weight_version=version)

    # -- what the engine reports ------------------------------------------------------------

    @property
    def weight_version(self):
        """The published label of the weights (``None``: not known)."""
        return self.label

    @property
    def pause_modes(self) -> tuple:
        return tuple(PAUSE_RULES[self.dialect])

    def request(self, rid: str) -> Request:
        try:
            return self.requests[rid]
        except KeyError:
            raise ServingError(f"no request {rid!r}") from None

    @property
    def in_flight(self) -> list:
        return [r for r in self.requests.values() if not r.done]

    # -- requests -------------------------------------------------------------------------

    def submit(self, prompt, max_new_tokens: int) -> str:
        """Queue a request; its id."""
        prompt = tuple(int(t) for t in prompt)
        if not prompt or not all(0 <= t < self.spec.vocab for t in prompt):
            raise ServingError(f"a prompt is a non-empty sequence of tokens in "
                               f"range({self.spec.vocab}), got {prompt!r:.80}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ServingError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if self.paused is not None and PAUSE_RULES[self.dialect][self.paused].rejects_new_requests:
            raise ServingError(f"paused ({self.dialect} mode {self.paused!r}): new requests are "
                               f"refused until the engine resumes")
        rid = f"req-{next(self._ids)}"
        self.requests[rid] = Request(rid, prompt, max_new_tokens)
        self.waiting.append(self.requests[rid])
        return rid

    def step(self) -> int:
        """One scheduler iteration: admit and prefill what fits, decode one token of every
        running request. Nothing runs while paused. The tokens produced."""
        if self.updating:
            raise ServingError("the scheduler runs no batch while a weight update is open")
        if self.paused is not None:
            return 0
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.popleft()
            self.running.append(request)
            self._prefill(request)
            admitted.append(request)
            self._finish_if_done(request)
        decoded = [r for r in self.running if r not in admitted]
        for request in decoded:
            self._decode(request)
            self._finish_if_done(request)
        return len(admitted) + len(decoded)

    def run(self, max_steps: int = 10_000) -> None:
        """Step until nothing is in flight (or paused)."""
        for _ in range(max_steps):
            if not (self.waiting or self.running) or self.paused is not None:
                return
            self.step()
        raise ServingError(f"still running after {max_steps} steps")

    def _weights(self):
        return self._view

    def _token_label(self, request: Request):
        """The label a token computed now carries."""
        return self.label

    def _prefill(self, request: Request) -> None:
        """Compute (or reuse) the KV of everything the request has seen, and its next token."""
        cache = KVCache()
        sequence = list(request.prompt) + list(request.output)
        blocks = self._reusable(sequence)
        if self.prefix is not None:
            PrefixCache.lock(blocks)
        for block in blocks:
            for layer, (keys, values) in enumerate(zip(block.keys, block.values)):
                if layer == len(cache.keys):
                    cache.keys.append([])
                    cache.values.append([])
                cache.keys[layer].extend(keys)
                cache.values[layer].extend(values)
            cache.versions.extend(block.versions)
        request.blocks, request.cache = blocks, cache
        request.cached_tokens = len(cache)
        request.status = "running"
        label, logprobs = self._token_label(request), None
        for token in sequence[len(cache):]:
            logprobs = token_forward.step(self._weights(), token, cache, label)
        request.prompt_versions = list(cache.versions[:len(request.prompt)])
        self._emit(request, logprobs, label)

    def _reusable(self, sequence) -> list:
        """The cached blocks a prefill of ``sequence`` reuses."""
        return [] if self.prefix is None else self.prefix.match(sequence)

    def _decode(self, request: Request) -> None:
        label = self._token_label(request)
        logprobs = token_forward.step(self._weights(), request.output[-1], request.cache, label)
        self._emit(request, logprobs, label)

    def _emit(self, request: Request, logprobs, label) -> None:
        token = int(logprobs.argmax())
        request.output.append(token)
        request.logprobs.append(float(logprobs[token]))
        request.token_versions.append(label)

    def _finish_if_done(self, request: Request) -> None:
        if len(request.output) < request.max_new_tokens:
            return
        if self.prefix is not None:
            fed = list(request.prompt) + list(request.output[:-1])
            cache = request.cache
            self.prefix.insert(fed, cache.keys, cache.values, cache.versions)
        self._release(request, "finished")

    def _release(self, request: Request, status: str, reason: Optional[str] = None) -> None:
        if self.prefix is not None:
            PrefixCache.unlock(request.blocks)
        request.blocks, request.cache = [], None
        request.status, request.abort_reason = status, reason
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def abort_all(self, reason: str) -> list:
        """End every in-flight request with ``reason``; their ids."""
        ended = [r.rid for r in self.in_flight]
        for request in list(self.running) + list(self.waiting):
            self._release(request, "aborted", reason)
        return ended

    # -- control plane --------------------------------------------------------------------

    def pause_generation(self, mode: Optional[str] = None, *, clear_cache: Optional[bool] = None):
        """Pause as ``mode`` says (the dialect's default when ``None``)."""
        mode = DEFAULT_PAUSE_MODE[self.dialect] if mode is None else mode
        if mode not in self.pause_modes:
            raise ServingError(f"pause mode {mode!r}; {self.dialect} has {self.pause_modes}")
        if clear_cache is not None and self.dialect != "vllm":
            raise ServingError("clear_cache is vLLM's pause option; SGLang flushes with "
                               "flush_cache()")
        if self.paused is not None:
            raise ServingError(f"pause_generation({mode!r}) while paused ({self.paused!r})")
        behaviour = PAUSE_RULES[self.dialect][mode].in_flight
        if behaviour == rules.InFlight.ABORTED:
            self.abort_all(f"aborted by pause_generation(mode={mode!r})")
        elif behaviour == rules.InFlight.DRAINED:
            self.run()
        elif behaviour == rules.InFlight.RETRACTED:
            self._retract_running()
        self.paused = mode
        clear = rules.VLLM_CLEAR_CACHE_DEFAULT if clear_cache is None else clear_cache
        if self.dialect == "vllm" and clear:
            if rules.VLLM_CLEAR_CACHE_PREEMPTS_RUNNING:  # their KV goes with the cache
                self._retract_running()
            self.flush_cache()

    def _retract_running(self) -> None:
        for request in reversed(list(self.running)):
            self._retract(request)

    def _retract(self, request: Request) -> None:
        """Back to the front of the waiting queue, its KV dropped (recomputed at resume)."""
        if self.prefix is not None:
            PrefixCache.unlock(request.blocks)
        request.blocks, request.cache = [], None
        request.status = "waiting"
        request.retractions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def continue_generation(self) -> None:
        if self.paused is None:
            raise ServingError("continue_generation without pause_generation")
        self.paused = None

    resume_generation = continue_generation

    def _flush_problem(self) -> Optional[str]:
        """Why the prefix cache cannot be flushed now (``None``: it can)."""
        holding = [r.rid for r in self.running if r.cache is not None]
        if holding:
            return (f"running requests {holding} hold KV (pause with 'retract' or 'abort', or "
                    f"let them finish)")
        return None if self.prefix is None else self.prefix.flush_problem()

    def flush_cache(self) -> bool:
        """Drop every cached prefix block; ``False`` (nothing dropped) while requests hold KV."""
        if self._flush_problem() is not None:
            return False
        if self.prefix is not None:
            self.prefix.flush()
        return True

    def reset_prefix_cache(self) -> bool:
        """vLLM's name for :meth:`flush_cache`: ``False`` while requests run."""
        return self.flush_cache()

    def update_weights(self, buckets, *, load_format: Optional[str] = None,
                       flush_cache: bool = True, weight_version=None) -> None:
        """Load a complete update (an iterable of buckets) in place; flush the prefix cache
        first when asked (refused before anything is written while requests hold KV); publish
        ``weight_version`` once the update completed."""
        if self.updating:
            raise ServingError("a weight update is already open")
        if flush_cache:
            problem = self._flush_problem()
            if problem is not None:
                raise FlushRefused(f"update_weights(flush_cache=True) refused before loading: "
                                   f"{problem}; pass flush_cache=False to keep their KV")
        self.updating = True
        self.label = None if weight_version is None else self._label_while_open(weight_version)
        try:
            self.receiver.begin_update()
            for bucket in buckets:
                self.receiver.load(list(bucket), load_format)
            self.receiver.end_update()
        except BaseException:
            self.label = None  # what the parameters hold is no complete version
            raise
        finally:
            self.updating = False
            self._view = engine_weights(self.spec, self.topo, self.receiver.params)
        if flush_cache:
            self.flush_cache()
        self._publish_after_update(weight_version)

    def _label_while_open(self, weight_version):
        """The label while an update to ``weight_version`` is open: the last complete one,
        never the new one."""
        return self.label

    def _publish_after_update(self, weight_version) -> None:
        self.label = weight_version

    def update_weight_version(self, new_version, abort_all_requests: Optional[bool] = None
                              ) -> None:
        """Publish ``new_version``; with ``abort_all_requests`` (SGLang's default) every
        in-flight request is ended first."""
        if abort_all_requests is None:
            abort_all_requests = rules.SGLANG_VERSION_PUBLISH_ABORTS_BY_DEFAULT
        if abort_all_requests:
            self.abort_all(f"aborted by update_weight_version({new_version!r}, "
                           f"abort_all_requests=True)")
        self.label = new_version


def initial_update(spec, version, seed: int = 0) -> list:
    """The first update of an engine: the whole model at ``version`` in one ``compat``
    bucket."""
    from pytest_weightsync.reference_impl.oracle import model_synth
    from pytest_weightsync.reference_impl.senders import model_senders

    return [model_senders.export("compat", spec, ReceiverTopology(tp=1), 0,
                                 model_synth.full_model(spec, version, seed))]
