"""Paged KV cache: one preallocated pool of fixed-size blocks, a block table per request row.

A token's KV lives at flat slot `block * block_size + offset` of every layer's pool. Each request
the engine holds has a row (services/worker/engine.py): its block table is a row of one
preallocated [rows, max_blocks] array, so a step's slot mapping is one vectorized lookup, and on
an accelerator the same table lives on the device for kernels that read the pool in place.
Blocks are taken when a request grows and returned when it finishes, is cancelled or is evicted.

Prefix caching (vLLM's automatic prefix caching, driven from outside): a full block whose tokens
are known can be registered under a hash that names its contents (services/scheduler/prefix_cache.py
computes it); from then on it is reference-counted, shared by every row that adopts it, and when
its last row lets go it stays cached, holding its KV, until a plan evicts it. The scheduler decides
all three (register, adopt, evict) and names them in its plans, so it knows this cache exactly
without being told: this side never evicts on its own, and refuses a command that does not fit
what it holds (CacheMismatch).
"""

import numpy as np
import torch

from shared import cache_digest


class KVCacheFull(Exception):
    """The pool has too few free blocks for a request's next step (nothing was changed)."""

    def __init__(self, request: str, blocks_needed: int, blocks_free: int):
        super().__init__(f"request {request} needs {blocks_needed} more KV blocks, {blocks_free} free")
        self.request, self.blocks_needed, self.blocks_free = request, blocks_needed, blocks_free


class CacheMismatch(Exception):
    """A prefix-cache command that does not fit this cache (a hash it does not hold, or holds in use)."""


class BlockTables:
    """Which blocks of the pool each request row holds: the paged KV's bookkeeping, no tensors (the
    emulated executor keeps exactly this, services/worker/emulated.py)."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int, max_blocks_per_row: int,
                 scratch_block: bool = False):
        """scratch_block: one more block, owned by nobody, where padding rows of fixed-shape decode
        steps (services/worker/decode_graphs.py) write their K/V."""
        self.block_size = block_size
        self.blocks_total = num_blocks
        self.scratch_slot = num_blocks * block_size if scratch_block else None
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids first
        self.block_tables = np.zeros((max_rows, max_blocks_per_row), dtype=np.int64)  # row -> its blocks
        self.blocks_held = np.zeros(max_rows, dtype=np.int64)  # valid entries of each row's table
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # tokens of each row whose KV is written
        # The prefix cache: registered blocks by hash, and how many rows hold each (0: cached, idle).
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self._references = np.zeros(num_blocks, dtype=np.int64)
        self._blocks_idle = 0  # registered blocks no row holds: evictable
        # The digest of the registered hashes (shared/cache_digest.py): each result reports it, and the
        # scheduler compares it with its copy's, so the two maps are checked whole.
        self.cache_digest = 0

    @property
    def blocks_free(self) -> int:
        """Blocks neither held by a row nor cached."""
        return len(self._free_blocks)

    @property
    def blocks_cached(self) -> int:
        """Registered blocks no row holds: KV kept for a later request, evicted when a plan says so."""
        return self._blocks_idle  # (a Python int: it goes on the wire)

    @property
    def max_blocks_per_row(self) -> int:
        return self.block_tables.shape[1]

    def blocks_needed(self, row: int, total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.block_size) - int(self.blocks_held[row]))

    def grow(self, row: int, total_tokens: int, request: str = "") -> None:
        """Make room for `total_tokens` tokens in a row; raise KVCacheFull, changing nothing, if it can't."""
        needed = self.blocks_needed(row, total_tokens)
        if needed == 0:
            return
        held = int(self.blocks_held[row])
        if needed > len(self._free_blocks) or held + needed > self.max_blocks_per_row:
            raise KVCacheFull(request or f"row {row}", needed, len(self._free_blocks))
        for index in range(held, held + needed):
            self.block_tables[row, index] = self._free_blocks.pop()
        self.blocks_held[row] = held + needed
        self._table_grew(row, held, held + needed)

    def _table_grew(self, row: int, start: int, end: int) -> None:
        """Entries start .. end-1 of a row's table were just written."""

    def block_table(self, row: int) -> np.ndarray:
        return self.block_tables[row, : self.blocks_held[row]]

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat pool slots of token positions, one row per token (within the rows' blocks)."""
        return self.block_tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size

    def free(self, row: int) -> None:
        """Let go of a row's blocks (harmless for a row that holds none): its own return to the pool,
        registered ones lose a reference and stay cached."""
        held = int(self.blocks_held[row])
        blocks = self.block_tables[row, held - 1 :: -1].tolist() if held else []
        if not self._hash_of_block:  # no prefix cache (off, or empty): every block is the row's own
            self._free_blocks.extend(blocks)
            blocks = []
        for block in blocks:
            if block in self._hash_of_block:
                self._references[block] -= 1
                self._blocks_idle += int(self._references[block] == 0)
            else:
                self._free_blocks.append(block)
        self.blocks_held[row] = 0
        self.lengths[row] = 0

    def free_all(self) -> None:
        """Drop every row and the whole prefix cache."""
        for row in np.flatnonzero(self.blocks_held).tolist():
            self.free(row)
        self.lengths[:] = 0
        self.evict(list(self._block_of_hash))

    # The prefix cache's commands (in a plan's order: register, free, evict, adopt)

    def register(self, row: int, index: int, block_hash: bytes) -> None:
        """Name the row's full block `index` by its hash: shared and cached from now on."""
        if index >= self.blocks_held[row] or (index + 1) * self.block_size > self.lengths[row]:
            raise CacheMismatch(f"row {row} has no full block {index} to register")
        block = int(self.block_tables[row, index])
        if block_hash in self._block_of_hash or block in self._hash_of_block:
            raise CacheMismatch(f"block {index} of row {row} or its hash is registered already")
        self._block_of_hash[block_hash] = block
        self._hash_of_block[block] = block_hash
        self._references[block] = 1
        self.cache_digest = cache_digest.added(self.cache_digest, block_hash)

    def adopt(self, row: int, hashes: list[bytes]) -> None:
        """Start an empty row with cached blocks as its first blocks (their KV is its prefix)."""
        if self.blocks_held[row]:
            raise CacheMismatch(f"row {row} holds blocks already")
        if len(hashes) > self.max_blocks_per_row:
            raise CacheMismatch(f"{len(hashes)} cached blocks exceed a row's table")
        blocks = [self._block_of_hash.get(block_hash) for block_hash in hashes]
        if None in blocks:
            raise CacheMismatch(f"{blocks.count(None)} of {len(hashes)} cached blocks are not in this cache")
        for index, block in enumerate(blocks):
            self._blocks_idle -= int(self._references[block] == 0)
            self._references[block] += 1
            self.block_tables[row, index] = block
        self.blocks_held[row] = len(blocks)
        self.lengths[row] = len(blocks) * self.block_size
        self._table_grew(row, 0, len(blocks))

    def evict(self, hashes: list[bytes]) -> None:
        """Return idle cached blocks to the pool (all of them, or none when one is not idle)."""
        blocks = [self._block_of_hash.get(block_hash) for block_hash in hashes]
        if None in blocks or len(set(hashes)) < len(hashes) or any(self._references[block] for block in blocks):
            raise CacheMismatch("evicting a block that is not cached or is in use")
        for block_hash, block in zip(hashes, blocks):
            del self._block_of_hash[block_hash], self._hash_of_block[block]
            self._blocks_idle -= 1
            self._free_blocks.append(block)
            self.cache_digest = cache_digest.removed(self.cache_digest, block_hash)


class PagedKVCache(BlockTables):
    """The pool itself: K and V of every layer as [layers, slots, Hkv, D] tensors."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, max_rows: int, max_blocks_per_row: int,
                 scratch_block: bool = False):
        super().__init__(num_blocks, block_size, max_rows, max_blocks_per_row, scratch_block)
        self.device = device
        shape = (n_layers, (num_blocks + scratch_block) * block_size, n_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [layers, slots, Hkv, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        # Each layer's [slots, Hkv, D] view, made once: indexing keys[layer] is an op every layer of every step.
        self.layer_keys, self.layer_values = list(self.keys.unbind(0)), list(self.values.unbind(0))
        # The tables on the device, for kernels that read the pool in place (CUDA); rows are copied
        # when they change. On the CPU the host array is the table.
        self.device_block_tables = (torch.zeros(self.block_tables.shape, dtype=torch.int32, device=device)
                                    if device.type == "cuda" else None)

    def _table_grew(self, row: int, start: int, end: int) -> None:
        if self.device_block_tables is not None:
            self.device_block_tables[row, start:end] = torch.from_numpy(self.block_tables[row, start:end])

    def write(self, layer: int, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's new K and V ([T, Hkv, D]) at their slots ([T])."""
        self.layer_keys[layer].index_copy_(0, slot_mapping, keys)
        self.layer_values[layer].index_copy_(0, slot_mapping, values)
