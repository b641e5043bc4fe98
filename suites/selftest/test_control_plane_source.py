"""The control-plane facts (``reference_impl/backends/control_plane.py``) equal the pinned source.

The reference engine model reads its pause, flush, update and version rules from those facts;
each test here reads the code the fact names - SGLang 0.5.23 as installed, vLLM 0.33.0 from
its wheel (:mod:`suites.selftest.vllm_source`) - and asserts the fact equals it. Dataclass
defaults are read from the real request classes; handlers are compiled from the real source
text (SGLang's scheduler module does not import here: it needs ``setproctitle``) and run on
stand-ins for the scheduler or engine around them, so a rule is checked by what the code does,
not by what its comments say. ``test_a_changed_fact_is_caught`` shows that a wrong value of a
fact would fail.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import enum
import functools
import importlib.util
import re
import time
import typing
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_weightsync.reference_impl.backends import control_plane as cp
from pytest_weightsync.suites.selftest import vllm_source as vsrc

_NO_SGLANG = ""
try:
    import msgspec
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import io_struct as io
except Exception as exc:  # noqa: BLE001 - any import failure means "no SGLang to read"
    io, _NO_SGLANG = None, f"sglang {cp.SGLANG_VERSION} is not importable ({exc})"

#: The SGLang checks read the installed package; the vLLM checks only need the wheel.
needs_sglang = pytest.mark.skipif(io is None, reason=_NO_SGLANG)


# ---- Reading SGLang's source -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sglang_tree(file: str) -> ast.Module:
    """The AST of ``file`` (``sglang/srt/...``) of the installed SGLang, read, not imported."""
    path = Path(importlib.util.find_spec("sglang").origin).parent.parent / file
    return ast.parse(path.read_text(), str(path))


def _sglang_def(source: cp.Source) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The definition ``source.name`` (``Class.method`` or ``function``) in ``source.file``."""
    *owner, name = source.name.split(".")
    body = _sglang_tree(source.file).body
    if owner:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner[0]).body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"sglang {cp.SGLANG_VERSION}: no {source.name} in {source.file}")


def _sglang_function(source: cp.Source, namespace: dict):
    """``source``'s function compiled from SGLang's text into ``namespace`` (annotations and
    decorators dropped: they name types this test does not provide)."""
    node = copy.deepcopy(_sglang_def(source))
    node.decorator_list = []
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sub.returns = None
            for arg in sub.args.posonlyargs + sub.args.args + sub.args.kwonlyargs:
                arg.annotation = None
    module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    exec(compile(module, f"<sglang {cp.SGLANG_VERSION} {source.file}>", "exec"), namespace)
    return namespace[node.name]


def _default(cls, field: str):
    return {f.name: f for f in msgspec.structs.fields(cls)}[field].default


def _calls(node, attr: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and getattr(c.func, "attr", getattr(c.func, "id", None)) == attr]


class _Recorder:
    """Any attribute is a callable that records its call and returns ``None``."""

    def __init__(self, log: list, prefix: str = ""):
        self._log, self._prefix = log, prefix

    def __getattr__(self, name):
        return lambda *a, **k: self._log.append((self._prefix + name, a, k))


class _Batch(SimpleNamespace):
    def is_empty(self):
        return not self.reqs


# ---- SGLang: pause / continue ----------------------------------------------------------------

def _sglang_pause_modes():
    field = {f.name: f for f in msgspec.structs.fields(io.PauseGenerationReqInput)}["mode"]
    return typing.get_args(field.type), field.default


@needs_sglang
def test_sglang_pause_modes_and_default():
    """``PauseGenerationReqInput.mode`` (io_struct.py): its Literal and its default."""
    assert cp.SGLANG_PAUSE_REQUEST.name == io.PauseGenerationReqInput.__name__
    assert _sglang_pause_modes() == (cp.SGLANG_PAUSE_MODES, cp.SGLANG_DEFAULT_PAUSE_MODE)
    assert set(cp.SGLANG_PAUSE_MODE_RULES) == set(cp.SGLANG_PAUSE_MODES)


def _scheduler(**state):
    log = []
    sched = SimpleNamespace(
        _engine_paused=False, _pause_started_at=None, enable_overlap=False,
        enable_overlap_mlx=False, last_batch=None, chunked_req=None,
        disaggregation_mode=DisaggregationMode.NULL, decode_offload_manager=None,
        running_batch=_Batch(reqs=[], batch_is_full=True), waiting_queue=[],
        req_to_token_pool=_Recorder(log, "req_pool."), tree_cache=_Recorder(log, "tree."),
        token_to_kv_pool_allocator=_Recorder(log, "kv_pool."),
        hisparse_coordinator=None, cur_batch_for_debug=None, enable_hisparse=False,
        enable_hierarchical_cache=False, enable_lmcache=False,
        metrics_reporter=SimpleNamespace(current_scheduler_metrics_enabled=False,
                                         last_gen_throughput=1.0, is_stats_logging_rank=False,
                                         reset_metrics=lambda: None),
        kv_events_publisher=_Recorder(log), result_queue=[], draft_worker=None,
        dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False),
        grammar_manager=SimpleNamespace(grammar_queue=[], clear=lambda: None),
        _pp_microbatches_drained=lambda: True, log=log)
    vars(sched).update(state)
    sched._add_request_to_queue = lambda req: sched.waiting_queue.append(req)
    return sched


def _req(rid, holds_kv=True, output_ids=()):
    return SimpleNamespace(rid=rid, finished=lambda: False, output_ids=list(output_ids),
                           kv=SimpleNamespace(holds_kv=holds_kv), weight_version_events=[])


def _sglang_pause(sched, mode):
    def retract_all(reqs, **kwargs):
        # What the real one does to each request (release_req -> release_kv_cache ->
        # tree_cache.free_kv_row): its KV row freed; test_..._requeues_without_kv checks that.
        sched.log.append(("retract_all", tuple(r.rid for r in reqs)))
        for r in reqs:
            r.kv.holds_kv = False
    ns = {"retract_all": retract_all, "DisaggregationMode": DisaggregationMode, "time": time}
    return _sglang_function(cp.SGLANG_SCHEDULER_PAUSE, ns)(sched, SimpleNamespace(mode=mode))


@needs_sglang
def test_sglang_scheduler_pause_handles_retract_and_in_place_only():
    """``Scheduler.pause_generation`` asserts the mode is in_place or retract: abort is handled
    before the scheduler (``TokenizerManager.pause_generation``)."""
    for mode in cp.SGLANG_PAUSE_MODES:
        sched = _scheduler()
        if mode in cp.SGLANG_SCHEDULER_PAUSE_MODES:
            _sglang_pause(sched, mode)
            assert sched._engine_paused
        else:
            with pytest.raises(AssertionError):
                _sglang_pause(sched, mode)


@needs_sglang
def test_sglang_in_place_keeps_and_retract_requeues_without_kv():
    """``Scheduler.pause_generation``: in_place leaves running requests and their KV; retract
    frees their KV (``retract_all``) and puts them back in the waiting queue."""
    for mode in cp.SGLANG_SCHEDULER_PAUSE_MODES:
        reqs = [_req("a"), _req("b")]
        sched = _scheduler(running_batch=_Batch(reqs=list(reqs), batch_is_full=True))
        _sglang_pause(sched, mode)
        if mode == "in_place":
            observed = cp.InFlight.KEPT
            assert sched.running_batch.reqs == reqs and all(r.kv.holds_kv for r in reqs)
        else:
            assert ("retract_all", ("a", "b")) in sched.log
            assert sched.running_batch.reqs == [] and sched.waiting_queue == reqs
            assert not any(r.kv.holds_kv for r in reqs)
            observed = cp.InFlight.RETRACTED
            frees = [("sglang/srt/managers/schedule_batch.py", "retract_all", "release_req"),
                     ("sglang/srt/managers/schedule_batch.py", "release_req", "release_kv_cache"),
                     ("sglang/srt/mem_cache/common.py", "release_kv_cache", "free_kv_row")]
            for file, caller, callee in frees:
                assert _calls(_sglang_def(cp.Source(file, caller)), callee), (caller, callee)
        rule = cp.SGLANG_PAUSE_MODE_RULES[mode]
        assert rule.in_flight is observed and rule.source == cp.SGLANG_SCHEDULER_PAUSE


@needs_sglang
def test_sglang_abort_pause_aborts_every_request_in_the_tokenizer_manager():
    """``TokenizerManager.pause_generation``: mode abort calls ``abort_request(abort_all=True)``
    until ``model_update_lock`` is free and sends nothing to the scheduler."""
    rule = cp.SGLANG_PAUSE_MODE_RULES["abort"]
    log = []

    async def not_locked():
        return False

    async def dispatch(obj):
        log.append(("dispatch", obj.mode))
    async def run(mode):
        tm = SimpleNamespace(is_pause=False, is_pause_cond=asyncio.Condition(),
                             model_update_lock=SimpleNamespace(is_locked=not_locked),
                             _async_dispatch_to_scheduler=dispatch,
                             abort_request=lambda **k: log.append(("abort", k)))
        await _sglang_function(rule.source, {"asyncio": asyncio})(tm, SimpleNamespace(mode=mode))
        return tm.is_pause

    assert asyncio.run(run("abort")) and log == [("abort", {"abort_all": True})]
    assert rule.in_flight is cp.InFlight.ABORTED
    log.clear()
    asyncio.run(run("retract"))
    assert log == [("dispatch", "retract")]


@needs_sglang
def test_sglang_paused_engine_steps_nothing_and_holds_new_requests():
    """``Scheduler.event_loop_normal`` / ``event_loop_overlap`` skip batching while
    ``_engine_paused``; ``TokenizerManager.generate_request`` waits for ``not self.is_pause``."""
    for loop in cp.SGLANG_PAUSED_LOOPS:
        skips = [n for n in ast.walk(_sglang_def(loop)) if isinstance(n, ast.If)
                 and ast.unparse(n.test) == "self._engine_paused"
                 and isinstance(n.body[-1], ast.Continue)]
        assert skips, loop.name
    waits = [ast.unparse(c) for c in _calls(_sglang_def(cp.SGLANG_NEW_REQUESTS_WAIT), "wait_for")]
    assert waits == ["self.is_pause_cond.wait_for(lambda: not self.is_pause)"]
    for rule in cp.SGLANG_PAUSE_MODE_RULES.values():
        assert (rule.steps_while_paused, rule.rejects_new_requests) == (False, False), rule.mode


@needs_sglang
def test_sglang_continue_without_pause_is_not_refused():
    """``Scheduler.continue_generation`` only clears ``_engine_paused``: it refuses nothing."""
    sched = _scheduler()
    ns = {"DisaggregationMode": DisaggregationMode, "time": time, "logger": None}
    _sglang_function(cp.SGLANG_CONTINUE, ns)(sched, SimpleNamespace(torch_empty_cache=False))
    assert not sched._engine_paused and cp.SGLANG_CONTINUE_WITHOUT_PAUSE_REFUSED is False


# ---- SGLang: flush_cache and its idle rule ---------------------------------------------------

def _flush(sched):
    """The real ``Scheduler.flush_cache`` over the real ``Scheduler.is_fully_idle``."""
    ns = {"DisaggregationMode": DisaggregationMode, "logger": None, "current_platform": None,
          "logging": SimpleNamespace(warning=lambda m: None)}
    sched.is_fully_idle = functools.partial(_sglang_function(cp.SGLANG_IDLE_RULE, ns), sched)
    return _sglang_function(cp.SGLANG_FLUSH, ns)(sched, empty_cache=False)


@needs_sglang
def test_sglang_flush_refusal_and_idle_queues():
    """``Scheduler.flush_cache`` / ``Scheduler.is_fully_idle``: flushes an idle scheduler,
    returns False (no exception) when any queue the fact names holds something."""
    assert _flush(_scheduler()) is True
    busy = {"running_batch": _Batch(reqs=[_req("r")]), "chunked_req": _req("c"),
            "last_batch": _Batch(reqs=[_req("l")]), "waiting_queue": [_req("w")]}
    for name in cp.SGLANG_FLUSH_IDLE_REQUIRES_EMPTY:
        sched = _scheduler()
        if name == "grammar_queue":
            sched.grammar_manager.grammar_queue = [_req("g")]
        else:
            setattr(sched, name, busy[name])
        assert _flush(sched) is cp.SGLANG_FLUSH_REFUSAL_RETURNS, name
        assert not [c for c in sched.log if c[0] == "tree.reset"], name


@needs_sglang
def test_sglang_paused_flush_ignores_waiting_requests_without_kv():
    """``Scheduler.flush_cache`` calls ``is_fully_idle(ignore_waiting=self._engine_paused)``:
    while paused a waiting request blocks the flush only if it holds KV."""
    free = _flush(_scheduler(_engine_paused=True, waiting_queue=[_req("w", holds_kv=False)]))
    held = _flush(_scheduler(_engine_paused=True, waiting_queue=[_req("w", holds_kv=True)]))
    assert (free, held) == (cp.SGLANG_FLUSH_IGNORES_KV_FREE_WAITING_WHILE_PAUSED, False)


@needs_sglang
def test_sglang_flush_after_each_pause_mode():
    """``Scheduler.pause_generation`` then ``Scheduler.flush_cache``: accepted after retract
    (waiting requests hold no KV), refused after in_place (the running batch keeps them)."""
    observed = {}
    for mode in cp.SGLANG_FLUSH_ACCEPTED_AFTER_PAUSE:
        sched = _scheduler(running_batch=_Batch(reqs=[_req("a")], batch_is_full=True))
        _sglang_pause(sched, mode)
        observed[mode] = _flush(sched)
    assert observed == cp.SGLANG_FLUSH_ACCEPTED_AFTER_PAUSE


# ---- SGLang: weight updates ------------------------------------------------------------------

def _update_request_defaults(field: str) -> dict:
    """``field``'s default on every ``UpdateWeight(s)From*ReqInput`` of io_struct.py that has it."""
    return {name: _default(cls, field) for name, cls in vars(io).items()
            if re.fullmatch(r"UpdateWeights?From\w+ReqInput", name)
            and field in {f.name for f in msgspec.structs.fields(cls)}}


@needs_sglang
def test_sglang_update_requests_flush_by_default_and_do_not_abort():
    """``UpdateWeightFromDiskReqInput`` / ``UpdateWeightsFrom{Distributed,Tensor,IPC}ReqInput``
    (io_struct.py): ``flush_cache`` and ``abort_all_requests`` defaults, on every update request."""
    assert _update_request_defaults("flush_cache") == cp.SGLANG_UPDATE_FLUSH_CACHE_DEFAULT
    assert _update_request_defaults("abort_all_requests") == cp.SGLANG_UPDATE_ABORT_ALL_DEFAULT


@needs_sglang
def test_sglang_refused_flush_after_update_fails_the_call_and_asserts_nothing():
    """``SchedulerWeightUpdaterManager.flush_cache_after_weight_update``: a refused flush
    turns the update's result into ``(False, message)``; no ``assert`` in any update handler."""
    from sglang.srt.managers.scheduler_components import weight_updater as wu

    cls = wu.SchedulerWeightUpdaterManager
    calls = []
    stand_in = SimpleNamespace(flush_cache=lambda empty_cache: calls.append(empty_cache) or False)
    req = io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])
    assert cls.flush_cache_after_weight_update(stand_in, req, True, "ok") == (
        False, cp.SGLANG_REFUSED_FLUSH_AFTER_UPDATE_MESSAGE)
    no_flush = io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[], flush_cache=False)
    assert cls.flush_cache_after_weight_update(stand_in, no_flush, True, "ok") == (True, "ok")
    assert calls == [False]
    module = _sglang_tree(cp.SGLANG_FLUSH_AFTER_UPDATE.file)
    asserts = [a for n in ast.walk(module)
               if isinstance(n, ast.FunctionDef) and n.name.startswith("update_weights_")
               for a in ast.walk(n) if isinstance(a, ast.Assert)]
    assert bool(asserts) is cp.SGLANG_REFUSED_FLUSH_KILLS_SCHEDULER


def _run_update(monkeypatch, *, session=True, load_ok=True):
    from sglang.srt.managers.scheduler_components import weight_updater as wu

    monkeypatch.setattr(wu.torch.distributed, "barrier", lambda **k: None)
    order = []
    runner = SimpleNamespace(weight_updater=SimpleNamespace(
        update_weights_from_tensor=lambda **k: order.append("load") or (load_ok, "loaded")))
    stand_in = SimpleNamespace(
        _session=wu._WeightUpdateSession(selector="all") if session else None,
        _observe_weight_load=lambda source: contextlib.nullcontext(),
        tp_worker=SimpleNamespace(deserialize_own_rank=lambda s: []),
        _select_runners=lambda selector: [("target", runner)], tp_cpu_group=None,
        record_weight_version_after_update=lambda v: order.append(
            "record_weight_version_after_update"),
        flush_cache_after_weight_update=lambda r, s, m: order.append(
            "flush_cache_after_weight_update") or (s, m))
    req = io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[], weight_version="v2")
    handler = cp.SGLANG_UPDATE_HANDLER.name.split(".")[1]
    out = getattr(wu.SchedulerWeightUpdaterManager, handler)(stand_in, req)
    return out.success, tuple(order)


@needs_sglang
def test_sglang_update_loads_then_records_the_version_then_flushes(monkeypatch):
    """``SchedulerWeightUpdaterManager.update_weights_from_tensor``: load, record the version
    (only after a successful load), flush; outside a begin/end session it loads nothing."""
    assert _run_update(monkeypatch) == (True, cp.SGLANG_UPDATE_ORDER)
    assert _run_update(monkeypatch, load_ok=False) == (False, cp.SGLANG_UPDATE_ORDER[:1])
    assert _run_update(monkeypatch, session=False) == (False, ())
    assert "update_weights_from_tensor" in cp.SGLANG_UPDATE_NEEDS_SESSION
    for name in cp.SGLANG_UPDATE_NEEDS_SESSION:
        node = _sglang_def(cp.Source(cp.SGLANG_UPDATE_HANDLER.file,
                                     "SchedulerWeightUpdaterManager." + name))
        assert "self._session is None" in ast.unparse(node.body[1].test), name


# ---- SGLang: version publish and per-token versions ------------------------------------------

def _sglang_publish_aborts_by_default():
    return _default(io.UpdateWeightVersionReqInput, "abort_all_requests")


@needs_sglang
def test_sglang_version_publish_aborts_all_by_default_at_the_http_endpoint():
    """``UpdateWeightVersionReqInput.abort_all_requests`` defaults to True; the HTTP handler
    ``update_weight_version`` aborts all when it is set; the tokenizer manager's own
    ``TokenizerControlMixin.update_weight_version`` aborts nothing."""
    assert _sglang_publish_aborts_by_default() is cp.SGLANG_VERSION_PUBLISH_ABORTS_BY_DEFAULT
    endpoint = _sglang_def(cp.SGLANG_VERSION_PUBLISH_ABORT_SITE)
    guarded = [n for n in ast.walk(endpoint) if isinstance(n, ast.If)
               and ast.unparse(n.test) == "obj.abort_all_requests"]
    assert guarded and [ast.unparse(c) for c in _calls(guarded[0], "abort_request")] == [
        "_global_state.tokenizer_manager.abort_request(abort_all=True)"]
    assert not _calls(_sglang_def(cp.SGLANG_VERSION_PUBLISH_TOKENIZER), "abort_request")


@needs_sglang
def test_sglang_versions_are_per_token_spans():
    """``record_weight_version_events`` / ``compute_weight_version_spans`` /
    ``add_weight_versions_to_meta_info`` (utils/weight_versions.py): a request that spans a
    change reports each version over its tokens; one without tokens at the change records none."""
    from sglang.srt.utils import weight_versions as wv

    spanning, fresh = _req("a", output_ids=[1, 2, 3]), _req("b")
    assert wv.record_weight_version_events([spanning, fresh], old_version="v1") == 1
    assert bool(fresh.weight_version_events) is not cp.SGLANG_VERSION_EVENT_NEEDS_OUTPUT_TOKENS
    meta = {}
    spans = wv.compute_weight_version_spans(spanning.weight_version_events, "v2", 5)
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=5)
    assert meta["weight_versions"] == [{"version": "v1", "start": 0, "end": 3},
                                       {"version": "v2", "start": 3, "end": 5}]
    assert meta["weight_version"] == "v2" and cp.SGLANG_VERSION_GRANULARITY == "token_spans"
    change = _sglang_def(cp.SGLANG_VERSION_CHANGE)
    assert _calls(change, "record_weight_version_events")
    assert cp.SGLANG_VERSION_SPANS.name == wv.compute_weight_version_spans.__name__
    assert cp.SGLANG_VERSION_META_INFO.name == wv.add_weight_versions_to_meta_info.__name__


@needs_sglang
def test_sglang_label_is_read_when_the_output_is_built():
    """``TokenizerManager._handle_batch_output``: ``meta_info["weight_version"]`` is the
    tokenizer's current label (``config_value``) per output, then the spans' last version."""
    node = _sglang_def(cp.SGLANG_VERSION_LABEL_SOURCE)
    labels = [v for d in ast.walk(node) if isinstance(d, ast.Dict)
              for k, v in zip(d.keys, d.values)
              if isinstance(k, ast.Constant) and k.value == "weight_version"]
    assert [ast.unparse(v) for v in labels] == ["self.config_value('weight_version')"]
    assert _calls(node, "add_weight_versions_to_meta_info")
    assert cp.SGLANG_VERSION_LABEL_READ_AT == "output"


# ---- vLLM 0.33.0, from the wheel -------------------------------------------------------------

def _vllm_pause_modes():
    ns = vsrc.compile_defs("v1/engine/__init__.py", ["PauseMode"], {"Literal": typing.Literal})
    return typing.get_args(ns["PauseMode"])


def test_vllm_pause_modes_and_defaults():
    """``PauseMode`` (v1/engine/__init__.py) and ``AsyncLLM.pause_generation``'s defaults."""
    assert _vllm_pause_modes() == cp.VLLM_PAUSE_MODES == tuple(cp.VLLM_PAUSE_MODE_RULES)
    node = next(n for n in vsrc.class_node("v1/engine/async_llm.py", "AsyncLLM").body
                if isinstance(n, ast.AsyncFunctionDef) and n.name == "pause_generation")
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(node.args.kwonlyargs,
                                                           node.args.kw_defaults)}
    assert defaults == {"mode": cp.VLLM_DEFAULT_PAUSE_MODE,
                        "clear_cache": cp.VLLM_CLEAR_CACHE_DEFAULT}


@functools.lru_cache(maxsize=None)
def _vllm_engine_classes():
    ns = {"get_args": typing.get_args, "Future": Future, "partial": functools.partial,
          "Any": typing.Any, "Literal": typing.Literal, "enum": enum, "logger": vsrc.Logger(),
          "RequestStatus": SimpleNamespace(FINISHED_ABORTED="FINISHED_ABORTED")}
    vsrc.compile_defs("v1/engine/__init__.py", ["PauseMode"], ns)
    vsrc.compile_defs("v1/core/sched/interface.py", ["PauseState"], ns)
    vsrc.compile_methods("v1/engine/core.py", "EngineCore",
                         ["reset_prefix_cache", "_reset_caches", "_finish_pause",
                          "resume_scheduler", "is_scheduler_paused"], ns)
    proc = vsrc.compile_methods("v1/engine/core.py", "EngineCoreProc",
                                ["pause_scheduler", "pause_generation", "resume_scheduler",
                                 "_pause_complete"], ns, base="EngineCore")
    return proc, ns


def _vllm_engine(busy=False):
    proc, ns = _vllm_engine_classes()
    log = []

    sched = SimpleNamespace(pause_state=ns["PauseState"].UNPAUSED)
    sched.set_pause_state = lambda state: setattr(sched, "pause_state", state)
    sched.finish_requests = lambda *a: log.append(("finish_requests", *a)) or ["r"]
    sched.reset_prefix_cache = lambda *a: log.append(("reset_prefix_cache", *a)) or True

    class Engine(proc):
        reset_mm_cache = reset_encoder_cache = staticmethod(lambda: None)
        _send_abort_outputs = staticmethod(lambda reqs: log.append(("abort_outputs", reqs)))
        has_work = staticmethod(lambda: busy)

    engine = Engine()
    engine.scheduler, engine._idle_state_callbacks, engine.log = sched, [], log
    engine.model_executor = SimpleNamespace(collective_rpc=lambda name: None)
    return engine, ns["PauseState"]


def _vllm_counts_running(state_name: str) -> bool:
    """``Scheduler.get_num_unfinished_requests`` under ``state_name`` with 2 running requests
    and 1 queued: whether the running ones are still scheduled."""
    _, ns = _vllm_engine_classes()
    cls = vsrc.compile_methods("v1/core/sched/scheduler.py", "Scheduler",
                               ["get_num_unfinished_requests"], dict(ns), name="Counts")
    counts = cls()
    counts._pause_state = ns["PauseState"][state_name]
    counts.get_request_counts, counts.kv_holding_waiting = (lambda: (2, 1)), []
    counts.num_waiting_for_streaming_input = 0
    return counts.get_num_unfinished_requests() == 2


def test_vllm_pause_modes_do_what_the_rules_say():
    """``EngineCoreProc.pause_scheduler`` / ``pause_generation`` and
    ``Scheduler.get_num_unfinished_requests``: abort finishes every request (PAUSED_NEW); wait
    sets PAUSED_NEW, under which running requests keep stepping until drained; keep sets
    PAUSED_ALL, under which nothing is scheduled; abort and wait reject new requests."""
    for mode, rule in cp.VLLM_PAUSE_MODE_RULES.items():
        engine, state = _vllm_engine()
        engine.pause_generation(mode, clear_cache=False)
        aborted = ("finish_requests", None, "FINISHED_ABORTED") in engine.log
        state_name = engine.scheduler.pause_state.name
        steps = _vllm_counts_running(state_name) and not aborted
        observed = (cp.InFlight.ABORTED if aborted else
                    cp.InFlight.DRAINED if steps else cp.InFlight.KEPT)
        assert (rule.in_flight, rule.steps_while_paused) == (observed, steps), mode
        assert cp.VLLM_PAUSE_STATES[mode] == state_name, mode
        assert engine.reject_new_requests is rule.rejects_new_requests, mode
        assert rule.source == cp.Source("vllm/v1/engine/core.py", "EngineCoreProc.pause_scheduler")
    with pytest.raises(cp.VLLM_UNKNOWN_MODE_ERROR, match="Invalid pause mode"):
        _vllm_engine()[0].pause_generation("retract")
    busy, _ = _vllm_engine(busy=True)
    assert isinstance(busy.pause_generation("wait", clear_cache=True), Future)  # completes later


def test_vllm_clear_cache_resets_with_running_requests_preempted():
    """``EngineCore._finish_pause`` -> ``_reset_caches``: ``clear_cache=True`` resets the
    prefix cache with ``reset_running_requests=True``; ``clear_cache=False`` resets nothing."""
    engine, _ = _vllm_engine()
    engine.pause_generation("keep", clear_cache=True)
    assert ("reset_prefix_cache", cp.VLLM_CLEAR_CACHE_PREEMPTS_RUNNING, True) in engine.log
    engine, _ = _vllm_engine()
    engine.pause_generation("keep", clear_cache=False)
    assert not [c for c in engine.log if c[0] == "reset_prefix_cache"]


def test_vllm_resume_clears_the_pause_and_refuses_nothing():
    """``EngineCoreProc.resume_scheduler``: UNPAUSED, new requests accepted; an engine that was
    never paused is not refused."""
    engine, state = _vllm_engine()
    engine.resume_scheduler()
    assert engine.scheduler.pause_state is state.UNPAUSED and engine.reject_new_requests is False
    assert cp.VLLM_RESUME_WITHOUT_PAUSE_REFUSED is False
    engine.pause_generation("abort", clear_cache=False)
    engine.resume_scheduler()
    assert not engine.is_scheduler_paused()


def test_vllm_reset_prefix_cache_refuses_while_blocks_are_used():
    """``Scheduler.reset_prefix_cache`` (default ``reset_running_requests=False``) returns
    ``BlockPool.reset_prefix_cache``'s answer: False while any block but the null block is
    used, with running requests left untouched and nothing raised."""
    node = vsrc.method_node("v1/core/sched/scheduler.py", "Scheduler", "reset_prefix_cache")
    assert ast.literal_eval(node.args.defaults[0]) is cp.VLLM_RESET_PREFIX_RESET_RUNNING_DEFAULT
    logger = vsrc.Logger()
    pool_cls = vsrc.compile_methods("v1/core/block_pool.py", "BlockPool",
                                    ["reset_prefix_cache"],
                                    {"logger": logger, "BlockHashToBlockMap": dict})
    pool = pool_cls()
    pool.num_gpu_blocks, pool.get_num_free_blocks = 8, lambda: 5
    pool.blocks, pool.cached_block_hashes_by_block, pool._reuse_watchers = [], {}, {}
    pool.metrics_collector, pool.enable_kv_cache_events = None, False
    assert pool.reset_prefix_cache() is cp.VLLM_RESET_PREFIX_REFUSAL_RETURNS
    assert "Failed to reset prefix cache" in logger.records[0][1]
    sched_cls = vsrc.compile_methods("v1/core/sched/scheduler.py", "Scheduler",
                                     ["reset_prefix_cache"], {"time": time})
    sched = sched_cls()
    sched.running, sched.aux_output_connector = ["r"], None
    sched.kv_cache_manager = SimpleNamespace(reset_prefix_cache=pool.reset_prefix_cache)
    assert sched.reset_prefix_cache() is cp.VLLM_RESET_PREFIX_REFUSAL_RETURNS
    assert sched.running == ["r"]
    # What clear_cache asks for (reset_running_requests=True): every running request preempted
    # (back to waiting, KV dropped), then the reset succeeds.
    preempted, sched.prev_step_scheduled_req_ids = [], set()
    sched._preempt_request = lambda req, ts, drop_stale_output: preempted.append(req)
    pool.get_num_free_blocks = lambda: 7 if not sched.running else 5
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert (preempted == ["r"]) is cp.VLLM_CLEAR_CACHE_PREEMPTS_RUNNING and not sched.running


# ---- A changed fact is caught ----------------------------------------------------------------

_READERS = {
    "SGLANG_PAUSE_MODES": lambda: _sglang_pause_modes()[0],
    "SGLANG_DEFAULT_PAUSE_MODE": lambda: _sglang_pause_modes()[1],
    "SGLANG_VERSION_PUBLISH_ABORTS_BY_DEFAULT": _sglang_publish_aborts_by_default,
    "SGLANG_UPDATE_FLUSH_CACHE_DEFAULT": lambda: _update_request_defaults("flush_cache"),
    "VLLM_PAUSE_MODES": _vllm_pause_modes,
}


@pytest.mark.parametrize("fact, wrong", [
    ("SGLANG_PAUSE_MODES", ("abort", "retract")),
    ("SGLANG_PAUSE_MODES", ("abort", "retract", "in_place", "wait")),
    ("SGLANG_DEFAULT_PAUSE_MODE", "retract"),
    ("SGLANG_VERSION_PUBLISH_ABORTS_BY_DEFAULT", False),
    ("SGLANG_UPDATE_FLUSH_CACHE_DEFAULT", {**cp.SGLANG_UPDATE_FLUSH_CACHE_DEFAULT,
                                           "UpdateWeightsFromTensorReqInput": False}),
    ("VLLM_PAUSE_MODES", ("abort", "wait")),
])
def test_a_changed_fact_is_caught(fact, wrong):
    """The readers above (the real ``PauseGenerationReqInput``, ``UpdateWeightVersionReqInput``,
    update requests, vLLM's ``PauseMode``) tell a wrong value of a fact from the right one."""
    if fact.startswith("SGLANG") and io is None:
        pytest.skip(_NO_SGLANG)
    real = _READERS[fact]()
    assert real == getattr(cp, fact) and real != wrong
