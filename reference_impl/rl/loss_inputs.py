"""Assemble the per-token inputs of the GRPO policy loss, with inline old log-probs and zero KL.

Two separate forwards can be skipped in colocated on-policy training:

- the *old-policy* forward, when :func:`pytest_weightsync.reference_impl.rl.inline_logprob.inline_logprob_eligibility`
  says so: ``old_log_probs`` is then ``log_probs.detach()`` - the same values, no graph;
- the *reference-model* forward, when the in-loss KL coefficient is 0: the KL term is then a
  tensor of zeros of the log-probs' shape, so the loss code needs no special case.

A non-zero KL coefficient without reference log-probs is an error, never a silent zero.

The in-loss KL coefficient comes from the config as in slime / Relax (see
:func:`kl_loss_coefficient`):

| field | flag | type | parser default |
| --- | --- | --- | --- |
| `use_kl_loss` | `--use-kl-loss` | bool | False |
| `kl_loss_coef` | `--kl-loss-coef` | float | 0.0 |

The KL estimator is k1, ``log_probs - ref_log_probs`` per token (slime's default
``--kl-loss-type k1``). Log-probs are one tensor or a sequence of per-sample tensors (the
frameworks keep one tensor per sample); the result has the same structure.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.rl.inline_logprob import ConfigField, read_fields

__all__ = [
    "KL_LOSS_FIELDS",
    "LossInputs",
    "LossInputsError",
    "assemble_loss_inputs",
    "kl_loss_coefficient",
]

LogProbs = Union[torch.Tensor, Sequence[torch.Tensor]]

KL_LOSS_FIELDS: tuple[ConfigField, ...] = (
    ConfigField("use_kl_loss", "--use-kl-loss", "bool", False),
    ConfigField("kl_loss_coef", "--kl-loss-coef", "float", 0.0),
)


class LossInputsError(WeightSyncError):
    """The loss inputs are missing, contradictory or of mismatched shapes."""


@dataclass(frozen=True)
class LossInputs:
    """What the policy loss consumes, per token, in the structure the log-probs came in."""

    log_probs: LogProbs  # current policy, carries the graph
    old_log_probs: LogProbs  # no graph
    ref_log_probs: LogProbs | None
    kl: LogProbs  # k1 per token; zeros when the coefficient is 0 and no reference is given
    kl_coef: float
    inline: bool


def kl_loss_coefficient(config: object) -> float:
    """The in-loss KL coefficient: ``kl_loss_coef`` when ``use_kl_loss`` is set, else 0."""
    values, _ = read_fields(config, KL_LOSS_FIELDS)
    return float(values["kl_loss_coef"]) if values["use_kl_loss"] else 0.0


def _as_samples(name: str, value: LogProbs) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(value, torch.Tensor):
        samples, single = (value,), True
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        samples, single = tuple(value), False
    else:
        raise TypeError(
            f"{name} must be a tensor or a sequence of per-sample tensors, "
            f"got {type(value).__name__}"
        )
    for i, t in enumerate(samples):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}[{i}] must be a floating-point tensor, got {got}")
    return samples, single


def _matching(
    name: str, value: LogProbs, like: tuple[torch.Tensor, ...], single: bool
) -> tuple[torch.Tensor, ...]:
    samples, other_single = _as_samples(name, value)
    if other_single != single or len(samples) != len(like):
        raise LossInputsError(
            f"{name} has {len(samples)} sample(s) ({'tensor' if other_single else 'sequence'}), "
            f"log_probs has {len(like)} ({'tensor' if single else 'sequence'})"
        )
    for i, (t, ref) in enumerate(zip(samples, like)):
        if t.shape != ref.shape:
            raise LossInputsError(
                f"{name}[{i}] has shape {tuple(t.shape)}, log_probs[{i}] has {tuple(ref.shape)}"
            )
    return samples


def assemble_loss_inputs(
    log_probs: LogProbs,
    *,
    inline: bool,
    kl_coef: float,
    old_log_probs: LogProbs | None = None,
    ref_log_probs: LogProbs | None = None,
) -> LossInputs:
    """Build :class:`LossInputs` from the training forward's ``log_probs``.

    ``inline`` is the eligibility decision (``decision.eligible``): when True the old-policy
    log-probs are ``log_probs.detach()`` and passing ``old_log_probs`` as well is an error
    (two sources for one value); when False ``old_log_probs`` is required. ``kl_coef`` is the
    in-loss KL coefficient (:func:`kl_loss_coefficient`); when it is non-zero
    ``ref_log_probs`` is required.
    """
    if not isinstance(inline, bool):
        raise TypeError(f"inline must be bool, got {type(inline).__name__} {inline!r}")
    if not isinstance(kl_coef, numbers.Real) or isinstance(kl_coef, bool):
        raise TypeError(f"kl_coef must be a float, got {type(kl_coef).__name__} {kl_coef!r}")
    if not math.isfinite(kl_coef):
        raise LossInputsError(f"kl_coef must be finite, got {kl_coef!r}")
    samples, single = _as_samples("log_probs", log_probs)

    if inline:
        if old_log_probs is not None:
            raise LossInputsError(
                "old_log_probs were given but the config is inline-eligible: the old-policy "
                "log-probs are log_probs.detach(); drop the separate forward or set inline=False"
            )
        old = tuple(t.detach() for t in samples)
    else:
        if old_log_probs is None:
            raise LossInputsError(
                "old_log_probs are required when the config is not inline-eligible "
                "(inline=False): run the old-policy forward"
            )
        old = tuple(t.detach() for t in _matching("old_log_probs", old_log_probs, samples, single))

    if ref_log_probs is not None:
        ref = _matching("ref_log_probs", ref_log_probs, samples, single)
        kl = tuple(t - r.detach() for t, r in zip(samples, ref))
    elif kl_coef != 0:
        raise LossInputsError(
            f"kl_coef={kl_coef!r} is non-zero but ref_log_probs are missing: the KL term needs "
            "the reference model's log-probs (set the KL coefficient to 0 or run the "
            "reference forward)"
        )
    else:
        ref = None
        kl = tuple(torch.zeros_like(t, requires_grad=False) for t in samples)

    def shape(xs: tuple[torch.Tensor, ...] | None) -> LogProbs | None:
        if xs is None:
            return None
        return xs[0] if single else xs

    return LossInputs(
        log_probs=shape(samples),
        old_log_probs=shape(old),
        ref_log_probs=shape(ref),
        kl=shape(kl),
        kl_coef=float(kl_coef),
        inline=inline,
    )
