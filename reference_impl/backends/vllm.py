"""vLLM 0.33.0: why it has no stock row on CPU, and the update protocol its engines speak.

Unlike SGLang, vLLM's loaders cannot be imported and run in this project's CPU environment
(``docs/backends.md``, "vLLM"): the wheel pins ``torch==2.14.0`` (this project pins 2.14.1),
its compiled ops (``_C_stable_libtorch``, ``_moe_C_stable_libtorch``) link ``libcuda.so.1``,
and ``vllm.model_executor.layers.linear`` imports ``vllm.config``, whose ``reasoning`` config
pulls the serving stack (``vllm.reasoning`` -> ``vllm.entrypoints.mcp.tool_server`` ->
``openai_harmony``) and a dozen packages this environment does not carry. Every layout fact
the reference models for vLLM (:mod:`~pytest_weightsync.reference_impl.model.vllm_layout`) is
checked against the wheel's source instead: ``suites/selftest/test_vllm_layouts.py`` compiles
vLLM's loading functions from the wheel's text and runs them on CPU. The facts below are
checked the same way.

The update protocol (vLLM's ``WeightTransferEngine``, ``distributed/weight_transfer/base.py``;
the worker's session, ``v1/worker/gpu_worker.py``):

* :data:`UPDATE_API`: ``init_weight_transfer_engine`` once, then per update
  ``start_weight_update`` (or ``start_draft_weight_update`` for the MTP / EAGLE draft), any
  number of ``update_weights`` chunks, ``finish_weight_update``; the trainer-side client
  (``VLLMWeightSyncClient``) is the same four calls;
* the worker refuses misuse with a ``RuntimeError`` (:data:`SESSION_ERRORS`), and a chunk
  that raises ends the session (``_weight_update_active = False``) and re-raises: the next
  call must start a new update. Nothing restores what the failed chunk's predecessors wrote;
* the IPC and NCCL engines (:data:`LAYERWISE_ENGINES`) receive checkpoint-format tensors
  through the model's ``load_weights`` and run a *layerwise reload*
  (``model_loader/reload/layerwise.py``): ``start_weight_update`` calls
  ``initialize_layerwise_reload`` (each layer's tensors moved to ``meta``, its loaders
  wrapped to buffer), a layer whose every element arrived is materialized, loaded,
  re-processed (``process_weights_after_loading``) and copied into the original storage at
  once; ``finish_weight_update`` calls ``finalize_layerwise_reload``: a layer that received
  nothing keeps its old tensors (logged ``Failed to load weights``), a layer that received
  part of its elements is processed with the rest freshly materialized (uninitialised), and
  attention layers are processed last. ``e_score_correction_bias`` and the expert maps are
  never wrapped (:data:`RELOAD_SKIPPED`).

What a sender hands the engine per update (names, dtype names, shapes, IPC handles or the NCCL
broadcasts, the calls' order) is the harness transport ``weight_transfer``
(:mod:`pytest_weightsync.transports.weight_transfer`), checked against the wheel in
``suites/selftest/test_vllm_transfer.py``.

Sleep between updates (``Worker.sleep(level)`` / ``wake_up``, ``device_allocator/
sleep_mode_backend.py``): level 1 offloads the weights to host memory and restores them at
``wake_up``; level 2 keeps only buffers (and ``sleep_preserve_parameter_names``): the weights
are discarded and must be loaded again (:data:`SLEEP_OFFLOADS_WEIGHTS`). The lifecycle claim
``sleep`` (``docs/validate-your-loader.md``) holds an engine to exactly that.
"""

from __future__ import annotations

#: The release whose source these facts are checked against, and the torch it pins.
VERSION = "0.33.0"
TORCH_PIN = "2.14.0"
#: The wheel the source checks read (fetched by ``ci/install.sh``, never installed).
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"

#: Why no stock vLLM row runs on CPU here: (what, the wheel member that shows it).
CPU_BLOCKERS = (
    ("the compiled ops link libcuda.so.1", "vllm/_C_stable_libtorch.abi3.so"),
    ("the compiled MoE ops link libcuda.so.1", "vllm/_moe_C_stable_libtorch.abi3.so"),
    ("the layers import the serving stack through vllm.config",
     "vllm/entrypoints/mcp/tool_server.py"),
)
#: The import chain from the linear layers to ``openai_harmony`` (module, what it imports).
IMPORT_CHAIN = (
    ("vllm/model_executor/layers/linear.py", "vllm.config"),
    ("vllm/config/__init__.py", "vllm.config.reasoning"),
    ("vllm/config/reasoning.py", "vllm.reasoning"),
    ("vllm/reasoning/__init__.py", "vllm.reasoning.abs_reasoning_parsers"),
    ("vllm/reasoning/abs_reasoning_parsers.py", "vllm.entrypoints.mcp.tool_server"),
    ("vllm/entrypoints/mcp/tool_server.py", "openai_harmony"),
)

#: The worker's weight-update calls, in protocol order.
UPDATE_API = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
              "finish_weight_update")
DRAFT_START = "start_draft_weight_update"
#: Misuse the worker refuses (``RuntimeError``), with the start of its message.
SESSION_ERRORS = {
    "start while an update is active":
        "start_weight_update called while a weight update is already active",
    "update_weights without start": "start_weight_update must be called before update_weights",
    "finish without start":
        "finish_weight_update called without a matching start_weight_update",
}
#: A chunk that raises ends the session (the worker clears its flag and re-raises).
FAILED_CHUNK_ENDS_SESSION = True
#: Registered engine name -> class; these run the layerwise reload around ``load_weights``.
LAYERWISE_ENGINES = {"ipc": "IPCWeightTransferEngine", "nccl": "NCCLWeightTransferEngine"}
#: Tensors the layerwise reload never wraps (``reload/meta.py`` ``SKIP_LOAD_TENSORS``).
RELOAD_SKIPPED = frozenset({"_expert_map", "expert_mask", "expert_global_to_physical",
                            "expert_physical_to_global", "expert_local_to_global",
                            "e_score_correction_bias"})
#: Sleep level -> whether the weights survive it (offloaded and restored at ``wake_up``).
SLEEP_OFFLOADS_WEIGHTS = {1: True, 2: False}
