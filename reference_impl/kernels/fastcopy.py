"""Many small copies as one operation.

Every sender path expresses its work as a list of ``(dst, src)`` tensor pairs of equal shape
and dtype and hands it to :func:`copy_pairs` (or builds a reusable :func:`plan_copies`);
making that one call fast makes every path fast.

Why a dedicated routine: expert weights are separate per-expert allocations on the trainer and
views into fused ``w13``/``w2`` buffers on the receiver. A loop of ``dst.copy_(src)`` costs one
kernel launch per expert on a GPU (7% of a plain copy at MoE-TP 1, 2% at MoE-TP 2 for a
Qwen3.5-35B-A3B layer on an H200), and ``torch._foreach_copy_`` degrades on the strided slices
of MoE-TP 2. So the plan picks, per pair list, the fastest bit-exact way it knows:

- runs (:func:`find_runs`): whole contiguous sources whose destinations tile one contiguous
  span (every expert of a layer into ``w13``, then into ``w2``; gate and up row blocks at
  MoE-TP 2) become one ``torch.cat(out=)`` each - torch's batched copy kernel, as fast as a
  plain copy;
- a large contiguous pair that forms no run (a direct payload's tensor per parameter) is a
  run of its two halves on CUDA: one ``torch.cat`` as well;
- the rest (strided column slices of fc2 at MoE-TP > 1, scattered destinations) goes to one
  Triton launch per element width and row-length class
  (:mod:`pytest_weightsync.reference_impl.kernels.triton_copy`) on CUDA, ``torch._foreach_copy_``
  without triton, and a loop of in-place copies on a CPU (single-threaded it already runs at
  the speed of one plain copy there);
- a plan that runs again is captured in a CUDA graph, so later runs pay no host work or gaps
  between launches.

Every step moves elements as integers of their width, so the result is bit-identical to
``dst.copy_(src)`` (NaN payloads and signed zeros included). ``CopyPlan.steps`` says what a
plan does; the op-count guard (``suites/selftest/test_copy_op_counts.py``) holds those counts fixed.
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
        import pytest_weightsync.reference_impl.kernels.triton_copy  # noqa: F401
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


@dataclass(frozen=True)
class Step:
    """One operation of a plan: ``kind`` says how its pairs are copied.

    ``"cat"``: one ``torch.cat(out=)`` of contiguous sources into one contiguous span that
    their adjacent destinations tile (a run); ``"triton"``: one launch of the multi-tensor
    kernel; ``"foreach"``: one ``torch._foreach_copy_``; ``"copy"``: ``dst.copy_(src)`` per
    pair. ``launches`` is how many device operations the step issues per run.
    """

    kind: str
    pairs: int
    nbytes: int
    launches: int


@dataclass
class CopyPlan:
    """A validated pair list bound to its copy steps; :meth:`run` performs the copies.

    The plan keeps references to every tensor it copies, so addresses recorded in it stay
    valid. Building it costs host time per pair; a sender that updates the same buffers
    repeatedly builds it once and calls :meth:`run` per update. On CUDA such a reused plan is
    captured in a CUDA graph (``graph="auto"``: at its second run), which removes the host
    work and launch gaps of every later run.
    """

    backend: str
    pairs: list[tuple[Any, Any]]
    graph: str | bool = "auto"
    steps: list[Step] = field(default_factory=list)
    #: The Triton launches among the steps (their ``even`` / ``offset32`` say how they index).
    launches: list[Any] = field(default_factory=list, repr=False)
    graph_error: str | None = None
    _actions: list[Any] = field(default_factory=list, repr=False)
    _runs: int = field(default=0, repr=False)
    _graph: Any = field(default=None, repr=False)
    _device: Any = field(default=None, repr=False)

    def counts(self) -> dict[str, int]:
        """Device operations one run issues, by step kind (``{"cat": 2, "triton": 1}``)."""
        out: dict[str, int] = {}
        for step in self.steps:
            out[step.kind] = out.get(step.kind, 0) + step.launches
        return out

    @property
    def captured(self) -> bool:
        """Whether runs now replay a CUDA graph."""
        return self._graph is not None

    def run(self) -> None:
        import torch

        if self._graph is not None:
            self._graph.replay()
            return
        with torch.no_grad():
            if self._wants_capture(torch):
                self._capture(torch)
                if self._graph is not None:
                    self._graph.replay()
                    return
            for action in self._actions:
                action()
        self._runs += 1

    def _wants_capture(self, torch) -> bool:
        if self.graph is False or self._device is None or self._device.type != "cuda":
            return False
        if not self._actions or self.graph_error is not None:
            return False
        if torch.cuda.is_current_stream_capturing():
            return False  # we are being captured into the caller's graph: just issue the work
        # "auto": the first run is eager (it compiles kernels and proves the steps work) and
        # the second captures; True captures at the first (after an eager warm-up run).
        return self.graph is True or self._runs >= 1

    def _capture(self, torch) -> None:
        if self._runs == 0:  # graph=True on a first run: warm up (Triton compiles) eagerly first
            for action in self._actions:
                action()
            self._runs += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self._device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        for action in self._actions:
                            action()
                    finally:
                        graph.capture_end()
            except RuntimeError as exc:  # keep working eagerly; say why in the plan
                self.graph_error = f"{type(exc).__name__}: {exc}"
                torch.cuda.current_stream().wait_stream(side)
                return
            torch.cuda.current_stream().wait_stream(side)
        self._graph = graph


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def find_runs(pairs: Sequence[tuple[Any, Any]]) -> tuple[list[list[int]], list[int]]:
    """Split pair indices into runs and the rest.

    A run is two or more pairs whose sources are contiguous and whose contiguous destinations,
    in address order, tile one span of one storage without gaps, all of one element width: the
    whole run is then one ``torch.cat`` of the flattened sources into that span (what a layer
    of whole per-expert tensors into a fused ``w13``/``w2`` is). Everything else is the rest.
    """
    rest: list[int] = []
    spans = []  # (device, storage, start, end, element width, index): one lookup per pair
    for i, (dst, src) in enumerate(pairs):
        if not dst.numel():
            continue
        if dst.is_contiguous() and src.is_contiguous() and dst.element_size() in _INT_OF_WIDTH:
            start = dst.data_ptr()
            spans.append((str(dst.device), dst.untyped_storage().data_ptr(), start,
                          start + _nbytes(dst), dst.element_size(), i))
        else:
            rest.append(i)
    spans.sort()
    runs: list[list[int]] = []
    current: list[int] = []
    prev = None
    for span in spans:
        if prev is not None and span[:2] == prev[:2] and span[2] == prev[3] and span[4] == prev[4]:
            current.append(span[5])
        else:
            if len(current) > 1:
                runs.append(current)
            else:
                rest.extend(current)
            current = [span[5]]
        prev = span
    if len(current) > 1:
        runs.append(current)
    else:
        rest.extend(current)
    rest.sort()
    return runs, rest


def _cat_action(pairs, run: list[int]):
    """One ``torch.cat`` of the run's flattened sources (as integers) into its span."""
    import torch

    first = pairs[run[0]][0]
    total = sum(pairs[i][0].numel() for i in run)
    out = _as_bits(first).as_strided((total,), (1,), first.storage_offset())
    srcs = [_as_bits(pairs[i][1]).reshape(-1) for i in run]
    return lambda: torch.cat(srcs, out=out)


def _copy_action(pairs):
    def run():
        for dst, src in pairs:
            dst.copy_(src)
    return run


def _foreach_action(pairs):
    # As integers: _foreach_copy_ on CUDA converts through the compute type, which would
    # canonicalize NaN payloads of bf16/fp16.
    import torch

    dsts, srcs, odd = [], [], []
    for dst, src in pairs:
        d, s = _as_bits(dst), _as_bits(src)
        if d is None:
            odd.append((dst, src))
        else:
            dsts.append(d)
            srcs.append(s)

    def run():
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        for dst, src in odd:
            dst.copy_(src)
    return run


def triton_groups(pairs: Sequence[tuple[Any, Any]], long_row: int, launch_key) -> tuple[
    dict[tuple[Any, ...], list[tuple[int, ...]]], dict[tuple[Any, ...], list[Any]], list[tuple[Any, Any]]
]:
    """The 2-D copies of ``pairs`` grouped by launch: ``(device, element width, aligned,
    *launch_key(copy))``; the tensors each group must keep alive; the pairs no launch takes."""
    groups: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}
    keep: dict[tuple[Any, ...], list[Any]] = {}
    leftover: list[tuple[Any, Any]] = []
    for dst, src in pairs:
        elem = dst.element_size()
        copies = to_2d_copies(dst, src, long_row) if elem in _INT_OF_WIDTH else None
        if copies is None:
            leftover.append((dst, src))
            continue
        for copy in copies:
            key = (dst.device, elem, _aligned(copy, elem), *launch_key(copy))
            groups.setdefault(key, []).append(copy)
            keep.setdefault(key, []).extend((dst, src))
    return groups, keep, leftover


def _add_triton(plan: CopyPlan, pairs, options: dict[str, Any]) -> None:
    from pytest_weightsync.reference_impl.kernels import triton_copy

    shape = triton_copy.LaunchShape(**options)
    groups, keep, leftover = triton_groups(pairs, triton_copy.MAX_BLOCK_COLS, shape.key)
    for key, copies in groups.items():
        device, elem, aligned, width, _even = key
        launch = triton_copy.TritonCopyLaunch(copies, elem, width, aligned, device, keep[key], shape)
        plan._actions.append(launch.run)
        plan.launches.append(launch)
        plan.steps.append(Step("triton", len(copies), sum(c[2] * c[3] for c in copies) * elem, 1))
    if leftover:
        _add_copy(plan, leftover)


#: A contiguous pair at least this large that forms no run (a direct payload: one tensor per
#: parameter) is copied as a run of its own pieces, one ``torch.cat``: the batched copy
#: kernel the runs use, not the Triton kernel (0.85 of a plain copy on whole tensors) nor
#: ``copy_`` (a memcpy: from CUDA-IPC-mapped sources it took 41 ms where a plain copy of the
#: same 60 GiB took 30 ms on an H200, 2026-12-01).
WHOLE_COPY_BYTES = 1 << 24
#: Size of those pieces: ``torch.cat`` of a 768 MiB tensor's two halves ran at 0.94 of a plain
#: copy, of 64-192 pieces at 1.00 (H200, 2026-12-03): the kernel spreads one input's elements
#: over fewer blocks than many inputs'.
WHOLE_PIECE_BYTES = 1 << 23


def _whole_copy(dst, src) -> bool:
    return (dst.is_contiguous() and src.is_contiguous() and _nbytes(dst) >= WHOLE_COPY_BYTES
            and dst.element_size() in _INT_OF_WIDTH)


def _add_whole(plan: CopyPlan, pairs) -> None:
    import torch

    for dst, src in pairs:
        out, flat = _as_bits(dst).reshape(-1), _as_bits(src).reshape(-1)
        pieces = max(2, _nbytes(dst) // WHOLE_PIECE_BYTES)
        step = (flat.numel() // pieces) // 64 * 64 or flat.numel() // pieces
        cuts = list(range(0, flat.numel(), step))
        srcs = [flat[start:start + step] for start in cuts[:-1]] + [flat[cuts[-1]:]]
        plan._actions.append(lambda srcs=srcs, out=out: torch.cat(srcs, out=out))
        plan.steps.append(Step("cat", len(srcs), _nbytes(dst), 1))


def _add_copy(plan: CopyPlan, pairs) -> None:
    plan._actions.append(_copy_action(pairs))
    plan.steps.append(Step("copy", len(pairs), sum(_nbytes(d) for d, _ in pairs), len(pairs)))


def _add_foreach(plan: CopyPlan, pairs) -> None:
    plan._actions.append(_foreach_action(pairs))
    plan.steps.append(Step("foreach", len(pairs), sum(_nbytes(d) for d, _ in pairs), 1))


def plan_copies(
    pairs: Iterable[Any],
    backend: str = "auto",
    graph: str | bool = "auto",
    triton_options: dict[str, Any] | None = None,
    runs: bool | None = None,
) -> CopyPlan:
    """Validate ``pairs`` and choose how each is copied.

    ``backend="auto"`` picks per pair list: runs (:func:`find_runs`) become one ``torch.cat``
    each - torch's batched copy of whole contiguous tensors is as fast as a plain copy - and
    the rest goes to the device's backend per :func:`choose_backend` (the Triton kernel for the
    strided slices of MoE-TP > 1 on CUDA). A named backend (``"triton"``, ``"foreach"``,
    ``"loop"``) copies every pair its way, with no runs unless ``runs=True`` (for tests,
    benchmarks, and for planning what CUDA would do from CPU tensors: ``backend="triton",
    runs=True``). A list spanning device types uses the loop and no runs.

    ``graph``: ``"auto"`` captures a CUDA plan in a CUDA graph at its second run, ``True`` at
    its first, ``False`` never. ``triton_options`` go to
    :class:`~pytest_weightsync.reference_impl.kernels.triton_copy.LaunchShape` (launch shape).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if graph not in ("auto", True, False):
        raise ValueError(f"graph must be 'auto', True or False, got {graph!r}")
    checked = validate_pairs(pairs)
    device_types = {dst.device.type for dst, _ in checked}
    devices = {dst.device for dst, _ in checked}
    use_runs = backend == "auto" if runs is None else bool(runs)
    if backend == "auto":
        if len(device_types) == 1:
            (device_type,) = device_types
            backend = choose_backend(
                device_type, triton_available() if device_type == "cuda" else False
            )
        else:
            backend = "loop"
    plan = CopyPlan(backend=backend, pairs=checked, graph=graph)
    if len(devices) == 1:
        (plan._device,) = devices
    rest = checked
    if use_runs and len(device_types) == 1:
        run_lists, rest_idx = find_runs(checked)
        for run in run_lists:
            plan._actions.append(_cat_action(checked, run))
            plan.steps.append(Step("cat", len(run), sum(_nbytes(checked[i][0]) for i in run), 1))
        rest = [checked[i] for i in rest_idx]
    rest = [(d, s) for d, s in rest if d.numel()]
    if use_runs and device_types == {"cuda"}:
        whole = [(d, s) for d, s in rest if _whole_copy(d, s)]
        if whole:
            _add_whole(plan, whole)
            rest = [(d, s) for d, s in rest if not _whole_copy(d, s)]
    if rest:
        if backend == "triton":
            _add_triton(plan, rest, triton_options or {})
        elif backend == "foreach":
            _add_foreach(plan, rest)
        else:
            _add_copy(plan, rest)
    return plan


def copy_pairs(pairs: Sequence[Any] | Iterable[Any], backend: str = "auto") -> str:
    """Copy each ``src`` into its ``dst`` in place, bit for bit; return the backend used for
    the pairs that are not runs (see :func:`plan_copies`).

    Every pair must have equal shape, dtype and device (the error names the pair index and
    the mismatch); ``dst`` must not overlap any ``src``.
    """
    plan = plan_copies(pairs, backend, graph=False)
    plan.run()
    return plan.backend
