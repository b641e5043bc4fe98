"""The LoRA layout facts (``reference_impl/backends/lora_facts.py``) equal the pinned source.

The reference adapter exporter and loaders take their layouts from those facts; each test here
reads the code a fact names and asserts the fact equals what it does. Megatron-Bridge's
``ParallelLinearAdapter`` is built for real in gloo ranks under Megatron-Core's own
``parallel_state`` (TP, EP, ETP) and its factors' shapes and split dimensions read off;
Bridge's ``lora.py`` / ``peft_bridge.py`` need Transformer Engine at import, so their methods are
compiled from the installed source text and run on CPU over stand-ins. SGLang 0.5.23 imports
here: its normalizers, shape rules and slicers run on tiny tensors. vLLM 0.33.0 is read from its
wheel (:mod:`suites.selftest.vllm_source`) and its functions compiled from that text. A fact that
only a GPU run could show is read from the AST of the function it names.
``test_a_changed_fact_is_caught`` shows that a wrong value of a fact would fail.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
from types import SimpleNamespace

import pytest

from pytest_weightsync.reference_impl.backends import lora_facts as lf
from pytest_weightsync.suites.selftest import vllm_source as vsrc
from pytest_weightsync.suites.selftest.lora_source import (
    IN,
    RANK,
    WORLD,
    bridge_adapters_in_rank,
    bridge_dir,
    bridge_name,
    bridge_suffix,
    class_fields,
    class_literal,
    compile_source,
    definition,
    expected_local,
    peft_helper,
    scaling_ops,
    sglang_pool,
    source_text,
    tp_stub,
    vllm_2d_expert_names,
    vllm_namespace,
    vllm_rel,
)

torch = pytest.importorskip("torch")

_NO_SGLANG = ""
try:
    from sglang.srt.lora import layers as sgl_layers
    from sglang.srt.lora import lora as sgl_lora
    from sglang.srt.lora import lora_config as sgl_config
    from sglang.srt.lora import lora_manager as sgl_manager
    from sglang.srt.lora import mem_pool as sgl_pool
    from sglang.srt.lora import utils as sgl_utils
except Exception as exc:  # noqa: BLE001 - any import failure means "no SGLang to read"
    sgl_layers = None
    _NO_SGLANG = f"sglang {lf.SGLANG_VERSION} is not importable ({exc})"
needs_sglang = pytest.mark.skipif(sgl_layers is None, reason=_NO_SGLANG)

# ---- Megatron-Bridge --------------------------------------------------------------------------

def _bridge_lora_targets():
    return class_fields(lf.BRIDGE_LORA_TARGETS[1])["target_modules"]

def test_bridge_lora_targets_and_defaults():
    """``LoRA`` (peft/lora.py): default targets and dim / alpha / dropout / init defaults."""
    assert _bridge_lora_targets() == lf.BRIDGE_LORA_TARGETS[0]
    fields = class_fields(lf.BRIDGE_LORA_DEFAULTS[1])
    assert {k: fields[k] for k in lf.BRIDGE_LORA_DEFAULTS[0]} == lf.BRIDGE_LORA_DEFAULTS[0]

def test_bridge_canonical_lora_targets():
    """``CanonicalLoRA`` (peft/canonical_lora.py): one target per HF projection."""
    fields = class_fields(lf.BRIDGE_CANONICAL_LORA_TARGETS[1])
    assert fields["target_modules"] == lf.BRIDGE_CANONICAL_LORA_TARGETS[0]

def test_bridge_expert_linear_names():
    """``is_expert_linear`` (peft/utils.py), run: routed fc1/fc2 only, shared experts excluded."""
    bridge_dir()
    from pytest_weightsync.reference_impl.backends.bridge import register_namespace_packages

    register_namespace_packages()
    from megatron.bridge.peft.utils import is_expert_linear

    cases, _ = lf.BRIDGE_EXPERT_LINEAR_CASES
    assert {name: is_expert_linear(name) for name in cases} == cases

#: What the gloo world read off Bridge's adapters, kept for every test of this module that
#: reads it: building them once in 4 ranks serves all of them.
_BRIDGE_RESULTS: list = []


@pytest.fixture
def bridge_results(rank_pool):
    bridge_dir()
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    if not _BRIDGE_RESULTS:
        _BRIDGE_RESULTS.append(rank_pool.run(bridge_adapters_in_rank, WORLD))
    return _BRIDGE_RESULTS[0]

def test_bridge_adapter_sharding_under_tp_and_etp(bridge_results):
    """``ParallelLinearAdapter.__init__`` (peft/utils.py), built in 4 gloo ranks: A / B local
    shapes, split dims and output gathers for column- and row-parallel bases under TP=2, and
    for routed experts under ETP=2 (``is_expert``: the expert-TP group, not TP=1)."""
    for result in bridge_results:
        for topo in ("tp2", "etp2"):
            for kind, layout in lf.BRIDGE_ADAPTER_LAYOUTS.items():
                got = result[topo][kind]
                for key, factor in (("in", layout.linear_in), ("out", layout.linear_out)):
                    shape, split, gathers = got[key]
                    assert shape == expected_local(factor, 2), (topo, kind, key, shape)
                    assert split == factor.split_dim, (topo, kind, key, split)
                    assert gathers == factor.gathers_output, (topo, kind, key)
            # The mutant "A sharded on the wrong dimension for a row-parallel base" is told apart.
            wrong = lf.ShardedFactor(("r", "in"), 0, False)
            assert result[topo]["row"]["in"][0] != expected_local(wrong, 2)
        # A dense adapter next to ETP=2 stays whole: experts alone take the expert-TP size.
        assert result["dense_tp1"]["in"][0] == (RANK, IN) and lf.BRIDGE_EXPERT_USES_ETP[0]

def test_bridge_scaling_applied_in_forward(bridge_results):
    """``ParallelLinearAdapter.forward``, run: output = B(A x) * alpha / dim, factors unscaled."""
    assert lf.BRIDGE_SCALING[0] == "alpha / dim" and lf.BRIDGE_SCALING_APPLIED_IN_FORWARD[0]
    assert all(result["forward"] for result in bridge_results)
    assert "x * (self.alpha / self.dim)" in source_text(lf.BRIDGE_SCALING[1])

def test_bridge_merge():
    """``LoRAMerge.merge`` (peft/lora.py), compiled and run."""
    merge = compile_source(lf.BRIDGE_MERGE[1], {"torch": torch})
    base, b, a = torch.ones(3, 2), torch.arange(3.0).reshape(3, 1), torch.tensor([[1.0, 2.0]])
    assert torch.equal(merge(None, base, b, a, 8, 4), base + 2.0 * (b @ a))

def test_bridge_hf_lora_names():
    """``MegatronPeftBridge._make_lora_param_name`` (peft_bridge.py), compiled and run: the
    suffix map, no ``base_model.model.`` prefix, and no name for a 3-D expert base."""
    assert bridge_suffix() == lf.BRIDGE_HF_LORA_SUFFIX[0]
    base = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert bridge_name(base, ".linear_in.weight") == (
        lf.BRIDGE_HF_NAME_PREFIX[0] + "model.layers.0.mlp.experts.3.gate_proj.lora_A.weight")
    assert bridge_name(base, ".linear_out.weight").endswith(".gate_proj.lora_B.weight")
    three_d = bridge_name("model.language_model.layers.0.mlp.experts.gate_up_proj",
                           ".linear_in.weight")
    assert (three_d is None) == lf.BRIDGE_3D_EXPERT_NAME_IS_NONE[0]

def test_bridge_qwen3_moe_expert_names():
    """``Qwen3MoEBridge.mapping_registry``: routed experts map to per-expert HF names."""
    strings = {n.value for n in ast.walk(definition(lf.BRIDGE_QWEN3_MOE_EXPERT_HF_NAMES[1]))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert set(lf.BRIDGE_QWEN3_MOE_EXPERT_HF_NAMES[0]) <= strings
    assert not any(s.endswith("experts.gate_up_proj") for s in strings)

def test_bridge_grouped_expert_adapter_per_ep_rank():
    """``_select_expert_adapter_weight`` (peft_bridge.py), compiled and run: a global expert's
    LoRA is its EP rank's one shared adapter; the export walks every global expert."""
    ps = SimpleNamespace(get_expert_model_parallel_world_size=lambda: 2)
    select = compile_source(lf.BRIDGE_GROUPED_EXPERT_ADAPTER[1], {"parallel_state": ps})
    gathered = [torch.zeros(2, 3), torch.ones(2, 3)]
    picks = [select(None, gathered[0], gathered, e, 8) for e in range(8)]
    assert [int(p[0, 0]) for p in picks] == [0, 0, 0, 0, 1, 1, 1, 1]
    stream = source_text(lf.BRIDGE_FUSED_A_SHARED[1])
    assert 'f".weight{expert_num}" for expert_num in range(num_moe_experts)' in stream.replace("'", '"')

def test_bridge_fused_a_shared():
    """``stream_adapter_weights_megatron_to_hf``: fused qkv / fc1 emit the same A per projection."""
    assert lf.BRIDGE_FUSED_A_SHARED[0]
    assert ("yield HFWeightTuple(linear_in_hf_names[index], current_linear_in_tensor)"
            in source_text(lf.BRIDGE_FUSED_A_SHARED[1]))

def test_bridge_fc1_split_is_tp_shard_major():
    """``_split_fused_fc1_linear_out_weight`` (peft_bridge.py), compiled and run at TP=2 and 1."""
    for tp, rows in ((2, ["g0", "u0", "g1", "u1"]), (1, ["g0", "g1", "u0", "u1"])):
        ps = SimpleNamespace(get_expert_tensor_parallel_world_size=lambda tp=tp: tp,
                             get_tensor_model_parallel_world_size=lambda tp=tp: tp)
        split = compile_source(lf.BRIDGE_FC1_SPLIT[1], {"parallel_state": ps, "torch": torch})
        labels = {"g0": 0, "g1": 1, "u0": 10, "u1": 11}
        b = torch.tensor([[labels[r]] for r in rows for _ in range(2)], dtype=torch.float32)
        gate, up = split(None, b, is_expert=True)
        assert gate[:, 0].tolist() == [0, 0, 1, 1] and up[:, 0].tolist() == [10, 10, 11, 11]
    assert lf.BRIDGE_FC1_SPLIT[0] == "per TP shard [gate_i; up_i]"

# ---- SGLang 0.5.23 ----------------------------------------------------------------------------

def _sglang_fn(source: lf.Source):
    module = {"lora_manager.py": sgl_manager, "lora.py": sgl_lora, "mem_pool.py": sgl_pool,
              "layers.py": sgl_layers, "utils.py": sgl_utils,
              "lora_config.py": sgl_config}[source.file.rsplit("/", 1)[-1]]
    obj = module
    for part in source.name.split("."):
        obj = getattr(obj, part)
    return obj

@needs_sglang
def test_sglang_load_from_tensors_signature():
    """``LoRAManager.load_lora_adapter_from_tensors``: its parameters."""
    import inspect

    params = tuple(inspect.signature(_sglang_fn(lf.SGLANG_LOAD_FROM_TENSORS_ARGS[1])).parameters)
    assert params == lf.SGLANG_LOAD_FROM_TENSORS_ARGS[0]

def _sglang_adapter(r=8, alpha=16):
    cfg = sgl_config.LoRAConfig(config_dict={"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                             "target_modules": ["q_proj"]})
    return sgl_lora.LoRAAdapter("u", cfg, SimpleNamespace(num_hidden_layers=1), None, None)

@needs_sglang
def test_sglang_config_fields_and_scaling():
    """``LoRAConfig.__init__`` reads these PEFT fields; ``LoRAAdapter.__init__``: scaling."""
    adapter = _sglang_adapter(8, 16)
    assert (adapter.config.r, adapter.config.lora_alpha) == (8, 16)
    assert adapter.scaling == 16 / 8 and lf.SGLANG_SCALING[0] == "lora_alpha / r"
    for missing in lf.SGLANG_CONFIG_FIELDS[0]:
        cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
        del cfg[missing]
        with pytest.raises(KeyError):
            sgl_config.LoRAConfig(config_dict=cfg)

def _sglang_targets():
    return {name: next(iter(sgl_utils.get_normalized_target_modules([name])))
            for name in lf.SGLANG_NORMALIZED_TARGETS[0]}

@needs_sglang
def test_sglang_normalized_targets():
    """``get_normalized_target_modules``, run: PEFT projection -> SGLang LoRA module."""
    assert _sglang_targets() == lf.SGLANG_NORMALIZED_TARGETS[0]
    assert sgl_utils.get_normalized_target_modules("all-linear") == {"all"}

def _sglang_stacked():
    return {name: sgl_utils.get_stacked_multiply(name) for name in lf.SGLANG_STACKED_MULTIPLY[0]}

@needs_sglang
def test_sglang_stacked_multiply():
    """``get_stacked_multiply``, run."""
    assert _sglang_stacked() == lf.SGLANG_STACKED_MULTIPLY[0]

@needs_sglang
def test_sglang_stack_order():
    """``LoRAAdapter.normalize_qkv_proj`` / ``normalize_gate_up_proj``, run: concatenation order
    and dim for 2-D and 3-D (per-expert stacked) factors; a stacked A is repeated."""
    adapter = _sglang_adapter()
    p = "model.layers.0.self_attn."
    w = {f"{p}{n}.lora_{x}.weight": torch.full((2, 3), float(i)) for i, n in
         enumerate(lf.SGLANG_STACK_ORDER[0]["qkv_proj"]) for x in "AB"}
    adapter.normalize_qkv_proj(list(w), w)
    assert w[f"{p}qkv_proj.lora_A.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert w[f"{p}qkv_proj.lora_B.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    m = "model.layers.0.mlp.experts."
    w = {f"{m}{n}.lora_{x}.weight": torch.full((4, 2, 3), float(i)) for i, n in
         enumerate(lf.SGLANG_STACK_ORDER[0]["gate_up_proj"]) for x in "AB"}
    adapter.normalize_gate_up_proj(list(w), w)
    stacked = w[f"{m}gate_up_proj.lora_B.weight"]
    assert stacked.shape == (4, 4, 3) and stacked[0, :, 0].tolist() == [0, 0, 1, 1]
    w = {f"{m}gate_up_proj.lora_A.weight": torch.ones(2, 3)}
    adapter.normalize_gate_up_proj(list(w), w)
    assert w[f"{m}gate_up_proj.lora_A.weight"].shape == (4, 3)

@needs_sglang
def test_sglang_row_parallel_modules():
    """``ROW_PARALLELISM_LINEAR_LORA_NAMES`` (lora/utils.py)."""
    assert tuple(sgl_utils.ROW_PARALLELISM_LINEAR_LORA_NAMES) == lf.SGLANG_ROW_PARALLEL_MODULES[0]

@needs_sglang
def test_sglang_buffer_shapes():
    """``LoRAMemoryPool.get_lora_A_shape`` / ``get_lora_B_shape``, run at TP=2 on a stand-in
    pool: dense, row-parallel and MoE buffers, slot dim first."""
    pool, model = sglang_pool()
    r, tp, shapes = 4, 2, lf.SGLANG_BUFFER_SHAPES[0]

    def sym(key, c, inn, out):
        d = {"max_loras": 3, "r*c": r * c, "r": r, "in": inn, "in_tp": inn // tp, "out": out,
             "out_tp": out // tp, "E": 4}
        return tuple(d[s] for s in shapes[key])

    for name, c, inn, out, a_key, b_key in (
            ("qkv_proj", 3, 16, 32, "A", "B"), ("o_proj", 1, 16, 16, "A_row", "B_row"),
            ("gate_up_proj_moe", 2, 16, 16, "A_moe", "B_moe")):
        assert pool.get_lora_A_shape(name, model, r, 0) == sym(a_key, c, inn, out), name
        assert pool.get_lora_B_shape(name, model, r, 0) == (
            sym(b_key, c, inn, out // tp) if name.endswith("_moe") else sym(b_key, c, inn, out)), name
    # down_proj_moe: row-parallel inside the experts (A's input is the TP-local intermediate).
    assert pool.get_lora_A_shape("down_proj_moe", model, r, 0) == (3, 4, r, 8 // tp)
    assert pool.get_lora_B_shape("down_proj_moe", model, r, 0) == (3, 4, 16, r)

@needs_sglang
def test_sglang_tp_slicing():
    """``slice_lora_a_weights`` / ``slice_lora_b_weights`` of the column, merged (gate_up), QKV
    and row LoRA layers, run as TP rank 1 of 2."""
    rows = torch.arange(8.0).reshape(8, 1)
    cols = torch.arange(8.0).reshape(1, 8)
    L, plan = sgl_layers, lf.SGLANG_TP_SLICING[0]
    col = tp_stub(output_partition_sizes=[4])
    assert L.ColumnParallelLinearWithLoRA.slice_lora_a_weights(col, cols) is cols
    assert L.ColumnParallelLinearWithLoRA.slice_lora_b_weights(col, rows)[:, 0].tolist() == [4, 5, 6, 7]
    merged = tp_stub(output_partition_sizes=[2, 2], output_sizes=[4, 4])
    got = L.MergedColumnParallelLinearWithLoRA.slice_lora_b_weights(merged, rows)
    assert got[:, 0].tolist() == [2, 3, 6, 7]  # gate rows of rank 1, then up rows of rank 1
    qkv = tp_stub(q_proj_shard_size=2, kv_proj_shard_size=1, num_kv_head_replicas=1,
                   kv_tp_group=SimpleNamespace(rank_in_group=1, world_size=2),
                   total_num_heads=4, total_num_kv_heads=2, head_size=1)
    got = L.QKVParallelLinearWithLoRA.slice_lora_b_weights(qkv, rows)
    assert got[:, 0].tolist() == [2, 3, 5, 7]
    row = tp_stub(input_size_per_partition=4)
    assert L.RowParallelLinearWithLoRA.slice_lora_a_weights(row, cols)[0].tolist() == [4, 5, 6, 7]
    assert L.RowParallelLinearWithLoRA.slice_lora_b_weights(row, rows) is rows
    assert plan == {"column": {"A": None, "B": 0}, "qkv": {"A": None, "B": 0},
                    "gate_up": {"A": None, "B": 0}, "row": {"A": 1, "B": None}}

@needs_sglang
def test_sglang_moe_tp_slicing():
    """``FusedMoEWithLoRA.slice_moe_lora_a_weights`` / ``slice_moe_lora_b_weights``, run as
    MoE-TP rank 1 of 2 on a stand-in layer."""
    F = sgl_layers.FusedMoEWithLoRA
    stub = SimpleNamespace(tp_size=2, intermediate_size_per_partition=2, _uses_interleaved_gate_up=False,
                           base_layer=SimpleNamespace(moe_runner_config=SimpleNamespace(is_gated=True)))
    stub._slice_moe_a = functools.partial(F._slice_moe_a, stub)
    stub._slice_moe_b_2d = functools.partial(F._slice_moe_b_2d, stub)
    a = torch.arange(4.0).reshape(1, 4)
    b = torch.arange(8.0).reshape(8, 1)
    assert F.slice_moe_lora_a_weights(stub, a, 1, "gate_up_proj_moe") is a
    assert F.slice_moe_lora_a_weights(stub, a, 1, "down_proj_moe")[0].tolist() == [2, 3]
    assert F.slice_moe_lora_b_weights(stub, b, 1, "gate_up_proj_moe")[:, 0].tolist() == [2, 3, 6, 7]
    assert F.slice_moe_lora_b_weights(stub, b, 1, "down_proj_moe") is b
    assert lf.SGLANG_MOE_TP_SLICING[0]["down_proj_moe"] == {"A": -1, "B": None}

@needs_sglang
def test_sglang_scaling_kept_for_dense_folded_for_moe():
    """``LoRAManager.prepare_lora_batch`` hands ``lora.scaling`` per slot to the backend;
    ``LoRAMemoryPool.load_lora_weight_to_buffer`` multiplies MoE B by it out of place only."""
    assert "scalings[weight_index] = lora.scaling" in source_text(lf.SGLANG_SCALE_KEPT_FOR_DENSE[1])
    binop, aug = scaling_ops(lf.SGLANG_SCALE_FOLDED_FOR_MOE[1])
    assert (binop > 0, aug == 0) == (lf.SGLANG_SCALE_FOLDED_FOR_MOE[0], True)

@needs_sglang
def test_sglang_moe_names_and_slots():
    """``load_lora_weight_to_buffer``: per-expert names by ``experts.<id>.``, 3-D tensors under
    ``experts``; the base (uid None) slot zeroed; ``prepare_lora_batch``: uid -> buffer id."""
    text = source_text(lf.SGLANG_MOE_NAMES[1])
    assert "re.search('experts\\\\.(\\\\d+)\\\\.', name)" in text
    assert "'experts' in name and weights.dim() == 3" in text
    assert "self._clear_buffer_slot_for_base(buffer_id)" in text
    assert f"self.{lf.SGLANG_SLOTS[0]}[uid] = buffer_id" in source_text(lf.SGLANG_SLOTS[1])

# ---- vLLM 0.33.0 (from the wheel) -------------------------------------------------------------

def test_vllm_from_lora_tensors_signature():
    """``LoRAModel.from_lora_tensors``: its parameters."""
    vsrc.require_wheel()
    node = definition(lf.VLLM_FROM_LORA_TENSORS_ARGS[1])
    assert tuple(a.arg for a in node.args.args) == lf.VLLM_FROM_LORA_TENSORS_ARGS[0]

def _vllm_scaling():
    ns = vllm_namespace()
    return peft_helper(ns, 8, 16).vllm_lora_scaling_factor, peft_helper(ns, 8, 16, True).vllm_lora_scaling_factor

def test_vllm_scaling():
    """``PEFTHelper._scaling``, compiled and run: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    assert _vllm_scaling() == (16 / 8, 16 / math.sqrt(8)) and lf.VLLM_SCALING[0] == "lora_alpha / r"

def test_vllm_rebuild_from_staged_tensors_scales_twice():
    """``LoRAModel.from_lora_tensors`` + ``LoRALayerWeights.optimize``, compiled and run: the
    built B is the staged tensor itself, the fold is in place, so a rebuild scales again."""
    ns = vllm_namespace()
    name = "base_model.model.model.layers.0.self_attn.o_proj.lora_"
    b0 = torch.arange(6.0).reshape(3, 2)
    staged = {name + "A.weight": torch.ones(2, 4), name + "B.weight": b0.clone()}
    h = peft_helper(ns, 2, 8)
    first = ns["LoRAModel"].from_lora_tensors(1, staged, h, device="cpu", dtype=torch.float32)
    lora = first.loras["model.layers.0.self_attn.o_proj"]
    assert (lora.lora_b is staged[name + "B.weight"]) == lf.VLLM_FROM_LORA_TENSORS_ALIASES[0]
    lora.optimize()  # what LoRAModelManager._create_merged_loras_inplace does on add
    assert torch.equal(lora.lora_b, b0 * 4) and lora.scaling == 1
    second = ns["LoRAModel"].from_lora_tensors(2, staged, h, device="cpu", dtype=torch.float32)
    again = second.loras["model.layers.0.self_attn.o_proj"].optimize()
    assert torch.equal(again.lora_b, b0 * 16)  # scaled twice
    assert "self.lora_b *= self.scaling" in source_text(lf.VLLM_FOLD[1])
    with pytest.raises(AssertionError):
        ns["LoRAModel"](0, 2, {})  # ids are > 0

def test_vllm_fold_callers():
    """``_add_adapter`` -> ``_create_merged_loras_inplace`` -> ``optimize()``; ``pack`` too."""
    vsrc.require_wheel()
    assert "self._create_merged_loras_inplace(lora)" in source_text(lf.VLLM_FOLD_CALLERS[1])
    for caller in lf.VLLM_FOLD_CALLERS[0]:
        assert "lora.optimize()" in source_text(caller), caller

def test_vllm_peft_prefix_stripped():
    """``parse_fine_tuned_lora_name``, compiled and run."""
    parse = vsrc.compile_defs("lora/utils.py", ["parse_fine_tuned_lora_name"], {})[
        "parse_fine_tuned_lora_name"]
    for prefix in (lf.VLLM_PEFT_PREFIX_STRIPPED[0], ""):
        assert parse(prefix + "model.layers.0.mlp.experts.3.gate_proj.lora_B.weight") == (
            "model.layers.0.mlp.experts.3.gate_proj", False)

def test_vllm_packed_modules():
    """``packed_modules_mapping`` of Qwen3-MoE (gate_up added when the model has a dense MLP)
    and Qwen3.5 (GDN ``in_proj_qkvz`` / ``in_proj_ba``)."""
    vsrc.require_wheel()
    src = lf.VLLM_PACKED_MODULES[1]
    got = class_literal(vllm_rel(src), src.name.split(".")[0], "packed_modules_mapping")
    assert got == {k: v for k, v in lf.VLLM_PACKED_MODULES[0].items() if k == "qkv_proj"}
    assert ('self.packed_modules_mapping["gate_up_proj"] = ["gate_proj", "up_proj"]'
            in vsrc.text(src.file).replace("'", '"'))
    src = lf.VLLM_QWEN35_PACKED_MODULES[1]
    got = class_literal(vllm_rel(src), src.name.split(".")[0], "packed_modules_mapping")
    assert {k: got[k] for k in lf.VLLM_QWEN35_PACKED_MODULES[0]} == lf.VLLM_QWEN35_PACKED_MODULES[0]

def test_vllm_2d_expert_names():
    """``RoutedExperts.build_expert_params_mapping``, compiled and run: the flat per-expert
    names ``process_packed_modules_mapping`` packs under ``experts``, expert-major (w1, w2, w3)."""
    expected = [n.format(e=e) for e in range(2) for n in lf.VLLM_2D_EXPERT_NAMES[0]]
    assert vllm_2d_expert_names() == expected

def test_vllm_3d_expert_layout_and_models():
    """``_stack_moe_lora_weights``: ``experts.base_layer`` is gate_up, ``experts`` down, A read as
    ``(E, r, in)``, B as ``(out, r, E)`` permuted to ``(E, out, r)``; ``is_3d_moe_weight`` per
    model; ``_validate_moe_lora_format`` refuses 3-D into a 2-D wrapper."""
    vsrc.require_wheel()
    text = source_text(lf.VLLM_3D_EXPERT_NAMES[1])
    assert "module_name + '.base_layer'" in text and "down_proj_lora = module_lora" in text
    assert "gate_up_proj_lora.lora_a.reshape(global_num_experts, -1," in text
    assert "gate_up_proj_lora.lora_b.reshape(gate_up_proj_lora.lora_b.shape[0], -1, global_num_experts)" in text
    assert "permute(2, 0, 1)" in text
    files = {"Qwen3MoeForCausalLM": "model_executor/models/qwen3_moe.py",
             "Qwen3_5MoeForConditionalGeneration": "model_executor/models/qwen3_5.py"}
    default = class_literal("model_executor/models/interfaces.py", "SupportsLoRA", "is_3d_moe_weight")
    got = {cls: (lambda v: default if v is None else v)(class_literal(rel, cls, "is_3d_moe_weight"))
           for cls, rel in files.items()}
    assert got == lf.VLLM_3D_MOE_MODELS[0]
    assert lf.VLLM_3D_INTO_2D_ERROR[0] in source_text(lf.VLLM_3D_INTO_2D_ERROR[1])

def test_vllm_tp_slicing():
    """``ColumnParallelLinearWithLoRA`` / ``RowParallelLinearWithLoRA`` ``slice_lora_a`` /
    ``slice_lora_b``, compiled and run as TP rank 1 of 2."""
    ns = {"torch": torch}
    col = vsrc.compile_methods("lora/layers/column_parallel_linear.py", "ColumnParallelLinearWithLoRA",
                               ["slice_lora_a", "slice_lora_b"], ns)()
    row = vsrc.compile_methods("lora/layers/row_parallel_linear.py", "RowParallelLinearWithLoRA",
                               ["slice_lora_a", "slice_lora_b"], ns)()
    vars(col).update(tp_rank=1, output_size=4, is_merged_col_linear=False)
    vars(row).update(tp_rank=1, input_size=4)
    rows, cols = torch.arange(8.0).reshape(8, 1), torch.arange(8.0).reshape(1, 8)
    assert col.slice_lora_a(cols) is cols and col.slice_lora_b(rows)[:, 0].tolist() == [4, 5, 6, 7]
    assert row.slice_lora_a(cols)[0].tolist() == [4, 5, 6, 7] and row.slice_lora_b(rows) is rows
    merged = vsrc.compile_methods("lora/layers/column_parallel_linear.py",
                                  "MergedColumnParallelLinearWithLoRA",
                                  ["slice_lora_a", "slice_lora_b"], ns)()
    vars(merged).update(n_slices=2, output_ids=[1, 1], output_slices=[2, 2])
    gate, up = merged.slice_lora_b([rows[:4], rows[4:]])  # each slice sliced on its own
    assert gate[:, 0].tolist() == [2, 3] and up[:, 0].tolist() == [6, 7]
    assert lf.VLLM_TP_SLICING[0] == {"column": {"A": None, "B": 0}, "row": {"A": 1, "B": None}}

def test_vllm_moe_slicing_and_buffers():
    """``FusedMoEWithLoRA._slice_w13_*`` / ``_slice_w2_*`` and ``_create_lora_{a,b}_weights``,
    compiled and run on a stand-in layer (TP rank 1 of 2, not fully sharded)."""
    ns = {"torch": torch}
    cls = vsrc.compile_methods("lora/layers/fused_moe.py", "FusedMoEWithLoRA",
                               ["_slice_w13_a", "_slice_w13_b", "_slice_w2_a", "_slice_w2_b",
                                "_create_lora_a_weights", "_create_lora_b_weights"], ns)
    m = cls()
    vars(m).update(tp_size=2, tp_rank=1, fully_sharded=False, _tp_shard_size=2, _w13_slices=2,
                   _w13_a_num_experts=3, _w2_b_num_experts=3, local_num_experts=3, hidden_size=5,
                   intermediate_size_per_partition=2, device="cpu")
    t = torch.arange(3 * 4 * 4.0).reshape(3, 4, 4)
    plan = lf.VLLM_MOE_TP_SLICING[0]
    for fn, key in ((m._slice_w13_a, ("w13", "A")), (m._slice_w13_b, ("w13", "B")),
                    (m._slice_w2_a, ("w2", "A")), (m._slice_w2_b, ("w2", "B"))):
        out, dim = fn(t), plan[key[0]][key[1]]
        assert (out is t) if dim is None else out.shape[dim] == 2, key
    cfg = SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32)
    m._create_lora_a_weights(4, cfg)
    m._create_lora_b_weights(4, cfg)
    sizes = {"max_loras": 4, "E_local": 3, "max_rank": 8, "hidden": 5, "inter_tp": 2}
    for name, shape in lf.VLLM_MOE_BUFFER_SHAPES[0].items():
        stacked = getattr(m, name + "_stacked")
        assert len(stacked) == (2 if name.startswith("w13") else 1), name
        assert tuple(stacked[0].shape) == tuple(sizes[s] for s in shape), name

def test_vllm_slots():
    """``LoRAModelManager.__init__``: slot i holds adapter id ``lora_index_to_id[i]``."""
    vsrc.require_wheel()
    assert (f"self.{lf.VLLM_SLOTS[0]}: list[int | None] = [None] * self.lora_slots"
            in source_text(lf.VLLM_SLOTS[1]))

# ---- A wrong fact is caught -------------------------------------------------------------------

_READERS = {
    "BRIDGE_LORA_TARGETS": _bridge_lora_targets,
    "SGLANG_STACKED_MULTIPLY": _sglang_stacked,
    "SGLANG_NORMALIZED_TARGETS": _sglang_targets,
    "VLLM_2D_EXPERT_NAMES": lambda: tuple(n.replace("0", "{e}") for n in vllm_2d_expert_names(1)),
}

@pytest.mark.parametrize("fact, wrong", [
    ("BRIDGE_LORA_TARGETS", ("linear_qkv", "linear_fc1", "linear_proj", "linear_fc2")),
    ("SGLANG_STACKED_MULTIPLY", {**lf.SGLANG_STACKED_MULTIPLY[0], "gate_up_proj_moe": 1}),
    ("SGLANG_NORMALIZED_TARGETS", {**lf.SGLANG_NORMALIZED_TARGETS[0], "up_proj": "up_proj"}),
    # The layout SkyRL#1852 sent: gate and up fused, not per expert.
    ("VLLM_2D_EXPERT_NAMES", ("experts.{e}.gate_up_proj", "experts.{e}.down_proj")),
])
def test_a_changed_fact_is_caught(fact, wrong):
    """The readers above (Bridge's ``LoRA`` fields, SGLang's normalizers, vLLM's expert
    mapping) tell a wrong value of a fact from the right one."""
    if fact.startswith("SGLANG") and sgl_layers is None:
        pytest.skip(_NO_SGLANG)
    if fact.startswith("VLLM"):
        vsrc.require_wheel()
    real = _READERS[fact]()
    assert real == getattr(lf, fact)[0] and real != wrong
