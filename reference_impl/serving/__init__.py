"""A model being served while it is refitted: the reference serving engine and refit sequence.

The engine (:mod:`.engine`: scheduler, prefix cache :mod:`.prefix_cache`, the SGLang and vLLM
control planes) computes with its own parameters, read back by :mod:`.weights_view`, through
the oracle's per-token forward; updates land through the reference's whole-model receiver.
:mod:`.orchestrator` is the refit sequence an RL framework should run on it. The rules it models,
each with its source, are :mod:`pytest_weightsync.reference_impl.backends.control_plane`.
"""

#: Rooms of ``reference_impl`` this one may import (checked by the repository's tests).
MAY_IMPORT = ("errors", "model", "oracle", "engine", "senders", "backends")
