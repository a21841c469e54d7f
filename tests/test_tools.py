"""Tool-call formats (services/gateway/tools.py) below HTTP: each family is recognised from its chat
template, its constraint for a forced call compiles and takes a well-formed call, and its answers
are read back into OpenAI's tool_calls (a malformed call stays text)."""

import json

import pytest

from services.gateway.api_models import ChatCompletionRequest, parse_body
from services.gateway.tools import parse_answer, plan_tools, tool_format
from shared.grammar import GrammarCompiler

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEMPLATES = {
    "hermes": "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
    "llama3_json": '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary}'
                   '{% endif %}<|python_tag|>',
    "generic": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
}
CALLS = {  # a well-formed answer of each family calling get_weather for Oslo
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}}]',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Oslo"}}',
    "generic": '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}',
}


def request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]} | fields
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


@pytest.mark.parametrize("form", list(TEMPLATES))
def test_each_family_is_recognised_constrained_and_read_back(form, tokenizer):
    assert tool_format(TEMPLATES[form]) == form
    plan = plan_tools(request(tool_choice="required"), TEMPLATES[form])
    assert plan.format == form and plan.constraint is not None
    assert (plan.template_tools is None) == (form == "generic")
    matcher = GrammarCompiler(tokenizer).matcher(plan.constraint)
    tokens = tokenizer.encode(CALLS[form])
    assert matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting(), form
    parsed = parse_answer(form, CALLS[form], "chatcmpl-1")
    assert parsed.content is None and [call["function"] for call in parsed.tool_calls] == [
        {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}]
    assert parsed.tool_calls[0]["id"] == parse_answer(form, CALLS[form], "chatcmpl-1").tool_calls[0]["id"]
    # A malformed call is the answer's text
    broken = CALLS[form][:-3]
    assert parse_answer(form, broken, "chatcmpl-1") == parse_answer(form, broken, "chatcmpl-2")
    assert parse_answer(form, broken, "chatcmpl-1").tool_calls == [] and parse_answer(form, broken, "x").content == broken


def test_auto_leaves_a_family_that_renders_tools_free_and_generic_constrained():
    assert plan_tools(request(), TEMPLATES["hermes"]).constraint is None
    generic = plan_tools(request(), TEMPLATES["generic"])
    schema = json.loads(generic.constraint.spec)
    assert len(schema["anyOf"]) == 2  # a call or a reply
    assert generic.messages[0]["role"] == "system" and "get_weather" in generic.messages[0]["content"]
    none = plan_tools(request(tool_choice="none"), TEMPLATES["hermes"])
    assert none.format == "none" and none.constraint is None and none.template_tools is None
    reply = parse_answer("generic", '{"response":"It is sunny."}', "chatcmpl-1")
    assert reply.content == "It is sunny." and reply.tool_calls == []
    text = parse_answer("hermes", "Let me check.\n" + CALLS["hermes"], "chatcmpl-1")
    assert text.content == "Let me check." and len(text.tool_calls) == 1


def test_a_generic_history_writes_calls_and_results_as_json():
    body = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER], "tool_choice": "none"}
    plan = plan_tools(parse_body(ChatCompletionRequest, json.dumps(body).encode()), TEMPLATES["generic"])
    assert [message["role"] for message in plan.messages] == ["user", "assistant", "user"]
    assert json.loads(plan.messages[1]["content"]) == {"tool_calls": [{"name": "get_weather",
                                                                       "arguments": {"city": "Oslo"}}]}
    assert json.loads(plan.messages[2]["content"])["tool_response"]["content"] == "sunny"


def test_parallel_tool_calls_false_allows_one_call(tokenizer):
    two = tokenizer.encode(CALLS["hermes"] + "\n" + CALLS["hermes"])  # (as Qwen writes them: a line apart)
    several = GrammarCompiler(tokenizer).matcher(plan_tools(request(tool_choice="required"),
                                                            TEMPLATES["hermes"]).constraint)
    assert several.try_consume_tokens(two) == len(two) and several.is_accepting()
    plan = plan_tools(request(tool_choice="required", parallel_tool_calls=False), TEMPLATES["hermes"])
    matcher = GrammarCompiler(tokenizer).matcher(plan.constraint)
    assert matcher.try_consume_tokens(two) < len(two)
