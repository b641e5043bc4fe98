"""Every transport, one module each, and the one registry the harness looks them up in.

A transport is how a bucket travels (:class:`~pytest_weightsync.transports.base.Transport`):

==================  =============================================================
``tensors``         :mod:`.tensors` - ``(name, tensor)`` pairs (the fallback)
``flattened_bucket`` :mod:`.flattened` - one uint8 tensor and SGLang's metadata
``serialized``      :mod:`.serialized` - ``update_weights_from_tensor``, an entry per rank
``broadcast``       :mod:`.broadcast` - SGLang's distributed path, on a channel
``weight_transfer`` :mod:`.weight_transfer` - vLLM's calls, a session at a time
==================  =============================================================

A third party adds one by publishing a :class:`Transport` instance under the entry-point group
:data:`ENTRY_POINT_GROUP` (``name = "package.module:TRANSPORT"``, the entry point's name equal
to the transport's); every suite then decodes an exporter's items on it, since the harness
asks :func:`of` which transport an item travels on and never branches on a name. Nothing
else changes: its module, its docs section and its tests.

Loading is lazy and once per process (the builtin modules import no torch at module level);
:func:`reload` forgets what was loaded (tests that add an entry point).
"""

from __future__ import annotations

from typing import Optional

from pytest_weightsync.transports.base import Transport, TransportRegistryError, WireFormatError

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "Transport", "TransportRegistryError", "WireFormatError",
    "all_transports", "get", "names", "of", "reload",
]

#: The entry-point group third-party transports are published under.
ENTRY_POINT_GROUP = "weightsync.transports"
#: The builtin transports, ``name -> "module:attr"``, in the order items are recognised
#: (``tensors`` last whatever is added: it takes whatever no other transport recognises).
BUILTIN = {
    "flattened_bucket": "pytest_weightsync.transports.flattened:TRANSPORT",
    "serialized": "pytest_weightsync.transports.serialized:TRANSPORT",
    "weight_transfer": "pytest_weightsync.transports.weight_transfer:TRANSPORT",
    "broadcast": "pytest_weightsync.transports.broadcast:TRANSPORT",
    "tensors": "pytest_weightsync.transports.tensors:TRANSPORT",
}
#: The fallback transport's name.
FALLBACK = "tensors"

_loaded: Optional[dict] = None
_REQUIRED = ("recognises", "encode", "decode")


def _load_target(target: str):
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _checked(obj, name: str, source: str) -> Transport:
    """``obj`` if it is a transport named ``name``; else :class:`TransportRegistryError`."""
    missing = [m for m in _REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        raise TransportRegistryError(f"{source}: {obj!r:.80} is no transport: it lacks "
                                     f"{', '.join(missing)} (see pytest_weightsync.transports"
                                     f".base.Transport)")
    if getattr(obj, "name", None) != name:
        raise TransportRegistryError(f"{source}: the transport is named "
                                     f"{getattr(obj, 'name', None)!r}, the entry point {name!r}")
    if not isinstance(getattr(obj, "docs", None), str) or not obj.docs:
        raise TransportRegistryError(f"{source}: transport {name!r} names no docs (a "
                                     f"'docs/<file>.md#<anchor>' where its users read it)")
    return obj


def _entry_points() -> list:
    from importlib.metadata import entry_points

    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def all_transports() -> dict:
    """``{name: transport}``: the builtins, then the entry points' (by name), the fallback
    last - the order :func:`of` asks them in. Loaded once per process."""
    global _loaded
    if _loaded is not None:
        return _loaded
    found = {name: _load_target(target) for name, target in BUILTIN.items()
             if name != FALLBACK}
    for ep in _entry_points():
        source = f"entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r})"
        if ep.name in BUILTIN or ep.name in found:
            raise TransportRegistryError(f"{source}: the name {ep.name!r} is taken (builtin "
                                         f"transports: {', '.join(BUILTIN)})")
        try:
            obj = ep.load()
        except Exception as error:
            raise TransportRegistryError(f"{source}: cannot load: {type(error).__name__}: "
                                         f"{error}") from error
        found[ep.name] = _checked(obj, ep.name, source)
    found[FALLBACK] = _load_target(BUILTIN[FALLBACK])
    _loaded = found
    return found


def names() -> tuple:
    """Every transport's name (builtins and entry points)."""
    return tuple(all_transports())


def get(name: str) -> Transport:
    """The transport called ``name``, or :class:`TransportRegistryError` listing the names."""
    found = all_transports()
    if name not in found:
        raise TransportRegistryError(f"no transport {name!r}; registered: {', '.join(found)} "
                                     f"(add one under the entry-point group "
                                     f"{ENTRY_POINT_GROUP!r})")
    return found[name]


def of(item) -> Transport:
    """The transport ``item`` (one element of an exporter's stream) travels on: the first that
    recognises it, ``tensors`` when none does."""
    for transport in all_transports().values():
        if transport.recognises(item):
            return transport
    raise AssertionError("unreachable: the fallback recognises everything")


def reload() -> None:
    """Forget the loaded transports: the next lookup reads the entry points again."""
    global _loaded
    _loaded = None
