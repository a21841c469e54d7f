"""The requests a worker holds, as rows: the bookkeeping every executor shares (the engine's
tensors and the emulated executor's clock both sit on top of it).

A request gets a row when a plan introduces it and keeps it until a plan frees it; its KV block
table is that row of the block tables, its last sampled token and output index are that row of
per-row arrays. A step's items are checked here (unknown request, tokens outside the vocabulary,
positions that do not follow the KV, the context length, a full pool: each a typed refusal, never
an exception) and turned into columns, one entry per runnable item, in item order.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from services.worker.kv_cache import BlockTables, CacheMismatch, KVCacheFull

if TYPE_CHECKING:
    from services.worker.prompt_logprobs import PromptLogprobs
    from shared.messages import BatchPlan, SamplingParams, StepItem


@dataclass(frozen=True)
class ItemRefusal:
    """An item the engine did not run, and why (the worker sends it on as an ItemError)."""

    request_id: str
    code: str  # kv_cache_full, unknown_request or bad_item
    message: str


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the most likely tokens', from the raw logits."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass
class StepOutcome:
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    errors: list[ItemRefusal] = field(default_factory=list)  # items that did not run
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # requests that asked for them
    # Speculating items' tokens (StepItem.draft_tokens): every token kept, from output_index on (its
    # first is also in `tokens`)
    speculated: dict[str, list[int]] = field(default_factory=dict)
    # Requests that asked for their prompt's (services/worker/prompt_logprobs.py PromptLogprobs)
    prompt_logprobs: dict[str, "PromptLogprobs"] = field(default_factory=dict)
    seconds: float = 0.0


class RequestRows:
    """Rows of requests over a KV cache's block tables."""

    def __init__(self, kv_cache: BlockTables, context_length: int, vocab_size: int):
        self.kv_cache = kv_cache
        self.context_length, self.vocab_size = context_length, vocab_size
        self.max_rows = kv_cache.block_tables.shape[0]
        self._row_of: dict[str, int] = {}
        self._request_of: list[str | None] = [None] * self.max_rows
        self._free_rows = list(range(self.max_rows - 1, -1, -1))  # a stack: lowest rows first
        self._params: list["SamplingParams | None"] = [None] * self.max_rows
        self._refused: dict[str, str] = {}  # requests add_request could not take, and why
        # The output index and token each row sampled last (the host's copy: known once the step
        # that sampled it is done); a pipelined plan feeds that token.
        self._last_output_index = np.full(self.max_rows, -1, dtype=np.int64)
        self._last_token_host = np.zeros(self.max_rows, dtype=np.int64)
        # Which request a row holds, as a number that changes whenever a row is given: a step's
        # tokens that arrive late (a pipeline's last stage) touch only rows still holding them.
        self._row_serial = np.zeros(self.max_rows, dtype=np.int64)
        self._serials_given = 0

    def add_request(self, request_id: str, sampling: "SamplingParams", history: Sequence[int] = ()) -> None:
        """Give a request a row (or new sampling parameters, if it has one). history: its tokens the
        worker will not be fed (those of the cached blocks it starts with: NewRequest.cached_token_ids)."""
        reason = self._refusal(sampling)
        if reason is not None:
            self.free(request_id)
            self._refused[request_id] = reason
            return
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._refused[request_id] = f"the worker already holds {self.max_rows} requests (max_batch_size)"
                return
            row = self._free_rows.pop()
            self._row_of[request_id] = row
            self._request_of[row] = request_id
            self._serials_given += 1
            self._row_serial[row] = self._serials_given
        self._refused.pop(request_id, None)
        self._params[row] = sampling
        self._row_added(row, sampling, history)

    def _refusal(self, sampling: "SamplingParams") -> str | None:
        """Why this engine cannot serve a request with these parameters, or None."""
        return None

    def _row_added(self, row: int, sampling: "SamplingParams", history: Sequence[int]) -> None:
        """A row has (new) sampling parameters, and its tokens before the first it will be fed."""

    def free(self, request_id: str) -> None:
        """Forget a request and return its KV blocks to the pool (harmless when unknown)."""
        self._refused.pop(request_id, None)
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        self._free_kv(row)
        self._request_of[row] = self._params[row] = None
        self._last_output_index[row] = -1
        self._row_serial[row] = 0
        self._row_freed(row)
        self._free_rows.append(row)

    def _row_freed(self, row: int) -> None:
        """A row was given up."""

    def take_plan(self, plan: "BatchPlan") -> None:
        """Everything a plan changes before its step, in its order: prefix-cache registrations, frees,
        evictions, new requests and the cached blocks they start with. Raises CacheMismatch for a
        cache command that does not fit this cache (the caller then resets: nothing can be trusted).
        (A plan's free_all or new epoch is the caller's: it resets first.)"""
        for request_id, index, block_hash in plan.register_blocks:
            row = self._row_of.get(request_id)
            if row is None:
                raise CacheMismatch(f"a block registered for request {request_id!r}, which holds no row")
            self.kv_cache.register(row, index, block_hash)
        for request_id in plan.free_request_ids:
            self.free(request_id)
        self.kv_cache.evict(list(plan.evict_blocks))
        block_size = self.kv_cache.block_size
        for new in plan.new_requests:
            if new.cached_token_ids and len(new.cached_token_ids) != len(new.cached_blocks) * block_size:
                raise CacheMismatch(f"request {new.request_id!r} starts with {len(new.cached_blocks)} cached blocks "
                                    f"said to hold {len(new.cached_token_ids)} tokens")
            self.add_request(new.request_id, new.sampling, new.cached_token_ids)
            row = self._row_of.get(new.request_id)
            if row is not None and new.cached_blocks:  # (a request refused a row has its items refused)
                self.kv_cache.adopt(row, list(new.cached_blocks))

    def reset(self) -> None:
        for request_id in list(self._row_of):
            self.free(request_id)
        self._refused.clear()
        self.kv_cache.free_all()

    def _free_kv(self, row: int) -> None:
        self.kv_cache.free(row)

    @property
    def running(self) -> int:
        return len(self._row_of)

    def row(self, request_id: str) -> int | None:
        """The request's row (in the KV cache's block tables and the per-row tensors), if it has one."""
        return self._row_of.get(request_id)

    def kv_length(self, request_id: str) -> int:
        """Tokens of a request whose KV is written (0 when unknown)."""
        row = self._row_of.get(request_id)
        return 0 if row is None else int(self.kv_cache.lengths[row])

    def columns(self, items: Sequence["StepItem"], outcome: "StepOutcome") -> "StepColumns | None":
        """The runnable items as columns, their KV blocks reserved; the others as refusals."""
        columns = StepColumns()
        kv_cache, context_length, vocab_size = self.kv_cache, self.context_length, self.vocab_size
        block_size, row_of, refusals = kv_cache.block_size, self._row_of, outcome.errors
        # The rows' state as lists, read once: a numpy element read per item and field costs more than
        # the whole copy. Only a rebuild below changes a row's KV (its own, once: an item per request).
        lengths, blocks_held = kv_cache.lengths.tolist(), kv_cache.blocks_held.tolist()
        last_output_index, last_token = self._last_output_index.tolist(), self._last_token_host.tolist()
        seen: set[str] = set()

        def refuse(request_id: str, code: str, message: str) -> None:
            refusals.append(ItemRefusal(request_id, code, message))

        for item in items:
            request_id = item.request_id
            if request_id in seen:
                refuse(request_id, "bad_item", "a request may have one item per step")
                continue
            seen.add(request_id)
            row = row_of.get(request_id)
            if row is None:
                refuse(request_id, "bad_item" if request_id in self._refused else "unknown_request",
                       self._refused.get(request_id, "no sampling parameters were sent for this request"))
                continue
            start = item.start_position
            if item.feeds_sampled:  # the token this worker sampled for it in the plan before
                if item.token_ids or last_output_index[row] != item.output_index - 1:
                    refuse(request_id, "bad_item", f"no token sampled at output_index {item.output_index - 1} to feed")
                    continue
                count = 1
            else:
                count = len(item.token_ids)
                if not count:
                    refuse(request_id, "bad_item", "no tokens to feed")
                    continue
                if min(item.token_ids) < 0 or max(item.token_ids) >= vocab_size:
                    refuse(request_id, "bad_item", "token id outside the vocabulary")
                    continue
            if start + count > context_length:
                refuse(request_id, "bad_item", f"exceeds the context length {context_length}")
                continue
            drafts = item.draft_tokens
            if drafts and (reason := self._draft_refusal(item, count, row)):
                refuse(request_id, "bad_item", reason)
                continue
            held = lengths[row]
            if start == 0 and held:
                self._free_kv(row)  # a rebuild from the first token
                grows = True
            elif start != held:
                refuse(request_id, "bad_item", f"start_position {start} but {held} tokens are in the KV cache")
                continue
            else:  # (most decode steps stay within the blocks the row holds: no call)
                grows = -(-(start + count) // block_size) > blocks_held[row]
            if grows:
                try:
                    kv_cache.grow(row, start + count, request_id)
                except KVCacheFull as full:
                    refuse(request_id, "kv_cache_full", str(full))
                    continue
            if drafts:
                columns.drafts[len(columns.request_ids)] = drafts
            columns.add(request_id, row, start, count, item, last_token[row])
        return columns if columns.request_ids else None

    def _draft_refusal(self, item: "StepItem", count: int, row: int) -> str | None:
        """Why an item with proposed tokens cannot be verified here, or None."""
        if item.feeds_sampled or not item.sample or not 0 < item.draft_tokens < count:
            return f"{item.draft_tokens} draft tokens need a sampled item of more tokens than that"
        if self._params[row].needs_history:  # (its history would hold the proposals not kept)
            return "a request with penalties or a constraint is not speculated"
        return None

    def sampled(self, columns: "StepColumns", tokens: np.ndarray) -> list[str]:
        """Note the tokens the step sampled (one per sampled item, in item order); their request ids."""
        sampled = np.asarray(columns.sample, dtype=bool)
        rows = np.asarray(columns.rows, dtype=np.int64)[sampled]
        self._last_output_index[rows] = np.asarray(columns.output_indices, dtype=np.int64)[sampled]
        self._last_token_host[rows] = tokens
        return [request_id for request_id, sample_it in zip(columns.request_ids, columns.sample) if sample_it]


@dataclass(eq=False)
class StepColumns:
    """The runnable items of one step as columns, in item order."""

    request_ids: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    output_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # flattened; a fed-from-device token holds 0
    feed_positions: list[int] = field(default_factory=list)  # where in token_ids a sampled token goes
    feed_rows: list[int] = field(default_factory=list)  # and whose
    fed_tokens: list[tuple[int, ...]] = field(default_factory=list)  # each item's tokens, as the host knows them
    # Speculating items' proposed tokens (StepItem.draft_tokens), by item index (most steps: none)
    drafts: dict[int, int] = field(default_factory=dict)

    def add(self, request_id: str, row: int, start: int, count: int, item: "StepItem", last_token: int) -> None:
        self.request_ids.append(request_id)
        self.rows.append(row)
        self.starts.append(start)
        self.counts.append(count)
        self.sample.append(item.sample)
        self.output_indices.append(item.output_index)
        if item.feeds_sampled:
            self.feed_positions.append(len(self.token_ids))
            self.feed_rows.append(row)
            self.token_ids.append(0)
            self.fed_tokens.append((int(last_token),))
        else:
            self.token_ids.extend(item.token_ids)
            self.fed_tokens.append(item.token_ids)


