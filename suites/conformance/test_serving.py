"""Refit under load: what a serving engine's requests show around a weight update.

Each test runs once per registered serving engine (``open_serving_engine``) and control plane it
claims (``Capabilities.serving``), and states one property (judged in
``suites/harness/serving.py`` against replays of the oracle's forward; the contract is
``docs/refit-under-load.md``):

- ``no_stale_kv``: after a completed update, a request sharing a prefix with earlier requests
  produces exactly the tokens and log-probs of a fresh engine at the new version - unless the
  engine reports the reuse (``prompt_versions``: the version that computed each reused token);
- ``in_flight``: under each claimed pause mode, the requests in flight during an update end as
  the mode says: aborted with a reason and no later token; retracted and recomputed under the
  new weights; kept, every token's version reported; drained (vLLM ``wait``) at the old one;
- ``token_versions``: a request spanning an update reports each token's version; a label is
  never published while its update is open;
- ``version_publish``: publishing a label ends no request unless asked;
- ``logprob_agreement``: the engine's log-probs are the trainer-side forward of the reported
  version on the same tokens, bit for bit (or within the declared ``logprob_tolerance``);
- ``flush_after_pause``: flushing the cache after any pause is accepted or refused with an
  error, and the engine keeps serving;
- ``refit_sequence`` (orchestrators, ``refit_engine``): an RL framework's pause / update /
  flush / publish / resume sequence, run on the reference serving engine with requests in
  flight, keeps every invariant above.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.vocabulary import PAUSE_MODES, SERVING_DIALECTS

from ..harness import claims, serving

DIALECT_MODES = [pytest.param(d, m, id=f"{d}-{m}") for d in SERVING_DIALECTS
                 for m in PAUSE_MODES[d]]


def _open(impl, dialect, mode=None, version=1):
    reason = impl.capabilities.serving_refusal(dialect, mode)
    if reason is not None:
        claims.skip_unclaimed(reason)
    return serving.open_engine(impl, dialect, version)


def _tolerance(impl):
    return impl.capabilities.logprob_tolerance


def _pause(engine, dialect, mode):
    """Pause in ``mode``; vLLM's ``keep`` without clearing the cache (clearing preempts the
    requests it keeps: that is ``retract``'s semantics, judged there)."""
    if dialect == "vllm":
        engine.pause_generation(mode, clear_cache=mode != "keep")
    else:
        engine.pause_generation(mode)


def _submit_all(engine, prompts=serving.PROMPTS):
    return [engine.submit(list(p), serving.NEW_TOKENS) for p in prompts]


@pytest.mark.weightsync_property("no_stale_kv")
@pytest.mark.parametrize("dialect", SERVING_DIALECTS)
@pytest.mark.parametrize("flush", [True, False], ids=["flushed", "kept-cache"])
def test_no_stale_kv_after_an_update(weightsync_serving_engine, dialect, flush):
    engine = _open(weightsync_serving_engine, dialect)
    first = engine.submit(list(serving.PROMPTS[0]), serving.NEW_TOKENS)
    serving.run_to_end(engine, [first])
    engine.update_weights(serving.update_buckets(2), flush_cache=flush, weight_version=2)
    later = engine.submit(list(serving.PROMPTS[1]), serving.NEW_TOKENS)
    serving.run_to_end(engine, [later])
    request = engine.request(later)
    serving.judge(weightsync_serving_engine.name, request,
                  serving.with_reported_prefix(request, 2), tolerance=_tolerance(
                      weightsync_serving_engine), what=" after an update to version 2")


@pytest.mark.weightsync_property("in_flight")
@pytest.mark.parametrize("dialect, mode", DIALECT_MODES)
def test_requests_in_flight_end_as_the_pause_mode_says(weightsync_serving_engine, dialect,
                                                       mode):
    impl = weightsync_serving_engine
    engine = _open(impl, dialect, mode)
    running_prompts = serving.PROMPTS[:2]
    rids = _submit_all(engine, running_prompts)
    for _ in range(3):
        engine.step()
    before = {rid: len(engine.request(rid).output) for rid in rids}
    waiting = engine.submit(list(serving.PROMPTS[2]), serving.NEW_TOKENS)
    _pause(engine, dialect, mode)
    drained = {rid: len(engine.request(rid).output) for rid in rids}
    keeps = mode in ("in_place", "keep")
    engine.update_weights(serving.update_buckets(2), flush_cache=not keeps, weight_version=2)
    engine.continue_generation() if dialect == "sglang" else engine.resume_generation()
    serving.run_to_end(engine, rids + [waiting])
    for rid, prompt in zip(rids, running_prompts):
        request = engine.request(rid)
        if mode == "abort":
            if request.status != "aborted" or not request.abort_reason:
                raise serving.ServingConformanceError(
                    f"{impl.name}: request {rid} in flight at pause_generation('abort') ended "
                    f"{request.status!r} (reason {request.abort_reason!r}); expected aborted "
                    f"with a reason")
            if len(request.output) != before[rid]:
                raise serving.ServingConformanceError(
                    f"{impl.name}: request {rid} was aborted by the pause with {before[rid]} "
                    f"tokens and holds {len(request.output)}: a token after its abort")
            continue
        if mode == "wait":
            expected = serving.fresh(prompt, 1)
        elif mode == "retract":
            expected = serving.retracted(prompt, drained[rid], 1, 2)
        else:
            expected = serving.kept(prompt, drained[rid], 1, 2)
        serving.judge(impl.name, request, expected, tolerance=_tolerance(impl),
                      what=f" ({mode} pause with {drained[rid]} tokens, update to version 2)")
    last = engine.request(waiting)
    if mode == "abort":
        assert last.status == "aborted" and not last.output, (mode, last)
    else:
        serving.judge(impl.name, last, serving.fresh(serving.PROMPTS[2], 1 if mode == "wait"
                                                     else 2), tolerance=_tolerance(impl),
                      what=f" (waiting at the {mode} pause)")


@pytest.mark.weightsync_property("token_versions")
@pytest.mark.parametrize("dialect", SERVING_DIALECTS)
def test_every_token_carries_the_version_that_computed_it(weightsync_serving_engine, dialect):
    impl = weightsync_serving_engine
    engine = _open(impl, dialect)
    rid = engine.submit(list(serving.PROMPTS[2]), serving.NEW_TOKENS)
    for _ in range(3):
        engine.step()
    before = len(engine.request(rid).output)
    seen = []

    def stream():  # the label between buckets of the open update
        for bucket in serving.update_buckets(2):
            seen.append(engine.weight_version)
            yield bucket
        seen.append(engine.weight_version)

    engine.update_weights(stream(), flush_cache=False, weight_version=2)
    early = [label for label in seen if label == 2]
    if early:
        raise serving.ServingConformanceError(
            f"{impl.name}: weight_version said 2 while the update to 2 was open (labels between "
            f"its buckets: {seen}): a label published before its update completed")
    if engine.weight_version != 2:
        raise serving.ServingConformanceError(
            f"{impl.name}: weight_version is {engine.weight_version!r} after the update to 2 "
            f"completed with weight_version=2")
    serving.run_to_end(engine, [rid])
    serving.judge(impl.name, engine.request(rid), serving.kept(serving.PROMPTS[2], before, 1, 2),
                  tolerance=_tolerance(impl), what=" (an update while it ran, no pause)")


@pytest.mark.weightsync_property("version_publish")
@pytest.mark.parametrize("dialect", SERVING_DIALECTS)
@pytest.mark.parametrize("abort", [False, True], ids=["keep-requests", "abort-all"])
def test_publishing_a_label_ends_no_request_unless_asked(weightsync_serving_engine, dialect,
                                                         abort):
    impl = weightsync_serving_engine
    engine = _open(impl, dialect)
    rid = engine.submit(list(serving.PROMPTS[0]), serving.NEW_TOKENS)
    engine.step()
    engine.update_weight_version(1, abort_all_requests=abort)
    request = engine.request(rid)
    if abort:
        if request.status != "aborted" or not request.abort_reason:
            raise serving.ServingConformanceError(
                f"{impl.name}: update_weight_version(abort_all_requests=True) left request "
                f"{rid} {request.status!r}; it asks every in-flight request to end")
        return
    if request.status == "aborted":
        raise serving.ServingConformanceError(
            f"{impl.name}: update_weight_version(1, abort_all_requests=False) aborted request "
            f"{rid} ({request.abort_reason}): publishing a label ended an in-flight request "
            f"(miles#2296)")
    serving.run_to_end(engine, [rid])
    serving.judge(impl.name, engine.request(rid), serving.fresh(serving.PROMPTS[0], 1),
                  tolerance=_tolerance(impl), what=" (a label published while it ran)")


@pytest.mark.weightsync_property("logprob_agreement")
@pytest.mark.parametrize("dialect", SERVING_DIALECTS)
def test_engine_logprobs_are_the_trainer_forward_of_their_version(weightsync_serving_engine,
                                                                   dialect):
    from pytest_weightsync.reference_impl.oracle import token_forward

    impl = weightsync_serving_engine
    engine = _open(impl, dialect, version=3)
    rids = _submit_all(engine)
    serving.run_to_end(engine, rids)
    tolerance = _tolerance(impl)
    for rid in rids:
        request = engine.request(rid)
        versions = set(request.token_versions)
        if versions != {3}:
            raise serving.ServingConformanceError(f"{impl.name}: request {rid} labels its tokens "
                                                  f"{sorted(map(repr, versions))}, expected 3")
        trainer = token_forward.score(serving.oracle(3), request.prompt, request.output)
        for index, (got, want) in enumerate(zip(request.logprobs, map(float, trainer))):
            if (got != want) if tolerance is None else not abs(got - want) <= tolerance:
                raise serving.ServingConformanceError(
                    f"{impl.name}: request {rid} token {index}: engine log-prob {got!r}, the "
                    f"trainer's forward of version 3 on the same tokens gives {want!r} "
                    f"({'bit for bit' if tolerance is None else f'within {tolerance}'} claimed)")


@pytest.mark.weightsync_property("flush_after_pause")
@pytest.mark.parametrize("dialect, mode", DIALECT_MODES)
def test_flushing_after_a_pause_never_kills_the_engine(weightsync_serving_engine, dialect, mode):
    impl = weightsync_serving_engine
    engine = _open(impl, dialect, mode)
    rids = _submit_all(engine, serving.PROMPTS[:2])
    for _ in range(2):
        engine.step()
    _pause(engine, dialect, mode)
    flush = engine.flush_cache if dialect == "sglang" else engine.reset_prefix_cache
    try:
        answer = flush()
    except Exception as error:  # noqa: BLE001 - a clear refusal is allowed
        answer = f"{type(error).__name__}: {error}"
    if answer not in (True, False) and not isinstance(answer, str):
        raise serving.ServingConformanceError(f"{impl.name}: the flush after a {mode} pause "
                                              f"answered {answer!r}, not True/False")
    try:
        engine.update_weights(serving.update_buckets(2), weight_version=2)
    except Exception as error:  # noqa: BLE001 - refused with an error: then without the flush
        if "flush" not in str(error).lower() and "cache" not in str(error).lower():
            raise
        engine.update_weights(serving.update_buckets(2), flush_cache=False, weight_version=2)
    engine.continue_generation() if dialect == "sglang" else engine.resume_generation()
    serving.run_to_end(engine, rids)
    probe = engine.submit(list(serving.PROMPTS[2]), serving.NEW_TOKENS)
    serving.run_to_end(engine, [probe])
    serving.judge(impl.name, engine.request(probe), serving.fresh(serving.PROMPTS[2], 2),
                  tolerance=_tolerance(impl), what=f" (served after a {mode} pause, a flush "
                                                  f"({answer!r}) and an update)")


@pytest.mark.weightsync_property("refit_sequence")
@pytest.mark.parametrize("dialect", SERVING_DIALECTS)
def test_an_orchestrators_refit_keeps_every_request_right(weightsync_orchestrator, dialect):
    from pytest_weightsync.reference_impl.serving.engine import ServingEngine

    impl = weightsync_orchestrator
    reason = impl.capabilities.serving_refusal(dialect)
    if reason is not None:
        claims.skip_unclaimed(reason)
    engine = ServingEngine(serving.spec(), version=1, dialect=dialect)
    rids = _submit_all(engine)
    for _ in range(3):
        engine.step()
    before = {rid: len(engine.request(rid).output) for rid in rids}
    serving.calls.call(impl, "refit_engine", engine, serving.update_buckets(2), version=2)
    if engine.weight_version != 2:
        raise serving.ServingConformanceError(
            f"{impl.name}: after its refit to version 2 the engine's label is "
            f"{engine.weight_version!r}")
    serving.run_to_end(engine, rids)
    for rid, prompt in zip(rids, serving.PROMPTS):
        request = engine.request(rid)
        if request.status == "aborted":
            raise serving.ServingConformanceError(
                f"{impl.name}: request {rid} in flight during its refit was aborted "
                f"({request.abort_reason}); a refit keeps requests (miles#2296: a version "
                f"published with abort_all_requests=True)")
        count = sum(1 for v in request.token_versions if v == 1)
        if request.retractions:
            expected = serving.retracted(prompt, count, 1, 2)
        else:
            expected = serving.kept(prompt, count, 1, 2)
        if count < before[rid]:
            raise serving.ServingConformanceError(
                f"{impl.name}: request {rid} had {before[rid]} tokens of version 1 before the "
                f"refit and reports {count}: tokens relabelled")
        serving.judge(impl.name, request, expected, what=" (through the orchestrator's refit)")
