"""Speculative decoding's verification: a step that feeds a request's last token and k proposed
tokens after it (StepItem.draft_tokens = k) samples k + 1 tokens at once, one at each position, each
with the randomness of its own output index, and keeps the proposals while each equals the token
sampled where it stands, then the token sampled after the last one kept.

Why this is exact: the token sampled at position i is the one decoding one token a step would
sample there, given the same tokens before it (the same logits, up to the last bits of a batched
matmul, and the same (seed, output index) uniforms): for a kept proposal they are the same tokens.
So greedy and seeded requests give the same tokens with and without speculation, whatever proposed
them. For a proposer that proposes one token per position (n-gram lookup, a greedy draft model) this
is also the best possible acceptance: the standard rejection rule (Leviathan et al. 2023) accepts a
proposal x with probability min(1, p(x) / q(x)) = p(x) when q is a point mass, the probability that
the token sampled there is x. (A draft model that samples its proposals would accept more under the
rejection rule, whose bonus token comes from the residual distribution instead; that rule is not
token-for-token the same as decoding without speculation, so it is not used here.)

The KV written for the proposals that were not kept stays in the pool past the request's length,
never read, and is overwritten by the next step.
"""

import numpy as np


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """0 .. count - 1 for each count, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if counts.size else 0) - np.repeat(ends - counts, counts)


def accepted(sampled: np.ndarray, proposed: list[tuple[int, ...]], per_item: np.ndarray) -> np.ndarray:
    """How many proposals each item keeps: sampled holds each item's draft + 1 tokens in a row, the
    token sampled at each proposal's position first, then the one after the last proposal."""
    kept = np.zeros(per_item.size, dtype=np.int64)
    begin = 0
    for index, (count, drafts) in enumerate(zip(per_item.tolist(), proposed)):
        if count > 1:
            differs = np.flatnonzero(sampled[begin : begin + count - 1] != np.asarray(drafts))
            kept[index] = differs[0] if differs.size else count - 1
        begin += count
    return kept


def propose_ngram(tokens: list[int] | tuple[int, ...], count: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Prompt lookup (vLLM's `ngram` method): the `count` tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, for the longest n in max_n .. min_n that occurs
    before; [] when none does."""
    length = len(tokens)
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
