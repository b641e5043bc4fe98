"""The harness's caches of inputs and expected states, accounted to the harness.

Every test of a topology reuses the same synthesized weights, trainer shards and expected
receiver states, so they are computed once and kept (``functools.lru_cache``). What a cache
newly holds after a call is reported to the plugin's memory check
(``pytest_weightsync.process_hygiene.harness_keeps``): the first test of a realistic topology
fills hundreds of MiB that every later test reuses, and that growth is the harness's, not the
implementation's under test.
"""

from __future__ import annotations

import dataclasses
import functools

from pytest_weightsync.process_hygiene import harness_keeps


def tensor_bytes(value) -> int:
    """Bytes of the distinct CPU tensor storages reachable from ``value`` (dicts, lists,
    tuples, named tuples and dataclasses walked): what the cache adds to the resident set the
    memory check measures (a GPU run's cached inputs live on the device, not in it)."""
    import torch

    seen: set = set()
    total = 0
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            if item.device.type != "cpu":
                continue
            storage = item.untyped_storage()
            key = (storage.data_ptr(), item.device.type)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            todo.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    return total


def memo(maxsize: int):
    """``functools.lru_cache(maxsize)`` whose newly cached values are reported to the memory
    check; ``cache_clear`` and ``cache_info`` as lru_cache's."""

    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            misses = cached.cache_info().misses
            value = cached(*args, **kwargs)
            if cached.cache_info().misses != misses:
                harness_keeps(tensor_bytes(value))
            return value

        call.cache_clear = cached.cache_clear
        call.cache_info = cached.cache_info
        return call

    return wrap
