"""The trainer state distributed exporters get is what Megatron-Core and Transformer Engine build.

* TEGroupedMLP: the one modelled piece, Transformer Engine's ``GroupedLinear``, must set the
  attributes TE's source sets. TE is not installed on CPU, so :data:`TE_SOURCE_FACTS` is a
  committed, cited statement of that source (not a copy of the code) and the modelled values
  are checked against it; where TE imports, its own source is checked too.
* Everything above that piece is megatron-core's installed code, run here in real gloo ranks:
  under explicit expert comms (expert TP > 1 or EP > 1) megatron hands TE
  ``parallel_mode=None``, so fc1 AND fc2 weights carry ``partition_dim=0``; without them TE
  gets ``"column"`` / ``"row"``; ``allreduce`` is ``not (EP > 1)``.
* ``get_model``'s wrapping: DDP around Float16Module around ``GPTModel``, real
  ``TransformerLayer`` s with global ``layer_number``, every parameter carrying
  ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` (the router and norms
  the defaults), each on storage inside DDP's contiguous parameter buffer.
"""

from __future__ import annotations

import pytest

from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology

#: NVIDIA/TransformerEngine ``transformer_engine/pytorch/module/grouped_linear.py``,
#: ``GroupedLinear.reset_parameters`` (commit 3ea1356190e88a50d8c2cae17e80c4e6ae96d442, the
#: same at 0069563f606859d4fb5d663e1c92509a30e99f35): for every GEMM ``i`` it calls
#: ``set_tensor_model_parallel_attributes`` on ``weight{i}`` with ``is_parallel`` always true,
#: ``dim`` 1 when ``parallel_mode`` is ``"row"`` and 0 otherwise (``None`` included), ``stride``
#: 1; that helper (``transformer_engine/pytorch/distributed.py``) sets exactly the three
#: attributes below. By parallel mode:
TE_SOURCE_FACTS = {
    None: {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1},
    "column": {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1},
    "row": {"tensor_model_parallel": True, "partition_dim": 1, "partition_stride": 1},
}
ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


def test_modelled_te_grouped_linear_sets_what_te_sets():
    from pytest_weightsync.reference_impl.trainer.te_grouped import TE_PARALLEL_MODES, te_weight_attributes

    assert set(TE_PARALLEL_MODES) == set(TE_SOURCE_FACTS)
    for mode, facts in TE_SOURCE_FACTS.items():
        assert te_weight_attributes(mode) == facts, mode


def test_the_installed_te_sets_what_the_facts_say():
    te = pytest.importorskip("transformer_engine.pytorch",
                             reason="Transformer Engine is not installed (it needs CUDA)")
    import inspect

    source = inspect.getsource(te.GroupedLinear.reset_parameters)
    assert "is_parallel=True" in source
    assert 'dim=1 if self.parallel_mode == "row" else 0' in source
    assert "stride=1" in source


def test_megatron_core_still_defines_what_is_compiled_from_it():
    pytest.importorskip("megatron.core")
    from pytest_weightsync.reference_impl.trainer.te_grouped import (
        MEGATRON_TE_CLASSES,
        megatron_te_grouped_linears,
    )

    classes = megatron_te_grouped_linears()
    assert tuple(classes) == MEGATRON_TE_CLASSES
    assert classes["TEColumnParallelGroupedLinear"].__mro__[1] is classes["TEGroupedLinear"]
    assert classes["TEGroupedLinear"].__module__ == "megatron.core.extensions.transformer_engine"


def _built_state(spec, topo):
    """Rank body: build the rank's model as the harness does; report what exporters read."""
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.trainer import trainer
    from pytest_weightsync.reference_impl.trainer.megatron_state import (
        megatron_model_state,
        megatron_parallel_state,
        unwrapped,
    )

    rank = dist.get_rank()
    with megatron_parallel_state(spec, topo):
        values = trainer.trainer_state(spec, topo, rank, synth.full_weights(spec, 1))
        model, params = megatron_model_state(spec, topo, rank, values)
        chunk = model[0]
        gpt = unwrapped(chunk)
        buffers = [(b.param_data.data_ptr(), b.param_data.numel() * b.param_data.element_size())
                   for b in chunk.buffers + chunk.expert_parallel_buffers]
        inside = {n: any(lo <= p.data_ptr() < lo + size for lo, size in buffers)
                  for n, p in params.items()}
        experts = gpt.decoder.layers[0].mlp.experts
        out = {
            "wrappers": [type(chunk).__name__, type(chunk.module).__name__,
                         type(chunk.module.module).__name__],
            "config": type(chunk.config).__name__,
            "layers": [(type(layer).__name__, layer.layer_number) for layer in gpt.decoder.layers],
            "experts": type(experts).__name__,
            "modes": {fc: getattr(getattr(experts, fc, None), "parallel_mode", "-")
                      for fc in ("linear_fc1", "linear_fc2")},
            "attributes": {n: {a: getattr(p, a, "unset") for a in ATTRIBUTES}
                           for n, p in params.items()},
            "in_buffer": inside,
        }
        del model, params, chunk, gpt, experts
        return out


SPEC = MoESpec(num_layers=4, num_experts=4, hidden=8, intermediate=4)


@pytest.mark.parametrize("tp, ep, etp, pp, explicit", [(2, 2, 2, 1, True), (2, 1, 1, 2, False)],
                         ids=["ep2-etp2-explicit-comm", "ep1-etp1"])
def test_te_grouped_experts_carry_what_megatron_and_te_set(rank_pool, tp, ep, etp, pp, explicit):
    pytest.importorskip("megatron.core")
    topo = TrainerTopology(tp=tp, ep=ep, etp=etp, pp=pp, expert_impl="te_grouped")
    states = rank_pool.run(_built_state, 4, SPEC, topo)
    for rank, state in enumerate(states):
        assert state["experts"] == "TEGroupedMLP"
        # megatron-core's own decision: parallel_mode None under explicit expert comms
        assert state["modes"] == ({"linear_fc1": None, "linear_fc2": None} if explicit
                                  else {"linear_fc1": "column", "linear_fc2": "row"}), rank
        experts = {n: a for n, a in state["attributes"].items() if ".experts." in n}
        assert len(experts) == 2 * (SPEC.num_layers // pp) * (SPEC.num_experts // ep)
        for name, attrs in experts.items():
            fc = "linear_fc1" if ".linear_fc1." in name else "linear_fc2"
            mode = state["modes"][fc]
            assert {a: attrs[a] for a in ATTRIBUTES[:3]} == TE_SOURCE_FACTS[mode], name
            assert attrs["allreduce"] is (ep == 1), name
        if explicit:  # the quirk: a row-parallel fc2 reported as split along dim 0
            assert all(a["partition_dim"] == 0 for n, a in experts.items() if "linear_fc2" in n)


def test_the_model_is_wrapped_and_attributed_as_get_model_does(rank_pool):
    pytest.importorskip("megatron.core")
    topo = TrainerTopology(tp=2, ep=2, etp=1, pp=2, expert_impl="sequential")
    states = rank_pool.run(_built_state, 4, SPEC, topo)
    for rank, state in enumerate(states):
        assert state["wrappers"] == ["DistributedDataParallel", "Float16Module", "GPTModel"]
        assert state["config"] == "TransformerConfig"
        stage = rank // 2
        assert state["layers"] == [("TransformerLayer", 2 * stage + 1),
                                   ("TransformerLayer", 2 * stage + 2)], rank
        assert state["experts"] == "SequentialMLP"
        for name, attrs in state["attributes"].items():
            assert "unset" not in [attrs[a] for a in ATTRIBUTES[:3]], name
            assert name.startswith("module.module."), name
        router = state["attributes"]["module.module.decoder.layers.0.mlp.router.weight"]
        assert {a: router[a] for a in ATTRIBUTES[:3]} == {
            "tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}
        fc1 = state["attributes"][
            "module.module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
        assert (fc1["tensor_model_parallel"], fc1["partition_dim"], fc1["allreduce"]) == \
            (True, 0, False)
        assert all(state["in_buffer"].values()), [n for n, ok in state["in_buffer"].items()
                                                  if not ok]
