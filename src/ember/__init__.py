"""Ember: a PyTorch-native engine that runs open large language models everywhere PyTorch runs."""

from ember.engine.sampler import SamplingParams
from ember.errors import EmberError
from ember.llm import LLM, CompletionOutput, RequestOutput, StreamChunk

__all__ = ["LLM", "CompletionOutput", "EmberError", "RequestOutput", "SamplingParams", "StreamChunk"]
__version__ = "0.1.0"
