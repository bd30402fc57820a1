"""Continuous batching: which requests run in the next step, and how many of their tokens.

Every step first serves the running requests in arrival order (a decode needs one token; a prompt still being
prefilled gets a chunk), then admits waiting requests while the token budget, the sequence limit and the KV
blocks allow. A long prompt is prefilled in chunks so that decodes keep flowing beside it.

When a running request needs a block and none is free, the most recently admitted request is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later (its prefix blocks often
survive in the prefix cache). A request that could never fit is refused by `EngineCore.validate` instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.engine.block_manager import BlockManager, block_hashes
from ember.engine.request import Request, Status


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it in this step, starting at request.num_computed


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        long_rope_from: int | None = None,
    ) -> None:
        self.blocks = blocks
        # LongRoPE (`ember.ops.rope`): a sequence longer than this rotates its keys with the long factors, so
        # its blocks are another prefix than a shorter sequence's with the same tokens (another hash seed).
        self.long_rope_from = long_rope_from
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, -(-(request.num_computed + num_tokens) // self.block_size) - len(request.blocks))

    def _grow(self, request: Request, num_tokens: int) -> bool:
        need = self._blocks_needed(request, num_tokens)
        if need == 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        request.blocks.extend(new)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.release(request)
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        out.preempted.append(request)

    def release(self, request: Request) -> None:
        """Returns a request's blocks to the pool (they stay in the prefix cache if full)."""
        self.blocks.free(request.blocks)
        request.blocks = []
        request.num_computed = 0

    def _match_prefix(self, request: Request) -> None:
        """Reuses cached blocks for the request's leading full blocks; at least one token is left to compute."""
        long = self.long_rope_from is not None and request.num_tokens > self.long_rope_from
        request.hash_seed = int(long)
        hashes = block_hashes(request.all_ids[: request.num_tokens - 1], self.block_size, request.hash_seed)
        hits = self.blocks.match_prefix(hashes)
        self.blocks.acquire(hits)
        request.blocks = list(hits)
        request.block_hashes = hashes[: len(hits)]
        request.num_computed = len(hits) * self.block_size
        request.cached_tokens = max(request.cached_tokens, request.num_computed)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batched_tokens
        for request in list(self.running):
            if request not in self.running or budget == 0:
                continue  # preempted earlier in this loop, or no budget left
            n = min(request.num_tokens - request.num_computed, budget)
            while not self._grow(request, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                out.scheduled.append(ScheduledRequest(request, n))
                budget -= n
        if out.preempted:
            return out  # memory is short: let the running requests drain before admitting more
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.blocks:
                self._match_prefix(request)
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._grow(request, n):
                self.release(request)
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        return out

    def register_full_blocks(self, request: Request) -> None:
        """After a step: full blocks whose tokens are all computed become shareable prefixes."""
        full = request.num_computed // self.block_size
        if full <= len(request.block_hashes):
            return
        hashes = block_hashes(request.all_ids[: full * self.block_size], self.block_size, request.hash_seed)
        for i in range(len(request.block_hashes), full):
            self.blocks.register(request.blocks[i], hashes[i])
        request.block_hashes = hashes

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)
        request.status = Status.FINISHED
