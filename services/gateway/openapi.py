"""The gateway's OpenAPI 3.0 document (GET /openapi.json), written by hand from api_models.py.

It says what a valid request is (the limits of this server included) and every answer an
endpoint may give: tests/test_api_fuzz.py runs schemathesis against it on a live system.
"""

from typing import Any

from services.gateway.api_models import SEED_RANGE
from shared.config import Settings

ERROR = {"$ref": "#/components/schemas/Error"}
JSON = "application/json"
# One server-sent event (`data: <chunk JSON>`, the last one `data: [DONE]`), as OpenAPI tools parse it.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def _error_responses(*statuses: int) -> dict[str, Any]:
    why = {
        400: "invalid request (the field is named in `param`)",
        401: "missing or wrong API key",
        404: "unknown model, request id or path",
        413: "request body too large",
        429: "busy (too many waiting requests or prompt tokens) or too many open requests for this key; "
        "see Retry-After",
        503: "Redis or the model unavailable, retry",
    }
    return {str(status): {"description": why[status], "content": {JSON: {"schema": ERROR}}} for status in statuses}


def _generation_properties(settings: Settings, context_length: int) -> dict[str, Any]:
    output_limit = settings.max_tokens_limit or context_length
    max_tokens = {"type": "integer", "minimum": 1, "maximum": output_limit}
    stop_string = {"type": "string", "minLength": 1, "maxLength": settings.max_stop_length}
    return {
        "max_tokens": _nullable(max_tokens),
        "max_completion_tokens": _nullable(max_tokens),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": 2**31 - 1}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "description": "extension"}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 10,
                                         "description": "extension"}),
        "seed": _nullable({"type": "integer", "minimum": -SEED_RANGE, "maximum": 2 * SEED_RANGE - 1}),
        "stop": _nullable(
            {"oneOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": settings.max_stop_strings}]}
        ),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(
            {"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}}
        ),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": 4,
                        "description": "choices (at most 16; the document says 4 to keep fuzzed requests short)"}),
        "ignore_eos": _nullable({"type": "boolean", "description": "extension: do not stop at end-of-sequence"}),
        "user": _nullable({"type": "string"}),
        "logit_bias": _nullable({"type": "object", "description": "token id (a string) -> bias added to its logit",
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "response_format": _nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                             "strict": _nullable({"type": "boolean"})}}}}),
        "structured_outputs": _nullable({"type": "object", "description": "extension (vLLM's): one of json, regex, "
                                                                         "choice, grammar, json_object"}),
        "guided_json": _nullable({"type": "object", "description": "extension (vLLM's): a JSON Schema"}),
        "guided_regex": _nullable({"type": "string", "description": "extension (vLLM's)"}),
        "guided_choice": _nullable({"type": "array", "items": {"type": "string"}, "description": "extension"}),
        "guided_grammar": _nullable({"type": "string", "description": "extension: Lark or GBNF"}),
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20,
                                      "description": "extension (vLLM's): each prompt token's log-probability and "
                                                     "rank, and this many most likely tokens; not with stream"}),
    }


def _answer_schema(object_name: str, content_name: str, content: dict, finish_reason: dict,
                   usage: dict) -> dict[str, Any]:
    """A non-streamed answer whose one choice carries `content_name`."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [object_name]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", content_name, "finish_reason"],
                    "properties": {"index": {"type": "integer"}, content_name: content, "finish_reason": finish_reason},
                },
            },
            "usage": usage,
        },
    }


def _schemas(settings: Settings, model_name: str, context_length: int, vocab_size: int) -> dict[str, Any]:
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {**{name: {"type": "integer", "minimum": 0}
                          for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
                       "prompt_tokens_details": {"type": "object", "properties": {
                           "cached_tokens": {"type": "integer", "minimum": 0}}}},
    }  # fmt: skip
    finish_reason = {"type": "string", "enum": ["stop", "length", "cancelled", "tool_calls"]}
    model = {"type": "string", "enum": [model_name]}
    generation = _generation_properties(settings, context_length)
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": _nullable({"type": "string"}),
                        "code": _nullable({"type": "string"}),
                    },
                }
            },
        },
        "Tokenized": {
            "type": "object",
            "required": ["count", "max_model_len", "tokens", "token_strs"],
            "properties": {"count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
                           "tokens": {"type": "array", "items": {"type": "integer"}},
                           "token_strs": _nullable({"type": "array", "items": {"type": "string"}})},
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["prompt"],
            "properties": {
                "model": model,
                "prompt": {
                    "oneOf": [
                        {"type": "string", "minLength": 1},
                        {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
                            "minItems": 1,
                        },
                    ]
                },
                "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5}),
                **generation,
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["messages"],
            "properties": {
                "model": model,
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant",
                                                                "tool"]},
                            "tool_call_id": _nullable({"type": "string"}),
                            "content": {
                                "oneOf": [
                                    {"type": "string"},
                                    {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["type", "text"],
                                            "properties": {
                                                "type": {"type": "string", "enum": ["text"]},
                                                "text": {"type": "string"},
                                            },
                                        },
                                    },
                                ]
                            },
                        },
                    },
                },
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20,
                                           "description": "needs logprobs: true"}),
                "tools": _nullable({"type": "array", "maxItems": 8, "items": {
                    "type": "object", "required": ["type", "function"], "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {"type": "object", "required": ["name"], "properties": {
                            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"}}}}}}),
                "tool_choice": _nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                                    {"type": "object"}]}),
                "parallel_tool_calls": _nullable({"type": "boolean"}),
                **generation,
            },
        },
        "Completion": _answer_schema("text_completion", "text", {"type": "string"}, finish_reason, usage),
        "ChatCompletion": _answer_schema("chat.completion", "message", {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"type": "string"}, "content": _nullable({"type": "string"}),
                           "tool_calls": {"type": "array", "items": {"type": "object"}}},
        }, finish_reason, usage),
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["model"]},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "max_model_len": {"type": "integer"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": _schema_ref("Model")},
            },
        },
        "RequestStatus": {
            "type": "object",
            "required": ["id", "object", "status"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["request"]},
                "status": {"type": "string", "enum": ["waiting", "running", "finished", "cancelled", "failed"]},
                "finish_reason": _nullable({"type": "string"}),
                "created": _nullable({"type": "integer"}),
                "model": {"type": "string"},
                "prompt_tokens": _nullable({"type": "integer"}),
                "max_tokens": _nullable({"type": "integer"}),
                "token_events": {"type": "integer", "minimum": 0},
            },
        },
        "RequestCancel": {
            "type": "object",
            "required": ["id", "object", "status", "cancelled"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["request.cancel"]},
                "status": {"type": "string"},
                "cancelled": {"type": "boolean"},
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {
                "status": {"type": "string", "enum": ["ok", "unavailable"]},
                "missing": {"type": "array", "items": {"type": "string"}},
                "reason": {"type": "string"},
                "model": {"type": "string"},
                "workers": {"type": "integer"},
                "waiting": {"type": "integer"},
                "running": {"type": "integer"},
            },
        },
    }


def _schema_ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_response(description: str, schema_name: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _schema_ref(schema_name)}}}


def _read_operation(summary: str, parameters: list[dict], ok: dict[str, Any], *error_statuses: int) -> dict[str, Any]:
    """A GET or DELETE answering JSON on 200, with OpenAI-style error bodies."""
    return {"summary": summary, **({"parameters": parameters} if parameters else {}),
            "responses": {"200": ok, **_error_responses(*error_statuses)}}


def _generation_operation(summary: str, request_schema: str, response_schema: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": _schema_ref(request_schema)}},
        },
        "responses": {
            "200": {
                "description": "the whole answer, or with `stream: true` server-sent events ending with `data: [DONE]`",
                "content": {
                    JSON: {"schema": _schema_ref(response_schema)},
                    "text/event-stream": {"schema": SSE_EVENT},
                },
            },
            **_error_responses(400, 401, 404, 413, 429, 503),
        },
    }


def openapi_document(settings: Settings, model_name: str, keys_required: bool, context_length: int,
                     vocab_size: int) -> dict[str, Any]:
    """The document; `security` is set only when the server requires API keys."""
    model_name_value = model_name
    request_id = {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}
    model_name = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
    observability_errors = _error_responses(401) if keys_required and settings.protect_observability else {}
    document: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "iterserve",
            "version": "1",
            "description": "OpenAI-compatible API of an Orca-style (iteration-level scheduling) inference server.",
        },
        "paths": {
            "/v1/completions": {
                "post": _generation_operation("Complete a prompt", "CompletionRequest", "Completion"),
            },
            "/v1/chat/completions": {
                "post": _generation_operation("Answer a conversation", "ChatCompletionRequest", "ChatCompletion"),
            },
            "/tokenize": {
                "post": {
                    "summary": "A prompt's or a conversation's token ids (vLLM's shapes)",
                    "requestBody": {"required": True, "content": {JSON: {"schema": {"type": "object", "properties": {
                        "model": {"type": "string", "enum": [model_name_value]},
                        "prompt": {"type": "string", "minLength": 1, "maxLength": 2000},
                        "add_special_tokens": _nullable({"type": "boolean"}),
                        "return_token_strs": {"type": "boolean"}}, "required": ["prompt"]}}}},
                    "responses": {"200": _json_response("the tokens", "Tokenized"),
                                  **_error_responses(400, 401, 404, 413)},
                },
            },
            "/detokenize": {
                "post": {
                    "summary": "Token ids back to text (vLLM's shapes)",
                    "requestBody": {"required": True, "content": {JSON: {"schema": {"type": "object", "properties": {
                        "model": {"type": "string", "enum": [model_name_value]},
                        "tokens": {"type": "array", "maxItems": 512, "items": {
                            "type": "integer", "minimum": 0, "maximum": vocab_size - 1}}}, "required": ["tokens"]}}}},
                    "responses": {"200": {"description": "the text", "content": {JSON: {"schema": {
                        "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}}},
                                  **_error_responses(400, 401, 404, 413)},
                },
            },
            "/v1/models": {
                "get": _read_operation("The served model", [], _json_response("one model", "ModelList"), 401),
            },
            "/v1/models/{model_name}": {
                "get": _read_operation("One model (only the served one exists)", [model_name],
                                       _json_response("the model", "Model"), 401, 404),
            },
            "/v1/requests/{request_id}": {
                "get": _read_operation("A request's status (only for the key that sent it)", [request_id],
                                       _json_response("its status", "RequestStatus"), 401, 404, 503),
                "delete": _read_operation("Cancel a request (harmless once it ended)", [request_id],
                                          _json_response("cancel sent, or the request had ended", "RequestCancel"),
                                          401, 404, 503),
            },
            "/v1/requests/{request_id}/stream": {
                "get": {
                    "summary": "Re-attach to a request's output from an index (server-sent events)",
                    "parameters": [
                        request_id,
                        {"name": "from", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 0}},
                        {"name": "include_usage", "in": "query", "required": False, "schema": {"type": "boolean"}},
                    ],
                    "responses": {
                        "200": {"description": "the output as server-sent events",
                                "content": {"text/event-stream": {"schema": SSE_EVENT}}},
                        **_error_responses(400, 401, 404, 429, 503),
                    },
                },
            },
            "/health": {
                "get": {
                    "summary": "200 when Redis, the scheduler and a worker are alive and requests move",
                    "security": [],
                    "responses": {
                        "200": _json_response("healthy", "Health"),
                        "503": _json_response("unhealthy: `missing` says what", "Health"),
                    },
                },
            },
            "/livez": {
                "get": {
                    "summary": "200 whenever the gateway serves HTTP (a restart probe: workers down do not fail it)",
                    "security": [],
                    "responses": {"200": {"description": "alive", "content": {JSON: {"schema": {
                        "type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}}}}},
                },
            },
            "/version": {
                "get": {
                    "summary": "The server's version",
                    "security": [],
                    "responses": {"200": {"description": "the version", "content": {JSON: {"schema": {
                        "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}}},
                },
            },
            "/status": {
                "get": {
                    "summary": "Workers, waiting and running requests",
                    **({} if observability_errors else {"security": []}),
                    "responses": {
                        "200": {"description": "the cluster", "content": {JSON: {"schema": {"type": "object"}}}},
                        **observability_errors,
                        **_error_responses(503),
                    },
                },
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    **({} if observability_errors else {"security": []}),
                    "responses": {
                        "200": {"description": "text exposition format",
                                "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **observability_errors,
                    },
                },
            },
            "/dashboard": {
                "get": {
                    "summary": "The live page of the iteration schedule (static HTML; holds no data)",
                    "security": [],
                    "responses": {"200": {"description": "the page",
                                          "content": {"text/html": {"schema": {"type": "string"}}}}},
                },
            },
            "/dashboard/events": {
                "get": {
                    "summary": "Server-sent events: `iteration` (every model's iteration records, the last 200 "
                               "first) and, every second, `latency` (this gateway's over the last minute)",
                    **({} if keys_required else {"security": []}),
                    "responses": {
                        "200": {"description": "an event stream",
                                "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                        **(_error_responses(401) if keys_required else {}),
                    },
                },
            },
        },
        "components": {"schemas": _schemas(settings, model_name, context_length, vocab_size)},
    }
    if keys_required:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
