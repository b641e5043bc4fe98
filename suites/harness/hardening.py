"""The hardening probe: what a loader does with bad input, recorded - never a verdict.

Stock SGLang is lenient by design (it casts float32, re-slices a short ``down_proj`` and
zero-fills, skips unknown names and out-of-range experts, lets a duplicate overwrite), and its
loads are still bit-exact and in place. So strictness is reported, not required: each bad kind
is fed to the loader at the end of an otherwise valid update, the parameters are compared
before and after, and the outcome is one of :data:`OUTCOMES`.

One outcome is a conformance failure: **refused after writing** - the loader raised
``ValueError``/``TypeError`` (it refused the bucket) but the bucket had already changed the
parameters. A loader that refuses promises the refused bucket wrote nothing (the atomicity
promise of ``pytest_weightsync.protocols``); breaking it leaves a half-applied update behind an
error that says nothing was applied. A crash with any other exception is a finding
("crashed", with "after writing" when it had written): the loader made no promise, the engine
will report the failure. A refusal from ``end_update`` (completeness, e.g. a missing expert) is
a refusal too: the buckets before it were valid and stay written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pytest_weightsync import compare
from pytest_weightsync.deadline import CallTimeoutError
from . import calls, claims, inputs
from pytest_weightsync.reference_impl.model.layout import parse_receiver_name, receiver_shard

#: Bad kinds SGLang users hit, fed in every format a loader claims.
KINDS = ("wrong_dtype", "short_down_proj", "unknown_name", "expert_out_of_range",
         "duplicate_in_bucket", "duplicate_across_buckets", "missing_expert")
#: Outcome categories, as the report shows them (a refusal or crash adds "(ExceptionType)").
OUTCOMES = (
    "refused",                                   # raised ValueError/TypeError, wrote nothing
    "refused at end_update",                     # completeness refusal after valid buckets
    "refused after writing",                     # CONFORMANCE FAILURE (atomicity)
    "crashed",                                   # another exception type, wrote nothing
    "crashed after writing",                     # another exception type, had written
    "crashed at end_update",
    "accepted, nothing changed",
    "accepted, result equals the valid entries'",  # the bad entry was cast / ignored harmlessly
    "accepted, wrong values written",
    "accepted, stale rows left",                 # elements the update owed still hold old bits
    "wrote outside the payload",                 # a parameter not in the update changed
)
#: Outcomes that fail the hardening test (conformance, not strictness).
FAILING = ("refused after writing",)
MESSAGE_HEAD = 120

#: Topology classes hardening runs on; per implementation, the smallest matrix case of each
#: class it claims (a loader claiming only MoE-TP = MoE-EP = 1 still runs the first).
CLASSES = {
    "unsharded": lambda r: r.moe_tp == 1 and r.moe_ep == 1 and r.moe_dp == 1 and not r.padded,
    "moe_tp": lambda r: r.moe_tp > 1 and not r.padded,
    "moe_ep": lambda r: r.moe_ep > 1 and r.moe_tp == 1,
    "padded": lambda r: r.padded,
    "up_gate": lambda r: r.order == "up_gate",
}


def case_for(impl, topology_class: str, fmt: str):
    """``(case, None)``: the smallest matrix case of ``topology_class`` that ``impl`` claims in
    ``fmt``; ``(None, reason)`` when it claims none."""
    from . import cases

    wanted = CLASSES[topology_class]
    claimed = [c for c in cases.CASES if wanted(c.receiver)
               and claims.unclaimed(impl, "loader", c, fmt) is None]
    if not claimed:
        return None, (f"{impl.name} claims no {topology_class} topology of the matrix in the "
                      f"{fmt} format")
    size = lambda c: (c.receiver.world_size * c.spec.num_layers * c.spec.num_experts  # noqa: E731
                      * c.spec.intermediate * c.spec.hidden, c.id)
    return min(claimed, key=size), None


# --- building the bad update ---------------------------------------------------------------------


def _owned_index(chunk, case, rank, projection=None) -> int:
    """Index of the last entry of ``chunk`` that ``rank`` loads (of ``projection``: gate/up/down
    for per-expert names, w13/w2 for fused ones; stacked names count as owned)."""
    shard = receiver_shard(case.spec, case.receiver, rank)
    for index in range(len(chunk) - 1, -1, -1):
        name = chunk[index][0]
        parsed = parse_receiver_name(name)
        per_expert = parsed is not None and parsed.expert is not None
        if per_expert:
            proj = parsed.projection
        else:
            proj = "w2" if name.endswith(("w2_weight", "down_proj")) else "w13"
        if projection is not None and proj not in projection:
            continue
        if not per_expert or parsed.expert in shard.experts:
            return index
    raise AssertionError(f"receiver rank {rank} owns no entry of the payload")


@dataclass
class BadUpdate:
    """A stream of buckets whose last bucket ends in the bad entry, and words a refusal's
    message must contain (checked for the reference only)."""

    buckets: list
    words: list = field(default_factory=list)


def bad_update(kind: str, fmt: str, case, rank: int) -> BadUpdate:
    """The full valid update of version 1 (every layer, one bucket) made bad by ``kind``."""
    import torch

    chunk = inputs.payload(fmt, case, rank, version=1)
    newer = dict(inputs.payload(fmt, case, rank, version=2))
    spec = case.spec
    if kind == "wrong_dtype":
        name, tensor = chunk.pop(_owned_index(chunk, case, rank))
        return BadUpdate([chunk + [(name, tensor.to(torch.float32))]], ["dtype"])
    if kind == "short_down_proj":
        name, tensor = chunk.pop(_owned_index(chunk, case, rank, ("down", "w2")))
        return BadUpdate([chunk + [(name, tensor[..., :-1].contiguous())]], ["shape"])
    if kind == "unknown_name":
        bogus = ("model.layers.0.mlp.experts.0.gate_proj.weight_scale" if fmt == "compat"
                 else "model.layers.0.mlp.experts.w13_weight_scale")
        return BadUpdate([chunk + [(bogus, chunk[-1][1].clone())]], [bogus])
    if kind == "expert_out_of_range":
        if fmt == "compat":
            bogus = f"model.layers.0.mlp.experts.{spec.num_experts}.gate_proj.weight"
            return BadUpdate([chunk + [(bogus, chunk[0][1].clone())]], [bogus])
        # stacked formats: one expert more than the model (or the rank) has
        name, tensor = chunk.pop(_owned_index(chunk, case, rank, ("w13",)))
        return BadUpdate([chunk + [(name, torch.cat([tensor, tensor[-1:]]))]], ["shape"])
    if kind in ("duplicate_in_bucket", "duplicate_across_buckets"):
        name, tensor = chunk[_owned_index(chunk, case, rank)]
        again = (name, newer[name])  # a different version: last-wins overwriting shows
        if kind == "duplicate_in_bucket":
            return BadUpdate([chunk + [again]], ["duplicate"])
        return BadUpdate([chunk, [again]], ["duplicate"])
    if kind == "missing_expert":
        if fmt == "compat":
            # drop an owned expert's up_proj: its gate_proj still touches w13
            name, _ = chunk.pop(_owned_index(chunk, case, rank, ("up",)))
            expert = parse_receiver_name(name).expert
            return BadUpdate([chunk], ["expert", str(expert)])
        name, tensor = chunk.pop(_owned_index(chunk, case, rank, ("w13",)))
        return BadUpdate([chunk + [(name, tensor[:-1].contiguous())]], ["shape"])
    raise ValueError(f"unknown bad-input kind {kind!r}; expected one of {KINDS}")


# --- feeding it and judging what happened ------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One probe's outcome (:data:`OUTCOMES`), with the exception type for a refusal or crash
    (``key``, what the report groups by) and the head of its message (``detail``)."""

    outcome: str
    error: Optional[BaseException] = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.outcome} ({type(self.error).__name__})" if self.error else self.outcome

    @property
    def detail(self) -> str:
        if self.error is None:
            return ""
        lines = str(self.error).strip().splitlines()
        text = lines[0] if lines else ""
        return text if len(text) <= MESSAGE_HEAD else text[:MESSAGE_HEAD - 3] + "..."

    @property
    def refused(self) -> bool:
        return self.outcome in ("refused", "refused at end_update")


def _changed(before: compare.Snapshot, params) -> bool:
    return any(not compare.same_bits(params[name], rec.copy) for name, rec in before.records.items())


def _state(params, case, rank, before: compare.Snapshot) -> str:
    """Outcome of an accepted update, from the parameters alone."""
    expected = inputs.expected(case, rank, 1)
    for name, rec in before.records.items():
        if name not in expected and not compare.same_bits(params[name], rec.copy):
            return "wrote outside the payload"
    if not _changed(before, params):
        return "accepted, nothing changed"
    stale = wrong = False
    for name, want in expected.items():
        got = compare.raw_bits(params[name])
        miss = got != compare.raw_bits(want)
        if bool(miss.any()):
            old = compare.raw_bits(before.records[name].copy)
            if bool((miss & (got == old)).any()):
                stale = True
            wrong = True
    if stale:
        return "accepted, stale rows left"
    if wrong:
        return "accepted, wrong values written"
    return "accepted, result equals the valid entries'"


def _close(impl, params, kwargs) -> None:
    """Close an update a refused bucket cut short, as an engine would (its verdict on the
    incomplete update is not this probe's business)."""
    try:
        calls.call_optional(impl, "end_update", params, **kwargs)
    except Exception:  # noqa: BLE001
        pass


def probe(impl, kind: str, fmt: str, case, rank: int) -> tuple[Finding, BadUpdate]:
    """Feed ``kind`` to ``impl`` on receiver ``rank`` of ``case`` and classify the outcome.
    Poisoned parameters, the loader's ``begin_update``/``end_update`` hooks around the stream
    when it has them."""
    params = inputs.receiver_params(case, rank)
    bad = bad_update(kind, fmt, case, rank)
    before = compare.snapshot(params)
    kwargs = dict(format=fmt, spec=case.spec, topology=case.receiver, rank=rank)
    calls.call_optional(impl, "begin_update", params, **kwargs)
    for bucket in bad.buckets:
        at_bucket = compare.snapshot(params)
        try:
            calls.call(impl, "load_weights", params, bucket, **kwargs)
        except CallTimeoutError:
            raise
        except Exception as error:  # noqa: BLE001 - a crash is a finding, not a test error
            wrote = _changed(at_bucket, params)
            if isinstance(error, (ValueError, TypeError)):
                finding = Finding("refused after writing" if wrote else "refused", error)
            else:
                finding = Finding("crashed after writing" if wrote else "crashed", error)
            _close(impl, params, kwargs)
            return finding, bad
    if callable(getattr(impl, "end_update", None)):
        try:
            calls.call(impl, "end_update", params, **kwargs)
        except CallTimeoutError:
            raise
        except (ValueError, TypeError) as error:
            return Finding("refused at end_update", error), bad
        except Exception as error:  # noqa: BLE001
            return Finding("crashed at end_update", error), bad
    compare.assert_same_storage(before, params, rank=rank)
    return Finding(_state(params, case, rank, before)), bad

