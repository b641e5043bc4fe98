"""Whole-model refits at Qwen3.5-35B-A3B's shapes, on the GPU.

Four layers of Qwen3.5-35B-A3B (three Gated DeltaNet layers and one full-attention layer
with its output gate, 256 experts of FFN 512 plus the shared expert, the 248,320-token
vocabulary untied) and its MTP draft, refit three times through the reference whole-model
receiver on engines of TP 1, TP 2 x MoE-EP 2 and TP 4 (two KV heads on four ranks:
replicated; the last rank holds vocab padding) in every whole-model format. Every parameter
is poisoned first and compared bit for bit after each update (``gpu_harness.
run_model_updates``; the same steps run on CPU at small sizes in tests/test_gpu_suites_cpu.py).
On an H200 each case takes 24-43 s (three updates of the first and last engine rank, every
parameter built and compared on the GPU): 296 s for the nine.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_35b_a3b
from pytest_weightsync.vocabulary import MODEL_FORMATS

from . import gpu_harness as h

pytestmark = [pytest.mark.gpu, pytest.mark.weightsync_property("repeated-updates")]

SPEC = qwen3_5_35b_a3b(num_layers=4)
ENGINES = [
    pytest.param(ReceiverTopology(tp=1), id="tp1"),
    pytest.param(ReceiverTopology(tp=2, moe_ep=2), id="tp2-ep2"),
    pytest.param(ReceiverTopology(tp=4, order="up_gate"), id="tp4-ug"),
]


@pytest.mark.parametrize("fmt", MODEL_FORMATS)
@pytest.mark.parametrize("receiver", ENGINES)
def test_whole_model_refits_at_qwen35_35b_a3b_shapes_are_bit_exact_on_the_gpu(receiver, fmt):
    log = h.run_model_updates(SPEC, receiver, fmt, "cuda", updates=3)
    assert log.updates == 3 and log.params_checked > 0
