"""The reference refit sequence: how an RL framework should update a serving engine.

pause -> update (flush decided before anything is written) -> publish WITH the update ->
resume. With SGLang's control plane it retracts the running requests (their KV is recomputed
under the new weights at resume, so every token after the refit is the new policy's and the
prefix cache can be flushed); with vLLM's it keeps them in place (vLLM has no retract): their
later tokens are computed by the new weights over the old KV and labelled as such, and the
prefix cache they hold is left for the engine to drop when they end. The label is never
published on its own (``update_weight_version``'s default ``abort_all_requests=True`` would end
every request the pause kept, miles#2296) and never before the update completed.
"""

from __future__ import annotations

__all__ = ["PAUSE_MODE", "refit"]

#: The pause each control plane's refit uses.
PAUSE_MODE = {"sglang": "retract", "vllm": "keep"}


def refit(engine, buckets, *, version) -> None:
    """Update ``engine`` (requests in flight) to ``buckets``, labelled ``version``."""
    mode = PAUSE_MODE[engine.dialect]
    if engine.dialect == "vllm":
        engine.pause_generation(mode, clear_cache=False)
    else:
        engine.pause_generation(mode)
    try:
        engine.update_weights(buckets, flush_cache=mode == "retract", weight_version=version)
    finally:
        if engine.dialect == "vllm":
            engine.resume_generation()
        else:
            engine.continue_generation()
