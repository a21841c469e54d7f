"""Every penalised row's tokens so far (its prompt and its output), kept on the model's device: the
penalty stage's input, as vLLM v1 keeps token ids in its persistent input batch.

A row with penalties starts with the tokens it will not be fed (those of the cached blocks it
adopts: NewRequest.cached_token_ids); each step writes the tokens it feeds with one indexed copy of
the step's token tensor (a pipelined decode's token is already there, on the device), and a sample
reads the sampled rows' histories as two padded id tensors, prompt and output, split by each row's
output index: no Python per token, and none per row but the host's own lengths.
"""

import numpy as np
import torch

from services.worker.sampler import PenaltyHistory

FIRST_WIDTH = 1024  # tokens per row at first; doubled when a row needs more (up to the context length)


class TokenHistory:
    def __init__(self, max_rows: int, context_length: int, device: torch.device):
        self.context_length, self.device = context_length, device
        self.tracked = np.zeros(max_rows, dtype=bool)  # rows with penalties
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # tokens of each tracked row held
        self._ids = torch.zeros((max_rows, 0), dtype=torch.long, device=device)  # grown on first use

    @property
    def any_tracked(self) -> bool:
        return bool(self.tracked.any())

    def start(self, row: int, tokens: list[int] | tuple[int, ...]) -> None:
        """A row with penalties, holding these tokens first (it is fed what follows them)."""
        self.tracked[row] = True
        self.lengths[row] = len(tokens)
        if tokens:
            self._fit(len(tokens))
            self._ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=self.device)

    def stop(self, row: int) -> None:
        self.tracked[row] = False
        self.lengths[row] = 0

    def fed(self, token_rows: np.ndarray, positions: np.ndarray, token_ids: torch.Tensor, rows: np.ndarray,
            ends: np.ndarray) -> None:
        """A step's tokens (one row and position each, token_ids on the device) into the tracked rows
        among them; each item's row (rows) then holds its tokens up to its end (ends): a row rebuilt
        from an earlier position forgets what followed."""
        tracked = self.tracked[token_rows]
        if not tracked.any():
            return
        item_tracked = self.tracked[rows]
        self.lengths[rows[item_tracked]] = ends[item_tracked]
        self._fit(int(positions[tracked].max()) + 1)
        if tracked.all():
            self._ids[torch.from_numpy(token_rows).to(self.device), torch.from_numpy(positions).to(self.device)] = token_ids
            return
        which = torch.from_numpy(np.flatnonzero(tracked)).to(self.device)
        self._ids[torch.from_numpy(token_rows[tracked]).to(self.device),
                  torch.from_numpy(positions[tracked]).to(self.device)] = token_ids.index_select(0, which)

    def for_sample(self, rows: np.ndarray, output_indices: np.ndarray) -> PenaltyHistory | None:
        """The sampled rows' prompts and outputs so far ([rows, L] each, padded with -1; an untracked
        row's are all -1), or None when none of them is tracked. A row's tokens are its prompt, then
        the outputs before the one it samples (output_indices)."""
        lengths = np.where(self.tracked[rows], self.lengths[rows], 0)
        width = int(lengths.max(initial=0))
        if not self.tracked[rows].any():
            return None
        ids = self._ids[torch.from_numpy(rows).to(self.device), :width]
        position = torch.arange(width, device=self.device).unsqueeze(0)
        ends = torch.from_numpy(lengths).to(self.device).unsqueeze(1)
        prompt_ends = torch.from_numpy(np.maximum(lengths - output_indices, 0)).to(self.device).unsqueeze(1)
        none = torch.full_like(ids, -1)
        return PenaltyHistory(torch.where(position < prompt_ends, ids, none),
                              torch.where((position >= prompt_ends) & (position < ends), ids, none))

    def outputs(self, row: int, start: int, end: int) -> list[int]:
        """A tracked row's output tokens start..end-1, where end is the output index it samples now
        (its history then ends with output end - 1): a matcher catching up replays them."""
        first = int(self.lengths[row]) - end + start
        if not self.tracked[row] or first < 0:
            return []
        return self._ids[row, first: first + end - start].tolist()

    def _fit(self, tokens: int) -> None:
        width = self._ids.shape[1]
        if tokens <= width:
            return
        wider = max(FIRST_WIDTH, width)
        while wider < tokens:
            wider *= 2
        grown = torch.zeros((self._ids.shape[0], min(wider, max(self.context_length, tokens))), dtype=torch.long,
                            device=self.device)
        grown[:, :width] = self._ids
        self._ids = grown
