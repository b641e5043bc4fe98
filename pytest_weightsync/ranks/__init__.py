"""The multi-rank launcher (placeholder)."""
