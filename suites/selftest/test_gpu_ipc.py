"""The sync paths across processes over CUDA IPC, as a colocated trainer feeds SGLang.

A trainer process serializes its payload tensors (CUDA IPC handles, not bytes: SGLang's
``MultiprocessingSerializer``) and every receiver rank, in its own process, rebuilds its entry,
loads it into its pre-allocated parameters and drops it (:mod:`pytest_weightsync.reference_impl.sharing.ipc`). Over
repeated updates:

* every receiver parameter is bit-identical to the oracle after every update (read back
  through IPC views of the receiver's live parameters);
* receiver parameter addresses never change;
* IPC handles are released: after the payload is dropped and ``torch.cuda.ipc_collect`` ran,
  the trainer's allocated memory, the receivers' allocated memory and the device's free memory
  are where they were after the first updates - and a receiver that keeps its payloads is
  caught by exactly these checks.
"""

from __future__ import annotations

import pytest

from . import gpu_harness as h
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology

pytestmark = [pytest.mark.gpu, pytest.mark.weightsync_property("cuda-ipc")]

UPDATES = 10
#: Updates before the memory baseline is taken (allocator caches and IPC state warm up).
WARMUP = 2
SPEC = MoESpec(num_layers=1, num_experts=16, hidden=512, intermediate=256)
#: Updates of the real-size layer: enough that a leak of one payload (1.5 GiB) per update, or a
#: slow one of a few MiB, shows against the memory baseline taken after WARMUP.
QWEN35_UPDATES = 21


@pytest.fixture(scope="module")
def receivers_on_gpu0():
    """Two receiver processes on cuda:0 (a colocated engine of up to two ranks), reused by
    every test of the module; each test configures fresh parameters."""
    from pytest_weightsync.reference_impl.engine.process import ReceiverProcess

    processes = [ReceiverProcess("cuda:0", timeout=120), ReceiverProcess("cuda:0", timeout=120)]
    try:
        yield processes
    finally:
        for process in processes:
            process.close()


def assert_released(log, receivers_count: int, where: str) -> None:
    """No memory growth after the warm-up updates, in the trainer, the receivers or the device.

    A leak keeps one payload per update alive, so growth below one payload over the remaining
    updates cannot be a leak; a leak over them is several payloads."""
    one = min(log.payload_bytes)
    first, last = log.trainer[WARMUP - 1], log.trainer[-1]
    grown = last.allocated - first.allocated
    assert grown < one, (f"{where}: trainer allocated memory grew by {grown} B over "
                         f"{len(log.trainer) - WARMUP} updates (one payload is {one} B): IPC "
                         f"blocks are not released")
    dropped = first.device_free - last.device_free
    assert dropped < 2 * one, (f"{where}: device free memory dropped by {dropped} B over "
                               f"{len(log.trainer) - WARMUP} updates (one payload is {one} B)")
    for rank in range(receivers_count):
        a = log.receivers[WARMUP - 1][rank].memory.allocated
        b = log.receivers[-1][rank].memory.allocated
        assert b - a < one, f"{where}: receiver rank {rank} allocated memory grew by {b - a} B"


def memory_line(log, receivers_count: int) -> str:
    """Memory after the warm-up and after the last update, in MiB (for the run's summary)."""
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    first, last = log.trainer[WARMUP - 1], log.trainer[-1]
    receivers = ", ".join(
        f"rank {r} {mib(log.receivers[WARMUP - 1][r].memory.allocated)} -> "
        f"{mib(log.receivers[-1][r].memory.allocated)}" for r in range(receivers_count))
    return (f"after update {WARMUP} -> after update {len(log.trainer)}: trainer allocated "
            f"{mib(first.allocated)} -> {mib(last.allocated)} MiB, device free "
            f"{mib(first.device_free)} -> {mib(last.device_free)} MiB, receivers allocated "
            f"{receivers} MiB (one payload {mib(min(log.payload_bytes))} MiB)")


CASES = [
    pytest.param("direct", ReceiverTopology(tp=1), id="direct-moe_tp1"),
    pytest.param("direct", ReceiverTopology(tp=2, moe_ep=2, order="up_gate"), id="direct-moe_ep2-up_gate"),
    pytest.param("direct", ReceiverTopology(tp=2, intermediate_padded=160), id="direct-moe_tp2-padded"),
    pytest.param("packed", ReceiverTopology(tp=2), id="packed-moe_tp2"),
]


@pytest.mark.parametrize("path, topo", CASES)
def test_updates_over_cuda_ipc_are_exact_in_place_and_release_handles(receivers_on_gpu0, path, topo):
    processes = receivers_on_gpu0[: topo.world_size]
    log = h.run_ipc_updates(processes, SPEC, topo, path, range(UPDATES), "cuda:0")
    assert all(r.entries > 0 for reports in log.receivers for r in reports)
    assert_released(log, topo.world_size, f"{path} path, {topo}")


@pytest.mark.parametrize("topo", [ReceiverTopology(tp=1), ReceiverTopology(tp=2)],
                         ids=["moe_tp1", "moe_tp2"])
def test_qwen35_layer_direct_path_over_cuda_ipc(receivers_on_gpu0, topo,
                                                weightsync_record_property):
    """One real Qwen3.5-35B-A3B MoE layer (256 experts, hidden 2048, moe_ffn 512: 1.5 GiB),
    updated 21 times: exact after every update, and trainer, receiver and device memory flat
    after the warm-up (poison, weights and expected values are all built on the GPU)."""
    spec = h.QWEN35_LAYER
    processes = receivers_on_gpu0[: topo.world_size]
    log = h.run_ipc_updates(processes, spec, topo, "direct", range(QWEN35_UPDATES), "cuda:0")
    assert len(log.trainer) == QWEN35_UPDATES
    assert all(b == 3 * 256 * 2048 * 512 * 2 for b in log.payload_bytes)  # the whole layer
    assert_released(log, topo.world_size, f"Qwen3.5 layer, {topo}")
    weightsync_record_property("gpu_memory", memory_line(log, topo.world_size))


def test_a_receiver_that_keeps_its_payloads_is_caught(receivers_on_gpu0):
    """The release checks can fail: a receiver holding every rebuilt payload pins one payload
    of trainer memory per update."""
    topo = ReceiverTopology(tp=1)
    log = h.run_ipc_updates(receivers_on_gpu0[:1], SPEC, topo, "direct", range(6), "cuda:0",
                            check=False, keep_payloads=True)
    grown = log.trainer[-1].allocated - log.trainer[WARMUP - 1].allocated
    assert grown >= (len(log.trainer) - WARMUP) * log.payload_bytes[0], grown
    with pytest.raises(AssertionError, match="IPC blocks are not released"):
        assert_released(log, 1, "leaking receiver")
    receivers_on_gpu0[0].configure(SPEC, topo, 0)  # drops the kept payloads


def test_a_refused_payload_leaves_parameters_untouched_and_releases_handles(receivers_on_gpu0):
    import torch

    from pytest_weightsync.reference_impl.sharing import ipc
    from pytest_weightsync.reference_impl.engine.process import ReceiverProcessError

    topo = ReceiverTopology(tp=1)
    process = receivers_on_gpu0[0]
    h.run_ipc_updates([process], SPEC, topo, "direct", [3], "cuda:0")
    baseline = ipc.memory_stats("cuda:0").allocated
    bad = [(name, t.to(torch.float32))
           for name, t in h.payload("direct", SPEC, topo, 0, h.full_weights(SPEC, 4, "cuda:0"))]
    with pytest.raises(ReceiverProcessError, match="dtype torch.float32"):
        process.update(ipc.serialize(bad), "direct")
    del bad
    ipc.collect("cuda:0")
    h.assert_params_exact(process.params(), SPEC, topo, 0, 3)
    assert ipc.memory_stats("cuda:0").allocated <= baseline


@pytest.mark.gpu(n=2)
def test_receiver_ranks_on_two_gpus_rebuild_by_uuid_and_copy_to_their_device():
    """Trainer on cuda:0, receiver rank r on cuda:r: the handle opens on the trainer's GPU
    (found by UUID) and rank 1 copies to its own device, as SGLang's ``_unwrap_tensor`` does."""
    from pytest_weightsync.reference_impl.engine.process import ReceiverProcess

    topo = ReceiverTopology(tp=2)
    with ReceiverProcess("cuda:0") as rank0, ReceiverProcess("cuda:1") as rank1:
        log = h.run_ipc_updates([rank0, rank1], SPEC, topo, "direct", range(UPDATES), "cuda:0")
        assert_released(log, 2, "receivers on two GPUs")


def test_a_plain_cuda_tensor_reduces_to_torchs_own_rebuild_arguments():
    """``ipc._reduce_tensor`` shares a plain CUDA tensor in one ``_share_cuda_`` call instead
    of through torch's ``reduce_tensor``: the rebuild arguments are torch's, field for field
    (the reference count slot and event of each share apart; the other tests here rebuild
    them in receiver processes); a tensor torch's path must see (a Parameter that requires
    grad) still goes through it."""
    import torch
    from torch.multiprocessing import reductions

    from pytest_weightsync.reference_impl.sharing import ipc

    base = torch.arange(4096, dtype=torch.int32, device="cuda:0").view(torch.bfloat16)
    view = base.view(64, 128)[3:40:2, 5:70]
    ours_fn, ours = ipc._reduce_tensor(view)
    theirs_fn, theirs = reductions.reduce_tensor(view)
    assert ours_fn is ipc.rebuild_cuda_tensor_by_uuid and theirs_fn is reductions.rebuild_cuda_tensor
    per_share = {11, 12, 13}  # ref counter handle and offset, event handle
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if i == 6:
            assert a == ipc._device_uuid(b)
        elif i not in per_share:
            assert a == b and type(a) is type(b), (i, a, b)
    assert len(ours) == len(theirs)
    param = torch.nn.Parameter(torch.ones(8, device="cuda:0"))
    fn, args = ipc._reduce_tensor(param)
    assert args[0] is torch.nn.Parameter and args[10] is True
    del param
    ipc.collect("cuda:0")


def test_a_shared_payloads_storages_travel_whole_and_leave_the_current_stream_alone():
    """A shared payload's storages are reduced as whole storages (``ipc._reduce_storage``:
    one ``_share_cuda_`` each, rebuilt by ``rebuild_storage_by_uuid``), anything else as
    ``_reduce_tensor`` does; the shares are made on the side stream and the caller's current
    stream and device are what they were. The receiver processes of the other tests here and
    of ``test_per_update_sync.py`` rebuild such payloads and check every bit."""
    import io

    import torch

    from pytest_weightsync.reference_impl.sharing import ipc, shared_payload

    base = torch.arange(4096, dtype=torch.int32, device="cuda:0")
    whole = torch.empty(0, dtype=torch.uint8, device="cuda:0").set_(
        base.untyped_storage(), 0, (base.untyped_storage().nbytes(),), (1,))
    fn, args = ipc._reduce_storage(whole)
    assert fn is ipc.rebuild_storage_by_uuid
    assert args[0] == ipc._device_uuid(0) and args[2] == whole.numel()
    assert args[7] is False  # no event to wait for: the sender orders the reads itself
    for partial in (whole[16:], base.view(torch.uint8)[:100], base):
        assert ipc._reduce_storage(partial)[0] is ipc.rebuild_cuda_tensor_by_uuid
    mine = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(mine):
        with shared_payload._side_streams([whole]):
            assert torch.cuda.current_stream("cuda:0") == shared_payload._SIDE_STREAMS[0] != mine
        payload = shared_payload.SharedPayload([("w", base.view(64, 64)[:, :32])])
        data = payload.serialize()
        assert torch.cuda.current_stream("cuda:0") == mine
        assert torch.cuda.current_device() == 0
    assert isinstance(data, bytes) and len(data) > 0
    wire = io.BytesIO()
    ipc.tensor_pickler(wire, storages=True).dump([("a", base[:10])])  # a view: torch's rebuild
    assert b"rebuild_cuda_tensor_by_uuid" in wire.getvalue()
    del data, payload
    ipc.collect("cuda:0")
