"""Each constrained row's grammar matcher (shared/grammar.py), and the masks of a step's constrained
rows as packed bitmasks ([rows, ceil(V / 32)] int32, bit t of a row: token t may follow).

A matcher's state is a function of the row's output tokens: it has consumed the first `consumed`
of them. A row sampling output index k whose matcher is elsewhere (a request moved here, preempted
and rebuilt, re-admitted after a restart, or given new parameters) is brought to k from the row's
own token history (services/worker/token_history.py keeps the tokens of every constrained row: its
prompt and output, whatever the prefix cache gave it): rolled back, or reset and fed them. So a
constrained request continues under its constraint exactly where it was, on any worker.

The masks are filled on the host, one row at a time, after the step's forward pass was launched: on
a GPU the fill overlaps the model's kernels; on the CPU it adds about 19 us a row (llguidance,
SmolLM2's vocabulary: benchmarks/results/grammar_engines.md). Unconstrained rows pay nothing.
"""

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from shared.grammar import GrammarCompiler
    from shared.messages import StructuredOutput

log = logging.getLogger("iterserve.worker")


class GrammarRows:
    def __init__(self, max_rows: int, vocab_size: int, compiler: "Callable[[], GrammarCompiler]"):
        """compiler: makes the GrammarCompiler on first use (its tokenizer takes about 0.2 s)."""
        self._make_compiler, self._compiler = compiler, None
        self.vocab_size = vocab_size
        self.constrained = np.zeros(max_rows, dtype=bool)
        self.consumed = np.zeros(max_rows, dtype=np.int64)  # output tokens each row's matcher consumed
        self._matchers: list = [None] * max_rows
        self._constraints: list["StructuredOutput | None"] = [None] * max_rows
        self._bitmask = np.zeros((max_rows, -(-vocab_size // 32)), dtype=np.int32)

    def start(self, row: int, constraint: "StructuredOutput") -> None:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        self._matchers[row] = self._compiler.matcher(constraint)
        self._constraints[row] = constraint
        self.constrained[row] = True
        self.consumed[row] = 0

    def stop(self, row: int) -> None:
        self._matchers[row] = self._constraints[row] = None
        self.constrained[row] = False
        self.consumed[row] = 0

    def masks(self, rows: np.ndarray, output_indices: np.ndarray, outputs: "Callable[[int, int, int], list[int]]",
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's constrained rows (positions among `rows`) and their bitmasks on the device, or
        None when no row of the step is constrained. outputs(row, start, end): the row's output
        tokens start..end-1 (from its history), for a matcher that must catch up."""
        positions = np.flatnonzero(self.constrained[rows])
        if positions.size == 0:
            return None
        bitmask = self._bitmask[: positions.size]
        for slot, position in enumerate(positions.tolist()):
            row, index = int(rows[position]), int(output_indices[position])
            matcher = self._matchers[row]
            if self.consumed[row] != index:
                matcher = self._move(row, index, outputs)
            matcher.unsafe_compute_mask_ptr(bitmask[slot].ctypes.data, bitmask.shape[1] * 4)
        return (torch.from_numpy(positions).to(device, non_blocking=True),
                torch.from_numpy(bitmask.copy()).to(device, non_blocking=True))

    def consume(self, rows: np.ndarray, output_indices: np.ndarray, tokens: np.ndarray) -> None:
        """The step's sampled tokens into the constrained rows' matchers."""
        for position in np.flatnonzero(self.constrained[rows]).tolist():
            row = int(rows[position])
            if self.consumed[row] != output_indices[position]:
                continue  # (caught up at its next sample)
            matcher = self._matchers[row]
            # A masked draw always fits (a stop token after the constraint ended too, again and again:
            # a plan of several steps samples past it): a refusal is a bug, said, and the matcher left
            # in its error state (its next mask allows nothing but the stop tokens).
            if not matcher.consume_token(int(tokens[position])):
                log.error("event=constraint_refused_token row=%d token=%d error=%s", row, int(tokens[position]),
                          matcher.get_error()[:200])
            self.consumed[row] += 1

    def _move(self, row: int, index: int, outputs: "Callable[[int, int, int], list[int]]"):
        """The row's matcher at output index `index`."""
        matcher, consumed = self._matchers[row], int(self.consumed[row])
        if consumed > index and not matcher.is_error() and matcher.rollback(consumed - index):
            self.consumed[row] = index
            return matcher
        if consumed > index or matcher.is_error():  # (a failed rollback leaves the matcher in error)
            matcher = self._matchers[row] = self._compiler.matcher(self._constraints[row])
            consumed = 0
        replay = outputs(row, consumed, index)
        if len(replay) != index - consumed or matcher.try_consume_tokens(replay) != len(replay):
            raise RuntimeError(f"row {row}: its output tokens {consumed}..{index - 1} do not follow its constraint")
        self.consumed[row] = index
        return matcher
