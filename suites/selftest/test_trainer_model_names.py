"""Every trainer model the distributed suites build is the Qwen model it claims to be.

Real exporters (slime, Megatron-Bridge, verl) convert every parameter of the model they are
handed and stop at a name the family does not have. So the models built in the trainer ranks -
the expert-only suite's (``reference_impl/trainer/megatron_state.py``) and the whole-model
suite's (``megatron_whole.py``) - are held, in real gloo ranks, every rank, PP 1 and PP 2, to
two statements of the families' real parameter set that share nothing with the code that
builds them:

* Megatron-Bridge 0.3.1's own registries (``suites/selftest/bridge_registry.py``, read from the
  installed source): every parameter must be matched by one of ``Qwen3MoEBridge`` /
  ``Qwen3NextBridge``'s mappings, and (Qwen3-MoE) what they convert to is exactly the
  checkpoint's non-expert tensor set - nothing missing either;
* a converter that knows only the real names (``suites/selftest/qwen_converter.py``, slime's
  behaviour: ``Unknown parameter name``).

Both must reject megatron-core's default ``GPTModel`` (learned absolute positions, LayerNorm
with biases): built beside each expert-only model, it shows the checks have teeth. The
settings that decide the parameter set are held to Bridge's ``Qwen3MoEModelProvider``.
Finally an exporter that converts every parameter with that converter before exporting passes
the expert-only and the whole-model distributed suites.
"""

from __future__ import annotations

import pytest

from suites.harness import distributed as dh
from suites.harness import model_distributed as md
from suites.harness.cases import DIST_CASES

from . import qwen_converter

pytestmark = [pytest.mark.weightsync_backend("megatron"),
              pytest.mark.weightsync_property("trainer_layout")]
#: The tests that read Megatron-Bridge's registries.
needs_bridge = pytest.mark.usefixtures("_bridge_installed")

ETP2_TE = next(c for c in DIST_CASES if "T.tp2ep2etp2pp1te" in c.id)
PP2_SEQ = next(c for c in DIST_CASES if "T.tp1ep2etp1pp2seq" in c.id)
#: Whole-model cases: Qwen3-MoE TP2 x EP2 x ETP2 with the float32 router and expert bias;
#: Qwen3.5 PP2 tied with the MTP draft and a GDN layer (Transformer Engine spec); Qwen3-MoE
#: PP2 from megatron-core's local spec; Qwen3.5 PP2 untied, SequentialMLP experts.
Q3_BIAS = next(c for c in md.MODEL_DIST_CASES
               if c.case.spec.family == "qwen3_moe" and c.case.spec.expert_bias
               and c.case.trainer.pp == 1 and c.case.trainer.etp == 2)
Q35_PP2_TIED = next(c for c in md.MODEL_DIST_CASES
                    if c.case.spec.family == "qwen3_5_moe" and c.case.spec.tied
                    and c.case.trainer.pp == 2)
Q3_LOCAL = next(c for c in md.MODEL_DIST_CASES if c.layer_spec == "local")
Q35_PP2_SEQ = next(c for c in md.MODEL_DIST_CASES
                   if c.case.spec.family == "qwen3_5_moe" and c.case.trainer.pp == 2
                   and c.case.trainer.expert_impl == "sequential")
#: TransformerConfig fields that decide which parameters exist.
NAME_SETTINGS = ("normalization", "qk_layernorm", "add_bias_linear", "add_qkv_bias",
                 "gated_linear_unit")


@pytest.fixture(autouse=True)
def _megatron_installed():
    dh.require_megatron()


@pytest.fixture
def _bridge_installed():
    from pytest_weightsync.reference_impl.backends import bridge

    try:
        bridge.installed_directory()
    except ImportError as exc:
        pytest.skip(f"megatron_bridge is not importable: {exc}")


def _registry(family, expert_bias=False):
    from . import bridge_registry

    return bridge_registry.registry(family, expert_bias)


# --------------------------------------------------------------------------------------------
# Rank bodies
# --------------------------------------------------------------------------------------------


def _megatron_default_model(spec, topo):
    """megatron-core's ``GPTModel`` with its default settings around the same experts (what
    the expert-only suite built before): the negative control."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from pytest_weightsync.reference_impl.backends.megatron import moe_transformer_config
    from pytest_weightsync.reference_impl.trainer import megatron_state as ms

    config = moe_transformer_config(
        hidden=spec.hidden, ffn=spec.intermediate, experts=spec.num_experts,
        topk=min(2, spec.num_experts), tp=topo.tp, ep=topo.ep, etp=topo.etp, dtype=spec.dtype,
        grouped=topo.expert_impl == "te_grouped", cpu_init=True, num_layers=spec.num_layers,
        kv_channels=ms.KV_CHANNELS, pipeline_model_parallel_size=topo.pp,
        pipeline_dtype=spec.dtype)
    return GPTModel(config=config, transformer_layer_spec=ms.layer_spec(spec, topo),
                    vocab_size=ms.VOCAB_PER_TP_RANK * topo.tp, max_sequence_length=8,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def _expert_only_built(spec, topo):
    """Rank body: the expert-only suite's model of this rank (names, settings) and the
    default ``GPTModel``'s names."""
    from megatron.core import parallel_state as ps

    from pytest_weightsync.reference_impl.trainer import megatron_state as ms

    with ms.megatron_parallel_state(spec, topo):
        config = ms.transformer_config(spec, topo)
        model = ms.build_model(spec, topo, config)
        gpt = ms.unwrapped(model[0])
        default = _megatron_default_model(spec, topo)
        out = {"stage": ps.get_pipeline_model_parallel_rank(),
               "names": sorted(n for n, _ in model[0].named_parameters()),
               "default_names": sorted(n for n, _ in default.named_parameters()),
               "config": {k: getattr(config, k) for k in ms.QWEN3_MOE_CONFIG},
               "model": {"position_embedding_type": gpt.position_embedding_type,
                         "share_embeddings_and_output_weights":
                             gpt.share_embeddings_and_output_weights}}
        del model, gpt, default
    return out


def _whole_model_built(mcase):
    """Rank body: the whole-model suite's model of this rank (names incl. the expert-bias
    buffers an exporter reads, settings)."""
    from megatron.core import parallel_state as ps

    from pytest_weightsync.reference_impl.trainer import megatron_state as ms
    from pytest_weightsync.reference_impl.trainer import megatron_whole as mw

    spec, topo = mcase.case.spec, mcase.case.trainer
    with ms.megatron_parallel_state(spec.experts, topo):
        config = mw.transformer_config(spec, topo)
        model = mw.build_model(spec, topo, config, mcase.layer_spec)
        gpt = ms.unwrapped(model[0])
        out = {"stage": ps.get_pipeline_model_parallel_rank(),
               "names": sorted(mw.model_state(model)),
               "config": {k: getattr(config, k) for k in
                          NAME_SETTINGS + ("attention_output_gate", "moe_shared_expert_gate")},
               "model": {"position_embedding_type": gpt.position_embedding_type,
                         "share_embeddings_and_output_weights":
                             gpt.share_embeddings_and_output_weights}}
        del model, gpt
    return out


# --------------------------------------------------------------------------------------------
# Checks in the pytest process
# --------------------------------------------------------------------------------------------


def _global(name: str, offset: int) -> str:
    """``name`` (wrappers removed) with a decoder layer's stage-local number made global."""
    import re

    from .bridge_registry import bridge_name

    return re.sub(r"^decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", bridge_name(name))


def _converted(reg, spec, topo, ranks) -> set:
    """What Bridge converts every rank's non-expert tensors into (global layer numbers;
    copies of the first stage's embedding left out, as the checkpoint has one source)."""
    from pytest_weightsync.reference_impl.model.layout import stage_layers

    from .bridge_registry import bridge_name, hf_names

    def copy(name, stage):  # a tied output layer; the embedding of a later stage (MTP)
        own = bridge_name(name)
        return (getattr(spec, "tied", False) and own == "output_layer.weight") or \
            (stage > 0 and own == "embedding.word_embeddings.weight")

    stages = stage_layers(spec.num_layers, topo)
    names = {_global(n, stages[r["stage"]].start) for r in ranks for n in r["names"]
             if ".mlp.experts." not in n and not copy(n, r["stage"])}
    return hf_names(reg, names)


def _assert_known(reg, family, ranks, converter=True):
    """Every rank's names are matched by ``reg`` and (``converter``) converted by the strict
    converter."""
    for rank, built in enumerate(ranks):
        unknown = _unknown(reg, built["names"])
        assert not unknown, (f"rank {rank}: parameters no {family} model has (Megatron-Bridge "
                             f"finds no mapping): {unknown}")
        rejected = _rejected(family, built["names"]) if converter else set()
        assert not rejected, f"rank {rank}: Unknown parameter name: {sorted(rejected)}"


def _unknown(reg, names):
    from .bridge_registry import unknown

    return unknown(reg, names)


@needs_bridge
@pytest.mark.parametrize("dist", [ETP2_TE, PP2_SEQ], ids=lambda c: c.id)
def test_the_expert_only_trainer_is_a_qwen3_moe(rank_pool, dist):
    """Every rank's parameters are Qwen3-MoE's (Bridge and the strict converter know each
    one, and together they convert to exactly a Qwen3-MoE checkpoint's non-expert tensors);
    megatron-core's default ``GPTModel`` around the same experts is rejected by both."""
    from pytest_weightsync.reference_impl.model.model_spec import hf_params, qwen3_moe

    spec, topo = dist.spec, dist.trainer
    ranks = rank_pool.run(_expert_only_built, dist.world, spec, topo)
    reg = _registry("qwen3_moe")
    _assert_known(reg, "qwen3_moe", ranks)
    checkpoint = set(hf_params(qwen3_moe(num_layers=spec.num_layers)))  # non-expert names
    assert _converted(reg, spec, topo, ranks) == checkpoint
    for rank, built in enumerate(ranks):
        assert built["config"] == _expected_qwen3_moe_config(), rank
        assert built["model"] == {"position_embedding_type": "rope",
                                  "share_embeddings_and_output_weights": False}, rank
    # the negative control: what the suite built before
    first = _unknown(reg, ranks[0]["default_names"])
    assert "embedding.position_embeddings.weight" in first, first
    assert "decoder.layers.0.input_layernorm.bias" in first, first
    last = _unknown(reg, ranks[-1]["default_names"])
    assert "decoder.final_layernorm.bias" in last, last
    assert {"embedding.position_embeddings.weight", "decoder.layers.0.input_layernorm.bias"} <= \
        _rejected("qwen3_moe", ranks[0]["default_names"])
    assert "decoder.final_layernorm.bias" in _rejected("qwen3_moe", ranks[-1]["default_names"])


def _rejected(family, names) -> set:
    """The names the strict converter refuses with ``Unknown parameter name``."""
    out = set()
    for name in names:
        try:
            qwen_converter.hf_names(family, name)
        except ValueError as error:
            assert str(error) == f"{qwen_converter.UNKNOWN}: {name}", error
            out.add(name)
    return out


def _expected_qwen3_moe_config() -> dict:
    """Bridge's ``Qwen3MoEModelProvider`` defaults of the settings the ranks report."""
    from pytest_weightsync.reference_impl.trainer.megatron_state import QWEN3_MOE_CONFIG

    from .bridge_registry import provider_defaults

    provider = provider_defaults("Qwen3MoEModelProvider")
    return {key: provider[key] for key in QWEN3_MOE_CONFIG}


@needs_bridge
@pytest.mark.parametrize("whole", [Q3_BIAS, Q35_PP2_TIED, Q3_LOCAL, Q35_PP2_SEQ],
                         ids=lambda c: c.id)
def test_the_whole_model_trainer_is_the_family_it_claims(rank_pool, whole):
    """Every rank's parameters (and expert-bias buffers) are matched by the family's Bridge
    registry (the expert bias by the GLM-4.5 router's mapping, for specs that declare it);
    Qwen3-MoE's convert to exactly the checkpoint's non-expert tensors; the strict converter
    knows every one of the Transformer Engine spec's."""
    from pytest_weightsync.reference_impl.model.model_spec import hf_params

    spec, topo = whole.case.spec, whole.case.trainer
    ranks = rank_pool.run(_whole_model_built, whole.world, whole)
    reg = _registry(spec.family, expert_bias=spec.expert_bias)
    # slime's converters know no local-spec input norm (Bridge's registry does)
    _assert_known(reg, spec.family, ranks, converter=whole.layer_spec == "te")
    for rank, built in enumerate(ranks):
        settings = built["config"]
        assert {k: settings[k] for k in NAME_SETTINGS} == {
            k: v for k, v in _expected_qwen3_moe_config().items() if k in NAME_SETTINGS}, rank
        q35 = spec.family == "qwen3_5_moe"
        assert settings["attention_output_gate"] is q35 and \
            settings["moe_shared_expert_gate"] is q35, (rank, settings)
        assert built["model"] == {"position_embedding_type": "rope",
                                  "share_embeddings_and_output_weights": spec.tied}, rank
    if spec.family == "qwen3_moe":
        assert _converted(reg, spec, topo, ranks) == set(hf_params(spec))
    assert {r["stage"] for r in ranks} == set(range(topo.pp))


@needs_bridge
def test_the_qwen_settings_are_megatron_bridges():
    """The settings that decide the parameter set are those of Bridge's
    ``Qwen3MoEModelProvider`` (``Qwen3NextModelProvider`` inherits them) and
    ``Qwen3MoEBridge.provider_bridge``; Qwen3.5's gates are ``Qwen3NextBridge``'s."""
    from pytest_weightsync.reference_impl.trainer.megatron_state import (
        QWEN3_MOE_CONFIG,
        QWEN3_MOE_MODEL,
    )
    from pytest_weightsync.reference_impl.trainer.megatron_whole import ROTARY_BASE

    from .bridge_registry import PROVIDERS, provider_bridge_settings, provider_defaults, source

    provider = provider_defaults("Qwen3MoEModelProvider")
    bridge = provider_bridge_settings("qwen3_moe")
    for key, value in {**QWEN3_MOE_CONFIG, **QWEN3_MOE_MODEL}.items():
        assert provider[key] == value, (key, provider[key], value)
        assert bridge.get(key, value) == value, (key, bridge[key], value)
    assert "class Qwen3NextModelProvider(Qwen3MoEModelProvider):" in source(PROVIDERS)
    assert provider_defaults("Qwen3NextModelProvider")["rotary_base"] == \
        ROTARY_BASE["qwen3_5_moe"]
    assert ROTARY_BASE["qwen3_moe"] == provider["rotary_base"]
    nxt = provider_bridge_settings("qwen3_5_moe")
    assert nxt["attention_output_gate"] is True and nxt["moe_shared_expert_gate"] is True
    assert nxt["qk_layernorm"] is True


def test_the_strict_converter_knows_real_names_only():
    """Its own rules, without ranks: real names convert, what no Qwen model has raises."""
    assert qwen_converter.hf_names(
        "qwen3_moe", "module.module.decoder.layers.3.mlp.experts.linear_fc1.weight5") == (
        "model.layers.3.mlp.experts.5.gate_proj.weight",
        "model.layers.3.mlp.experts.5.up_proj.weight")
    assert qwen_converter.hf_names("qwen3_5_moe", "mtp.layers.0.transformer_layer.mlp."
                                   "shared_experts.gate_weight") == (
        "mtp.layers.0.mlp.shared_expert_gate.weight",)
    for family, name in (("qwen3_moe", "embedding.position_embeddings.weight"),
                         ("qwen3_moe", "decoder.final_layernorm.bias"),
                         ("qwen3_moe", "decoder.layers.0.self_attention.linear_qkv.bias"),
                         ("qwen3_moe", "decoder.layers.0.self_attention.in_proj.weight"),
                         ("qwen3_moe", "mtp.layers.0.enorm.weight"),
                         ("qwen3_5_moe", "decoder.layers.0.input_layernorm.weight")):
        with pytest.raises(ValueError, match=f"Unknown parameter name: {name}"):
            qwen_converter.hf_names(family, name)


# --------------------------------------------------------------------------------------------
# An exporter that converts every parameter passes both distributed suites
# --------------------------------------------------------------------------------------------


class ConvertEveryParameterExporter:
    """Converts the name of every tensor it is handed with :mod:`.qwen_converter` (raising
    ``Unknown parameter name`` as slime does), then exports as the reference does. It claims
    the Transformer Engine spec only, as slime's converters know only its names."""

    name = "convert-every-parameter"

    def __init__(self):
        import dataclasses

        from pytest_weightsync.reference_impl.impl import ReferenceImplementation

        self.capabilities = dataclasses.replace(ReferenceImplementation.capabilities,
                                                layer_specs=frozenset({"te"}))

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes, model=None, engine=None):
        from pytest_weightsync.reference_impl.impl import ReferenceImplementation

        family = getattr(spec, "family", "qwen3_moe")  # expert-only: a Qwen3-MoE trainer
        converted = [hf for name in model_state for hf in qwen_converter.hf_names(family, name)]
        if not converted:
            raise ValueError("nothing to convert")
        return ReferenceImplementation().export_weights_distributed(
            model_state, config=config, format=format, spec=spec, trainer=trainer,
            receiver=receiver, delivery=delivery, bucket_bytes=bucket_bytes, model=model,
            engine=engine)


@pytest.mark.parametrize("dist, fmt", [(ETP2_TE, "direct"), (PP2_SEQ, "compat")],
                         ids=["etp2-te-direct", "pp2-seq-compat"])
def test_an_exporter_converting_every_parameter_passes_the_expert_only_suite(rank_pool, dist,
                                                                             fmt):
    impl = ConvertEveryParameterExporter()
    dh.require_claim(impl, dist, fmt)
    result = dh.run_and_judge(rank_pool, impl, dist, [fmt])
    assert result.formats == {fmt} and len(result.checked) == 2


@pytest.mark.parametrize("whole, fmt", [(Q3_BIAS, "compat"), (Q35_PP2_TIED, "direct")],
                         ids=["qwen3-bias-compat", "qwen35-pp2-tied-direct"])
def test_an_exporter_converting_every_parameter_passes_the_whole_model_suite(rank_pool, whole,
                                                                             fmt):
    impl = ConvertEveryParameterExporter()
    md.require_claim(impl, whole, fmt)
    result = md.run(rank_pool, impl, whole, [fmt])
    for update in range(len(result.updates)):
        assert md.judge_update(result, update)
    if whole.case.spec.tied:
        md.check_tied(result)
    if whole.case.spec.mtp_layers:
        md.check_draft(result)
