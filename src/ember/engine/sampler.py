"""SamplingParams and the pure sampler: `sample(logits, batch_params, generators) -> tokens`.

Every row of a batch may have its own settings, so the sampler works on per-row tensors (`SamplingTensors`)
and never branches on a row in Python. Sampling draws Exponential(1) noise and takes argmax(p / noise),
which samples from p exactly and needs no host sync on a GPU (no multinomial, no `.item()`); temperature 0
rows take the argmax of the processed logits. Same seed, same noise, same tokens. On a CPU, where a sync
costs nothing, top-k, top-p and min-p look at each row's most likely few hundred tokens when that provably
keeps the same ones (`_filter_candidates`), rather than sorting the whole vocabulary.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from ember.errors import InvalidParameterError, check_count
from ember.ops.argmax import argmax


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; the fields and their meaning follow vLLM's and OpenAI's."""

    max_tokens: int | None = 256  # None: until the context is full
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # Hugging Face's: logits of seen tokens divided (or multiplied) by it
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated text
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities per generated position (0: only the chosen token)
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1

    def __post_init__(self) -> None:
        def bad(name: str, value: object, expected: str) -> InvalidParameterError:
            return InvalidParameterError(f"{name}={value!r} is invalid; expected {expected}")

        def integer(value: object) -> bool:  # numpy's integers count; bools do not
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        def number(name: str, low: float, high: float, expected: str, *, open_low: bool = False) -> None:
            # NaN fails every comparison; bools and strings are refused before comparing.
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise bad(name, value, expected)
            if not (low < value if open_low else low <= value) or not value <= high:
                raise bad(name, value, expected)

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name, kind, expected in (
            ("stop", tuple, "a string, a list of strings or None"),
            ("stop_token_ids", tuple, "a list of token ids or None"),
            ("logit_bias", dict, "a {token id: bias} dict or None"),
        ):
            value = getattr(self, name)
            try:  # a copy: later edits to the caller's list or dict change nothing here
                object.__setattr__(self, name, kind(() if value is None else value))
            except (TypeError, ValueError):
                raise bad(name, value, expected) from None
        check_count("max_tokens", self.max_tokens, optional=True)  # None: up to what the context holds
        number("temperature", 0.0, 100.0, "a number in [0, 100]")
        if not integer(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= -1 (0 or -1 disables it)")
        number("top_p", 0.0, 1.0, "a number in (0, 1]", open_low=True)
        number("min_p", 0.0, 1.0, "a number in [0, 1]")
        number("repetition_penalty", 0.0, 10.0, "a number in (0, 10]", open_low=True)
        number("presence_penalty", -2.0, 2.0, "a number in [-2, 2]")
        number("frequency_penalty", -2.0, 2.0, "a number in [-2, 2]")
        if self.seed is not None and not integer(self.seed):
            raise bad("seed", self.seed, "an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if any(not integer(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "True or False")
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20] or None")
        for token, value in self.logit_bias.items():
            if not integer(token) or token < 0:
                raise bad("logit_bias", self.logit_bias, "{token id: bias} with integer token ids >= 0")
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not -100 <= value <= 100:
                raise bad(f"logit_bias[{token}]", value, "a number in [-100, 100]")
        check_count("n", self.n)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SamplingTensors:
    """The per-row parameters of a batch as tensors, shapes (B,) unless noted."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # int64, V where disabled
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    logit_bias: torch.Tensor | None  # (B, V) added to the logits, or None when no row has one
    # Host-side summaries, so that unused filters cost nothing and need no sync to detect.
    all_greedy: bool = False
    max_top_k: int = 0  # the largest enabled top_k, or V when no row uses top-k
    any_top_p: bool = False
    any_min_p: bool = False

    @classmethod
    def build(
        cls, params: list[SamplingParams], vocab_size: int, device: torch.device | str
    ) -> SamplingTensors:
        def col(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        bias = None
        if any(p.logit_bias for p in params):
            bias = torch.zeros(len(params), vocab_size, device=device)
            for row, p in enumerate(params):
                for token, value in p.logit_bias.items():
                    if not 0 <= int(token) < vocab_size:
                        raise InvalidParameterError(
                            f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})"
                        )
                    bias[row, int(token)] = float(value)
        return cls(
            temperature=col([p.temperature for p in params]),
            top_k=col([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
            top_p=col([p.top_p for p in params]),
            min_p=col([p.min_p for p in params]),
            repetition_penalty=col([p.repetition_penalty for p in params]),
            presence_penalty=col([p.presence_penalty for p in params]),
            frequency_penalty=col([p.frequency_penalty for p in params]),
            logit_bias=bias,
            all_greedy=all(p.temperature == 0 for p in params),
            max_top_k=min(vocab_size, max((p.top_k for p in params if p.top_k > 0), default=vocab_size)),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )


def apply_penalties(
    logits: torch.Tensor, st: SamplingTensors, seen: torch.Tensor, output_counts: torch.Tensor
) -> torch.Tensor:
    """logits (B, V); seen (B, V) bool: token in prompt or output; output_counts (B, V): occurrences in output."""
    rp = st.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rp, logits * rp)
    logits = torch.where(seen, penalised, logits)
    counts = output_counts.to(logits.dtype)
    logits = logits - st.frequency_penalty[:, None] * counts
    logits = logits - st.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    if st.logit_bias is not None:
        logits = logits + st.logit_bias
    return logits


def _top_p_drop(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's tokens (most likely first) top-p drops: those the mass before which already reaches
    p; never the first, and none in rows without top-p (rounding can take a float32 sum to 1 before the last)."""
    drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    return drop


def _min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`logits` less the tokens whose probability is under min_p times the most likely one's."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def _filter(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as masks. logits (B, V); each filter runs only if a row uses it."""
    logits = logits / st.temperature.clamp(min=1e-5)[:, None]
    V = logits.shape[-1]
    if st.max_top_k < V:
        kth = logits.topk(st.max_top_k, dim=-1).values  # (B, kmax), descending
        threshold = kth.gather(-1, (st.top_k.clamp(max=st.max_top_k) - 1)[:, None])  # (B, 1)
        threshold = torch.where(st.top_k[:, None] >= V, float("-inf"), threshold)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if st.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        drop = _top_p_drop(sorted_logits.softmax(dim=-1), st.top_p)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if st.any_min_p:
        logits = _min_p_mask(logits, st.min_p)
    return logits


# How many of a row's most likely tokens `_filter_candidates` tries, smallest first. On a CPU, sorting the whole
# vocabulary for top-p cost more than a decode step (21 ms for Gemma 3's 262k, the step ~10 ms), and the tokens
# the filters keep are almost always among the first few hundred.
CANDIDATES = (256, 2048)


def _filter_candidates(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_filter` on each row's K most likely tokens only: (filtered logits (B, K), their token ids (B, K)), where
    for every row the filters provably drop every other token, else None. The same tokens survive as in
    `_filter`, with the same logits. Checking needs the values on the host (a GPU sorts fast anyway)."""
    logits = logits / st.temperature.clamp(min=1e-5)[:, None]
    V = logits.shape[-1]
    top_k = st.top_k[:, None]
    k_on = top_k < V
    for K in CANDIDATES:
        if K >= V:
            return None
        if K < st.max_top_k < V:  # some row's top-k keeps more than K
            continue
        vals, ids = logits.topk(K, dim=-1)  # descending
        # A token outside the candidates has a logit <= the last candidate's: a filter covers a row where it
        # drops every token at that logit (ties included, whatever order a sort would put them in).
        last = vals[:, -1:]
        kth = vals.gather(-1, top_k.clamp(max=K) - 1)
        masked = vals.masked_fill(k_on & (vals < kth), float("-inf"))
        k_inside = ~k_on | (kth > last)  # what top-k keeps is all among the candidates
        covered = k_on.clone()
        if st.any_top_p:
            # The mass before a token is taken over what top-k kept (then all candidates), else everything.
            total = torch.where(k_on, masked.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True))
            probs = (masked - total).exp()
            above = (probs * (vals > last)).sum(-1, keepdim=True)
            covered |= (st.top_p[:, None] < 1.0) & (above >= st.top_p[:, None])
        if st.any_min_p:
            covered |= (st.min_p[:, None] > 0) & (last < vals[:, :1] + torch.log(st.min_p[:, None]))
        covered = (covered & k_inside) | (st.temperature[:, None] == 0)  # greedy rows take the argmax
        if not bool(covered.all()):
            continue
        if st.any_top_p:
            masked = masked.masked_fill(_top_p_drop(probs, st.top_p), float("-inf"))
        if st.any_min_p:
            masked = _min_p_mask(masked, st.min_p)
        return masked, ids
    return None


def _noise(like: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """Exponential(1) draws, as -log(U) (U uniform in [0, 1): a zero gives infinite noise, never chosen); on a
    CPU 6x faster than `exponential_`."""
    u = torch.empty_like(like)
    if generators is None:
        u.uniform_()
    else:
        for row, gen in enumerate(generators):
            u[row].uniform_(generator=gen)
    return u.log_().neg_()


def sample(
    logits: torch.Tensor, st: SamplingTensors, generators: list[torch.Generator | None] | None = None
) -> torch.Tensor:
    """logits (B, V) float32, already penalised -> next tokens (B,) int64. Pure apart from the generators."""
    greedy_tokens = argmax(logits)
    if st.all_greedy:
        return greedy_tokens
    found = None
    if logits.device.type == "cpu" and (st.max_top_k < logits.shape[-1] or st.any_top_p or st.any_min_p):
        found = _filter_candidates(logits, st)
    if found is not None:
        filtered, ids = found
        probs = filtered.softmax(dim=-1)
        sampled = ids.gather(-1, argmax(probs / _noise(probs, generators))[:, None])[:, 0]
    else:
        probs = _filter(logits, st).softmax(dim=-1)
        sampled = argmax(probs / _noise(probs, generators))
    return torch.where(st.temperature == 0, greedy_tokens, sampled)


def _seed32(seed: int) -> int:
    """A seed for torch's CPU generator, which keeps only the low 32 bits (-1 and 2**63 - 1, or 0 and 2**32, drew
    the same numbers): seeds in [0, 2**32) as they are, any other through a 64-bit mix (splitmix64)."""
    if 0 <= seed < 1 << 32:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % (1 << 64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % (1 << 64)
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % (1 << 64)
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(_seed32(seed) if gen.device.type == "cpu" else seed)
    return gen
