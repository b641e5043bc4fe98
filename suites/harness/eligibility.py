"""The inputs of the inline-logprob eligibility suite: replica argument parsers and truth tables.

Every config is parsed from a command line by a replica of the training framework's real
argument parser (slime, Relax), so the Namespace carries exactly the fields the real one does.
A decision that reads a field the real Namespace lacks (``getattr(args, "rl_partial_rollouts",
True)``) therefore shows up as a disagreement, which a hand-built config would hide.

Expected decisions come from the truth tables below, written from the on-policy argument in
docs/inline-logprob.md; no code under test is consulted for them. Every case carries
:data:`REFERENCE_EXPLAINER`: when a function disagrees with the tables, it re-runs the function
and the reference with one field changed at a time to name the field that decided the
difference (the comparison with the reference lives here, in the harness: the plugin that
decides the verdict imports no decision).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable, Mapping

from hypothesis import strategies as st

from pytest_weightsync.eligibility import Case, Verdict, normalize_result
from pytest_weightsync.reference_impl.rl.inline_logprob import FIELDS, inline_logprob_eligibility

# ----------------------------------------------------------------------------------------------
# Which field decided a difference: the reference re-run with one field changed at a time.

#: Values tried for a field no FIELDS entry describes (one the frameworks do not define).
_UNKNOWN_FIELD_PROBES = (False, True, 0, 1, None)


def _probes(field, value: object, fields: Mapping[str, object]) -> list[object]:
    """Other valid values of a FIELDS entry ``field`` currently holding ``value``: the ones the
    decision turns on (booleans flipped, 0/1/2 and neighbours of ints, zero and both signs of
    floats, the one-step global batch)."""
    if field.kind == "bool":
        candidates = [not value]
    elif field.kind == "float":
        candidates = [0.0, 0.001, -0.001, -value if isinstance(value, (int, float)) else 0.0]
    else:
        candidates = [0, 1, 2]
        if isinstance(value, int):
            candidates += [value - 1, value + 1]
        if field.kind == "optional_int":
            candidates.append(None)
            rbs, n = fields.get("rollout_batch_size"), fields.get("n_samples_per_prompt", 1)
            if isinstance(rbs, int) and isinstance(n, int):
                candidates.append(rbs * n)
        low = field.minimum
        candidates = [c for c in candidates if c is None or low is None or c >= low]
        if field.kind == "int":
            candidates = [c for c in candidates if c is not None]
    return [c for c in dict.fromkeys(candidates) if c != value or type(c) is not type(value)]


def _other_probes(value: object) -> list[object]:
    """Other values of a config field the reference does not read (it must not matter)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [c for c in (0, 1, 2, value + 1) if c != value]
    if isinstance(value, float):
        return [c for c in (0.0, 0.01, -0.01) if c != value]
    return []


def _answer(func: Callable[[object], object], fields: Mapping[str, object]) -> bool | None:
    """``func``'s decision on a Namespace of ``fields``; ``None`` when it raised (or returned
    something unusable): such a probe says nothing."""
    try:
        return normalize_result(func(argparse.Namespace(**fields)), "probe")[0]
    except Exception:  # a probe the function (or the reference) refuses is skipped
        return None


class ReferenceExplainer:
    """Finds the fields that decided a disagreement by comparing with the reference decision
    (:func:`~pytest_weightsync.reference_impl.rl.inline_logprob.inline_logprob_eligibility`)
    over its table of fields; the rules are in :mod:`pytest_weightsync.eligibility`:

    - a field whose change alone moves the reference's decision but not the function's, or
      moves the function's decision to the expected one while the reference's stays;
    - a field the function looked up that the config does not carry, but only when supplying it
      (at its parser default, for a field of the reference's table; at any simple value for one
      the frameworks do not define) moves the function to the expected decision."""

    #: The fields the reference reads, in its table's order (the failure table's columns).
    fields = tuple(f.name for f in FIELDS)

    def deciding_fields(self, func: Callable[[object], object], case: Case, verdict: Verdict
                        ) -> tuple[list[str], list[str]]:
        """``(fields whose value decided the difference, absent fields whose default did)``
        for one disagreeing case."""
        base = dict(vars(case.config))
        expected, got = case.expected, verdict.eligible
        by_name = {f.name: f for f in FIELDS}
        deciding = []
        if got is not None:
            for name, value in base.items():
                field = by_name.get(name)
                probes = (_probes(field, value, base) if field is not None
                          else _other_probes(value))
                for probe in probes:
                    changed = {**base, name: probe}
                    ref = _answer(inline_logprob_eligibility, changed)
                    fn = _answer(func, changed)
                    if ref is None or fn is None:
                        continue
                    ignored = ref is not expected and fn is got  # reference moves, function stays
                    objects = fn is expected and ref is expected  # function moves to the expected
                    if ignored or objects:
                        deciding.append(name)
                        break
        blamed_absent = []
        for name in verdict.absent_reads:
            field = by_name.get(name)
            if got is None:  # it raised on the absent field: that field decided
                blamed_absent.append(name)
                continue
            probes = (field.default,) if field is not None and not field.required \
                else _UNKNOWN_FIELD_PROBES
            if any(_answer(func, {**base, name: p}) is expected for p in probes):
                blamed_absent.append(name)
        return deciding, blamed_absent


#: The explainer every case of the suite carries.
REFERENCE_EXPLAINER = ReferenceExplainer()


def config_case(label: str, config: argparse.Namespace, expected: bool) -> Case:
    """A case of the suite: ``config`` with its expected decision, explained against the
    reference when a function disagrees."""
    return Case(label, config, expected, explainer=REFERENCE_EXPLAINER)


def generated_case(framework: str, values: dict[str, object]) -> Case:
    """The case of generated ``values`` (see :func:`generated_configs`): parsed from their
    command line, expected from the truth tables."""
    argv = to_argv(values)
    return config_case(f"{framework}: {' '.join(argv)}", parse(framework, argv), oracle(values))


# ----------------------------------------------------------------------------------------------
# Replicas of the argument definitions (flag, type, action, default) in slime
# (slime/utils/arguments.py) and Relax (relax/utils/arguments.py). `--global-batch-size` and
# `--micro-batch-size` are Megatron's, with the defaults both frameworks reset them to.
# A few arguments the decision must ignore are included so that they vary too.


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--colocate", action="store_true", default=False)
    parser.add_argument("--offload", action="store_true", default=False)
    parser.add_argument("--partial-rollout", action="store_true", default=False)
    parser.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true", default=False)
    parser.add_argument("--update-weights-interval", type=int, default=1)
    parser.add_argument("--n-samples-per-prompt", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--num-steps-per-rollout", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--eps-clip", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=0.00)
    parser.add_argument("--use-kl-loss", action="store_true", default=False)
    parser.add_argument("--kl-loss-coef", type=float, default=0.0)
    parser.add_argument("--use-rollout-logprobs", action="store_true", default=False)
    parser.add_argument("--use-tis", action="store_true", default=False)
    parser.add_argument("--use-routing-replay", action="store_true", default=False)
    parser.add_argument("--use-rollout-routing-replay", action="store_true", default=False)

def slime_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime", exit_on_error=False)
    _add_common_arguments(parser)
    parser.add_argument("--rollout-batch-size", type=int, required=True)
    return parser

def relax_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relax", exit_on_error=False)
    _add_common_arguments(parser)
    # Relax derives it from --global-batch-size during validation when omitted.
    parser.add_argument("--rollout-batch-size", type=int, default=None)
    parser.add_argument("--fully-async", action="store_true", default=False)
    parser.add_argument("--hybrid", action="store_true", default=False)
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--num-iters-per-train-update", type=int, default=1)
    return parser

PARSERS = {"slime": slime_parser(), "relax": relax_parser()}

FRAMEWORKS = tuple(PARSERS)

def parse(framework: str, argv: list[str]) -> argparse.Namespace:
    return PARSERS[framework].parse_args(argv)

def to_argv(values: dict[str, object]) -> list[str]:
    """Command line for ``values`` (dest -> value); False and None leave the flag out."""
    argv: list[str] = []
    for dest, value in values.items():
        flag = "--" + dest.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv

# ----------------------------------------------------------------------------------------------
# The oracle: plain truth tables, field by field.

BOOLEAN_TRUTH = {  # field -> {value: does this field allow inline log-probs?}
    "colocate": {True: True, False: False},
    "partial_rollout": {False: True, True: False},
    "use_rollout_logprobs": {False: True, True: False},
}

ROUTING_REPLAY_TRUTH = {  # (use_routing_replay, use_rollout_routing_replay) -> allowed?
    (False, False): True,
    (False, True): True,
    (True, True): True,  # routes come from the rollout: replayed, not recorded
    (True, False): False,  # routes are recorded in the old-policy forward itself
}

def one_optimizer_step_per_rollout(rbs: int, n: int, gbs: int | None, steps: int | None) -> bool:
    if steps is not None:
        return steps == 1
    if gbs is not None:
        return gbs == rbs * n
    return False  # Megatron derives the global batch from micro batch x DP: unknown here

def oracle(v: dict[str, object]) -> bool:
    """Expected decision for the values a command line set (parser defaults elsewhere);
    ``max_staleness`` None means the framework has no such field (slime: synchronous)."""
    return (
        all(BOOLEAN_TRUTH[f][v.get(f, False)] for f in BOOLEAN_TRUTH)
        and ROUTING_REPLAY_TRUTH[
            (v.get("use_routing_replay", False), v.get("use_rollout_routing_replay", False))
        ]
        and one_optimizer_step_per_rollout(
            v["rollout_batch_size"],
            v.get("n_samples_per_prompt", 1),
            v.get("global_batch_size"),
            v.get("num_steps_per_rollout"),
        )
        and v.get("max_staleness") in (None, 0)
        and v.get("update_weights_interval", 1) == 1
        and v.get("kl_coef", 0.0) == 0
    )

# ----------------------------------------------------------------------------------------------
# The decision table: each condition alone, then in combination.

RECIPE = {
    "colocate": True, "rollout_batch_size": 4, "n_samples_per_prompt": 8, "global_batch_size": 32
}

# (id, changes to RECIPE, expected, fields the reference must name as reasons)
DECISION_TABLE = [
    ("on_policy_recipe", {}, True, set()),
    ("not_colocated", {"colocate": False}, False, {"colocate"}),
    ("two_steps_per_rollout", {"global_batch_size": 16}, False, {"global_batch_size"}),
    ("step_spans_two_rollouts", {"global_batch_size": 64}, False, {"global_batch_size"}),
    ("num_steps_1", {"global_batch_size": None, "num_steps_per_rollout": 1}, True, set()),
    ("num_steps_2", {"global_batch_size": None, "num_steps_per_rollout": 2}, False,
     {"num_steps_per_rollout"}),
    ("num_steps_1_and_gbs", {"num_steps_per_rollout": 1}, True, set()),
    ("num_steps_2_and_gbs", {"global_batch_size": 16, "num_steps_per_rollout": 2}, False,
     {"num_steps_per_rollout"}),
    ("no_batch_relation", {"global_batch_size": None}, False, {"global_batch_size"}),
    ("one_sample_per_prompt", {"rollout_batch_size": 32, "n_samples_per_prompt": 1}, True, set()),
    ("max_staleness_1", {"max_staleness": 1}, False, {"max_staleness"}),
    ("max_staleness_0_explicit", {"max_staleness": 0}, True, set()),
    ("update_weights_interval_2", {"update_weights_interval": 2}, False,
     {"update_weights_interval"}),
    ("partial_rollout", {"partial_rollout": True}, False, {"partial_rollout"}),
    ("use_rollout_logprobs", {"use_rollout_logprobs": True}, False, {"use_rollout_logprobs"}),
    ("routing_replay_records", {"use_routing_replay": True}, False, {"use_routing_replay"}),
    ("rollout_routing_replay", {"use_routing_replay": True, "use_rollout_routing_replay": True},
     True, set()),
    ("rollout_routing_replay_only", {"use_rollout_routing_replay": True}, True, set()),
    ("reward_kl", {"kl_coef": 0.001}, False, {"kl_coef"}),
    ("reward_kl_negative", {"kl_coef": -0.001}, False, {"kl_coef"}),
    ("reward_kl_zero_explicit", {"kl_coef": 0.0}, True, set()),
    ("reward_kl_with_kl_loss", {"kl_coef": 0.001, "use_kl_loss": True, "kl_loss_coef": 0.01},
     False, {"kl_coef"}),
    ("reward_kl_negative_with_kl_loss",
     {"kl_coef": -0.05, "use_kl_loss": True, "kl_loss_coef": 0.01}, False, {"kl_coef"}),
    ("loss_kl_needs_only_ref", {"use_kl_loss": True, "kl_loss_coef": 0.01}, True, set()),
    ("loss_kl_negative_coef", {"use_kl_loss": True, "kl_loss_coef": -0.01}, True, set()),
    ("loss_kl_on_zero_coef", {"use_kl_loss": True}, True, set()),
    ("loss_kl_coef_without_loss", {"kl_loss_coef": 0.5}, True, set()),
    ("tis_and_masking_ignored", {"use_tis": True, "mask_offpolicy_in_partial_rollout": True},
     True, set()),
    ("stale_and_partial", {"max_staleness": 1, "partial_rollout": True}, False,
     {"max_staleness", "partial_rollout"}),
    ("async_off_policy", {"colocate": False, "max_staleness": 2, "update_weights_interval": 2,
                          "global_batch_size": 16}, False,
     {"colocate", "max_staleness", "update_weights_interval", "global_batch_size"}),
    ("everything_off", {"colocate": False, "global_batch_size": 8, "update_weights_interval": 3,
                        "partial_rollout": True, "use_rollout_logprobs": True,
                        "use_routing_replay": True, "kl_coef": 0.1}, False,
     {"colocate", "global_batch_size", "update_weights_interval", "partial_rollout",
      "use_rollout_logprobs", "use_routing_replay", "kl_coef"}),
]

def table_rows(framework: str):
    for row_id, changes, expected, blockers in DECISION_TABLE:
        if framework == "slime" and "max_staleness" in changes:
            continue  # slime has no --max-staleness
        yield row_id, {**RECIPE, **changes}, expected, blockers

def table_cases(framework: str) -> list[Case]:
    return [
        config_case(f"{framework}:{row_id}", parse(framework, to_argv(values)), expected)
        for row_id, values, expected, _ in table_rows(framework)
    ]

# ----------------------------------------------------------------------------------------------
# Every combination of the conditions, against the oracle.

BATCH_SHAPES = {  # name -> (global_batch_size, num_steps_per_rollout) for 4 prompts x 8 samples
    "gbs_one_step": (32, None),
    "gbs_two_steps": (16, None),
    "num_steps_1": (None, 1),
    "num_steps_2": (None, 2),
    "unset": (None, None),
}

#: Reward-shaping KL coefficients: negative, zero and positive (any non-zero one blocks).
KL_COEFS = (-0.001, 0.0, 0.001)

#: In-loss KL (use_kl_loss, kl_loss_coef): off, and on with a negative coefficient (the table
#: above has it on with a positive one).
KL_LOSSES = ((False, 0.0), (True, -0.01))

@functools.lru_cache(maxsize=None)
def every_combination(framework: str) -> tuple[Case, ...]:
    """Every combination of the conditions (built once per process: several tests share it)."""
    stalenesses = (None,) if framework == "slime" else (0, 1)
    cases = []
    for colocate, batch, staleness, interval, partial, rollout_lp, replay, kl, kl_loss in (
        itertools.product(
            (True, False), BATCH_SHAPES, stalenesses, (1, 2), (False, True), (False, True),
            ROUTING_REPLAY_TRUTH, KL_COEFS, KL_LOSSES,
        )
    ):
        gbs, steps = BATCH_SHAPES[batch]
        values = {
            "colocate": colocate, "rollout_batch_size": 4, "n_samples_per_prompt": 8,
            "global_batch_size": gbs, "num_steps_per_rollout": steps, "max_staleness": staleness,
            "update_weights_interval": interval, "partial_rollout": partial,
            "use_rollout_logprobs": rollout_lp, "use_routing_replay": replay[0],
            "use_rollout_routing_replay": replay[1], "kl_coef": kl,
            # the in-loss KL must not matter, whatever its sign
            "use_kl_loss": kl_loss[0], "kl_loss_coef": kl_loss[1],
        }
        label = f"{framework}:{batch}"
        cases.append(config_case(label, parse(framework, to_argv(values)), oracle(values)))
    return tuple(cases)

# ----------------------------------------------------------------------------------------------
# Generated configs, including values outside the grid and arguments the decision must ignore.


@st.composite
def generated_configs(draw):
    framework = draw(st.sampled_from(FRAMEWORKS))
    rbs, n = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    samples = rbs * n
    shape = draw(
        st.sampled_from(["one_step", "one_step", "any_gbs", "steps", "steps_and_gbs", "unset"])
    )
    gbs = steps = None
    if shape == "one_step":
        gbs = samples
    elif shape == "any_gbs":
        gbs = draw(st.integers(1, 2 * samples))
    elif shape in ("steps", "steps_and_gbs"):
        steps = draw(st.integers(1, min(samples, 4)))
        if shape == "steps_and_gbs":
            gbs = samples // steps
    # Each condition is drawn with its eligible value more often than not, so that eligible
    # configs (all conditions met at once) are common enough to be generated.
    values = {
        "colocate": draw(st.sampled_from([True, True, False])),
        "rollout_batch_size": rbs,
        "n_samples_per_prompt": n,
        "global_batch_size": gbs,
        "num_steps_per_rollout": steps,
        "max_staleness": None if framework == "slime" else draw(st.sampled_from([0, 0, 1, 3])),
        "update_weights_interval": draw(st.sampled_from([1, 1, 2, 3])),
        "partial_rollout": draw(st.sampled_from([False, False, True])),
        "use_rollout_logprobs": draw(st.sampled_from([False, False, True])),
        "use_routing_replay": draw(st.booleans()),
        "use_rollout_routing_replay": draw(st.booleans()),
        "kl_coef": draw(st.sampled_from([0.0, 0.0, 0.001, -0.001, 0.5])),
        # Ignored by the decision:
        "use_kl_loss": draw(st.booleans()),
        "kl_loss_coef": draw(st.sampled_from([0.0, 0.01, -0.01])),
        "use_tis": draw(st.booleans()),
        "micro_batch_size": draw(st.integers(1, 4)),
        "offload": draw(st.booleans()),
    }
    if framework == "relax":
        values["fully_async"] = draw(st.booleans())
        values["num_iters_per_train_update"] = draw(st.integers(1, 2))
    return framework, values

# ----------------------------------------------------------------------------------------------
# Regression: the intended recipes, parsed by the frameworks' real argument definitions.

ON_POLICY_RECIPE = [
    "--colocate", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
    "--global-batch-size", "32", "--kl-coef", "0", "--use-kl-loss", "--kl-loss-coef", "0",
]

RELAX_ON_POLICY_RECIPE = [*ON_POLICY_RECIPE, "--max-staleness", "0"]

SLIME_OFF_POLICY_RECIPE = [
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--global-batch-size", "16",
    "--update-weights-interval", "2", "--partial-rollout",
]

RELAX_OFF_POLICY_RECIPE = [
    "--fully-async", "--max-staleness", "1", "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "8", "--global-batch-size", "32", "--partial-rollout",
]

def recipe_case(framework: str, argv: list[str], expected: bool) -> Case:
    return config_case(f"{framework}: {' '.join(argv)}", parse(framework, argv), expected)
