"""Registry of implementations under test (placeholder, filled by the conformance work)."""
