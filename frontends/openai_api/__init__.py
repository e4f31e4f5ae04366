"""The OpenAI-compatible frontend in front of Triton's gRPC endpoint; importable as ``ssd_openai``."""
