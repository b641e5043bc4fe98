"""The value function's hash as one fused GPU kernel (Triton), for the oracle's device path.

Why: in torch ops the hash of :mod:`.synth` is some 60 elementwise operations, each a round
trip of the whole block through device memory - about a second per Qwen3.5-35B-A3B checkpoint
on an H100, several per GPU test. The kernel reads the coordinates and writes each 16-bit
pattern once. It computes the same unsigned 32-bit arithmetic (``uint32`` wraps, shifts are
logical), and before its first use on a device and bit spread it is checked against the
torch-ops form on that device over a sample that includes coordinates beyond ``2**31``; where
Triton is missing, fails, or that check differs, the oracle keeps the torch ops (one warning).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

#: Elements per program.
BLOCK = 1024
_STATE: dict = {}  # (device, finite) -> whether the kernel was checked there and is usable


try:  # imported only where the oracle runs on CUDA (synth._fused)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch ops stay
    triton = None

if triton is not None:

    @triton.jit
    def _mix(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    # sizes and version constants vary call to call: one compiled variant per bit spread
    @triton.jit(do_not_specialize=["n_cols", "per_key", "vmask", "vslot"])
    def _hash_grid(out_ptr, keys_ptr, rows_ptr, cols_ptr, n_cols, per_key, vmask, vslot,
                   FINITE: tl.constexpr, BLOCK: tl.constexpr):
        k = tl.program_id(1)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < per_key
        ri = offs // n_cols
        ci = offs - ri * n_cols
        r = tl.load(rows_ptr + ri, mask=live, other=0).to(tl.uint32, bitcast=True)
        c = tl.load(cols_ptr + ci, mask=live, other=0).to(tl.uint32, bitcast=True)
        key = tl.load(keys_ptr + k).to(tl.uint32, bitcast=True)
        x = r * 0x2545F491 + c * 0x9E3779B1 + key
        x = _mix(_mix(x) ^ (r << 20) ^ c)
        sign_mantissa = x & 0x807F
        if FINITE:
            exponent = 0x71 + ((x >> 7) & 0xFF) % 30
            bits = (sign_mantissa | (exponent << 7)) ^ vmask
        else:
            exponent = 1 + ((x >> 7) & 0xFF) % 254
            bits = (sign_mantissa | (exponent << 7)) ^ vmask
            slot = ((x >> 16) + vslot) & 0xFF
            sign = x & 0x8000
            rotated = 1 + ((x & 0x7F) + slot) % 127
            bits = tl.where(slot < 2, slot << 15, bits)
            bits = tl.where((slot >= 2) & (slot < 4), 0x7F80 | ((slot - 2) << 15), bits)
            bits = tl.where((slot >= 4) & (slot < 20), sign | rotated, bits)
            bits = tl.where((slot >= 20) & (slot < 36), sign | 0x7F80 | rotated, bits)
        tl.store(out_ptr + k.to(tl.int64) * per_key + offs, bits.to(tl.int32, bitcast=True),
                 mask=live)


def launch(keys: torch.Tensor, version: int, rows: torch.Tensor, cols: torch.Tensor,
           finite: bool, vmask: int) -> torch.Tensor:
    """int32 ``[len(keys), len(rows), len(cols)]``: the hash of every key at every
    coordinate (``keys``, ``rows``, ``cols`` int32 on one device)."""
    keys, rows, cols = keys.contiguous(), rows.contiguous(), cols.contiguous()
    out = torch.empty(keys.numel(), rows.numel(), cols.numel(), dtype=torch.int32,
                      device=rows.device)
    per_key = rows.numel() * cols.numel()
    if out.numel():
        grid = ((per_key + BLOCK - 1) // BLOCK, keys.numel())
        _hash_grid[grid](out, keys, rows, cols, cols.numel(), per_key, vmask, version & 0xFF,
                        FINITE=bool(finite), BLOCK=BLOCK)
    return out


def hash_grid(keys: torch.Tensor, version: int, rows: torch.Tensor, cols: torch.Tensor,
              finite: bool, mask_of, reference) -> Optional[torch.Tensor]:
    """:func:`launch` where the kernel is usable on ``rows``' device (CUDA, Triton present,
    checked there against ``reference`` - the torch-ops hash ``(keys, version, r, c,
    finite)`` - once per device and bit spread); ``None`` elsewhere. ``mask_of(version)``:
    the version's 16-bit XOR mask (the oracle passes both, so this module imports nothing of
    it)."""
    device = rows.device
    if device.type != "cuda" or triton is None:
        return None
    state = (str(device), bool(finite))
    usable = _STATE.get(state)
    if usable is None:
        usable = _STATE[state] = _self_check(device, finite, mask_of, reference)
    if not usable:
        return None
    return launch(keys, version, rows, cols, finite, mask_of(version))


def _self_check(device, finite: bool, mask_of, reference) -> bool:
    """The kernel against the torch-ops hash on ``device``: keys of both signs, coordinates
    from 0 past ``2**31`` (they wrap to int32 as the oracle's do), four versions."""
    try:
        keys = torch.tensor([0, 1, -1, 0x2545F491, -0x61C88647], dtype=torch.int32,
                            device=device)
        rows = torch.tensor([0, 1, 2, 3, 1000, 2**20 + 7, 2**31 - 1, 2**31 + 5, 2**33 + 3,
                             *range(64, 640)]).to(torch.int32).to(device)
        cols = torch.tensor([0, 1, 511, 2047, 12345, *range(100, 300)]).to(torch.int32).to(device)
        for version in (0, 1, 263, 0xABCDE):
            got = launch(keys, version, rows, cols, finite, mask_of(version))
            want = reference(keys.reshape(-1, 1, 1), version, rows.reshape(1, -1, 1),
                             cols.reshape(1, 1, -1), finite)
            if not torch.equal(got, want.expand_as(got)):
                warnings.warn("the fused oracle kernel differs from the torch-ops hash on "
                              f"{device}: the oracle keeps the torch ops there")
                return False
        return True
    except Exception as error:  # no Triton, no compiler: the torch ops stay
        warnings.warn(f"the fused oracle kernel is not usable on {device} "
                      f"({type(error).__name__}: {error}); the oracle keeps the torch ops")
        return False
