"""Many small copies as one operation.

Every sender path expresses its work as a list of ``(dst, src)`` tensor pairs of equal shape
and dtype and hands it to :func:`copy_pairs`; making that one call fast makes every path fast.

Why a dedicated routine: expert weights are separate per-expert allocations on the trainer and
views into fused ``w13``/``w2`` buffers on the receiver. A loop of ``dst.copy_(src)`` costs one
kernel launch per expert on a GPU (7% of a plain copy at MoE-TP 1, 2% at MoE-TP 2 for a
Qwen3.5-35B-A3B layer on an H200), and ``torch._foreach_copy_`` degrades on the strided slices
of MoE-TP 2. On a GPU this module copies every pair in one Triton launch per element width and
row-length class (:mod:`pytest_weightsync.reference_impl.triton_copy`); on a CPU a single-threaded loop of
in-place copies already runs at the speed of one plain copy, so it is kept.

Backends (``backend=``): ``"auto"`` picks ``"triton"`` for CUDA tensors when triton imports,
``"foreach"`` (``torch._foreach_copy_``) for CUDA tensors without triton, and ``"loop"`` for
every other device. All are bit-identical to ``dst.copy_(src)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_weightsync.reference_impl.errors import WeightSyncError

BACKENDS = ("auto", "triton", "foreach", "loop")


class PairMismatchError(WeightSyncError):
    """A (dst, src) pair whose shapes, dtypes or devices differ."""


class PairTypeError(WeightSyncError, TypeError):
    """An entry of the pair list that is not a (tensor, tensor) pair."""


def triton_available() -> bool:
    """Whether the Triton multi-tensor kernel can be imported in this process."""
    try:
        import pytest_weightsync.reference_impl.triton_copy  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(device_type: str, has_triton: bool) -> str:
    """The backend ``"auto"`` resolves to for tensors on ``device_type``."""
    if device_type == "cuda":
        return "triton" if has_triton else "foreach"
    return "loop"


def validate_pairs(pairs: Iterable[Any]) -> list[tuple[Any, Any]]:
    """Return ``pairs`` as a list, raising an error that names the first bad pair and why."""
    import torch

    checked = []
    for index, pair in enumerate(pairs):
        try:
            dst, src = pair
        except (TypeError, ValueError):
            raise PairTypeError(
                f"pair {index}: expected a (dst, src) pair of tensors, got {type(pair).__name__}"
            ) from None
        for role, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise PairTypeError(
                    f"pair {index}: {role} is {type(t).__name__}, expected torch.Tensor"
                )
        if dst.shape != src.shape:
            raise PairMismatchError(
                f"pair {index}: shape mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}"
            )
        if dst.dtype != src.dtype:
            raise PairMismatchError(
                f"pair {index}: dtype mismatch: dst {dst.dtype} vs src {src.dtype}"
            )
        if dst.device != src.device:
            raise PairMismatchError(
                f"pair {index}: device mismatch: dst {dst.device} vs src {src.device}"
            )
        checked.append((dst, src))
    return checked


def _collapse(shape, src_strides, dst_strides):
    """Merge dimensions that are contiguous with their neighbour on both sides.

    Returns a list of ``(size, src_stride, dst_stride)`` from outermost to innermost, size-1
    dimensions dropped.
    """
    dims = [(n, s, d) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:
        if merged:
            pn, ps, pd = merged[-1]
            if ps == s * n and pd == d * n:
                merged[-1] = (pn * n, s, d)
                continue
        merged.append((n, s, d))
    return merged


def to_2d_copies(dst, src, long_row: int) -> list[tuple[int, ...]] | None:
    """Express one pair as at most two 2-D copies over the same memory.

    Each copy is ``(src_addr, dst_addr, rows, cols, src_stride0, src_stride1, dst_stride0,
    dst_stride1)``, strides in elements. A pair that collapses to one dimension (contiguous on
    both sides, or one strided run) is cut into rows of ``long_row`` elements plus a one-row
    tail, so that any size fills whole tiles. Returns None when the pair needs more than two
    dimensions (left to ``copy_``).
    """
    dims = _collapse(dst.shape, src.stride(), dst.stride())
    src_addr, dst_addr = src.data_ptr(), dst.data_ptr()
    if len(dims) > 2:
        return None
    if len(dims) == 2:
        (r, ss0, ds0), (c, ss1, ds1) = dims
        return [(src_addr, dst_addr, r, c, ss0, ss1, ds0, ds1)]
    n, ss, ds = dims[0] if dims else (dst.numel(), 1, 1)
    if n == 0:
        return []
    out = []
    body, tail = divmod(n, long_row)
    if body:
        out.append((src_addr, dst_addr, body, long_row, ss * long_row, ss, ds * long_row, ds))
    if tail:
        done = body * long_row * dst.element_size()
        out.append((src_addr + done * ss, dst_addr + done * ds, 1, tail, 0, ss, 0, ds))
    return out


def _aligned(copy: tuple[int, ...], elem: int) -> bool:
    """Whether a 2-D copy allows 16-byte vector accesses: aligned bases, rows and row lengths,
    unit column strides."""
    src, dst, rows, cols, ss0, ss1, ds0, ds1 = copy
    return (
        (cols * elem) % 16 == 0
        and ss1 == 1
        and ds1 == 1
        and src % 16 == 0
        and dst % 16 == 0
        and (rows == 1 or ((ss0 * elem) % 16 == 0 and (ds0 * elem) % 16 == 0))
    )


#: Integer dtype of each element width, for copying bits without interpreting them.
_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_bits(t):
    """``t`` viewed as integers of its element width (None for widths without one)."""
    import torch

    name = _INT_OF_WIDTH.get(t.element_size())
    return None if name is None else t.view(getattr(torch, name))


@dataclass
class CopyPlan:
    """A validated pair list bound to a backend; :meth:`run` performs the copies.

    The plan keeps references to every tensor it copies, so addresses recorded in it stay
    valid. Building it costs host time per pair; a sender that updates the same buffers
    repeatedly can build it once and call :meth:`run` per update.
    """

    backend: str
    pairs: list[tuple[Any, Any]]
    _launches: list[Any] = field(default_factory=list, repr=False)
    _leftover: list[tuple[Any, Any]] = field(default_factory=list, repr=False)

    def run(self) -> None:
        import torch

        with torch.no_grad():
            if self.backend == "loop":
                for dst, src in self.pairs:
                    dst.copy_(src)
            elif self.backend == "foreach":
                # As integers: _foreach_copy_ on CUDA converts through the compute type, which
                # would canonicalize NaN payloads of bf16/fp16.
                dsts, srcs = [], []
                for dst, src in self.pairs:
                    d, s = _as_bits(dst), _as_bits(src)
                    if d is None:
                        dst.copy_(src)
                    else:
                        dsts.append(d)
                        srcs.append(s)
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
            else:
                for launch in self._launches:
                    launch.run()
                for dst, src in self._leftover:
                    dst.copy_(src)


def _build_triton(plan: CopyPlan) -> None:
    from pytest_weightsync.reference_impl import triton_copy

    groups: dict[tuple[Any, int, int, bool], list[tuple[int, ...]]] = {}
    keep: dict[tuple[Any, int, int, bool], list[Any]] = {}
    long_row = triton_copy.MAX_BLOCK_COLS
    for dst, src in plan.pairs:
        elem = dst.element_size()
        copies = to_2d_copies(dst, src, long_row) if elem in (1, 2, 4, 8) else None
        if copies is None:
            plan._leftover.append((dst, src))
            continue
        for copy in copies:
            key = (dst.device, elem, triton_copy.block_cols_for(copy[3]), _aligned(copy, elem))
            groups.setdefault(key, []).append(copy)
            keep.setdefault(key, []).extend((dst, src))
    for key, copies in groups.items():
        device, elem, width, aligned = key
        plan._launches.append(
            triton_copy.TritonCopyLaunch(copies, elem, width, aligned, device, keep[key])
        )


def plan_copies(pairs: Iterable[Any], backend: str = "auto") -> CopyPlan:
    """Validate ``pairs`` and prepare them for ``backend``.

    ``"auto"`` resolves per :func:`choose_backend` from the device of the first pair; a list
    that spans device types uses the loop.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    checked = validate_pairs(pairs)
    if backend == "auto":
        device_types = {dst.device.type for dst, _ in checked}
        if len(device_types) == 1:
            (device_type,) = device_types
            backend = choose_backend(
                device_type, triton_available() if device_type == "cuda" else False
            )
        else:
            backend = "loop"
    plan = CopyPlan(backend=backend, pairs=checked)
    if backend == "triton":
        _build_triton(plan)
    return plan


def copy_pairs(pairs: Sequence[Any] | Iterable[Any], backend: str = "auto") -> str:
    """Copy each ``src`` into its ``dst`` in place, bit for bit; return the backend used.

    Every pair must have equal shape, dtype and device (the error names the pair index and
    the mismatch); ``dst`` must not overlap any ``src``.
    """
    plan = plan_copies(pairs, backend)
    plan.run()
    return plan.backend
