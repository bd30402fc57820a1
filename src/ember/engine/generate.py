"""Single-stream generation on a static KV cache: prefill the prompt, then one-token decode steps.

`Generator.generate` yields one `TokenStep` per generated token and knows nothing of text; stop strings and
detokenization live in `ember.engine.output`. The decode step has static shapes (B=1, T=1, a fixed cache), so
`compile=True` hands it to torch.compile once and keeps the compiled callable on this object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ember.engine.kv_cache import StaticKVCache
from ember.engine.sampler import SamplingParams, SamplingTensors, apply_penalties, make_generator, sample
from ember.errors import ContextLengthError
from ember.models.decoder import Decoder

log = logging.getLogger(__name__)

CACHE_ROUNDING = 256  # cache lengths are rounded up so that similar requests reuse one cache (and one graph)


@dataclass
class TokenStep:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" (EOS or stop token) or "length"; None while generating


@dataclass
class Timings:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0  # from the call to the first sampled token
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0


def check_fits(prompt_tokens: int, max_tokens: int | None, context: int) -> int:
    """Returns how many tokens may be generated; raises ContextLengthError naming the counts when none fit."""
    if prompt_tokens == 0:
        raise ContextLengthError("the prompt is empty; at least one token is needed")
    if prompt_tokens >= context:
        raise ContextLengthError(f"prompt has {prompt_tokens} tokens but the context holds {context}")
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise ContextLengthError(
            f"prompt has {prompt_tokens} tokens and max_tokens={max_tokens}, "
            f"but the context holds {context} ({context - prompt_tokens} tokens left)"
        )
    return max_tokens


class Generator:
    def __init__(self, model: Decoder, *, device: torch.device, context: int, compile: bool = False) -> None:
        self.model = model
        self.device = device
        self.context = context
        self.dtype = model.model.embed_tokens.weight.dtype
        self.cache: StaticKVCache | None = None
        self._step = self._forward
        if compile:
            self._step = torch.compile(self._forward, fullgraph=True, dynamic=False)
        self.timings = Timings()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        hidden = self.model(tokens, positions, cache)
        return self.model.compute_logits(hidden[:, -1])  # (B, V)

    def _cache_for(self, length: int) -> StaticKVCache:
        size = min(self.context, -(-length // CACHE_ROUNDING) * CACHE_ROUNDING)
        if self.cache is None or self.cache.max_seq_len < size:
            self.cache = StaticKVCache(
                self.model.config, batch_size=1, max_seq_len=size, device=self.device, dtype=self.dtype
            )
        return self.cache

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...], generator: torch.Generator | None
    ) -> Iterator[TokenStep]:
        budget = check_fits(len(prompt), params.max_tokens, self.context)
        cache = self._cache_for(len(prompt) + budget)
        V = self.model.config.vocab_size
        st = SamplingTensors.build([params], V, self.device)
        gen = generator if generator is not None else make_generator(params.seed, self.device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        seen = torch.zeros(1, V, dtype=torch.bool, device=self.device)
        seen[0, torch.tensor(prompt, device=self.device).clamp(0, V - 1)] = True
        counts = torch.zeros(1, V, dtype=torch.int32, device=self.device)
        timings = self.timings = Timings(prompt_tokens=len(prompt))

        start = time.perf_counter()
        tokens = torch.tensor([prompt], device=self.device)  # (1, T)
        positions = torch.arange(len(prompt), device=self.device)[None]  # (1, T)
        # Prefill runs eagerly: its shape changes with every prompt.
        logits = self._forward(tokens, positions, cache)
        pos = len(prompt)
        for i in range(budget):
            processed = apply_penalties(logits, st, seen, counts)
            token = sample(processed, st, [gen])
            token_id = int(token)  # the one host sync per step: the caller needs the token to stream it
            now = time.perf_counter()
            if i == 0:
                timings.prefill_s = timings.first_token_s = now - start
                decode_start = now
            step = TokenStep(token_id)
            if params.logprobs is not None:
                logp = torch.log_softmax(logits[0], dim=-1)
                step.logprob = float(logp[token_id])
                if params.logprobs:
                    top = logp.topk(params.logprobs)
                    step.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            timings.generated_tokens = i + 1
            if token_id in stops:
                step.finish_reason = "stop"
            elif i == budget - 1:
                step.finish_reason = "length"
            timings.decode_s = now - decode_start
            yield step
            if step.finish_reason:
                return
            seen[0, token_id] = True
            counts[0, token_id] += 1
            logits = self._step(token.view(1, 1), torch.tensor([[pos]], device=self.device), cache)
            pos += 1
