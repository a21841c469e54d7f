"""OpenAI response bodies and stream chunks for the two generation endpoints (pure functions)."""

import json
import secrets
from dataclasses import dataclass

from services.gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerationParams

DONE_EVENT = b"data: [DONE]\n\n"
# An SSE comment line: clients ignore it, a gone client fails the write. No blank line after it: the
# OpenAI Python client keeps the last event id and dispatches an empty event at any blank line.
KEEPALIVE_EVENT = b": keep-alive\n"


@dataclass(frozen=True)
class Endpoint:
    name: str  # metrics and log label
    request_type: type[GenerationParams]
    id_prefix: str
    object_name: str
    chunk_object_name: str
    prompt_param: str  # which field a too-long prompt is blamed on
    is_chat: bool

    def new_request_id(self) -> str:
        return f"{self.id_prefix}{secrets.token_hex(16)}"


COMPLETIONS = Endpoint(
    "completions", CompletionRequest, "cmpl-", "text_completion", "text_completion", "prompt", is_chat=False
)
CHAT = Endpoint(
    "chat", ChatCompletionRequest, "chatcmpl-", "chat.completion", "chat.completion.chunk", "messages", is_chat=True
)


def endpoint_of(request_id: str) -> Endpoint:
    return CHAT if request_id.startswith(CHAT.id_prefix) else COMPLETIONS


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage block; cached_tokens: prompt tokens whose KV was found in the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probabilities, as a TokenEvent brought them."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first
    text_offset: int  # where its text starts in the completion (characters)


def logprobs_body(endpoint: Endpoint, entries: list[TokenLogprob] | None, tokenizer) -> dict | None:
    """OpenAI's logprobs object: chat's `content` list, or the legacy completions' parallel lists.
    A token's text is its bytes decoded (U+FFFD where it holds part of a character; chat also
    gives the bytes)."""
    if entries is None:
        return None

    def text(token_id: int) -> str:
        return tokenizer.token_text(token_id)

    if endpoint.is_chat:
        def one(token_id: int, logprob: float) -> dict:
            return {"token": text(token_id), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}

        return {"content": [one(entry.token_id, entry.logprob) | {"top_logprobs": [one(*top) for top in entry.top]}
                            for entry in entries]}
    return {
        "tokens": [text(entry.token_id) for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{text(token_id): logprob for token_id, logprob in entry.top} for entry in entries],
        "text_offset": [entry.text_offset for entry in entries],
    }


def final_body(
    endpoint: Endpoint, request_id: str, created: int, model: str, text: str | None, finish_reason: str,
    token_usage: dict, logprobs: dict | None = None, tool_calls: list[dict] | None = None,
) -> dict:
    return whole_body(endpoint, request_id, created, model,
                      [final_choice(endpoint, 0, text, finish_reason, logprobs, tool_calls)], token_usage)


def final_choice(endpoint: Endpoint, index: int, text: str | None, finish_reason: str, logprobs: dict | None = None,
                 tool_calls: list[dict] | None = None) -> dict:
    if endpoint.is_chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def whole_body(endpoint: Endpoint, request_id: str, created: int, model: str, choices: list[dict],
               token_usage: dict) -> dict:
    return {
        "id": request_id,
        "object": endpoint.object_name,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": token_usage,
    }


class ChunkWriter:
    """Builds one request's SSE events in the OpenAI streaming format."""

    def __init__(self, endpoint: Endpoint, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self.endpoint = endpoint
        self.include_usage = include_usage
        self._base = {"id": request_id, "object": endpoint.chunk_object_name, "created": created, "model": model}

    def _event(self, choices: list[dict], token_usage: dict | None = None, event_id: int | None = None) -> bytes:
        chunk = {**self._base, "choices": choices}
        if self.include_usage:
            chunk["usage"] = token_usage  # null on every chunk but the last, as OpenAI does
        return sse(chunk, event_id)

    def role(self, index: int = 0) -> bytes:
        """The first chat chunk (of each choice): it names the role, as OpenAI's does."""
        delta = {"role": "assistant", "content": ""}
        return self._event([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

    def text(self, text: str, finish_reason: str | None = None, resume_from: int | None = None,
             logprobs: dict | None = None, index: int = 0) -> bytes:
        """resume_from: the output index a reader that got this chunk re-attaches from (SSE `id:`).
        logprobs: those of the tokens whose text this chunk carries. index: the choice's."""
        if self.endpoint.is_chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._event([choice], event_id=resume_from)

    def answer(self, content: str | None, tool_calls: list[dict], finish_reason: str, resume_from: int | None,
               logprobs: dict | None, index: int = 0) -> bytes:
        """A chat answer that may call tools, sent whole at its end: its content, or its calls as
        OpenAI's delta.tool_calls (each call whole in one delta, with its index), then the finish."""
        events = b""
        if tool_calls:
            delta = {"tool_calls": [{"index": position, **call} for position, call in enumerate(tool_calls)]}
            events += self._event([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
            logprobs = None
        elif content:
            events += self._event([{"index": index, "delta": {"content": content}, "logprobs": logprobs,
                                    "finish_reason": None}])
            logprobs = None
        return events + self._event([{"index": index, "delta": {}, "logprobs": logprobs,
                                      "finish_reason": finish_reason}], event_id=resume_from)

    def usage(self, token_usage: dict) -> bytes:
        return self._event([], token_usage)


def sse(data: dict, event_id: int | None = None) -> bytes:
    """One SSE event. Its `id:` (when given) is where the stream resumes: a client that lost its
    connection re-attaches with GET /v1/requests/{id}/stream?from=<last id> (or Last-Event-ID)."""
    head = b"" if event_id is None else b"id: %d\n" % event_id
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
