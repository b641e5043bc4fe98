"""vLLM's module tree and engine facts held to the wheel's source text - the checks that
both ``test_vllm_layouts.py``'s fact tests and its mutation test (each modelled fact broken once)
run, so they live outside one test module.

Each ``check_*`` returns the problems found (empty when the model is vLLM's); the caller
skips first when the wheel is absent (``vllm_source.require_wheel``).
"""

from __future__ import annotations

import ast
import functools
import re

from pytest_weightsync.reference_impl.backends import vllm as facts
from pytest_weightsync.reference_impl.model import vllm_layout as v
from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec
from pytest_weightsync.suites.selftest import vllm_source as src

__all__ = ["MODEL_FILES", "check_engine_facts", "check_module_tree"]


MODEL_FILES = ("model_executor/models/qwen3_moe.py", "model_executor/models/qwen3_5.py",
               "model_executor/models/qwen3_next.py", "model_executor/models/qwen2_moe.py",
               "model_executor/models/qwen3_5_mtp.py",
               "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
               "model_executor/layers/fused_moe/runner/moe_runner.py",
               "model_executor/layers/fused_moe/layer.py")


@functools.lru_cache(maxsize=1)
def _classes() -> dict:
    return {node.name: (rel, node) for rel in MODEL_FILES for node in src.tree(rel).body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


@functools.lru_cache(maxsize=1)
def _aliases() -> dict:
    """``import X as Y`` of the model files: Y -> X (a name re-exported under its alias by
    another model file resolves to the same)."""
    return {a.asname: a.name for rel in MODEL_FILES for n in ast.walk(src.tree(rel))
            if isinstance(n, ast.ImportFrom) for a in n.names if a.asname}


def _held_by(classes: dict, cls: str, attr: str) -> set:
    """What vLLM's ``cls`` (or a base class of it in the model files) assigns to
    ``self.<attr>``: the called class (import aliases resolved), through ``self.<method>(...)``
    returns, ``FusedMoEFactory``'s return annotation and annotated constructor arguments;
    ``layers`` also gives the classes called in that method (``make_layers`` /
    ``ModuleList`` elements) and the defaults of its parameters."""
    out = set()
    while cls in classes:
        rel, node = classes[cls]
        alias = _aliases()
        methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
        found = set()
        for method in methods.values():
            annotated = {a.arg: a.annotation for a in method.args.args + method.args.kwonlyargs
                         if a.annotation is not None}
            for stmt in ast.walk(method):
                if not isinstance(stmt, ast.Assign):
                    continue
                targets = [t for target in stmt.targets
                           for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
                if not any(isinstance(t, ast.Attribute) and t.attr == attr
                           and getattr(t.value, "id", "") == "self" for t in targets):
                    continue
                value = stmt.value
                if isinstance(value, ast.Name) and value.id in annotated:
                    found.add(ast.unparse(annotated[value.id]))
                if not isinstance(value, ast.Call):
                    continue
                name = ast.unparse(value.func).rpartition(".")[2]
                if isinstance(value.func, ast.Attribute) and getattr(value.func.value, "id", "") \
                        == "self" and name in methods:
                    for ret in ast.walk(methods[name]):
                        if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Call):
                            found.add(ast.unparse(ret.value.func).rpartition(".")[2])
                elif name in classes and isinstance(classes[name][1], ast.FunctionDef) \
                        and classes[name][1].returns is not None:
                    found.add(ast.unparse(classes[name][1].returns))
                else:
                    found.add(name)
                if attr == "layers":
                    found |= {ast.unparse(c.func) for c in ast.walk(method)
                              if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
                    found |= {ast.unparse(d) for d in method.args.kw_defaults
                              + method.args.defaults if d is not None}
        out |= {alias.get(n, n) for n in found}
        bases = [ast.unparse(b) for b in node.bases]
        cls = next((b for b in bases if b in classes), None)
    return out


def check_module_tree() -> list[str]:
    """Every edge of :data:`vllm_layout.MODULE_TREE` in vLLM's source, every layout name a
    walk through it, every leaf a parameter its holder registers."""
    problems = []
    classes = _classes()
    for family in families.names():
        record = families.get(family)
        tree = record.vllm_module_tree
        for cls, attrs in tree.items():
            for attr, held in attrs.items():
                found = _held_by(classes, cls, attr)
                if held not in found:
                    problems.append(f"{family}: vLLM's {cls}.{attr} is {sorted(found)}, not {held}")
        for spec in (ModelSpec(family=family, **record.small_spec),
                     ModelSpec(family=family, tied=True, **record.small_spec)):
            served, draft = record.vllm_roots
            for name, p in v.engine_params(spec, v.VllmTopology(tp=2), 0).items():
                root = draft if p.target == "draft" else served
                parts = name[len(v.DRAFT_PREFIX):].split(".") if p.target == "draft" \
                    else name.split(".")
                cls, ok = root, True
                for part in parts[:-1]:
                    if part.isdigit():
                        continue
                    cls = tree.get(cls, {}).get(part)
                    if cls is None:
                        ok = False
                        break
                if not ok or parts[-1] not in v.PARAMETERS.get(cls, ("weight",)):
                    problems.append(f"{family}: {name} is no path of the module tree")
    if {f: r[0] for f, r in v.ROOTS.items()} != {f: c for f, (_, c) in v.MODEL_CLASSES.items()} \
            or v.ROOTS["qwen3_5_moe"][1] != v.DRAFT_CLASS[1]:
        problems.append("the module tree's roots are not the modelled classes")
    for family, (rel, cls) in v.MODEL_CLASSES.items():
        registry = src.text("vllm/model_executor/models/registry.py")
        module = rel[:-3]
        if f'"{cls}": ("{module}", "{cls}")' not in registry:
            problems.append(f"{cls} is not vLLM's registered class for {family}")
    rel, cls = v.DRAFT_CLASS
    registry = src.text("vllm/model_executor/models/registry.py")
    if f'"{cls}": ("{rel[:-3]}", "{cls}")' not in registry:
        problems.append(f"{cls} is not a registered vLLM draft")
    ties = {f: "tie_weights(self.model.embed_tokens)" in src.text("vllm/model_executor/models/" + f)
            for f, _ in v.MODEL_CLASSES.values()}
    if not all(ties.values()):
        problems.append(f"lm_head is not tied to embed_tokens in {ties}")
    gdn = src.method_node("model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
                          "QwenGatedDeltaNetAttention", "__init__")
    text = ast.unparse(gdn)
    for name in v.PARAMETERS["QwenGatedDeltaNetAttention"]:
        if f"self.{name} = nn.Parameter(" not in text:
            problems.append(f"the GDN mixer registers no {name}")
    layer = src.method_node("model_executor/models/qwen3_5.py", "Qwen3_5DecoderLayer",
                            "__init__")
    if "gqa_interleaved_layout=False" not in ast.unparse(layer):
        problems.append("Qwen3.5's GDN layer is not built with the flat (non-interleaved) layout")
    return problems


def check_engine_facts() -> list[str]:
    problems = []
    meta = src.text(f"vllm-{facts.VERSION}.dist-info/METADATA")
    if f"\nVersion: {facts.VERSION}\n" not in meta or facts.VERSION != v.VLLM_VERSION:
        problems.append("the wheel is not the modelled version")
    if f"Requires-Dist: torch=={facts.TORCH_PIN}\n" not in meta \
            or facts.TORCH_PIN != v.VLLM_TORCH_PIN:
        problems.append("the wheel's torch pin differs")
    for what, member in facts.CPU_BLOCKERS:
        blob = src.data(member)
        if "libcuda" in what and b"libcuda.so.1" not in blob:
            problems.append(f"{member} no longer links libcuda.so.1")
    for member, imported in facts.IMPORT_CHAIN:
        tree = ast.parse(src.text(member))
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {f"{n.module}.{a.name}" for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        if imported not in names:
            problems.append(f"{member} no longer imports {imported}")
    worker = src.class_node("v1/worker/gpu_worker.py", "Worker")
    methods = {m.name: m for m in worker.body if isinstance(m, ast.FunctionDef)}
    for name in facts.UPDATE_API + (facts.DRAFT_START,):
        if name not in methods:
            problems.append(f"the worker has no {name}")
    text = ast.unparse(worker)
    for what, message in facts.SESSION_ERRORS.items():
        if message not in text:
            problems.append(f"the worker no longer refuses {what} with {message!r}")
    update = ast.unparse(methods.get("update_weights", ast.Pass()))
    if facts.FAILED_CHUNK_ENDS_SESSION and not re.search(
            r"except BaseException:\s+self\._weight_update_active = False", update):
        problems.append("a failed chunk no longer ends the session")
    factory = src.text("vllm/distributed/weight_transfer/factory.py")
    for engine, cls in facts.LAYERWISE_ENGINES.items():
        if f'"{engine}"' not in factory or cls not in factory:
            problems.append(f"{engine} is not registered as {cls}")
        rel = f"distributed/weight_transfer/{engine}_engine.py"
        start = ast.unparse(src.method_node(rel, cls, "start_weight_update"))
        finish = ast.unparse(src.method_node(rel, cls, "finish_weight_update"))
        if "initialize_layerwise_reload(self.model)" not in start \
                or "finalize_layerwise_reload(self.model" not in finish:
            problems.append(f"{cls} no longer runs the layerwise reload")
    skipped = src.module_constant("model_executor/model_loader/reload/meta.py",
                                  "SKIP_LOAD_TENSORS")
    if set(skipped) != facts.RELOAD_SKIPPED:
        problems.append(f"SKIP_LOAD_TENSORS is {sorted(skipped)}")
    final = ast.unparse(src.function_node("model_executor/model_loader/reload/layerwise.py",
                                          "finalize_layerwise_processing"))
    for fragment in ("if info.load_numel <= 0:", "_place_kernel_tensors(layer, info)",
                     "Failed to load weights",
                     "elif info.load_numel > 0 and info.load_numel < info.load_numel_total:"):
        if fragment not in final:
            problems.append(f"finalize_layerwise_processing lost {fragment!r}")
    if "torch.empty_strided(" not in ast.unparse(src.function_node(
            "model_executor/model_loader/reload/meta.py", "materialize_meta_tensor")):
        problems.append("a materialized layer is no longer uninitialised memory")
    return problems
