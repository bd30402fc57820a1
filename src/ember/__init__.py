"""Ember: a PyTorch-native engine that runs open large language models everywhere PyTorch runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.engine.sampler import SamplingParams
    from ember.errors import EmberError
    from ember.llm import LLM, CompletionOutput, RequestOutput, StreamChunk

__all__ = ["LLM", "CompletionOutput", "EmberError", "RequestOutput", "SamplingParams", "StreamChunk"]
__version__ = "0.1.0"

# Imported on first use (`ember.LLM`): `import ember.cli.main`, the command's first step, stays free of torch,
# so that everything slow happens inside the command, where Ctrl-C is handled.
_HOMES = {
    "LLM": "ember.llm",
    "CompletionOutput": "ember.llm",
    "RequestOutput": "ember.llm",
    "StreamChunk": "ember.llm",
    "SamplingParams": "ember.engine.sampler",
    "EmberError": "ember.errors",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
