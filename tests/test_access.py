"""Access and admission at the gateway (services/gateway/admission.py): API keys, 429 with
Retry-After past the waiting limits, open requests per key, per-request limits, a slow reader,
and the OpenAPI document. Real Redis and tokenizer; FakeScheduler (tests/test_gateway.py) stands
in for the scheduler."""

import asyncio
import json
import logging
import socket

import pytest
from aiohttp import web

from services.gateway.admission import key_id
from services.gateway.app import create_app, warn_if_open
from services.gateway.state import STATE
from services.gateway.store import READ_COUNT
from shared import keys
from shared.exits import CONFIGURATION_ERROR
from shared.messages import IterationRecord, RequestRecord, TokenEvent
from shared.wire import decode, encode
from tests.test_gateway import (  # noqa: F401 (tokenizer is a fixture)
    CHAT,
    COMPLETIONS,
    GOOD_CHAT,
    GOOD_COMPLETION,
    WAIT_SECONDS,
    FakeScheduler,
    assert_openai_error,
    gateway_settings,
    read_sse,
    running,
    scheduler_info,
    serve_gateway,
    tokenizer,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

KEY_A, KEY_B = "sk-test-alpha-0123456789", "sk-test-beta-9876543210"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}


async def call(client, method: str, path: str, **kwargs) -> tuple[int, dict, dict]:
    async with asyncio.timeout(WAIT_SECONDS):
        response = await client.request(method, path, **kwargs)
        body = await response.json() if response.content_type == "application/json" else {}
        return response.status, body, dict(response.headers)


async def open_stream(client, path: str, body: dict, headers: dict | None = None):
    """A streaming request whose headers are out (so it is accepted and counted); the caller closes it."""
    async with asyncio.timeout(WAIT_SECONDS):
        response = await client.post(path, json={**body, "stream": True}, headers=headers)
    assert response.status == 200, await response.text()
    return response


@pytest.fixture
async def keyed(redis_url, redis_client, tokenizer):  # noqa: F811
    settings = gateway_settings(redis_url, api_keys=f"{KEY_A}, {KEY_B}")
    async with serve_gateway(settings, tokenizer) as client:
        yield client


@pytest.fixture
async def held(redis_client):
    async with running(FakeScheduler(redis_client, hold=True)) as fake:
        yield fake


# API keys


async def test_every_v1_request_needs_a_valid_key_while_health_and_openapi_stay_open(keyed, held):
    for headers, code in [(None, None), ({"Authorization": "Bearer sk-wrong"}, "invalid_api_key"),
                          ({"Authorization": f"Basic {KEY_A}"}, "invalid_api_key"),
                          ({"Authorization": "Bearer"}, "invalid_api_key")]:  # fmt: skip
        for method, path, body in [("POST", COMPLETIONS, GOOD_COMPLETION), ("POST", CHAT, GOOD_CHAT),
                                   ("GET", "/v1/models", None), ("GET", "/v1/requests/cmpl-1", None),
                                   ("DELETE", "/v1/requests/cmpl-1", None), ("GET", "/v1/nothing", None)]:  # fmt: skip
            status, error, response_headers = await call(keyed, method, path, json=body, headers=headers)
            assert status == 401, f"{method} {path} with {headers}: {status} {error}"
            assert_openai_error(error, None)
            assert error["error"]["code"] == code and error["error"]["type"] == "invalid_request_error"
            assert response_headers["WWW-Authenticate"].startswith("Bearer")
    assert await keyed.server.app[STATE].store.redis.xlen(keys.NEW_REQUESTS_STREAM) == 0, "nothing got in"
    status, body, _ = await call(keyed, "GET", "/v1/models", headers=AUTH_B)
    assert status == 200 and body["object"] == "list"
    status, body, _ = await call(keyed, "GET", "/health")
    assert status == 503 and body["status"] == "unavailable", "open, and honest: no scheduler here"
    status, document, _ = await call(keyed, "GET", "/openapi.json")
    assert status == 200 and document["security"] == [{"bearer": []}]
    for path in ("/metrics", "/status"):  # not protected unless protect_observability
        async with asyncio.timeout(WAIT_SECONDS):
            assert (await keyed.get(path)).status == 200


async def test_the_dashboard_page_is_open_and_its_iteration_feed_needs_a_key(keyed, redis_client):
    """/dashboard is a static page with no data; /dashboard/events (the iteration records) is
    behind the key whenever keys are on, and streams records once given one."""
    async with asyncio.timeout(WAIT_SECONDS):
        page = await keyed.get("/dashboard")
        assert page.status == 200 and page.content_type == "text/html" and "/dashboard/events" in await page.text()
    status, error, _ = await call(keyed, "GET", "/dashboard/events")
    assert status == 401 and error["error"]["code"] is None
    record = IterationRecord(iteration=7, worker_id="w1", plan_id=3, request_ids=("cmpl-a", "cmpl-b"), joined=(),
                             finished=("cmpl-a",), cancelled=("cmpl-b",), prefill_tokens=0, decode_tokens=2,
                             started_at=1.0, finished_at=1.5, step_seconds=0.25)
    await redis_client.xadd(keys.ITERATIONS_STREAM, {"m": encode(record)})
    async with asyncio.timeout(WAIT_SECONDS):
        response = await keyed.get("/dashboard/events", headers=AUTH_A)
        assert response.status == 200 and response.content_type == "text/event-stream"
        events = {}
        while not {"iteration", "latency"} <= set(events):
            event = (await response.content.readuntil(b"\n\n")).decode()
            name, data = event.split("\n")[0].removeprefix("event: "), event.split("\n")[1].removeprefix("data: ")
            events[name] = json.loads(data)
        response.close()
    assert events["iteration"]["model"] == "smollm2-135m-instruct"
    assert events["iteration"]["cancelled"] == ["cmpl-b"] and events["iteration"]["iteration"] == 7
    assert set(events["latency"]) == {"ttft", "tpot"}


async def test_protect_observability_puts_metrics_and_status_behind_a_key(
    redis_url, redis_client, tokenizer  # noqa: F811
):
    settings = gateway_settings(redis_url, api_keys=KEY_A, protect_observability=True)
    async with serve_gateway(settings, tokenizer) as client:
        for path in ("/metrics", "/status"):
            status, error, _ = await call(client, "GET", path)
            assert status == 401, path
            assert_openai_error(error, None)
            async with asyncio.timeout(WAIT_SECONDS):
                assert (await client.get(path, headers=AUTH_A)).status == 200, path
                metrics = await (await client.get("/metrics", headers=AUTH_A)).text()
        assert 'iterserve_gateway_refusals_total{code="none",status="401"} 2.0' in metrics
        assert (await call(client, "GET", "/health"))[0] == 503


async def test_keys_from_a_file_and_a_missing_file_stops_the_start(
    redis_url, redis_client, tokenizer, tmp_path, capsys  # noqa: F811
):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team keys\n\n  {KEY_B}  \n")
    settings = gateway_settings(redis_url, api_keys_file=str(key_file))
    async with serve_gateway(settings, tokenizer) as client:
        assert (await call(client, "GET", "/v1/models", headers=AUTH_B))[0] == 200
        assert (await call(client, "GET", "/v1/models", headers=AUTH_A))[0] == 401
    (tmp_path / "empty").write_text("# nothing\n")
    for name, said in (("absent", "cannot read the API keys file"), ("empty", "holds no key")):
        with pytest.raises(SystemExit) as stopped:  # a setting that can never work: not restarted (shared/exits.py)
            create_app(gateway_settings(redis_url, api_keys_file=str(tmp_path / name)), tokenizer)
        assert stopped.value.code == CONFIGURATION_ERROR
        assert said in capsys.readouterr().err


async def test_a_request_carries_its_key_id_and_only_that_key_sees_it(keyed, held, redis_client):
    response = await open_stream(keyed, CHAT, GOOD_CHAT, AUTH_A)
    request_id = json.loads((await response.content.readline()).removeprefix(b"data: "))["id"]
    raw = await redis_client.hget(keys.request_key(request_id), "record")
    record = decode(RequestRecord, raw)
    assert record.client_key == key_id(KEY_A) and record.client_key.startswith("key-")
    assert KEY_A.encode() not in raw, "the key itself never reaches Redis"
    for method, path in [("GET", f"/v1/requests/{request_id}"), ("GET", f"/v1/requests/{request_id}/stream"),
                         ("DELETE", f"/v1/requests/{request_id}")]:  # fmt: skip
        status, error, _ = await call(keyed, method, path, headers=AUTH_B)
        assert status == 404 and error["error"]["code"] == "request_not_found", f"{method} {path} by another key"
    status, body, _ = await call(keyed, "GET", f"/v1/requests/{request_id}", headers=AUTH_A)
    assert status == 200 and body["status"] in ("waiting", "running")
    status, body, _ = await call(keyed, "DELETE", f"/v1/requests/{request_id}", headers=AUTH_A)
    assert status == 200 and body["cancelled"] is True
    response.close()


async def test_an_open_server_says_so_at_start(redis_url, tokenizer, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, "iterserve.gateway")
    warn_if_open(create_app(gateway_settings(redis_url), tokenizer)[STATE])
    warn_if_open(create_app(gateway_settings(redis_url, host="0.0.0.0"), tokenizer)[STATE])
    warn_if_open(create_app(gateway_settings(redis_url, api_keys=KEY_A), tokenizer)[STATE])
    messages = [record.getMessage() for record in caplog.records]
    assert "no API keys configured: the API is open to every process on this machine" in messages[0]
    assert "the API is OPEN to anyone who can reach this address" in messages[1]
    assert messages[2].startswith("API keys required")


# Bounded admission


def assert_busy(status: int, error: dict, headers: dict, what: str) -> None:
    assert status == 429, f"{status} {error}"
    assert_openai_error(error, None)
    assert error["error"]["code"] == "rate_limit_exceeded" and error["error"]["type"] == "rate_limit_error"
    assert what in error["error"]["message"], error
    assert int(headers["Retry-After"]) >= 1


async def test_past_the_waiting_requests_limit_a_request_gets_429_until_one_starts(
    redis_url, redis_client, tokenizer, held  # noqa: F811
):
    async with serve_gateway(gateway_settings(redis_url, max_waiting_requests=2), tokenizer) as client:
        first = await open_stream(client, COMPLETIONS, GOOD_COMPLETION)
        second = await open_stream(client, CHAT, GOOD_CHAT)
        for path, body in [(COMPLETIONS, GOOD_COMPLETION), (CHAT, {**GOOD_CHAT, "stream": True})]:
            assert_busy(*await call(client, "POST", path, json=body), "2 requests are waiting")
        assert await redis_client.xlen(keys.NEW_REQUESTS_STREAM) == 2, "a refused request never reaches Redis"
        held.release()  # first tokens: both requests stop waiting
        for response in (first, second):
            assert (await read_sse(response))[-1] == "[DONE]"
        status, body, _ = await call(client, "POST", COMPLETIONS, json=GOOD_COMPLETION)
        assert status == 200 and body["choices"][0]["text"] == " w0 w1 w2"
        assert client.server.app[STATE].admission.waiting_requests == 0


async def test_past_the_waiting_prompt_tokens_limit_a_request_gets_429(
    redis_url, redis_client, tokenizer, held  # noqa: F811
):
    prompt = "one two three four five six"  # 6 tokens
    settings = gateway_settings(redis_url, max_waiting_prompt_tokens=10)
    async with serve_gateway(settings, tokenizer) as client:
        first = await open_stream(client, COMPLETIONS, {**GOOD_COMPLETION, "prompt": prompt})
        assert_busy(*await call(client, "POST", COMPLETIONS, json={**GOOD_COMPLETION, "prompt": prompt}),
                    "prompt tokens are waiting")
        second = await open_stream(client, COMPLETIONS, {**GOOD_COMPLETION, "prompt": [5, 6, 7, 8]})  # 6 + 4 fit
        first.close()
        second.close()


async def test_the_scheduler_heartbeat_counts_requests_other_gateways_queued(
    redis_url, redis_client, tokenizer  # noqa: F811
):
    await redis_client.set(keys.SCHEDULER_HEARTBEAT, encode(scheduler_info(waiting=3, waiting_tokens=50)), px=5000)
    async with serve_gateway(gateway_settings(redis_url, max_waiting_requests=3), tokenizer) as client:
        assert_busy(*await call(client, "POST", COMPLETIONS, json=GOOD_COMPLETION), "3 requests are waiting")
    async with serve_gateway(gateway_settings(redis_url, max_waiting_prompt_tokens=50), tokenizer) as client:
        assert_busy(*await call(client, "POST", COMPLETIONS, json=GOOD_COMPLETION), "50 prompt tokens")


async def test_one_key_cannot_hold_more_than_its_open_requests_while_another_key_gets_in(
    redis_url, redis_client, tokenizer, held  # noqa: F811
):
    settings = gateway_settings(redis_url, api_keys=f"{KEY_A},{KEY_B}", max_streams_per_key=2)
    async with serve_gateway(settings, tokenizer) as client:
        streams = [await open_stream(client, COMPLETIONS, GOOD_COMPLETION, AUTH_A) for _ in range(2)]
        assert_busy(*await call(client, "POST", COMPLETIONS, json=GOOD_COMPLETION, headers=AUTH_A),
                    "2 are already open for this API key")
        whole = asyncio.create_task(client.post(COMPLETIONS, json=GOOD_COMPLETION, headers=AUTH_B))
        other = await open_stream(client, CHAT, GOOD_CHAT, AUTH_B)
        streams[0].close()  # the client leaves: its place frees
        admission = client.server.app[STATE].admission
        await wait_until(lambda: _true(admission.open_streams.get(key_id(KEY_A)) == 1), "the closed stream to free")
        streams.append(await open_stream(client, COMPLETIONS, GOOD_COMPLETION, AUTH_A))
        held.release()
        async with asyncio.timeout(WAIT_SECONDS):
            assert (await whole).status == 200
        for response in [other, *streams[1:]]:
            assert (await read_sse(response))[-1] == "[DONE]"
        assert admission.open_streams == {} and admission.waiting_requests == 0


async def _true(value: bool) -> bool:
    return value


# Limits on what a request may ask for


LIMITED = dict(max_tokens_limit=8, max_prompt_tokens=60, max_stop_strings=2, max_stop_length=5)
LIMIT_CASES = [
    # (name, path, body, param, code)
    ("max_tokens past the limit", COMPLETIONS, {**GOOD_COMPLETION, "max_tokens": 9}, "max_tokens",
     "max_tokens_exceeded"),
    ("max_completion_tokens past the limit", CHAT, {**GOOD_CHAT, "max_completion_tokens": 100},
     "max_completion_tokens", "max_tokens_exceeded"),
    ("prompt past max_prompt_tokens", COMPLETIONS, {**GOOD_COMPLETION, "prompt": "word " * 80}, "prompt",
     "prompt_too_long"),
    ("chat past max_prompt_tokens", CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": "hi " * 80}]},
     "messages", "prompt_too_long"),
    ("three stop strings", COMPLETIONS, {**GOOD_COMPLETION, "stop": ["a", "b", "c"]}, "stop", None),
    ("a long stop string", COMPLETIONS, {**GOOD_COMPLETION, "stop": "abcdef"}, "stop", None),
    ("a lone surrogate in the prompt", COMPLETIONS, {**GOOD_COMPLETION, "prompt": "a\ud800b"}, "prompt", None),
    ("a lone surrogate in a message", CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": "\udfff"}]},
     "messages[0].content", None),
    ("a lone surrogate in a stop string", COMPLETIONS, {**GOOD_COMPLETION, "stop": ["\ud83d"]}, "stop", None),
    # Found by schemathesis: a top_k past 2**64 could not be packed into the request record (a 503).
    ("a huge top_k", COMPLETIONS, {**GOOD_COMPLETION, "top_k": 7092149640234958637261389824}, "top_k", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "code"), [case[1:] for case in LIMIT_CASES], ids=[case[0] for case in LIMIT_CASES]
)
async def test_each_limit_is_a_clear_400(redis_url, redis_client, tokenizer, path, body, param, code):  # noqa: F811
    async with serve_gateway(gateway_settings(redis_url, **LIMITED), tokenizer) as client:
        async with asyncio.timeout(WAIT_SECONDS):
            data = json.dumps(body, ensure_ascii=True)  # lone surrogates travel as \ud800 escapes
            response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
            status, error = response.status, await response.json()
        assert status == 400, error
        assert_openai_error(error, param)
        assert error["error"]["code"] == code, error
    assert await redis_client.xlen(keys.NEW_REQUESTS_STREAM) == 0


async def test_within_the_limits_a_request_runs_and_defaults_to_the_max_tokens_limit(
    redis_url, redis_client, tokenizer  # noqa: F811
):
    async with serve_gateway(gateway_settings(redis_url, **LIMITED), tokenizer) as client:
        async with running(FakeScheduler(redis_client)):
            status, body, _ = await call(client, "POST", CHAT, json={**GOOD_CHAT, "max_tokens": None,
                                                                     "stop": ["w9", "abcde"]})
    assert status == 200 and body["usage"]["completion_tokens"] == 8, "chat defaults to the server's limit"


# Backpressure


async def test_a_reader_that_stops_reading_stalls_only_its_own_stream(
    redis_url, redis_client, tokenizer, held, monkeypatch  # noqa: F811
):
    """The gateway writes a stream only as fast as its client reads: once the client's socket is
    full, a write waits, nothing more is read from Redis, and what the gateway holds is at most
    the one XREAD batch it was writing out (READ_COUNT entries); other requests go on."""
    events, piece = 3000, "x" * 4000  # 12 MB of output: far more than the socket buffers take
    async with serve_gateway(gateway_settings(redis_url), tokenizer) as client:
        store = client.server.app[STATE].store
        fetched: dict[str, int] = {}  # token stream -> entries the gateway read from Redis
        writes = {"started": 0, "done": 0}  # the stalled stream's writes to its socket
        xread = store.redis.xread

        async def counting_xread(streams, *args, **kwargs):
            reply = await xread(streams, *args, **kwargs)
            for name, entries in reply or ():
                fetched[name.decode()] = fetched.get(name.decode(), 0) + len(entries)
            return reply

        store.redis.xread = counting_xread
        write = web.StreamResponse.write

        async def counting_write(response, data):
            if b"xxxx" not in data:
                return await write(response, data)
            writes["started"] += 1
            try:
                return await write(response, data)
            finally:
                writes["done"] += 1

        monkeypatch.setattr(web.StreamResponse, "write", counting_write)
        reader, writer = await slow_client(client.server.port)
        body = json.dumps({**GOOD_COMPLETION, "max_tokens": events, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        [[_, [(_, fields)]]] = await wait_until(lambda: redis_client.xread({keys.NEW_REQUESTS_STREAM: "0-0"}),
                                                "the request to be accepted")
        request_id = fields[b"id"].decode()
        pipe = redis_client.pipeline(transaction=False)
        for index in range(events):
            last = index == events - 1
            pipe.xadd(keys.token_stream(request_id), {"m": encode(TokenEvent(
                index=index, token_id=100, text=piece, finish_reason="length" if last else None,
                prompt_tokens=1 if last else 0, completion_tokens=events if last else 0))})
        await pipe.execute()
        # Stalled: a write waits for the client to read (the socket is full), so the follower
        # reads no more from Redis until it returns.
        await wait_until(lambda: _true(writes["started"] > writes["done"] > 0), "a write waiting on the client")
        stalled_fetched, written = fetched[keys.token_stream(request_id)], writes["done"]
        assert stalled_fetched < events, "the gateway read the whole stream for a client that reads nothing"
        assert stalled_fetched - written <= READ_COUNT, (
            f"the gateway holds {stalled_fetched - written} events for a stalled client, more than one batch")
        print(f"figures: a stalled reader: the gateway read {stalled_fetched} of {events} events from Redis, "
              f"wrote {written} ({written * len(piece) / 1e6:.1f} MB, now in the socket buffers), held the rest")

        held.cancelled.add(request_id)  # the fake scheduler leaves this one to the test
        held.release()  # another request is not held up by the stalled one
        status, done, _ = await call(client, "POST", COMPLETIONS, json=GOOD_COMPLETION)
        assert status == 200 and done["choices"][0]["text"] == " w0 w1 w2"

        received = bytearray()
        async with asyncio.timeout(30):  # now read it all: every event arrives
            while b"data: [DONE]" not in received[-100:] and (chunk := await reader.read(1 << 16)):
                received += chunk
        writer.close()
        assert received.count(b'"finish_reason": null') == events - 1


async def slow_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with a small receive buffer, which the test reads only when it chooses."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=1 << 16)


# The OpenAPI document


async def test_the_openapi_document_covers_every_route_and_states_the_limits(keyed):
    status, document, _ = await call(keyed, "GET", "/openapi.json")
    assert status == 200 and document["openapi"].startswith("3.0")
    routes = {(route.method.lower(), route.resource.canonical) for route in keyed.server.app.router.routes()
              if route.method != "HEAD"}
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert routes - documented == {("get", "/openapi.json")}, routes - documented
    request = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["stop"]["oneOf"][1]["maxItems"] == 4 and request["max_tokens"]["maximum"] == 8192
    assert set(document["paths"]["/v1/completions"]["post"]["responses"]) >= {"200", "400", "401", "429"}


async def test_a_client_that_pipelines_requests_and_never_reads_is_not_buffered_without_bound(
    redis_url, redis_client, tokenizer  # noqa: F811
):
    """aiohttp answers a connection's pipelined requests one at a time and stops reading the socket
    while answers wait to be written: the client's own send blocks, the gateway holds little."""
    request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    blob = request * (20_000_000 // len(request))  # 20 MB of requests
    async with serve_gateway(gateway_settings(redis_url), tokenizer) as client:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", client.server.port))
        sent, deadline = 0, loop.time() + 3.0
        while sent < len(blob) and loop.time() < deadline:
            try:
                sent += sock.send(blob[sent : sent + 65536])
            except BlockingIOError:
                await asyncio.sleep(0.05)
        assert sent < len(blob) // 4, f"the gateway took {sent} bytes of requests it could not answer"
        status, body, _ = await call(client, "GET", "/v1/models")  # everyone else is served meanwhile
        assert status == 200 and body["object"] == "list"
        sock.close()
    print(f"figures: a client pipelining requests without reading got {sent / 1e6:.1f} MB of 20 MB in")
