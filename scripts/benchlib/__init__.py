"""Helpers for scripts/bench.py: the C load tool, parsers, profile summaries."""
