"""Inline-logprob eligibility fixtures (placeholder)."""
