"""Megatron-Bridge's weight mappings (``param_mapping``), importable without the rest of Bridge.

Megatron-Bridge converts Megatron-Core weights to Hugging Face checkpoints with one mapping
class per fused layout (``GatedMLPMapping`` for ``fc1 = [gate; up]``, ``QKVMapping`` for the
per-query-group interleaved ``linear_qkv``, ``GDNLinearMapping`` / ``GDNConv1dMapping`` for
Gated DeltaNet, ``AutoMapping`` for column/row-parallel and expert tensors). Those classes are
what the suites compare the reference's gathers with: third-party code, run for real, in gloo
ranks with Megatron-Core's own ``parallel_state`` groups.

Why the import is not ``import megatron.bridge``: the package ``__init__`` chain imports
``AutoBridge`` (and with it the model providers, ``transformers`` model classes and ``peft``,
which needs Transformer Engine), so on a CPU machine it fails before any mapping is defined.
The mapping module itself needs only torch, megatron-core, ``rich`` and ``transformers``'
config base class. :func:`register_namespace_packages` therefore registers
``megatron.bridge``, ``megatron.bridge.models`` and ``megatron.bridge.models.conversion`` in
``sys.modules`` as plain namespace modules whose ``__path__`` is the real directory, so that
importing ``megatron.bridge.models.conversion.param_mapping`` loads the real file and its
real sibling ``conversion.utils`` without executing any package ``__init__``.

Side effect, by design limited to the process that asks for it: after registration
``megatron.bridge`` is that namespace module, so ``from megatron.bridge import AutoBridge``
fails in that process. Where the full package does import (a GPU machine with Transformer
Engine), :func:`register_namespace_packages` leaves an already imported ``megatron.bridge``
alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

#: The module the suites use, and the one :func:`~pytest_weightsync.reference_impl.backends.probe`
#: imports for the ``megatron_bridge`` backend.
PARAM_MAPPING_MODULE = "megatron.bridge.models.conversion.param_mapping"

#: Packages whose ``__init__`` must not run, relative to the ``megatron.bridge`` directory.
_NAMESPACE_PACKAGES = (
    ("megatron.bridge", ()),
    ("megatron.bridge.models", ("models",)),
    ("megatron.bridge.models.conversion", ("models", "conversion")),
)


class BridgeNotInstalledError(ImportError):
    """megatron-bridge is not installed (no ``megatron/bridge`` directory next to megatron-core)."""


def installed_directory() -> str:
    """The installed ``megatron/bridge`` directory, found without executing its ``__init__``.

    Uses the import system's own lookup (``importlib.util.find_spec``), so an environment that
    hides the package (a blocking finder, or ``sys.modules["megatron.bridge"] = None``) reads as
    "not installed". Raises :class:`BridgeNotInstalledError` (an ImportError) then.
    """
    try:
        spec = importlib.util.find_spec("megatron.bridge")
    except (ImportError, ValueError) as exc:
        raise BridgeNotInstalledError(f"No module named 'megatron.bridge' ({exc})") from exc
    for base in (spec.submodule_search_locations or ()) if spec is not None else ():
        if os.path.isfile(os.path.join(base, "models", "conversion", "param_mapping.py")):
            return base
    raise BridgeNotInstalledError(
        "No module named 'megatron.bridge' (megatron-bridge is not installed: no "
        "megatron/bridge/models/conversion/param_mapping.py on megatron's path)"
    )


def register_namespace_packages() -> None:
    """Make ``megatron.bridge.models.conversion.*`` importable without running any package ``__init__``.

    Idempotent. Raises :class:`BridgeNotInstalledError` (an ImportError) when megatron-bridge
    is not installed, and leaves ``sys.modules`` untouched then.
    """
    root = None
    for name, parts in _NAMESPACE_PACKAGES:
        if name in sys.modules and sys.modules[name] is not None:
            continue
        if sys.modules.get(name, ...) is None:
            # An environment that hides the package (sys.modules[name] = None) means "absent".
            raise BridgeNotInstalledError(f"No module named {name!r} (import of it is blocked)")
        root = root or installed_directory()
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *parts)]
        module.__file__ = None
        module.__package__ = name
        module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        module.__spec__.submodule_search_locations = module.__path__
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)


def param_mapping():
    """Megatron-Bridge's real ``param_mapping`` module (imports it on first call)."""
    register_namespace_packages()
    return importlib.import_module(PARAM_MAPPING_MODULE)


__all__ = ["BridgeNotInstalledError", "PARAM_MAPPING_MODULE", "installed_directory", "param_mapping", "register_namespace_packages"]
