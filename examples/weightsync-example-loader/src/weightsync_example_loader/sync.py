"""The example package's implementation under test: one object, both sides of the sync.

``ExampleSync`` is what a team ships: the receiver-side loader (:mod:`.loader`) and the
trainer-side distributed exporter (:mod:`.exporter`) under one name, so
``pytest -p weightsync --pyargs pytest_weightsync.suites --weightsync-only example`` judges
both. Its broken twins are registered on their own: ``example-swapped`` (a loader that swaps
the gate/up halves of ``w13``) and ``example-unregrouped`` (an exporter that forgets to
regroup ``linear_fc1`` after the ETP gather).
"""

from __future__ import annotations

from pytest_weightsync.protocols import Capabilities

from weightsync_example_loader.exporter import ExampleDistributedExporter
from weightsync_example_loader.loader import ExampleLoader


class ExampleSync(ExampleLoader, ExampleDistributedExporter):
    """Loads and exports compat, packed and direct payloads for unpadded receivers."""

    name = "example"
    capabilities = Capabilities(formats={"compat", "packed", "direct"},
                                orders={"gate_up", "up_gate"}, padded=False)
