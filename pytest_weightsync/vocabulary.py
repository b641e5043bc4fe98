"""The words every part of pytest-weightsync shares, defined once.

Wire formats, receiver orders, trainer expert modules, deliveries, roles, conformance
properties, verdict words: the protocols, the registry, the reference implementation, the
suites and the reports all import them from here, so a new value reaches every one of them
(and a typo anywhere is a ``KeyError`` / ``NameError`` instead of a silently empty loop).
Nothing here imports torch: the plugin reads it at collection time.
"""

from __future__ import annotations

__all__ = [
    "BUCKET_LIMIT", "BUCKET_LIMITS", "BUCKET_OVER", "BUCKET_WITHIN", "CONFORMANCE_MODULES",
    "DELIVERIES", "ENGINE_LAYOUTS", "EXPERT_IMPLS", "EXPERT_MODULES", "EXPERT_PLACEMENTS",
    "FAIL", "FORMATS", "FORMAT_PARAMS", "HARDENING", "INTERRUPTED", "LAYER_SPECS", "LIFECYCLE",
    "LOADER_TRANSPORTS", "LOAD_FORMAT", "LOAD_FORMATS", "LORA_LAYOUTS", "MODEL_FAMILIES",
    "MODEL_FORMATS", "MODEL_PARTS", "NOT_RUN", "ORDERS", "OUTCOME_WAIVED", "PAD_MODES",
    "PARTIAL", "PASS", "PAUSE_MODES", "PROPERTIES", "QUANTIZERS", "RANKS_COVERED",
    "RECEIVER_AXES", "REPORT_PROPERTIES", "ROLES", "SERVING_DIALECTS", "SKIP_NOT_APPLICABLE",
    "SKIP_NOT_RUN", "SKIP_NO_DEVICE", "SKIP_OUTSIDE", "SKIP_UNCLAIMED", "SPEED", "TARGETS",
    "TRAINER_AXES", "TRANSPORTS", "VERDICTS", "WAIVED", "WEIGHT_QUANTS",
]

#: Payload (wire) formats, fastest first (the order path selection falls back along):
#:
#: ``direct``   each receiver rank's own parameter names and exact shapes (SGLang
#:              ``update_weights_from_tensor(load_format="direct")``);
#: ``packed``   unsharded ``experts.w13_weight`` / ``experts.w2_weight`` of every expert in the
#:              receiver's gate/up order: needs an engine-side loader (stock SGLang 0.5.23 has
#:              no code path for these names);
#: ``hf_fused`` the fused-experts checkpoint format SGLang's model ``load_weights`` accepts:
#:              ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first, always) and
#:              ``experts.down_proj`` ``[E, H, I]``;
#: ``compat``   per-expert Hugging Face names ``experts.{e}.{gate,up,down}_proj.weight``.
FORMATS = ("direct", "packed", "hf_fused", "compat")
#: Test parameters whose value names the payload format / sync path / capability taken away.
FORMAT_PARAMS = ("payload_format", "path", "fmt", "restriction")
#: SGLang's ``load_format`` each wire format is loaded with (``None``: the model's own
#: ``load_weights``; ``"direct"``: ``default_weight_loader`` per parameter name).
LOAD_FORMAT = {"direct": "direct", "packed": None, "hf_fused": None, "compat": None}
#: The ``load_format`` values the reference receiver accepts.
LOAD_FORMATS = (None, "direct")
#: Receiver orders of the two halves of ``w13_weight``: ``gate_up`` is SGLang's default,
#: ``up_gate`` what runners with ``load_up_proj_weight_first`` (flashinfer_cutlass) store.
ORDERS = ("gate_up", "up_gate")
#: How a receiver with padded buffers slices the intermediate dimension: ``even`` (SGLang's
#: default loader) or ``blocked`` (its padded loader).
PAD_MODES = ("even", "blocked")
#: What the engine holds in ``w13_weight`` / ``w2_weight`` between updates (SGLang 0.5.23's
#: MoE runners; docs/layout.md gives each one's source):
#:
#: ``checkpoint``    the layout the loader writes, kept as is (triton, flashinfer_cutlass);
#: ``trtllm_block``  FlashInfer TRT-LLM BF16: after loading, rows of each expert permuted
#:                   (gate/up interleaved, then shuffled in blocks of 32) and split into
#:                   128-byte column blocks (``process_weights_after_loading``), restored to
#:                   the checkpoint layout before the next update
#:                   (``restore_weights_before_loading``);
#: ``transposed``    triton_kernels: both parameters allocated transposed
#:                   (``w13 [E, H, 2I]``, ``w2 [E, I, H]``), each loaded tensor transposed.
ENGINE_LAYOUTS = ("checkpoint", "trtllm_block", "transposed")
#: Quantization of the receiver's expert weights: ``none`` (the model dtype) or ``fp8_block``
#: (SGLang ``Fp8MoEMethod`` with ``weight_block_size``: float8_e4m3fn weights and one float32
#: ``weight_scale_inv`` per block).
WEIGHT_QUANTS = ("none", "fp8_block")
#: How an engine spreads the routed experts over its MoE-EP ranks (``ReceiverTopology.
#: expert_placement``): ``even`` (SGLang: ``num_experts % ep == 0``, rank e holds the block
#: ``[e * E/ep, (e+1) * E/ep)``) or ``linear_uneven`` (vLLM's ``determine_expert_map``, linear:
#: any ``num_experts``, the first ``E % ep`` ranks hold one expert more).
EXPERT_PLACEMENTS = ("even", "linear_uneven")
#: Who quantizes the weights of a quantized receiver: the ``sender`` (float8_e4m3fn weights
#: and their float32 ``weight_scale_inv`` on the wire, as FP8 checkpoints and FP8 refits send)
#: or the ``loader`` (model-dtype weights on the wire, quantized while loading).
QUANTIZERS = ("sender", "loader")
#: Megatron-Core expert modules a trainer can hold its experts in (parameter spellings):
#: ``sequential`` = ``SequentialMLP`` (``experts.local_experts.{i}.linear_fc1.weight``),
#: ``te_grouped`` = ``TEGroupedMLP`` (``experts.linear_fc1.weight{i}``).
EXPERT_IMPLS = ("sequential", "te_grouped")
#: Megatron-Core class name of each expert module.
EXPERT_MODULES = {"sequential": "SequentialMLP", "te_grouped": "TEGroupedMLP"}
#: Megatron-Core layer specs a whole-model trainer is built from (parameter spellings):
#: ``te`` = ``get_gpt_layer_with_transformer_engine_spec`` (input norms fused:
#: ``self_attention.linear_qkv.layer_norm_weight``), what real jobs build; ``local`` =
#: ``get_gpt_layer_local_spec`` (``input_layernorm.weight``).
LAYER_SPECS = ("te", "local")
#: Trainer parallel sizes an exporter can bound (``TrainerTopology`` fields).
TRAINER_AXES = ("tp", "ep", "etp", "pp")
#: Receiver parallel sizes a loader can bound (``ReceiverTopology`` properties).
RECEIVER_AXES = ("moe_tp", "moe_ep", "moe_dp")
#: How a distributed exporter hands its streams over: ``colocated`` (every trainer rank
#: returns the stream of the engine rank colocated with it) or ``distributed`` (trainer rank
#: 0 returns every engine rank's stream).
DELIVERIES = ("colocated", "distributed")
#: How one bucket travels (``pytest_weightsync.wire``, ``docs/transports.md``): ``tensors``
#: (``(name, tensor)`` pairs), ``flattened_bucket`` (one uint8 tensor plus SGLang's
#: ``FlattenedTensorMetadata``), ``serialized`` (``update_weights_from_tensor``'s
#: ``serialized_named_tensors``, one entry per engine TP rank) and ``broadcast`` (names,
#: dtypes and shapes, then a broadcast from the sender: ``pytest_weightsync.transports.broadcast``) and
#: ``weight_transfer`` (vLLM's protocol: init, start, ``update_weights`` calls carrying IPC
#: handles or announcing NCCL broadcasts, finish: ``pytest_weightsync.transports.weight_transfer``).
TRANSPORTS = ("tensors", "flattened_bucket", "serialized", "broadcast", "weight_transfer")
#: The transports a loader's ``load_weights`` can be handed (the engine's TP worker decodes
#: the others before its loader runs); ``Capabilities.transports`` of a loader.
LOADER_TRANSPORTS = ("tensors", "flattened_bucket")
#: The roles an implementation can play, by the method that provides each.
ROLES = {"loader": "load_weights", "exporter": "export_weights",
         "distributed_exporter": "export_weights_distributed",
         "serving_engine": "open_serving_engine", "orchestrator": "refit_engine",
         "adapter_loader": "load_adapter", "adapter_exporter": "export_adapter",
         "adapter_merger": "merge_adapter"}
#: How an engine holds LoRA adapters (``Capabilities.lora``; ``docs/lora.md``): ``sglang`` -
#: SGLang 0.5.23's memory pool, per-slot A and B buffers TP-sliced per module kind, the scaling
#: kept apart and applied at run time; ``vllm`` - vLLM 0.33's ``LoRAModel``, ``lora_alpha / r``
#: folded into ``lora_B`` when the adapter is built.
LORA_LAYOUTS = ("sglang", "vllm")
#: The control planes a serving engine speaks and an orchestrator drives
#: (``Capabilities.serving``; ``docs/refit-under-load.md``).
SERVING_DIALECTS = ("sglang", "vllm")
#: The pause modes of each control plane (``pause_generation(mode=...)``: SGLang 0.5.23's
#: ``PauseGenerationReqInput.mode``, vLLM 0.33's ``AsyncLLM.pause_generation``); an engine claims
#: the ones it implements (``Capabilities.pause_modes``), and the ``in_flight`` property runs
#: each claimed one. Held to the pinned sources by ``suites/selftest/test_control_plane_source.py``.
PAUSE_MODES = {"sglang": ("abort", "retract", "in_place"), "vllm": ("abort", "wait", "keep")}
#: Whole-model families the suites hold a refit to (``reference_impl/model/model_spec.py``):
#: ``qwen3_moe`` (attention + routed experts) and ``qwen3_5_moe`` (Gated DeltaNet layers with
#: full attention every k-th layer, a shared expert, an MTP draft).
MODEL_FAMILIES = ("qwen3_moe", "qwen3_5_moe")
#: Parameter groups of a whole model. A whole-model case needs its implementation to claim
#: every group the model has (``Capabilities.model_parts``); an implementation that claims
#: none (the default) is an expert-only one and is not run on whole-model cases.
#:
#: ``experts``          routed experts (``mlp.experts``);
#: ``attention``        GQA attention (``qkv_proj``, ``o_proj``, ``q_norm``/``k_norm``);
#: ``gdn``              Gated DeltaNet (``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``A_log``,
#:                      ``dt_bias``, ``norm``, ``out_proj``);
#: ``router``           the router weight ``mlp.gate.weight`` (bf16);
#: ``router_fp32``      a float32 router weight;
#: ``expert_bias``      the float32 ``mlp.gate.e_score_correction_bias``;
#: ``shared_expert``    ``mlp.shared_expert.{gate_up,down}_proj`` and ``mlp.shared_expert_gate``;
#: ``norms``            layer norms and the final norm;
#: ``embeddings``       ``embed_tokens`` and ``lm_head`` (vocab padded per TP rank);
#: ``tied_embeddings``  ``lm_head`` tied to ``embed_tokens``: one source, both views.
MODEL_PARTS = ("experts", "attention", "gdn", "router", "router_fp32", "expert_bias",
               "shared_expert", "norms", "embeddings", "tied_embeddings")
#: Wire formats the whole-model suites drive: the checkpoint's per-expert and fused-expert
#: names, and every engine parameter direct (``packed`` names only experts, for an engine-side
#: loader, and is covered by the expert suites).
MODEL_FORMATS = ("direct", "hf_fused", "compat")
#: The engine models an update can reach (SGLang's update ``selector``): the served model and
#: its speculative (MTP) draft.
TARGETS = ("target", "draft")
#: What an engine-side loader (one with ``begin_update`` / ``end_update``) may claim of the
#: update lifecycle (``Capabilities.lifecycle``; the default claims none, and a property whose
#: claim is missing is skipped as not claimed):
#:
#: ``sessions``  its hooks keep the update session themselves: a bucket outside a session, a
#:               second ``begin_update``, an ``end_update`` without one and a ``begin_update``
#:               after a failed update are refused with an error or handled as documented,
#:               never corrupting (property ``lifecycle``). Not claimed where a layer above the
#:               loader keeps the session (SGLang's scheduler refuses these before its model
#:               runner sees them);
#: ``atomic``    an update that fails mid-stream leaves the old version bit for bit, or the
#:               engine marked unusable until a full update (``end_update`` refuses to
#:               complete it, or ``weight_version`` says ``None``) - never a silent mix
#:               (property ``atomic_update``);
#: ``version``   it exposes ``weight_version(params, *, spec, topology, rank)``: the version
#:               those parameters hold, which moves exactly once per completed update, or
#:               ``None`` while they hold no complete version (property ``version``);
#: ``sleep``     it exposes ``sleep(params, *, level, spec, topology, rank)`` and
#:               ``wake_up(params, *, spec, topology, rank)``, an engine giving its weights'
#:               memory back between updates (vLLM's sleep levels, SGLang's
#:               ``release_memory_occupation`` / ``resume_memory_occupation``): level 1
#:               offloads the weights and wake_up restores them bit for bit at the same
#:               addresses; level 2 discards them, so no complete version is held after
#:               wake_up and the next update must be complete - an incomplete one is refused
#:               or leaves the engine marked unusable (property ``lifecycle``).
LIFECYCLE = ("sessions", "atomic", "version", "sleep")
#: The run-time record of the ``coverage_by_rank`` property: which engine ranks (and
#: replicas) its check covered, as vLLM's weight checker returns them.
RANKS_COVERED = "ranks_covered"
#: Named bucket limits the suites cut streams at (see ``suites/harness/inputs.py``).
BUCKET_LIMITS = ("tensor", "split_layer", "multi_layer", "whole")

#: Conformance properties, in report order, and the role each one judges. Every one counts
#: in the verdict except :data:`HARDENING`.
PROPERTIES = {
    "bit_exact": "loader",
    "export_bit_exact": "exporter",
    "distributed_export_bit_exact": "distributed_exporter",
    "in_place": "loader",
    "no_stale_values": "loader",
    "fallback_routing": None,  # loaders and exporters
    # whole-model refit (suites/conformance/test_model.py), loaders and exporters:
    "coverage": None,          # every engine parameter written once, from the right source
    "model_bit_exact": None,   # every parameter bit-exact, dtype kept, two versions
    "tied_embeddings": None,   # one source, both views equal
    "targets": None,           # the draft updated when claimed, a frozen draft untouched
    "engine_layout": "loader",
    # the update lifecycle of engine-side loaders (suites/conformance/test_lifecycle.py):
    "identity": "loader",          # N identity syncs change no bit, post-load included
    "atomic_update": "loader",     # a failed update: old bits or marked unusable, never a mix
    "lifecycle": "loader",         # misuse of begin/end refused or handled, never corrupting
    "coverage_by_rank": "loader",  # every engine rank and replica updated, replicas identical
    "version": "loader",           # the version moves once per completed update
    # refit under load (suites/conformance/test_serving.py), serving engines:
    "no_stale_kv": "serving_engine",        # a prefix computed by old weights is never reused silently
    "in_flight": "serving_engine",          # requests in flight end as the pause mode says
    "token_versions": "serving_engine",     # every token labelled with the weights that computed it
    "version_publish": "serving_engine",    # publishing a label ends no request unless asked
    "logprob_agreement": "serving_engine",  # the engine's log-probs are the trainer forward's
    "flush_after_pause": "serving_engine",  # flushing after any pause: accepted or refused, alive
    # ... and RL frameworks' refit sequences (orchestrators):
    "refit_sequence": "orchestrator",       # pause, update, flush, publish, resume keep them all
    # LoRA refit (suites/conformance/test_lora.py), adapter loaders, exporters and mergers:
    "lora_bit_exact": None,                # every A/B in the engine's buffers bit for bit
    "lora_coverage": None,                 # every targeted module gets A and B, nothing else
    "lora_scale_once": "adapter_loader",   # alpha / r applied once, also after evict + rebuild
    "base_untouched": "adapter_loader",    # the base weights bit-identical after adapter syncs
    "lora_versions": "adapter_loader",     # a new version replaces the old in its slot, no mix
    "lora_merged": "adapter_merger",       # the merged path equals the oracle's merge
    "hardening": "loader",
    "speed": "loader",
}
#: The property whose tests record findings (strictness on bad input), never a verdict.
HARDENING = "hardening"
#: The property whose tests record what an update costs (ops, bytes, ratios), never a verdict.
SPEED = "speed"
#: Report-only properties: their failures fail the verdict, nothing else of theirs counts
#: (a skipped GPU speed probe on a CPU machine does not make a verdict PARTIAL).
REPORT_PROPERTIES = (HARDENING, SPEED)
#: The report-only column of distributed exporters' bucket sizes: a bucket may exceed
#: ``bucket_bytes`` by one unit (the tensors converted from one source parameter); each
#: distributed test records :data:`BUCKET_WITHIN` or :data:`BUCKET_OVER`, never a verdict.
BUCKET_LIMIT = "bucket_limit"
BUCKET_WITHIN, BUCKET_OVER = "within", "over"

#: The shipped conformance modules (package ``suites.conformance``, installed as
#: ``pytest_weightsync.suites.conformance``) and the roles whose implementations each one
#: runs. A run that did not collect one of them for an implementation of its role cannot
#: certify that implementation: its verdict is PARTIAL.
CONFORMANCE_MODULES = {
    "test_loader": ("loader",),
    "test_exporter": ("exporter",),
    "test_distributed_exporter": ("distributed_exporter",),
    "test_random": ("loader", "exporter"),
    "test_speed": ("loader",),
    "test_model": ("loader", "exporter"),
    "test_model_distributed": ("distributed_exporter",),
    "test_lifecycle": ("loader",),
    "test_serving": ("serving_engine", "orchestrator"),
    "test_lora": ("adapter_loader", "adapter_exporter", "adapter_merger"),
}

#: Verdict words, best first. PASS: every case the implementation claims was selected and
#: ran to a result, none failed. FAIL: a case failed. PARTIAL: none failed, but some claimed
#: case was not selected (``-k``, ``--lf``, a path narrower than the suites), not collected,
#: or skipped for a reason other than the claims (a missing backend). INTERRUPTED: the run
#: stopped (Ctrl-C, ``-x``, a crashed worker) before every selected case had a result.
#: NOT RUN: no case ran at all (nothing it claims is tested here). WAIVED: as PASS, except
#: that some failures were waived as known, accepted deviations (``--weightsync-waivers``):
#: never PASS, but the run exits 0 for it.
PASS, FAIL, PARTIAL, INTERRUPTED, NOT_RUN = "PASS", "FAIL", "PARTIAL", "INTERRUPTED", "NOT RUN"
WAIVED = "WAIVED"
VERDICTS = (PASS, FAIL, PARTIAL, INTERRUPTED, NOT_RUN, WAIVED)
#: The outcome of a test whose failure a waiver accepted (the report's word for pytest's
#: xfailed report of it).
OUTCOME_WAIVED = "waived"

#: Skip kinds a conformance test reports (``weightsync_skip`` user property). ``unclaimed``
#: and ``not_applicable`` are outside what the implementation claims and do not hold the
#: verdict back; ``no_device`` is listed but does not either; ``not_run`` (anything else,
#: e.g. a missing package) does.
SKIP_UNCLAIMED, SKIP_NOT_APPLICABLE, SKIP_NOT_RUN = "unclaimed", "not_applicable", "not_run"
#: A skip because the machine lacks the GPUs a case needs (the ``gpu`` marker): listed in the
#: verdict as not run here, without making it PARTIAL.
SKIP_NO_DEVICE = "no_device"
#: A skip of a case outside the topologies, trainer layouts, formats or deliveries the
#: implementation declares, of a property it does claim. Like ``unclaimed`` it does not hold
#: the verdict back case by case; but a claimed property whose every case is such a skip never
#: ran, and the verdict names it NOT RUN (``pytest_weightsync.verdict``).
SKIP_OUTSIDE = "outside_topologies"
