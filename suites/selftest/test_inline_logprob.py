"""The reference inline log-prob eligibility decision: its reasons, defaults and type policy.

The conformance part (every eligibility function against the truth tables) is
``suites/conformance/test_eligibility.py``; this file checks what only the reference promises
- the fields it names as reasons, the defaults it documents and takes, the errors it raises -
over the same replica parsers and tables (``suites/harness/eligibility.py``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from pytest_weightsync.reference_impl.rl import inline_logprob
from pytest_weightsync.reference_impl.rl.inline_logprob import (
    FIELDS,
    ConfigFieldTypeError,
    ConfigFieldValueError,
    InconsistentConfigError,
    MissingConfigFieldError,
    inline_logprob_eligibility,
)

from ..harness.eligibility import (
    FRAMEWORKS,
    ON_POLICY_RECIPE,
    PARSERS,
    RECIPE,
    RELAX_ON_POLICY_RECIPE,
    oracle,
    parse,
    table_rows,
    to_argv,
)

pytestmark = pytest.mark.weightsync_property("inline_logprob_eligibility")


def test_decision_table_rows_match_the_truth_tables():
    """The hand-written expectations and the oracle tell the same story."""
    for framework in FRAMEWORKS:
        for row_id, values, expected, blockers in table_rows(framework):
            assert oracle(values) is expected, row_id
            assert (not blockers) is expected, row_id


@pytest.mark.parametrize(
    "framework, row_id, values, blockers",
    [(fw, r, v, b) for fw in FRAMEWORKS for r, v, _, b in table_rows(fw)],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_reference_names_each_blocking_field_and_value(framework, row_id, values, blockers):
    config = parse(framework, to_argv(values))
    decision = inline_logprob_eligibility(config)
    assert {r.field for r in decision.reasons} == blockers
    for reason in decision.reasons:
        assert reason.value == getattr(config, reason.field)
        assert str(reason).startswith(f"{reason.field}={reason.value!r}")


def test_real_namespaces_lack_the_field_the_original_check_read():
    for framework, argv in (("slime", ON_POLICY_RECIPE), ("relax", RELAX_ON_POLICY_RECIPE)):
        config = parse(framework, argv)
        assert not hasattr(config, "rl_partial_rollouts")
        assert config.partial_rollout is False


def test_reference_reads_only_fields_the_frameworks_define():
    relax = parse("relax", RELAX_ON_POLICY_RECIPE)
    slime = parse("slime", ON_POLICY_RECIPE)
    read = set(inline_logprob_eligibility(relax).fields_read)
    assert read <= set(vars(relax))
    assert read - set(vars(slime)) == {"max_staleness"}
    decision = inline_logprob_eligibility(slime)
    assert decision.defaulted == ("max_staleness",)
    assert decision.eligible is True


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_documented_defaults_are_the_parser_defaults(framework):
    parser = PARSERS[framework]
    for field in FIELDS:
        if field.name == "max_staleness" and framework == "slime":
            continue
        if field.required:
            assert field.name == "rollout_batch_size"
            continue
        assert parser.get_default(field.name) == field.default, field.name
        assert field.flag in parser._option_string_actions, field.flag


# ----------------------------------------------------------------------------------------------
# The missing-field and type policy of the reference.


@pytest.mark.parametrize("field", [f for f in FIELDS if not f.required], ids=lambda f: f.name)
def test_an_absent_field_takes_its_default_and_never_flips_the_decision(field):
    for row_id, values, expected, _ in table_rows("relax"):
        config = parse("relax", to_argv(values))
        if getattr(config, field.name) != field.default:
            continue
        stripped = argparse.Namespace(**{k: v for k, v in vars(config).items() if k != field.name})
        decision = inline_logprob_eligibility(stripped)
        assert decision.eligible is expected, row_id
        assert field.name in decision.defaulted


def test_a_missing_required_field_raises_naming_it():
    config = vars(parse("relax", to_argv(RECIPE)))
    del config["rollout_batch_size"]
    required = r"'rollout_batch_size' \(--rollout-batch-size\) is required"
    with pytest.raises(MissingConfigFieldError, match=required):
        inline_logprob_eligibility(argparse.Namespace(**config))
    with pytest.raises(MissingConfigFieldError, match="rollout_batch_size"):
        inline_logprob_eligibility({"colocate": True})


def test_unknown_extra_fields_are_ignored():
    base = vars(parse("relax", to_argv(RECIPE)))
    noisy = {**base, "rl_partial_rollouts": True, "async_mode": "full", "max_staleness_s": 9}
    assert inline_logprob_eligibility(argparse.Namespace(**noisy)).eligible is True


def test_a_mapping_decides_like_a_namespace():
    for framework in FRAMEWORKS:
        for row_id, values, expected, _ in table_rows(framework):
            config = parse(framework, to_argv(values))
            from_mapping = inline_logprob_eligibility(dict(vars(config)))
            assert from_mapping == inline_logprob_eligibility(config), row_id
            assert from_mapping.eligible is expected, row_id


@pytest.mark.parametrize(
    "field, value, wanted",
    [
        ("max_staleness", "0", "int"),
        ("max_staleness", 0.0, "int"),
        ("max_staleness", None, "int"),
        ("rollout_batch_size", 4.0, "int"),
        ("rollout_batch_size", None, "int"),
        ("global_batch_size", "32", "int or None"),
        ("update_weights_interval", True, "int"),
        ("colocate", 1, "bool"),
        ("colocate", "True", "bool"),
        ("partial_rollout", 0, "bool"),
        ("partial_rollout", None, "bool"),
        ("kl_coef", "0", "float"),
        ("kl_coef", False, "float"),
    ],
)
def test_a_wrong_type_raises_naming_field_and_type(field, value, wanted):
    config = {**vars(parse("relax", to_argv(RECIPE))), field: value}
    with pytest.raises(ConfigFieldTypeError) as info:
        inline_logprob_eligibility(config)
    message = str(info.value)
    assert f"{field!r}" in message
    assert f"must be {wanted}, got {type(value).__name__}" in message


@pytest.mark.parametrize(
    "field, value",
    [("rollout_batch_size", 0), ("n_samples_per_prompt", -1), ("global_batch_size", 0),
     ("num_steps_per_rollout", 0), ("max_staleness", -1), ("update_weights_interval", 0),
     ("kl_coef", math.nan), ("kl_coef", math.inf)],
)
def test_an_out_of_range_value_raises_naming_field(field, value):
    config = {**vars(parse("relax", to_argv(RECIPE))), field: value}
    with pytest.raises(ConfigFieldValueError, match=f"'{field}'"):
        inline_logprob_eligibility(config)


def test_contradicting_batch_fields_raise():
    config = parse("relax", to_argv({**RECIPE, "num_steps_per_rollout": 2}))  # 32 vs 32 // 2
    contradiction = "global_batch_size=32 contradicts num_steps_per_rollout=2"
    with pytest.raises(InconsistentConfigError, match=contradiction):
        inline_logprob_eligibility(config)


def test_every_field_is_documented_in_the_module_and_the_docs():
    texts = [inline_logprob.__doc__]
    docs = Path(__file__).resolve().parents[2] / "docs" / "inline-logprob.md"
    if docs.is_file():  # a source checkout; an installed wheel carries no docs/
        texts.append(docs.read_text())
    for text in texts:
        for field in FIELDS:
            assert f"`{field.name}`" in text, field.name
            assert f"`{field.flag}`" in text, field.flag
