"""The ``weight_transfer`` transport is vLLM 0.33.0's weight-transfer protocol, held to the wheel.

Every modelled fact of :mod:`pytest_weightsync.transports.weight_transfer` is checked against vLLM's own
source (the pinned wheel, :mod:`vllm_source`; vLLM does not import here):

* from the AST: the worker's and the client's calls, the fields of each engine's update and
  init info, the packed defaults, the registered engines and the default backend, the handle
  argument the worker overwrites with its device; the sleep levels (level 1 offloads the
  weights, level 2 discards them: the lifecycle claim ``sleep``);
* by running vLLM's own receiving code (:mod:`vllm_transfer_engine`) on what the reference
  encodes (IPC and NCCL, unpacked and packed, per-worker lists, reused NCCL metadata): the
  ``load_weights`` calls vLLM makes are exactly the buckets the harness decodes, bit for bit,
  and vLLM cuts packed chunks where :func:`~pytest_weightsync.transports.weight_transfer.packed_chunks`
  says (its own ``pack_tensors`` on the same tensors);
* ``ipc_handles_pickled``: vLLM unpickles it only with ``VLLM_ALLOW_INSECURE_SERIALIZATION``
  (plain ``pickle``), the harness with its allow-list unpickler, to the same buckets;
* bad input: what vLLM refuses (an update outside start/finish, a second start, a finish
  without start, a handle list shorter than the names) the harness refuses too, before
  anything is loaded, with its own error; what vLLM loads silently (an unpacked IPC handle of
  another dtype than announced) the harness refuses, and vLLM is shown loading it.

The exporter suites' shared decoding step takes the transport like the others (last tests).
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from pytest_weightsync.transports import weight_transfer as wt
from pytest_weightsync.reference_impl.backends import vllm as facts
from pytest_weightsync.wire import WireFormatError

from . import vllm_source as src
from . import vllm_transfer_engine as ve

pytestmark = [pytest.mark.weightsync_property("receiver_layout")]
WT = "distributed/weight_transfer/"


@pytest.fixture(scope="module", autouse=True)
def wheel():
    return src.require_wheel()


def _fields(rel: str, cls: str) -> tuple:
    return tuple(n.target.id for n in src.class_node(rel, cls).body
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                 and "ClassVar" not in ast.unparse(n.annotation))


def _methods(rel: str, cls: str) -> set:
    return {n.name for n in src.class_node(rel, cls).body if isinstance(n, ast.FunctionDef)}


def test_the_calls_fields_and_defaults_are_vllms():
    assert set(wt.CALLS) <= _methods("v1/worker/gpu_worker.py", "Worker")
    client = _methods(WT + "base.py", "VLLMWeightSyncClient")
    assert client == {wt.INIT, wt.START, wt.UPDATE, wt.FINISH}, client
    assert _fields(WT + "ipc_engine.py", "IPCWeightTransferUpdateInfo") == wt.UPDATE_FIELDS["ipc"]
    assert _fields(WT + "nccl_engine.py", "NCCLWeightTransferUpdateInfo") == \
        wt.UPDATE_FIELDS["nccl"]
    assert _fields(WT + "ipc_engine.py", "IPCWeightTransferInitInfo") == wt.INIT_FIELDS["ipc"]
    assert _fields(WT + "nccl_common.py", "NCCLWeightTransferInitInfo") == wt.INIT_FIELDS["nccl"]
    ns = ve.namespace(0)
    assert ns["DEFAULT_PACKED_BUFFER_SIZE_BYTES"] == wt.DEFAULT_PACKED_BUFFER_SIZE_BYTES
    assert ns["DEFAULT_PACKED_NUM_BUFFERS"] == wt.DEFAULT_PACKED_NUM_BUFFERS
    factory = src.text("vllm/" + WT + "factory.py")
    for backend in wt.BACKENDS:
        assert f'register_engine(\n    "{backend}",' in factory, backend
    default = src.class_node("config/weight_transfer.py", "WeightTransferConfig").body
    assert any(isinstance(n, ast.AnnAssign) and n.target.id == "backend"
               and ast.literal_eval(n.value) == wt.DEFAULT_BACKEND for n in default)
    # the worker overwrites argument 6 of rebuild_cuda_tensor with its own device index
    body = ast.unparse(src.method_node(WT + "ipc_engine.py", "IPCWeightTransferEngine",
                                       "receive_weights"))
    assert f"list_args[{wt.HANDLE_DEVICE_ARG}] = device_index" in body
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    assert tuple(inspect.signature(rebuild_cuda_tensor).parameters) == wt.HANDLE_ARGS


def test_sleep_level_1_offloads_the_weights_and_level_2_discards_them():
    suspend = src.method_node("device_allocator/sleep_mode_backend.py", "CuMemBackend", "suspend")
    default = next(n for n in suspend.body if isinstance(n, ast.AnnAssign))  # every level
    only_1 = next(n for n in suspend.body if isinstance(n, ast.If))
    assert ast.unparse(only_1.test) == "level == 1" and not only_1.orelse
    offloaded = {2: "'weights'" in ast.unparse(default),
                 1: "'weights'" in ast.unparse(default) + ast.unparse(only_1.body)}
    assert offloaded == facts.SLEEP_OFFLOADS_WEIGHTS == {1: True, 2: False}
    sleep = ast.unparse(src.method_node("v1/worker/gpu_worker.py", "Worker", "sleep"))
    assert "if level == 2:" in sleep and "model.named_buffers()" in sleep  # buffers kept only


def _tensors(seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [("model.layers.0.self_attn.qkv_proj.weight",
             torch.randint(-9, 9, (4, 6), generator=gen).to(torch.bfloat16)),
            ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(5, generator=gen)),
            ("model.norm.weight", torch.randn(7, generator=gen).to(torch.bfloat16)),
            ("model.layers.1.mlp.experts.w13_weight",
             torch.randint(-9, 9, (2, 4, 3), generator=gen).to(torch.int8))]


def _same(got: list, want: list) -> None:
    assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in want]
    for gb, wb in zip(got, want):
        for (name, g), (_, w) in zip(gb, wb):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g.contiguous().view(torch.uint8),
                               w.contiguous().view(torch.uint8)), name


CASES = [("ipc", False), ("ipc", True), ("nccl", False), ("nccl", True)]


@pytest.mark.parametrize("backend,packed", CASES, ids=[f"{b}-{'packed' if p else 'plain'}"
                                                        for b, p in CASES])
def test_vllm_loads_exactly_the_buckets_the_harness_decodes(backend, packed):
    named = _tensors()
    calls = wt.transfer_stream([named[:3], named[3:]], backend=backend, engine_ranks=[0, 1],
                               packed=packed, buffer_bytes=40)
    if backend == "nccl":  # a second update whose announcement is empty: the metadata reused
        again = [(n, t + 1 if t.is_floating_point() else t) for n, t in named[3:]]
        reuse = wt.nccl_update(again, packed=packed, buffer_bytes=40)
        calls += [wt.TransferCall(wt.START), wt.TransferCall(wt.UPDATE, {"names": [],
                  "dtype_names": [], "shapes": []}, broadcasts=reuse.broadcasts),
                  wt.TransferCall(wt.FINISH)]
    for rank in (0, 1):
        decoded = wt.decode_stream(calls, engine_rank=rank, engine_world=2)
        _same(ve.run(calls, backend=backend, engine_rank=rank, engine_world=2), decoded)
    first = [pair for bucket in decoded for pair in bucket][:len(named)]
    _same([first], [named])


def test_a_per_worker_list_is_read_at_the_workers_rank():
    named = _tensors()
    per_rank = [wt.ipc_update([named[r]], engine_ranks=[r]) for r in range(2)]
    calls = [wt.TransferCall(wt.INIT, {"packed": False}, backend="ipc"),
             wt.TransferCall(wt.START), wt.TransferCall(wt.UPDATE, per_rank),
             wt.TransferCall(wt.FINISH)]
    for rank in (0, 1):
        decoded = wt.decode_stream(calls, engine_rank=rank, engine_world=2)
        assert decoded[0][0][0] == named[rank][0]
        _same(ve.run(calls, backend="ipc", engine_rank=rank, engine_world=2), decoded)
    with pytest.raises(wt.TransferProtocolError, match="one per engine worker \\(3\\)"):
        wt.decode_stream(calls, engine_rank=0, engine_world=3)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_pickled_handles_are_read_by_the_allow_list_where_vllm_needs_insecure_pickle():
    calls = _stream()
    info = calls[2].info
    over_http = calls[:2] + [wt.TransferCall(wt.UPDATE, wt.pickled_handles(info))] + calls[3:]
    with pytest.raises(ValueError, match="without VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        ve.run(over_http, backend="ipc", engine_rank=0, engine_world=1)
    decoded = wt.decode_stream(over_http, engine_rank=0, engine_world=1)
    _same(ve.run(over_http, backend="ipc", engine_rank=0, engine_world=1, insecure=True),
          decoded)
    both = dict(wt.pickled_handles(info), ipc_handles=info["ipc_handles"])
    with pytest.raises(ValueError, match="Cannot specify both"):
        ve.run(calls[:2] + [wt.TransferCall(wt.UPDATE, both)], backend="ipc", engine_rank=0,
               engine_world=1, insecure=True)
    with pytest.raises(wt.TransferProtocolError, match="both ipc_handles and ipc_handles_pickled"):
        wt.decode_stream(calls[:2] + [wt.TransferCall(wt.UPDATE, both)] + calls[3:],
                         engine_rank=0, engine_world=1)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_packed_chunks_are_cut_where_vllms_own_packer_cuts_them():
    named = _tensors()
    ns = ve.namespace(0)
    for limit in (1, 12, 40, 10**6):
        it = iter(named)
        vllm_chunks = []
        while (chunk := ns["pack_tensors"](it, lambda item: item[1], limit)) is not None:
            vllm_chunks.append(chunk)
        sizes = [t.numel() * t.element_size() for _, t in named]
        ours = wt.packed_chunks(sizes, limit)
        assert [c.names for c in vllm_chunks] == [[named[i][0] for i in c] for c in ours], limit
        sent = wt.nccl_update(named, packed=True, buffer_bytes=limit).broadcasts
        assert all(torch.equal(c.packed_tensor, s) for c, s in zip(vllm_chunks, sent)), limit


def _stream(backend="ipc", packed=False):
    return wt.transfer_stream([_tensors()[:2], _tensors()[2:]], backend=backend,
                              engine_ranks=[0], packed=packed)


#: misuse -> (how the calls are broken, what vLLM's worker raises, what the harness says)
MISUSE = {
    "update outside start/finish": (lambda c: [c[0], c[2]] + c[1:],
                                    "start_weight_update must be called before update_weights",
                                    "update_weights outside a session"),
    "second start": (lambda c: c[:2] + [c[1]] + c[2:], "already active",
                     "start while an update is active"),
    "finish without start": (lambda c: [c[0], c[-1]] + c[1:], "without a matching",
                             "finish without a start"),
}


@pytest.mark.parametrize("misuse", sorted(MISUSE))
def test_misuse_vllm_refuses_is_refused_before_anything_loads(misuse):
    broken, vllm_says, we_say = MISUSE[misuse]
    calls = broken(_stream())
    with pytest.raises(RuntimeError, match=vllm_says):
        ve.run(calls, backend="ipc", engine_rank=0, engine_world=1)
    with pytest.raises(wt.TransferSessionError, match=we_say):
        wt.decode_stream(calls, engine_rank=0, engine_world=1)
    with pytest.raises(wt.TransferSessionError, match="never finished"):
        wt.decode_stream(_stream()[:-1], engine_rank=0, engine_world=1)


def test_bad_chunks_are_refused_by_the_harness_where_vllm_refuses_or_loads_garbage():
    calls = _stream()
    short = dict(calls[2].info, ipc_handles=calls[2].info["ipc_handles"][:1])
    bad = calls[:2] + [wt.TransferCall(wt.UPDATE, short)] + calls[3:]
    with pytest.raises(ValueError, match="`ipc_handles` should be of the same size"):
        ve.run(bad, backend="ipc", engine_rank=0, engine_world=1)
    with pytest.raises(wt.TransferProtocolError, match="1 IPC handles for 2 announced"):
        wt.decode_stream(bad, engine_rank=0, engine_world=1)
    # a dtype other than announced: vLLM's unpacked IPC engine loads the handle's tensor
    lied = dict(calls[2].info, dtype_names=["float16", "float32"])
    bad = calls[:2] + [wt.TransferCall(wt.UPDATE, lied)] + calls[3:]
    loaded = ve.run(bad, backend="ipc", engine_rank=0, engine_world=1)
    assert loaded[0][0][1].dtype == torch.bfloat16
    with pytest.raises(wt.TransferProtocolError, match="announced torch.float16 \\(4, 6\\), the "
                                                       "handle holds torch.bfloat16"):
        wt.decode_stream(bad, engine_rank=0, engine_world=1)
    # NCCL: a broadcast of another dtype, one broadcast short, a packed size in elements
    calls = _stream("nccl")
    upd = calls[2]
    for broadcasts, said in ((upd.broadcasts[:1] + (upd.broadcasts[1].double(),),
                              "announced torch.float32, 20 bytes; broadcast torch.float64"),
                             (upd.broadcasts[:1], "1 broadcasts for 2 announced parameters")):
        bad = calls[:2] + [wt.TransferCall(wt.UPDATE, upd.info, broadcasts=broadcasts)] + calls[3:]
        with pytest.raises(RuntimeError):
            ve.run(bad, backend="nccl", engine_rank=0, engine_world=1)
        with pytest.raises(wt.TransferProtocolError, match=said):
            wt.decode_stream(bad, engine_rank=0, engine_world=1)
    calls = _stream(packed=True)
    sizes = dict(calls[2].info, tensor_sizes=[24, 5])
    bad = calls[:2] + [wt.TransferCall(wt.UPDATE, sizes)] + calls[3:]
    with pytest.raises(wt.TransferProtocolError, match="tensor size 24 bytes.*needs 48"):
        wt.decode_stream(bad, engine_rank=0, engine_world=1)
    freed = list(wt.cpu_handle(torch.ones(2)))
    freed[7] = bytes(freed[7])  # the token without the memory it names: gone
    with pytest.raises(wt.TransferProtocolError, match="names no live memory.*freed before"):
        wt.open_handle(tuple(freed))
    with pytest.raises(wt.TransferProtocolError, match="no IPC handle for this engine rank"):
        wt.decode_stream(_stream(), engine_rank=1, engine_world=2)
    with pytest.raises(wt.TransferProtocolError, match="fields \\['ipc_handles'\\]"):
        wt.decode_stream([wt.TransferCall(wt.INIT, {}, backend="nccl")] + _stream()[1:],
                         engine_rank=0, engine_world=1)
    assert issubclass(wt.TransferProtocolError, WireFormatError)


def test_a_single_process_exporter_may_send_vllm_weight_transfer_calls():
    """``export_weights`` results on this transport go through the suites' one decoding step
    (``exporter.exported_streams``): the reference's payload encoded as IPC and NCCL calls
    lands; an update outside start/finish is refused naming the call."""
    from pytest_weightsync.reference_impl.impl import ReferenceImplementation

    from ..harness import exporter as eh
    from ..harness import judge
    from ..harness.cases import ANCHORS

    case = ANCHORS[1]

    class OverVllm(ReferenceImplementation):
        name = "reference-vllm-transfer"
        backend, packed, broken = "ipc", False, False

        def export_weights(self, trainer_states, *, rank, **kwargs):
            bucket = list(super().export_weights(trainer_states, rank=rank, **kwargs))
            half = max(1, len(bucket) // 2)
            calls = wt.transfer_stream([bucket[:half], bucket[half:]], backend=self.backend,
                                       engine_ranks=[rank], packed=self.packed, buffer_bytes=256)
            return [calls[0], calls[2]] + calls[1:] if self.broken else calls

    for backend, packed in CASES:
        OverVllm.backend, OverVllm.packed = backend, packed
        eh.export_and_check(OverVllm(), case, "compat", 1)
    OverVllm.broken = True
    with pytest.raises(judge.ConformanceError, match="call 1 \\(update_weights\\): "
                                                     "update_weights outside a session"):
        eh.export_and_check(OverVllm(), case, "compat", 1)
