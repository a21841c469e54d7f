"""msgpack on the wire, pydantic at every edge: decode() validates or raises WireError.

The per-token messages are positional arrays instead of maps (a token event is `[index, token,
text]` unless it carries more): the scheduler writes one per output token, so their encoding is
on its hot path and their size on Redis's; they are validated where they are read.
"""

from collections.abc import Iterable
from typing import Any, NamedTuple, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

Message = TypeVar("Message", bound=BaseModel)


class WireError(ValueError):
    """A message from Redis that is not valid msgpack or does not match its schema."""


def encode(message: BaseModel) -> bytes:
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def encode_row(row: NamedTuple) -> bytes:
    """encode() of the message whose fields a named tuple holds, in its order (IterationRow)."""
    return _PACKER.pack(row._asdict())


def decode(message_type: type[Message], data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise WireError(f"{message_type.__name__}: not msgpack: {error}") from error
    try:
        return message_type.model_validate(raw)
    except ValidationError as error:
        raise WireError(f"{message_type.__name__}: {error}") from error


def _unpack(name: str, data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise WireError(f"{name}: not msgpack: {error}") from error


# A token event's fields, in wire order; trailing defaults are left off.
TOKEN_EVENT_FIELDS = ("index", "token_id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "logprob",
                      "top_logprobs", "cached_tokens")
_TOKEN_EVENT_DEFAULTS = (None, 0, 0, None, None, 0)  # of the fields after text
# One packer for the process: msgpack.packb builds one per call, a third of a token event's cost.
# (Packer.pack holds the GIL from start to end, so threads cannot interleave in it.)
_PACKER = msgpack.Packer(use_bin_type=True)


def encode_token_event(index: int, token_id: int, text: str, finish_reason: str | None = None,
                       prompt_tokens: int = 0, completion_tokens: int = 0, logprob: float | None = None,
                       top_logprobs: tuple = (), cached_tokens: int = 0) -> bytes:
    """A TokenEvent as the scheduler writes it: no model object built, no validation (the reader's)."""
    if finish_reason is None and logprob is None and not (top_logprobs or prompt_tokens or completion_tokens
                                                          or cached_tokens):
        return _PACKER.pack((index, token_id, text))  # most entries: the rest are defaults, left off
    fields = [index, token_id, text, finish_reason, prompt_tokens, completion_tokens, logprob, top_logprobs or None,
              cached_tokens]
    while len(fields) > 3 and fields[-1] == _TOKEN_EVENT_DEFAULTS[len(fields) - 4]:
        fields.pop()
    return _PACKER.pack(fields)


def encode_plain_token_events(indexes: Iterable[int], token_ids: Iterable[int], texts: Iterable[str]) -> list[bytes]:
    """encode_token_event of many entries that carry only a token and its text (no finish, usage or
    logprobs: the rest are defaults, left off), in one call."""
    pack = _PACKER.pack
    return [pack(fields) for fields in zip(indexes, token_ids, texts)]


def decode_token_event(data: bytes):
    """A validated TokenEvent from its positional form (or the map form: any writer may use it)."""
    from shared.messages import TokenEvent

    raw = _unpack("TokenEvent", data)
    if isinstance(raw, list):
        if not 3 <= len(raw) <= len(TOKEN_EVENT_FIELDS):
            raise WireError(f"TokenEvent: {len(raw)} fields")
        raw = dict(zip(TOKEN_EVENT_FIELDS, raw))
        if raw.get("top_logprobs") is None:
            raw.pop("top_logprobs", None)
    try:
        return TokenEvent.model_validate(raw)
    except ValidationError as error:
        raise WireError(f"TokenEvent: {error}") from error
