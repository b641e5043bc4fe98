"""Dispatch of ``ranks``-marked tests to rank processes (placeholder)."""
