"""Paged KV cache: one preallocated pool of fixed-size blocks, a block table per request.

A token's KV lives at flat slot `block * block_size + offset` of every layer's pool. Blocks
are taken when a request grows and returned when it finishes, is cancelled or is evicted.
"""

import torch


class KVCacheFull(Exception):
    """The pool has too few free blocks for a request's next step (nothing was changed)."""

    def __init__(self, request_id: str, blocks_needed: int, blocks_free: int):
        super().__init__(f"request {request_id} needs {blocks_needed} more KV blocks, {blocks_free} free")
        self.request_id, self.blocks_needed, self.blocks_free = request_id, blocks_needed, blocks_free


class PagedKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.block_size = block_size
        self.blocks_total = num_blocks
        shape = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [layers, slots, Hkv, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids first
        self._block_tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}  # tokens of each request whose KV is written

    @property
    def blocks_free(self) -> int:
        return len(self._free_blocks)

    def length(self, request_id: str) -> int:
        return self._lengths.get(request_id, 0)

    def blocks_needed(self, request_id: str, total_tokens: int) -> int:
        held = len(self._block_tables.get(request_id, ()))
        return max(0, -(-total_tokens // self.block_size) - held)

    def grow(self, request_id: str, total_tokens: int) -> None:
        """Make room for `total_tokens` tokens; raise KVCacheFull, changing nothing, if it can't."""
        needed = self.blocks_needed(request_id, total_tokens)
        if needed > len(self._free_blocks):
            raise KVCacheFull(request_id, needed, len(self._free_blocks))
        table = self._block_tables.setdefault(request_id, [])
        self._lengths.setdefault(request_id, 0)
        for _ in range(needed):
            table.append(self._free_blocks.pop())

    def block_table(self, request_id: str) -> list[int]:
        return list(self._block_tables[request_id])

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat pool slots of token positions [start, end) of a request (within its blocks)."""
        table, size = self._block_tables[request_id], self.block_size
        return [table[position // size] * size + position % size for position in range(start, end)]

    def set_length(self, request_id: str, length: int) -> None:
        self._lengths[request_id] = length

    def free(self, request_id: str) -> None:
        """Return a request's blocks to the pool (harmless for an unknown request)."""
        self._free_blocks.extend(reversed(self._block_tables.pop(request_id, [])))
        self._lengths.pop(request_id, None)

    def free_all(self) -> None:
        for request_id in list(self._block_tables):
            self.free(request_id)

    def write(self, layer: int, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's new K and V ([T, Hkv, D]) at their slots ([T])."""
        self.keys[layer].index_copy_(0, slot_mapping, keys)
        self.values[layer].index_copy_(0, slot_mapping, values)
