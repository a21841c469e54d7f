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

from shared.speculative import propose_ngram  # noqa: F401 (the proposer, with the scheduler that runs it)


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
