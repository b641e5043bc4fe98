"""Probes of the reference receiver with every kind of tensor a sender could hand it.

A probe takes a valid bucket of one format for one receiver rank, replaces the last entry the
rank loads by the same values as another *kind* of tensor (a DTensor, a FakeTensor, a tensor
subclass, a nested tensor, a lazy neg/conj view, freed or shrunk storage, a meta or sparse
tensor ...), loads it through one API level (``ReferenceReceiver.load`` or
``ReferenceImplementation.load_weights``), alone or as the second bucket of an open update,
and says what happened:

* ``refused``: a :class:`PayloadError` (what the receiver promises, together with
  ``wrote=False``);
* ``wrong-error``: an exception outside the project's hierarchy (``RuntimeError`` from deep
  inside a copy, ``AssertionError`` ...);
* ``accepted``: loaded without complaint;

and ``wrote``: whether any parameter's raw bits or address changed since the bucket was
offered (a refused bucket that wrote is a corruption).

Valid entries come before the bad one, and the padded MoE-TP topology makes the receiver zero
padding tails, so a receiver that writes while it validates (or validates inside the copy)
shows up as ``wrote``. Freed storage can crash the process outright, so those probes also run
as a script (``python tensor_kind_probes.py KIND ...``) that prints one JSON line per probe,
each preceded by a ``start`` line: a probe that kills the process is the last one started.
``--without-checks`` disables :mod:`~pytest_weightsync.reference_impl.engine.tensor_checks`, to
prove the probes find what those checks prevent.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.senders import formats as senders
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.engine import tensor_checks
from pytest_weightsync.reference_impl.errors import PayloadError
from pytest_weightsync.reference_impl.impl import ReferenceImplementation
from pytest_weightsync.reference_impl.model.layout import (MoESpec, ReceiverTopology,
                                                     parse_receiver_name, receiver_shard)

SPEC = MoESpec(num_layers=2, num_experts=4, hidden=8, intermediate=8)
#: MoE-TP 2 with padded buffers (rows 4 of 5): every bucket zeroes padding tails; EP 2.
TOPOLOGY = ReceiverTopology(tp=4, moe_ep=2, intermediate_padded=5)
RANK = 3  # MoE-TP rank 1, experts 2..3: it owns the last expert of every per-expert bucket
FORMATS = ("compat", "hf_fused", "packed", "direct")
LOAD_FORMAT = {"compat": None, "hf_fused": None, "packed": None, "direct": "direct"}
APIS = ("receiver", "implementation")
#: ``single``: the bad bucket is a whole update's only bucket; ``mid-stream``: bucket 1 of an
#: open update whose bucket 0 (layer 0) was loaded.
POSITIONS = ("single", "mid-stream")


class _Subclass(torch.Tensor):
    """A trivial tensor subclass (what quantization and tracing libraries derive)."""


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _dtensor(t):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t.clone(), _mesh(), [Replicate()])


def _fake(t):
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(t)


def _freed(t):
    out = t.clone()
    out.untyped_storage().resize_(0)
    return out


def _shrunk(t):
    out = t.clone()
    out.untyped_storage().resize_(out.untyped_storage().nbytes() // 2)
    return out


#: kind -> (how to make it from a valid tensor, the PayloadError subclass it must raise).
KINDS = {
    "subclass": (lambda t: t.clone().as_subclass(_Subclass), rx.TensorSubclassError),
    "dtensor": (_dtensor, rx.TensorSubclassError),
    "dtensor-parameter": (lambda t: torch.nn.Parameter(_dtensor(t)), rx.TensorSubclassError),
    "fake-tensor": (_fake, rx.TensorSubclassError),
    "uninitialized-parameter": (lambda t: torch.nn.UninitializedParameter(dtype=t.dtype),
                                rx.TensorSubclassError),
    "functional": (lambda t: torch._to_functional_tensor(t.clone()), rx.TensorSubclassError),
    "nested": (lambda t: torch.nested.as_nested_tensor(list(t.clone().unbind(0))),
               rx.NestedTensorError),
    "nested-jagged": (lambda t: torch.nested.nested_tensor(list(t.clone().unbind(0)),
                                                           layout=torch.jagged),
                      rx.TensorSubclassError),
    "neg-view": (lambda t: torch._neg_view(t.clone()), rx.LazyViewError),
    "conj-view": (lambda t: torch.zeros(t.shape, dtype=torch.complex64).conj(), rx.LazyViewError),
    "freed-storage": (_freed, rx.TensorStorageError),
    "shrunk-storage": (_shrunk, rx.TensorStorageError),
    "meta-device": (lambda t: torch.empty_like(t, device="meta"), rx.TensorLayoutError),
    "sparse": (lambda t: t.to_sparse(), rx.TensorLayoutError),
}
#: Kinds whose load can kill the process when the checks are missing: probed in a subprocess.
CRASH_PRONE = ("freed-storage", "shrunk-storage")
#: Kinds that need a torch.distributed default group (a DeviceMesh) to exist.
NEEDS_GROUP = ("dtensor", "dtensor-parameter")


@dataclass
class Outcome:
    kind: str
    fmt: str
    api: str
    position: str
    result: str  # refused | wrong-error | accepted
    wrote: bool = False
    error: str = ""
    message: str = ""
    entry: str = ""  # the name of the entry made bad

    @property
    def probe(self) -> str:
        return f"{self.kind}/{self.fmt}/{self.api}/{self.position}"


@functools.lru_cache(maxsize=None)
def _full(version: int):
    return synth.full_weights(SPEC, version)


def bucket(fmt: str, layers, version: int = 1) -> list:
    """A valid bucket of ``fmt`` for :data:`RANK` holding ``layers``."""
    return senders.export(fmt, SPEC, TOPOLOGY, RANK, _full(version), layers)


def last_owned(entries) -> int:
    """Index of the last entry :data:`RANK` loads (a per-expert entry of another EP rank is
    ignored by the receiver, so breaking it would prove nothing)."""
    experts = receiver_shard(SPEC, TOPOLOGY, RANK).experts
    for index in range(len(entries) - 1, -1, -1):
        parsed = parse_receiver_name(entries[index][0])
        if parsed.expert is None or parsed.expert in experts:
            return index
    raise AssertionError("the rank owns no entry of the bucket")


def fresh_params() -> dict:
    params = rx.ReferenceReceiver(SPEC, TOPOLOGY, RANK).params
    for tensor in params.values():
        synth.poison_(tensor)
    return params


class Loader:
    """One API level over one set of parameters, framed as an update."""

    def __init__(self, api: str, fmt: str, params: dict):
        self.api, self.fmt, self.params = api, fmt, params
        self.kwargs = dict(format=fmt, spec=SPEC, topology=TOPOLOGY, rank=RANK)
        if api == "receiver":
            self.receiver = rx.ReferenceReceiver(SPEC, TOPOLOGY, RANK, params=params)
        else:
            self.impl = ReferenceImplementation()

    def begin(self):
        if self.api == "receiver":
            self.receiver.begin_update()
        else:
            self.impl.begin_update(self.params, **self.kwargs)

    def load(self, entries):
        if self.api == "receiver":
            self.receiver.load(entries, load_format=LOAD_FORMAT[self.fmt])
        else:
            self.impl.load_weights(self.params, entries, **self.kwargs)


def probe(kind: str, fmt: str, api: str, position: str) -> Outcome:
    """Offer a bucket whose last owned entry is of ``kind``; classify what the receiver did."""
    make, _ = KINDS[kind]
    params = fresh_params()
    loader = Loader(api, fmt, params)
    loader.begin()
    if position == "mid-stream":
        loader.load(bucket(fmt, [0]))
        entries = bucket(fmt, [1])
    else:
        entries = bucket(fmt, None)
    index = last_owned(entries)
    name, tensor = entries[index]
    entries[index] = (name, make(tensor))
    before = compare.snapshot(params)
    outcome = Outcome(kind, fmt, api, position, "accepted", entry=name)
    try:
        loader.load(entries)
    except Exception as exc:  # noqa: BLE001 - every exception is classified, none escapes
        outcome.error, outcome.message = type(exc).__name__, str(exc)[:600]
        outcome.result = "refused" if isinstance(exc, PayloadError) else "wrong-error"
    try:
        compare.assert_unchanged(before, params)
    except AssertionError as exc:
        outcome.wrote = True
        outcome.message += f" | wrote: {str(exc)[:300]}"
    return outcome


def probes(kinds, formats=FORMATS, apis=APIS, positions=POSITIONS):
    return [(k, f, a, p) for k in kinds for f in formats for a in apis for p in positions]


@contextlib.contextmanager
def default_group():
    """A one-rank gloo default group (FileStore in a private directory: no port), for the
    DeviceMesh a DTensor needs; destroyed on exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tensor-kinds-") as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def checks_disabled():
    """The receiver without its tensor-kind and storage checks (what the probes must catch)."""
    saved = tensor_checks.kind_problem, tensor_checks.storage_problem
    tensor_checks.kind_problem = tensor_checks.storage_problem = lambda tensor: None
    try:
        yield
    finally:
        tensor_checks.kind_problem, tensor_checks.storage_problem = saved


def main(argv) -> int:
    """``KIND ... [--without-checks]``: run every probe of those kinds, one JSON line each."""
    torch.set_num_threads(1)
    kinds = [a for a in argv if not a.startswith("--")]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        print(f"unknown kinds {sorted(unknown)}", file=sys.stderr)
        return 2
    guard = checks_disabled() if "--without-checks" in argv else contextlib.nullcontext()
    group = default_group() if set(kinds) & set(NEEDS_GROUP) else contextlib.nullcontext()
    with group, guard:
        for spec in probes(kinds):
            print(json.dumps({"start": "/".join(spec)}), flush=True)
            print(json.dumps(asdict(probe(*spec))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
