"""The serving control planes of SGLang 0.5.23 and vLLM 0.33.0, as plain data.

A refit under load breaks around the copy, not in it: what a pause does with the requests in
flight and their KV, whether a cache flush is refused while requests live, what a weight
update does when its flush is refused, whether publishing a version label ends requests, and
which version a token is reported with. The reference engine model
(``reference_impl/serving/``) reads its rules from here instead of restating them, and
``suites/selftest/test_control_plane_source.py`` holds every value to the pinned source - SGLang
as installed, vLLM from its wheel (:mod:`~pytest_weightsync.reference_impl.backends.vllm`) - so
a rule cannot drift from the engine it models. Each fact names where it comes from
(:class:`Source`: a file under ``sglang/srt/`` or ``vllm/``, and the function or class).

Where the pinned source differs from the public reports the project issue cites, the pinned
source wins and the docstring says so: SGLang 0.5.23 ignores waiting requests that hold no KV
when a *paused* scheduler flushes, and a refused flush after an update fails the update call
instead of asserting (the scheduler-killing ``assert flush_cache_success`` of sglang#33784 is
not in 0.5.23); per-token version spans (not an admission-time label) are what 0.5.23 reports.
Nothing here imports torch or an engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class Source:
    """Where a fact is read: ``file`` relative to the package root (``sglang/srt/...`` or
    ``vllm/...``) and the qualified name of the function, method or class."""

    file: str
    name: str


class InFlight(str, enum.Enum):
    """What a pause does with a request that is being generated."""

    ABORTED = "aborted"  # finished with an abort reason, no later token
    RETRACTED = "retracted"  # back to the waiting queue, its KV freed, recomputed on resume
    KEPT = "kept"  # stays with its KV; continues on resume with the old KV
    DRAINED = "drained"  # keeps being scheduled until it finishes; the pause waits for it


@dataclass(frozen=True)
class PauseModeRule:
    """One pause mode: what happens to requests in flight, whether the scheduler still steps
    while paused, whether new requests are refused, and the code that does it."""

    mode: str
    in_flight: InFlight
    steps_while_paused: bool
    rejects_new_requests: bool
    source: Source


# ---------------------------------------------------------------------------------------------
# SGLang 0.5.23
# ---------------------------------------------------------------------------------------------

_IO = "sglang/srt/managers/io_struct.py"
_SCHED = "sglang/srt/managers/scheduler.py"
_TM = "sglang/srt/managers/tokenizer_manager.py"
_TCM = "sglang/srt/managers/tokenizer_control_mixin.py"
_WU = "sglang/srt/managers/scheduler_components/weight_updater.py"
_WV = "sglang/srt/utils/weight_versions.py"
_HTTP = "sglang/srt/entrypoints/http_server.py"

#: ``PauseGenerationReqInput.mode: Literal["abort", "retract", "in_place"] = "abort"``.
SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")
SGLANG_DEFAULT_PAUSE_MODE = "abort"
SGLANG_PAUSE_REQUEST = Source(_IO, "PauseGenerationReqInput")

#: ``abort`` never reaches the scheduler: the tokenizer manager aborts every request
#: (``abort_request(abort_all=True)``) until ``model_update_lock`` is free;
#: ``Scheduler.pause_generation`` asserts the mode is one of these.
SGLANG_SCHEDULER_PAUSE_MODES = ("in_place", "retract")
SGLANG_SCHEDULER_PAUSE = Source(_SCHED, "Scheduler.pause_generation")

#: In every mode a paused engine generates nothing and refuses no new request: the scheduler
#: loop skips batching while ``_engine_paused``, and ``generate_request`` waits on
#: ``is_pause_cond`` until ``continue_generation`` (the request is held, not rejected).
SGLANG_PAUSED_LOOPS = (Source(_SCHED, "Scheduler.event_loop_normal"),
                       Source(_SCHED, "Scheduler.event_loop_overlap"))
SGLANG_NEW_REQUESTS_WAIT = Source(_TM, "TokenizerManager.generate_request")
SGLANG_PAUSE_MODE_RULES = {
    "abort": PauseModeRule("abort", InFlight.ABORTED, False, False,
                           Source(_TM, "TokenizerManager.pause_generation")),
    # retract_all frees the requests' KV (req_pool_idx released), running_batch.reqs = [],
    # each request is put back with _add_request_to_queue.
    "retract": PauseModeRule("retract", InFlight.RETRACTED, False, False,
                             Source(_SCHED, "Scheduler.pause_generation")),
    # Only _engine_paused is set; running_batch / last_batch / chunked_req stay untouched.
    "in_place": PauseModeRule("in_place", InFlight.KEPT, False, False,
                              Source(_SCHED, "Scheduler.pause_generation")),
}

#: ``continue_generation`` clears ``_engine_paused``; it does not refuse an engine that was
#: never paused (``Scheduler.continue_generation``, ``TokenizerManager.continue_generation``).
SGLANG_CONTINUE_WITHOUT_PAUSE_REFUSED = False
SGLANG_CONTINUE = Source(_SCHED, "Scheduler.continue_generation")

#: ``Scheduler.flush_cache`` flushes only when ``is_fully_idle(ignore_waiting=paused)``.
#: Idle (non-disaggregated): these are empty / None ...
SGLANG_FLUSH_IDLE_REQUIRES_EMPTY = ("running_batch", "chunked_req", "last_batch", "waiting_queue",
                                    "grammar_queue")
#: ... except that while paused a waiting request blocks the flush only if it holds KV
#: (``req.kv.holds_kv``, i.e. a request-pool row): retracted requests hold none.
SGLANG_FLUSH_IGNORES_KV_FREE_WAITING_WHILE_PAUSED = True
SGLANG_IDLE_RULE = Source(_SCHED, "Scheduler.is_fully_idle")
#: Refused: ``flush_cache`` returns ``False`` (logs "Cache not flushed because there are
#: pending requests"); it raises nothing and the caches stay.
SGLANG_FLUSH_REFUSAL_RETURNS = False
SGLANG_FLUSH = Source(_SCHED, "Scheduler.flush_cache")
#: So, paused: flushing after ``retract`` is accepted, after ``in_place`` refused (the running
#: batch keeps its requests); unpaused with queued or running requests, refused.
SGLANG_FLUSH_ACCEPTED_AFTER_PAUSE = {"retract": True, "in_place": False}

#: Every ``update_weights_*`` request flushes after loading by default.
SGLANG_UPDATE_FLUSH_CACHE_DEFAULT = {
    "UpdateWeightFromDiskReqInput": True,
    "UpdateWeightsFromDistributedReqInput": True,
    "UpdateWeightsFromTensorReqInput": True,
    "UpdateWeightsFromIPCReqInput": True,
}
#: ... and does not abort requests first unless asked (the IPC request has no such field).
SGLANG_UPDATE_ABORT_ALL_DEFAULT = {
    "UpdateWeightFromDiskReqInput": False,
    "UpdateWeightsFromDistributedReqInput": False,
    "UpdateWeightsFromTensorReqInput": False,
}
SGLANG_UPDATE_REQUESTS = Source(_IO, "UpdateWeightsFrom*ReqInput")

#: A flush refused after an update: the weights stay updated (and the version recorded), the
#: update call returns ``success=False`` with this message. No assert: the scheduler lives
#: (sglang#33784's ``assert flush_cache_success`` is not in 0.5.23).
SGLANG_REFUSED_FLUSH_AFTER_UPDATE_MESSAGE = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache.")
SGLANG_REFUSED_FLUSH_KILLS_SCHEDULER = False
SGLANG_FLUSH_AFTER_UPDATE = Source(
    _WU, "SchedulerWeightUpdaterManager.flush_cache_after_weight_update")
#: Order inside ``update_weights_from_tensor`` / ``_distributed``: load, then (on success)
#: record the new version, then flush. A failed load records no version.
SGLANG_UPDATE_ORDER = ("load", "record_weight_version_after_update",
                       "flush_cache_after_weight_update")
SGLANG_UPDATE_HANDLER = Source(_WU, "SchedulerWeightUpdaterManager.update_weights_from_tensor")
#: ``update_weights_from_distributed`` / ``_tensor`` outside ``begin_weight_update()`` ..
#: ``end_weight_update()`` fail (``success=False``) without loading.
SGLANG_UPDATE_NEEDS_SESSION = ("update_weights_from_distributed", "update_weights_from_tensor")

#: ``UpdateWeightVersionReqInput.abort_all_requests = True``: publishing a label aborts every
#: request unless told not to (miles#2296). The abort is done by the HTTP endpoint
#: (``/update_weight_version``); the tokenizer manager's ``update_weight_version``
#: (``TokenizerControlMixin``) aborts nothing itself.
SGLANG_VERSION_PUBLISH_ABORTS_BY_DEFAULT = True
SGLANG_VERSION_PUBLISH_REQUEST = Source(_IO, "UpdateWeightVersionReqInput")
SGLANG_VERSION_PUBLISH_ABORT_SITE = Source(_HTTP, "update_weight_version")
SGLANG_VERSION_PUBLISH_TOKENIZER = Source(_TCM, "TokenizerControlMixin.update_weight_version")

#: Versions per token (sglang#34185's admission-time capture is not how 0.5.23 labels): at a
#: version change the scheduler appends ``WeightVersionEvent(old_version, len(output_ids))`` to
#: every live request that has output tokens (one without tokens yet records nothing - all its
#: tokens get the new label); a request's output carries spans ``(version, start, end)`` and
#: ``meta_info["weight_version"]`` is the last span's version, else the tokenizer's current
#: label when the output is built - never the label at admission.
SGLANG_VERSION_GRANULARITY = "token_spans"
SGLANG_VERSION_EVENT_NEEDS_OUTPUT_TOKENS = True
SGLANG_VERSION_CHANGE = Source(_SCHED, "Scheduler.record_weight_version_change")
SGLANG_VERSION_SPANS = Source(_WV, "compute_weight_version_spans")
SGLANG_VERSION_META_INFO = Source(_WV, "add_weight_versions_to_meta_info")
SGLANG_VERSION_LABEL_READ_AT = "output"
SGLANG_VERSION_LABEL_SOURCE = Source(_TM, "TokenizerManager._handle_batch_output")

# ---------------------------------------------------------------------------------------------
# vLLM 0.33.0
# ---------------------------------------------------------------------------------------------

_ASYNC = "vllm/v1/engine/async_llm.py"
_CORE = "vllm/v1/engine/core.py"
_VSCHED = "vllm/v1/core/sched/scheduler.py"
_POOL = "vllm/v1/core/block_pool.py"

#: ``PauseMode = Literal["abort", "wait", "keep"]`` (``vllm/v1/engine/__init__.py``).
VLLM_PAUSE_MODES = ("abort", "wait", "keep")
VLLM_PAUSE_MODE_TYPE = Source("vllm/v1/engine/__init__.py", "PauseMode")
#: ``AsyncLLM.pause_generation(*, mode="abort", clear_cache=True)``.
VLLM_DEFAULT_PAUSE_MODE = "abort"
VLLM_CLEAR_CACHE_DEFAULT = True
VLLM_PAUSE = Source(_ASYNC, "AsyncLLM.pause_generation")

#: ``EngineCoreProc.pause_scheduler`` / ``pause_generation``: abort finishes every request
#: (FINISHED_ABORTED) and sets PAUSED_NEW; wait sets PAUSED_NEW (running and KV-holding
#: requests keep stepping until drained); keep sets PAUSED_ALL (nothing is scheduled). New
#: requests are rejected (``reject_new_requests = mode != "keep"``) until resume.
_VLLM_PAUSE = Source(_CORE, "EngineCoreProc.pause_scheduler")
#: mode: (what it does to a request in flight, steps while paused, rejects new requests).
VLLM_PAUSE_MODE_RULES = {mode: PauseModeRule(mode, in_flight, steps, rejects, _VLLM_PAUSE)
                         for mode, (in_flight, steps, rejects) in (
                             ("abort", (InFlight.ABORTED, False, True)),
                             ("wait", (InFlight.DRAINED, True, True)),
                             ("keep", (InFlight.KEPT, False, False)))}
VLLM_PAUSE_STATES = {"abort": "PAUSED_NEW", "wait": "PAUSED_NEW", "keep": "PAUSED_ALL"}
#: An unknown mode: ``ValueError("Invalid pause mode: ...")``.
VLLM_UNKNOWN_MODE_ERROR = ValueError

#: ``clear_cache=True``: once the pause completes, ``_finish_pause`` calls ``_reset_caches``,
#: which resets the prefix cache with ``reset_running_requests=True`` - requests still running
#: (``keep``) are preempted back to waiting, their KV dropped and recomputed on resume - and
#: raises ``RuntimeError`` when the reset fails.
VLLM_CLEAR_CACHE_PREEMPTS_RUNNING = True
VLLM_CLEAR_CACHE = Source(_CORE, "EngineCore._reset_caches")

#: ``resume_generation`` -> ``resume_scheduler``: UNPAUSED, new requests accepted again; it
#: does not refuse an engine that was not paused.
VLLM_RESUME_WITHOUT_PAUSE_REFUSED = False
VLLM_RESUME = Source(_CORE, "EngineCoreProc.resume_scheduler")

#: ``reset_prefix_cache(reset_running_requests=False)`` refuses while any KV block but the
#: null block is in use - i.e. while requests run: it returns ``False`` (a logged warning, no
#: error), so a caller that ignores the result recomputes nothing (NeMo-RL#3839).
VLLM_RESET_PREFIX_RESET_RUNNING_DEFAULT = False
VLLM_RESET_PREFIX_REFUSAL_RETURNS = False
VLLM_RESET_PREFIX = Source(_VSCHED, "Scheduler.reset_prefix_cache")
VLLM_RESET_PREFIX_RULE = Source(_POOL, "BlockPool.reset_prefix_cache")

__all__ = [name for name in dir() if name.isupper() and not name.startswith("_")] + [
    "InFlight", "PauseModeRule", "Source"]
