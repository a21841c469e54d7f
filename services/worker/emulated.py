"""The emulated executor: a worker without a model, for measuring the control plane at GPU step
times (a benchmarking instrument: never the default, and it says so in /status and every log line).

It takes the same plans as the engine and keeps the same request rows and paged-KV block tables
(services/worker/rows.py: the same checks, the same typed refusals, the same block accounting),
and takes as long as the hardware profile's roofline says the step would take
(services/worker/hardware.py). Its "model" is a hash: each KV block holds, instead of keys and
values, a 64-bit sum over the tokens written into it (of a mix of each token and its position),
and a sampled item's token is a function of the request's seed, its output index and the sum over
the blocks its row's table holds (its context as this worker's KV has it). So outputs are exact
and checkable across batches, workers and faults (emulated_tokens gives them from the tokens
alone), and a KV fault changes them as it would a model's: a block adopted from the prefix cache
that holds other tokens, a block lost or overwritten, a prefix applied at the wrong place.
"""

import logging
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from services.worker.hardware import HardwareProfile, load_profile
from services.worker.kv_cache import BlockTables
from services.worker.rows import RequestRows, StepOutcome

if TYPE_CHECKING:
    from shared.config import Settings
    from shared.messages import SamplingParams, StepItem

log = logging.getLogger("iterserve.worker")

FIRST_TOKEN = 17  # emulated tokens avoid SmolLM2's control tokens (ids 0-16): no stop token, valid text
MASK64 = (1 << 64) - 1


def emulated_token(seed: int, output_index: int, vocab_size: int, context_digest: int = 0) -> int:
    """The token sampled at output_index by a request of this seed whose context (prompt and output
    before it) has this digest (context_digest): splitmix64 of the three."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + context_digest * 0xD6E8FEB86659FD93
         + 0x94D049BB133111EB) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return FIRST_TOKEN + x % (vocab_size - FIRST_TOKEN)


def emulated_token_array(seeds: np.ndarray, output_indexes: np.ndarray, vocab_size: int,
                         context_digests: np.ndarray) -> np.ndarray:
    """emulated_token over arrays (uint64 arithmetic wraps as the scalar version's masks do)."""
    with np.errstate(over="ignore"):
        x = (seeds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + output_indexes.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             + context_digests.astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93) + np.uint64(0x94D049BB133111EB))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (FIRST_TOKEN + x % np.uint64(vocab_size - FIRST_TOKEN)).astype(np.int64)


def token_marks(positions: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """What a token at a position adds to the digest of the KV holding it (uint64, wrapping):
    splitmix64 of the pair, so a token moved, changed or missing changes the sum."""
    with np.errstate(over="ignore"):
        x = positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + token_ids.astype(np.uint64) * np.uint64(
            0xBF58476D1CE4E5B9) + np.uint64(0x632BE59BD9B4E019)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def context_digest(token_ids: Sequence[int]) -> int:
    """The digest of a context (a request's prompt and output so far), as KV holding it sums to."""
    marks = token_marks(np.arange(len(token_ids), dtype=np.int64), np.asarray(token_ids, dtype=np.int64))
    return int(marks.sum(dtype=np.uint64))


def emulated_tokens(seed: int, prompt_ids: Sequence[int], count: int, vocab_size: int) -> list[int]:
    """The first `count` output tokens of a request, as the emulated executor samples them (its
    tokens from the tokens alone: the oracle of the emulated executor's KV)."""
    context, output = list(prompt_ids), []
    for index in range(count):
        token = emulated_token(seed, index, vocab_size, context_digest(context))
        output.append(token)
        context.append(token)
    return output


class KVDigests(BlockTables):
    """Block tables whose every block holds, for its KV, the sum of its tokens' marks (token_marks)."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int, max_blocks_per_row: int):
        super().__init__(num_blocks, block_size, max_rows, max_blocks_per_row)
        self.block_sums = np.zeros(num_blocks, dtype=np.uint64)

    def grow(self, row: int, total_tokens: int, request: str = "") -> None:
        held = int(self.blocks_held[row])
        super().grow(row, total_tokens, request)
        self.block_sums[self.block_tables[row, held : self.blocks_held[row]]] = 0  # fresh blocks hold no KV

    def write(self, rows: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> None:
        """The KV of tokens at positions of rows (one each), written into their blocks."""
        blocks = self.block_tables[rows, positions // self.block_size]
        np.add.at(self.block_sums, blocks, token_marks(positions, token_ids))

    def digests(self, rows: np.ndarray) -> np.ndarray:
        """Each row's context digest: the sum over the blocks its table holds (uint64)."""
        held = self.blocks_held[rows]
        widest = int(held.max()) if held.size else 0
        tables = self.block_tables[rows, :widest]
        sums = np.where(np.arange(widest) < held[:, None], self.block_sums[tables], np.uint64(0))
        return sums.sum(axis=1, dtype=np.uint64)


class EmulatedEngine(RequestRows):
    """(Constraints and logit_bias are not applied: no model runs, its tokens are a hash of the
    context, never text; a benchmark of constrained requests on it measures the control plane only.)"""

    executor = "emulated"

    def __init__(self, profile: HardwareProfile, kv_blocks: int, block_size: int, max_rows: int, vocab_size: int,
                 context_length: int, sleep=time.sleep):
        """vocab_size and context_length: the served model's (the gateway's tokenizer reads the
        tokens back); the profile gives only the time a step takes."""
        kv = KVDigests(kv_blocks, block_size, max_rows, -(-context_length // block_size))
        super().__init__(kv, context_length, vocab_size)
        self.profile = profile
        self.device_name = f"emulated:{profile.name}"
        self._seeds = np.zeros(max_rows, dtype=np.uint64)  # each row's request's seed
        self._sleep = sleep

    @classmethod
    def from_settings(cls, settings: "Settings") -> "EmulatedEngine":
        from shared.model_file import load_metadata, serving_config

        profile = load_profile(settings.hardware)
        config = serving_config(load_metadata(settings.model).config, settings.max_model_len)
        if settings.gpu_memory_utilization > 0:  # vLLM's meaning, on the profile's device
            blocks = profile.kv_blocks_in_share(settings.kv_block_size, settings.gpu_memory_utilization)
        elif settings.kv_memory_fraction > 0:
            blocks = profile.kv_blocks(settings.kv_block_size, settings.kv_memory_fraction)
        else:
            blocks = settings.kv_blocks
        engine = cls(profile, blocks, settings.kv_block_size, settings.max_batch_size, config.vocab_size,
                     config.context_length)
        log.info("event=engine_ready executor=emulated hardware=%s device=%r kv_blocks=%d "
                 "decode_step_ms_at_batch_1=%.2f note=EMULATED: no model runs, steps take the profile's time",
                 profile.name, profile.device_name, blocks, 1000 * profile.decode_step_seconds(1, 512))
        return engine

    def _draft_refusal(self, item, count: int, row: int) -> str | None:
        return "the emulated executor does not verify proposed tokens"

    def _row_added(self, row: int, sampling: "SamplingParams", history: Sequence[int]) -> None:
        self._seeds[row] = sampling.seed

    def step(self, items: Sequence["StepItem"]) -> StepOutcome:
        started = time.perf_counter()
        outcome = StepOutcome()
        columns = self.columns(items, outcome)
        if columns is not None:
            starts, counts = columns.starts, columns.counts
            seconds = self.profile.step_seconds(zip(starts, counts, columns.sample))
            rows = np.asarray(columns.rows, dtype=np.int64)
            begins, lengths = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
            token_ids = np.asarray(columns.token_ids, dtype=np.int64)
            if columns.feed_positions:  # the tokens it sampled for them in the step before
                token_ids[columns.feed_positions] = self._last_token_host[columns.feed_rows]
            offsets = np.arange(token_ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            self.kv_cache.write(np.repeat(rows, lengths), np.repeat(begins, lengths) + offsets, token_ids)
            self.kv_cache.lengths[rows] = begins + lengths
            sampled = np.asarray(columns.sample, dtype=bool)
            sampled_rows = rows[sampled]
            tokens = emulated_token_array(self._seeds[sampled_rows],
                                          np.asarray(columns.output_indices, dtype=np.int64)[sampled],
                                          self.vocab_size, self.kv_cache.digests(sampled_rows))
            request_ids = self.sampled(columns, tokens)
            outcome.tokens = dict(zip(request_ids, tokens.tolist()))
            remaining = seconds - (time.perf_counter() - started)  # the host's own time is part of the step
            if remaining > 0:
                self._sleep(remaining)
        outcome.seconds = time.perf_counter() - started
        return outcome
