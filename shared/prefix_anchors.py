"""Prefix anchors: names of a token sequence's first chunks, so that several schedulers of a model
can send a request to the one whose worker holds its prefix (services/scheduler/shards.py).

A scheduler's prefix cache names full KV blocks by a chain of hashes that depends on each worker's
block size (services/scheduler/prefix_cache.py); the schedulers of a model share something coarser
and the same everywhere: a chained hash of the first CHUNK_TOKENS tokens, of the first 2 x CHUNK_TOKENS,
and so on, kept only at DEPTHS (in chunks, about 1.5x apart: a shared prefix is found to within a
third of its length with at most len(DEPTHS) keys a request). The gateway puts a new request's anchors
on its new-request entry; a scheduler that loads or ends a request writes its anchors to Redis as its
own (services/scheduler/shards.py, PUBLISH_SCRIPT), and whichever scheduler holds the deepest anchor
of a new request takes it while it has room.

Only a placement hint: a wrong or stale anchor sends a request to a scheduler whose workers do not
hold its prefix, which computes it (the prefix cache itself is exact, worker by worker).
"""

import hashlib
import struct
from collections.abc import Sequence

CHUNK_TOKENS = 64
DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # in chunks: up to 4096 tokens
ANCHOR_BYTES = 8  # a collision only misplaces a request
_ROOT = hashlib.blake2b(b"iterserve-anchor-v1", digest_size=ANCHOR_BYTES).digest()
_PACK = struct.Struct(f"<{CHUNK_TOKENS}i").pack


def anchors(token_ids: Sequence[int]) -> list[bytes]:
    """The anchors of a sequence's first DEPTHS[i] chunks, for every depth it fills, shallowest first."""
    chunks = min(len(token_ids) // CHUNK_TOKENS, DEPTHS[-1])
    found: list[bytes] = []
    chained = _ROOT
    for chunk in range(chunks):
        start = chunk * CHUNK_TOKENS
        chained = hashlib.blake2b(chained + _PACK(*token_ids[start : start + CHUNK_TOKENS]),
                                  digest_size=ANCHOR_BYTES).digest()
        if chunk + 1 in DEPTHS:
            found.append(chained)
    return found


def packed(token_ids: Sequence[int]) -> bytes:
    """A new-request entry's field: the anchors, concatenated."""
    return b"".join(anchors(token_ids))


def unpacked(data: bytes) -> list[bytes]:
    if len(data) % ANCHOR_BYTES or len(data) // ANCHOR_BYTES > len(DEPTHS):
        return []  # malformed: no hint
    return [data[start : start + ANCHOR_BYTES] for start in range(0, len(data), ANCHOR_BYTES)]
