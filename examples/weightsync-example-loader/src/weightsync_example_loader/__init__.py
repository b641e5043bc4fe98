"""Example third-party MoE expert loaders, distributed exporters and a LoRA adapter loader for
pytest-weightsync's conformance suites."""

from weightsync_example_loader.adapter import ExampleAdapterLoader
from weightsync_example_loader.exporter import ExampleDistributedExporter, UnregroupedFc1Exporter
from weightsync_example_loader.loader import ExampleLoader, SwappedGateUpLoader
from weightsync_example_loader.model_exporter import ExampleModelExporter
from weightsync_example_loader.sync import ExampleSync

__all__ = ["ExampleAdapterLoader", "ExampleDistributedExporter", "ExampleLoader",
           "ExampleModelExporter", "ExampleSync", "SwappedGateUpLoader", "UnregroupedFc1Exporter"]
