"""Speculative decoding's configuration (vLLM's --speculative-config JSON) and the n-gram proposer.

The scheduler plans a verification item per speculating request (services/scheduler/batch_formation.py)
and the worker verifies every proposal in the one step (services/worker/speculation.py). Who proposes:
- `ngram` (vLLM's prompt lookup): the scheduler, over the tokens it already holds (propose_ngram);
- `draft_model`: the worker, with a second, smaller model of the same tokenizer that it runs before
  the target on the speculating items (services/worker/draft.py); the scheduler's plan holds
  placeholders where the proposals go.
"""

import json

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SPECULATIVE_TOKENS = 15  # proposals one item may carry (a result's per-item token count is a uint8)
METHODS = ("ngram", "draft_model")


class SpeculativeConfig(BaseModel):
    """vLLM's fields (those iterserve serves); anything else is refused, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = ""  # "": draft_model where a model is given (as vLLM infers it)
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    # n-gram lookup: the longest suffix of n tokens (max .. min) that occurred before proposes what followed it
    prompt_lookup_min: int = Field(1, ge=1, le=64)
    prompt_lookup_max: int = Field(0, ge=0, le=64)  # 0: prompt_lookup_min (vLLM: one given, both are it)
    # vLLM's: no speculation for a worker's batch while it runs more than this many requests (a step
    # of many rows is no longer bound by reading the weights: verifying proposals costs compute).
    # 0: iterserve's default, DEFAULT_DISABLE_BY_BATCH_SIZE.
    disable_by_batch_size: int = Field(0, ge=0, le=4096)
    model: str | None = None  # the draft model (method draft_model): a GGUF, checkpoint directory or name
    # vLLM's: how the draft's weights are held. "gguf": a GGUF draft's quantized tensors kept packed
    # (as --quantization gguf holds a target's; CPU only, in bfloat16): a cheap draft made of the
    # target's own GGUF, say. None: as the target's dtype, dequantized.
    quantization: str | None = None

    @model_validator(mode="after")
    def _served(self) -> "SpeculativeConfig":
        if not self.method:
            if not self.model:
                raise ValueError("no method: give method ngram, or method draft_model with a model")
            object.__setattr__(self, "method", "draft_model")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs a model (the draft: a GGUF, a checkpoint directory or "
                             "smollm2-135m-instruct)")
        if self.method == "ngram" and self.model:
            raise ValueError("method ngram proposes from the request's own tokens: it takes no model")
        if self.quantization not in (None, "none", "gguf"):
            raise ValueError(f"quantization {self.quantization!r}: a draft's weights are held as the target's "
                             "dtype (none) or packed from its GGUF (gguf)")
        if self.quantization == "gguf" and self.method != "draft_model":
            raise ValueError("quantization is the draft model's: method ngram has none")
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
    def proposed_by_worker(self) -> bool:
        """Whether the worker proposes (a draft model), the plan holding placeholders for it."""
        return self.method == "draft_model"

    @property
    def draft_packed(self) -> bool:
        """Whether the draft's GGUF tensors are kept packed (quantization gguf)."""
        return self.quantization == "gguf"

    @property
    def batch_limit(self) -> int:
        if self.disable_by_batch_size:
            return self.disable_by_batch_size
        return DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE if self.proposed_by_worker else DEFAULT_DISABLE_BY_BATCH_SIZE


# Speculation stops at a worker running more requests than this (the config's disable_by_batch_size
# overrides it). Measured on this project's CPU hosts (docs/benchmarks.md): a verification step of
# 4 rows x 5 tokens costs about a 4-row plain step in bfloat16 on the Intel class, and past ~8 rows
# a step is no longer bound by reading the weights, so proposals that fail cost their compute.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# A draft model's proposals cost its passes, one per proposal, each costing more with every row.
# Measured with SmolLM2's own Q4 GGUF as the draft of its float32 self on the AMD EPYC AVX2 class
# (docs/benchmarks.md, "With a draft model"): 1.28-1.42x at one request, 0.66x at two, 0.46x at
# four. A draft far smaller than its target moves that point: the config's disable_by_batch_size sets it.
DEFAULT_DRAFT_DISABLE_BY_BATCH_SIZE = 1


# Per request, at its end: the share of its proposed tokens kept, counted into these buckets (upper
# bounds), the sum of the shares in thousandths, and the requests counted (Redis counters of these
# names; /metrics shows them as the histogram iterserve:spec_decode_request_acceptance_rate).
ACCEPTANCE_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
ACCEPTANCE_COUNTERS = (*(f"spec_request_acceptance_le_{round(bound * 100)}" for bound in ACCEPTANCE_BUCKETS),
                       "spec_request_acceptance_permille_sum", "spec_requests")


def acceptance_bucket(kept: int, proposed: int) -> str:
    """The counter of the first bucket that holds kept / proposed."""
    share = kept / proposed
    bound = next(bound for bound in ACCEPTANCE_BUCKETS if share <= bound)
    return f"spec_request_acceptance_le_{round(bound * 100)}"


def speculation_status(counters: dict[str, int], method: str, num_speculative_tokens: int) -> dict | None:
    """A model's speculative decoding as /status shows it (and /dashboard draws it): its method, the
    scheduler's lasting counters (those /metrics shows under vLLM's names) and the per-request
    acceptance histogram's requests per bucket (not cumulative). None for a model that neither
    speculates nor ever verified a proposal. mean_acceptance_length is vLLM's: tokens a verification
    gives, 1 + kept / verifications (the target's own token after the kept proposals)."""
    verifications = counters.get("spec_drafts", 0)
    if not method and not verifications:
        return None
    proposed, kept = counters.get("spec_draft_tokens", 0), counters.get("spec_accepted_tokens", 0)
    requests = counters.get("spec_requests", 0)
    return {
        "method": method, "num_speculative_tokens": num_speculative_tokens,
        "verifications": verifications, "proposed_tokens": proposed, "accepted_tokens": kept,
        "acceptance_rate": kept / proposed if proposed else None,
        "mean_acceptance_length": 1 + kept / verifications if verifications else None,
        "requests": requests,  # that verified proposals and ended
        "request_acceptance_rate_mean": (counters.get("spec_request_acceptance_permille_sum", 0) / 1000 / requests
                                         if requests else None),
        # Each bucket: the requests whose share kept is at most `le` and above the bucket before's.
        "request_acceptance_buckets": [{"le": bound, "requests": counters.get(name, 0)}
                                       for bound, name in zip(ACCEPTANCE_BUCKETS, ACCEPTANCE_COUNTERS)],
    }


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


def draft_model_problem(draft: str, target: str, context_length: int, packed: bool = False,
                        tokenizer: str = "") -> str | None:
    """Why `draft` cannot propose for `target` (its tokenizer `tokenizer` where one replaces its own)
    served with this context length, or None: it must load, speak the same vocabulary (token for
    token: a proposal is a token id of the target's), embed every id the target may sample (a
    target's padded embedding rows included: the draft is fed them) and hold the served context
    (its positions reach every one the target's do)."""
    from shared.model_file import ModelFileError, load_metadata
    from shared.tokenizer import Tokenizer

    try:
        draft_metadata = load_metadata(draft)
        draft_vocabulary = Tokenizer.load(draft).vocabulary()
    except (ModelFileError, OSError, ValueError) as error:
        return f"speculative_config: the draft model {draft}: {error}"
    if packed and draft_metadata.format != "gguf":
        return f"speculative_config: quantization gguf packs a GGUF draft's tensors, and {draft} is not a GGUF file"
    target_vocabulary = Tokenizer.load(tokenizer or target).vocabulary()
    if draft_vocabulary != target_vocabulary:
        differ = len(set(draft_vocabulary.items()) ^ set(target_vocabulary.items()))
        return (f"speculative_config: the draft model {draft} has another tokenizer than {target} "
                f"({len(draft_vocabulary)} against {len(target_vocabulary)} tokens, {differ} entries differ): "
                "a draft must share the target's vocabulary")
    target_rows = load_metadata(target).config.vocab_size
    if draft_metadata.config.vocab_size < target_rows:
        return (f"speculative_config: the draft model {draft} embeds {draft_metadata.config.vocab_size} token ids, "
                f"fewer than the {target_rows} {target} may sample")
    if draft_metadata.config.context_length < context_length:
        return (f"speculative_config: the draft model {draft} holds {draft_metadata.config.context_length} "
                f"positions, fewer than the {context_length} served for {target}: pass a smaller --max-model-len")
    return None


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
