"""Megatron-Bridge's own Qwen parameter registries, read from the installed source.

A trainer model the suites build must hold only parameters the real model family has: the
names a converter of that family knows. Megatron-Bridge 0.3.1 states them per family in
``mapping_registry()`` of its model bridges (``megatron/bridge/models/qwen/qwen3_moe_bridge.py``
``Qwen3MoEBridge``; ``qwen3_next_bridge.py`` ``Qwen3NextBridge``, the Qwen3.5-MoE layout:
Gated DeltaNet + gated attention, shared expert, MTP) - every Megatron parameter name its
export meets must be matched by one of those mappings. The bridge modules cannot be imported
on CPU (``model_bridge`` pulls in PEFT and with it Transformer Engine), so this reads their
source: the mapping constructor calls of ``mapping_registry()`` (literal arguments, and the
``param_mappings`` dictionary of ``AutoMapping`` pairs) are rebuilt with Bridge's real mapping
classes (``param_mapping``) into Bridge's real ``MegatronMappingRegistry``, whose
``megatron_to_hf_lookup`` (wildcards, the separate-layernorm aliases) answers.

Also here: the ``Qwen3MoEModelProvider`` defaults (``qwen_provider.py``), read the same way,
and the one mapping a Qwen model of the suites may add from another family: the router's
``expert_bias`` (DeepSeek-V3 / GLM-4.5 style routers, ``glm45_bridge.py``), for specs that
declare it. Test-only: nothing of the shipped package imports this.
"""

from __future__ import annotations

import ast
import importlib
import os
import re

from pytest_weightsync.reference_impl.model import families

#: family -> (bridge source relative to ``megatron/bridge``, its bridge class): a view of the
#: builtin families' records (``ModelFamily.bridge``).
FAMILY_BRIDGES = {name: families.get(name).bridge for name in families.names()}
#: Where the router's expert-bias mapping is read from (a family that has one).
EXPERT_BIAS_BRIDGE = ("models/glm/glm45_bridge.py", "GLM45Bridge")
PROVIDERS = "models/qwen/qwen_provider.py"

_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def source(relative: str) -> str:
    """The text of an installed Megatron-Bridge file."""
    from pytest_weightsync.reference_impl.backends import bridge

    with open(os.path.join(bridge.installed_directory(), relative), encoding="utf-8") as f:
        return f.read()


def _method(relative: str, cls: str, method: str) -> ast.FunctionDef:
    tree = ast.parse(source(relative))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    raise LookupError(f"{relative}: no {cls}.{method}")


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def mapping_specs(relative: str, cls: str) -> list:
    """``[(mapping class name, args, kwargs)]`` of ``cls.mapping_registry()``: every mapping
    constructor call with literal arguments, and an ``AutoMapping`` per entry of each
    ``{megatron: hf}`` dictionary literal it builds."""
    out = []
    for node in ast.walk(_method(relative, cls, "mapping_registry")):
        if isinstance(node, ast.Dict):
            pairs = _literal(node)
            if isinstance(pairs, dict) and all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in pairs.items()):
                out += [("AutoMapping", (), {"megatron_param": k, "hf_param": v})
                        for k, v in pairs.items()]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id.endswith("Mapping"):
            args = [_literal(a) for a in node.args]
            kwargs = {k.arg: _literal(k.value) for k in node.keywords}
            if None in args or None in kwargs.values() or None in kwargs:
                continue  # built from variables: the dictionary entries above
            out.append((node.func.id, tuple(args), kwargs))
    return out


def registry(family: str, expert_bias: bool = False):
    """Megatron-Bridge's real ``MegatronMappingRegistry`` of ``family``'s bridge; with
    ``expert_bias`` also the router's expert-bias mapping of :data:`EXPERT_BIAS_BRIDGE`."""
    from pytest_weightsync.reference_impl.backends import bridge

    param_mapping = bridge.param_mapping()
    registries = importlib.import_module("megatron.bridge.models.conversion.mapping_registry")
    specs = mapping_specs(*families.get(family).bridge)
    if expert_bias:
        specs += [s for s in mapping_specs(*EXPERT_BIAS_BRIDGE)
                  if (s[2].get("megatron_param") or s[1][0]).endswith(".mlp.router.expert_bias")]
    return registries.MegatronMappingRegistry(
        *(getattr(param_mapping, name)(*args, **kwargs) for name, args, kwargs in specs))


def bridge_name(name: str) -> str:
    """``name`` as Bridge looks it up: the wrappers' ``module.`` prefixes removed and a
    ``SequentialMLP`` expert under its ``TEGroupedMLP`` name (``linear_fc1.weight{i}``): Bridge's
    Qwen3-Next registry names only those, and its Qwen3-MoE export of SequentialMLP experts
    goes through the same name (``suites/selftest/test_megatron_bridge.py``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    m = _SEQUENTIAL.match(name)
    return f"{m.group(1)}.{m.group(3)}.weight{m.group(2)}" if m else name


def unknown(reg, names) -> list:
    """The names of ``names`` that no mapping of ``reg`` matches, sorted."""
    return sorted(n for n in names if reg.megatron_to_hf_lookup(bridge_name(n)) is None)


def hf_names(reg, names) -> set:
    """Every Hugging Face name ``reg`` converts ``names`` into (each must be known)."""
    out = set()
    for name in names:
        hf = reg.megatron_to_hf_lookup(bridge_name(name)).hf_param
        out.update(hf.values() if isinstance(hf, dict) else (hf,))
    return out


def provider_defaults(cls: str) -> dict:
    """``{field: default}`` of the literal defaults a provider dataclass of
    :data:`PROVIDERS` declares itself (not inherited)."""
    tree = ast.parse(source(PROVIDERS))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {item.target.id: _literal(item.value) for item in node.body
                    if isinstance(item, ast.AnnAssign) and item.value is not None
                    and isinstance(item.target, ast.Name)}
    raise LookupError(f"{PROVIDERS}: no {cls}")


def provider_bridge_settings(family: str) -> dict:
    """``{attribute: value}`` of the literal ``provider.X = value`` assignments (and the
    literal keywords of a provider constructor call) in ``provider_bridge`` of ``family``'s
    bridge: what Bridge sets on every model of the family it converts."""
    out = {}
    for node in ast.walk(_method(*families.get(family).bridge, "provider_bridge")):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Attribute) \
                and isinstance(node.targets[0].value, ast.Name) \
                and node.targets[0].value.id == "provider":
            value = _literal(node.value)
            if value is not None:
                out[node.targets[0].attr] = value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id.endswith("ModelProvider"):
            out.update((k.arg, v) for k in node.keywords
                       if k.arg and (v := _literal(k.value)) is not None)
    return out
