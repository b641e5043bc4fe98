"""The reference serving engine itself: its words agree with the pinned engines' facts, its
forward with the oracle's, and misuse of its control plane is refused with the engine usable.

The conformance suite (``suites/conformance/test_serving.py``) judges it as a row; these tests
hold what that suite cannot see: the vocabulary's pause modes are the pinned engines' (one word
list for the plugin, one fact list with sources for the reference), the engine computes with
what its parameters hold (a parameter changed in place changes its tokens), a prefix is reused
and reported, and every refused call leaves an engine that still serves the right tokens.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync.reference_impl.backends import control_plane as facts
from pytest_weightsync.reference_impl.serving.engine import (
    DEFAULT_PAUSE_MODE,
    PAUSE_RULES,
    ServingEngine,
    ServingError,
)
from pytest_weightsync.vocabulary import PAUSE_MODES

from ..harness import serving

pytestmark = pytest.mark.weightsync_property("reference_strictness")


def test_the_vocabulary_pause_modes_are_the_pinned_engines():
    assert PAUSE_MODES["sglang"] == facts.SGLANG_PAUSE_MODES == tuple(PAUSE_RULES["sglang"])
    assert PAUSE_MODES["vllm"] == facts.VLLM_PAUSE_MODES == tuple(PAUSE_RULES["vllm"])
    assert DEFAULT_PAUSE_MODE == {"sglang": facts.SGLANG_DEFAULT_PAUSE_MODE,
                                  "vllm": facts.VLLM_DEFAULT_PAUSE_MODE}


def test_the_engine_computes_with_what_its_parameters_hold():
    engine = ServingEngine(serving.spec(), version=1)
    rid = engine.submit(list(serving.PROMPTS[0]), 4)
    serving.run_to_end(engine, [rid])
    assert engine.request(rid).output == serving.fresh(serving.PROMPTS[0], 1, 4).tokens
    w13 = engine.receiver.params["model.layers.0.mlp.experts.w13_weight"]
    w13.copy_(torch.flip(w13, [0]))  # the experts' bits moved: what the forward reads changes
    from pytest_weightsync.reference_impl.serving.weights_view import engine_weights

    engine._view = engine_weights(engine.spec, engine.topo, engine.receiver.params)  # noqa: SLF001
    again = engine.submit(list(serving.PROMPTS[0]), 4)
    serving.run_to_end(engine, [again])
    assert engine.request(again).logprobs != engine.request(rid).logprobs


def test_a_shared_prefix_is_reused_and_reported():
    engine = ServingEngine(serving.spec(), version=1)
    first = engine.submit(list(serving.PROMPTS[0]), serving.NEW_TOKENS)
    serving.run_to_end(engine, [first])
    later = engine.submit(list(serving.PROMPTS[1]), serving.NEW_TOKENS)
    serving.run_to_end(engine, [later])
    request = engine.request(later)
    assert request.cached_tokens == 8 and request.prompt_versions[:8] == [1] * 8
    serving.judge("reference", request, serving.fresh(serving.PROMPTS[1], 1))


@pytest.mark.parametrize("misuse, message", [
    (lambda e: e.pause_generation("drain"), "pause mode 'drain'"),
    (lambda e: e.continue_generation(), "without pause_generation"),
    (lambda e: e.pause_generation("abort", clear_cache=True), "clear_cache is vLLM's"),
    (lambda e: e.submit([], 2), "non-empty sequence"),
    (lambda e: e.submit([500], 2), r"range\(96\)"),
    (lambda e: e.submit([1], 0), "max_new_tokens"),
    (lambda e: e.request("req-99"), "no request"),
    (lambda e: (e.pause_generation("in_place"), e.pause_generation("retract")), "while paused"),
    (lambda e: (e.step(), e.pause_generation("in_place"),
                e.update_weights(serving.update_buckets(2), weight_version=2)),
     "refused before loading"),
])
def test_misuse_is_refused_and_the_engine_still_serves(misuse, message):
    engine = ServingEngine(serving.spec(), version=1)
    rid = engine.submit(list(serving.PROMPTS[2]), serving.NEW_TOKENS)
    with pytest.raises(ServingError, match=message):
        misuse(engine)
    assert engine.weight_version == 1
    if engine.paused is not None:
        engine.continue_generation()
    serving.run_to_end(engine, [rid])
    serving.judge("reference", engine.request(rid), serving.fresh(serving.PROMPTS[2], 1))


def test_a_step_during_an_update_is_refused_and_a_failed_update_leaves_no_label():
    engine = ServingEngine(serving.spec(), version=1)
    buckets = serving.update_buckets(2)

    def stream():
        yield buckets[0]
        with pytest.raises(ServingError, match="no batch while a weight update is open"):
            engine.step()
        yield [("model.layers.0.no_such.weight", torch.zeros(1))]

    with pytest.raises(Exception, match="no_such"):
        engine.update_weights(stream(), weight_version=2)
    assert engine.weight_version is None  # part of version 2 landed: no complete version
    engine.update_weights(serving.update_buckets(2), weight_version=2)
    rid = engine.submit(list(serving.PROMPTS[2]), serving.NEW_TOKENS)
    serving.run_to_end(engine, [rid])
    serving.judge("reference", engine.request(rid), serving.fresh(serving.PROMPTS[2], 2))


def test_vllm_wait_and_abort_refuse_new_requests_while_paused_keep_accepts():
    for mode, refused in (("abort", True), ("wait", True), ("keep", False)):
        engine = ServingEngine(serving.spec(), version=1, dialect="vllm")
        engine.pause_generation(mode, clear_cache=False)
        assert facts.VLLM_PAUSE_MODE_RULES[mode].rejects_new_requests == refused
        if refused:
            with pytest.raises(ServingError, match="new requests are refused"):
                engine.submit([1, 2], 2)
        else:
            engine.submit([1, 2], 2)
        engine.resume_generation()
