"""Refit under load, driven and judged: what a serving engine's requests must show after a refit.

Every expectation is a replay of the oracle's per-token forward
(:mod:`pytest_weightsync.reference_impl.oracle.token_forward`) over the oracle's weights of each
version - never the engine's values. What a request should hold depends only on what the
harness did to it: which version's weights computed the keys and values of each token it has
seen, and which version computed each of its output tokens. The replays:

* a fresh request at version ``v``: the prompt's KV at ``v``, every token at ``v``;
* a request reusing a cached prefix: the prefix's KV at the version the engine REPORTS for it
  (``prompt_versions``) - a reuse reported honestly is the engine's to make; a stale one
  reported as new shows as other tokens or log-probs;
* retracted and resumed: the tokens before the pause at the old version, then everything it
  has seen recomputed at the new one, the rest decoded at the new one;
* kept in place (``in_place`` / ``keep``, or an update with no pause): the KV it had at the old
  version, every later token computed by the new weights over it.

A request's tokens, the bits of its log-probs (or within the engine's declared tolerance) and
its per-token labels are compared with the replay; the first difference is named with the
request, the token index and the pattern it looks like.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from . import calls

#: The serving model: two attention + MoE layers, hidden 32, a vocabulary of 96, GQA 4/2.
SPEC_FIELDS = dict(num_layers=2, num_experts=4, hidden=32, intermediate=16, vocab=96,
                   num_heads=4, num_kv_heads=2, head_dim=8)
#: Bucket limit of the update streams (bytes): several buckets per update.
BUCKET_BYTES = 16 * 1024
#: Prompts: the first two share their first 8 tokens (two whole cache blocks).
PROMPTS = ((5, 17, 3, 44, 9, 60, 2, 31, 7, 12), (5, 17, 3, 44, 9, 60, 2, 31, 70, 1, 88),
           (90, 4, 4, 26, 51))
#: Output tokens per request.
NEW_TOKENS = 8


class ServingConformanceError(AssertionError):
    """A serving engine's request that differs from the replay, named and located."""


def spec():
    from pytest_weightsync.reference_impl.model.model_spec import qwen3_moe

    return qwen3_moe(**SPEC_FIELDS)


@functools.lru_cache(maxsize=8)
def oracle(version):
    """The oracle's weights of ``version`` as the per-token forward reads them."""
    from pytest_weightsync.reference_impl.oracle import token_forward

    return token_forward.oracle_weights(spec(), version)


def update_buckets(version) -> list:
    """A complete update to ``version``: the whole model in ``compat`` names, cut into
    buckets of :data:`BUCKET_BYTES`."""
    from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
    from pytest_weightsync.reference_impl.oracle import model_synth
    from pytest_weightsync.reference_impl.senders import model_senders
    from pytest_weightsync.reference_impl.senders.buckets import split_buckets

    payload = model_senders.export("compat", spec(), ReceiverTopology(tp=1), 0,
                                   model_synth.full_model(spec(), version))
    return split_buckets(payload, BUCKET_BYTES)


def open_engine(impl, dialect: str, version=1):
    return calls.call(impl, "open_serving_engine", spec=spec(), version=version,
                      dialect=dialect)


@dataclass
class Replay:
    """What the oracle says a request holds: its tokens, the log-prob of each and the version
    whose weights computed each."""

    tokens: list
    logprobs: list
    versions: list


def replay(feed, decode_version, count: int) -> Replay:
    """Feed ``(token, version)`` pairs (each token's KV computed by that version's weights);
    the last one's log-probs give the first output token; then decode ``count - 1`` more at
    ``decode_version``. The first output's version is the last fed token's."""
    from pytest_weightsync.reference_impl.oracle import token_forward

    cache = token_forward.KVCache()
    logprobs = None
    for token, version in feed:
        logprobs = token_forward.step(oracle(version), token, cache)
    out = Replay([], [], [])
    version = feed[-1][1]
    for index in range(count):
        token = int(logprobs.argmax())
        out.tokens.append(token)
        out.logprobs.append(float(logprobs[token]))
        out.versions.append(version)
        if index + 1 < count:
            version = decode_version
            logprobs = token_forward.step(oracle(version), token, cache)
    return out


def fresh(prompt, version, count: int = NEW_TOKENS) -> Replay:
    return replay([(t, version) for t in prompt], version, count)


def combine(first: Replay, second: Replay) -> Replay:
    return Replay(first.tokens + second.tokens, first.logprobs + second.logprobs,
                  first.versions + second.versions)


def retracted(prompt, before: int, old, new, count: int = NEW_TOKENS) -> Replay:
    """``before`` tokens at ``old``, then everything seen recomputed at ``new``."""
    head = fresh(prompt, old, before) if before else Replay([], [], [])
    tail = replay([(t, new) for t in list(prompt) + head.tokens], new, count - before)
    return combine(head, tail)


def kept(prompt, before: int, old, new, count: int = NEW_TOKENS) -> Replay:
    """``before`` tokens at ``old`` (their KV kept), every later token computed at ``new``."""
    if before == 0:
        return fresh(prompt, new, count)
    head = fresh(prompt, old, before)
    seen = [(t, old) for t in list(prompt) + head.tokens[:-1]] + [(head.tokens[-1], new)]
    return combine(head, replay(seen, new, count - before))


def with_reported_prefix(request, version, count: int = NEW_TOKENS) -> Replay:
    """A request prefilled at ``version`` whose prompt KV is what the engine reports
    (``prompt_versions``: a reused prefix at the version that computed it)."""
    reported = list(request.prompt_versions)
    feed = [(t, reported[i] if i < len(reported) and reported[i] is not None else version)
            for i, t in enumerate(request.prompt)]
    feed[-1] = (feed[-1][0], version)
    return replay(feed, version, count)


def judge(engine_name: str, request, expected: Replay, *, tolerance: Optional[float] = None,
          what: str = "") -> None:
    """``request`` holds ``expected`` (tokens, log-probs within ``tolerance`` - bit-exact when
    ``None`` - and labels), or :class:`ServingConformanceError` naming the first difference."""
    where = f"{engine_name}: request {request.rid} (prompt {list(request.prompt)}){what}"
    if request.status != "finished":
        raise ServingConformanceError(f"{where}: ended {request.status!r} "
                                      f"({request.abort_reason}), expected it to finish")
    for index, (got, want) in enumerate(zip(request.output, expected.tokens)):
        if got != want:
            version = expected.versions[index]
            raise ServingConformanceError(
                f"{where}: output token {index} is {got}, the oracle's forward at version "
                f"{version} over what the request had seen gives {want} - "
                f"{pattern(request, expected, index)}")
    if len(request.output) != len(expected.tokens):
        raise ServingConformanceError(f"{where}: {len(request.output)} output tokens, expected "
                                      f"{len(expected.tokens)}")
    for index, (got, want) in enumerate(zip(request.logprobs, expected.logprobs)):
        if (got != want) if tolerance is None else not abs(got - want) <= tolerance:
            bound = "bit for bit" if tolerance is None else f"within {tolerance}"
            raise ServingConformanceError(
                f"{where}: log-prob of output token {index} is {got!r}, the trainer-side "
                f"forward of version {expected.versions[index]} gives {want!r} (claimed "
                f"{bound}) - {pattern(request, expected, index)}")
    for index, (got, want) in enumerate(zip(request.token_versions, expected.versions)):
        if got != want:
            raise ServingConformanceError(
                f"{where}: output token {index} is labelled version {got!r}, it was computed "
                f"by version {want!r} - {label_pattern(got, want)}")


def pattern(request, expected: Replay, index: int) -> str:
    """The bug a wrong token or log-prob looks like."""
    if request.cached_tokens and index == 0:
        return (f"stale prefix reuse: {request.cached_tokens} prompt tokens came from the "
                f"prefix cache, reported as computed by {sorted(set(request.prompt_versions))}")
    if request.retractions:
        return "recompute-KV no-op: a retracted request resumed on KV of the old weights"
    return "computed by other weights than its label says (old weights after the update?)"


def label_pattern(got, want) -> str:
    if got is None:
        return "no label: the version was not published with the update"
    if isinstance(got, int) and isinstance(want, int) and got > want:
        return "a label published before its update completed (or captured too late)"
    return "a label captured at admission, or tokens after the update tagged with the old version"


def run_to_end(engine, rids, max_steps: int = 500) -> None:
    """Step ``engine`` until every request of ``rids`` finished or was aborted."""
    for _ in range(max_steps):
        if all(engine.request(r).status in ("finished", "aborted") for r in rids):
            return
        engine.step()
    raise ServingConformanceError(f"requests still in flight after {max_steps} steps")
