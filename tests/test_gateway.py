"""The gateway against a real private Redis and the real tokenizer.

The only double is FakeScheduler, standing in for the scheduler process: it reads the
protocol's streams and writes TokenEvents exactly as docs/protocol.md says the scheduler does.
"""

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import create_app, run_gateway
from services.gateway.state import STATE
from shared import keys
from shared.config import Settings
from shared.messages import RequestRecord, SchedulerInfo, TokenEvent, WorkerInfo
from shared.model_file import load_metadata
from shared.tokenizer import Tokenizer
from shared.wire import decode, encode

pytestmark = pytest.mark.timeout(60)

MODEL = "smollm2-135m-instruct"
MAX_BODY_BYTES = 64 * 1024
WAIT_SECONDS = 5.0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()


class FakeScheduler:
    """Test double of the scheduler: answers request i's output token k with the text " w{k}".

    hold: emit nothing until release() (cancellations still end a held request).
    fail: end every request after one token with finish_reason "error" (status failed).
    """

    def __init__(self, redis, delay: float = 0.0, hold: bool = False, fail: bool = False,
                 counted_short_at: int | None = None) -> None:
        self.redis = redis
        self.fail = fail
        # Ends at this index without a token, counting one token fewer than the stream carried (a
        # worker's entry of a token in flight, written before the scheduler's end: docs/protocol.md)
        self.counted_short_at = counted_short_at
        self.delay = delay
        self.released = asyncio.Event()
        if not hold:
            self.released.set()
        self.cancelled: set[str] = set()
        self.tasks: list[asyncio.Task] = []
        # Stopped by a flag, not by cancelling: redis-py 8 can lose a cancellation that lands
        # mid-read and hang the task (see services/gateway/store.py).
        self.stopping = False

    def release(self) -> None:
        self.released.set()

    async def run(self) -> None:
        last_ids = {keys.NEW_REQUESTS_STREAM: "0-0", keys.CANCEL_STREAM: "0-0"}
        while not self.stopping:
            reply = await self.redis.xread(last_ids, block=50)
            for stream, entries in reply or []:
                stream = stream.decode()
                for entry_id, fields in entries:
                    last_ids[stream] = entry_id
                    request_id = fields[b"id"].decode()
                    if stream == keys.CANCEL_STREAM:
                        self.cancelled.add(request_id)
                    else:
                        self.tasks.append(asyncio.create_task(self.serve(request_id)))

    async def serve(self, request_id: str) -> None:
        record = decode(RequestRecord, await self.redis.hget(keys.request_key(request_id), "record"))
        await self.redis.hset(keys.request_key(request_id), "status", "running")
        while not self.released.is_set() and request_id not in self.cancelled:
            await asyncio.sleep(0.01)
            if self.stopping:
                return
        prompt_tokens, text = len(record.prompt_token_ids), ""
        for index in range(record.sampling.max_tokens):
            if self.stopping:
                return
            if request_id in self.cancelled:
                return await self.end(request_id, index, "cancelled", prompt_tokens)
            if self.fail and index == 1:
                return await self.end(request_id, index, "error", prompt_tokens)
            if index == self.counted_short_at:
                return await self.end(request_id, index - 1, "stop", prompt_tokens)
            piece = f" w{index}"
            if any(stop in text + piece for stop in record.sampling.stop):
                return await self.end(request_id, index, "stop", prompt_tokens)
            text += piece
            last = index == record.sampling.max_tokens - 1
            wanted = record.sampling.logprobs
            event = TokenEvent(
                index=index, token_id=100 + index, text=piece, finish_reason="length" if last else None,
                prompt_tokens=prompt_tokens if last else 0, completion_tokens=index + 1 if last else 0,
                logprob=fake_logprob(index) if wanted >= 0 else None,
                top_logprobs=fake_top_logprobs(index)[:wanted] if wanted > 0 else (),
            )  # fmt: skip
            await self.redis.xadd(keys.token_stream(request_id), {"m": encode(event)})
            if last:
                return await self.close(request_id, "finished", "length")
            await asyncio.sleep(self.delay)

    async def end(self, request_id: str, index: int, reason: str, prompt_tokens: int) -> None:
        event = TokenEvent(
            index=index, token_id=-1, text="", finish_reason=reason,
            prompt_tokens=prompt_tokens, completion_tokens=index,
        )  # fmt: skip
        await self.redis.xadd(keys.token_stream(request_id), {"m": encode(event)})
        status = {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")
        await self.close(request_id, status, reason)

    async def close(self, request_id: str, status: str, reason: str) -> None:
        await self.redis.hset(keys.request_key(request_id), mapping={"status": status, "finish_reason": reason})
        await self.redis.srem(keys.ACTIVE_REQUESTS_SET, request_id)


def fake_logprob(index: int) -> float:
    return -0.25 - index / 8


def fake_top_logprobs(index: int) -> tuple[tuple[int, float], ...]:
    return ((100 + index, fake_logprob(index)), (17, -3.0), (18, -4.0), (19, -5.0))


@asynccontextmanager
async def running(scheduler: FakeScheduler):
    task = asyncio.create_task(scheduler.run())
    try:
        yield scheduler
    finally:
        scheduler.stopping = True
        await asyncio.wait([task, *scheduler.tasks], timeout=WAIT_SECONDS)


def gateway_settings(redis_url: str, **overrides) -> Settings:
    return Settings(**{"redis_url": redis_url, "port": 0, "max_body_bytes": MAX_BODY_BYTES, **overrides})


@asynccontextmanager
async def serve_gateway(settings: Settings, tokenizer: Tokenizer):
    async with TestClient(TestServer(create_app(settings, tokenizer))) as client:
        yield client


@pytest.fixture
async def gateway(redis_url, redis_client, tokenizer):
    async with serve_gateway(gateway_settings(redis_url), tokenizer) as client:
        yield client


@pytest.fixture
async def scheduler(redis_client):
    async with running(FakeScheduler(redis_client)) as fake:
        yield fake


@pytest.fixture
async def held_scheduler(redis_client):
    async with running(FakeScheduler(redis_client, hold=True)) as fake:
        yield fake


async def wait_until(condition, what: str, timeout: float = WAIT_SECONDS):
    deadline = time.monotonic() + timeout
    while True:
        result = await condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)


async def read_sse(response: aiohttp.ClientResponse, timeout: float = WAIT_SECONDS) -> list[str]:
    """Every `data:` payload of an SSE response, in order, up to the end of the body."""
    payloads = []
    async with asyncio.timeout(timeout):
        async for line in response.content:
            line = line.decode().rstrip("\n")
            if line.startswith("data: "):
                payloads.append(line.removeprefix("data: "))
    return payloads


async def cancel_entries(redis_client) -> list[str]:
    return [fields[b"id"].decode() for _, fields in await redis_client.xrange(keys.CANCEL_STREAM)]


async def post_json(client, path: str, body: dict) -> tuple[int, dict]:
    async with asyncio.timeout(WAIT_SECONDS):
        response = await client.post(path, json=body)
        return response.status, await response.json()


def assert_openai_error(body: dict, param: str | None) -> None:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert body["error"]["param"] == param, f"param {body['error']['param']!r}, expected {param!r}: {body}"


GOOD_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

BAD_REQUESTS = [
    # (name, method, path, body: dict or raw bytes, status, param)
    ("malformed json", "POST", COMPLETIONS, b'{"prompt": ', 400, None),
    ("body not an object", "POST", COMPLETIONS, b"[1, 2]", 400, None),
    ("NaN is not JSON", "POST", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, None),
    ("prompt missing", "POST", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt": 5}, 400, "prompt"),
    ("batch of prompts", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    ("token id out of vocab", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt": [1, 10**9]}, 400, "prompt"),
    ("empty prompt", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt": ""}, 400, "prompt"),
    ("temperature string", "POST", COMPLETIONS, {**GOOD_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("temperature too high", "POST", COMPLETIONS, {**GOOD_COMPLETION, "temperature": 2.5}, 400, "temperature"),
    ("temperature negative", "POST", COMPLETIONS, {**GOOD_COMPLETION, "temperature": -0.1}, 400, "temperature"),
    ("top_p zero", "POST", COMPLETIONS, {**GOOD_COMPLETION, "top_p": 0}, 400, "top_p"),
    ("top_p above one", "POST", COMPLETIONS, {**GOOD_COMPLETION, "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", "POST", COMPLETIONS, {**GOOD_COMPLETION, "top_k": -2}, 400, "top_k"),
    ("max_tokens zero", "POST", COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens string", "POST", COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens bool", "POST", COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": True}, 400, "max_tokens"),
    ("max_tokens past context", "POST", COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 9000}, 400, "max_tokens"),
    ("stream not bool", "POST", COMPLETIONS, {**GOOD_COMPLETION, "stream": "yes"}, 400, "stream"),
    ("include_usage not bool", "POST", COMPLETIONS,
     {**GOOD_COMPLETION, "stream": True, "stream_options": {"include_usage": "yes"}},
     400, "stream_options.include_usage"),
    ("five stop strings", "POST", COMPLETIONS, {**GOOD_COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty stop string", "POST", COMPLETIONS, {**GOOD_COMPLETION, "stop": [""]}, 400, "stop"),
    ("seed string", "POST", COMPLETIONS, {**GOOD_COMPLETION, "seed": "1"}, 400, "seed"),
    ("n=17", "POST", COMPLETIONS, {**GOOD_COMPLETION, "n": 17}, 400, "n"),
    ("n=0", "POST", COMPLETIONS, {**GOOD_COMPLETION, "n": 0}, 400, "n"),
    ("presence_penalty above 2", "POST", COMPLETIONS, {**GOOD_COMPLETION, "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("frequency_penalty below -2", "POST", COMPLETIONS, {**GOOD_COMPLETION, "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("repetition_penalty zero", "POST", COMPLETIONS, {**GOOD_COMPLETION, "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("min_p above one", "POST", COMPLETIONS, {**GOOD_COMPLETION, "min_p": 1.5}, 400, "min_p"),
    ("min_p negative", "POST", COMPLETIONS, {**GOOD_COMPLETION, "min_p": -0.1}, 400, "min_p"),
    ("completions logprobs above 5", "POST", COMPLETIONS, {**GOOD_COMPLETION, "logprobs": 6}, 400, "logprobs"),
    ("completions logprobs bool", "POST", COMPLETIONS, {**GOOD_COMPLETION, "logprobs": True}, 400, "logprobs"),
    ("echo not bool", "POST", COMPLETIONS, {**GOOD_COMPLETION, "echo": "yes"}, 400, "echo"),
    ("chat echo", "POST", CHAT, {**GOOD_CHAT, "echo": True}, 400, "echo"),
    # Structured outputs, logit_bias, and vLLM's fields that would change the output (not implemented)
    ("schema not JSON Schema", "POST", CHAT, {**GOOD_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nothing"}}}}, 400, "response_format.json_schema.schema"),
    ("json_schema without name", "POST", CHAT, {**GOOD_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, 400, "response_format.json_schema.name"),
    ("response_format unknown type", "POST", CHAT, {**GOOD_CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("guided_json not JSON", "POST", COMPLETIONS, {**GOOD_COMPLETION, "guided_json": "{nope"}, 400, "guided_json"),
    ("guided_regex invalid", "POST", COMPLETIONS, {**GOOD_COMPLETION, "guided_regex": "a(b"}, 400, "guided_regex"),
    ("guided_choice empty", "POST", COMPLETIONS, {**GOOD_COMPLETION, "guided_choice": []}, 400, "guided_choice"),
    ("guided_grammar invalid", "POST", COMPLETIONS, {**GOOD_COMPLETION, "guided_grammar": "start: ("}, 400,
     "guided_grammar"),
    ("guided_grammar neither Lark nor GBNF", "POST", COMPLETIONS,
     {**GOOD_COMPLETION, "guided_grammar": "\U000684aa$<\u00a5m#P"}, 400, "guided_grammar"),
    ("two structured outputs", "POST", COMPLETIONS, {**GOOD_COMPLETION, "guided_regex": "a+", "guided_choice": ["a"]},
     400, "guided_choice"),
    ("structured_outputs two kinds", "POST", COMPLETIONS,
     {**GOOD_COMPLETION, "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400, "structured_outputs"),
    ("structured_outputs unknown key", "POST", COMPLETIONS,
     {**GOOD_COMPLETION, "structured_outputs": {"structural_tag": "{}"}}, 400, "structured_outputs.structural_tag"),
    ("structured_outputs disable_additional_properties", "POST", COMPLETIONS,
     {**GOOD_COMPLETION, "structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": True}},
     400, "structured_outputs.disable_additional_properties"),
    ("structured output with ignore_eos", "POST", COMPLETIONS,
     {**GOOD_COMPLETION, "guided_regex": "a+", "ignore_eos": True}, 400, "ignore_eos"),
    ("logit_bias key not a token id", "POST", COMPLETIONS, {**GOOD_COMPLETION, "logit_bias": {"hello": 1}}, 400,
     "logit_bias"),
    ("logit_bias token out of vocab", "POST", COMPLETIONS, {**GOOD_COMPLETION, "logit_bias": {"49152": 1}}, 400,
     "logit_bias"),
    ("logit_bias above 100", "POST", COMPLETIONS, {**GOOD_COMPLETION, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias not numbers", "POST", COMPLETIONS, {**GOOD_COMPLETION, "logit_bias": {"5": "up"}}, 400,
     "logit_bias.5"),
    ("prompt_logprobs streamed", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("prompt_logprobs -1", "POST", CHAT, {**GOOD_CHAT, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("prompt_logprobs 21", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs true", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt_logprobs": True}, 400,
     "prompt_logprobs"),
    ("min_tokens", "POST", COMPLETIONS, {**GOOD_COMPLETION, "min_tokens": 4}, 400, "min_tokens"),
    # Tools
    ("tool_choice names an unknown function", "POST", CHAT, {**GOOD_CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, 400, "tool_choice"),
    ("tool_choice without tools", "POST", CHAT, {**GOOD_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice unknown word", "POST", CHAT, {**GOOD_CHAT, "tools": [TOOL], "tool_choice": "always"}, 400,
     "tool_choice"),
    ("two tools of one name", "POST", CHAT, {**GOOD_CHAT, "tools": [TOOL, TOOL]}, 400, "tools"),
    ("tool parameters not a schema", "POST", CHAT, {**GOOD_CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nothing"}}}]}, 400, "tools"),
    ("tool name with a space", "POST", CHAT, {**GOOD_CHAT, "tools": [{"type": "function", "function": {
        "name": "get weather"}}]}, 400, "tools[0].function.name"),
    ("tool message without a matching call", "POST", CHAT, {**GOOD_CHAT, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]}, 400, "messages[2].tool_call_id"),
    ("tool message without tool_call_id", "POST", CHAT, {**GOOD_CHAT, "messages": [
        {"role": "tool", "content": "sunny"}]}, 400, "messages[0]"),
    ("call arguments not JSON", "POST", CHAT, {**GOOD_CHAT, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{city"}}]}]}, 400, "messages[0].tool_calls[0].function.arguments"),
    ("tools with a structured output", "POST", CHAT, {**GOOD_CHAT, "tools": [TOOL],
                                                      "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("tools on completions", "POST", COMPLETIONS, {**GOOD_COMPLETION, "tools": [TOOL]}, 400, "tools"),
    ("unknown model", "POST", COMPLETIONS, {**GOOD_COMPLETION, "model": "gpt-4"}, 404, "model"),
    ("prompt too long", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt": "hello " * 9000}, 400, "prompt"),
    ("body too large", "POST", COMPLETIONS, {**GOOD_COMPLETION, "prompt": "x" * MAX_BODY_BYTES}, 413, None),
    ("messages missing", "POST", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages empty", "POST", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("unknown role", "POST", CHAT, {**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role"),
    ("content number", "POST", CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("image part", "POST", CHAT,
     {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    ("chat n=17", "POST", CHAT, {**GOOD_CHAT, "n": 17}, 400, "n"),
    ("chat logprobs not bool", "POST", CHAT, {**GOOD_CHAT, "logprobs": 3}, 400, "logprobs"),
    ("top_logprobs above 20", "POST", CHAT, {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat unknown model", "POST", CHAT, {**GOOD_CHAT, "model": "llama"}, 404, "model"),
    ("unknown route", "POST", "/v1/nothing", {}, 404, None),
    ("wrong method", "GET", COMPLETIONS, None, 405, None),
    ("cancel unknown request", "DELETE", "/v1/requests/cmpl-0123", None, 404, "id"),
    ("status of unknown request", "GET", "/v1/requests/cmpl-0123", None, 404, "id"),
    ("re-attach unknown request", "GET", "/v1/requests/cmpl-0123/stream", None, 404, "id"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_input_gets_openai_error_then_a_good_request_succeeds(
    gateway, scheduler, method, path, body, status, param
):
    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {}
    if isinstance(body, dict):
        kwargs = {"json": body}
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.request(method, path, **kwargs)
        assert response.status == status, f"{method} {path}: status {response.status}, body {await response.text()}"
        assert response.content_type == "application/json"
        assert_openai_error(await response.json(), param)
    good_status, good = await post_json(gateway, COMPLETIONS, GOOD_COMPLETION)
    assert good_status == 200, f"a good request after the bad one failed: {good}"
    assert good["choices"][0]["text"] == " w0 w1 w2"


async def test_n_above_the_limit_says_the_limit(gateway):
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "n": 17})
    assert status == 400
    assert "1 to 16" in body["error"]["message"] and "17" in body["error"]["message"], body


async def test_prompt_too_long_is_refused_with_context_length_code(gateway, scheduler):
    context = load_metadata(MODEL).config.context_length
    prompt = [1] * context
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "prompt": prompt, "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "prompt"
    # One token short of the context with one output token fits exactly.
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "prompt": prompt[:-1], "max_tokens": 1})
    assert status == 200 and body["choices"][0]["text"] == " w0", body


@pytest.mark.parametrize(
    "extra",
    [
        {"unknown_field": {"nested": 1}},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "echo": False, "n": 1},
        {"prompt": ["a single prompt in a list"]},
        {"prompt": [19556, 905]},
        {"top_k": -1, "top_p": 1, "temperature": 0},
        {"max_completion_tokens": 3, "max_tokens": None},
        {"stop": "never", "seed": -5, "user": "someone", "ignore_eos": True},
    ],
    ids=["unknown field", "defaults of unsupported", "list of one prompt", "token ids", "off values", "new name",
         "misc"],  # fmt: skip
)
async def test_accepted_variants(gateway, scheduler, extra):
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, **extra})
    assert status == 200, body
    assert body["choices"][0]["text"] == " w0 w1 w2"


async def test_accepted_request_is_in_redis_before_the_answer(gateway, held_scheduler, redis_client, tokenizer):
    body = {**GOOD_COMPLETION, "prompt": "The capital of France", "stream": True, "temperature": 0.7, "top_p": 0.9,
            "top_k": 40, "seed": 1234, "stop": ["\n", "END"], "max_tokens": 5, "ignore_eos": True}  # fmt: skip
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json=body)
        assert response.status == 200 and response.content_type == "text/event-stream"
        # Headers are out, no token yet (the scheduler holds): Redis must already hold everything.
        [new_entry] = await redis_client.xrange(keys.NEW_REQUESTS_STREAM)
        request_id = new_entry[1][b"id"].decode()
        assert request_id.startswith("cmpl-") and len(request_id) == len("cmpl-") + 32
        assert await redis_client.sismember(keys.ACTIVE_REQUESTS_SET, request_id)
        record = decode(RequestRecord, await redis_client.hget(keys.request_key(request_id), "record"))
        assert record.request_id == request_id
        assert list(record.prompt_token_ids) == tokenizer.encode("The capital of France")
        sampling = record.sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.7, 0.9, 40, 1234)
        assert sampling.stop == ("\n", "END") and sampling.max_tokens == 5 and sampling.ignore_eos
        assert abs(record.arrival_time - time.time()) < 10
        held_scheduler.release()
        payloads = await read_sse(response)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[0])["id"] == request_id


async def accepted_record(client, redis_client, path: str, body: dict) -> RequestRecord:
    """Send a streaming request, read its first chunk's id, and return the record in Redis."""
    async with asyncio.timeout(WAIT_SECONDS):
        response = await client.post(path, json={**body, "stream": True})
        assert response.status == 200, await response.text()
        if path == CHAT:
            request_id = json.loads((await response.content.readline()).removeprefix(b"data: "))["id"]
        else:
            request_id = (await redis_client.xrange(keys.NEW_REQUESTS_STREAM))[-1][1][b"id"].decode()
        response.close()
    return decode(RequestRecord, await redis_client.hget(keys.request_key(request_id), "record"))


async def test_every_request_is_seeded_and_chat_defaults_to_the_remaining_context(
    gateway, held_scheduler, redis_client, tokenizer
):
    chat = await accepted_record(gateway, redis_client, CHAT, {"messages": GOOD_CHAT["messages"], "max_tokens": None})
    prompt = tokenizer.encode_chat(GOOD_CHAT["messages"])
    assert list(chat.prompt_token_ids) == prompt
    assert chat.sampling.max_tokens == load_metadata(MODEL).config.context_length - len(prompt)
    assert chat.sampling.temperature == 1.0, "OpenAI's default temperature"
    # No model: the served one.
    completion = await accepted_record(gateway, redis_client, COMPLETIONS, {"prompt": "x"})
    assert completion.sampling.max_tokens == 16, "completions default to 16 output tokens"
    assert chat.sampling.seed != completion.sampling.seed, "each request without a seed draws its own"


async def test_non_stream_completion_with_the_openai_client(gateway, scheduler):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="x", max_retries=0, timeout=WAIT_SECONDS)
    completion = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == MODEL and abs(completion.created - time.time()) < 10
    [choice] = completion.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, " w0 w1 w2 w3", "length")
    assert choice.logprobs is None
    assert completion.usage.completion_tokens == 4 and completion.usage.prompt_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 4

    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=2,
    )
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == " w0 w1"
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 2
    await client.close()


async def test_stream_chat_with_the_openai_client_and_usage(gateway, scheduler):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="x", max_retries=0, timeout=WAIT_SECONDS)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == " w0 w1 w2"
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(chunk.usage is None for chunk in chunks[:-1])
    await client.close()


async def test_a_stream_idle_long_enough_for_keep_alives_reads_in_the_openai_client(
        gateway, redis_client, monkeypatch):
    """An idle stream sends a keep-alive comment; the OpenAI Python client, which keeps the last
    event id, makes an (empty, unparsable) event of a comment that ends in a blank line after an
    event with an id: the comment must not end one."""
    from openai import AsyncOpenAI

    from services.gateway import generation

    monkeypatch.setattr(generation, "KEEPALIVE_SECONDS", 0.01)
    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="x", max_retries=0, timeout=WAIT_SECONDS)
    async with running(FakeScheduler(redis_client, delay=1.2)):  # (a keep-alive between tokens: BLOCK_MS)
        stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].text for chunk in chunks) == " w0 w1 w2"
    assert chunks[-1].choices[0].finish_reason == "length"
    await client.close()


async def test_stream_completion_sse_format(gateway, scheduler):
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "stream": True})
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["X-Request-Id"].startswith("cmpl-"), "the id comes before any token"
        raw = await response.read()
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw
    ids_and_data = [event.split("\n") for event in events[:-2]]
    assert [lines[0] for lines in ids_and_data] == ["id: 1", "id: 2", "id: 3"], "each id is where to resume"
    chunks = [json.loads(lines[1].removeprefix("data: ")) for lines in ids_and_data]
    assert [chunk["choices"][0]["text"] for chunk in chunks] == [" w0", " w1", " w2"]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, "length"]
    assert all(chunk["object"] == "text_completion" and "usage" not in chunk for chunk in chunks)

    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(
            COMPLETIONS, json={**GOOD_COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        )
        payloads = await read_sse(response)
    assert payloads[-1] == "[DONE]"
    usage_chunk = json.loads(payloads[-2])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 3


async def test_the_stop_list_reaches_the_scheduler_and_its_stop_finish_reaches_the_client(gateway, scheduler,
                                                                                          redis_client):
    """The gateway's part only: the stop strings go into the request's record, and the end the
    scheduler sends (here the fake one, which cuts at them itself) becomes the answer. The real
    scheduler's search of the text: tests/test_scheduler_output.py, and through the whole system
    tests/test_system.py's stop-string test."""
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 10, "stop": ["w4", "w7"]})
    assert status == 200, body
    assert body["choices"][0]["text"] == " w0 w1 w2 w3" and body["choices"][0]["finish_reason"] == "stop"
    record = decode(RequestRecord, await redis_client.hget(keys.request_key(body["id"]), "record"))
    assert record.sampling.stop == ("w4", "w7")


async def test_delete_a_running_request_then_again_then_a_finished_one(gateway, held_scheduler, redis_client):
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "stream": True})
        request_id = (await redis_client.xrange(keys.NEW_REQUESTS_STREAM))[0][1][b"id"].decode()
        first = await gateway.delete(f"/v1/requests/{request_id}")
        assert first.status == 200
        body = await first.json()
        assert body["id"] == request_id and body["object"] == "request.cancel" and body["cancelled"] is True
        assert body["status"] == "cancelled"  # the answer comes once the request has ended
        payloads = await read_sse(response)
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "cancelled"
    assert payloads[-1] == "[DONE]"
    # The scheduler writes the final event and the status in either order: wait for the status.
    await wait_until(lambda: _status_is(redis_client, request_id, b"cancelled"), "status cancelled")
    async with asyncio.timeout(WAIT_SECONDS):
        second = await (await gateway.delete(f"/v1/requests/{request_id}")).json()
    assert second["cancelled"] is False and second["status"] == "cancelled"
    assert await cancel_entries(redis_client) == [request_id], "a second cancel of an ended request sends nothing"

    held_scheduler.release()
    status, done = await post_json(gateway, COMPLETIONS, GOOD_COMPLETION)
    assert status == 200
    async with asyncio.timeout(WAIT_SECONDS):
        finished = await (await gateway.delete(f"/v1/requests/{done['id']}")).json()
        state = await (await gateway.get(f"/v1/requests/{done['id']}")).json()
    assert finished == {"id": done["id"], "object": "request.cancel", "status": "finished", "cancelled": False}
    assert state["status"] == "finished" and state["finish_reason"] == "length" and state["token_events"] == 3


async def test_client_disconnect_mid_stream_cancels_the_request(gateway, held_scheduler, redis_client):
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(CHAT, json={**GOOD_CHAT, "stream": True})
        first_line = await response.content.readline()
        assert first_line.startswith(b"data: ") and b'"role": "assistant"' in first_line
        request_id = json.loads(first_line.removeprefix(b"data: "))["id"]
        response.close()  # the client goes away mid-stream
    await wait_until(lambda: _has_cancel(redis_client, request_id), "a CANCEL_STREAM entry")
    await wait_until(
        lambda: _status_is(redis_client, request_id, b"cancelled"), "the fake scheduler to end the request"
    )


async def test_client_disconnect_while_waiting_for_a_whole_answer_cancels(gateway, held_scheduler, redis_client):
    waiting = asyncio.create_task(gateway.post(COMPLETIONS, json=GOOD_COMPLETION))
    request_id = (
        await wait_until(lambda: redis_client.smembers(keys.ACTIVE_REQUESTS_SET), "the request to be accepted")
    ).pop().decode()
    waiting.cancel()  # the client gives up: its connection closes
    await asyncio.gather(waiting, return_exceptions=True)
    await wait_until(lambda: _has_cancel(redis_client, request_id), "a CANCEL_STREAM entry")


async def test_a_finished_request_is_not_cancelled(gateway, scheduler, redis_client):
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "stream": True})
        payloads = await read_sse(response)
        response.close()
    assert payloads[-1] == "[DONE]"
    status, _ = await post_json(gateway, COMPLETIONS, GOOD_COMPLETION)
    assert status == 200
    # Not a sleep: once no generation handler is running and the cancels they started in the
    # background are done, any cancel the gateway was going to send is in Redis.
    state = gateway.server.app[STATE]
    await wait_until(lambda: _true(state.metrics.in_flight._value.get() == 0), "the handlers to return")
    await state.drain_background()
    assert await cancel_entries(redis_client) == []


async def _true(value: bool) -> bool:
    return value


async def _has_cancel(redis_client, request_id: str) -> bool:
    return request_id in await cancel_entries(redis_client)


async def _status_is(redis_client, request_id: str, status: bytes) -> bool:
    return await redis_client.hget(keys.request_key(request_id), "status") == status


async def test_reattach_replays_from_an_index_then_follows_live(gateway, held_scheduler, redis_client):
    held_scheduler.release()
    status, done = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 6})
    assert status == 200
    async with asyncio.timeout(WAIT_SECONDS):
        params = {"from": "3", "include_usage": "true"}
        response = await gateway.get(f"/v1/requests/{done['id']}/stream", params=params)
        assert response.status == 200
        payloads = await read_sse(response)
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert [chunk["choices"][0]["text"] for chunk in chunks[:-1]] == [" w3", " w4", " w5"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and payloads[-1] == "[DONE]"
    assert all(chunk["id"] == done["id"] and chunk["object"] == "text_completion" for chunk in chunks)

    # Live: attach to a chat request that has produced nothing yet, then let it run.
    held_scheduler.released.clear()
    async with asyncio.timeout(WAIT_SECONDS):
        original = await gateway.post(CHAT, json={**GOOD_CHAT, "stream": True})
        request_id = json.loads((await original.content.readline()).removeprefix(b"data: "))["id"]
        attached = await gateway.get(f"/v1/requests/{request_id}/stream")
        held_scheduler.release()
        payloads = await read_sse(attached)
        await read_sse(original)
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == " w0 w1 w2"
    assert await cancel_entries(redis_client) == []


def scheduler_info(**overrides) -> SchedulerInfo:
    now = time.time()
    values = dict(pid=1, policy="iteration", started_at=now - 5, heartbeat_at=now, last_iteration_at=now,
                  iterations=7, waiting=2, running=3, executors=["engine"])  # fmt: skip
    return SchedulerInfo(**{**values, **overrides})


def worker_info(worker_id: str) -> WorkerInfo:
    now = time.time()
    return WorkerInfo(
        worker_id=worker_id, pid=42, host="localhost", device="cpu", kv_block_size=16,
        kv_blocks_total=100, kv_blocks_free=60, running=3, started_at=now, heartbeat_at=now,
    )  # fmt: skip


async def get_json(client, path: str) -> tuple[int, dict]:
    async with asyncio.timeout(WAIT_SECONDS):
        response = await client.get(path)
        return response.status, await response.json()


async def test_health_needs_scheduler_and_a_live_worker_and_progress(gateway, redis_client):
    status, body = await get_json(gateway, "/health")
    assert status == 503 and body == {"status": "unavailable", "missing": ["scheduler", "workers"]}

    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(scheduler_info()), px=5000)
    await redis_client.sadd(keys.WORKERS_SET, "w-dead")  # registered, but its heartbeat key expired
    status, body = await get_json(gateway, "/health")
    assert status == 503 and body["missing"] == ["workers"]

    await redis_client.set(keys.worker_heartbeat("w1"), encode(worker_info("w1")), px=5000)
    await redis_client.sadd(keys.WORKERS_SET, "w1")
    # A live worker the scheduler has not seen yet (its heartbeat names no executor): not ready,
    # since no request can be placed on it and no answer could say what made it.
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(scheduler_info(executors=[])), px=5000)
    status, body = await get_json(gateway, "/health")
    assert status == 503 and body["missing"] == ["workers"]
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(scheduler_info()), px=5000)
    status, body = await get_json(gateway, "/health")
    assert status == 200 and body["status"] == "ok" and body["workers"] == 1 and body["executor"] == "engine", body

    stalled = scheduler_info(last_iteration_at=time.time() - 120)  # requests wait, nothing ran for 2 min
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(stalled), px=5000)
    status, body = await get_json(gateway, "/health")
    assert status == 503 and body["missing"] == ["progress"] and "waiting" in body["reason"]

    never_ran = scheduler_info(last_iteration_at=0.0, started_at=time.time() - 120)
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(never_ran), px=5000)
    assert (await get_json(gateway, "/health"))[0] == 503
    idle = scheduler_info(last_iteration_at=time.time() - 120, waiting=0)  # idle is not stalled
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(idle), px=5000)
    assert (await get_json(gateway, "/health"))[0] == 200


async def test_status_and_metrics(gateway, scheduler, redis_client):
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(scheduler_info()), px=5000)
    await redis_client.set(keys.worker_heartbeat("w1"), encode(worker_info("w1")), px=5000)
    await redis_client.sadd(keys.WORKERS_SET, "w1", "w-dead")
    status, body = await get_json(gateway, "/status")
    assert status == 200
    assert body["waiting"] == 2 and body["running"] == 3 and body["scheduler"]["iterations"] == 7
    [worker] = body["workers"]
    assert {key: worker[key] for key in ("id", "pid", "device", "kv_blocks_total", "kv_blocks_free", "running",
                                         "draining")} == {  # fmt: skip
        "id": "w1", "pid": 42, "device": "cpu", "kv_blocks_total": 100, "kv_blocks_free": 60, "running": 3,
        "draining": False,
    }  # fmt: skip
    assert worker["model"] == "smollm2-135m-instruct"
    assert body["models"]["smollm2-135m-instruct"] == {
        "waiting": 2, "running": 3, "active_requests": 0, "workers": ["w1"], "scheduler": body["scheduler"],
        "schedulers": [], "speculative": None}

    assert (await post_json(gateway, COMPLETIONS, GOOD_COMPLETION))[0] == 200
    assert (await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "temperature": 9}))[0] == 400
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.get("/metrics")
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
    expected = [
        'iterserve_gateway_requests_total{endpoint="completions",outcome="length"} 1.0',
        'iterserve_gateway_requests_total{endpoint="completions",outcome="400"} 1.0',
        "iterserve_gateway_time_to_first_token_seconds_count 1.0",
        "iterserve_gateway_time_per_output_token_seconds_count 1.0",
        "iterserve_gateway_e2e_request_latency_seconds_count 1.0",
        'iterserve_scheduler_waiting_requests{model="smollm2-135m-instruct"} 2.0',
        'iterserve_scheduler_running_requests{model="smollm2-135m-instruct"} 3.0',
        'iterserve_live_workers{model="smollm2-135m-instruct"} 1.0',
    ]
    missing = [line for line in expected if line not in text]
    assert not missing, f"/metrics lacks {missing}:\n{text}"


async def test_vllm_named_metrics_beside_ours_and_the_scheduler_counters_outlive_it(gateway, scheduler, redis_client):
    """The series routers and autoscalers read from vLLM, under its names and `model_name` label: the
    queue, KV use, latencies and tokens from this gateway, and the prefix-cache counters from the
    scheduler's totals in Redis (a scheduler restart, whose own counts start over, keeps them)."""
    model = 'model_name="smollm2-135m-instruct"'
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(scheduler_info()), px=5000)
    await redis_client.set(keys.worker_heartbeat("w1"), encode(worker_info("w1")), px=5000)
    await redis_client.sadd(keys.WORKERS_SET, "w1")
    await redis_client.hset(keys.SINGLE_MODEL.counters, mapping={"prefix_cache_queried_tokens": 900,
                                                                 "prefix_cache_hit_tokens": 600})
    assert (await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 4}))[0] == 200
    async with asyncio.timeout(WAIT_SECONDS):
        text = await (await gateway.get("/metrics")).text()
    expected = [f"vllm:num_requests_waiting{{{model}}} 2.0", f"vllm:num_requests_running{{{model}}} 3.0",
                f"vllm:kv_cache_usage_perc{{{model}}} 0.4", f"vllm:time_to_first_token_seconds_count{{{model}}} 1.0",
                f"vllm:inter_token_latency_seconds_count{{{model}}} 3.0",
                f"vllm:e2e_request_latency_seconds_count{{{model}}} 1.0",
                f"vllm:generation_tokens_total{{{model}}} 4.0", f"vllm:prefix_cache_queries_total{{{model}}} 900.0",
                f"vllm:prefix_cache_hits_total{{{model}}} 600.0", "# TYPE vllm:prefix_cache_hits_total counter"]
    missing = [line for line in expected if line not in text]
    assert not missing, f"/metrics lacks {missing}:\n{text}"
    assert re.search(rf"vllm:prompt_tokens_total{{{model}}} [1-9]", text)
    await redis_client.delete(keys.SINGLE_MODEL.counters)


async def test_livez_answers_while_nothing_behind_the_gateway_does(redis_url, tokenizer):
    """/livez (a restart probe) and /version answer when Redis is unreachable and /health says 503."""
    from services.launcher import free_port

    settings = gateway_settings(f"redis://127.0.0.1:{free_port()}/0")
    async with serve_gateway(settings, tokenizer) as client:
        async with asyncio.timeout(WAIT_SECONDS):
            live, version, health = (await client.get("/livez"), await client.get("/version"),
                                     await client.get("/health"))
            assert (live.status, await live.json()) == (200, {"status": "alive"})
            assert version.status == 200 and (await version.json())["version"] == "0.1.0"
            assert health.status == 503


async def test_a_failed_request_is_an_error_not_a_500(gateway, redis_client):
    async with running(FakeScheduler(redis_client, fail=True)):
        status, body = await post_json(gateway, COMPLETIONS, GOOD_COMPLETION)
        assert status == 503 and body["error"]["code"] == "request_failed", body
        async with asyncio.timeout(WAIT_SECONDS):
            response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "stream": True})
            payloads = await read_sse(response)
    assert json.loads(payloads[0])["choices"][0]["text"] == " w0"
    assert json.loads(payloads[-2])["error"]["code"] == "request_failed" and payloads[-1] == "[DONE]"


async def test_an_end_without_a_token_counts_every_token_the_stream_carried(gateway, redis_client):
    async with running(FakeScheduler(redis_client, counted_short_at=3)):
        status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 10})
    assert status == 200 and body["choices"][0]["text"] == " w0 w1 w2", body
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 3


async def test_a_streamed_end_without_a_token_repeats_no_resume_id(gateway, redis_client):
    """The end (index 2: the tokens the scheduler applied) comes after the stream carried token 2
    (a worker's entry of a token in flight): its chunk adds no token, so it carries no SSE id; the
    ids stay where a reader resumes, each once (a reader takes a repeated id for a repeated token)."""
    async with running(FakeScheduler(redis_client, counted_short_at=3)), asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "max_tokens": 10, "stream": True,
                                                         "stream_options": {"include_usage": True}})
        raw = (await response.read()).decode()
    events = [event.split("\n") for event in raw.split("\n\n")[:-2]]
    assert [lines[0] for lines in events if lines[0].startswith("id: ")] == ["id: 1", "id: 2", "id: 3"], raw
    final = json.loads(events[-2][-1].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "stop" and not events[-2][0].startswith("id: "), raw
    assert json.loads(events[-1][-1].removeprefix("data: "))["usage"]["completion_tokens"] == 3


async def test_a_bug_in_the_gateway_is_a_500_with_an_error_body_and_the_gateway_serves_on(
        gateway, scheduler, monkeypatch, caplog):
    """An unexpected exception is a bug: 500 (not a 503 that invites retries into it), an OpenAI
    error body, the traceback logged with the request's id; the next request is served."""
    from services.gateway import responses

    def broken_chunk_writer(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(responses, "final_body", broken_chunk_writer)
    monkeypatch.setattr("services.gateway.generation.final_body", broken_chunk_writer)
    status, body = await post_json(gateway, COMPLETIONS, GOOD_COMPLETION)
    assert status == 500, body
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
    logged = [record for record in caplog.records if "unexpected error" in record.getMessage()]
    assert logged and "id=cmpl-" in logged[0].getMessage() and logged[0].exc_info is not None
    monkeypatch.undo()
    status, body = await post_json(gateway, COMPLETIONS, GOOD_COMPLETION)
    assert status == 200 and body["choices"][0]["text"] == " w0 w1 w2"


async def test_logprobs_in_openais_shapes_whole_and_streamed(gateway, scheduler, tokenizer):
    """Completions: parallel lists (tokens, token_logprobs, top_logprobs, text_offset); chat: a
    `content` list of {token, logprob, bytes, top_logprobs}; a stream carries each token's with
    the chunk of its text."""
    def text(token_id: int) -> str:
        return tokenizer.token_text(token_id)

    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "logprobs": 2})
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": [text(100), text(101), text(102)],
        "token_logprobs": [fake_logprob(0), fake_logprob(1), fake_logprob(2)],
        "top_logprobs": [{text(100 + i): fake_logprob(i), text(17): -3.0} for i in range(3)],
        "text_offset": [0, 3, 6],  # " w0", " w1", " w2"
    }
    status, body = await post_json(gateway, CHAT, {**GOOD_CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [{"token": text(100 + i), "logprob": fake_logprob(i), "bytes": list(tokenizer.token_bytes(100 + i)),
                        "top_logprobs": [{"token": text(100 + i), "logprob": fake_logprob(i),
                                          "bytes": list(tokenizer.token_bytes(100 + i))}]} for i in range(2)]
    status, body = await post_json(gateway, CHAT, {**GOOD_CHAT, "max_tokens": 2, "logprobs": True})
    assert [entry["top_logprobs"] for entry in body["choices"][0]["logprobs"]["content"]] == [[], []]
    status, body = await post_json(gateway, CHAT, {**GOOD_CHAT, "max_tokens": 2})
    assert body["choices"][0]["logprobs"] is None, "no logprobs unless asked"
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "logprobs": 1, "stream": True})
        payloads = await read_sse(response)
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    streamed = [chunk["choices"][0]["logprobs"] for chunk in chunks if chunk["choices"][0]["text"]]
    assert [entry["token_logprobs"] for entry in streamed] == [[fake_logprob(i)] for i in range(3)]
    assert [entry["top_logprobs"] for entry in streamed] == [[{text(100 + i): fake_logprob(i)}] for i in range(3)]


async def test_models_list(gateway):
    status, body = await get_json(gateway, "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [model["id"] for model in body["data"]] == [MODEL] and body["data"][0]["object"] == "model"


async def test_redis_down_answers_503_then_recovers_after_restart(tokenizer):
    from tests.redis_server import RedisProcess

    server = RedisProcess().start()
    try:
        async with serve_gateway(gateway_settings(server.url), tokenizer) as client:
            server.stop()
            started = time.monotonic()
            status, body = await post_json(client, COMPLETIONS, GOOD_COMPLETION)
            assert status == 503 and body["error"]["code"] == "service_unavailable", body
            status, body = await get_json(client, "/health")
            assert status == 503 and body["missing"] == ["redis"]
            assert time.monotonic() - started < 15, "a Redis outage must not hang the client"

            server.start()  # same port, same data directory
            from shared.redis_connection import connect

            redis = connect(server.url)
            try:
                async with running(FakeScheduler(redis)):
                    status, body = await post_json(client, COMPLETIONS, GOOD_COMPLETION)
                    assert status == 200, body
            finally:
                await redis.aclose()
    finally:
        server.close()



async def until_listening(send):
    """The response to send() once the gateway listens (run_gateway binds its port in the background)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            return await send()
        except aiohttp.ClientConnectionError:
            assert time.monotonic() < deadline, "run_gateway never listened"
            await asyncio.sleep(0.05)


async def test_run_gateway_serves_on_its_port_until_stopped(redis_url, redis_client):
    from tests.redis_server import free_port

    port = free_port()
    stop_event = asyncio.Event()
    serving = asyncio.create_task(run_gateway(gateway_settings(redis_url, port=port), stop_event))
    try:
        async with aiohttp.ClientSession() as session:
            async with await until_listening(lambda: session.get(f"http://127.0.0.1:{port}/v1/models")) as response:
                assert response.status == 200
    finally:
        stop_event.set()
        await asyncio.wait_for(serving, WAIT_SECONDS)


async def test_a_stopping_gateway_leaves_its_open_streams_running_for_a_reattach(redis_url, redis_client,
                                                                                 held_scheduler):
    from tests.redis_server import free_port

    port = free_port()
    stop_event = asyncio.Event()
    serving = asyncio.create_task(run_gateway(gateway_settings(redis_url, port=port), stop_event))
    try:
        async with aiohttp.ClientSession() as session:
            response = await until_listening(lambda: session.post(f"http://127.0.0.1:{port}{COMPLETIONS}",
                                                                  json={**GOOD_COMPLETION, "stream": True}))
            request_id = (await redis_client.xrange(keys.NEW_REQUESTS_STREAM))[0][1][b"id"].decode()
            stop_event.set()  # SIGTERM: the gateway closes the stream on its way out
            await asyncio.wait_for(serving, 20)
            response.close()
    finally:
        stop_event.set()
        await asyncio.wait({serving}, timeout=20)
    assert await cancel_entries(redis_client) == [], "a gateway going away is not a client going away"
    assert request_id in {member.decode() for member in await redis_client.smembers(keys.ACTIVE_REQUESTS_SET)}


async def test_tokenize_and_detokenize_in_vllms_shapes(gateway, tokenizer):
    status, body = await post_json(gateway, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    ids = tokenizer.encode_prompt("Hello world")
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    assert body["token_strs"] == [tokenizer.token_text(token_id) for token_id in ids]
    status, body = await post_json(gateway, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert body["tokens"] == tokenizer.encode("Hello world") and body["token_strs"] is None
    messages = [{"role": "user", "content": "Hi there"}]
    status, body = await post_json(gateway, "/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == tokenizer.encode_chat(messages)
    status, body = await post_json(gateway, "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": tokenizer.decode(ids)}
    for path, bad, param in (("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                             ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                             ("/detokenize", {"tokens": [tokenizer.vocab_size]}, "tokens"),
                             ("/detokenize", {"tokens": "1 2"}, "tokens"),
                             ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model")):
        status, body = await post_json(gateway, path, bad)
        assert status in (400, 404) and body["error"]["param"] == param, (bad, body)


async def test_echo_starts_the_completion_with_the_prompt(gateway, scheduler, tokenizer):
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "echo": True})
    assert status == 200 and body["choices"][0]["text"] == GOOD_COMPLETION["prompt"] + " w0 w1 w2", body
    ids = tokenizer.encode_prompt("Hi there")
    status, body = await post_json(gateway, COMPLETIONS, {**GOOD_COMPLETION, "prompt": ids, "echo": True})
    assert body["choices"][0]["text"] == tokenizer.decode(ids) + " w0 w1 w2"
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "echo": True, "stream": True})
        payloads = await read_sse(response)
    texts = [json.loads(payload)["choices"][0]["text"] for payload in payloads[:-1]]
    assert texts[0] == GOOD_COMPLETION["prompt"] and "".join(texts) == GOOD_COMPLETION["prompt"] + " w0 w1 w2"


async def stored_record(redis_client, request_id: str) -> RequestRecord | None:
    raw = await redis_client.hget(keys.request_key(request_id), "record")
    return None if raw is None else decode(RequestRecord, raw)


async def test_n_choices_each_a_request_of_its_own_seed_submitted_after_the_first_token(
        gateway, held_scheduler, redis_client):
    """Choice i is the request `<id>.i` with the seed seed + i; choices 1.. are submitted once choice 0
    has its first token (its prompt cached by then: the prefill is done once)."""
    async with asyncio.timeout(WAIT_SECONDS):
        pending = asyncio.create_task(gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "n": 3, "seed": 7}))
        await wait_until(lambda: redis_client.xlen(keys.NEW_REQUESTS_STREAM), "choice 0 submitted")
        await asyncio.sleep(0.3)
        assert await redis_client.xlen(keys.NEW_REQUESTS_STREAM) == 1, "the other choices went before choice 0's token"
        held_scheduler.release()
        response = await pending
        body = await response.json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert all(choice["text"] == " w0 w1 w2" for choice in body["choices"]), body
    assert body["usage"]["completion_tokens"] == 9 and body["usage"]["prompt_tokens"] == 1  # (counted once)
    records = [await stored_record(redis_client, request_id)
               for request_id in (body["id"], f"{body['id']}.1", f"{body['id']}.2")]
    assert [record.sampling.seed for record in records] == [7, 8, 9]


async def test_n_choices_streamed_with_their_indexes(gateway, scheduler):
    async with asyncio.timeout(WAIT_SECONDS):
        response = await gateway.post(CHAT, json={**GOOD_CHAT, "n": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        payloads = await read_sse(response)
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: " w0 w1 w2", 1: " w0 w1 w2"} and finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_cancelling_an_answer_of_n_choices_cancels_every_choice(gateway, redis_client):
    slow = FakeScheduler(redis_client, delay=0.2)
    async with running(slow):
        async with asyncio.timeout(WAIT_SECONDS):
            pending = asyncio.create_task(gateway.post(COMPLETIONS, json={**GOOD_COMPLETION, "n": 3,
                                                                          "max_tokens": 50}))
            async def three() -> bool:
                return await redis_client.xlen(keys.NEW_REQUESTS_STREAM) == 3

            await wait_until(three, "all three choices submitted")
            entries = await redis_client.xrange(keys.NEW_REQUESTS_STREAM)
            request_id = entries[0][1][b"id"].decode()
            response = await gateway.delete(f"/v1/requests/{request_id}")
            assert response.status == 200
            answer = await (await pending).json()
        assert {request_id, f"{request_id}.1", f"{request_id}.2"} <= slow.cancelled
        assert all(choice["finish_reason"] == "cancelled" for choice in answer["choices"]), answer
