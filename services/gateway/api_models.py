"""Request bodies of the OpenAI-compatible endpoints, validated at the edge.

Types are strict (a string is not a number, a bool is not an int) and every refusal names the
field in `param`. Fields this server does not know are ignored, as OpenAI does; fields of OpenAI's
or vLLM's that would change the output and are not implemented here (best_of, suffix, vLLM's
min_tokens, ...) are accepted only at their default, so that no client gets an
output silently other than the one it asked for.

Structured outputs come in any of the names clients use, one per request: OpenAI's
response_format (json_object, json_schema), vLLM's structured_outputs object (json, regex, choice,
grammar, json_object) and its older guided_json / guided_regex / guided_choice / guided_grammar.
"""

import json
import random
from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from services.gateway.errors import ApiError, bad_request
from shared.messages import MAX_LOGIT_BIAS, SamplingParams, StructuredOutput

MAX_STOP_STRINGS = 4  # defaults of the limits; parse_body(limits=Settings) sets the server's own
MAX_STOP_LENGTH = 256
SEED_RANGE = 2**63  # SamplingParams.seed is in [0, 2**63); wider client seeds are folded into it

# Known OpenAI/vLLM parameters this server does not implement: the values that mean "off".
UNSUPPORTED_UNLESS_DEFAULT: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    # vLLM's extensions that change what is generated
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "logits_processors": (None, []),
    "guided_whitespace_pattern": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None, []),
    "vllm_xargs": (None, {}),
}
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
MAX_CHOICES = 256  # strings of one guided_choice
MAX_N = 16  # choices of one request (n)
MAX_TOP_LOGPROBS = 20  # most likely tokens per position (OpenAI's top_logprobs limit; vLLM's max_logprobs)
MAX_SPEC_CHARS = 65536  # a schema, regex or grammar, as JSON text


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictBody):
    include_usage: bool | None = None


class GenerationParams(StrictBody):
    """The parameters both endpoints share."""

    # Read from the body by check_supported (parse_body calls it)
    _structured: tuple[StructuredOutput, str] | None = None
    _logit_bias: tuple[tuple[int, float], ...] = ()

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
    # OpenAI's: token id (as a string) -> bias in [-100, 100], added to that token's logit
    logit_bias: dict[str, float] | None = None
    # Structured outputs (STRUCTURED_FIELDS; at most one given): read by structured_output()
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None  # (vLLM's choice of engine: this server has one)
    # vLLM's: each prompt token's log-probability and rank, and this many most likely tokens at its
    # position (the answer's prompt_logprobs: the first token's is null)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted only at their default (see UNSUPPORTED_UNLESS_DEFAULT).
    best_of: Any = None
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    documents: Any = None
    vllm_xargs: Any = None

    @field_validator("n")
    @classmethod
    def choices_within_limit(cls, n: int | None) -> int | None:
        if n is not None and not 1 <= n <= MAX_N:
            raise ValueError(f"n must be 1 to {MAX_N}, got {n}")
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
        self._structured = self._read_structured()
        self._logit_bias = self._read_logit_bias()
        if self.prompt_logprobs is not None and self.stream:  # (vLLM's refusal, and its words)
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if self._structured is not None and self.ignore_eos:
            raise bad_request("`ignore_eos` cannot be combined with a structured output: the output ends where "
                              "its constraint does", param="ignore_eos")

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The request's constraint and the parameter it came in (for a 400 naming it), or None."""
        return self._structured

    def _read_structured(self) -> tuple[StructuredOutput, str] | None:
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and getattr(self, name) == {"type": "text"})]
        if len(given) > 1:
            raise bad_request(f"at most one structured output per request: {', '.join(given)} were given",
                              param=given[1])
        if not given:
            return None
        name = given[0]
        value = getattr(self, name)
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise bad_request("`structured_outputs` must be an object", param=name)
            kinds = {key: item for key, item in value.items() if key in ("json", "regex", "choice", "grammar",
                                                                         "json_object") and item not in (None, False)}
            # (backend and disable_fallback choose vLLM's engine; this server has one, and writes JSON
            # without whitespace whatever disable_any_whitespace says. What would change the output
            # otherwise is refused unless at its default.)
            unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object", "backend",
                                            "disable_fallback", "disable_any_whitespace",
                                            "disable_additional_properties", "whitespace_pattern"})
            unknown += [key for key, default in (("disable_additional_properties", False),
                                                 ("whitespace_pattern", None))
                        if key in value and value[key] not in (default, None)]
            if unknown:
                raise bad_request(f"`structured_outputs.{unknown[0]}` is not supported by this server",
                                  param=f"{name}.{unknown[0]}")
            if len(kinds) != 1:
                raise bad_request("`structured_outputs` needs exactly one of json, regex, choice, grammar, "
                                  "json_object", param=name)
            [(kind, item)] = kinds.items()
            return _constraint(kind, item, f"{name}.{kind}"), f"{name}.{kind}"
        return _constraint(name.removeprefix("guided_"), value, name), name

    def _read_logit_bias(self) -> tuple[tuple[int, float], ...]:
        if not self.logit_bias:
            return ()
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                              param="logit_bias")
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit() or not key.isascii():
                raise bad_request(f"`logit_bias` keys are token ids, got {_short(key)}", param="logit_bias")
            if not -100 <= value <= 100:
                raise bad_request(f"`logit_bias` values are in [-100, 100], got {value} for token {key}",
                                  param="logit_bias")
            bias[int(key)] = float(value)
        return tuple(sorted(bias.items()))

    def logit_bias_ids(self) -> tuple[int, ...]:
        return tuple(token_id for token_id, _ in self._logit_bias)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_wanted(self) -> int:
        """-1: no logprobs; n >= 0: the chosen token's and the n most likely tokens' (per endpoint)."""
        return -1

    def echo_logprobs(self) -> int:
        """-1, or (completions' echo with logprobs) the most likely tokens wanted at each prompt position."""
        return -1

    def prompt_logprobs_wanted(self) -> int:
        """-1: the prompt's log-probabilities are not computed; n >= 0: with the n most likely tokens."""
        return max(-1 if self.prompt_logprobs is None else self.prompt_logprobs, self.echo_logprobs())

    def sampling_params(self, max_tokens: int, constraint: StructuredOutput | None = None) -> SamplingParams:
        """constraint: the output's, when the server sets it (tool calls), else the request's own."""
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
            prompt_logprobs=self.prompt_logprobs_wanted(),
            seed=seed,
            max_tokens=max_tokens,
            stop=self.stop,
            ignore_eos=bool(self.ignore_eos),
            logit_bias=self._logit_bias,
            structured=constraint or (structured[0] if (structured := self.structured_output()) else None),
        )


class CompletionRequest(GenerationParams):
    # A string, a list of token ids, or a list holding one of those (a batch of one).
    prompt: Any
    # The legacy endpoint's logprobs: this many most likely tokens per position, and the chosen one's.
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None  # the answer's text starts with the prompt's
    tools: Any = None  # (chat completions' only)
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise bad_request(f"`{name}` is for chat completions (/v1/chat/completions)", param=name)

    def top_logprobs_wanted(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def echo_logprobs(self) -> int:
        return self.logprobs if self.echo and self.logprobs is not None else -1

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


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's function names


class FunctionCall(StrictBody):
    name: str = Field(pattern=TOOL_NAME)
    arguments: str  # JSON text of an object

    @field_validator("arguments")
    @classmethod
    def json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError("arguments must be JSON text of an object") from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be JSON text of an object")
        return arguments


class ToolCall(StrictBody):
    """A call an assistant made, as a conversation's history carries it."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(StrictBody):
    class Function(StrictBody):
        name: str

    type: Literal["function"]
    function: Function


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # None only for an assistant's message that carries tool_calls
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def roles_fields(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant's message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant's message carries tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @field_validator("content")
    @classmethod
    def text_content(cls, content: Any) -> str | None:
        if content is None:
            return None
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

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention: a call's arguments as an object)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: Any = None  # (vLLM's chat echo, of the last message: not supported, refused unless false)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Any = None  # "none", "auto", "required" or a NamedToolChoice (read by check_supported)
    parallel_tool_calls: bool | None = None  # default true: an answer may make several calls
    logprobs: bool | None = None  # the chosen tokens' log-probabilities
    # and this many most likely tokens' (needs logprobs)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo not in (None, False):
            raise bad_request(f"`echo`={_short(self.echo)} is not supported on chat completions", param="echo")
        self._check_tools()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")

    def top_logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1

    def _check_tools(self) -> None:
        if isinstance(self.tool_choice, dict):
            try:
                self.tool_choice = NamedToolChoice.model_validate(self.tool_choice)
            except ValidationError as error:
                raise bad_request("`tool_choice` must be none, auto, required or {\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ...}}}}: {error.errors()[0]['msg']}",
                                  param="tool_choice") from None
        elif self.tool_choice not in (None, "none", "auto", "required"):
            raise bad_request(f"`tool_choice` must be none, auto, required or a named function, got "
                              f"{_short(self.tool_choice)}", param="tool_choice")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise bad_request("two tools have the same name", param="tools")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise bad_request("`tool_choice` needs `tools`", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise bad_request(f"`tool_choice` names the function {_short(self.tool_choice.function.name)}, which "
                              f"is not among the tools ({', '.join(names)})", param="tool_choice")
        if self.tools_active and self.structured_output() is not None:
            raise bad_request("a structured output with tools is not supported: give one or the other",
                              param=self.structured_output()[1])
        for tool in self.tools or ():
            if tool.function.parameters is not None:
                try:
                    Draft202012Validator.check_schema(tool.function.parameters)
                except SchemaError as error:
                    raise bad_request(f"tool {tool.function.name}'s parameters are not a JSON Schema: "
                                      f"{error.message}", param="tools") from None
        calls: set[str] = set()
        for position, message in enumerate(self.messages):
            for call in message.tool_calls or ():
                calls.add(call.id)
            if message.role == "tool" and message.tool_call_id not in calls:
                raise bad_request(f"message {position} answers the tool call {_short(message.tool_call_id)}, which "
                                  "no assistant message before it made", param=f"messages[{position}].tool_call_id")

    @property
    def tools_active(self) -> bool:
        """Whether the model is offered the tools (tool_choice none offers them not)."""
        return bool(self.tools) and self.tool_choice != "none"


def _response_format(value: Any) -> tuple[StructuredOutput, str]:
    """OpenAI's response_format (json_object, or json_schema with its name, schema and strict), and
    the parameter a bad grammar is named by."""
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("`response_format` must be an object with a `type`", param=param)
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutput(kind="json_object"), param
    if kind != "json_schema":
        raise bad_request(f"`response_format.type` must be text, json_object or json_schema, got {_short(kind)}",
                          param=f"{param}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("`response_format.json_schema` is required with type json_schema (an object with "
                          "`name` and `schema`)", param=f"{param}.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad_request("`response_format.json_schema.name` must be a string of 1 to 64 characters",
                          param=f"{param}.json_schema.name")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_request("`response_format.json_schema.strict` must be a boolean",
                          param=f"{param}.json_schema.strict")
    schema_param = f"{param}.json_schema.schema"
    return _constraint("json", spec.get("schema", {}), schema_param), schema_param


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    """A constraint of one kind from its request value (shapes checked here, grammar at compile)."""
    if kind == "json_object":
        return StructuredOutput(kind="json_object")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise bad_request(f"`{param}` is not valid JSON: {error}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"`{param}` must be a JSON Schema (an object)", param=param)
        spec = json.dumps(value)  # (in its own key order: an object's properties are written in it)
    elif kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(item, str) and item for item in value)):
            raise bad_request(f"`{param}` must be a list of 1 to {MAX_CHOICES} non-empty strings", param=param)
        spec = json.dumps([text_of(item, f"a string of `{param}`") for item in value])
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise bad_request(f"`{param}` must be a non-empty string", param=param)
        spec = text_of(value, f"`{param}`")
    if len(spec) > MAX_SPEC_CHARS:
        raise bad_request(f"`{param}` is too long: {len(spec)} characters, at most {MAX_SPEC_CHARS}", param=param)
    return StructuredOutput(kind=kind, spec=spec)


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
