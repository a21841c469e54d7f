"""A prefix cache's digest: the sum, modulo 2**64, of its registered block hashes' first 8 bytes.

The worker's cache (services/worker/kv_cache.py) and the scheduler's copy of it
(services/scheduler/prefix_cache.py) each keep it as blocks are registered and evicted; every result
reports the worker's, and the scheduler compares it with its copy's as of the plan answered, so the
two maps are checked whole, not only command by command. (A sum: the order of registration does not
matter, and a hash registered twice is not cancelled away as with XOR.) No imports: the engine's
modules take it where the service's packages are not installed.
"""

DIGEST_MASK = (1 << 64) - 1


def added(digest: int, block_hash: bytes) -> int:
    return (digest + int.from_bytes(block_hash[:8], "little")) & DIGEST_MASK


def removed(digest: int, block_hash: bytes) -> int:
    return (digest - int.from_bytes(block_hash[:8], "little")) & DIGEST_MASK


def after_plan(digest: int, plan) -> int:
    """The digest after a plan's commands (a BatchPlan's free_all, register_blocks, evict_blocks),
    for a worker that holds no cache of its own to read it from (the scheduler benchmark's)."""
    if plan.free_all:
        digest = 0
    for _, _, block_hash in plan.register_blocks:
        digest = added(digest, block_hash)
    for block_hash in plan.evict_blocks:
        digest = removed(digest, block_hash)
    return digest
