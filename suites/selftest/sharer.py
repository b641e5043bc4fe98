"""For self-tests that serialize CPU tensors themselves and do not fetch every one.

A CPU tensor pickled by ``ForkingPickler`` (file-descriptor sharing) stays registered with this
process's ``multiprocessing.resource_sharer`` until a receiver fetches it. A test that is the
sender AND refuses or skips some entries stops the sharer afterwards, dropping what it
registered. The harness itself never does this (the sharer is process-wide, and code under test
may still be serving from it): it reads every entry it receives exactly once instead
(``pytest_weightsync.distributed``).
"""

from __future__ import annotations


def drop_unfetched_shares() -> None:
    """Stop this process's resource sharer, closing every descriptor nobody fetched (it starts
    again at the next registration)."""
    from multiprocessing import resource_sharer

    resource_sharer.stop(timeout=5)
