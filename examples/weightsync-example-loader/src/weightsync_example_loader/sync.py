"""The example package's implementation under test: one object, both sides of the sync.

``ExampleSync`` is what a team ships: the receiver-side loader (:mod:`.loader`,
:mod:`.model_loader`) and the trainer-side distributed exporter (:mod:`.model_exporter`: whole
models; expert-only updates through :mod:`.exporter`) under one name, so
``pytest -p weightsync --pyargs pytest_weightsync.suites --weightsync-only example`` judges
both. Its broken twins are registered on their own: ``example-swapped`` (a loader that swaps
the gate/up halves of ``w13``) and ``example-unregrouped`` (an exporter that forgets to
regroup ``linear_fc1`` after the ETP gather).
"""

from __future__ import annotations

import torch

from pytest_weightsync.protocols import MODEL_PARTS, TARGETS, Capabilities

from weightsync_example_loader.loader import ExampleLoader
from weightsync_example_loader.model_exporter import ExampleModelExporter
from weightsync_example_loader.model_loader import ModelLoading


class ExampleSync(ModelLoading, ExampleLoader, ExampleModelExporter):
    """Loads and exports compat, packed and direct payloads for unpadded receivers; loads and
    exports whole Qwen3-MoE / Qwen3.5-MoE models (every parameter, the MTP draft too) in
    compat and direct, from every trainer layout megatron-core builds (TP, EP x ETP, even and
    uneven PP, SequentialMLP and TEGroupedMLP experts)."""

    name = "example"
    capabilities = Capabilities(formats={"compat", "packed", "direct"},
                                orders={"gate_up", "up_gate"}, padded=False,
                                model_parts=MODEL_PARTS, targets=TARGETS)

    def load_weights(self, params, payload, *, format, spec, topology, rank,
                     targets=None) -> None:
        if not hasattr(spec, "family"):  # experts only
            return super().load_weights(params, payload, format=format, spec=spec,
                                        topology=topology, rank=rank)
        payload = list(payload)
        copies, zeros, experts = self.plan_model(params, payload, format, spec, topology, rank,
                                                 targets)
        for target, entries in experts.items():
            if not entries:
                continue
            prefix = "draft." if target == "draft" else ""
            view = {name[len(prefix):]: t for name, t in params.items() if name.startswith(prefix)
                    and ".mlp.experts." in name}
            expert_spec = spec.experts if target == "target" else spec.draft_experts
            copies += self.plan(view, entries, format, expert_spec, topology, rank)
        with torch.no_grad():
            for dst in zeros:
                dst.zero_()
            for dst, src in copies:
                dst.copy_(src)
