"""Example third-party MoE expert loaders for pytest-weightsync's conformance suites."""

from weightsync_example_loader.loader import ExampleLoader, SwappedGateUpLoader

__all__ = ["ExampleLoader", "SwappedGateUpLoader"]
