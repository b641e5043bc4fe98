"""vLLM 0.33.0's weight-transfer receiving code, compiled from the wheel and run on CPU.

``test_vllm_transfer.py`` holds the harness's decoder (:mod:`pytest_weightsync.transports.weight_transfer`)
to what vLLM itself does with the same calls. vLLM does not import here, so its own code is
compiled from the wheel's text (:mod:`vllm_source`): the worker's session methods
(``Worker._start_weight_update``, ``update_weights``, ``finish_weight_update``,
``init_weight_transfer_engine``), the engine base's ``update_weights`` / ``parse_*_info``, the
IPC and NCCL engines' ``init_transfer_engine`` / ``start_weight_update`` /
``finish_weight_update`` / ``receive_weights``, their update-info dataclasses (validation
included) and ``packed_tensor.py``'s packing and unpacking. What they read around them is
stood in for: CUDA's ``rebuild_cuda_tensor`` opens the harness's CPU handle, the device's UUID
is the harness engine rank's key, the NCCL group hands out what the sender broadcast (and
refuses a receive of another size, where NCCL would hang or corrupt), streams and events do
nothing, the layerwise reload is left out (its buffering is the model's, not the protocol's),
and the model records every ``load_weights`` call.
"""

from __future__ import annotations

import base64
import contextlib
import math
import pickle
from types import SimpleNamespace

import torch

from pytest_weightsync.transports import weight_transfer as wt

from . import vllm_source as src

WT = "distributed/weight_transfer/"


class _Stream:
    def synchronize(self):
        pass

    def wait_event(self, event):
        pass


class _Event:
    def record(self, stream=None):
        pass


class FakeTorch:
    """``torch`` as vLLM's receiving code sees it here: the real one, but CUDA streams, events
    and device properties that a CPU has not (``uuid``: the harness engine rank's key)."""

    def __init__(self, engine_rank: int):
        key = wt.device_key(engine_rank)
        self.cuda = SimpleNamespace(
            stream=lambda stream=None: contextlib.nullcontext(),
            current_stream=lambda *a: _Stream(),
            get_device_properties=lambda index=None: SimpleNamespace(uuid=key))
        self.accelerator = SimpleNamespace(current_stream=lambda *a: _Stream(),
                                           current_device_index=lambda: 0,
                                           synchronize=lambda *a: None)
        self.Event = _Event

    def __getattr__(self, name):
        return getattr(torch, name)


class Group:
    """The trainer<->worker NCCL group: a receive takes the sender's next broadcast; one of
    another size or dtype is refused (NCCL would wait, or write other bytes)."""

    def __init__(self):
        self.pending: list = []

    def broadcast(self, tensor, src=0, stream=None):
        if not self.pending:
            raise RuntimeError("the worker waits for a broadcast the sender never makes")
        sent = self.pending.pop(0)
        if sent.dtype != tensor.dtype or sent.numel() != tensor.numel():
            raise RuntimeError(f"receive of {tensor.dtype} {tuple(tensor.shape)} met a broadcast "
                               f"of {sent.dtype} {tuple(sent.shape)}")
        tensor.copy_(sent.reshape(tensor.shape))


class Model:
    """The served model: records every ``load_weights`` call (copies of what it was handed)."""

    def __init__(self):
        self.calls: list = []

    def load_weights(self, weights):
        self.calls.append([(name, tensor.clone()) for name, tensor in weights])


def _rebuild(*args):
    return wt.open_handle(tuple(args), "vLLM's rebuild_cuda_tensor")


def _packed(namespace: dict) -> dict:
    """``packed_tensor.py``'s functions and importer, over the stand-ins."""
    src.compile_defs(WT + "packed_tensor.py",
                     ["DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS",
                      "unpack_tensor", "PackedChunk", "pack_tensors",
                      "packed_nccl_broadcast_consumer", "PackedBufferImporter",
                      "packed_ipc_consumer"], namespace, keep_annotations=True)
    return namespace


def namespace(engine_rank: int) -> dict:
    ns = {"torch": FakeTorch(engine_rank), "math": math, "pickle": pickle, "base64": base64,
          "dataclass": __import__("dataclasses").dataclass,
          "field": __import__("dataclasses").field, "Any": object,
          "Callable": object, "Iterator": object, "ClassVar": object, "Self": object,
          "TYPE_CHECKING": False, "_get_streams": lambda idx, n: tuple(_Stream()
                                                                      for _ in range(n)),
          "rebuild_cuda_tensor": _rebuild,
          "envs": SimpleNamespace(VLLM_ALLOW_INSECURE_SERIALIZATION=False),
          "disable_mtp_completeness_check": contextlib.nullcontext,
          "initialize_layerwise_reload": lambda model: None,
          "finalize_layerwise_reload": lambda model, config: None,
          "set_current_vllm_config": lambda config: contextlib.nullcontext(),
          "share_source_lm_heads": lambda model: None,
          "restore_quantized_lm_heads": lambda model, refresh=True: None}
    return _packed(ns)


class _Base:
    """Placeholder base for the compiled dataclasses (vLLM's are empty ABC dataclasses)."""


def engine(backend: str, engine_rank: int, model: Model, insecure: bool = False):
    """vLLM's ``backend`` engine (its own methods) on ``model``, for ``engine_rank``
    (``insecure``: ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""
    ns = namespace(engine_rank)
    ns["envs"].VLLM_ALLOW_INSECURE_SERIALIZATION = insecure
    ns["_Base"] = _Base
    src.compile_methods(WT + "base.py", "WeightTransferEngine",
                        ["update_weights", "parse_update_info", "parse_init_info",
                         "set_weight_update_target", "reset_weight_update_target"], ns,
                        name="EngineBase")
    # The two backends differ only in where their info classes are defined; the engine class
    # and its wiring are compiled the same way for both.
    prefix, module = ("IPC", "ipc_engine.py") if backend == "ipc" else ("NCCL", "nccl_engine.py")
    if backend == "ipc":
        src.compile_defs(WT + module, ["IPCWeightTransferInitInfo",
                                       "IPCWeightTransferUpdateInfo"], ns,
                         bases={"WeightTransferInitInfo": "_Base",
                                "WeightTransferUpdateInfo": "_Base"}, keep_annotations=True)
    else:
        group = Group()
        ns["worker_init_process_group"] = lambda info, parallel: group
        src.compile_defs(WT + "nccl_common.py", ["NCCLWeightTransferInitInfo"], ns,
                         bases={"WeightTransferInitInfo": "_Base"}, keep_annotations=True)
        ns["decode_nccl_unique_id"] = lambda **kw: None  # rendezvous: not this model's
        src.compile_defs(WT + module, ["NCCLWeightTransferUpdateInfo"], ns,
                         bases={"WeightTransferUpdateInfo": "_Base"}, keep_annotations=True)
    cls = src.compile_methods(WT + module, f"{prefix}WeightTransferEngine",
                              ["init_transfer_engine", "start_weight_update",
                               "finish_weight_update", "receive_weights"], ns,
                              base="EngineBase")
    cls.init_info_cls = ns[f"{prefix}WeightTransferInitInfo"]
    cls.update_info_cls = ns[f"{prefix}WeightTransferUpdateInfo"]
    eng = cls.__new__(cls)
    eng.model = eng._default_model = model
    eng.model_config = eng._default_model_config = None
    eng.device = torch.device("cpu")
    eng.parallel_config = None
    eng.supports_draft_weight_update = True
    eng.packed = False
    if backend == "ipc":
        eng._packed_importer = ns["PackedBufferImporter"]()
    else:
        eng.model_update_group = None
        eng._last_update_info = {}
    return eng, ns


def worker(backend: str, engine_rank: int, engine_world: int, insecure: bool = False):
    """vLLM's worker session methods over ``engine(backend, ...)``; ``.model`` records the
    loads, ``.group`` (NCCL) takes the broadcasts of the next call."""
    model = Model()
    eng, ns = engine(backend, engine_rank, model, insecure)
    cls = src.compile_methods("v1/worker/gpu_worker.py", "Worker",
                              ["_check_weight_transfer_engine", "init_weight_transfer_engine",
                               "start_weight_update", "start_draft_weight_update",
                               "_start_weight_update", "update_weights",
                               "finish_weight_update"], ns)
    w = cls.__new__(cls)
    w.weight_transfer_engine = eng
    w._weight_update_active = False
    w._weight_update_is_draft = False
    w.rank = engine_rank
    w.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0,
                                                                    world_size=engine_world))
    w.get_draft_model = lambda: None
    w.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    w.model = model
    w.group = ns.get("worker_init_process_group", lambda *a: None)(None, None)
    return w


def run(calls, *, backend: str, engine_rank: int, engine_world: int,
        insecure: bool = False) -> list:
    """Every ``load_weights`` call vLLM's worker makes for ``calls`` (raises what it raises)."""
    w = worker(backend, engine_rank, engine_world, insecure)
    with _cpu_stand_ins():
        for call in calls:
            _call(w, call)
    return w.model.calls


@contextlib.contextmanager
def _cpu_stand_ins():
    """For the run only: ``rebuild_cuda_tensor`` where ``PackedBufferImporter.rebuild``'s own
    import finds it, and ``Tensor.record_stream`` (the NCCL consumer's, CUDA streams only)
    doing nothing."""
    from torch.multiprocessing import reductions

    real, record = reductions.rebuild_cuda_tensor, torch.Tensor.record_stream
    reductions.rebuild_cuda_tensor = _rebuild
    torch.Tensor.record_stream = lambda self, stream: None
    try:
        yield
    finally:
        reductions.rebuild_cuda_tensor, torch.Tensor.record_stream = real, record


def _call(w, call) -> None:
    if call.method == wt.UPDATE:
        if w.group is not None:
            w.group.pending = list(call.broadcasts)
        w.update_weights(call.info)
    elif call.method == wt.INIT:
        w.init_weight_transfer_engine(dict(call.info or {}))
    else:
        getattr(w, call.method)()
