"""Locust load tests, the concurrency sweep and the soak; importable as ``ssd_loadtest``."""
