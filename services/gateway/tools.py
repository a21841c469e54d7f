"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), in the format the model's
own chat template teaches it, read back into OpenAI's `tool_calls`.

The format follows the template (its source names it, as vLLM's tool parsers are chosen per family):
- hermes (Qwen2.5, Qwen3, Hermes): the template renders the tools; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row.
- llama3_json (Llama 3.1+): the template renders the tools; a call is the whole answer,
  `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`).
- mistral: the template renders the tools; calls are `[TOOL_CALLS]` and a JSON list of
  `{"name", "arguments"}`.
- generic, for a template that knows no tools (SmolLM2's), as llama.cpp's generic format: the tools
  go into a system message that says how to answer, and the answer is constrained to a JSON object,
  `{"tool_calls": [{"name", "arguments"}]}` or `{"response": "..."}`. A conversation's earlier
  calls and tool results are written in the same JSON (as assistant and user turns).

With `required` or a named function (and in the generic format always) the answer is generated
under a grammar whose calls' arguments follow each function's `parameters` schema (shared/grammar.py),
so they always validate; with `auto` a family whose template renders the tools answers freely and
its calls are parsed out of the text. A request's constraint is a function of its tools and choice
only, so its output stays exact across batches, moves and restarts like any constrained output.
"""

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.api_models import ChatCompletionRequest, NamedToolChoice
from shared.messages import StructuredOutput

GENERIC_INSTRUCTIONS = (
    "You can call the tools below. Answer with JSON only. To call tools: "
    '{"tool_calls": [{"name": <a tool\'s name>, "arguments": <an object of its parameters>}]}. '
    'To answer without a tool: {"response": <your answer>}.\nTools:\n')
MAX_CALLS_PER_TOOL, MAX_CALLS = 2, 16
# The JSON inside a grammar written compactly, as structured outputs are (shared/grammar.py).
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolPlan:
    format: str  # hermes, llama3_json, mistral, generic
    template_tools: list[dict] | None  # what the template renders (None: the template is not given tools)
    messages: list[dict]  # the conversation as the template takes it
    constraint: StructuredOutput | None  # what the answer is generated under


def tool_format(template_source: str) -> str:
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "tools" in template_source and ("<|python_tag|>" in template_source or '"parameters"' in template_source):
        return "llama3_json"
    return "generic"


def plan_tools(params: ChatCompletionRequest, template_source: str) -> ToolPlan:
    messages = [message.as_template_message() for message in params.messages]
    form = tool_format(template_source)
    if not params.tools_active:  # no tools offered; a history with calls in it still needs writing out
        if form == "generic" and any(message.role == "tool" or message.tool_calls for message in params.messages):
            messages = _generic_history(messages, None)
        return ToolPlan("none", None, messages, None)
    tools = params.tools
    if isinstance(params.tool_choice, NamedToolChoice):
        offered = [tool for tool in tools if tool.function.name == params.tool_choice.function.name]
        must_call = True
    else:
        offered, must_call = list(tools), params.tool_choice == "required"
    # At most MAX_CALLS_PER_TOOL calls of each offered tool in one answer (a small model under a
    # grammar that allows "another call" may take it until max_tokens); 1 without parallel calls.
    several = params.parallel_tool_calls is not False
    most_calls = min(MAX_CALLS, MAX_CALLS_PER_TOOL * len(offered)) if several else 1
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in params.tools]
    if form == "generic":
        messages = _generic_history(messages, tool_dicts)
        schema = _generic_schema(offered, must_call, most_calls)
        return ToolPlan(form, None, messages, StructuredOutput(kind="json", spec=json.dumps(schema)))
    constraint = None
    if must_call:
        calls = [_call_schema(tool, "parameters" if form == "llama3_json" else "arguments") for tool in offered]
        call = {"anyOf": calls} if len(calls) > 1 else calls[0]
        if form == "hermes":
            lark = (f'start: {" ".join(["call"] + ["call?"] * (most_calls - 1))}\n'
                    f'call: "<tool_call>\\n" %json {json.dumps(call | COMPACT)} "\\n</tool_call>" "\\n"?\n')
        elif form == "mistral":
            array = {"type": "array", "items": call, "minItems": 1, "maxItems": most_calls}
            lark = f'start: "[TOOL_CALLS]" %json {json.dumps(array | COMPACT)}\n'
        else:
            lark = f"start: %json {json.dumps(call | COMPACT)}\n"
        constraint = StructuredOutput(kind="grammar", spec=lark)
    return ToolPlan(form, tool_dicts, messages, constraint)


def _parameters(tool) -> dict:
    """A call's arguments: the declared parameters only, as under OpenAI's strict mode, unless the
    schema says otherwise (a small model offered "any other property" writes them until max_tokens)."""
    parameters = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        parameters = parameters | {"additionalProperties": False}
    return parameters


def _call_schema(tool, arguments_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             arguments_key: _parameters(tool)},
            "required": ["name", arguments_key], "additionalProperties": False}


def _generic_schema(offered: list, must_call: bool, most_calls: int) -> dict:
    calls = [_call_schema(tool, "arguments") for tool in offered]
    array = {"type": "array", "items": {"anyOf": calls} if len(calls) > 1 else calls[0], "minItems": 1,
             "maxItems": most_calls}
    call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}
    if must_call:
        return call
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False}
    return {"anyOf": [call, reply]}


def _generic_history(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template that knows no tools: the tools (when offered) and the answer
    format in the system message; earlier calls and results written as the JSON the model answers in."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                     for call in message["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif message["role"] == "tool":
            result = {"tool_response": {"tool_call_id": message["tool_call_id"], "content": message["content"]}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            out.append({"role": message["role"], "content": message["content"] or ""})
    if tools is None:
        return out
    instructions = GENERIC_INSTRUCTIONS + "\n".join(json.dumps(tool["function"], ensure_ascii=False)
                                                    for tool in tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict]  # OpenAI's: {"id", "type": "function", "function": {"name", "arguments": JSON text}}


def parse_answer(form: str, text: str, request_id: str) -> ParsedAnswer:
    """The answer's text as OpenAI's message fields (an answer that holds no well-formed call is content)."""
    calls: list[tuple[str, Any]] = []
    content: str | None = text
    try:
        if form == "generic":
            value = json.loads(text)
            if not isinstance(value, dict):
                return ParsedAnswer(text, [])
            if "tool_calls" in value:
                calls = [(call["name"], call["arguments"]) for call in value["tool_calls"]]
                content = None
            elif "response" in value:
                content = value["response"]
        elif form == "hermes":
            found = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.DOTALL)
            if found:
                for body in found:
                    value = json.loads(body)
                    calls.append((value["name"], value.get("arguments", {})))
                content = text[: text.index("<tool_call>")].strip() or None
        elif form == "mistral":
            if "[TOOL_CALLS]" in text:
                head, _, tail = text.partition("[TOOL_CALLS]")
                calls = [(value["name"], value.get("arguments", {})) for value in json.loads(tail)]
                content = head.strip() or None
        elif form == "llama3_json":
            body = text.removeprefix("<|python_tag|>").strip()
            if body.startswith("{"):
                for part in body.split(";"):
                    value = json.loads(part)
                    calls.append((value["name"], value.get("parameters", value.get("arguments", {}))))
                content = None
    except (ValueError, KeyError, TypeError):  # no well-formed call: the text is the answer
        return ParsedAnswer(text, [])
    if any(not isinstance(name, str) or not isinstance(arguments, dict) for name, arguments in calls):
        return ParsedAnswer(text, [])
    return ParsedAnswer(content, [{"id": call_id(request_id, index), "type": "function",
                                   "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                                  for index, (name, arguments) in enumerate(calls)])


def call_id(request_id: str, index: int) -> str:
    """A call's id: a function of its request and place, so a re-read answer names it the same."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]
