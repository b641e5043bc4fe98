"""Throughput measurement and baseline guard (placeholder, filled by the benchmark work)."""
