"""The scheduler's copy of each worker's prefix cache: which full KV blocks it holds, by hash.

A full block is named by a hash of its parent block's hash and its token ids (vLLM's automatic
prefix caching), so a hash names a whole prefix, and two requests whose first k blocks agree
share those k blocks' KV. The root hash carries what else changes a block's KV (the model).

The scheduler decides every change to a worker's cache and names it in that worker's plans
(services/worker/kv_cache.py carries them out in a plan's order: register, free, evict, adopt):
- register: when a result confirms that a request's full block is in the worker's KV, the block
  is named by its hash and held by that request (unless another block holds the same contents:
  then it stays the request's own);
- adopt: a request admitted to the worker starts with the longest run of its block hashes the
  worker holds (at most all but its last token: the last one is fed to sample from);
- release: a request leaving the worker lets go of its blocks; registered ones stay, idle;
- evict: when a step needs blocks and too few are free, the idle blocks used longest ago go.
No event stream comes back: the copy is exact by construction, and a worker that finds a command
not fitting what it holds drops everything and says so (the scheduler then starts it over empty).
"""

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

from shared import cache_digest
from shared.plans import HASH_BYTES  # 128 bits: a collision would hand one prompt another's KV


def root_hash(salt: str) -> bytes:
    return hashlib.blake2b(b"iterserve-prefix-v1\0" + salt.encode(), digest_size=HASH_BYTES).digest()


def extend_chain(chain: list[bytes], root: bytes, tokens: Callable[[int, int], Sequence[int]], block_size: int,
                 blocks: int) -> None:
    """Grow `chain` (the hashes of a request's first full blocks) to `blocks` entries; tokens(start,
    end) gives its tokens, known up to blocks * block_size."""
    pack = _block_packer(block_size)
    for index in range(len(chain), blocks):
        parent = chain[index - 1] if index else root
        data = pack(*tokens(index * block_size, (index + 1) * block_size))
        chain.append(hashlib.blake2b(parent + data, digest_size=HASH_BYTES).digest())


@functools.cache
def _block_packer(block_size: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{block_size}i").pack  # (int32 little-endian, as numpy's "<i4")


class WorkerPrefixCache:
    """One worker's registered blocks: how many running requests hold each, and the idle ones
    (held by none, evictable) least recently used first."""

    def __init__(self) -> None:
        self.references: dict[bytes, int] = {}
        self.idle: OrderedDict[bytes, None] = OrderedDict()
        self.digest = 0  # of its hashes, as the worker's cache keeps it (shared/cache_digest.py)

    def __len__(self) -> int:
        return len(self.references)

    @property
    def blocks_idle(self) -> int:
        return len(self.idle)

    def match(self, chain: Sequence[bytes], limit: int) -> int:
        """How many of the first `limit` hashes of a chain this worker holds, in a row."""
        count = 0
        while count < min(limit, len(chain)) and chain[count] in self.references:
            count += 1
        return count

    def idle_among(self, hashes: Sequence[bytes]) -> int:
        return sum(block_hash in self.idle for block_hash in hashes)

    def acquire(self, hashes: Sequence[bytes]) -> None:
        for block_hash in hashes:
            self.references[block_hash] += 1
            self.idle.pop(block_hash, None)

    def add(self, block_hash: bytes) -> bool:
        """Register a block held by one request; False (nothing changed) when the hash is known."""
        if block_hash in self.references:
            return False
        self.references[block_hash] = 1
        self.digest = cache_digest.added(self.digest, block_hash)
        return True

    def release(self, block_hash: bytes) -> None:
        self.references[block_hash] -= 1
        if self.references[block_hash] == 0:
            self.idle[block_hash] = None  # most recently used last

    def evict(self, count: int) -> list[bytes]:
        """The `count` idle blocks used longest ago, dropped."""
        evicted = []
        for _ in range(min(count, len(self.idle))):
            block_hash, _ = self.idle.popitem(last=False)
            del self.references[block_hash]
            self.digest = cache_digest.removed(self.digest, block_hash)
            evicted.append(block_hash)
        return evicted

    def clear(self) -> None:
        self.references.clear()
        self.idle.clear()
        self.digest = 0
