"""Every kind of tensor a sender could hand the reference receiver: plain tensors and
``nn.Parameter`` load; DTensors, FakeTensors, subclasses, nested tensors, lazy neg/conj views,
freed or shrunk storage, meta and sparse tensors are refused with a named ``PayloadError``
(entry index, bucket and name in the message) before a byte is written; nothing crashes.

Each kind is probed over every format, both API levels (``ReferenceReceiver.load``,
``ReferenceImplementation.load_weights``) and both stream positions (a whole update's only
bucket, the second bucket of an open update), see :mod:`.tensor_kind_probes`. Freed storage
can kill the process, so those probes run in a subprocess. The last test proves the probes
have teeth: with the receiver's tensor checks disabled they find corruptions and a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

from . import tensor_kind_probes as kp
from pytest_weightsync import compare
from pytest_weightsync.reference_impl.engine import receiver as rx
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.errors import PayloadError, shown
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

pytestmark = [pytest.mark.weightsync_property("bad_payload_refused"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")]

IN_PROCESS = [kind for kind in kp.KINDS if kind not in kp.CRASH_PRONE]
SCRIPT = os.path.abspath(kp.__file__)


def broken_promise(outcome: kp.Outcome) -> str | None:
    """What is wrong with ``outcome``, or ``None`` when the receiver kept its promise: the
    kind's own ``PayloadError`` subclass, the entry index, bucket and name in the message,
    and nothing written."""
    expected = kp.KINDS[outcome.kind][1]
    if outcome.wrote:
        return f"{outcome.result} after writing: {outcome.message}"
    if outcome.result != "refused":
        return f"{outcome.result} {outcome.error}: {outcome.message}"
    if outcome.error != expected.__name__:
        return f"refused with {outcome.error}, expected {expected.__name__}: {outcome.message}"
    bucket = 1 if outcome.position == "mid-stream" else 0
    where = f"of bucket {bucket} {shown(outcome.entry)}"
    if "payload entry " not in outcome.message or where not in outcome.message:
        return f"the message does not name the entry ({where!r}): {outcome.message}"
    return None


def broken(outcomes) -> list[str]:
    return [f"{o.probe}: {why}" for o in outcomes if (why := broken_promise(o)) is not None]


def run_script(kinds, *flags) -> tuple[int, list[kp.Outcome], str | None, str]:
    """Run the probes of ``kinds`` in a subprocess: (returncode, outcomes, the probe running
    when the process ended, stderr)."""
    # a probe process that dies (what the last test provokes) removes nothing it made: its
    # temporary files go under a directory removed here
    with tempfile.TemporaryDirectory(prefix="tensor-kinds-run-") as tmpdir:
        proc = subprocess.run([sys.executable, "-W", "ignore", SCRIPT, *kinds, *flags],
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "TMPDIR": tmpdir})
    outcomes, last = [], None
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if "start" in record:
            last = record["start"]
        else:
            outcomes.append(kp.Outcome(**record))
            last = None
    return proc.returncode, outcomes, last, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def default_group():
    with kp.default_group():
        yield


@pytest.mark.parametrize("kind", IN_PROCESS)
def test_every_tensor_kind_is_refused_by_name_before_anything_is_written(kind, default_group):
    outcomes = [kp.probe(*spec) for spec in kp.probes([kind])]
    assert len(outcomes) == len(kp.FORMATS) * len(kp.APIS) * len(kp.POSITIONS)
    assert not broken(outcomes), "\n".join(broken(outcomes))


def test_freed_and_shrunk_storage_are_refused_without_crashing():
    """Run in a subprocess: a regression here is a segfault, which must fail this test, not
    end the pytest session."""
    code, outcomes, running, stderr = run_script(kp.CRASH_PRONE)
    assert code == 0, f"the probe process died (returncode {code}) during {running}:\n{stderr}"
    assert len(outcomes) == len(kp.probes(kp.CRASH_PRONE))
    assert not broken(outcomes), "\n".join(broken(outcomes))


def test_the_probes_find_corruptions_and_a_crash_without_the_checks():
    """With ``tensor_checks`` disabled the receiver validates names, dtypes and shapes only:
    a DTensor or a subclass passes, and the copy fails (or silently reads the wrong bits)
    after padding zeroing and earlier copies ran; a freed direct tensor segfaults. The same
    probes that pass above must report all of that."""
    kinds = ("subclass", "dtensor", "neg-view", "nested", "freed-storage")  # the crash last
    code, outcomes, running, _ = run_script(kinds, "--without-checks")
    corrupted = [o for o in outcomes if o.wrote]
    foreign = [o for o in outcomes if o.result == "wrong-error"]
    assert {o.kind for o in corrupted} >= {"subclass", "dtensor", "neg-view"}, broken(outcomes)
    assert any(o.kind == "nested" for o in foreign), broken(outcomes)
    crashed = code != 0 and running is not None and running.startswith("freed-storage/")
    assert crashed or any(o.kind == "freed-storage" and broken_promise(o) for o in outcomes), (
        code, running)


# --- what is accepted ------------------------------------------------------------------------


def _as_parameter(t):
    return torch.nn.Parameter(t.clone(), requires_grad=True)


def _non_leaf(t):
    return t.clone().requires_grad_(True).view(t.shape)  # a view: not a leaf, same bits


def _inference(t):
    with torch.inference_mode():
        return t.clone()


ACCEPTED = {"plain": lambda t: t, "parameter": _as_parameter, "non-leaf": _non_leaf,
            "inference-tensor": _inference}


@pytest.mark.parametrize("api", kp.APIS)
@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_plain_tensors_and_parameters_load_bit_exact(kind, api):
    for fmt in kp.FORMATS:
        params = kp.fresh_params()
        before = compare.snapshot(params)
        loader = kp.Loader(api, fmt, params)
        loader.begin()
        for layer in range(kp.SPEC.num_layers):
            loader.load([(n, ACCEPTED[kind](t)) for n, t in kp.bucket(fmt, [layer])])
        if api == "receiver":
            loader.receiver.end_update()
        else:
            loader.impl.end_update(params, **loader.kwargs)
        expected = synth.expected_receiver_params(kp.SPEC, kp.TOPOLOGY, kp.RANK, 1)
        compare.assert_loaded(params, expected, before=before, rank=kp.RANK)


# --- the receiver's own parameters ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["subclass", "neg-view", "freed-storage", "sparse"])
def test_receiver_refuses_parameters_it_cannot_write(kind):
    params = kp.fresh_params()
    name = next(iter(params))
    params[name] = kp.KINDS[kind][0](params[name])
    with pytest.raises(rx.ReceiverParamsError, match=f"receiver rank {kp.RANK} parameter "
                                                     f"'{name}'"):
        rx.ReferenceReceiver(kp.SPEC, kp.TOPOLOGY, kp.RANK, params=params)


# --- something that is no tensor in an exporter's bucket -------------------------------------


def test_a_lock_in_a_distributed_exporters_bucket_is_named():
    from pytest_weightsync import distributed
    from pytest_weightsync.reference_impl.model.layout import ReceiverTopology

    good = kp.bucket("compat", [0])[:2]
    result = [good, [good[0], ("model.layers.0.mlp.experts.1.up_proj.weight", threading.Lock())]]
    with pytest.raises(distributed.DistributedExportError,
                       match=r"bucket 1 entry 1 'model\.layers\.0\.mlp\.experts\.1\.up_proj"
                             r"\.weight' is a lock, not a torch\.Tensor"):
        distributed.normalize_result(result, delivery="colocated", rank=0,
                                     receiver=ReceiverTopology(), source="x")
    with pytest.raises(distributed.DistributedExportError,
                       match=r"bucket 0 entry 0 .* tensor subclass \(.*_Subclass\)"):
        distributed.normalize_result([[(good[0][0], good[0][1].as_subclass(kp._Subclass))]],
                                     delivery="colocated", rank=0, receiver=ReceiverTopology(),
                                     source="x")


def test_a_lock_in_a_stream_to_split_is_named():
    from pytest_weightsync.reference_impl.senders.buckets import BucketEntryError, split_buckets

    named = kp.bucket("compat", [0])[:2] + [("model.layers.0.mlp.experts.9.up_proj.weight",
                                             threading.Lock())]
    for limit in (None, 0, 1 << 20):
        with pytest.raises(BucketEntryError, match=r"entry 2 'model\.layers\.0\.mlp\.experts\.9"
                                                   r"\.up_proj\.weight' of the stream is a lock"):
            split_buckets(named, limit)
    with pytest.raises(BucketEntryError, match="entry 0 of the stream is a str"):
        split_buckets(["not a pair"], None)


def test_a_lock_in_a_loaded_bucket_is_a_payload_error_naming_the_entry():
    impl = ReferenceImplementation()
    params = kp.fresh_params()
    entries = kp.bucket("compat", [0])
    entries[3] = (entries[3][0], threading.Lock())
    with pytest.raises(PayloadError, match=rf"payload entry 3 {shown(entries[3][0])} is a lock"):
        impl.load_weights(params, entries, format="compat", spec=kp.SPEC, topology=kp.TOPOLOGY,
                          rank=kp.RANK)
