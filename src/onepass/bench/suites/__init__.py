"""Benchmark suites: one module per op family, each exposing ``cases() -> list[Case]``."""
