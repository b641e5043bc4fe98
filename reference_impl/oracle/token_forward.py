"""A whole model's forward, one token at a time, from checkpoint-named weights.

It answers the serving properties' question: which tokens and log-probs does a model holding
version ``v`` produce? A serving engine (``reference_impl/serving``) runs it over ITS OWN
parameters (read back into checkpoint names through the engine layout); the judge runs it over
the oracle's values of ``v`` (:func:`oracle_weights`). Where the two agree bit for bit, the
engine computed with exactly version ``v``; a stale prefix, a stale parameter or a mislabelled
version shows as a different token or log-prob.

Every computation is per token, in float32, with shapes that do not depend on how many tokens
came before except the attention over the cache - so a prompt computed in one request and
reused from a prefix cache by another gives the same bits as computing it again, and an engine
that decodes token by token agrees with a teacher-forced pass (:func:`score`). The synthetic
weights hold every bf16 value class (huge, tiny, inf, NaN): each weight enters as
``tanh(nan_to_num(w))``, a bounded value that still changes with every version. The model is
a Qwen3-MoE-like decoder: RMS norms, GQA attention with q/k norms (no rotary position: the
cache order is what positions mean here), a top-k routed MoE with SiLU-gated experts, a final
norm and the LM head. Families with Gated DeltaNet layers are refused: their recurrent state is
not a KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pytest_weightsync.reference_impl.model.layout import WeightSyncError
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec

__all__ = ["LayerWeights", "ModelWeightsView", "TokenForwardError", "TOP_K", "KVCache",
           "oracle_weights", "score", "squash", "step", "weights_from_checkpoint"]

#: Experts each token is routed to (fewer where the model has fewer).
TOP_K = 2
#: RMS norm epsilon.
EPS = 1e-6


class TokenForwardError(WeightSyncError):
    """A model the per-token forward does not model, or weights of the wrong shape."""


def squash(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as the forward uses it: float32, bounded, finite, contiguous."""
    return torch.tanh(torch.nan_to_num(tensor.float(), nan=0.0, posinf=1.0, neginf=-1.0)
                      ).contiguous()


@dataclass
class LayerWeights:
    """One decoder layer's weights, checkpoint layout, squashed: attention ``q`` ``[nh*hd, H]``,
    ``k`` / ``v`` ``[nkv*hd, H]``, ``o`` ``[H, nh*hd]``, ``q_norm`` / ``k_norm`` ``[hd]``, the two
    layer norms ``[H]``, the router ``[E, H]`` and the experts ``gate`` / ``up`` ``[E, I, H]``,
    ``down`` ``[E, H, I]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class ModelWeightsView:
    """A whole model's weights as the forward reads them."""

    spec: ModelSpec
    embed: torch.Tensor
    layers: list
    norm: torch.Tensor
    head: torch.Tensor


@dataclass
class KVCache:
    """One sequence's keys and values, per layer a list of ``[nkv, hd]`` tensors, one per
    token; ``version`` per token: the weights that computed it (what a prefix cache keeps)."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    versions: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.versions)


def check_modelled(spec: ModelSpec) -> None:
    """Refuse a model the forward does not model (a GDN layer has recurrent state)."""
    kinds = {spec.layer_kind(layer) for layer in range(spec.num_layers)}
    if kinds != {"attention"} or spec.mtp_layers or spec.intermediate_shared:
        raise TokenForwardError(
            f"the per-token forward models attention-only MoE models without a shared expert "
            f"or draft (family {spec.family!r} has layer kinds {sorted(kinds)}, "
            f"mtp_layers={spec.mtp_layers}, intermediate_shared={spec.intermediate_shared})")


def weights_from_checkpoint(spec: ModelSpec, dense, experts) -> ModelWeightsView:
    """The forward's view of checkpoint tensors: ``dense`` maps checkpoint names to tensors,
    ``experts[layer]`` is ``(gate [E, I, H], up [E, I, H], down [E, H, I])``. Every weight is
    squashed here, the same way whoever holds it."""
    layers = []
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        gate, up, down = experts[layer]
        attention = {name: squash(dense[f"{p}self_attn.{name}_proj.weight"])
                     for name in ("q", "k", "v", "o")}
        layers.append(LayerWeights(
            **attention,
            q_norm=squash(dense[p + "self_attn.q_norm.weight"]),
            k_norm=squash(dense[p + "self_attn.k_norm.weight"]),
            in_norm=squash(dense[p + "input_layernorm.weight"]),
            post_norm=squash(dense[p + "post_attention_layernorm.weight"]),
            router=squash(dense[p + "mlp.gate.weight"]),
            gate=squash(gate), up=squash(up), down=squash(down)))
    embed = dense["model.embed_tokens.weight"]
    head = embed if spec.tied else dense["lm_head.weight"]
    return ModelWeightsView(spec, squash(embed), layers, squash(dense["model.norm.weight"]),
                            squash(head))


def oracle_weights(spec: ModelSpec, version: int, seed: int = 0) -> ModelWeightsView:
    """The oracle's weights of ``spec`` at ``version`` (checkpoint values), as the forward
    reads them: never read from an engine."""
    from pytest_weightsync.reference_impl.oracle import model_synth

    check_modelled(spec)
    full = model_synth.full_model(spec, version, seed)
    per_layer = full.experts["target"]
    experts = {layer: tuple(torch.stack([per_layer[layer][e][proj]
                                         for e in range(spec.num_experts)])
                            for proj in ("gate", "up", "down"))
               for layer in range(spec.num_layers)}
    return weights_from_checkpoint(spec, full.dense, experts)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * weight


def _attention(w: LayerWeights, spec: ModelSpec, x: torch.Tensor, cache: KVCache, layer: int,
               version) -> torch.Tensor:
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = _rms(torch.mv(w.q, x).view(nh, hd), w.q_norm)
    k = _rms(torch.mv(w.k, x).view(nkv, hd), w.k_norm)
    v = torch.mv(w.v, x).view(nkv, hd)
    if layer == len(cache.keys):
        cache.keys.append([])
        cache.values.append([])
    cache.keys[layer].append(k)
    cache.values[layer].append(v)
    keys = torch.stack(cache.keys[layer])      # [T, nkv, hd]
    values = torch.stack(cache.values[layer])  # [T, nkv, hd]
    group = nh // nkv
    out = []
    for head in range(nh):
        kv = head // group
        scores = torch.mv(keys[:, kv, :], q[head]) / math.sqrt(hd)
        out.append(torch.mv(values[:, kv, :].t(), torch.softmax(scores, 0)))
    return torch.mv(w.o, torch.cat(out))


def _moe(w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(torch.mv(w.router, x), 0)
    top = min(TOP_K, probs.numel())
    weights, ids = torch.topk(probs, top)
    weights = weights / weights.sum()
    order = torch.argsort(ids)  # experts summed in id order: one order for every caller
    out = torch.zeros_like(x)
    for i in order.tolist():
        e = int(ids[i])
        hidden = torch.nn.functional.silu(torch.mv(w.gate[e], x)) * torch.mv(w.up[e], x)
        out = out + weights[i] * torch.mv(w.down[e], hidden)
    return out


def step(weights: ModelWeightsView, token: int, cache: KVCache, version=None) -> torch.Tensor:
    """Log-probs (float32 ``[vocab]``) of the next token after ``token``, whose keys and
    values are appended to ``cache`` (labelled ``version``)."""
    spec = weights.spec
    if not 0 <= token < spec.vocab:
        raise TokenForwardError(f"token {token} outside the vocabulary of {spec.vocab}")
    x = weights.embed[token]
    for layer, w in enumerate(weights.layers):
        x = x + _attention(w, spec, _rms(x, w.in_norm), cache, layer, version)
        x = x + _moe(w, _rms(x, w.post_norm))
    cache.versions.append(version)
    logits = torch.mv(weights.head[:spec.vocab], _rms(x, weights.norm))
    return torch.log_softmax(logits, 0)


def score(weights: ModelWeightsView, prompt: list, completion: list) -> list:
    """The log-prob of every token of ``completion`` after ``prompt`` (teacher forcing, one
    token at a time): what a trainer's forward of these weights gives the engine's tokens."""
    cache = KVCache()
    sequence = list(prompt) + list(completion)
    out = []
    for position, token in enumerate(sequence[:-1]):
        logprobs = step(weights, token, cache)
        if position + 1 >= len(prompt):
            out.append(logprobs[sequence[position + 1]])
    return out
