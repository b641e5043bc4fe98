"""The reference receiver of an FP8 block-quantized engine (``weight_quant="fp8_block"``).

It is two checkpoint-layout reference receivers over one rank's parameters (``fp8.py``): one
for the float8_e4m3fn ``w13_weight`` / ``w2_weight``, one for the float32
``w13_weight_scale_inv`` / ``w2_weight_scale_inv``, whose elements are blocks (square blocks:
a rank's scale rows are its weight rows divided by the block). A bucket is split by name -
``...weight_scale_inv`` entries to the scales, the rest to the weights - and both halves are
validated whole before either writes (the atomicity promise of
:class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver` holds for the pair). An
update is complete when both are: a weight without its scale (or the reverse) is named at
``end_update``.

Who quantizes:

* the sender (``QUANTIZERS`` ``"sender"``): per-expert FP8 checkpoint names, weights in
  float8_e4m3fn and their ``weight_scale_inv`` (what FP8 checkpoints and FP8 refits send), or
  ``direct`` with the rank's four parameters;
* the loader (``"loader"``): per-expert weights in the model dtype; each projection is
  quantized here with :func:`pytest_weightsync.reference_impl.model.fp8.quantize`, blocks at its HF
  coordinates, before it is split over ranks. Scales are rebuilt from every update's weights.

A bucket that mixes model-dtype and FP8 weights is refused, and so is a sender's block scale
that is NaN, infinite, zero or negative (:class:`BlockScaleError`, naming the entry and its
first bad block): every element of a block is read as ``q * scale_inv``, so such a scale turns
its whole block into NaN, infinities, zeros or flipped signs, and no quantizer produces one
(``scale_inv = amax / 448`` with ``amax`` clamped below at ``AMAX_FLOOR``). The scale values
are read after the bucket's entries were found to be dense float32 tensors over readable
memory, and before anything is written.
"""

from __future__ import annotations

from typing import Optional

import torch

from pytest_weightsync.reference_impl.model import fp8
from pytest_weightsync.reference_impl.errors import shown
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, parse_receiver_name
from pytest_weightsync.reference_impl.engine.receiver import (
    IncompleteUpdateError,
    MissingExpertError,
    PayloadDtypeError,
    PayloadError,
    PayloadTypeError,
    ReceiverParamsError,
    ReferenceReceiver,
    UpdateState,
)


class BlockScaleError(PayloadError):
    """A sender's ``weight_scale_inv`` holding a NaN, infinite, zero or negative block scale:
    dequantized, its block would be NaN, infinite, zero or sign-flipped."""


def _bad_scale_reason(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return f"{value} (infinite)"
    if value == 0:
        return f"{value} (zero)"
    return f"{value} (negative)"


class Fp8UpdateState:
    """The open update of both halves (weights, scales); buckets counted by both."""

    def __init__(self, weights: UpdateState, scales: UpdateState):
        self.weights, self.scales = weights, scales

    def count_refused(self) -> None:
        self.weights.count_refused()
        self.scales.count_refused()


class Fp8BlockReceiver:
    """One receiver rank of an FP8 block-quantized engine (see the module docstring)."""

    def __init__(self, spec: MoESpec, topo: ReceiverTopology, rank: int, device="cpu",
                 params=None):
        self.spec, self.topo, self.rank = spec, topo, rank
        self.block = fp8.block_of(topo)
        specs = fp8.param_specs(spec, topo, rank)
        if params is None:
            params = {name: torch.zeros(shape, dtype=dtype, device=device)
                      for name, (shape, dtype) in specs.items()}
        missing = [name for name in specs if name not in params]
        if missing:
            raise ReceiverParamsError(f"receiver rank {rank} has no parameter {missing[0]!r} "
                                      f"(an fp8_block engine holds weights and their "
                                      f"{fp8.SCALE_SUFFIX} per layer; {len(missing)} missing)")
        plain = fp8.plain_topology(topo)
        weights = {n: params[n] for n in specs if not n.endswith(fp8.SCALE_SUFFIX)}
        scales = {n[:-len(fp8.SCALE_SUFFIX)]: params[n] for n in specs
                  if n.endswith(fp8.SCALE_SUFFIX)}
        self.weights = ReferenceReceiver(fp8.weight_spec(spec), plain, rank, params=weights)
        self.scales = ReferenceReceiver(fp8.scale_spec(spec, topo), plain, rank, params=scales)
        self.params = {**self.weights.params,
                       **{n + fp8.SCALE_SUFFIX: t for n, t in self.scales.params.items()}}
        self.device = self.weights.device
        self.shard = self.weights.shard

    # -- the receiver API (what ReferenceImplementation calls) ----------------------------------

    def named_parameters(self):
        return self.params.items()

    @property
    def in_update(self) -> bool:
        return self.weights.in_update

    def begin_update(self) -> None:
        self.weights.begin_update()
        self.scales.begin_update()

    @property
    def update_state(self) -> Optional[Fp8UpdateState]:
        if self.weights.update_state is None:
            return None
        return Fp8UpdateState(self.weights.update_state, self.scales.update_state)

    def resume_update(self, state) -> None:
        if not isinstance(state, Fp8UpdateState):
            raise IncompleteUpdateError(f"resume_update() of an fp8_block receiver needs the "
                                        f"state it gave, got {type(state).__name__}")
        self.weights.resume_update(state.weights)
        self.scales.resume_update(state.scales)

    def refuse_bucket(self) -> None:
        self.weights.refuse_bucket()
        self.scales.refuse_bucket()

    def describe_entry(self, index: int, name=None) -> str:
        return self.weights.describe_entry(index, name)

    def end_update(self) -> None:
        """Close both halves; a missing weight or scale is named (scales as such)."""
        try:
            self.weights.end_update()
        finally:
            try:
                self.scales.end_update()
            except MissingExpertError as error:
                raise MissingExpertError(f"{fp8.SCALE_SUFFIX[1:]} (the block scales): {error}"
                                         ) from None

    def load(self, payload, load_format: Optional[str] = None):
        """Validate the whole bucket (both halves), then write weights and scales."""
        if payload is not None and not isinstance(payload, (list, tuple, str, bytes, dict,
                                                             torch.Tensor)) \
                and hasattr(payload, "__iter__"):
            payload = list(payload)  # read twice: split, then the scales' entry indices
        try:
            weights, scales = self._split(payload, load_format)
            plans = (self.weights.plan(weights, load_format),
                     self.scales.plan(scales, load_format))
            self._check_scale_values(payload, scales, load_format)
        except BaseException:
            self.refuse_bucket()
            raise
        for half, plan in zip((self.weights, self.scales), plans):
            half._apply(plan)
            update = half.update_state
            if update is not None:
                update.carry(plan)
        return plans

    # -- the block scales a sender sent ------------------------------------------------------

    def _check_scale_values(self, payload, scales, load_format) -> None:
        """Refuse a sender's scale entry holding a block scale that is not finite and positive
        (:class:`BlockScaleError`, naming the entry, its first bad block and how many are bad).
        Asked once planning has found every scale a dense float32 tensor over readable memory;
        scales the loader computed from model-dtype weights are not the sender's and are not
        asked about."""
        index_of = {}
        for index, item in enumerate(payload):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) \
                    and item[0].endswith(fp8.SCALE_SUFFIX):
                index_of.setdefault(item[0][:-len(fp8.SCALE_SUFFIX)], index)
        for name, tensor in scales:
            index = index_of.get(name)
            if index is None or not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                continue
            bad = ~(torch.isfinite(tensor) & (tensor > 0))
            count = int(bad.sum())
            if not count:
                continue
            at = tuple(int(i) for i in bad.nonzero()[0])
            value = float(tensor[at])
            raise BlockScaleError(
                f"{self.describe_entry(index, name + fp8.SCALE_SUFFIX)}: block scale "
                f"{_bad_scale_reason(value)} at {self._block_words(name, at, load_format)}"
                f"{f' ({count} of {tensor.numel()} block scales bad)' if count > 1 else ''}; "
                f"every element of a block is read as q * scale_inv, so a weight_scale_inv "
                f"must be finite and positive (amax / {fp8.FP8_MAX:g}, amax clamped at "
                f"{fp8.AMAX_FLOOR:g})")

    def _block_words(self, name: str, at: tuple, load_format) -> str:
        """Where scale element ``at`` of entry ``name`` (the scale's weight name) sits: its
        block and the weight rows and columns the block covers; for the receiver's own
        parameters (``load_format="direct"``) also the layer, logical expert and projection."""
        if len(at) < 2:
            return f"index {at}"
        if load_format == "direct" and len(at) == 3:
            located = fp8.locate(self.spec, self.topo, self.rank, name + fp8.SCALE_SUFFIX, at)
            if located is not None:
                return f"block index {at} ({located})"
        b, (bi, bj) = self.block, at[-2:]
        return (f"block index {at}: rows {bi * b}..{(bi + 1) * b - 1}, cols "
                f"{bj * b}..{(bj + 1) * b - 1} of its weight")

    # -- splitting and quantizing ------------------------------------------------------------

    def _split(self, payload, load_format):
        if payload is None or isinstance(payload, (str, bytes, dict, torch.Tensor)) \
                or not hasattr(payload, "__iter__"):
            raise PayloadTypeError(f"payload is a {type(payload).__name__}; expected a list of "
                                   f"(name, tensor) pairs")
        weights, scales, dtypes = [], [], {}
        for index, item in enumerate(payload):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise PayloadTypeError(f"{self.describe_entry(index)} is not a (name, tensor) "
                                       f"pair")
            name, tensor = item
            if name.endswith(fp8.SCALE_SUFFIX):
                scales.append((name[:-len(fp8.SCALE_SUFFIX)], tensor))
                continue
            if isinstance(tensor, torch.Tensor):
                dtypes.setdefault(tensor.dtype, (index, name))
            weights.append((name, tensor))
        if len(dtypes) > 1:
            shown_dtypes = ", ".join(f"{d} ({self.describe_entry(i, n)})"
                                     for d, (i, n) in dtypes.items())
            raise PayloadDtypeError(f"model-dtype and FP8 weights mixed in one bucket: "
                                    f"{shown_dtypes}; a bucket is quantized by its sender or by "
                                    f"the loader, not both")
        if dtypes and next(iter(dtypes)) == self.spec.dtype and self.spec.dtype != fp8.FP8:
            if scales:
                raise PayloadDtypeError(f"{self.spec.dtype} weights sent with "
                                        f"{fp8.SCALE_SUFFIX} entries: model-dtype weights are "
                                        f"quantized by the loader, their scales come from them")
            return self._quantize(weights, load_format)
        return weights, scales

    def _quantize(self, weights, load_format):
        """The loader quantizes: every per-expert model-dtype projection, blocks at its HF
        coordinates (the whole projection, before the rank's rows are taken)."""
        if load_format == "direct":
            raise PayloadDtypeError(f"load_format='direct' into an fp8_block engine takes its "
                                    f"own float8_e4m3fn parameters and scales, not "
                                    f"{self.spec.dtype} tensors")
        out_w, out_s = [], []
        for index, (name, tensor) in enumerate(weights):
            if not isinstance(tensor, torch.Tensor):
                out_w.append((name, tensor))  # refused by name when the bucket is planned
                continue
            parsed = parse_receiver_name(name)
            if parsed is None or parsed.kind != "expert":
                raise PayloadDtypeError(f"{self.describe_entry(index, name)}: the loader "
                                        f"quantizes per-expert {self.spec.dtype} weights "
                                        f"(experts.{{e}}.{{gate,up,down}}_proj.weight), got "
                                        f"{shown(name)}")
            if tensor.dim() != 2:
                raise PayloadDtypeError(f"{self.describe_entry(index, name)}: a per-expert "
                                        f"projection is 2-D, got shape {tuple(tensor.shape)}")
            q, s = fp8.quantize(tensor, self.block)
            out_w.append((name, q))
            out_s.append((name, s))
        return out_w, out_s
