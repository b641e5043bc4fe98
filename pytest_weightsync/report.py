"""Conformance matrix report (placeholder, filled by the conformance work)."""
