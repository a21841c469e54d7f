"""The emulated executor: a worker without a model, for measuring the control plane at GPU step
times (a benchmarking instrument: never the default, and it says so in /status and every log line).

It takes the same plans as the engine and keeps the same request rows and paged-KV block tables
(services/worker/rows.py: the same checks, the same typed refusals, the same block accounting,
no tensors), answers each sampled item with a token derived from the request's (seed, output
index) alone, so outputs are exact and checkable across batches, workers and faults, and takes as
long as the hardware profile's roofline says the step would take (services/worker/hardware.py).
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
    from shared.messages import StepItem

log = logging.getLogger("iterserve.worker")

FIRST_TOKEN = 17  # emulated tokens avoid SmolLM2's control tokens (ids 0-16): no stop token, valid text
MASK64 = (1 << 64) - 1


def emulated_token(seed: int, output_index: int, vocab_size: int) -> int:
    """A token that depends on (seed, output index) only: splitmix64 of the two."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return FIRST_TOKEN + x % (vocab_size - FIRST_TOKEN)


class EmulatedEngine(RequestRows):
    executor = "emulated"

    def __init__(self, profile: HardwareProfile, kv_blocks: int, block_size: int, max_rows: int, vocab_size: int,
                 context_length: int, sleep=time.sleep):
        """vocab_size and context_length: the served model's (the gateway's tokenizer reads the
        tokens back); the profile gives only the time a step takes."""
        kv = BlockTables(kv_blocks, block_size, max_rows, -(-context_length // block_size))
        super().__init__(kv, context_length, vocab_size)
        self.profile = profile
        self.device_name = f"emulated:{profile.name}"
        self._sleep = sleep

    @classmethod
    def from_settings(cls, settings: "Settings") -> "EmulatedEngine":
        from shared.model_file import load_metadata

        profile = load_profile(settings.hardware)
        config = load_metadata(settings.model).config
        blocks = (profile.kv_blocks(settings.kv_block_size, settings.kv_memory_fraction)
                  if settings.kv_memory_fraction > 0 else settings.kv_blocks)
        engine = cls(profile, blocks, settings.kv_block_size, settings.max_batch_size, config.vocab_size,
                     config.context_length)
        log.info("event=engine_ready executor=emulated hardware=%s device=%r kv_blocks=%d "
                 "decode_step_ms_at_batch_1=%.2f note=EMULATED: no model runs, steps take the profile's time",
                 profile.name, profile.device_name, blocks, 1000 * profile.decode_step_seconds(1, 512))
        return engine

    def step(self, items: Sequence["StepItem"], return_logits: bool = False) -> StepOutcome:
        started = time.perf_counter()
        outcome = StepOutcome()
        columns = self.columns(items, outcome)
        if columns is not None:
            starts, counts = columns.starts, columns.counts
            seconds = self.profile.step_seconds(zip(starts, counts, columns.sample))
            rows = np.asarray(columns.rows, dtype=np.int64)
            self.kv_cache.lengths[rows] = np.asarray(starts, dtype=np.int64) + np.asarray(counts, dtype=np.int64)
            tokens = np.array([emulated_token(self._params[row].seed, output_index, self.vocab_size)
                               for row, output_index, sample in zip(columns.rows, columns.output_indices,
                                                                    columns.sample) if sample], dtype=np.int64)
            request_ids = self.sampled(columns, tokens)
            outcome.tokens = dict(zip(request_ids, tokens.tolist()))
            remaining = seconds - (time.perf_counter() - started)  # the host's own time is part of the step
            if remaining > 0:
                self._sleep(remaining)
        outcome.seconds = time.perf_counter() - started
        return outcome
