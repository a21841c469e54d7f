"""Contiguous copies of the decoding requests' KV, kept from one step to the next.

The batched attention path would otherwise gather every decode request's whole context out
of the paged pool, for every layer, at every step: at 64 requests of 256 tokens that copy is
about a third of a CPU decode step. Here each decoding request owns one row of a
[layers, rows, Hkv, capacity, D] tensor; a step appends its new token's K and V to the row
(besides the pool, which stays the source of truth), so a steady decode batch gathers nothing.
A row is filled from the pool only when its request joins the decode group (or its row no
longer matches the pool); a request that leaves the group gives its row up at the next step.

The workspace costs memory: at most max_tokens tokens of K and V (rows x context, the rows
padded to the longest context), and only what the rows have reached is ever touched. A step
that would need more runs on the gathering path instead.
"""

import numpy as np
import torch

from services.worker.kv_cache import PagedKVCache

ROW_ALIGN = 8  # rows are allocated in multiples of this
# Positions past the used context are zeroed (masked positions must hold finite numbers) this many
# at a time: one position per step would be a strided write into every (layer, row, head) run of
# the workspace at every step (about 20 ms a step at 64 rows on 2 CPU cores, measured).
ZERO_AHEAD = 64


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class DecodeWorkspace:
    def __init__(self, kv_cache: PagedKVCache, max_tokens: int, rows_hint: int = 64):
        self.kv_cache = kv_cache
        self.max_tokens = max_tokens
        self.rows_hint = rows_hint  # rows to allocate at once (the batch size): a reallocation is costly
        self.keys: torch.Tensor | None = None  # [layers, rows, Hkv, capacity, D]
        self.values: torch.Tensor | None = None
        self.layer_keys: list[torch.Tensor] = []  # each layer's view, made once per allocation
        self.layer_values: list[torch.Tensor] = []
        self._row_of: dict[int, int] = {}  # a request's KV-cache row -> its row here
        self._order: list[int] = []  # the KV-cache row of each used row
        self._length: dict[int, int] = {}  # tokens of each row that match the pool
        self._finite_context = 0  # positions 0 .. this - 1 of every used row hold finite numbers

    @property
    def capacity_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1] * self.keys.shape[3]

    def drop(self, kv_row: int) -> None:
        """Give a request's row up (its KV was freed or will change outside the workspace).
        Requests are known by their row in the KV cache's block tables."""
        row = self._row_of.pop(kv_row, None)
        if row is None:
            return
        self._length.pop(kv_row, None)
        last = len(self._order) - 1
        if row != last:  # keep rows dense: the last row moves into the hole
            moved = self._order[last]
            length = self._length[moved]
            self.keys[:, row, :, :length] = self.keys[:, last, :, :length]
            self.values[:, row, :, :length] = self.values[:, last, :, :length]
            self._order[row], self._row_of[moved] = moved, row
        self._order.pop()

    def forget(self) -> None:
        """Forget every row, keeping the memory (its pages are already touched) for the next ones."""
        self._row_of.clear()
        self._order.clear()
        self._length.clear()
        self._finite_context = 0

    def clear(self) -> None:
        """Forget every row and release the memory."""
        self.forget()
        self.keys = self.values = None
        self.layer_keys, self.layer_values = [], []

    def prepare(self, decodes: list[tuple[int, int]]) -> list[int] | None:
        """Make the rows hold exactly these (request id, start position) decode requests, each
        with its context 0 .. start-1 from the pool, and room for this step's token at `start`.
        Returns each request's row, or None when that needs more than max_tokens (the
        workspace is then released and the caller gathers from the pool)."""
        wanted = dict(decodes)
        for kv_row in [kv_row for kv_row in self._order if kv_row not in wanted]:
            self.drop(kv_row)
        for kv_row, start in decodes:
            if kv_row in self._row_of and self._length[kv_row] != start:
                self.drop(kv_row)  # rebuilt, or it skipped steps: refill it from the pool
        needed_context = max(start for _, start in decodes) + 1
        if not self._fit(len(decodes), needed_context):
            self.clear()
            return None
        for kv_row, start in decodes:
            if kv_row not in self._row_of:
                self._fill(kv_row, start)
        for kv_row, start in decodes:
            self._length[kv_row] = start + 1  # the step writes its token there
        return [self._row_of[kv_row] for kv_row, _ in decodes]

    def _fit(self, rows: int, context: int) -> bool:
        if self.keys is None or rows > self.keys.shape[1] or context > self.keys.shape[3]:
            if not self._allocate(rows, context):
                return False
        if context > self._finite_context:  # positions the used rows may now read: make them finite
            used = len(self._order)
            end = min(self.keys.shape[3], _round_up(context, ZERO_AHEAD))
            self.keys[:, :used, :, self._finite_context : end] = 0
            self.values[:, :used, :, self._finite_context : end] = 0
            self._finite_context = end
        return True

    def _allocate(self, rows: int, context: int) -> bool:
        """New tensors with room for `rows` rows of at least `context` tokens; the used rows move over.

        Rows for the whole batch at once, and the context axis takes the rest of the budget:
        torch.empty only reserves address space, and a page costs memory (and a page fault, slow
        on VMs) when first written, so room nobody reaches is free, and neither a growing batch
        nor a growing context forces a reallocation (and a copy into fresh pages) until one of
        them outgrows it."""
        aligned = _round_up(rows, ROW_ALIGN)
        for new_rows in (max(self.rows_hint, aligned), 2 * aligned, aligned, rows):
            if new_rows >= rows and self.max_tokens // new_rows >= context:
                break
        else:
            return False
        capacity = self.max_tokens // new_rows
        pool = self.kv_cache.keys  # [layers, slots, Hkv, D]
        shape = (pool.shape[0], new_rows, pool.shape[2], capacity, pool.shape[3])
        keys = torch.empty(shape, device=pool.device, dtype=pool.dtype)
        values = torch.empty(shape, device=pool.device, dtype=pool.dtype)
        # Masked positions must still hold finite numbers (0 x NaN is NaN): the used rows are
        # copied and zeroed up to `context`, a row taken later is zeroed when it is filled.
        for kv_row, row in self._row_of.items():
            length = self._length[kv_row]
            for new, old in ((keys, self.keys), (values, self.values)):
                new[:, row, :, :length] = old[:, row, :, :length]
                new[:, row, :, length:context] = 0
        self.keys, self.values, self._finite_context = keys, values, context
        self.layer_keys, self.layer_values = list(keys.unbind(0)), list(values.unbind(0))
        return True

    def _fill(self, kv_row: int, start: int) -> None:
        row = len(self._order)
        self._order.append(kv_row)
        self._row_of[kv_row] = row
        self._length[kv_row] = start
        self.keys[:, row, :, start : self._finite_context] = 0
        self.values[:, row, :, start : self._finite_context] = 0
        if start == 0:
            return
        positions = np.arange(start)
        slots = torch.from_numpy(self.kv_cache.slots(np.full(start, kv_row), positions)).to(self.keys.device)
        # [layers, start, Hkv, D] -> [layers, Hkv, start, D]
        self.keys[:, row, :, :start] = self.kv_cache.keys.index_select(1, slots).transpose(1, 2)
        self.values[:, row, :, :start] = self.kv_cache.values.index_select(1, slots).transpose(1, 2)
