"""Tool calls through the whole system with the official openai client: SmolLM2, whose template
knows no tools (the generic format: the tools in a system message, the answer constrained to a call
or a reply), and a tiny Qwen2 checkpoint whose chat template renders tools in Qwen2.5's (Hermes)
format, written here as Qwen2.5's tokenizer_config.json writes it (no hub: a shortened copy of its
tool part). Calls under `required` or a named function always validate against their parameters;
streamed deltas join to the whole call; a full round trip (call, tool result, answer) works."""

import json
import urllib.request

import jsonschema
import openai
import pytest

from services.gateway.tools import tool_format
from shared.tokenizer import Tokenizer
from tests.checkpoints import save_checkpoint, transformers_model
from tests.system import System

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
SMOLLM2, QWEN = "smollm2", "tiny-qwen2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
                   "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
# Room for a few calls: the tiny Qwen's tokens are bytes (a call of WEATHER is about 110)
ROOM = {SMOLLM2: 200, QWEN: 800}

# Qwen2.5's chat template, its tool part (tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> in a user turn), as its tokenizer_config.json has it, shortened.
QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def qwen_directory(tmp_path_factory):
    # (a byte tokenizer: a token a byte, so the tools alone take a thousand tokens)
    directory = save_checkpoint(transformers_model("qwen2", max_position_embeddings=4096),
                                tmp_path_factory.mktemp("tiny-qwen2-tools"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": QWEN_TEMPLATE}))
    assert tool_format(Tokenizer.load(str(directory)).chat_template_source) == "hermes"
    return directory


@pytest.fixture(scope="module")
def system(qwen_directory):
    with System("--model", "smollm2-135m-instruct", "--model", str(qwen_directory), "--served-model-name", SMOLLM2,
                "--served-model-name", QWEN, workers=1, kv_blocks=128) as running:
        yield running


@pytest.fixture(scope="module")
def client(system):
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", timeout=180, max_retries=0)


def check_calls(message, allowed: set[str], at_most: int | None = None) -> list:
    calls = message.tool_calls or []
    assert calls, message
    assert at_most is None or len(calls) <= at_most
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("model", [SMOLLM2, QWEN])
def test_tool_choice_required_named_auto_and_none(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    tools = [WEATHER, TIME]
    for seed in range(3):
        required = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                                  temperature=1.0, seed=seed, max_tokens=ROOM[model])
        assert required.choices[0].finish_reason == "tool_calls", required
        check_calls(required.choices[0].message, {"get_weather", "get_time"})
    named = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=ROOM[model], temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    check_calls(named.choices[0].message, {"get_time"})
    single = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=ROOM[model], temperature=0)
    check_calls(single.choices[0].message, {"get_weather", "get_time"}, at_most=1)
    auto = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=ROOM[model], temperature=0)
    message = auto.choices[0].message
    if message.tool_calls:
        check_calls(message, {"get_weather", "get_time"})
        assert auto.choices[0].finish_reason == "tool_calls"
    else:
        assert isinstance(message.content, str) and auto.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                          max_tokens=12, temperature=0)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == \
        plain.choices[0].message.content


@pytest.mark.parametrize("model", [SMOLLM2, QWEN])
def test_streamed_tool_calls_join_to_the_whole_call_and_a_round_trip(client, model):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    whole = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=ROOM[model], temperature=0)
    calls = check_calls(whole.choices[0].message, {"get_weather"})
    joined: dict[int, dict] = {}
    finish = request_id = None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                                tool_choice="required", max_tokens=ROOM[model], temperature=0, stream=True):
        request_id = chunk.id
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = joined.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    expected_calls = [{"name": call.function.name, "arguments": call.function.arguments} for call in calls]
    assert list(joined.values()) == expected_calls
    # Re-attached (GET /v1/requests/{id}/stream): the same calls, not the model's raw text
    with urllib.request.urlopen(f"{client.base_url}requests/{request_id}/stream", timeout=60) as response:
        events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    deltas = [choice["delta"] for event in events for choice in event["choices"]]
    assert [call["function"] for delta in deltas for call in delta.get("tool_calls", ())] == expected_calls
    assert not any(delta.get("content") for delta in deltas)
    # The round trip: the calls and their results in the history, then the answer (a reply or another call)
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True) for call in calls]},
        *({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": -3, "unit": "celsius"})}
          for call in calls)]
    answer = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=60,
                                            temperature=0)
    message = answer.choices[0].message
    assert message.content is not None or message.tool_calls
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0)
    # (text, not a call: its text may be empty, a random model's tokens being special or unused ids)
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    # A tool result that answers no call: a 400 naming it, and the next request is served
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=history[:1] + history[2:3], tools=[WEATHER])
    assert refused.value.body["param"] == "messages[1].tool_call_id"
    # (served: an unseeded sample of a random model may be tokens that decode to no text, so count them)
    served = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert served.choices[0].finish_reason == "length" and served.usage.completion_tokens == 2


@pytest.mark.parametrize("model", [SMOLLM2, QWEN])
def test_an_agent_frameworks_client_gets_tool_calls_and_structured_output(system, model):
    """langchain-openai's ChatOpenAI, as an agent framework calls it: bind_tools (its tools from a
    pydantic model, no additionalProperties: the arguments hold the declared parameters only) and
    with_structured_output (response_format json_schema; and json_mode)."""
    import pydantic
    from langchain_openai import ChatOpenAI

    class GetWeather(pydantic.BaseModel):
        """The current weather in a city"""
        city: str = pydantic.Field(description="the city", max_length=30)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=130)

    llm = ChatOpenAI(base_url=f"{system.base_url}/v1", api_key="unused", model=model, temperature=0,
                     max_tokens=ROOM[model], max_retries=0, timeout=180)
    message = llm.bind_tools([GetWeather], tool_choice="required").invoke("What is the weather in Oslo?")
    assert message.tool_calls and all(call["name"] == "GetWeather" and GetWeather(**call["args"])
                                       for call in message.tool_calls), message
    assert isinstance(llm.with_structured_output(Person).invoke("Ann is 30. Describe her."), Person)
    if model == SMOLLM2:  # (json_mode: any JSON object, which only a model that knows the keys fills)
        person = llm.with_structured_output(Person, method="json_mode").invoke(
            'Ann is 30. Give JSON with the keys "name" and "age".')
        assert person == Person(name="Ann", age=30)
