"""Serving, engine-building, deployment and device tools; importable as ``ssd_tools``."""
