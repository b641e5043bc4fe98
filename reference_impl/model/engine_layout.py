"""What an engine holds in its expert parameters between updates, element by element.

A loader writes the checkpoint layout (``layout.py``: experts, MoE-TP rows, gate/up halves,
padding). Engines then keep other layouts (``ReceiverTopology.engine_layout``, SGLang 0.5.23):

* ``trtllm_block`` - the FlashInfer TRT-LLM BF16 runner. ``UnquantizedFusedMoEMethod.
  process_weights_after_loading`` (``sglang/srt/layers/quantization/unquant.py``,
  ``_apply_trtllm_bf16_block_layout``) rewrites every expert of ``w13_weight`` and
  ``w2_weight`` in place: rows permuted by flashinfer's ``_maybe_get_cached_w3_w1_permute_indices``
  (w13: ``get_reorder_rows_for_gated_act_gemm_row_indices`` - the two halves interleaved - then
  ``get_shuffle_matrix_a_row_indices`` with ``epilogue_tile_m=128``: rows shuffled within blocks
  of 32) or ``get_w2_permute_indices_with_cache`` (w2: the shuffle only), then
  ``convert_to_block_layout(tile, 128)`` on the tile viewed as bytes: ``[K_bytes / 128, M, 128]``.
  ``restore_weights_before_loading`` (called by ``begin_weight_update``) and the weight
  loader's ``maybe_restore_flashinfer_trtllm_bf16_weight_shape_for_load`` undo it before the
  next update. The buffer keeps its storage: the block layout lives in the same bytes.
* ``transposed`` - the triton_kernels runner allocates ``w13 [E, H, 2I]`` and ``w2 [E, I, H]``
  (``UnquantizedFusedMoEMethod.create_weights``) and ``FusedMoE._load_w13`` / ``_load_w2``
  transpose each loaded tensor.

This module answers two questions in two independent ways:

* **Coordinates** (the oracle): :func:`checkpoint_index` / :func:`source_rows` say, in closed
  form, which checkpoint element every engine element holds. the oracle's
  ``synth.expected_engine_params`` evaluates the synthetic value function there, so the
  expected state never comes from running a transform over synthetic tensors.
* **Transforms** (what the reference receiver runs): :func:`apply_post_load` /
  :func:`restore_pre_load` build the permutation the way flashinfer composes it (interleave
  table, shuffle table, block split) and move the bytes in place. The suites check them
  against the coordinates and, where flashinfer imports, against SGLang's own functions
  (``suites/selftest/test_engine_layouts.py``).

Which layout a parameter holds *now* is marked on the tensor itself (:data:`MARK`), as SGLang
marks its transformed parameters (``format_ue8m0``, ``is_shuffled``): the mark dies with the
tensor and needs no registry.
"""

from __future__ import annotations

from typing import Optional

import torch

from pytest_weightsync.reference_impl.model.layout import (
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    receiver_shard,
)

#: TRT-LLM BF16 tile geometry (``unquant._TRTLLM_BF16_EPILOGUE_TILE_M`` / ``_BLOCK_K``): the
#: epilogue tile of 128 rows picks flashinfer's 32-row shuffle; blocks are 128 bytes wide.
TRTLLM_EPILOGUE_TILE_M = 128
TRTLLM_BLOCK_BYTES = 128
#: flashinfer ``utils.srcToDstBlk32RowMap``: source row ``o`` of a 32-row block goes to
#: destination row ``map[o]``.
SHUFFLE_BLOCK = 32
_SRC_TO_DST_32 = tuple((o % 4) * 8 + o // 4 for o in range(SHUFFLE_BLOCK))
#: Attribute naming the post-load layout a parameter tensor holds now (absent: checkpoint).
MARK = "_weightsync_engine_layout"
#: The engine layouts an update has to restore before loading and re-apply after it.
POST_LOAD = ("trtllm_block",)


class EngineLayoutError(WeightSyncError):
    """A parameter whose shape or dtype cannot hold the engine layout asked for."""


# --------------------------------------------------------------------------------------------
# Coordinates (closed form: the oracle)
# --------------------------------------------------------------------------------------------


def trtllm_source_row(param: str, n: torch.Tensor, rows: int) -> torch.Tensor:
    """The checkpoint row that row ``n`` of one expert's TRT-LLM tile holds (``rows`` rows).

    Shuffle (flashinfer ``get_shuffle_matrix_a_row_indices``, 32-row blocks): destination row
    ``n`` of a block takes source row ``(n % 8) * 4 + (n % 32) // 8`` of it. w13 only, before
    that, gate/up interleave (``get_reorder_rows_for_gated_act_gemm_row_indices``): row ``k``
    takes checkpoint row ``k // 2`` (even ``k``, first half) or ``rows // 2 + k // 2`` (odd)."""
    shuffled = (n // SHUFFLE_BLOCK) * SHUFFLE_BLOCK + (n % 8) * 4 + (n % SHUFFLE_BLOCK) // 8
    if param == "w2":
        return shuffled
    return torch.where(shuffled % 2 == 0, shuffled // 2, rows // 2 + shuffled // 2)


def _trtllm_geometry(shape: tuple, element_size: int) -> tuple[int, int, int]:
    """``(rows M, cols K, columns per 128-byte block)`` of one expert's ``[M, K]`` tile."""
    rows, cols = shape
    per_block = TRTLLM_BLOCK_BYTES // element_size
    if cols % per_block or rows % SHUFFLE_BLOCK or rows % 2:
        raise EngineLayoutError(f"a TRT-LLM BF16 tile needs rows divisible by {SHUFFLE_BLOCK} "
                                f"(and even) and columns divisible by {per_block}; got {shape}")
    return rows, cols, per_block


def source_rows(param: str, shape: tuple, element_size: int, device=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, col)`` int64 tensors of ``shape``: the checkpoint element each element of one
    expert's TRT-LLM buffer holds. The buffer keeps its ``[M, K]`` shape; its bytes are the
    block layout ``[K_bytes / 128, M, 128]``, so flat element ``f`` is block ``f // (M * c)``,
    tile row ``(f // c) % M``, column ``f % c`` of that block (``c`` columns per block)."""
    rows, cols, per_block = _trtllm_geometry(shape, element_size)
    flat = torch.arange(rows * cols, device=device)
    block, rem = flat // (rows * per_block), flat % (rows * per_block)
    n, c = rem // per_block, rem % per_block
    src_row = trtllm_source_row(param, n, rows)
    return src_row.view(rows, cols), (block * per_block + c).view(rows, cols)


def checkpoint_index(spec: MoESpec, topo: ReceiverTopology, rank: int, param: str,
                     index: tuple) -> tuple[int, int, int]:
    """The checkpoint-layout index ``(slot, row, col)`` of engine element ``param[index]``
    (``param`` is ``"w13"`` or ``"w2"``), for messages that name model coordinates."""
    slot, i, j = (int(x) for x in index)
    if topo.engine_layout == "transposed":
        return slot, j, i
    if topo.engine_layout == "trtllm_block":
        shard = receiver_shard(spec, topo, rank)
        shape = ((2 * shard.buffer_rows, spec.hidden) if param == "w13"
                 else (spec.hidden, shard.buffer_rows))
        rows, cols, per_block = _trtllm_geometry(shape, spec.dtype.itemsize)
        f = i * cols + j
        block, rem = divmod(f, rows * per_block)
        n, c = divmod(rem, per_block)
        src = int(trtllm_source_row(param, torch.tensor([n]), rows)[0])
        return slot, src, block * per_block + c
    return slot, i, j


def checkpoint_view(spec: MoESpec, topo: ReceiverTopology, rank: int,
                    params: dict) -> dict[str, torch.Tensor]:
    """The checkpoint-layout tensors an engine's parameters stand for, read through the
    coordinates (inverse of :func:`source_rows` by scatter): what a forward of the engine's
    kernels computes with. Copies; ``params`` are not touched."""
    out = {}
    for name, tensor in params.items():
        if topo.engine_layout == "transposed":
            out[name] = tensor.transpose(-2, -1).contiguous()
        elif topo.engine_layout == "trtllm_block":
            param = "w13" if name.endswith("w13_weight") else "w2"
            rows, cols = source_rows(param, tuple(tensor.shape[1:]), tensor.element_size(),
                                     tensor.device)
            canon = torch.empty_like(tensor)
            canon[:, rows, cols] = tensor
            out[name] = canon
        else:
            out[name] = tensor
    return out


# --------------------------------------------------------------------------------------------
# Transforms (what the reference receiver runs), flashinfer's composition
# --------------------------------------------------------------------------------------------


def _trtllm_permutation(param: str, rows: int) -> torch.Tensor:
    """Tile row ``n`` takes row ``perm[n]``: flashinfer's ``permute0[permute1]`` for w13 (the
    gated-activation interleave, then the shuffle), the shuffle alone for w2."""
    old = torch.arange(rows)
    new = (old // SHUFFLE_BLOCK) * SHUFFLE_BLOCK + torch.tensor(_SRC_TO_DST_32)[old % SHUFFLE_BLOCK]
    shuffle = torch.empty(rows, dtype=torch.long)
    shuffle[new] = old
    if param == "w2":
        return shuffle
    interleave = torch.empty(rows, dtype=torch.long)
    interleave[0::2] = torch.arange(rows // 2)
    interleave[1::2] = torch.arange(rows // 2, rows)
    return interleave[shuffle]


def _tile_bytes(expert: torch.Tensor) -> torch.Tensor:
    return expert.contiguous().view(torch.uint8)


def apply_post_load(tensor: torch.Tensor, param: str, layout: str) -> None:
    """Rewrite every expert of ``tensor`` (``[E, M, K]``, checkpoint layout) into ``layout``
    in place, keeping its storage, and mark it."""
    if layout not in POST_LOAD:
        raise EngineLayoutError(f"{layout!r} is no post-load layout (those are {POST_LOAD})")
    if getattr(tensor, MARK, None) == layout:
        raise EngineLayoutError(f"parameter already holds the {layout} layout: applying it "
                                f"again would permute permuted rows")
    rows, _, _ = _trtllm_geometry(tuple(tensor.shape[1:]), tensor.element_size())
    perm = _trtllm_permutation(param, rows).to(tensor.device)
    with torch.no_grad():
        for e in range(tensor.shape[0]):
            tile = _tile_bytes(tensor[e])[perm]  # [M, K_bytes], rows permuted
            blocked = tile.view(rows, -1, TRTLLM_BLOCK_BYTES).permute(1, 0, 2).contiguous()
            tensor[e].view(-1).view(torch.uint8).copy_(blocked.view(-1))
    setattr(tensor, MARK, layout)


def restore_pre_load(tensor: torch.Tensor, param: str) -> None:
    """Undo :func:`apply_post_load` in place (the checkpoint layout a loader writes into);
    a tensor without the mark is left alone."""
    layout = getattr(tensor, MARK, None)
    if layout is None:
        return
    rows, cols, _ = _trtllm_geometry(tuple(tensor.shape[1:]), tensor.element_size())
    inverse = torch.argsort(_trtllm_permutation(param, rows)).to(tensor.device)
    with torch.no_grad():
        for e in range(tensor.shape[0]):
            flat = tensor[e].reshape(-1).view(torch.uint8)
            blocked = flat.view(-1, rows, TRTLLM_BLOCK_BYTES)
            tile = blocked.permute(1, 0, 2).reshape(rows, -1)[inverse]
            flat.copy_(tile.reshape(-1))
    delattr(tensor, MARK)


def held_layout(tensor: torch.Tensor) -> Optional[str]:
    """The post-load layout ``tensor`` holds now (``None``: checkpoint layout)."""
    return getattr(tensor, MARK, None)
