"""Imports every family module so that each registers its architectures."""

from ember.models import gemma, granite, llama, mixtral, olmo, phi3, qwen  # noqa: F401
