"""The per-row sampler the engine used before services/worker/sampler.py, kept only as the baseline
of benchmarks/sampling.py: greedy, temperature, top-k, top-p, with per-request seeded randomness.

The randomness of output token k of a request is drawn from a generator seeded by
(seed, k) alone, on the CPU: the same request samples the same tokens whatever else is in
its batch, whichever worker runs it, and after its KV is rebuilt mid-way.
"""

import hashlib

import torch

from shared.messages import SamplingParams


def step_seed(seed: int, output_index: int) -> int:
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + output_index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth_value = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probabilities, order = torch.sort(probabilities, descending=True)
        mass_before = torch.cumsum(sorted_probabilities, dim=-1) - sorted_probabilities
        sorted_probabilities[mass_before >= params.top_p] = 0.0  # keep the smallest set reaching top_p
        probabilities = torch.zeros_like(probabilities).scatter_(0, order, sorted_probabilities)
    return probabilities


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """[B, V] logits (one row per request) -> the next token of each request."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy for every row, overwritten where sampling
    for row, (request_params, output_index) in enumerate(zip(params, output_indices)):
        if request_params.temperature == 0:
            continue
        probabilities = filtered_probabilities(logits[row].cpu(), request_params)
        generator = torch.Generator().manual_seed(step_seed(request_params.seed, output_index))
        # Exponential race: argmax p / E with E ~ Exp(1) draws from p (one draw per token id).
        race = torch.empty_like(probabilities).exponential_(generator=generator)
        tokens[row] = int(torch.argmax(probabilities / race))
    return tokens
