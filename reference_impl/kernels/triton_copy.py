"""One Triton launch that copies many 2-D tensor pairs, each with its own pointers and strides.

Expert weights live in separate per-expert allocations on the trainer side and land in views of
fused buffers on the receiver side; at receiver MoE-TP > 1 the sources are row slices of fc1
halves and column slices of fc2. ``torch._foreach_copy_`` handles such lists but falls back to
one kernel per strided tensor; a per-tensor loop pays one launch per expert. This kernel reads a
small table of (pointer, rows, cols, strides) per pair and a block table saying which tile of
which pair each program copies, so the whole list is one launch per element size.

Elements are moved as unsigned integers of the element's width, which makes the copy
bit-identical to ``dst.copy_(src)`` for equal dtypes (NaN payloads and signed zeros included).

Importing this module imports triton; :mod:`pytest_weightsync.reference_impl.kernels.fastcopy` imports it lazily and
falls back to ``torch._foreach_copy_`` where triton is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Launch shape, from a sweep on an H200 (``bench_expert_sync.py --sweep``: the strided fc2
#: column slices of a Qwen3.5-35B-A3B layer at receiver MoE-TP 2, bf16, graph-captured; tiles
#: of 2-16 K elements x 1-4 tiles per program x 2-8 warps): tiles of 4096 elements, one tile
#: per program, 2 warps moved 1,820 GB/s against 1,769 for the earlier 4096 / 2 / 4 (which
#: ncu showed at 64 registers a thread, 50% occupancy); 16 K tiles with 2 warps fell to 250-1,260.
#: Streaming cache hints (evict-first loads, .cs stores) cost about 5% in an earlier sweep, so
#: the kernel uses plain loads and stores.
#: Elements copied by one tile (8 KiB of bf16). The tile is ``TILE // block_cols`` rows
#: by ``block_cols`` columns, with ``block_cols`` picked per pair from its row length so that
#: narrow column slices (fc2 at MoE-TP 2: 256 columns) still fill whole tiles.
TILE = 4096
MAX_BLOCK_COLS = 1024
NUM_WARPS = 2
TILES_PER_PROGRAM = 1
MIN_BLOCK_COLS = 16


def block_cols_for(cols: int) -> int:
    """Tile width for rows of ``cols`` elements: the next power of two, clamped."""
    width = MIN_BLOCK_COLS
    while width < cols and width < MAX_BLOCK_COLS:
        width *= 2
    return width

#: Element widths (bytes) the kernel moves, each as an integer of that width.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Columns of the per-pair metadata table (int64): src address, dst address, rows, cols,
#: src row/col stride, dst row/col stride (elements), tiles per row, index of its first program.
_META_WIDTH = 10


@triton.jit
def _copy_tiles_kernel(
    meta_ptr,
    block_pair_ptr,
    ELEM: tl.constexpr,
    META_WIDTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ALIGNED: tl.constexpr,
    TILES: tl.constexpr,
    EVEN: tl.constexpr,
    OFFSET32: tl.constexpr,
):
    pid = tl.program_id(0)
    pair = tl.load(block_pair_ptr + pid).to(tl.int64)
    row = meta_ptr + pair * META_WIDTH
    src_addr = tl.load(row + 0)
    dst_addr = tl.load(row + 1)
    n_rows = tl.load(row + 2)
    n_cols = tl.load(row + 3)
    ss0 = tl.load(row + 4)
    ss1 = tl.load(row + 5)
    ds0 = tl.load(row + 6)
    ds1 = tl.load(row + 7)
    tiles_c = tl.load(row + 8)
    first_block = tl.load(row + 9)

    if ELEM == 1:
        ptr_ty = tl.pointer_type(tl.uint8)
    elif ELEM == 2:
        ptr_ty = tl.pointer_type(tl.int16)
    elif ELEM == 4:
        ptr_ty = tl.pointer_type(tl.int32)
    else:
        ptr_ty = tl.pointer_type(tl.int64)
    if ALIGNED:
        # Every address and row stride is a multiple of 16 bytes and columns are unit-stride:
        # say so, so the compiler emits 16-byte vector loads and stores.
        VEC: tl.constexpr = 16 // ELEM
        src_addr = tl.multiple_of(src_addr, 16)
        dst_addr = tl.multiple_of(dst_addr, 16)
        ss0 = tl.multiple_of(ss0, VEC)
        ds0 = tl.multiple_of(ds0, VEC)
        n_cols = tl.multiple_of(n_cols, VEC)  # keeps the column mask constant per vector
        ss1 = 1
        ds1 = 1
    src_base = src_addr.to(ptr_ty)
    dst_base = dst_addr.to(ptr_ty)

    # This program copies TILES consecutive tiles (row-major over the pair's tile grid), so
    # the table lookups above are paid once per TILES * BLOCK_R * BLOCK_C elements. EVEN: every
    # pair of this launch is whole tiles and whole programs, so no element needs a mask;
    # otherwise tiles past the pair's end fall outside n_rows and are fully masked. OFFSET32:
    # every offset of this launch fits in 32 bits, which halves the index arithmetic.
    if OFFSET32:
        ss0 = ss0.to(tl.int32)
        ss1 = ss1.to(tl.int32)
        ds0 = ds0.to(tl.int32)
        ds1 = ds1.to(tl.int32)
        first = ((pid - first_block) * TILES).to(tl.int32)
        tiles_c = tiles_c.to(tl.int32)
        r_range = tl.arange(0, BLOCK_R)
        c_range = tl.arange(0, BLOCK_C)
    else:
        first = (pid - first_block) * TILES
        r_range = tl.arange(0, BLOCK_R).to(tl.int64)
        c_range = tl.arange(0, BLOCK_C).to(tl.int64)
    for i in tl.static_range(TILES):
        tile = first + i
        tile_r = tile // tiles_c
        tile_c = tile - tile_r * tiles_c
        rows = tile_r * BLOCK_R + r_range
        cols = tile_c * BLOCK_C + c_range
        src_ptrs = src_base + rows[:, None] * ss0 + cols[None, :] * ss1
        dst_ptrs = dst_base + rows[:, None] * ds0 + cols[None, :] * ds1
        if EVEN:
            vals = tl.load(src_ptrs)
            tl.store(dst_ptrs, vals)
        else:
            mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            vals = tl.load(src_ptrs, mask=mask)
            tl.store(dst_ptrs, vals, mask=mask)


@dataclass(frozen=True)
class LaunchShape:
    """How a launch cuts its copies: ``tile`` elements per tile, ``tiles_per_program`` tiles
    per program, ``num_warps`` warps per program (defaults from the H200 sweep above)."""

    tile: int = TILE
    tiles_per_program: int = TILES_PER_PROGRAM
    num_warps: int = NUM_WARPS

    def block_rows(self, block_cols: int) -> int:
        return max(1, self.tile // block_cols)

    def even(self, copy: tuple[int, ...], block_cols: int) -> bool:
        """Whether ``copy`` is whole tiles and whole programs: copied with no masks."""
        rows, cols = copy[2], copy[3]
        block_rows = self.block_rows(block_cols)
        tiles = -(-rows // block_rows) * -(-cols // block_cols)
        return rows % block_rows == 0 and cols % block_cols == 0 and tiles % self.tiles_per_program == 0

    def key(self, copy: tuple[int, ...]) -> tuple[int, bool]:
        """The part of a launch's grouping key this shape decides: tile width, evenness."""
        width = block_cols_for(copy[3])
        return width, self.even(copy, width)


def _to_device(table: torch.Tensor, device) -> torch.Tensor:
    """A launch table on ``device`` without waiting for the device.

    A blocking copy from pageable host memory (``tensor.to(device)``) synchronizes the current
    stream: a receiver planning bucket ``b + 1`` while its stream still copies bucket ``b``
    would wait for that copy on the host, and the pipeline of buckets would run one after the
    other. From pinned memory the copy is queued like any other work (torch's pinned-memory
    allocator keeps the host block until the copy has run)."""
    if torch.device(device).type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


class _LaunchTables:
    """Device launch tables by what determines them (addresses, extents, strides, tile
    shape): a sender that plans the same copies every update (a stateless export staging
    ``[gate_r; up_r]`` into the same pool memory) reuses its tables instead of building and
    uploading them again - 0.5 ms of host time per launch on an H100 host (2026-12-06), where
    the copy it launches takes 0.3 ms. A table holds numbers, not tensors: a cached one keeps
    no memory of the copies alive, and a launch still keeps its own tensors (``keep_alive``).
    An upload is queued on the stream current when it was made: a launch on another stream
    waits for it on the device until the upload is known done."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._tables: dict = {}

    def get(self, key):
        entry = self._tables.get(key)
        if entry is None or torch.cuda.is_current_stream_capturing():
            return None  # a capture neither queries nor waits for work outside it
        tables, stream, done = entry
        if done is not None:
            if done.query():  # uploaded: no stream needs to wait any more
                self._tables[key] = (tables, stream, None)
            elif torch.cuda.current_stream(tables[0].device) != stream:
                torch.cuda.current_stream(tables[0].device).wait_event(done)
        self._tables[key] = self._tables.pop(key)  # most recently used last
        return tables

    def put(self, key, device, tables):
        if torch.device(device).type != "cuda" or torch.cuda.is_current_stream_capturing():
            return tables
        while len(self._tables) >= self.capacity:
            self._tables.pop(next(iter(self._tables)))  # least recently used
        stream = torch.cuda.current_stream(tables[0].device)
        done = torch.cuda.Event()
        done.record(stream)
        self._tables[key] = (tables, stream, done)
        return tables

    def clear(self) -> None:
        self._tables.clear()

    def __len__(self) -> int:
        return len(self._tables)


#: Every launch's tables, shared by the launches of this process (see :class:`_LaunchTables`).
_LAUNCH_TABLES = _LaunchTables()


class TritonCopyLaunch:
    """One launch over 2-D copies of one element width and tile width, reusable.

    ``copies`` holds ``(src_addr, dst_addr, rows, cols, src_stride0, src_stride1, dst_stride0,
    dst_stride1)`` with strides in elements; ``keep_alive`` holds the tensors those addresses
    point into, so they stay valid for as long as this object lives. ``aligned`` promises that
    every address and row stride is a multiple of 16 bytes and every column stride is 1 (the
    caller checks) and that every row length is a multiple of 16 bytes, which lets the kernel
    use vector memory accesses. When every copy is whole tiles (:meth:`LaunchShape.even`) the
    kernel runs without masks, and when every offset fits in 32 bits it indexes in 32 bits.
    """

    def __init__(
        self,
        copies: list[tuple[int, ...]],
        elem_size: int,
        block_cols: int,
        aligned: bool,
        device: torch.device,
        keep_alive: list[torch.Tensor],
        shape: LaunchShape = LaunchShape(),
    ):
        if elem_size not in _BITS_DTYPE:
            raise ValueError(f"element size must be one of {sorted(_BITS_DTYPE)}, got {elem_size}")
        self.elem_size = elem_size
        self.block_cols = block_cols
        self.block_rows = shape.block_rows(block_cols)
        self.num_warps = shape.num_warps
        self.tiles_per_program = tiles_per_program = shape.tiles_per_program
        self.aligned = aligned
        self.keep_alive = keep_alive
        meta = []
        blocks_per_pair = []
        first = 0
        self.even = all(shape.even(c, block_cols) for c in copies)
        self.offset32 = True
        for src, dst, rows, cols, ss0, ss1, ds0, ds1 in copies:
            tiles_r = -(-rows // self.block_rows)
            tiles_c = -(-cols // block_cols)
            blocks = -(-(tiles_r * tiles_c) // tiles_per_program)
            # Largest offset any lane forms, masked lanes of the last tiles included.
            reach_r, reach_c = tiles_r * self.block_rows, tiles_c * block_cols
            for s0, s1 in ((ss0, ss1), (ds0, ds1)):
                self.offset32 &= (reach_r * abs(s0) + reach_c * abs(s1)) < 2**31
            meta.append((src, dst, rows, cols, ss0, ss1, ds0, ds1, tiles_c, first))
            blocks_per_pair.append(blocks)
            first += blocks
        self.n_blocks = first
        key = (str(device), self.block_rows, block_cols, tiles_per_program, tuple(meta))
        tables = _LAUNCH_TABLES.get(key)
        if tables is None:
            counts = torch.tensor(blocks_per_pair, dtype=torch.int64)
            tables = _LAUNCH_TABLES.put(key, device, (
                _to_device(torch.tensor(meta, dtype=torch.int64).reshape(-1, _META_WIDTH), device),
                _to_device(torch.repeat_interleave(
                    torch.arange(len(copies), dtype=torch.int32), counts), device)))
        self.meta, self.block_pair = tables

    def run(self) -> None:
        if self.n_blocks == 0:
            return
        _copy_tiles_kernel[(self.n_blocks,)](
            self.meta,
            self.block_pair,
            ELEM=self.elem_size,
            META_WIDTH=_META_WIDTH,
            BLOCK_R=self.block_rows,
            BLOCK_C=self.block_cols,
            ALIGNED=self.aligned,
            TILES=self.tiles_per_program,
            EVEN=self.even,
            OFFSET32=self.offset32,
            num_warps=self.num_warps,
        )
