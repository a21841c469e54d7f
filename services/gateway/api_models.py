"""Request bodies of the OpenAI-compatible endpoints, validated at the edge.

Types are strict (a string is not a number, a bool is not an int) and every refusal names the
field in `param`. Fields this server does not know are ignored, as OpenAI does; fields it knows
but does not implement (echo, logit_bias, tools, ...) are accepted only at their default.
"""

import json
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from services.gateway.errors import ApiError, bad_request
from shared.messages import SamplingParams

MAX_STOP_STRINGS = 4  # defaults of the limits; parse_body(limits=Settings) sets the server's own
MAX_STOP_LENGTH = 256
SEED_RANGE = 2**63  # SamplingParams.seed is in [0, 2**63); wider client seeds are folded into it

# Known OpenAI/vLLM parameters this server does not implement: the values that mean "off".
UNSUPPORTED_UNLESS_DEFAULT: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictBody):
    include_usage: bool | None = None


class GenerationParams(StrictBody):
    """The parameters both endpoints share."""

    model: str | None = None  # absent: the served model
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # newer name; wins over max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # -1 or 0: no top-k cut
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension (vLLM, llama.cpp)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # extension (vLLM)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Any = Field(None, validate_default=True)  # normalized to a tuple of strings
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool | None = None  # extension (vLLM): benchmarks force output lengths
    user: str | None = None
    # Accepted only at their default (see UNSUPPORTED_UNLESS_DEFAULT).
    echo: Any = None
    best_of: Any = None
    logit_bias: Any = None
    suffix: Any = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None

    @field_validator("n")
    @classmethod
    def only_one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(
                f"n={n} is not supported: this server returns exactly one choice (n=1); send separate requests"
            )
        return n

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, stop: Any, info: ValidationInfo) -> tuple[str, ...]:
        limits = info.context or {}
        max_strings = limits.get("max_stop_strings", MAX_STOP_STRINGS)
        max_length = limits.get("max_stop_length", MAX_STOP_LENGTH)
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
            raise ValueError("stop must be a string or a list of strings")
        if len(stop) > max_strings:
            raise ValueError(f"at most {max_strings} stop strings, got {len(stop)}")
        if any(item == "" for item in stop):
            raise ValueError("stop strings must not be empty")
        longest = max((len(item) for item in stop), default=0)
        if longest > max_length:
            raise ValueError(f"a stop string may have at most {max_length} characters, got {longest}")
        return tuple(text_of(item, "a stop string") for item in stop)

    def check_supported(self) -> None:
        for name, defaults in UNSUPPORTED_UNLESS_DEFAULT.items():
            value = getattr(self, name)
            if not _is_default(value, defaults):
                raise bad_request(f"`{name}`={_short(value)} is not supported by this server", param=name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_wanted(self) -> int:
        """-1: no logprobs; n >= 0: the chosen token's and the n most likely tokens' (per endpoint)."""
        return -1

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        seed = random.getrandbits(63) if self.seed is None else self.seed % SEED_RANGE

        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            temperature=given(self.temperature, 1.0),  # OpenAI's default
            top_p=given(self.top_p, 1.0),
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,
            min_p=given(self.min_p, 0.0),
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            logprobs=self.top_logprobs_wanted(),
            seed=seed,
            max_tokens=max_tokens,
            stop=self.stop,
            ignore_eos=bool(self.ignore_eos),
        )


class CompletionRequest(GenerationParams):
    # A string, a list of token ids, or a list holding one of those (a batch of one).
    prompt: Any
    # The legacy endpoint's logprobs: this many most likely tokens per position, and the chosen one's.
    logprobs: int | None = Field(None, ge=0, le=5)

    def top_logprobs_wanted(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, prompt: Any) -> str | tuple[int, ...]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            return text_of(prompt, "the prompt")
        if isinstance(prompt, list):
            if prompt and all(isinstance(item, str) for item in prompt):
                raise ValueError(f"a batch of {len(prompt)} prompts is not supported: send one prompt per request")
            if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
                return tuple(prompt)
        raise ValueError("prompt must be a string or a list of token ids")


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any

    @field_validator("content")
    @classmethod
    def text_content(cls, content: Any) -> str:
        if isinstance(content, str):
            return text_of(content, "content")
        if isinstance(content, list):
            texts = []
            for position, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"content part {position}: only {{\"type\": \"text\", \"text\": ...}} parts are supported"
                    )
                texts.append(text_of(part["text"], f"content part {position}"))
            return "".join(texts)
        raise ValueError("content must be a string or a list of text parts")

    def as_template_message(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    tool_choice: Any = None  # meaningless without tools, which are refused
    logprobs: bool | None = None  # the chosen tokens' log-probabilities
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many most likely tokens' (needs logprobs)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")

    def top_logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1


def text_of(text: str, what: str) -> str:
    """JSON can carry lone UTF-16 surrogates (\\ud800), which are no text: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate)") from None
    return text


def parse_body(
    model_type: type[GenerationParams], body: bytes, limits: dict[str, int] | None = None
) -> GenerationParams:
    """The validated request, or an ApiError naming the offending field.

    limits: max_stop_strings and max_stop_length, when the server sets its own.
    """
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise bad_request(f"malformed JSON body: {error}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model_type.model_validate(data, context=limits)
    except ValidationError as error:
        raise validation_error(error) from None
    request.check_supported()
    return request


def validation_error(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    param = loc_to_param(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return bad_request(f"`{param}` is required", param=param)
    return bad_request(f"invalid `{param}`: {message} (got {_short(first.get('input'))})", param=param)


def loc_to_param(loc: tuple[str | int, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    return param or "body"


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    for default in defaults:
        if default is None or isinstance(default, bool):
            if value is default:
                return True
        elif isinstance(default, (int, float)):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == default:
                return True
        elif value == default:
            return True
    return False


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if _is_json(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
