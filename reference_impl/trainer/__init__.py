"""The trainer side as Megatron-Core and Transformer Engine build it, and the gathers over it.

Trainer ranks' shards of the synthetic weights (:mod:`.trainer`), real megatron-core models
filled from them (:mod:`.megatron_state` for MoE layers, :mod:`.megatron_whole` and
:mod:`.megatron_model` for whole models, :mod:`.te_grouped` for TE's grouped experts), and the
collectives an exporter runs over them: the owner-balanced BF16 gather (:mod:`.bf16_gather`,
:mod:`.gather_plan`) and component-ordered TP gathers (:mod:`.component_gather`). A trainer
is filled from the oracle as a real one is filled by its optimizer; it knows nothing of wire
formats or engines.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors", "model", "oracle", "kernels", "backends")
