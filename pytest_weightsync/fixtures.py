"""Fixtures users see that belong to no single sub-plugin."""
