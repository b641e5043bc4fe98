"""The vLLM layout model is vLLM 0.33.0's: every modelled fact, held to the wheel's source.

vLLM does not import here (``reference_impl/backends/vllm.py`` says why), so its source is
read from the pinned wheel (:mod:`vllm_source`) and its loading code compiled from that text
and run on CPU (:mod:`vllm_engine`):

* routed experts: vLLM's MoE parallel config, expert map, ``create_weights`` and
  ``RoutedExperts.load_weights`` on every modelled topology (MoE-TP, DP-flattened TP, even
  and uneven EP) must give :func:`vllm_layout.expert_shard`'s placement, names and shapes, and
  load each expert format the model says it loads into exactly the modelled rows (the
  formats it says vLLM ignores: nothing written, nothing raised); every placement is a
  harness engine (``receiver_topology``): SGLang's default layout where it is even, the
  ``expert_placement="linear_uneven"`` engine where it is not, whose expected state is what
  vLLM's own loading leaves;
* whole models (Qwen3-MoE, Qwen3.5-MoE with its MTP draft, tied and untied, KV replication):
  the engine built from vLLM's layer classes has exactly the layout's names, shapes and
  dtypes, and the checkpoint streamed through the models' own ``load_weights`` renaming and
  the layers' own loaders lands bit-exact where the layout's segments say;
* constants, mappings and the module tree the names walk are read from the AST (the module
  tree and engine checks live in :mod:`vllm_source_checks`, which the mutation test shares).

A mutation test breaks each modelled fact in turn and requires a check here to fail.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools

import pytest
import torch

from pytest_weightsync.reference_impl.backends import vllm as facts
from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.model import vllm_layout as v
from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    TopologyError,
    receiver_param_shapes,
    receiver_shard,
)
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe
from pytest_weightsync.reference_impl.oracle import model_synth, synth
from pytest_weightsync.suites.selftest import vllm_engine as ve
from pytest_weightsync.suites.selftest import vllm_source as src
from pytest_weightsync.suites.selftest.vllm_source_checks import (
    check_engine_facts,
    check_module_tree,
)

pytestmark = [pytest.mark.weightsync_property("receiver_layout")]

VERSION = 5


@pytest.fixture(scope="module", autouse=True)
def wheel():
    return src.require_wheel()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _differs(expected: dict, got: dict) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit (NaN payloads included)."""
    out = []
    for name in sorted(set(expected) | set(got)):
        e, g = expected.get(name), got.get(name)
        if e is None or g is None or e.shape != g.shape or e.dtype != g.dtype \
                or not torch.equal(_bits(e), _bits(g)):
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------
# Routed experts
# --------------------------------------------------------------------------------------------

EXPERT_SPECS = {"E4": MoESpec(2, 4, 8, 8), "E5": MoESpec(1, 5, 8, 8)}
EXPERT_TOPOS = [v.VllmTopology(tp=1), v.VllmTopology(tp=2), v.VllmTopology(tp=4),
                v.VllmTopology(tp=2, dp=2), v.VllmTopology(tp=2, expert_parallel=True),
                v.VllmTopology(tp=4, expert_parallel=True),
                v.VllmTopology(tp=3, expert_parallel=True),
                v.VllmTopology(tp=2, dp=2, expert_parallel=True)]
EXPERT_CASES = [pytest.param(spec, topo, id=f"{sid}-{topo.id}")
                for sid, spec in EXPERT_SPECS.items() for topo in EXPERT_TOPOS
                if spec.intermediate % topo.moe_tp == 0]


def expert_payload(spec: MoESpec, fmt: str, layer: int):
    """One layer's experts in ``fmt``, named relative to the MoE block as vLLM's runner gets
    them, laid out as the vLLM model says the format is (:data:`vllm_layout.W13_HALVES`,
    ``FUSED_CHUNK_DIM``, ``PER_EXPERT_FUSED_CHUNK_DIM``)."""
    full = synth.full_weights(spec, VERSION)[layer]
    halves = {v.SHARD_IDS[p]: p for p in ("gate", "up")}
    order = [halves[sid] for sid in v.W13_HALVES]
    if fmt == "compat":
        return [(f"{e}.{p}_proj.weight", w[p]) for e, w in enumerate(full)
                for p in ("gate", "up", "down")]
    if fmt == "hf_fused":
        gate_up = torch.stack([torch.cat([w[p] for p in order], dim=v.FUSED_CHUNK_DIM - 1)
                               for w in full])
        return [(v.FUSED_GATE_UP, gate_up), ("down_proj", torch.stack([w.down for w in full]))]
    if fmt == "per_expert_fused":
        return [(f"{e}.{v.FUSED_GATE_UP}.weight",
                 torch.cat([w[p] for p in order], dim=v.PER_EXPERT_FUSED_CHUNK_DIM))
                for e, w in enumerate(full)] + [(f"{e}.down_proj.weight", w.down)
                                               for e, w in enumerate(full)]
    if fmt in ("packed", "direct"):  # this project's fused names, global shape
        return [("w13_weight", torch.stack([torch.cat([w.gate, w.up]) for w in full])),
                ("w2_weight", torch.stack([w.down for w in full]))]
    raise ValueError(fmt)


def expected_experts(spec: MoESpec, topo: v.VllmTopology, rank: int, layer: int) -> dict:
    """What the vLLM model says rank ``rank`` holds of ``layer`` after a full load."""
    return _expected_from(spec, v.expert_shard(spec, topo, rank), layer)


def _routed(spec, topo, rank, layer=0):
    return ve.RoutedExpertsRank(f"model.layers.{layer}.mlp.experts", spec.num_experts,
                                spec.hidden, spec.intermediate, topo.tp, topo.dp, rank,
                                topo.expert_parallel, spec.dtype)


def _held(routed) -> dict:
    return {"w13_weight": routed.layer.w13_weight.data, "w2_weight": routed.layer.w2_weight.data}


def check_expert_placement(spec: MoESpec, topo: v.VllmTopology) -> list[str]:
    """vLLM's parallel config, expert map and allocation against the model, every rank."""
    problems = []
    for rank in range(topo.world_size):
        shard = v.expert_shard(spec, topo, rank)
        parallel = ve.moe_parallel(topo.tp, topo.dp, rank, topo.expert_parallel)
        got = (parallel.tp_size, parallel.tp_rank, parallel.ep_size, parallel.ep_rank)
        want = (topo.moe_tp, shard.moe_tp_rank, topo.moe_ep, shard.moe_ep_rank)
        if got != want:
            problems.append(f"rank {rank}: vLLM (moe_tp, tp_rank, ep, ep_rank) {got}, model {want}")
        local, mapping = ve.expert_map(parallel.ep_size, parallel.ep_rank, spec.num_experts)
        held = list(range(spec.num_experts)) if mapping is None else \
            sorted((int(mapping[e]), e) for e in range(spec.num_experts) if mapping[e] >= 0)
        held = held if mapping is None else [e for _, e in held]
        if held != list(shard.experts) or local != len(shard.experts):
            problems.append(f"rank {rank}: vLLM holds experts {held}, model {list(shard.experts)}")
        routed = _routed(spec, topo, rank)
        shapes = {k: tuple(t.shape) for k, t in _held(routed).items()}
        model = {n.rpartition(".")[2]: s for n, s in v.expert_param_shapes(
            MoESpec(1, spec.num_experts, spec.hidden, spec.intermediate), topo, rank).items()}
        if shapes != model:
            problems.append(f"rank {rank}: vLLM allocates {shapes}, model {model}")
    return problems


def check_expert_loads(spec: MoESpec, topo: v.VllmTopology) -> list[str]:
    """Each format through vLLM's ``load_weights``: loaded ones land where the model says,
    ignored ones write nothing, report nothing loaded and raise nothing."""
    problems = []
    formats = sorted(v.LOADED_FORMATS) + ["per_expert_fused"] + sorted(v.IGNORED_FORMATS)
    for rank in range(topo.world_size):
        routed = _routed(spec, topo, rank)
        problems += _load_formats(spec, topo, rank, routed, formats)
    return problems


def _load_formats(spec, topo, rank, routed, formats) -> list[str]:
    problems = []
    for fmt in formats:
        for t in _held(routed).values():
            t.fill_(float("nan"))
        before = {k: t.clone() for k, t in _held(routed).items()}
        try:
            loaded = routed.load(expert_payload(spec, fmt, 0))
        except Exception as exc:  # a payload vLLM cannot take is a difference too
            problems.append(f"rank {rank} {fmt}: vLLM raised {type(exc).__name__}: {exc}")
            continue
        loads = fmt in v.LOADED_FORMATS or fmt == "per_expert_fused"
        want = expected_experts(spec, topo, rank, 0) if loads else before
        bad = _differs(want, _held(routed))
        if bad:
            problems.append(f"rank {rank} {fmt}: {bad} differ from the model")
        if not loads and loaded:
            problems.append(f"rank {rank} {fmt}: vLLM reports {sorted(set(loaded))} loaded")
    return problems


@pytest.mark.parametrize("spec,topo", EXPERT_CASES)
def test_vllm_places_and_allocates_experts_where_the_model_says(spec, topo):
    assert check_expert_placement(spec, topo) == []


@pytest.mark.parametrize("spec,topo", EXPERT_CASES)
def test_vllm_loads_each_expert_format_where_the_model_says(spec, topo):
    assert check_expert_loads(spec, topo) == []


@pytest.mark.parametrize("spec,topo", EXPERT_CASES)
def test_every_vllm_expert_placement_is_a_harness_engine(spec, topo):
    """Even placements are SGLang's default layout; uneven ones (E % EP != 0) the harness's
    ``expert_placement="linear_uneven"`` engine. Either way the harness's placement, shapes
    and expected state are what vLLM's own code allocates and loads, rank by rank."""
    receiver = v.receiver_topology(spec, topo)
    even = spec.num_experts % topo.moe_ep == 0
    assert receiver.expert_placement == ("even" if even else "linear_uneven")
    if even:
        assert receiver == ReceiverTopology(tp=topo.world_size, moe_ep=topo.moe_ep)
    for rank in range(topo.world_size):
        mine, sglang = v.expert_shard(spec, topo, rank), receiver_shard(spec, receiver, rank)
        assert (mine.experts, mine.row_start, mine.rows, mine.buffer_rows) == (
            sglang.experts, sglang.row_start, sglang.rows, sglang.buffer_rows)
        assert [s for s in v.expert_param_shapes(spec, topo, rank).values()] == \
            list(receiver_param_shapes(spec, receiver, rank).values())
        expected = synth.expected_receiver_params(spec, receiver, rank, VERSION)
        routed = _routed(spec, topo, rank)
        routed.load(expert_payload(spec, "compat", 0))
        assert _differs({"w13_weight": expected["model.layers.0.mlp.experts.w13_weight"],
                         "w2_weight": expected["model.layers.0.mlp.experts.w2_weight"]},
                        _held(routed)) == []


def test_uneven_ep_has_no_sglang_topology_and_blocked_padding_is_refused():
    spec = EXPERT_SPECS["E4"]
    with pytest.raises(TopologyError, match="divisible"):  # SGLang's even placement refuses it
        receiver_shard(spec, ReceiverTopology(tp=3, moe_ep=3), 0)
    with pytest.raises(TopologyError, match="intermediate"):
        v.expert_shard(MoESpec(1, 4, 8, 6), v.VllmTopology(tp=4), 0)
    post = src.method_node("model_executor/layers/fused_moe/config.py", "FusedMoEConfig",
                           "__post_init__")
    text = ast.unparse(post)
    assert "assert self.intermediate_size % tp_size == 0" in text
    # vLLM's block-aligned padded TP loading is FP8's only (fused_moe/oracle/fp8.py)
    setters = [m for m in src.members() if m.endswith(".py") and m.startswith("vllm/")
               and "tp_shard_with_padding = True" in src.text(m)]
    assert setters == ["vllm/model_executor/layers/fused_moe/oracle/fp8.py"]


def check_expert_constants() -> list[str]:
    problems = []
    for n in (1, 4, 5):
        got = ve.expert_params_mapping(n)
        if got != v.expert_mapping(n):
            problems.append(f"expert mapping of {n} experts: vLLM {got[:4]}..., "
                            f"model {v.expert_mapping(n)[:4]}...")
    loader = src.method_node("model_executor/layers/fused_moe/routed_experts.py",
                             "RoutedExperts", "weight_loader")
    for node in ast.walk(loader):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == \
                "SHARD_ID_TO_SHARDED_DIM":
            if ast.literal_eval(node.value) != v.SHARDED_DIM:
                problems.append(f"SHARD_ID_TO_SHARDED_DIM is {ast.unparse(node.value)}")
            break
    else:
        problems.append("RoutedExperts.weight_loader has no SHARD_ID_TO_SHARDED_DIM")
    runner = src.class_node("model_executor/layers/fused_moe/runner/moe_runner.py", "MoERunner")
    if f"self.{v.ROUTED_EXPERTS} = routed_experts" not in ast.unparse(runner):
        problems.append(f"MoERunner holds no {v.ROUTED_EXPERTS}")
    create = ast.unparse(src.method_node(
        "model_executor/layers/fused_moe/unquantized_fused_moe_method.py",
        "UnquantizedFusedMoEMethod", "create_weights"))
    for name in v.PARAMETERS["RoutedExperts"]:
        if f"register_parameter('{name}'" not in create:
            problems.append(f"create_weights registers no {name}")
    strategy = ast.unparse(src.function_node(
        "model_executor/layers/fused_moe/expert_map_manager.py",
        "determine_expert_placement_strategy"))
    if "num_expert_group is not None and num_expert_group > 1" not in strategy \
            or v.PLACEMENTS != ("linear",):
        problems.append("round-robin placement is no longer limited to grouped-expert models")
    return problems


def test_expert_mapping_shard_dims_names_and_placement_strategy_are_vllms():
    assert check_expert_constants() == []


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------

MODEL_CASES = [
    pytest.param(qwen3_moe(), v.VllmTopology(tp=1), id="q3-tp1"),
    pytest.param(qwen3_moe(), v.VllmTopology(tp=2), id="q3-kv1-tp2"),
    pytest.param(qwen3_moe(), v.VllmTopology(tp=4), id="q3-kv1-tp4"),
    pytest.param(qwen3_moe(num_kv_heads=4), v.VllmTopology(tp=4, expert_parallel=True),
                 id="q3-kv4-tp4-ep"),
    pytest.param(qwen3_moe(tied=True), v.VllmTopology(tp=2), id="q3-tied-tp2"),
    pytest.param(qwen3_5_moe(), v.VllmTopology(tp=1), id="q35-tp1"),
    pytest.param(qwen3_5_moe(), v.VllmTopology(tp=2), id="q35-tp2"),
    pytest.param(qwen3_5_moe(tied=True), v.VllmTopology(tp=2, expert_parallel=True),
                 id="q35-tied-tp2-ep"),
]


def checkpoint_stream(spec):
    """Every checkpoint tensor of ``spec`` at :data:`VERSION` (experts per expert)."""
    w = model_synth.full_model(spec, VERSION)
    stream = list(w.dense.items())
    for target, layers in w.experts.items():
        prefix = "model.layers" if target == "target" else "mtp.layers"
        for layer, experts in layers.items():
            for e, ew in enumerate(experts):
                stream += [(f"{prefix}.{layer}.mlp.experts.{e}.{p}_proj.weight", ew[p])
                           for p in ("gate", "up", "down")]
    return stream


def expected_model(spec, topo, rank) -> dict:
    out = {}
    for name, p in v.engine_params(spec, topo, rank).items():
        if p.part != "experts":
            out[name] = model_synth.segment_values(spec, p, VERSION)
    return out


def check_model(spec, topo, rank) -> list[str]:
    ns = ve.base_namespace(topo.tp, rank)
    mods = ve.build_rank(spec, topo, rank, ns)
    params = ve.parameters(mods)
    layout = v.engine_params(spec, topo, rank)
    problems = [f"vLLM's tree has {n}, the model does not"
                for n in sorted(set(params) - set(layout))]
    problems += [f"the model has {n}, vLLM's tree does not"
                 for n in sorted(set(layout) - set(params))]
    for name in sorted(set(params) & set(layout)):
        got, want = (tuple(params[name].shape), params[name].dtype), (layout[name].shape,
                                                                      layout[name].dtype)
        if got != want:
            problems.append(f"{name}: vLLM {got}, model {want}")
    if problems:
        return problems
    for p in params.values():
        p.data.fill_(float("nan"))
    stream = checkpoint_stream(spec)
    unheld = ve.load(mods, ve.served_stream(spec.family, stream), ns)
    if spec.mtp_layers:
        draft = {k[len(v.DRAFT_PREFIX):]: m for k, m in mods.items()
                 if k.startswith(v.DRAFT_PREFIX)}
        own = [(n, t) for n, t in ve.draft_stream(stream)
               if n.startswith("model.") and "embed_tokens" not in n]  # shared with the target
        unheld += ve.load(draft, own, ns)
    problems += [f"nothing in vLLM's tree holds {n}" for n in unheld]
    got = {n: t.data for n, t in params.items() if layout[n].part != "experts"}
    problems += [f"{n} differs from the model's segments" for n in
                 _differs(expected_model(spec, topo, rank), got)]
    for name, p in layout.items():
        if p.part == "experts":
            experts = spec.experts if p.target == "target" else spec.draft_experts
            value_spec = experts if p.target == "target" else model_synth.draft_value_spec(spec)
            value_layer = p.layer if p.target == "target" else spec.num_layers + p.layer
            shard = v.expert_shard(experts, topo, rank)
            want = _expected_from(value_spec, shard, value_layer)[name.rpartition(".")[2]]
            if _differs({name: want}, {name: params[name].data}):
                problems.append(f"{name} differs from the expert placement")
    return problems


def _expected_from(spec, shard, layer) -> dict:
    rows = torch.arange(shard.row_start, shard.row_start + shard.rows)
    cols = torch.arange(spec.hidden)
    w13 = torch.zeros(len(shard.experts), 2 * shard.rows, spec.hidden, dtype=spec.dtype)
    w2 = torch.zeros(len(shard.experts), spec.hidden, shard.rows, dtype=spec.dtype)
    for slot, expert in enumerate(shard.experts):
        for p in ("gate", "up"):
            at = v.W13_HALVES.index(v.SHARD_IDS[p]) * shard.rows
            w13[slot, at:at + shard.rows] = synth.expert_block(spec, VERSION, layer, expert, p,
                                                               rows, cols)
        w2[slot] = synth.expert_block(spec, VERSION, layer, expert, "down", cols, rows)
    return {"w13_weight": w13, "w2_weight": w2}


@pytest.mark.parametrize("spec,topo", MODEL_CASES)
def test_vllms_layers_hold_the_layout_and_its_loaders_fill_it(spec, topo):
    problems = [f"rank {r}: {p}" for r in range(topo.tp) for p in check_model(spec, topo, r)]
    assert problems == []


def check_routes(spec) -> list[str]:
    """The model's checkpoint routing (outer prefixes, stacked shard ids) against the models'
    own ``load_weights`` bodies and mappers."""
    problems = []
    names = [n for n, _ in checkpoint_stream(spec)]
    mapped = [(n, getattr(t, "shard_id", None))
              for n, t in ve.served_stream(spec.family, [(n, torch.zeros(1)) for n in names])]
    modelled = [r for r in (v.checkpoint_route(spec, n) for n in names) if r is not None]
    if mapped != modelled:
        diff = [f"vLLM {a}, model {b}" for a, b in itertools.zip_longest(mapped, modelled)
                if a != b]
        problems.append(f"{len(diff)} routes differ, e.g. {diff[:3]}")
    ns = ve.weights_mapper_namespace()
    outer, inner = ve.served_mappers(spec.family, ns)
    if dict(inner.orig_to_new_stacked) != dict(spec.family_record.vllm_stacked):
        problems.append(f"stacked mapping is {dict(inner.orig_to_new_stacked)}")
    prefixes = {} if outer is None else dict(outer.orig_to_new_prefix)
    if prefixes != dict(spec.family_record.vllm_served_prefixes):
        problems.append(f"served-model prefixes are {prefixes}")
    return problems


@pytest.mark.parametrize("spec", [qwen3_moe(), qwen3_5_moe()], ids=["q3", "q35"])
def test_checkpoint_routes_and_stacked_shard_ids_are_the_models_own(spec):
    assert check_routes(spec) == []


VOCAB_CASES = [(37, 1), (37, 2), (37, 4), (37, 3), (129, 2), (129, 4), (100, 8), (64, 3),
               (1000, 16)]


def check_vocab() -> list[str]:
    problems = []
    if src.module_constant("model_executor/layers/vocab_parallel_embedding.py",
                           "DEFAULT_VOCAB_PADDING_SIZE") != v.VOCAB_PADDING:
        problems.append("DEFAULT_VOCAB_PADDING_SIZE differs")
    for vocab, tp in VOCAB_CASES:
        for rank in range(tp):
            ns = ve.base_namespace(tp, rank)
            try:
                emb = ns["VocabParallelEmbedding"](vocab, 4)
            except AssertionError:
                emb = None
            try:
                shard = v.vocab_shard(vocab, tp, rank)
            except TopologyError:
                shard = None
            if (emb is None) != (shard is None):
                problems.append(f"vocab {vocab} tp {tp}: vLLM "
                                f"{'refuses' if emb is None else 'builds'}, the model "
                                f"{'refuses' if shard is None else 'builds'}")
                break
            if emb is None:
                break
            i = emb.shard_indices
            got = (i.org_vocab_start_index, i.org_vocab_end_index - i.org_vocab_start_index,
                   emb.num_embeddings_per_partition)
            if got != (shard.start, shard.real, shard.rows):
                problems.append(f"vocab {vocab} tp {tp} rank {rank}: vLLM {got}, model "
                                f"{(shard.start, shard.real, shard.rows)}")
    return problems


def test_vocab_padding_and_sharding_are_vllms():
    assert check_vocab() == []



def test_the_module_tree_the_names_walk_is_vllms():
    assert check_module_tree() == []


def check_refusals() -> list[str]:
    """vLLM's own refusals the model repeats, as the source states them."""
    problems = []
    for rel, cls in (("qwen3_moe.py", "Qwen3MoeSparseMoeBlock"),
                     ("qwen3_next.py", "Qwen3NextSparseMoeBlock")):
        text = ast.unparse(src.method_node("model_executor/models/" + rel, cls, "__init__"))
        if "if self.tp_size > config.num_experts:" not in text:
            problems.append(f"{cls} no longer refuses tp > num_experts")
    for rel, cls in (("qwen3_moe.py", "Qwen3MoeAttention"),
                     ("qwen3_next.py", "Qwen3NextAttention")):
        text = ast.unparse(src.method_node("model_executor/models/" + rel, cls, "__init__"))
        if "assert self.total_num_heads % tp_size == 0" not in text:
            problems.append(f"{cls} no longer requires heads % tp == 0")
    with pytest.raises(TopologyError):
        v.engine_params(qwen3_moe(), v.VllmTopology(tp=8), 0)
    return problems


def test_the_models_refusals_are_vllms():
    assert check_refusals() == []
    with pytest.raises(TopologyError, match="float32 router"):
        v.engine_params(qwen3_moe(router_dtype=torch.float32), v.VllmTopology(tp=1), 0)
    with pytest.raises(TopologyError, match="dp 1"):
        v.engine_params(qwen3_moe(), v.VllmTopology(tp=1, dp=2), 0)


# --------------------------------------------------------------------------------------------
# The engine: why no stock row, and its update protocol
# --------------------------------------------------------------------------------------------



def test_why_no_stock_row_and_the_update_protocol_are_vllms():
    assert check_engine_facts() == []


def test_the_wheel_read_is_the_pinned_one():
    import hashlib

    pin = (src.ROOT / "ci" / "requirements-vllm-source.txt").read_text()
    assert f"vllm=={facts.VERSION} --hash=sha256:{facts.WHEEL_SHA256}" in pin
    digest = hashlib.sha256()
    with open(src.require_wheel(), "rb") as wheel:
        for block in iter(lambda: wheel.read(1 << 22), b""):
            digest.update(block)
    assert digest.hexdigest() == facts.WHEEL_SHA256


# --------------------------------------------------------------------------------------------
# Each modelled fact, broken once, fails a check above
# --------------------------------------------------------------------------------------------

def _family(name: str, **changes) -> tuple:
    """A mutant of family ``name``'s record (where the vLLM facts of a model live): the
    registry entry and the record with ``changes``."""
    return families._REGISTRY, name, dataclasses.replace(families.get(name), **changes)


_E4, _TP2, _EP3 = (EXPERT_SPECS["E4"], v.VllmTopology(tp=2),
                   v.VllmTopology(tp=3, expert_parallel=True))
MUTANTS = {
    "gate/up halves swapped": (v, "W13_HALVES", ("w3", "w1"),
                               lambda: check_expert_loads(_E4, _TP2)),
    "fused gate_up split along H": (v, "FUSED_CHUNK_DIM", 2,
                                    lambda: check_expert_loads(_E4, _TP2)),
    "per-expert fused split along H": (v, "PER_EXPERT_FUSED_CHUNK_DIM", 1,
                                       lambda: check_expert_loads(_E4, _TP2)),
    "packed names claimed loaded": (v, "LOADED_FORMATS", frozenset({"compat", "hf_fused",
                                                                    "packed"}),
                                    lambda: check_expert_loads(_E4, _TP2)),
    "uneven EP remainder on the last rank": (
        v, "expert_range",
        lambda n, ep, r: range(r * (n // ep), (r + 1) * (n // ep) + (n % ep if r == ep - 1 else 0)),
        lambda: check_expert_placement(_E4, _EP3)),
    "down sharded along rows": (v, "SHARDED_DIM", {"w1": 0, "w2": 0, "w3": 0},
                                check_expert_constants),
    "experts without routed_experts": (v, "ROUTED_EXPERTS", "experts",
                                       check_expert_constants),
    "vocab padded to 128": (v, "VOCAB_PADDING", 128, check_vocab),
    "a stacked shard id": (*_family("qwen3_moe", vllm_stacked={
        **v.STACKED["qwen3_moe"], ".k_proj": (".qkv_proj", "v")}),
        lambda: check_routes(qwen3_moe())),
    "mtp tensors kept": (*_family("qwen3_5_moe", vllm_served_prefixes={
        "model.language_model.": "model."}), lambda: check_routes(qwen3_5_moe())),
    "Qwen3.5 attention without self_attn": (
        *_family("qwen3_5_moe", vllm_attention_prefix=""), check_module_tree),
    "norm class": (*_family("qwen3_moe", vllm_module_tree={
        **v.MODULE_TREE["qwen3_moe"], "Qwen3MoeModel": {
            "embed_tokens": "VocabParallelEmbedding", "layers": "Qwen3MoeDecoderLayer",
            "norm": "GemmaRMSNorm"}}), check_module_tree),
    "another torch pin": (facts, "TORCH_PIN", "2.14.1", check_engine_facts),
    "reload wraps the expert bias": (facts, "RELOAD_SKIPPED",
                                     facts.RELOAD_SKIPPED - {"e_score_correction_bias"},
                                     check_engine_facts),
    "a session error": (facts, "SESSION_ERRORS", {**facts.SESSION_ERRORS,
                                                  "finish without start": "finish is ignored"},
                        check_engine_facts),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_modelled_fact_broken_fails_a_check(mutant, monkeypatch):
    module, attr, value, check = MUTANTS[mutant]
    if isinstance(module, dict):  # a family record (the registry's entry)
        monkeypatch.setitem(module, attr, value)
    else:
        monkeypatch.setattr(module, attr, value)
    v.engine_params.cache_clear()
    try:
        assert check() != [], f"{mutant}: no check failed"
    finally:
        v.engine_params.cache_clear()


# --------------------------------------------------------------------------------------------
# Where vLLM and SGLang agree, the layouts are the same (and where not, the model says so)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,topo", MODEL_CASES)
def test_the_harness_engine_is_this_vllm_engine_but_for_the_modelled_differences(spec, topo):
    from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
    from pytest_weightsync.reference_impl.model.model_layout import engine_params

    receiver = ReceiverTopology(tp=topo.tp, moe_ep=topo.moe_ep)
    assert v.vllm_topology(receiver) == topo
    for rank in range(topo.tp):
        sglang, vllm = engine_params(spec, receiver, rank), v.engine_params(spec, topo, rank)
        renamed = {v.vllm_name(spec, n): p for n, p in sglang.items()}
        dropped = renamed.pop(None, None)
        assert (dropped is not None) == spec.tied  # the tied lm_head, one tensor in vLLM
        assert set(renamed) == set(vllm)
        differ = sorted(n for n, p in vllm.items()
                        if (p.shape, p.dtype, p.segments) != (renamed[n].shape, renamed[n].dtype,
                                                             renamed[n].segments))
        assert differ == (["draft.model.fc.weight"] if spec.mtp_layers and topo.tp > 1 else [])
    for refused in (ReceiverTopology(tp=4, moe_ep=2), ReceiverTopology(tp=2, moe_dp=2),
                    ReceiverTopology(tp=2, order="up_gate"),
                    ReceiverTopology(tp=2, intermediate_padded=8)):
        assert v.vllm_topology(refused) is None
