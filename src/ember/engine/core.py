"""EngineCore: continuous batching over a paged KV cache, one synchronous `step()` at a time.

    Request -> Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput
            -> EngineCore._update() -> RequestUpdate (one per request that produced something)

`add_request` and `abort` may be called from any thread: they only enqueue, and `step()` (on the engine
thread) applies them first. `ember.LLM.generate` drives the same core synchronously for many prompts.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ember.config import ModelConfig
from ember.engine.block_manager import BlockManager
from ember.engine.cpu_step import EagerCpuStep
from ember.engine.generate import check_prompt_ids
from ember.engine.output import TextAssembler
from ember.engine.paged_cache import PagedBatch, PagedKVCache
from ember.engine.request import Request, RequestUpdate, Status
from ember.engine.sampler import SamplingParams, SamplingTensors, apply_penalties, make_generator, sample
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.errors import (
    ContextLengthError,
    EmberError,
    InvalidParameterError,
    check_count,
    non_finite_logits_message,
)
from ember.loading.checkpoint import LoadedModel
from ember.ops import cpu_ext
from ember.quant.linear import INT8_GEMV_ROWS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: 1 GiB on CPU, 80% of the free memory on a GPU
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_batched_tokens"):
            check_count(name, getattr(self, name))
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise InvalidParameterError(
                f"kv_cache_memory={self.kv_cache_memory!r} is invalid; expected a positive byte count or None"
            )


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_usage: float  # used / total
    num_preemptions: int
    prompt_tokens: int
    generated_tokens: int


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> token
    logprobs: dict[str, dict[int, float]]
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it has no token (NaN logits)


# Up to this many decode rows a step runs the flat CPU step: its projections' row kernels are the ones their
# forwards take for so few rows (int8-dyn's own kernel up to `INT8_GEMV_ROWS`, int4 off the tile unit below
# `cpu_ext.AMX_BF16_ROWS`).
FLAT_ROWS = min(INT8_GEMV_ROWS, cpu_ext.AMX_BF16_ROWS - 1)


class ModelRunner:
    """Turns a SchedulerOutput into one packed forward pass, then samples the requests that need a token."""

    def __init__(self, loaded: LoadedModel, cache: PagedKVCache) -> None:
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.cache = cache
        self.device = loaded.device
        self.vocab_size = loaded.config.vocab_size
        # On a CPU, batches of decode rows run the eager step's layers as one C++ call (`ember.engine.cpu_step`)
        self.flat = EagerCpuStep.build(self.model, cache) if self.device.type == "cpu" else None

    def _batch(self, sched: SchedulerOutput) -> tuple[torch.Tensor, PagedBatch, list[int]]:
        bs = self.cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []
        slots: list[int] = []
        decode_index, decode_tables, decode_lens = [], [], []
        prefills = []
        sample_index = []  # packed index of the last token of each request that samples this step
        for s in sched.scheduled:
            r, start, n = s.request, s.request.num_computed, s.num_tokens
            offset = len(tokens)
            ids = r.all_ids[start : start + n]
            tokens.extend(ids)
            positions.extend(range(start, start + n))
            lengths.extend([r.num_tokens] * n)  # a prompt's chunks: the whole prompt's length
            slots.extend(r.blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_index.append(offset)
                decode_tables.append(r.blocks)
                decode_lens.append(start + 1)
            else:
                table = torch.tensor(r.blocks, device=self.device)
                prefills.append((offset, n, table, start + n))
            if start + n == r.num_tokens:
                sample_index.append(offset + n - 1)
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        dev = self.device
        batch = PagedBatch(
            slot_mapping=torch.tensor(slots, device=dev),
            positions=torch.tensor([positions], device=dev),
            lengths=torch.tensor([lengths], device=dev),
            decode_index=torch.tensor(decode_index, dtype=torch.int64, device=dev),
            decode_tables=torch.tensor(padded, dtype=torch.int64, device=dev).view(len(padded), width),
            decode_lens=torch.tensor(decode_lens, dtype=torch.int64, device=dev),
            prefills=prefills,
        )
        return torch.tensor([tokens], device=dev), batch, sample_index

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        tokens, batch, sample_index = self._batch(sched)
        self.cache.set_batch(batch)
        if self.flat is not None and not batch.prefills and tokens.shape[1] <= FLAT_ROWS:
            hidden = self.flat.paged(tokens, batch, self.cache)[None]  # (1, N, E), the same values
        else:
            hidden = self.model(tokens, batch.positions, self.cache)  # (1, N, E)
        out = RunnerOutput({}, {})
        sampling = [
            s.request
            for s in sched.scheduled
            if s.request.num_computed + s.num_tokens == s.request.num_tokens
        ]
        if not sampling:
            return out
        logits = self.model.compute_logits(hidden[0, sample_index])  # (Bs, V)
        params = [r.params for r in sampling]
        st = SamplingTensors.build(params, self.vocab_size, self.device)
        processed = logits
        if any(r.uses_penalties for r in sampling) or st.logit_bias is not None:
            zeros_b = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            zeros_i = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            seen = torch.stack([r.seen if r.seen is not None else zeros_b for r in sampling])
            counts = torch.stack([r.counts if r.counts is not None else zeros_i for r in sampling])
            processed = apply_penalties(logits, st, seen, counts)
        tokens = sample(processed, st, [r.generator for r in sampling])
        # NaN logits would sample token 0 (float16 overflow). x * 0 is 0 where x is finite and NaN where not, so a
        # row's sum of it is 0 exactly when all of it is finite: one product and a sum, where isfinite().all()
        # took 5x as long on a CPU (80 us a row of 49152).
        finite = (logits * 0).sum(dim=-1) == 0
        chosen, ok = torch.stack((tokens, finite.to(tokens.dtype))).tolist()  # one sync for both
        want_logprobs = [i for i, r in enumerate(sampling) if r.params.logprobs is not None and ok[i]]
        if want_logprobs:
            logp = torch.log_softmax(logits[want_logprobs], dim=-1)
        for row, r in enumerate(sampling):
            if ok[row]:
                out.sampled[r.request_id] = chosen[row]
            else:
                out.failed[r.request_id] = non_finite_logits_message(self.dtype)
        for j, row in enumerate(want_logprobs):
            r, token = sampling[row], chosen[row]
            entry = {}
            if r.params.logprobs:
                top = logp[j].topk(r.params.logprobs)
                entry = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            entry[token] = float(logp[j, token])
            out.logprobs[r.request_id] = entry
        return out


def long_rope_from(cfg: ModelConfig) -> int | None:
    """The length past which a LongRoPE model's sequences take the long factors (None: no LongRoPE)."""
    ropes = [r for r in (cfg.rope, cfg.local_rope) if r is not None and r.rope_type == "longrope"]
    return min(r.original_length for r in ropes) if ropes else None


def default_kv_memory(loaded: LoadedModel) -> int:
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        return int(free * 0.8)
    return 1 << 30


class EngineCore:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig | None = None, *, context: int | None = None
    ) -> None:
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        cfg = loaded.config
        self.context = min(context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        memory = config.kv_cache_memory or default_kv_memory(loaded)
        per_block = PagedKVCache.bytes_per_block(cfg, config.block_size, loaded.dtype)
        num_blocks = memory // per_block
        if num_blocks < 2:
            raise EmberError(
                f"kv cache memory of {memory} bytes holds {num_blocks} blocks of {per_block} bytes; at least 2 are needed"
            )
        self.cache = PagedKVCache(
            cfg, num_blocks=num_blocks, block_size=config.block_size, device=loaded.device, dtype=loaded.dtype
        )
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_batched_tokens,
            long_rope_from=long_rope_from(cfg),
        )
        self.runner = ModelRunner(loaded, self.cache)
        self._requests: dict[str, Request] = {}
        self._incoming: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        log.info(
            "paged KV cache: %d blocks of %d tokens (%.2f GiB), %d tokens in all",
            num_blocks,
            config.block_size,
            num_blocks * per_block / 2**30,
            (num_blocks - 1) * config.block_size,
        )

    # -- intake (any thread) -------------------------------------------------------------------------------

    def token_capacity(self) -> int:
        """The most tokens (prompt and generated) one request can hold: the KV cache's, at most the context."""
        return min(self.context, self.blocks.capacity * self.config.block_size)

    def max_tokens_for(self, prompt_len: int, params: SamplingParams) -> int:
        """max_tokens, or where it is None as many as the request can hold (`token_capacity`)."""
        return params.max_tokens if params.max_tokens is not None else self.token_capacity() - prompt_len

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ContextLengthError, naming the counts, for a request that can never run (InvalidParameterError
        for an empty prompt)."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidParameterError("the prompt is empty; at least one token is needed")
        if n >= self.context:
            raise ContextLengthError(f"prompt has {n} tokens but the context holds {self.context}")
        total = n + self.max_tokens_for(n, params)
        if total > self.context:
            raise ContextLengthError(
                f"prompt has {n} tokens and max_tokens={params.max_tokens}, but the context holds "
                f"{self.context} ({self.context - n} tokens left)"
            )
        capacity = self.blocks.capacity * self.config.block_size
        if n >= capacity:
            raise ContextLengthError(
                f"prompt ({n} tokens) plus one new token needs {n + 1} tokens of KV cache, which holds {capacity}"
            )
        if total > capacity:
            raise ContextLengthError(
                f"prompt ({n} tokens) plus max_tokens needs {total} tokens of KV cache, which holds {capacity}"
            )
        V = self.loaded.config.vocab_size
        check_prompt_ids(prompt_ids, V)
        # Checked here, not in the engine step, where one bad request would fail the whole batch.
        bad = [t for t in params.logit_bias if not 0 <= int(t) < V]
        if bad:
            raise InvalidParameterError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {V})")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.validate(prompt_ids, params)
        request = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            max_tokens=self.max_tokens_for(len(prompt_ids), params),
            assembler=TextAssembler(self.loaded.tokenizer.stream_decoder(prompt_ids=prompt_ids), params.stop),
            generator=make_generator(params.seed, self.loaded.device),
        )
        with self._lock:
            self._incoming.append(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self._incoming or self._aborts or self.scheduler.has_work())

    def num_waiting(self) -> int:
        return len(self._incoming) + len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        b = self.blocks.stats()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.num_waiting(),
            kv_blocks_total=b.total,
            kv_blocks_used=b.used,
            kv_blocks_cached=b.cached,
            kv_usage=b.used / b.total,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
        )

    # -- engine thread ---------------------------------------------------------------------------------------

    def _drain_intake(self) -> list[RequestUpdate]:
        updates = []
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            aborts, self._aborts = list(self._aborts), deque()
        for r in incoming:
            if r.uses_penalties:
                # The prompt's tokens are seen from the first sampled token on (as in the single-stream
                # Generator): made here, on the engine thread, not in add_request.
                V, dev = self.loaded.config.vocab_size, self.loaded.device
                r.seen = torch.zeros(V, dtype=torch.bool, device=dev)
                r.seen[torch.tensor(r.prompt_ids, device=dev)] = True
                r.counts = torch.zeros(V, dtype=torch.int32, device=dev)
            self._requests[r.request_id] = r
            self.scheduler.add(r)
            self.prompt_tokens += len(r.prompt_ids)
        for request_id in aborts:
            r = self._requests.pop(request_id, None)
            if r is not None:
                self.scheduler.finish(r)
                updates.append(self._final(r, "abort"))
        return updates

    def _final(self, r: Request, reason: str, error: str | None = None) -> RequestUpdate:
        return RequestUpdate(
            r.request_id,
            "",
            [],
            reason,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            cached_tokens=r.cached_tokens,
            error=error,
        )

    def step(self) -> list[RequestUpdate]:
        updates = self._drain_intake()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return updates
        result = self.runner.execute(sched)
        for s in sched.scheduled:
            r = s.request
            r.num_computed += s.num_tokens
            self.scheduler.register_full_blocks(r)
            if r.request_id in result.failed:
                self.scheduler.finish(r)
                self._requests.pop(r.request_id, None)
                updates.append(self._final(r, "error", result.failed[r.request_id]))
                continue
            token = result.sampled.get(r.request_id)
            if token is not None:
                updates.append(self._append(r, token, result.logprobs.get(r.request_id)))
        return updates

    def _append(self, r: Request, token: int, logprobs: dict[int, float] | None) -> RequestUpdate:
        r.output_ids.append(token)
        self.generated_tokens += 1
        if r.seen is not None and r.counts is not None:
            r.seen[token] = True
            r.counts[token] += 1
        p = r.params
        finish = None
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.loaded.eos_token_ids))
        if token in stops:
            finish, text = "stop", ""
        else:
            text = r.assembler.push(token)
            if r.assembler.stopped:
                finish = "stop"
            elif len(r.output_ids) >= r.max_tokens:
                finish = "length"
        if finish:
            text += r.assembler.finish()
            if r.assembler.stopped:  # the end's flush completed a stop string
                finish = "stop"
            self.scheduler.finish(r)
            self._requests.pop(r.request_id, None)
        return RequestUpdate(
            r.request_id,
            text,
            [token],
            finish,
            logprobs=[logprobs] if logprobs is not None else None,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            cached_tokens=r.cached_tokens,
        )

    def fail_all(self, message: str, *, finish_reason: str = "error") -> list[RequestUpdate]:
        """Ends every request (after an internal error, or at shutdown)."""
        updates = self._drain_intake()
        for r in list(self._requests.values()):
            self.scheduler.finish(r)
            updates.append(self._final(r, finish_reason, message))
        self._requests.clear()
        return updates

    def run_to_completion(self) -> dict[str, list[RequestUpdate]]:
        """Steps until every request has finished; returns each request's updates (for LLM.generate)."""
        results: dict[str, list[RequestUpdate]] = {}
        while self.has_work():
            for u in self.step():
                results.setdefault(u.request_id, []).append(u)
        return results


__all__ = ["EngineConfig", "EngineCore", "EngineStats", "RequestUpdate", "Status"]
