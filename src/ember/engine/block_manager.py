"""KV-cache blocks: allocation, reference counts, and prefix caching.

The paged cache is a pool of fixed-size blocks; a request owns a list of block ids (its block table). A block
that is full is keyed by a hash of its tokens and of the block before it, so two requests whose prompts share
a prefix (a system prompt, an earlier chat turn) share those blocks. A block whose last owner leaves stays
cached until its memory is needed, then it is evicted least-recently-used first.

Block 0 is never handed out: padding tokens write their k/v there, which keeps the attention kernel free of
branches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


def block_hashes(tokens: list[int], block_size: int, seed: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `tokens`: equal hashes mean equal prefixes (and equal `seed`s:
    what else decides the blocks' keys, see `Scheduler`)."""
    hashes, parent = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class BlockStats:
    total: int
    free: int  # never used or evicted
    cached: int  # unowned but still holding a reusable prefix
    used: int  # owned by at least one request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # block 0 is the padding sink
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> hash, for full blocks
        self._block_of: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no owner, LRU first

    @property
    def capacity(self) -> int:
        """Blocks a request can ever use (all but the padding sink)."""
        return self.num_blocks - 1

    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    def stats(self) -> BlockStats:
        free, cached = len(self._free), len(self._evictable)
        return BlockStats(self.capacity, free, cached, self.capacity - free - cached)

    def match_prefix(self, hashes: list[int]) -> list[int]:
        """The cached blocks for the longest run of leading `hashes` (not yet owned by the caller)."""
        blocks = []
        if self.prefix_caching:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Takes a reference on cached blocks found by match_prefix."""
        for block in blocks:
            if self._refs[block] == 0:
                self._evictable.pop(block, None)
            self._refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting cached ones if needed; None (and nothing taken) if there are not enough."""
        if n > self.num_available():
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, block_hash: int) -> None:
        """Marks a now-full block as holding the prefix `block_hash`, so later requests can share it."""
        if not self.prefix_caching or block in self._hash_of:
            return
        if block_hash in self._block_of:
            return  # an identical block is already cached; this copy stays private
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def free(self, blocks: list[int]) -> None:
        """Drops one reference on each block; unowned blocks become evictable (if cached) or free."""
        for block in reversed(blocks):  # the table's tail is the least likely to be shared: evict it first
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed twice"
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
