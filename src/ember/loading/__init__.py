"""Checkpoint loading: safetensors, GGUF, and resolving a model name to files."""
