"""Speculative decoding's configuration (vLLM's --speculative-config JSON) and the n-gram proposer.

The scheduler proposes (propose_ngram, over a request's prompt and output so far) and plans a
verification item per speculating request (services/scheduler/batch_formation.py); the worker
verifies every proposal in the one step (services/worker/speculation.py). Only what the scheduler
can propose from the tokens it already holds is served: `ngram` (vLLM's prompt lookup). A draft
model is refused at start with a message saying so.
"""

import json

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SPECULATIVE_TOKENS = 15  # proposals one item may carry (a result's per-item token count is a uint8)
METHODS = ("ngram",)


class SpeculativeConfig(BaseModel):
    """vLLM's fields (those iterserve serves); anything else is refused, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    # n-gram lookup: the longest suffix of n tokens (max .. min) that occurred before proposes what followed it
    prompt_lookup_min: int = Field(1, ge=1, le=64)
    prompt_lookup_max: int = Field(0, ge=0, le=64)  # 0: prompt_lookup_min (vLLM: one given, both are it)
    # vLLM's: no speculation for a worker's batch while it runs more than this many requests (a step
    # of many rows is no longer bound by reading the weights: verifying proposals costs compute).
    # 0: iterserve's default, DEFAULT_DISABLE_BY_BATCH_SIZE.
    disable_by_batch_size: int = Field(0, ge=0, le=4096)
    model: str | None = None  # a draft model: not served (see below)

    @model_validator(mode="after")
    def _served(self) -> "SpeculativeConfig":
        if self.method == "draft_model" or self.model:
            raise ValueError("method draft_model (a draft model) is not served yet: use method ngram")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r} (served: {', '.join(METHODS)})")
        if self.prompt_lookup_max and self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max {self.prompt_lookup_max} is below prompt_lookup_min "
                             f"{self.prompt_lookup_min}")
        return self

    @property
    def lookup_max(self) -> int:
        return self.prompt_lookup_max or self.prompt_lookup_min

    @property
    def batch_limit(self) -> int:
        return self.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE


# Speculation stops at a worker running more requests than this (the config's disable_by_batch_size
# overrides it). Measured on this project's CPU hosts (docs/speculation.md): a verification step of
# 4 rows x 5 tokens costs about a 4-row plain step in bfloat16 on the Intel class, and past ~8 rows
# a step is no longer bound by reading the weights, so proposals that fail cost their compute.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The --speculative-config JSON ("" : none); a ValueError that says what is wrong otherwise."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"speculative_config is not JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object, such as "
                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    try:
        return SpeculativeConfig.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, problem['loc'])) or 'config'}: {problem['msg']}"
                             for problem in error.errors())
        raise ValueError(f"speculative_config: {problems}") from None


def propose_ngram(tokens: list[int] | tuple[int, ...], count: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Prompt lookup (vLLM's `ngram` method): the `count` tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, for the longest n in max_n .. min_n that occurs
    before; [] when none does."""
    length = len(tokens)
    if count <= 0 or length < 2:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if n <= 0:
            break
        tail = array[length - n :]
        # windows ending before the tail's own start, latest first
        windows = np.lib.stride_tricks.sliding_window_view(array[: length - 1], n)
        matches = np.flatnonzero((windows == tail).all(axis=1))
        matches = matches[matches + n < length]  # something follows the match
        if matches.size:
            start = int(matches[-1]) + n
            return array[start : start + count].tolist()
    return []
