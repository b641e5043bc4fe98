"""Deterministic synthetic expert weights whose every element says where it belongs.

Each BF16 element is a hash of ``(seed, layer, expert, projection, row, col)``: neighbouring
coordinates, other experts, other layers and the other projection all hold unrelated values,
so a swap, a shift by one, a transpose or a wrong slice changes almost every element it
touches.

The values span every BF16 bit pattern a lossy conversion changes, so a loader or exporter
that sends the weights through FP16, FP8 or a float rounding step anywhere cannot pass: most
elements are normal numbers with an exponent drawn from *every* BF16 binade (far beyond FP16's
range on both ends: above 65504 and below 2^-24) and all 7 mantissa bits random; the rest are
signed zeros, infinities, BF16 subnormals and NaNs with random payloads (quiet and signalling).
A raw-bit copy (every reference path, every real loader) keeps all of them; anything that goes
through float arithmetic or a narrower dtype does not. Consumers that *compute* with the
weights (a forward pass) ask for ``finite=True``: finite normal values inside FP16's range.

Versions: two versions ``v1 != v2 (mod 256)`` differ in *every* element, zeros and NaNs
included, so a stale value left from an earlier version is always visible. A normal element
keeps its (location-derived) exponent and XORs the sign and mantissa with a distinct 8-bit
constant per version (:func:`version_mask`); which elements are special is chosen by
``(hash + version) mod 256``, so no two versions put the same special pattern in one place.

The expected receiver state is computed by evaluating the same function at the coordinates
the layout model assigns to each receiver element (:func:`expected_receiver_params`); it never
slices the full tensors the sender paths slice, so it is an independent oracle for them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pytest_weightsync.reference_impl.model.layout import (
    PROJECTION_INDEX,
    PROJECTIONS,
    EtpGroupedExperts,
    ExpertWeights,
    GroupedExperts,
    MoESpec,
    ReceiverTopology,
    fused_name,
    receiver_shard,
)

_M32 = 0xFFFFFFFF


def _s32(value: int) -> int:
    """A Python int's low 32 bits as a signed 32-bit value (an int32 tensor's literal)."""
    value &= _M32
    return value - (1 << 32) if value >= 1 << 31 else value


def _lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift right of int32 bit patterns (``>>`` on int32 sign-extends)."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32) on int32 bit patterns. int32 multiplication
    wraps modulo 2**32 like the unsigned arithmetic the hash is defined in, and int32 tensors
    halve the memory traffic of int64 ones: the value function is twice as fast."""
    x = x ^ _lsr(x, 16)
    x = x * _s32(0x7FEB352D)
    x = x ^ _lsr(x, 15)
    x = x * _s32(0x846CA68B)
    return x ^ _lsr(x, 16)


def _scalar_key(seed: int, layer: int, expert: int, projection: str) -> int:
    key = 0x9E3779B9
    for part in (seed, layer, expert, PROJECTION_INDEX[projection]):
        key = ((key ^ (part & _M32)) * 0x01000193) & _M32
        key ^= key >> 13
    return key


#: Special-class slots out of 256: [0, 2) signed zeros, [2, 4) infinities, [4, 20) BF16
#: subnormals, [20, 36) NaNs with a payload; the other 220 are normal numbers.
_ZERO_SLOTS, _INF_END, _SUBNORMAL_END, _NAN_END = 2, 4, 20, 36
#: Dtypes that hold every BF16 pattern exactly (NaN payloads included); others get the finite set.
_HOLDS_EVERY_BF16 = (torch.bfloat16, torch.float32)


def version_mask(version: int) -> int:
    """16-bit XOR mask of a version: touches only sign and mantissa, distinct per version
    modulo 256 (an odd multiplier is a bijection on 8 bits), never zero-equal across two."""
    c = (version * 167 + 89) & 0xFF
    return (c & 0x7F) | ((c & 0x80) << 8)


def bf16_bits(seed: int, version: int, layer: int, expert: int, projection: str,
              rows: torch.Tensor, cols: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """int32 tensor ``[len(rows), len(cols)]`` of the 16-bit patterns at those coordinates.

    ``finite=True``: finite normal values with exponents in ``[2^-14, 2^15]`` (exact in FP16,
    safe to compute with); otherwise the full spread described in the module docstring.
    Pure tensor ops on ``rows``' device (no per-element Python)."""
    return keyed_bf16_bits(_scalar_key(seed, layer, expert, projection), version, rows, cols,
                           finite)


def keyed_bf16_bits(key: int, version: int, rows: torch.Tensor, cols: torch.Tensor,
                    finite: bool = False) -> torch.Tensor:
    """:func:`bf16_bits` of an arbitrary 32-bit ``key`` (the expert value function keys by
    ``(seed, layer, expert, projection)``; other tensors of a model key by their name, see
    :mod:`pytest_weightsync.reference_impl.oracle.model_synth`)."""
    r = rows.to(torch.int32).reshape(-1, 1)
    c = cols.to(torch.int32).reshape(1, -1).to(r.device)
    if r.device.type == "cuda":  # one fused kernel there (synth_kernel), checked on first use
        keys = torch.tensor([_s32(key)], dtype=torch.int32, device=r.device)
        fused = _fused(keys, version, r.reshape(-1), c.reshape(-1), finite)
        if fused is not None:
            return fused[0]
    return _bits_at(_s32(key), version, r, c, finite)


def _fused(keys, version: int, rows, cols, finite: bool):
    """The hash of every key at ``rows x cols`` from the fused GPU kernel, or ``None`` where
    it is not in use (:mod:`.synth_kernel`: off CUDA, no Triton, or its check failed)."""
    from pytest_weightsync.reference_impl.oracle import synth_kernel

    return synth_kernel.hash_grid(keys, version, rows, cols, finite, version_mask, _bits_at)


def _bits_at(key, version: int, r: torch.Tensor, c: torch.Tensor, finite: bool) -> torch.Tensor:
    """The hash of :func:`bf16_bits` for int32 coordinates ``r``, ``c`` and ``key`` (a signed
    32-bit Python int, or an int32 tensor of per-expert keys), all broadcast against each
    other. Every operation is on 32-bit patterns: the result equals the same hash computed
    in unsigned 32-bit arithmetic (``suites/selftest/test_mutations_values.py`` checks it
    against a plain Python evaluation)."""
    x = r * _s32(0x2545F491) + c * _s32(0x9E3779B1) + key
    x = _mix32(_mix32(x) ^ (r << 20) ^ c)
    sign_mantissa = x & 0x807F  # bits 0-6 and 15: location-derived sign and mantissa
    if finite:
        exponent = 0x71 + (_lsr(x, 7) & 0xFF) % 30  # biased 113..142: normal in bf16 and fp16
        return (sign_mantissa | (exponent << 7)) ^ version_mask(version)
    exponent = 1 + (_lsr(x, 7) & 0xFF) % 254  # every finite binade, 2^-126 .. 2^127
    bits = (sign_mantissa | (exponent << 7)) ^ version_mask(version)
    # Special classes: the slot rotates with the version, so one place never holds the same
    # special pattern in two versions (and a special never equals a normal: exponent field).
    slot = (_lsr(x, 16) + version) & 0xFF
    sign = x & 0x8000
    rotated = 1 + ((x & 0x7F) + slot) % 127  # non-zero mantissa, distinct per slot in a class
    bits = torch.where(slot < _ZERO_SLOTS, slot << 15, bits)  # +0, -0
    bits = torch.where((slot >= _ZERO_SLOTS) & (slot < _INF_END),
                       0x7F80 | ((slot - _ZERO_SLOTS) << 15), bits)  # +inf, -inf
    bits = torch.where((slot >= _INF_END) & (slot < _SUBNORMAL_END), sign | rotated, bits)
    bits = torch.where((slot >= _SUBNORMAL_END) & (slot < _NAN_END), sign | 0x7F80 | rotated, bits)
    return bits


def expert_bits(seed: int, version: int, layer: int, experts, projection: str,
                rows: torch.Tensor, cols: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """int32 tensor ``[len(experts), len(rows), len(cols)]``: :func:`bf16_bits` of several
    experts of one layer and projection at once (the same bits, one set of launches)."""
    keys = torch.tensor([_s32(_scalar_key(seed, layer, e, projection)) for e in experts],
                        dtype=torch.int32, device=rows.device).reshape(-1, 1, 1)
    r = rows.to(torch.int32).reshape(1, -1, 1)
    c = cols.to(torch.int32).reshape(1, 1, -1).to(r.device)
    if r.device.type == "cuda":
        fused = _fused(keys.reshape(-1), version, r.reshape(-1), c.reshape(-1), finite)
        if fused is not None:
            return fused
    return _bits_at(keys, version, r, c, finite)


def _bits_to_dtype(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    values = signed.view(torch.bfloat16)
    return values if dtype == torch.bfloat16 else values.to(dtype)


def expert_block(spec: MoESpec, version: int, layer: int, expert: int, projection: str,
                 rows: torch.Tensor, cols: torch.Tensor, seed: int = 0,
                 finite: bool = False) -> torch.Tensor:
    """Values of ``projection`` of ``(layer, expert)`` at HF coordinates ``rows x cols``.
    A model dtype that cannot hold every BF16 pattern (FP16, FP64) gets the finite set, so
    the expected values stay exact in it. Always a new tensor (never a view of a cached one)."""
    finite = finite or spec.dtype not in _HOLDS_EVERY_BF16
    full = _cached_block(spec, version, layer, expert, projection, rows, cols, seed, finite)
    if full is not None:
        return full.index_select(0, rows.long()).index_select(1, cols.long())
    return _bits_to_dtype(bf16_bits(seed, version, layer, expert, projection, rows, cols,
                                    finite), spec.dtype)


#: Largest expert block (elements) the CPU cache of :func:`expert_block` keeps, and the most
#: bytes it holds in all (least recently used dropped first; well under what the suites'
#: memory check attributes to an implementation). The suites evaluate the same
#: small blocks again and again - for each format's payload, each rank's expected state, each
#: version - and the hash is some 20 tensor operations per call, each costing more in dispatch
#: than in arithmetic at these sizes. A hit indexes the block the same hash computed over its
#: whole shape, so the values are the same bits; GPU-sized blocks are computed every time.
CACHED_BLOCK_ELEMENTS = 1 << 16
CACHE_BYTES = 32 << 20
_BLOCKS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_CACHED = [0]


def clear_block_cache() -> None:
    """Drop every cached block (self-tests that plant mutants start and end with this)."""
    _BLOCKS.clear()
    _CACHED[0] = 0


def _cached_block(spec: MoESpec, version: int, layer: int, expert: int, projection: str,
                  rows: torch.Tensor, cols: torch.Tensor, seed: int, finite: bool):
    """The whole ``projection`` block of ``(layer, expert)``, from the cache or computed and
    kept; ``None`` when the request is not one the cache serves (off the CPU, a large block,
    coordinates outside the block)."""
    n_rows, n_cols = spec.hf_shape(projection)
    if (rows.device.type != "cpu" or n_rows * n_cols > CACHED_BLOCK_ELEMENTS
            or rows.numel() == 0 or cols.numel() == 0):
        return None
    if int(rows.min()) < 0 or int(cols.min()) < 0 or int(rows.max()) >= n_rows \
            or int(cols.max()) >= n_cols:
        return None
    # the functions the bits come from are part of the key: a self-test that plants a
    # mutant in one of them must get the mutant's bits, and later tests the real ones
    key = (seed, version, layer, expert, projection, finite, spec.dtype, n_rows, n_cols,
           bf16_bits, keyed_bf16_bits, _bits_at, _mix32, _lsr, _scalar_key, version_mask,
           _bits_to_dtype)
    block = _BLOCKS.get(key)
    if block is not None:
        _BLOCKS.move_to_end(key)
        return block
    block = _bits_to_dtype(bf16_bits(seed, version, layer, expert, projection,
                                     torch.arange(n_rows), torch.arange(n_cols), finite),
                           spec.dtype)
    _BLOCKS[key] = block
    _CACHED[0] += block.numel() * block.element_size()
    while _CACHED[0] > CACHE_BYTES:
        _, dropped = _BLOCKS.popitem(last=False)
        _CACHED[0] -= dropped.numel() * dropped.element_size()
    return block


def expert_blocks(spec: MoESpec, version: int, layer: int, experts, projection: str,
                  rows: torch.Tensor, cols: torch.Tensor, seed: int = 0,
                  finite: bool = False) -> torch.Tensor:
    """:func:`expert_block` of several experts of one layer at once:
    ``[len(experts), len(rows), len(cols)]``, the same values as stacking them."""
    finite = finite or spec.dtype not in _HOLDS_EVERY_BF16
    return _bits_to_dtype(expert_bits(seed, version, layer, experts, projection, rows, cols,
                                      finite), spec.dtype)


#: Elements one batch of :func:`expert_blocks` computes in the grouped builders and checks:
#: bounds its int64 temporaries (~10 of them) to a few GiB whatever the model's size.
BATCH_ELEMENTS = 1 << 25


def experts_per_batch(elements_per_expert: int) -> int:
    """How many experts one :func:`expert_blocks` batch takes (at least one)."""
    return max(1, BATCH_ELEMENTS // max(1, elements_per_expert))


# Device handling: every function below takes ``device`` and builds its index tensors there,
# so the value function runs where the weights live. A GPU-sized tensor (one Qwen3.5 MoE layer
# is ~800M elements) is never computed element by element on one CPU thread and copied over:
# on the GPU it takes milliseconds, on the CPU minutes. The bits do not depend on the device
# (integer ops only), which tests/test_gpu_suites_cpu.py and the GPU suites check.


def expert_weights(spec: MoESpec, version: int, layer: int, expert: int,
                   seed: int = 0, *, device=None, finite: bool = False) -> ExpertWeights:
    """The three full Hugging Face tensors of one expert at ``version``, on ``device``."""
    out = {}
    for projection in PROJECTIONS:
        n_rows, n_cols = spec.hf_shape(projection)
        out[projection] = expert_block(spec, version, layer, expert, projection,
                                       torch.arange(n_rows, device=device),
                                       torch.arange(n_cols, device=device), seed, finite=finite)
    return ExpertWeights(**out)


def full_weights(spec: MoESpec, version: int, seed: int = 0,
                 layers=None, *, device=None,
                 finite: bool = False) -> dict[int, tuple[ExpertWeights, ...]]:
    """Full HF expert weights ``{layer: (expert 0, expert 1, ...)}`` at ``version``, on
    ``device``; ``finite`` for consumers that compute with them (see :func:`bf16_bits`)."""
    layers = range(spec.num_layers) if layers is None else layers
    if not _on_cpu(device):
        return _batched_full_weights(spec, version, seed, layers, device, finite)
    return {layer: tuple(expert_weights(spec, version, layer, e, seed, device=device,
                                        finite=finite)
                         for e in range(spec.num_experts))
            for layer in layers}


def _on_cpu(device) -> bool:
    """Whether the builders take the per-expert path (the CPU, where :func:`expert_block`'s
    cache serves the suites' small blocks again and again). Anywhere else they take the
    batched path: one set of launches per batch of experts instead of some 30 launches and
    their Python per expert and projection, which bound a GPU run by the host (a Qwen3.5 layer
    is 768 expert blocks per build). The bits are the same on both paths (tests/
    test_oracle_device_path.py runs the batched path on the CPU against the per-expert one)."""
    return device is None or torch.device(device).type == "cpu"


def _batched_full_weights(spec: MoESpec, version: int, seed: int, layers, device,
                          finite: bool) -> dict[int, tuple[ExpertWeights, ...]]:
    """:func:`full_weights` built a batch of experts at a time (:func:`expert_blocks`). Every
    expert tensor is cloned out of its batch: each keeps a storage of its own, as on the
    per-expert path, so a sender sees the same layout (:func:`grouped_full_weights` is the
    one that shares buffers)."""
    size, hidden, n = spec.intermediate, spec.hidden, spec.num_experts
    rows_i, cols_h = torch.arange(size, device=device), torch.arange(hidden, device=device)
    step = experts_per_batch(size * hidden)
    out = {}
    for layer in layers:
        experts = []
        for start in range(0, n, step):
            chosen = range(start, min(n, start + step))
            gate, up = (expert_blocks(spec, version, layer, chosen, p, rows_i, cols_h, seed,
                                      finite) for p in ("gate", "up"))
            down = expert_blocks(spec, version, layer, chosen, "down", cols_h, rows_i, seed,
                                 finite)
            experts.extend(ExpertWeights(gate[i].clone(), up[i].clone(), down[i].clone())
                           for i in range(len(chosen)))
            del gate, up, down
        out[layer] = tuple(experts)
    return out


def grouped_full_weights(spec: MoESpec, version: int, seed: int = 0, layers=None, *,
                         device=None, finite: bool = False) -> dict[int, tuple[ExpertWeights, ...]]:
    """:func:`full_weights` (the same bits) laid out the way a grouped-GEMM trainer holds its
    experts: per layer one fc1 buffer ``[E, 2I, H]`` (``[gate; up]`` per expert) and one fc2
    buffer ``[E, H, I]``, every :class:`ExpertWeights` tensor a view into them. Payloads whose
    tensors keep this layout are shared without a staging copy
    (:mod:`pytest_weightsync.reference_impl.senders.zerocopy`); built in batches of experts, so a
    whole model on a GPU takes seconds, not the minutes of one launch group per expert."""
    layers = range(spec.num_layers) if layers is None else layers
    size, hidden, n = spec.intermediate, spec.hidden, spec.num_experts
    rows_i, cols_h = torch.arange(size, device=device), torch.arange(hidden, device=device)
    out = {}
    for layer in layers:
        fc1 = torch.empty((n, 2 * size, hidden), dtype=spec.dtype, device=device)
        fc2 = torch.empty((n, hidden, size), dtype=spec.dtype, device=device)
        step = experts_per_batch(size * hidden)
        for start in range(0, n, step):
            chosen = range(start, min(n, start + step))
            for half, projection in enumerate(("gate", "up")):
                fc1[chosen.start:chosen.stop, half * size:(half + 1) * size] = expert_blocks(
                    spec, version, layer, chosen, projection, rows_i, cols_h, seed, finite)
            fc2[chosen.start:chosen.stop] = expert_blocks(
                spec, version, layer, chosen, "down", cols_h, rows_i, seed, finite)
        out[layer] = GroupedExperts(fc1, fc2)
    return out


def etp_grouped_weights(spec: MoESpec, version: int, seed: int = 0, layers=None, *, etp: int,
                        device=None, finite: bool = False) -> dict[int, EtpGroupedExperts]:
    """:func:`full_weights` (the same bits) as a grouped-GEMM trainer's ETP group of ``etp``
    ranks holds them, not gathered: per layer and ETP rank ``r`` one fc1 buffer
    ``[E, 2I/etp, H]`` (``[gate_r; up_r]`` per expert) and one fc2 ``[E, H, I/etp]``
    (:class:`EtpGroupedExperts`). Built layer by layer from :func:`grouped_full_weights`
    (:meth:`EtpGroupedExperts.split`, which refuses an ``etp`` that does not divide the
    intermediate size)."""
    layers = range(spec.num_layers) if layers is None else layers
    out = {}
    for layer in layers:
        whole = grouped_full_weights(spec, version, seed, [layer], device=device, finite=finite)
        out[layer] = EtpGroupedExperts.split(whole[layer], etp)
        del whole
    return out


def storage_words(full: dict[int, tuple[ExpertWeights, ...]]) -> list[torch.Tensor]:
    """Every buffer under :func:`grouped_full_weights`' (or :func:`etp_grouped_weights`')
    result once, as a flat int16 view, so an in-place change between updates (a bitwise xor, as
    a trainer step would write) touches each element exactly once however many expert tensors
    share a buffer."""
    seen = {}
    for layer in full.values():
        tensors = (layer.buffers() if isinstance(layer, EtpGroupedExperts)
                   else [t for w in layer for t in (w.gate, w.down)])
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                flat = torch.empty(0, dtype=torch.int16, device=t.device)
                seen[storage.data_ptr()] = flat.set_(storage, 0, (storage.nbytes() // 2,), (1,))
    return list(seen.values())


def expected_receiver_params(spec: MoESpec, topo: ReceiverTopology, rank: int, version: int,
                             seed: int = 0, *, device=None,
                             finite: bool = False) -> dict[str, torch.Tensor]:
    """What every receiver parameter of ``rank`` must hold after a complete update to
    ``version``: the synthetic value at each element's model coordinates, zero in padding.
    Built on ``device`` (pass the receiver's: the comparison then never leaves it)."""
    shard = receiver_shard(spec, topo, rank)
    cols_h = torch.arange(spec.hidden, device=device)
    rows_i = torch.arange(shard.row_start, shard.row_start + shard.rows, device=device)
    out = {}
    for layer in range(spec.num_layers):
        w13 = torch.zeros(len(shard.experts), 2 * shard.buffer_rows, spec.hidden, dtype=spec.dtype,
                          device=device)
        w2 = torch.zeros(len(shard.experts), spec.hidden, shard.buffer_rows, dtype=spec.dtype,
                         device=device)
        out[fused_name(layer, "w13")] = w13
        out[fused_name(layer, "w2")] = w2
        if not _on_cpu(device):
            _fill_receiver_layer(spec, topo, shard, version, layer, seed, finite, w13, w2,
                                 rows_i, cols_h)
            continue
        for slot, expert in enumerate(shard.slot_experts(layer)):  # every physical copy
            for projection in ("gate", "up"):
                off = shard.half_offset(projection, topo.order)
                w13[slot, off:off + shard.rows] = expert_block(
                    spec, version, layer, expert, projection, rows_i, cols_h, seed, finite=finite)
            # down_proj is [hidden, intermediate]: the rank owns columns rows_i.
            w2[slot, :, :shard.rows] = expert_block(
                spec, version, layer, expert, "down", cols_h, rows_i, seed, finite=finite)
    return out


def _fill_receiver_layer(spec: MoESpec, topo: ReceiverTopology, shard, version: int,
                         layer: int, seed: int, finite: bool, w13: torch.Tensor,
                         w2: torch.Tensor, rows_i: torch.Tensor, cols_h: torch.Tensor) -> None:
    """:func:`expected_receiver_params`' loop over slots for one layer, a batch of slots at a
    time (the batched path, see :func:`_on_cpu`): the same coordinates, the same bits."""
    finite = finite or spec.dtype not in _HOLDS_EVERY_BF16
    slots = list(shard.slot_experts(layer))  # every physical copy
    step = experts_per_batch(shard.rows * spec.hidden)
    for start in range(0, len(slots), step):
        stop = min(len(slots), start + step)
        chosen = slots[start:stop]
        for projection in ("gate", "up"):
            off = shard.half_offset(projection, topo.order)
            w13[start:stop, off:off + shard.rows] = expert_blocks(
                spec, version, layer, chosen, projection, rows_i, cols_h, seed, finite)
        # down_proj is [hidden, intermediate]: the rank owns columns rows_i.
        w2[start:stop, :, :shard.rows] = expert_blocks(
            spec, version, layer, chosen, "down", cols_h, rows_i, seed, finite)


#: Period of the poison pattern, in elements: the pattern is one tile of this many hashed
#: values repeated, so poisoning costs a copy, not a hash per element (a 36 MiB layer in
#: milliseconds). An element's poison depends only on its flat index.
POISON_TILE = 1 << 16
_TILES: dict = {}


def poison_values(start: int, stop: int, dtype: torch.dtype, seed: int = 0xBAD,
                  device=None) -> torch.Tensor:
    """Flat elements ``start .. stop - 1`` of the poison pattern, on ``device``."""
    tile = _poison_tile(dtype, seed, device)
    index = torch.arange(start, stop, device=tile.device) % POISON_TILE
    return tile[index]


def _poison_tile(dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    key = (dtype, seed, POISON_TILE, str(torch.device(device) if device is not None else "cpu"))
    tile = _TILES.get(key)
    if tile is None:
        flat = torch.arange(POISON_TILE, device=device)
        bits = bf16_bits(seed, 0x55, -1, -1, "gate", flat,
                         torch.zeros(1, dtype=torch.int64, device=device),
                         finite=True)  # non-zero, finite: never equal to zero padding
        tile = _TILES[key] = _bits_to_dtype(bits.reshape(-1), dtype)
    return tile


def poison_(tensor: torch.Tensor, seed: int = 0xBAD) -> torch.Tensor:
    """Fill ``tensor`` in place with an unrelated non-zero pattern, so an element a loader
    forgot to write (or a padding tail it forgot to zero) does not equal its expected value
    by luck of a zero-initialised buffer. The pattern is built on the tensor's own device and
    depends only on each element's flat index (:data:`POISON_TILE`)."""
    with torch.no_grad():
        n = tensor.numel()
        if n == 0:
            return tensor
        tile = _poison_tile(tensor.dtype, seed, tensor.device)
        if not tensor.is_contiguous():  # strided: build whole, copy once (small in practice)
            tensor.copy_(poison_values(0, n, tensor.dtype, seed, tensor.device).view(tensor.shape))
            return tensor
        flat = tensor.view(-1)
        whole = n // POISON_TILE
        if whole:
            flat[:whole * POISON_TILE].view(whole, POISON_TILE).copy_(
                tile.expand(whole, POISON_TILE))
        rest = n - whole * POISON_TILE
        if rest:
            flat[whole * POISON_TILE:].copy_(tile[:rest])
    return tensor


def expected_engine_params(spec: MoESpec, topo: ReceiverTopology, rank: int, version: int,
                           seed: int = 0, *, device=None, finite: bool = False
                           ) -> dict[str, torch.Tensor]:
    """What every expert parameter of receiver ``rank`` holds after a complete update to
    ``version``, in the engine's layout: the checkpoint-layout expected state (``synth``, at
    layout coordinates, every physical copy of a redundant expert included), then each engine
    element taken from the checkpoint element :func:`~pytest_weightsync.reference_impl.model.engine_layout.source_rows` names."""
    from pytest_weightsync.reference_impl.model.engine_layout import source_rows

    out = expected_receiver_params(spec, topo, rank, version, seed, device=device,
                                         finite=finite)
    if topo.engine_layout == "transposed":
        return {name: t.transpose(-2, -1).contiguous() for name, t in out.items()}
    if topo.engine_layout == "trtllm_block":
        for name, tensor in out.items():
            param = "w13" if name.endswith("w13_weight") else "w2"
            rows, cols = source_rows(param, tuple(tensor.shape[1:]), tensor.element_size(),
                                     tensor.device)
            out[name] = tensor[:, rows, cols].contiguous()
    return out
