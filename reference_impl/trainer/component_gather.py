"""Tensor-parallel gathers of fused weights whose dim 0 is a list of components.

A fused projection such as GLU ``fc1 = [gate; up]`` or GDN ``in_proj = [q; k; v; z; b; a]`` is
sharded per component: TP rank ``r`` holds ``[gate_r; up_r]``, which is not a contiguous slice
of the unsharded tensor. The correct gather is component-major: split each shard into its
components, gather each component across ranks, concatenate component by component.
Concatenating whole shards gives ``[gate_0; up_0; gate_1; up_1]`` - the same shape, wrong rows.

Megatron's attention ``linear_qkv`` is the exception: it interleaves per query group and TP
shards hold whole groups, so its gather is a plain concatenation followed by
:func:`split_megatron_qkv` (see :func:`megatron_qkv_layout`).

Three forms give the same bits: :func:`assemble_components` (one process, given every shard),
:func:`gather_components_sequential` (one blocking all_gather per component) and
:func:`gather_components_async` (every component's all_gather issued with ``async_op=True``
straight into its place in the output, then waited on together: no reorder copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pytest_weightsync.reference_impl.errors import WeightSyncError


class ComponentLayoutError(WeightSyncError):
    """A shard or layout does not fit the component sizes."""


@dataclass(frozen=True)
class ComponentLayout:
    """Named components of a fused tensor and their unsharded sizes along dim 0."""

    name: str
    components: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.components) != len(self.sizes) or not self.sizes:
            raise ComponentLayoutError(f"{self.name}: {len(self.components)} component names for {len(self.sizes)} sizes")
        if any(s < 0 for s in self.sizes):
            raise ComponentLayoutError(f"{self.name}: component sizes must be >= 0, got {self.sizes}")

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def shard_sizes(self, tp: int) -> tuple[int, ...]:
        """Rows of each component in one of ``tp`` shards; every size must divide by ``tp``."""
        if tp < 1:
            raise ComponentLayoutError(f"{self.name}: tensor-parallel size must be >= 1, got {tp}")
        bad = [(c, s) for c, s in zip(self.components, self.sizes) if s % tp]
        if bad:
            raise ComponentLayoutError(f"{self.name}: components {bad} do not divide by TP size {tp}")
        return tuple(s // tp for s in self.sizes)

    def locate(self, row: int, tp: int) -> tuple[str, int, int]:
        """(component, source TP rank, row within that rank's component) of an unsharded row."""
        start = 0
        for name, size, part in zip(self.components, self.sizes, self.shard_sizes(tp)):
            if row < start + size:
                return name, (row - start) // part, (row - start) % part
            start += size
        raise IndexError(f"{self.name}: row {row} outside {self.rows} rows")


def glu_fc1_layout(ffn: int) -> ComponentLayout:
    """Gated MLP ``fc1 = [gate; up]``, each ``ffn`` rows unsharded."""
    return ComponentLayout("glu_fc1", ("gate", "up"), (ffn, ffn))


def gdn_in_proj_layout(key_head_dim: int, num_k_heads: int, value_head_dim: int, num_v_heads: int) -> ComponentLayout:
    """Gated DeltaNet ``in_proj = [q; k; v; z; b; a]`` with rows ``[qk, qk, v, v, nv, nv]``."""
    qk, v = key_head_dim * num_k_heads, value_head_dim * num_v_heads
    return ComponentLayout("gdn_in_proj", ("q", "k", "v", "z", "b", "a"), (qk, qk, v, v, num_v_heads, num_v_heads))


def gdn_conv1d_layout(key_head_dim: int, num_k_heads: int, value_head_dim: int, num_v_heads: int) -> ComponentLayout:
    """Gated DeltaNet ``conv1d.weight = [q; k; v]`` (channels along dim 0)."""
    qk, v = key_head_dim * num_k_heads, value_head_dim * num_v_heads
    return ComponentLayout("gdn_conv1d", ("q", "k", "v"), (qk, qk, v))


def qkv_layout(q_rows: int, kv_rows: int) -> ComponentLayout:
    """Fused attention QKV as three blocks ``[q; k; v]``, each sharded over TP.

    This is the *receiver* layout (SGLang's ``QKVParallelLinear.qkv_proj``: TP rank ``r`` holds
    ``[q_r; k_r; v_r]``) and HF-style ``[q; k; v]`` concatenations. It is NOT Megatron-Core's
    ``linear_qkv``, which interleaves per query group: use :func:`megatron_qkv_layout` and
    :func:`split_megatron_qkv` for the trainer side.
    """
    return ComponentLayout("qkv", ("q", "k", "v"), (q_rows, kv_rows, kv_rows))


class MegatronQKVError(ComponentLayoutError):
    """Head counts or tensors that do not fit Megatron's per-query-group QKV layout."""


def _check_heads(num_heads: int, num_query_groups: int, head_dim: int, tp: int = 1) -> int:
    for name, value in (("num_heads", num_heads), ("num_query_groups", num_query_groups), ("head_dim", head_dim), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise MegatronQKVError(f"megatron_qkv: {name} must be a positive int, got {value!r}")
    if num_heads % num_query_groups:
        raise MegatronQKVError(f"megatron_qkv: num_heads={num_heads} is not divisible by num_query_groups={num_query_groups}")
    if num_query_groups % tp:
        raise MegatronQKVError(f"megatron_qkv: num_query_groups={num_query_groups} does not divide by TP size {tp}")
    return num_heads // num_query_groups


def megatron_qkv_layout(num_heads: int, num_query_groups: int, head_dim: int, tp: int = 1) -> ComponentLayout:
    """Megatron-Core ``self_attention.linear_qkv``: one block per query group.

    Query group ``g`` is ``[q heads g*n .. g*n+n-1; k head g; v head g]`` (``n = num_heads /
    num_query_groups`` heads of ``head_dim`` rows each), groups in order; this is how
    ``SelfAttention.get_query_key_value_tensors`` views the projection. TP rank ``r`` holds whole
    query groups ``[r*G/tp, (r+1)*G/tp)``: a *contiguous* slice, so the TP gather is a plain
    concatenation (one component), and the split into HF ``q``/``k``/``v`` comes after it
    (:func:`split_megatron_qkv`). Gathering it as ``[q; k; v]`` components (:func:`qkv_layout`)
    is wrong whenever there is more than one query group.
    """
    heads_per_group = _check_heads(num_heads, num_query_groups, head_dim, tp)
    return ComponentLayout("megatron_qkv", ("query_groups",), ((heads_per_group + 2) * head_dim * num_query_groups,))


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_query_groups: int,
                   head_dim: int) -> torch.Tensor:
    """Megatron ``linear_qkv`` (unsharded) from HF ``q_proj`` / ``k_proj`` / ``v_proj`` (dim 0 = heads)."""
    n = _check_heads(num_heads, num_query_groups, head_dim)
    want = {"q": num_heads * head_dim, "k": num_query_groups * head_dim, "v": num_query_groups * head_dim}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 1 or t.shape[0] != want[name]:
            raise MegatronQKVError(f"megatron_qkv: {name} has {tuple(t.shape)}, dim 0 must be {want[name]}")
    rest = tuple(q.shape[1:])
    qg = q.reshape(num_query_groups, n * head_dim, *rest)
    kg = k.reshape(num_query_groups, head_dim, *rest)
    vg = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_megatron_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int):
    """HF ``(q, k, v)`` from an unsharded (gathered) Megatron ``linear_qkv``."""
    n = _check_heads(num_heads, num_query_groups, head_dim)
    rows = (n + 2) * head_dim * num_query_groups
    if qkv.dim() < 1 or qkv.shape[0] != rows:
        raise MegatronQKVError(f"megatron_qkv: linear_qkv has {tuple(qkv.shape)}, dim 0 must be {rows}")
    rest = tuple(qkv.shape[1:])
    groups = qkv.reshape(num_query_groups, (n + 2) * head_dim, *rest)
    q, k, v = torch.split(groups, [n * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _check_shard(shard: torch.Tensor, layout: ComponentLayout, tp: int, where: str) -> tuple[int, ...]:
    sizes = layout.shard_sizes(tp)
    if shard.dim() < 1 or shard.shape[0] != sum(sizes):
        raise ComponentLayoutError(
            f"{layout.name}: {where} has {tuple(shard.shape)}, dim 0 must be {sum(sizes)} = sum of {dict(zip(layout.components, sizes))}"
        )
    return sizes


def split_components(shard: torch.Tensor, layout: ComponentLayout, tp: int) -> tuple[torch.Tensor, ...]:
    """Views of each component of one TP shard."""
    sizes = _check_shard(shard, layout, tp, "shard")
    return tuple(torch.split(shard, sizes, dim=0))


def shard_of(full: torch.Tensor, layout: ComponentLayout, tp: int, rank: int) -> torch.Tensor:
    """The shard TP rank ``rank`` holds: its slice of every component, concatenated."""
    if full.shape[0] != layout.rows:
        raise ComponentLayoutError(f"{layout.name}: unsharded tensor has {full.shape[0]} rows, layout has {layout.rows}")
    parts = layout.shard_sizes(tp)
    pieces = torch.split(full, layout.sizes, dim=0)
    return torch.cat([p[rank * n : (rank + 1) * n] for p, n in zip(pieces, parts)], dim=0)


def assemble_components(shards, layout: ComponentLayout) -> torch.Tensor:
    """Unsharded tensor from every rank's shard (single process, component-major)."""
    shards = list(shards)
    tp = len(shards)
    if tp == 0:
        raise ComponentLayoutError(f"{layout.name}: no shards to assemble")
    first = shards[0]
    for r, s in enumerate(shards):
        _check_shard(s, layout, tp, f"shard of rank {r}")
        if s.shape[1:] != first.shape[1:] or s.dtype != first.dtype:
            raise ComponentLayoutError(
                f"{layout.name}: shard of rank {r} is {tuple(s.shape)} {s.dtype}, rank 0 has {tuple(first.shape)} {first.dtype}"
            )
    split = [split_components(s, layout, tp) for s in shards]
    return torch.cat([split[r][c] for c in range(len(layout.sizes)) for r in range(tp)], dim=0)


def _empty_full(shard: torch.Tensor, layout: ComponentLayout) -> torch.Tensor:
    return torch.empty((layout.rows, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)


def _component_rows(full: torch.Tensor, layout: ComponentLayout) -> tuple[torch.Tensor, ...]:
    return tuple(torch.split(full, layout.sizes, dim=0))


def gather_components_sequential(shard: torch.Tensor, layout: ComponentLayout, *, group=None) -> torch.Tensor:
    """One blocking all_gather per component, then a component-major concatenation."""
    tp = dist.get_world_size(group)
    parts = []
    for component in split_components(shard, layout, tp):
        received = [torch.empty_like(component) for _ in range(tp)]
        dist.all_gather(received, component.contiguous(), group=group)
        parts.extend(received)
    return torch.cat(parts, dim=0)


def gather_components_async(shard: torch.Tensor, layout: ComponentLayout, *, group=None) -> torch.Tensor:
    """Every component's all_gather in flight at once, each straight into its rows of the output.

    Component ``c`` of the unsharded tensor is exactly the rank-major concatenation of every
    rank's component ``c``, i.e. what ``all_gather_into_tensor`` writes; no reorder is needed.
    """
    tp = dist.get_world_size(group)
    shard = shard.contiguous()
    full = _empty_full(shard, layout)
    works = [
        dist.all_gather_into_tensor(dst, src, group=group, async_op=True)
        for dst, src in zip(_component_rows(full, layout), split_components(shard, layout, tp))
        if src.numel()
    ]
    for work in works:
        work.wait()
    return full
