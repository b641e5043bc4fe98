"""The whole-model cases: a model, an engine, a trainer, and the targets an update reaches.

A handful, chosen to cover between them what differs from the expert matrix
(``suites/harness/cases.py``) while the CPU run stays short: engine TP 1, 2 and 4 with fewer
KV heads than TP ranks, a vocabulary no TP size divides (and a rank that holds only padding
rows), tied and untied embeddings, a float32 router with the float32 expert bias, the MTP
draft updated and frozen, both gate/up orders, MoE-EP, and trainers with PP 2 (one layer per
stage: a stage-local layer name lands on another layer; 2 + 1 layers on uneven stages), TP 2,
ETP 2, both expert modules, and KV heads replicated over engine ranks (2 KV heads on TP 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, TrainerTopology
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec, qwen3_5_moe, qwen3_moe


@dataclass(frozen=True)
class ModelCase:
    """One whole-model refit: ``spec`` trained on ``trainer``, served on ``receiver``; the
    update reaches ``targets`` (``("target",)`` with a draft present: the draft is frozen)."""

    spec: ModelSpec
    receiver: ReceiverTopology
    trainer: TrainerTopology
    targets: tuple

    @property
    def frozen(self) -> tuple:
        """The targets of the model this update does not reach."""
        return tuple(t for t in self.spec.targets if t not in self.targets)

    @property
    def id(self) -> str:
        r, t = self.receiver, self.trainer
        frozen = "-frozen_draft" if self.frozen else ""
        return (f"{self.spec.id}-R.tp{r.tp}ep{r.moe_ep}{'gu' if r.order == 'gate_up' else 'ug'}"
                f"-T.tp{t.tp}pp{t.pp}ep{t.ep}etp{t.etp}"
                f"{'te' if t.expert_impl == 'te_grouped' else 'seq'}{frozen}")


def _case(spec, receiver, trainer, targets=None) -> ModelCase:
    return ModelCase(spec, receiver, trainer, spec.targets if targets is None else targets)


MODEL_CASES = (
    # Qwen3-MoE on TP 2 (1 KV head: replicated), vocab 37 padded; trainer PP 2 x EP 2.
    _case(qwen3_moe(), ReceiverTopology(tp=2), TrainerTopology(tp=1, ep=2, pp=2)),
    # Qwen3.5-MoE (GDN + attention + shared expert), tied embeddings, MTP draft, TP 1; trainer
    # TP 2 PP 2 EP 2 ETP 2 (the tied embedding lives on both stages).
    _case(qwen3_5_moe(tied=True), ReceiverTopology(tp=1),
          TrainerTopology(tp=2, ep=2, etp=2, pp=2)),
    # Qwen3.5-MoE on TP 4 (MoE-EP 2, up/gate runner, 1 KV head on 4 ranks, a rank of vocab
    # padding only), MTP draft; trainer EP 4 with TEGroupedMLP.
    _case(qwen3_5_moe(linear_k_heads=4, linear_v_heads=8, num_kv_heads=1),
          ReceiverTopology(tp=4, moe_ep=2, order="up_gate"),
          TrainerTopology(tp=1, ep=4, expert_impl="te_grouped")),
    # float32 router and float32 e_score_correction_bias, tied, engine TP 2 x MoE-EP 2.
    _case(qwen3_moe(tied=True, router_dtype=torch.float32, expert_bias=True),
          ReceiverTopology(tp=2, moe_ep=2), TrainerTopology(tp=1, ep=2, pp=2)),
    # the served model updated, its MTP draft frozen (SGLang selector="target").
    _case(qwen3_5_moe(), ReceiverTopology(tp=2), TrainerTopology(), ("target",)),
    # 2 KV heads on engine TP 4: each KV head replicated on 2 ranks (rank r holds head
    # r // 2: a loader that takes r % 2 fails here and nowhere else); 3 layers on uneven
    # trainer stages (2 + 1) under TP 2.
    _case(qwen3_moe(num_layers=3, num_kv_heads=2), ReceiverTopology(tp=4),
          TrainerTopology(tp=2, pp=2, first_stage_layers=2)),
    # engine TP 3: 64 padded vocabulary rows do not divide by 3, so SGLang pads to 64 x 3
    # (192 rows, 64 per rank: ranks 1 and 2 hold padding only; the trainer pads to 128), the
    # one KV head is replicated on all 3 ranks, and the experts are split in thirds (MoE-TP 3).
    _case(qwen3_moe(num_heads=6, intermediate=6), ReceiverTopology(tp=3), TrainerTopology(ep=4)),
)


def model_case_params(cases=MODEL_CASES, where=None) -> list:
    """``pytest.param`` list of ``cases`` (those ``where(case)`` keeps), with readable ids."""
    import pytest

    return [pytest.param(case, id=case.id) for case in cases if where is None or where(case)]
