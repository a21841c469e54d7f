"""When a request's newest output token ends it: one decision for the scheduler, which ends
requests, and the workers, which must not write the token entry of a token that ends its request
(its entry, with the finish and the usage, is the scheduler's: docs/protocol.md)."""

from collections.abc import Container

from shared.messages import FinishReason


def length_limit(max_tokens: int, prompt_length: int, context_length: int) -> int:
    """Output tokens at which a request ends by length (its max_tokens, or its context full)."""
    return min(max_tokens, context_length - prompt_length)


def finish_reason(token_id: int, output_count: int, limit: int, stop_token_ids: Container[int],
                  ignore_eos: bool) -> FinishReason | None:
    """Why the request ends with this token, its output_count-th (None: it goes on)."""
    if token_id in stop_token_ids and not ignore_eos:
        return "stop"
    if output_count >= limit:
        return "length"
    return None
