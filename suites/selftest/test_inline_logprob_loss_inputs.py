"""Loss inputs for inline old log-probs and a zero in-loss KL.

Inline: ``old_log_probs`` is ``log_probs.detach()`` - bit-identical values, same storage, no
graph - so the importance ratio is exactly 1 and the policy-gradient is exactly the advantage.
Zero KL without a reference forward: KL terms are zeros of each sample's shape. A non-zero KL
without reference log-probs is an error, never a silent zero.
"""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.reference_impl.rl.inline_logprob import (  # noqa: E402
    ConfigFieldTypeError,
    inline_logprob_eligibility,
)
from pytest_weightsync.reference_impl.rl.loss_inputs import (  # noqa: E402
    LossInputsError,
    assemble_loss_inputs,
    kl_loss_coefficient,
)

pytestmark = pytest.mark.weightsync_property("inline_logprob_loss_inputs")

LENGTHS = (3, 1, 7)  # response lengths of three samples


def per_sample_log_probs(seed: int, *, grad: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (-torch.rand(n, generator=gen, dtype=torch.float32) * 4).requires_grad_(grad)
        for n in LENGTHS
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def kl_parser() -> argparse.ArgumentParser:
    # As in slime / Relax: --use-kl-loss store_true (False), --kl-loss-coef float (0.0).
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--use-kl-loss", action="store_true", default=False)
    parser.add_argument("--kl-loss-coef", type=float, default=0.0)
    return parser


def test_inline_old_log_probs_are_the_detached_log_probs():
    log_probs = per_sample_log_probs(0, grad=True)
    inputs = assemble_loss_inputs(log_probs, inline=True, kl_coef=0.0)
    for i, (old, new) in enumerate(zip(inputs.old_log_probs, log_probs)):
        assert torch.equal(bits(old), bits(new)), f"sample {i}: old log-probs differ"
        assert not old.requires_grad and old.grad_fn is None, f"sample {i} carries a graph"
        assert old.data_ptr() == new.data_ptr(), f"sample {i} was copied"
        assert inputs.log_probs[i] is new


def test_inline_ratio_is_one_and_the_gradient_is_the_advantage():
    log_probs = per_sample_log_probs(1, grad=True)
    advantages = [torch.full((n,), float(i + 1) / 3) for i, n in enumerate(LENGTHS)]
    inputs = assemble_loss_inputs(log_probs, inline=True, kl_coef=0.0)
    loss = sum(
        (torch.exp(lp - old) * adv).sum()
        for lp, old, adv in zip(inputs.log_probs, inputs.old_log_probs, advantages)
    )
    loss.backward()
    for i, (lp, adv) in enumerate(zip(log_probs, advantages)):
        assert torch.equal(bits(lp.grad), bits(adv)), f"sample {i}: gradient is not the advantage"


@pytest.mark.parametrize("inline", [True, False])
def test_zero_kl_without_reference_gives_zero_terms_of_each_shape(inline):
    log_probs = per_sample_log_probs(2, grad=True)
    old = None if inline else per_sample_log_probs(3, grad=False)
    inputs = assemble_loss_inputs(log_probs, inline=inline, kl_coef=0.0, old_log_probs=old)
    assert inputs.ref_log_probs is None
    assert len(inputs.kl) == len(LENGTHS)
    for i, (kl, lp) in enumerate(zip(inputs.kl, log_probs)):
        assert isinstance(kl, torch.Tensor)
        assert kl.shape == lp.shape and kl.dtype == lp.dtype, f"sample {i}"
        assert not kl.requires_grad
        assert torch.count_nonzero(kl) == 0


def test_a_single_tensor_keeps_its_structure():
    log_probs = torch.full((2, 5), -0.5, dtype=torch.bfloat16, requires_grad=True)
    inputs = assemble_loss_inputs(log_probs, inline=True, kl_coef=0)
    assert isinstance(inputs.kl, torch.Tensor)
    assert inputs.kl.shape == (2, 5) and inputs.kl.dtype == torch.bfloat16
    assert torch.equal(inputs.old_log_probs.view(torch.int16), log_probs.detach().view(torch.int16))


def test_nonzero_kl_without_reference_log_probs_raises():
    missing = r"kl_coef=0\.01 is non-zero but ref_log_probs are missing"
    with pytest.raises(LossInputsError, match=missing):
        assemble_loss_inputs(per_sample_log_probs(4, grad=True), inline=True, kl_coef=0.01)


def test_kl_with_reference_is_k1_and_differentiable():
    log_probs = per_sample_log_probs(5, grad=True)
    ref = per_sample_log_probs(6, grad=False)
    inputs = assemble_loss_inputs(log_probs, inline=True, kl_coef=0.05, ref_log_probs=ref)
    expected = [lp.detach() - r for lp, r in zip(log_probs, ref)]
    for i, (kl, want) in enumerate(zip(inputs.kl, expected)):
        assert torch.equal(bits(kl), bits(want)), f"sample {i}"
    sum(kl.sum() for kl in inputs.kl).backward()
    for lp in log_probs:
        assert torch.equal(lp.grad, torch.ones_like(lp))


def test_a_separate_old_forward_is_required_when_not_inline():
    with pytest.raises(LossInputsError, match="old_log_probs are required"):
        assemble_loss_inputs(per_sample_log_probs(7, grad=True), inline=False, kl_coef=0.0)


def test_inline_with_separately_computed_old_log_probs_is_refused():
    log_probs = per_sample_log_probs(8, grad=True)
    with pytest.raises(LossInputsError, match="inline-eligible"):
        assemble_loss_inputs(log_probs, inline=True, kl_coef=0.0, old_log_probs=log_probs)


def test_not_inline_uses_the_given_old_log_probs_without_graph():
    log_probs = per_sample_log_probs(9, grad=True)
    old = per_sample_log_probs(10, grad=True)
    inputs = assemble_loss_inputs(log_probs, inline=False, kl_coef=0.0, old_log_probs=old)
    for got, want in zip(inputs.old_log_probs, old):
        assert torch.equal(bits(got), bits(want)) and not got.requires_grad


@pytest.mark.parametrize("which", ["old_log_probs", "ref_log_probs"])
def test_mismatched_shapes_raise_naming_the_sample(which):
    log_probs = per_sample_log_probs(11, grad=True)
    other = per_sample_log_probs(12, grad=False)
    other[1] = torch.zeros(2)
    kwargs = {which: other, "inline": which == "ref_log_probs", "kl_coef": 0.1}
    mismatch = rf"{which}\[1\] has shape \(2,\), log_probs\[1\] has \(1,\)"
    with pytest.raises(LossInputsError, match=mismatch):
        assemble_loss_inputs(log_probs, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"inline": 1, "kl_coef": 0.0}, TypeError, "inline must be bool, got int"),
        ({"inline": True, "kl_coef": "0"}, TypeError, "kl_coef must be a float, got str"),
        ({"inline": True, "kl_coef": float("nan")}, LossInputsError, "kl_coef must be finite"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        assemble_loss_inputs(per_sample_log_probs(13, grad=True), **kwargs)


def test_integer_log_probs_are_refused():
    with pytest.raises(TypeError, match=r"log_probs\[0\] must be a floating-point tensor"):
        assemble_loss_inputs([torch.zeros(3, dtype=torch.int64)], inline=True, kl_coef=0.0)


@pytest.mark.parametrize(
    "argv, coef",
    [([], 0.0), (["--kl-loss-coef", "0.01"], 0.0), (["--use-kl-loss"], 0.0),
     (["--use-kl-loss", "--kl-loss-coef", "0.01"], 0.01)],
)
def test_kl_loss_coefficient_from_the_parsed_config(argv, coef):
    assert kl_loss_coefficient(kl_parser().parse_args(argv)) == coef


def test_kl_loss_coefficient_policy():
    assert kl_loss_coefficient({}) == 0.0  # both absent: parser defaults
    with pytest.raises(ConfigFieldTypeError, match="'use_kl_loss'.*must be bool, got str"):
        kl_loss_coefficient({"use_kl_loss": "True", "kl_loss_coef": 0.1})
    with pytest.raises(ConfigFieldTypeError, match="'kl_loss_coef'.*must be float, got str"):
        kl_loss_coefficient({"use_kl_loss": True, "kl_loss_coef": "0.1"})


def test_on_policy_recipe_needs_neither_old_nor_reference_forward():
    config = argparse.Namespace(
        colocate=True, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8,
        use_kl_loss=False, kl_loss_coef=0.0,
    )
    decision = inline_logprob_eligibility(config)
    assert decision.eligible is True
    log_probs = per_sample_log_probs(14, grad=True)
    inputs = assemble_loss_inputs(
        log_probs, inline=decision.eligible, kl_coef=kl_loss_coefficient(config)
    )
    assert inputs.inline is True and inputs.kl_coef == 0.0
    assert all(torch.count_nonzero(kl) == 0 for kl in inputs.kl)
