"""msgpack on the wire, pydantic at every edge: decode() validates or raises WireError."""

from typing import TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

Message = TypeVar("Message", bound=BaseModel)


class WireError(ValueError):
    """A message from Redis that is not valid msgpack or does not match its schema."""


def encode(message: BaseModel) -> bytes:
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def decode(message_type: type[Message], data: bytes) -> Message:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise WireError(f"{message_type.__name__}: not msgpack: {error}") from error
    try:
        return message_type.model_validate(raw)
    except ValidationError as error:
        raise WireError(f"{message_type.__name__}: {error}") from error
