"""Imports every family module so that each registers its architectures."""

from ember.models import llama  # noqa: F401
