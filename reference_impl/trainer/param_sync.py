"""The trainer between its optimizer step and its next forward: DP shards not yet gathered.

With Megatron's distributed optimizer each data-parallel rank updates only its own shard of
every DDP parameter buffer; the param all-gather that brings the other ranks' fresh shards
into this rank's parameters runs after the step, or - with ``overlap_param_gather=True`` -
lazily, in the forward pre-hooks of the next training forward. A refit taken between the
step and that forward reads this rank's fresh shard beside stale copies of the others, in
every refit path that reads the parameters directly (NVIDIA-NeMo/RL#4086, "synchronize
parameters before inference refit": with a ``DistributedDataParallel`` model and
``overlap_param_gather``, force a synchronous parameter all-gather before the refit reads).

:func:`step_with_deferred_gather` puts a real megatron-core DDP model (built with the
distributed optimizer and ``overlap_param_gather``) in exactly that state, without an
optimizer: the new version is written, then every shard but this rank's own is put back to
what it held, in every bucket of every bucket group (dense and expert). What a correct
exporter does about it is :func:`sync_params_before_refit`, megatron-core's own
``start_param_sync(force_sync=True)``. :func:`relocate` is the other way a trainer leaves
stale copies behind: parameters moved to new storage between refits.
"""

from __future__ import annotations


def _bucket_groups(chunk) -> list:
    return list(getattr(chunk, "bucket_groups", ())) + \
        list(getattr(chunk, "expert_parallel_bucket_groups", ()))


def defers_param_gather(chunk) -> bool:
    """Whether the DDP chunk gathers its parameters lazily (distributed optimizer with
    ``overlap_param_gather``)."""
    ddp = getattr(chunk, "ddp_config", None)
    return bool(ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather)


def step_with_deferred_gather(model, write) -> int:
    """``write()`` the next version into ``model``'s parameters (a list of DDP chunks), then
    leave every DP shard of every parameter buffer but this rank's own as it was before: the
    state right after a distributed-optimizer step whose param all-gather is deferred to the
    next forward (every shard held the previous version whole before it: the forward before
    the step gathered them). Returns how many elements were left stale in this rank."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    sync_params_before_refit(model)  # the training forward before this step gathered them
    held = []
    for chunk in model:
        for group in _bucket_groups(chunk):
            size = group.intra_distributed_optimizer_instance_size
            own = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                held.append((bucket, size, own, bucket.param_data.clone()))
    write()
    stale = 0
    for bucket, size, own, before in held:
        now, then = shard_buffer(bucket.param_data, size), shard_buffer(before, size)
        for index, (shard, old) in enumerate(zip(now, then)):
            if index != own:
                shard.copy_(old)
                stale += shard.numel()
    return stale


def sync_params_before_refit(model) -> None:
    """Complete the deferred param all-gather of every chunk of ``model`` that defers it
    (megatron-core's ``DistributedDataParallel.start_param_sync(force_sync=True)``, what
    NeMo-RL#4086 calls before a refit reads). Collective over each chunk's DP groups; chunks
    that gather eagerly, and models that are not DDP, are left alone."""
    for chunk in model or ():
        if defers_param_gather(chunk):
            chunk.start_param_sync(force_sync=True)


def relocate(state) -> None:
    """Move every tensor of ``state`` (a model's parameters and buffers, by name) to new
    storage holding the same values, the objects kept: what a trainer that offloads and
    reloads its weights, or packs them for inference, does between refits (Megatron-LM#7448:
    the packing relocated the storage a refit kept reading, and generation ran on stale
    weights). The next step then writes the new storage: a reader of the tensors it is given
    sees the new version; a copy or view kept from an earlier call still sees the old."""
    import torch

    with torch.no_grad():
        for tensor in state.values():
            tensor.data = tensor.data.clone()

