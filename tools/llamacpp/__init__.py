"""The llama.cpp peer: its build script, a tiny GGUF writer, its Locust user; ``ssd_tools.llamacpp``."""
