"""The generic decoder and the per-family deltas that configure it."""

from ember.models.decoder import Decoder
from ember.models.registry import config_from_hf, get_family, supported_architectures

__all__ = ["Decoder", "config_from_hf", "get_family", "supported_architectures"]
