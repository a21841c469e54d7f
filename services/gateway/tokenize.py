"""vLLM's /tokenize and /detokenize: a prompt (or a conversation, rendered with the model's chat
template as the chat endpoint renders it) to token ids, and token ids back to text, in vLLM's shapes."""

import asyncio
import json
from typing import Any

from aiohttp import web
from jinja2 import TemplateError
from pydantic import Field, ValidationError, field_validator

from services.gateway.api_models import ChatMessage, StrictBody, text_of, validation_error
from services.gateway.errors import bad_request
from services.gateway.state import STATE

INLINE_CHARS = 4096  # longer texts are tokenized off the event loop


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None  # a completion prompt ...
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # ... or a conversation
    add_special_tokens: bool | None = None  # prompt: the BOS the model expects (default true)
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opening
    return_token_strs: bool = False

    @field_validator("prompt")
    @classmethod
    def valid_text(cls, prompt: str | None) -> str | None:
        return None if prompt is None else text_of(prompt, "the prompt")


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = _parse(TokenizeRequest, await request.read())
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of `prompt` and `messages`", param="prompt")
    model = state.model(body.model)
    tokenizer = model.tokenizer
    if body.messages is not None:
        messages = [message.as_template_message() for message in body.messages]
        size = sum(len(message["content"] or "") for message in messages)

        def work() -> list[int]:
            return tokenizer.encode_chat(messages, body.add_generation_prompt)
    else:
        size = len(body.prompt)

        def work() -> list[int]:
            if body.add_special_tokens is False:
                return tokenizer.encode(body.prompt)
            return tokenizer.encode_prompt(body.prompt)
    try:
        token_ids = await asyncio.to_thread(work) if size > INLINE_CHARS else work()
    except (TemplateError, TypeError) as error:
        raise bad_request(f"the chat template refused these messages: {error}", param="messages") from None
    answer: dict[str, Any] = {"count": len(token_ids), "max_model_len": model.context_length, "tokens": token_ids,
                              "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.token_text(token_id) for token_id in token_ids]
    return web.json_response(answer)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = _parse(DetokenizeRequest, await request.read())
    model = state.model(body.model)
    vocab_size = model.tokenizer.vocab_size
    bad = next((token_id for token_id in body.tokens if not 0 <= token_id < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of the vocabulary (0..{vocab_size - 1})", param="tokens")
    return web.json_response({"prompt": model.tokenizer.decode(body.tokens)})


def _parse(model_type, raw: bytes):
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise bad_request(f"malformed JSON body: {error}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model_type.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None
