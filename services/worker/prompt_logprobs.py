"""Prompt log-probabilities (vLLM's `prompt_logprobs`; the completions' `echo` with `logprobs`): for
a request that asks, each prompt token's log-probability given the tokens before it, its rank, and
the most likely tokens at its position, from the raw logits of the prompt positions its chunks run.

The logits at position p give token p + 1's: within a chunk every position but the last finds that
token in the chunk; the last one's (a chunk that does not sample) waits here, as a row of
log-probabilities, for the next chunk's first token. Only a request's first prefill is read (items
of output index 0: no output yet). The scheduler gives such a request no cached blocks, so every
prompt position is computed on the worker that runs it; and the worker writes a step's prompt
log-probabilities with the result that carries the step's tokens, so once the first output token
is out they are all written, and a later rebuild computes none.
"""

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from services.worker.sampler import topk

# One prompt token's: (its token id, log-probability, rank among the vocabulary from 1, the most
# likely tokens at its position as (token id, log-probability), most likely first).
PromptEntry = tuple[int, float, int, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class PromptLogprobs:
    first_position: int  # the prompt position of the first entry's token (>= 1: the first token has none)
    entries: list[PromptEntry] = field(default_factory=list)  # consecutive positions from first_position


@dataclass(frozen=True)
class _Asking:
    """The columns of a step whose prompt positions are read, and where their logits are."""

    columns: np.ndarray  # column indexes of the step
    positions: np.ndarray  # flattened token positions whose logits are wanted, column after column
    own_rows: np.ndarray  # how many of those each column has


class PromptLogprobRows:
    def __init__(self, max_rows: int):
        self.wanted = np.full(max_rows, -1, dtype=np.int64)  # per row: -1 none, k >= 0 the top k too
        self.count = 0  # rows that ask
        # row -> (the prompt position the logprob row predicts, the log-probabilities [V] there)
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}

    def start(self, row: int, top: int) -> None:
        self.stop(row)
        if top >= 0:
            self.wanted[row] = top
            self.count += 1

    def stop(self, row: int) -> None:
        if self.wanted[row] >= 0:
            self.count -= 1
        self.wanted[row] = -1
        self._pending.pop(row, None)

    def asking(self, rows: np.ndarray, output_indices: np.ndarray, query_starts: np.ndarray, counts: np.ndarray,
               sampled: np.ndarray) -> _Asking | None:
        """The step's columns that read prompt positions, and the positions whose logits they need
        (every position of the chunk, but the one that samples the first output token)."""
        if not self.count:
            return None
        columns = np.flatnonzero((self.wanted[rows] >= 0) & (output_indices == 0))
        if not columns.size:
            return None
        own_rows = counts[columns] - sampled[columns]
        positions = np.concatenate([np.arange(query_starts[column], query_starts[column] + own)
                                    for column, own in zip(columns.tolist(), own_rows.tolist())])
        return _Asking(columns, positions.astype(np.int64), own_rows)

    def take(self, asking: _Asking, logits: torch.Tensor, request_ids: Sequence[str], rows: np.ndarray,
             starts: np.ndarray, counts: np.ndarray, fed_tokens: Sequence[Sequence[int]]
             ) -> dict[str, PromptLogprobs]:
        """Read the asking columns' logits ([positions, V], in asking.positions' order)."""
        found: dict[str, PromptLogprobs] = {}
        logprobs = torch.log_softmax(logits.float(), dim=1) if logits.shape[0] else logits.float()
        offset = 0
        for column, own in zip(asking.columns.tolist(), asking.own_rows.tolist()):
            row, start, count, tokens = int(rows[column]), int(starts[column]), int(counts[column]), fed_tokens[column]
            own_logprobs = logprobs[offset : offset + own]
            offset += own
            matrices, targets = [], []
            first = start + 1
            pending = self._pending.pop(row, None)
            if pending is not None and pending[0] == start:  # the last chunk's last position: this chunk's first token
                matrices.append(pending[1].unsqueeze(0))
                targets.append(int(tokens[0]))
                first = start
            within = min(own, count - 1)  # positions whose next token is in this chunk
            matrices.append(own_logprobs[:within])
            targets.extend(int(token) for token in tokens[1 : 1 + within])
            if own == count:  # the chunk does not sample: its last position's token comes next chunk
                self._pending[row] = (start + count, own_logprobs[count - 1].clone())
            if not targets:
                continue
            matrix = torch.cat(matrices)
            chosen = matrix.gather(1, torch.tensor(targets, device=matrix.device).unsqueeze(1))
            ranks = (matrix > chosen).sum(1) + 1
            top = int(self.wanted[row])
            top_ids: list[list[int]] = [[] for _ in targets]
            top_values: list[list[float]] = [[] for _ in targets]
            if top > 0:
                values, ids = topk(matrix, min(top, matrix.shape[1]))
                top_ids, top_values = ids.tolist(), values.tolist()
            found[request_ids[column]] = PromptLogprobs(first, [
                (token, logprob, rank, tuple(zip(ids_here, values_here)))
                for token, logprob, rank, ids_here, values_here in zip(
                    targets, chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_values)])
        return found
