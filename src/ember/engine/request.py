"""A request inside the engine, and the update the engine sends back about it after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ember.engine.output import TextAssembler
from ember.engine.sampler import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestUpdate:
    """What one engine step produced for one request: new tokens, the text they made final, maybe the end."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    logprobs: list[dict[int, float]] | None = None  # per new token: token id -> log-probability
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context
    assembler: TextAssembler
    generator: torch.Generator
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks computed so far
    hash_seed: int = 0  # set with them (`Scheduler._match_prefix`)
    num_computed: int = 0  # tokens whose k/v are in the cache
    cached_tokens: int = 0
    # Penalty state, (V,) on the device; None when the request uses no penalty.
    seen: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def uses_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
