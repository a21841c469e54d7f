"""The prompt's log-probabilities in an answer: vLLM's `prompt_logprobs`, and the legacy
completions' `echo` with `logprobs` (the echoed prompt's tokens first in the logprobs lists).

The worker that prefills a request that asks for them computes them from the raw logits of every
prompt position (services/worker/prompt_logprobs.py) and writes them into the request's hash, a
field per step, before the entry of the request's first token: they are read here once that token
(or the answer's end) has arrived. The first prompt token has none (null, as vLLM and OpenAI give).
"""

import logging
from dataclasses import dataclass

from shared.messages import PromptLogprobsChunk, PromptTokenLogprobs
from shared.tokenizer import IncrementalDetokenizer

log = logging.getLogger("iterserve.gateway")


@dataclass(frozen=True)
class PromptLogprobs:
    token_ids: tuple[int, ...]  # the prompt's
    entries: list[PromptTokenLogprobs | None]  # per prompt position: None for the first


def assemble(request_id: str, prompt_token_ids: tuple[int, ...],
             chunks: list[PromptLogprobsChunk]) -> PromptLogprobs:
    """The chunks' entries by prompt position (a position written twice, by a rebuild: either)."""
    entries: list[PromptTokenLogprobs | None] = [None] * len(prompt_token_ids)
    for chunk in chunks:
        for position, entry in enumerate(chunk.entries, chunk.first_position):
            if position < len(entries) and entry[0] == prompt_token_ids[position]:
                entries[position] = entry
    missing = sum(entry is None for entry in entries[1:])
    if missing:  # (the worker writes every position before the first token: a bug, or an emulated executor)
        log.warning("prompt logprobs incomplete id=%s missing=%d of %d", request_id, missing, len(entries) - 1)
    return PromptLogprobs(prompt_token_ids, entries)


def vllm_body(prompt: PromptLogprobs, top: int, tokenizer) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt position, {token id: {logprob, rank, decoded_token}} for the
    prompt's token and the `top` most likely ones (ranks from 1), null for the first position."""
    body: list[dict | None] = []
    for entry in prompt.entries:
        if entry is None:
            body.append(None)
            continue
        token_id, logprob, rank, most_likely = entry
        position = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token_id)}}
        for likely_rank, (likely_id, likely_logprob) in enumerate(most_likely[:top], 1):
            position.setdefault(str(likely_id), {"logprob": likely_logprob, "rank": likely_rank,
                                                 "decoded_token": tokenizer.token_text(likely_id)})
        body.append(position)
    return body


def echo_logprobs_body(prompt: PromptLogprobs, top: int, tokenizer) -> dict:
    """The legacy completions' logprobs lists for the echoed prompt (the output's follow them): its
    tokens, their log-probabilities and `top` most likely tokens (null for the first token), and
    where each token's text starts in the answer's text."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    offsets, characters = [], 0
    for token_id in prompt.token_ids:
        offsets.append(characters)
        characters += len(detokenizer.push(token_id))
    return {
        "tokens": [tokenizer.token_text(token_id) for token_id in prompt.token_ids],
        "token_logprobs": [None if entry is None else entry[1] for entry in prompt.entries],
        "top_logprobs": [None if entry is None else {tokenizer.token_text(likely_id): likely_logprob
                                                      for likely_id, likely_logprob in entry[3][:top]}
                         for entry in prompt.entries],
        "text_offset": offsets,
    }


def joined(first: dict, then: dict | None) -> dict:
    """Two legacy logprobs objects, one after the other."""
    if then is None:
        return first
    return {name: first[name] + then[name] for name in first}
