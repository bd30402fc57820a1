"""Perplexity of a model on a text: what `ember eval` reports, and how a quantization's cost is measured.

    result = perplexity(model, tokens, window=2048, stride=1024)
    result.perplexity, result.scored

A text longer than the window is scored in overlapping windows, as fixed-length models are in the field
(Hugging Face's guide to perplexity, lm-eval's rolling windows): each window of at most `window` tokens starts
`stride` tokens (fewer than `window`) after the one before and scores only the tokens past that one's end, so
every token but the first is scored exactly once, with at least `window - stride` tokens before it (all that
precede it, in the first window). Each window is one forward of a prompt from position 0, so it runs the model's prefill path,
the one a quantization or a GGUF file's kept codes change. Logits come a slice of positions at a time: a
262k-token vocabulary over a long window never holds a (T, V) float32 tensor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ember.engine.kv_cache import StaticKVCache

# Positions whose logits are computed at once (float32 (rows, V): 256 MB at Gemma 3's 262144 tokens).
LOGIT_ROWS = 256


@dataclass(frozen=True)
class Perplexity:
    perplexity: float  # exp(nll)
    nll: float  # mean negative log-likelihood of the scored tokens, nats a token
    tokens: int  # tokens in the text
    scored: int  # tokens scored: all but the first
    windows: int  # forwards run
    window: int  # the most tokens a forward sees
    stride: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def windows(count: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window over `count` tokens: tokens[begin:end] is run and the targets
    first .. end-1 are scored (each predicted by the position before it)."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(
            f"window {window} and stride {stride}: expected window >= 2 and 1 <= stride < window"
        )
    spans, begin, scored_to = [], 0, 1
    while True:
        end = min(begin + window, count)
        spans.append((begin, end, scored_to))
        if end == count:
            return spans
        scored_to, begin = end, begin + stride


def perplexity(
    model: nn.Module,
    tokens: Sequence[int] | torch.Tensor,
    *,
    window: int | None = None,
    stride: int | None = None,
    progress: bool = False,
) -> Perplexity:
    """The perplexity of `tokens` (ids, at least 2) under `model` (an Ember Decoder), windows of `window` tokens
    (default: all of them in one) `stride` apart (default: half a window); `progress`: a bar of windows on
    stderr."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    count = ids.numel()
    if count < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {count}")
    window = min(window or count, count)
    stride = min(stride or window // 2, window - 1)
    device = model.model.norm.weight.device
    ids = ids.to(device)
    spans = windows(count, window, stride)
    cache = StaticKVCache(
        model.config,
        batch_size=1,
        max_seq_len=window,
        device=device,
        dtype=model.model.norm.weight.dtype,
        prompts_from_start=True,
    )
    total = 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        for begin, end, first in tqdm(
            spans, desc="scoring", unit="window", disable=not progress, leave=False
        ):
            x = ids[begin:end][None]
            hidden = model(x, torch.arange(end - begin, device=device)[None], cache)[0]  # (T, E)
            # The targets first .. end-1, each predicted by the position before it (window-relative).
            for row in range(first - 1 - begin, end - 1 - begin, LOGIT_ROWS):
                rows = slice(row, min(row + LOGIT_ROWS, end - 1 - begin))
                logits = model.compute_logits(hidden[None, rows])[0]  # (rows, V) float32
                targets = ids[begin + rows.start + 1 : begin + rows.stop + 1]
                total += float(F.cross_entropy(logits, targets, reduction="sum").double())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    nll = total / (count - 1)
    return Perplexity(
        perplexity=math.exp(nll),
        nll=nll,
        tokens=count,
        scored=count - 1,
        windows=len(spans),
        window=window,
        stride=stride,
        seconds=time.perf_counter() - start,
    )
