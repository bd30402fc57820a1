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
from collections.abc import Iterator, Sequence
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


@dataclass(frozen=True)
class _Plan:
    """The ids (T,) of a text and the windows (`windows`) that score them."""

    ids: torch.Tensor
    window: int
    stride: int
    spans: list[tuple[int, int, int]]

    @classmethod
    def of(cls, tokens: Sequence[int] | torch.Tensor, window: int | None, stride: int | None) -> _Plan:
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        count = ids.numel()
        if count < 2:
            raise ValueError(f"perplexity needs at least 2 tokens, got {count}")
        window = min(window or count, count)
        stride = min(stride or window // 2, window - 1)
        return cls(ids, window, stride, windows(count, window, stride))


class _Scorer:
    """One model's side of an evaluation: its cache, its summed negative log-likelihood and its seconds."""

    def __init__(self, model: nn.Module, window: int) -> None:
        self.model, self.total, self.seconds = model, 0.0, 0.0
        self.device = model.model.norm.weight.device
        self.cache = StaticKVCache(
            model.config,
            batch_size=1,
            max_seq_len=window,
            device=self.device,
            dtype=model.model.norm.weight.dtype,
            prompts_from_start=True,
        )

    def chunks(self, plan: _Plan, progress: bool = False) -> Iterator[torch.Tensor]:
        """The logits (rows, V) float32 of every scored position in order, a window's forward at a time; the
        seconds counted are the model's, not the caller's between chunks."""
        model, ids = self.model, plan.ids.to(self.device)
        bar = tqdm(plan.spans, desc="scoring", unit="window", disable=not progress, leave=False)
        for begin, end, first in bar:
            start = time.perf_counter()
            x = ids[begin:end][None]
            hidden = model(x, torch.arange(end - begin, device=self.device)[None], self.cache)[0]  # (T, E)
            # The targets first .. end-1, each predicted by the position before it (window-relative).
            for row in range(first - 1 - begin, end - 1 - begin, LOGIT_ROWS):
                rows = slice(row, min(row + LOGIT_ROWS, end - 1 - begin))
                logits = model.compute_logits(hidden[None, rows])[0]
                targets = ids[begin + rows.start + 1 : begin + rows.stop + 1]
                self.total += float(F.cross_entropy(logits, targets, reduction="sum").double())
                self.seconds += time.perf_counter() - start
                yield logits
                start = time.perf_counter()

    def result(self, plan: _Plan) -> Perplexity:
        count = plan.ids.numel()
        nll = self.total / (count - 1)
        spans = len(plan.spans)
        return Perplexity(math.exp(nll), nll, count, count - 1, spans, plan.window, plan.stride, self.seconds)


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
    plan = _Plan.of(tokens, window, stride)
    scorer = _Scorer(model, plan.window)
    with torch.inference_mode():
        for _ in scorer.chunks(plan, progress):
            pass
    return scorer.result(plan)


@dataclass(frozen=True)
class Divergence:
    """How far a model's next-token distributions are from a reference's, over the scored positions."""

    kl_divergence: float  # mean KL(reference || model), nats a token
    kl_divergence_p99: float  # its 99th percentile over positions
    top_agreement: float  # the share of positions where both models' most likely token is the same

    def to_dict(self) -> dict:
        return asdict(self)


def compare(
    model: nn.Module,
    reference: nn.Module,
    tokens: Sequence[int] | torch.Tensor,
    *,
    window: int | None = None,
    stride: int | None = None,
    progress: bool = False,
) -> tuple[Perplexity, Perplexity, Divergence]:
    """`model`'s and `reference`'s perplexities of `tokens` over the same windows, and the divergence of
    `model`'s predictions from `reference`'s at each scored position (llama.cpp's measure of a quantization:
    perplexities of a short text move by a percent either way on noise alone, the divergence does not)."""
    plan = _Plan.of(tokens, window, stride)
    ours, theirs = _Scorer(model, plan.window), _Scorer(reference, plan.window)
    kl, same = [], 0
    with torch.inference_mode():
        for logits, ref in zip(ours.chunks(plan, progress), theirs.chunks(plan), strict=True):
            log_p, log_q = F.log_softmax(ref, -1), F.log_softmax(logits.to(ref.device), -1)
            kl.append((log_p.exp() * (log_p - log_q)).sum(-1).double().cpu())
            same += int((logits.argmax(-1).to(ref.device) == ref.argmax(-1)).sum())
    kl = torch.cat(kl)
    divergence = Divergence(float(kl.mean()), float(kl.quantile(0.99)), same / kl.numel())
    return ours.result(plan), theirs.result(plan), divergence
