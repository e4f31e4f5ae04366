"""The benchmark runner and its phases; importable as ``ssd_tools.bench``."""
