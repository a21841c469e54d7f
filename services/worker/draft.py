"""A draft model's proposals (--speculative-config method draft_model), made by the worker that
verifies them, inside the step that does.

The scheduler plans a speculating item as for prompt lookup, its proposals placeholders
(services/scheduler/speculation.py); before the target's forward pass the engine hands the step's
columns here, and the draft writes its proposals over the placeholders: greedy (its argmax), one
pass for the chunk that brings its KV up to the item's last token, then one pass per further
proposal, all speculating items of the step batched in each pass (Orca's selective batching, as
the target's step). The target then verifies them as any proposals (services/worker/speculation.py).

Exactness does not rest on the draft: verification keeps only what the target samples, so a draft
that proposes badly, or a stale draft KV, costs acceptance, never a token.

The draft's KV (DraftPool) is laid out as the target's: one slot per target slot, addressed through
the target's block tables, so a request's draft KV sits at the slots of its target KV and needs no
blocks, allocation or prefix-cache bookkeeping of its own; its memory is the target pool's times
the draft's KV width over the target's.

The draft KV is filled lazily, only for speculating items: a row's draft KV holds its first
`filled` positions, and before proposing, the draft is fed the tokens from there to the item's
last one, as one chunk or, when longer than max_batch_tokens, in passes of at most that (after a
back-off of plain steps, a prefix-cached start or the last proposal of a fully kept verification,
which the draft proposed but never fed). For that the engine tells
this class every row's tokens as it feeds them (`fed`): the row's tokens on the host, those it was
fed (proposals too, the refused ones cut by the row's next item) and the cached prefix it started with.
A row whose tokens have a gap (the worker was fed a start past what it knows) proposes its last
token over again until it is rebuilt from its first token: verification refuses what does not fit.
"""

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from services.worker.attention import StepLayout, build_batch
from services.worker.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from services.worker.model import Llama
    from services.worker.rows import StepColumns


class DraftPool:
    """The draft's K and V of every layer, [layers, slots, Hkv, D], at the target pool's slots; the
    block tables are the target's own arrays (read, never written here)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, target: "PagedKVCache", dtype: torch.dtype):
        self.block_size = target.block_size
        self.block_tables, self.blocks_held = target.block_tables, target.blocks_held
        self.slots = target.slots
        shape = (n_layers, target.keys.shape[1], n_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=target.device, dtype=dtype)
        self.values = torch.zeros(shape, device=target.device, dtype=dtype)
        self.layer_keys, self.layer_values = list(self.keys.unbind(0)), list(self.values.unbind(0))

    write = PagedKVCache.write  # (it reads only layer_keys and layer_values)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class DraftProposer:
    """A draft model and its KV, proposing for a target engine's speculating items."""

    def __init__(self, model: "Llama", target_cache: "PagedKVCache", max_rows: int, vocab_size: int,
                 chunk_tokens: int = 2048):
        config = model.config
        self.model = model
        self.chunk_tokens = max(2, chunk_tokens)  # the most tokens one draft pass feeds (max_batch_tokens)
        self.pool = DraftPool(config.n_layers, config.n_kv_heads, config.head_dim, target_cache, model.dtype)
        self.vocab_size = vocab_size  # the target's: a draft's padding ids past it are never proposed
        self.tokens: list[list[int] | None] = [[] for _ in range(max_rows)]  # None: a gap, nothing to feed
        self.filled = np.zeros(max_rows, dtype=np.int64)  # positions of each row's draft KV written
        self.passes = 0  # the draft's forward passes, and the tokens it was fed (the cost of proposing)
        self.tokens_fed = 0

    # Rows

    def start(self, row: int, history: Sequence[int]) -> None:
        """A row starts over, knowing the tokens before the first it will be fed (a cached prefix)."""
        self.tokens[row] = list(history)
        self.filled[row] = 0

    def fed(self, columns: "StepColumns") -> None:
        """After a step: each item's tokens from its start on. A verification's refused proposals
        stay past the row's KV length until its next item, whose start cuts them (and the draft KV
        written for them: `propose` and this read a row's draft KV only below the item's start). A
        plain item's positions were written by the target only: the draft KV from its start on is stale."""
        filled, tokens = self.filled, self.tokens
        speculating = columns.drafts
        for index, (row, start, fed) in enumerate(zip(columns.rows, columns.starts, columns.fed_tokens)):
            known = tokens[row]
            if known is None and start == 0:  # a rebuild from the first token: known again
                known = tokens[row] = []
            if known is not None:
                if len(known) < start:
                    tokens[row] = None
                else:
                    del known[start:]
                    known.extend(fed)
            if index not in speculating and filled[row] > start:
                filled[row] = start

    # Proposing

    def propose(self, columns: "StepColumns") -> None:
        """Write the draft's proposals over the placeholders of the step's speculating items (in
        columns.token_ids and fed_tokens), feeding the draft what it lacks of each."""
        offsets = np.cumsum(columns.counts) - np.asarray(columns.counts)
        items, rows, starts, chunks, wanted = [], [], [], [], []
        for index, count in sorted(columns.drafts.items()):
            row, start, last = columns.rows[index], columns.starts[index], columns.fed_tokens[index][0]
            known = self.tokens[row]
            if known is None or len(known) < start:
                self._write(columns, index, offsets[index], [last] * count)  # (a gap: nothing to propose from)
                continue
            begin = min(int(self.filled[row]), start)
            items.append(index)
            rows.append(row)
            starts.append(begin)
            chunks.append(known[begin:start] + [last])
            wanted.append(count)
        if not items:
            return
        self._catch_up(rows, starts, chunks)
        rows_array, wanted_array = np.asarray(rows, dtype=np.int64), np.asarray(wanted, dtype=np.int64)
        proposals = np.zeros((len(items), int(wanted_array.max())), dtype=np.int64)
        counts = np.asarray([len(chunk) for chunk in chunks], dtype=np.int64)
        positions = np.asarray(starts, dtype=np.int64) + counts  # where each item's next input goes
        picked = self._forward(rows_array, np.asarray(starts, dtype=np.int64), counts,
                               [token for chunk in chunks for token in chunk])
        proposals[:, 0] = picked
        for step in range(1, proposals.shape[1]):  # one pass per further proposal, for the items that want it
            going = np.flatnonzero(wanted_array > step)
            proposals[going, step] = self._forward(rows_array[going], positions[going] + step - 1,
                                                   np.ones(going.size, dtype=np.int64),
                                                   proposals[going, step - 1].tolist())
        # each row's draft KV now holds its tokens up to its last proposal but one
        self.filled[rows_array] = positions + wanted_array - 1
        for slot, index in enumerate(items):
            self._write(columns, index, offsets[index], proposals[slot, : wanted[slot]].tolist())

    def _catch_up(self, rows: list[int], starts: list[int], chunks: list[list[int]]) -> None:
        """Feed the draft the head of every chunk longer than a pass may take (a whole prompt after
        prefill, a cached prefix), in passes of at most chunk_tokens tokens (as the target's prompts
        are split by max_batch_tokens: a pass's attention scores grow with its tokens times its
        context), leaving each chunk at most chunk_tokens - 1 tokens before its last one. `starts`
        and `chunks` are updated in place."""
        limit = self.chunk_tokens
        while True:
            over = [slot for slot, chunk in enumerate(chunks) if len(chunk) > limit]
            if not over:
                return
            budget, pass_slots, pass_counts, pass_tokens = limit, [], [], []
            for slot in over:
                take = min(budget, len(chunks[slot]) - limit)
                if take <= 0:
                    break
                pass_slots.append(slot)
                pass_counts.append(take)
                pass_tokens += chunks[slot][:take]
                budget -= take
            self._forward(np.asarray([rows[slot] for slot in pass_slots], dtype=np.int64),
                          np.asarray([starts[slot] for slot in pass_slots], dtype=np.int64),
                          np.asarray(pass_counts, dtype=np.int64), pass_tokens)
            for slot, take in zip(pass_slots, pass_counts):
                starts[slot] += take
                del chunks[slot][:take]

    def _forward(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, token_ids: list[int]) -> np.ndarray:
        """One draft pass: each row's `count` tokens from `start` on written to its draft KV; the
        draft's greedy next token after each row's last."""
        model, config = self.model, self.model.config
        device = model.device
        query_starts = np.cumsum(counts) - counts
        total = int(counts.sum())
        positions = np.repeat(starts - query_starts, counts) + np.arange(total)
        slot_mapping = torch.from_numpy(self.pool.slots(np.repeat(rows, counts), positions)).to(device)
        batch = build_batch("batched", StepLayout(rows, query_starts, counts, starts), slot_mapping, self.pool,
                            config.n_heads // config.n_kv_heads, config.n_kv_heads * config.head_dim, device,
                            model.dtype)
        logits = model.forward(torch.tensor(token_ids, dtype=torch.long, device=device),
                               torch.from_numpy(positions).to(device), batch, self.pool,
                               torch.from_numpy(query_starts + counts - 1).to(device))
        self.passes += 1
        self.tokens_fed += total
        return logits[:, : self.vocab_size].argmax(dim=-1).cpu().numpy()

    @staticmethod
    def _write(columns: "StepColumns", index: int, offset: int, proposals: list[int]) -> None:
        last = columns.fed_tokens[index][0]
        columns.token_ids[offset + 1 : offset + 1 + len(proposals)] = proposals
        columns.fed_tokens[index] = (last, *proposals)

    @property
    def nbytes(self) -> int:
        """The draft's weights and KV pool."""
        from services.worker.engine import weight_bytes

        return weight_bytes(self.model) + self.pool.nbytes


def load_draft(path: str, target_model: str, tokenizer: str, target_cache: "PagedKVCache", max_rows: int,
               context_length: int, vocab_size: int, device: torch.device, dtype: torch.dtype,
               quantization: str | None = None, chunk_tokens: int = 2048) -> DraftProposer:
    """The draft model of a speculative config, on the target's device, in `dtype` (draft_dtype); a
    ModelFileError that says why where it cannot propose for the target (shared/speculative.py
    draft_model_problem)."""
    from services.worker.model import Llama
    from services.worker.weights import load_weights
    from shared.model_file import ModelFileError, load_metadata, serving_config
    from shared.speculative import draft_model_problem

    if problem := draft_model_problem(path, target_model, context_length, quantization == "gguf", tokenizer):
        raise ModelFileError(problem)
    metadata = load_metadata(path)
    if quantization == "gguf" and device.type != "cpu":
        raise ModelFileError(f"speculative_config: a draft with quantization gguf runs on the CPU only for now, "
                             f"not {device}")
    model = Llama(serving_config(metadata.config, context_length), load_weights(metadata, quantization or "none"),
                  device, dtype)
    return DraftProposer(model, target_cache, max_rows, vocab_size, chunk_tokens)
