"""Access and admission on the whole system (`iterserve up`, real processes and model): a Redis
with a password, API keys, per-key limits, fair turns across keys, schemathesis on the API, and
random, truncated and wrong-typed msgpack thrown at the scheduler's and the worker's inputs.

Each fuzz test prints its figures (`figures:` lines, shown with -s) for docs/operations.md."""

import collections
import concurrent.futures
import copy
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import openai
import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shared import keys
from shared.messages import (
    BatchPlan,
    NewRequest,
    RequestRecord,
    SamplingParams,
    SchedulerInfo,
    StepItem,
    WorkerInfo,
)
from services.bench.by_request_id import PlanCodec
from shared.plans import PLAN_FORMAT
from tests.fuzzing import bad_payloads
from tests.redis_server import RedisProcess
from tests.system import REPO, System

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
PASSWORD = "test-Pässwörd:@/ 1"  # characters a URL must escape
PASSWORD_IN_URL = "test-P%C3%A4ssw%C3%B6rd%3A%40%2F%201"
KEY_A, KEY_B, KEY_C = "sk-system-a", "sk-system-b", "sk-system-c"
MAX_TOKENS_LIMIT, STREAMS_PER_KEY = 16, 8
WRONG_PASSWORD = "not-the-password-42"
HTTP_TIMEOUT = 120


@pytest.fixture(scope="module")
def password_redis():
    server = RedisProcess(password=PASSWORD)
    server.url = f"redis://:{PASSWORD_IN_URL}@127.0.0.1:{server.port}/0"
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def system(password_redis, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# one key per line\n{KEY_A}\n{KEY_B}\n{KEY_C}\n")
    options = ["--redis-url", password_redis.url, "--api-keys-file", str(key_file), "--protect-observability",
               "--max-batch-size", "2", "--threads", "1", "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
               "--max-streams-per-key", str(STREAMS_PER_KEY), "--max-waiting-requests", "16"]  # fmt: skip
    with System(*options, workers=1, kv_blocks=256) as running:
        yield running


@pytest.fixture(scope="module")
def store(system, password_redis):
    client = redis.Redis.from_url(password_redis.url, socket_timeout=10)
    yield client
    client.close()


def client_for(system: System, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key=key, timeout=HTTP_TIMEOUT, max_retries=0)


def http(system: System, method: str, path: str, body: dict | None = None, key: str | None = None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{system.base_url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            return response.status, json.loads(response.read() or b"{}"), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}"), dict(error.headers)


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "The history of the bicycle", "max_tokens": MAX_TOKENS_LIMIT,
            "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip


def openai_completion(**extra) -> dict:
    """completion() as the openai client takes it: extensions go in extra_body."""
    body = completion(**extra)
    ignore_eos = body.pop("ignore_eos")
    return {**body, "extra_body": {"ignore_eos": ignore_eos}}


# Redis with a password


@pytest.mark.parametrize("command", ["scheduler", "worker", "gateway", "up"])
def test_a_wrong_or_missing_redis_password_stops_a_service_at_start_with_a_clear_message(password_redis, command):
    port = password_redis.port
    for url in (f"redis://:{WRONG_PASSWORD}@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        finished = subprocess.run([sys.executable, "-m", "services.cli", command, "--redis-url", url],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        output = finished.stdout + finished.stderr
        assert finished.returncode == 2, f"{command} {url}: exit {finished.returncode}\n{output[-2000:]}"
        assert "refused the credentials" in output, output[-2000:]
        assert WRONG_PASSWORD not in output, "the password is never printed"


def test_every_service_runs_on_a_password_protected_redis(system, store):
    assert http(system, "GET", "/health")[0] == 200, "health stays open"
    reply = client_for(system, KEY_A).completions.create(**openai_completion())
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS_LIMIT
    assert store.exists(keys.SCHEDULER_HEARTBEAT) and store.scard(keys.WORKERS_SET) == 1
    assert PASSWORD_IN_URL not in system.log() and PASSWORD not in system.log(), "the password never reaches a log"


# API keys and limits


def test_keys_are_required_and_checked_end_to_end(system):
    with pytest.raises(openai.AuthenticationError) as refused:
        client_for(system, "sk-not-a-key").completions.create(**openai_completion())
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    status, error, _ = http(system, "GET", "/v1/models")
    assert status == 401 and error["error"]["code"] is None
    assert http(system, "GET", "/metrics")[0] == 401 and http(system, "GET", "/status")[0] == 401
    assert http(system, "GET", "/status", key=KEY_B)[0] == 200
    with pytest.raises(openai.BadRequestError) as too_long:
        client_for(system, KEY_A).completions.create(**openai_completion(max_tokens=MAX_TOKENS_LIMIT + 1))
    assert too_long.value.code == "max_tokens_exceeded"


def test_a_key_flooding_the_server_gets_429_and_another_key_still_gets_in(system):
    flood = 2 * STREAMS_PER_KEY
    with concurrent.futures.ThreadPoolExecutor(flood + 1) as pool:
        flooding = [pool.submit(http, system, "POST", "/v1/completions", completion(), KEY_A)
                    for _ in range(flood)]  # fmt: skip
        time.sleep(0.5)
        other = pool.submit(http, system, "POST", "/v1/completions", completion(max_tokens=4), KEY_B)
        answers = [future.result() for future in flooding]
        other_status, other_body, _ = other.result()
    statuses = collections.Counter(status for status, _, _ in answers)
    assert set(statuses) <= {200, 429} and statuses[429] >= 1 and statuses[200] >= STREAMS_PER_KEY, statuses
    refused = next(body for status, body, _ in answers if status == 429)
    assert refused["error"]["code"] == "rate_limit_exceeded", refused
    assert all(headers.get("Retry-After") for status, _, headers in answers if status == 429)
    assert other_status == 200 and other_body["usage"]["completion_tokens"] == 4, other_body
    print(f"figures: flood of {flood} requests from one key: {dict(statuses)}; the other key: {other_status}")


def test_one_key_flooding_the_queue_does_not_starve_another_key(system):
    """One worker runs 2 requests at a time. Key A queues 8 requests of 16 tokens, then key B sends 2.
    FCFS would run B's after all of A's; round-robin across keys gives B every other free place."""
    finished_at: dict[str, float] = {}

    def send(name: str, key: str) -> None:
        status, body, _ = http(system, "POST", "/v1/completions", completion(), key)
        assert status == 200 and body["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT, body
        finished_at[name] = time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(STREAMS_PER_KEY + 2) as pool:
        futures = [pool.submit(send, f"a{index}", KEY_A) for index in range(STREAMS_PER_KEY)]
        time.sleep(0.5)  # A's are accepted and queued before B's arrive
        futures += [pool.submit(send, f"b{index}", KEY_B) for index in range(2)]
        for future in futures:
            future.result()
    a_done = sorted(finished_at[f"a{index}"] for index in range(STREAMS_PER_KEY))
    b_done = sorted(finished_at[f"b{index}"] for index in range(2))
    order = sorted(finished_at, key=finished_at.get)
    assert b_done[-1] < a_done[-2], f"key B waited behind key A's flood: finish order {order}"
    print(f"figures: fairness finish order {order}")


# Fuzzing the API (schemathesis) on the live system


def fuzz_schema(system: System):
    """The served OpenAPI document, with the generation endpoints' prompts and max_tokens kept
    small so that each generated request runs in a moment (the document itself says 16)."""
    import schemathesis

    with urllib.request.urlopen(f"{system.base_url}/openapi.json", timeout=30) as response:
        document = json.loads(response.read())
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas[name]["properties"]
        properties["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
        properties.pop("max_completion_tokens")
        schemas[name]["required"].append("max_tokens")
    schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"][0]["maxLength"] = 200
    schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"][1]["maxItems"] = 64
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    messages["maxItems"] = 4
    messages["items"]["properties"]["content"]["oneOf"][0]["maxLength"] = 200
    return schemathesis.openapi.from_dict(copy.deepcopy(document))


def test_schemathesis_finds_no_server_error_no_hang_and_no_crash(system):
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = fuzz_schema(system)
    auth = {"Authorization": f"Bearer {KEY_C}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    processes = {process.pid for process in system.descendants()}
    figures: collections.Counter = collections.Counter()
    failures: list[str] = []
    slowest = 0.0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.label == "GET /dashboard/events":
            continue  # an endless event stream (no parameter, no body): tests/test_access.py checks it
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.label in ("GET /health", "GET /livez", "GET /version",
                                                                   "GET /dashboard"):
                continue  # nothing to make invalid: no parameter, no body, no key

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=30, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def call(case) -> None:
                nonlocal slowest
                started = time.monotonic()
                response = case.call(base_url=system.base_url, headers=auth, timeout=HTTP_TIMEOUT)  # a hang fails
                slowest = max(slowest, time.monotonic() - started)
                figures[response.status_code] += 1
                try:
                    case.validate_response(response, checks=checks)
                except BaseException as failure:  # noqa: BLE001 (schemathesis raises a FailureGroup)
                    failures.append(f"{operation.label} {mode.value} -> {response.status_code}: {failure}"[:2000])

            call()
    print(f"figures: schemathesis sent {sum(figures.values())} requests, by status {dict(sorted(figures.items()))}, "
          f"slowest {slowest:.1f} s, failures {len(failures)}")
    assert not failures, "\n\n".join(failures[:5])
    assert not any(status >= 500 for status in figures)
    assert {process.pid for process in system.descendants()} == processes, "a service restarted (crashed)"
    assert "event=exited" not in system.log()
    assert http(system, "GET", "/health")[0] == 200


# Fuzzing the scheduler's and the worker's inputs with bad msgpack


def valid_messages(worker_id: str) -> dict[str, dict]:
    now = time.time()
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    return {
        "record": RequestRecord(request_id="fuzz", prompt_token_ids=(1, 2, 3), sampling=sampling, arrival_time=now,
                                client_key="key-fuzz").model_dump(),
        "result": {"f": PLAN_FORMAT, "e": "fuzz-epoch", "p": 1, "w": worker_id, "h": b"\x00\x00", "t": b"\x05\x00\x00\x00",
                   "o": b"\x00\x00\x00\x00", "x": [[0, "bad_item", "fuzz"]], "kt": 256, "kf": 256, "s": 0.01},
        "worker": WorkerInfo(worker_id="fuzz-worker", pid=1, host="h", device="cpu", kv_block_size=16,
                             kv_blocks_total=256, kv_blocks_free=256, running=0, started_at=now,
                             heartbeat_at=now).model_dump(),
        "plan": msgpack.unpackb(PlanCodec().encode(BatchPlan(
            scheduler_epoch="fuzz-epoch", plan_id=1, worker_id=worker_id,
            new_requests=(NewRequest(request_id="fuzz-plan", sampling=sampling),),
            items=(StepItem(request_id="fuzz-plan", token_ids=(1, 2, 3), start_position=0, sample=True,
                            output_index=0),)))),
        "heartbeat": SchedulerInfo(pid=1, policy="iteration", started_at=now, heartbeat_at=now, last_iteration_at=now,
                                   iterations=1, waiting=0, running=0).model_dump(),
    }  # fmt: skip


INPUTS = ("new_request", "cancel", "result", "worker_heartbeat", "plan", "scheduler_heartbeat")


def test_bad_msgpack_on_every_scheduler_and_worker_input_leaves_them_serving(system, store):
    [worker_id] = [member.decode() for member in store.smembers(keys.WORKERS_SET)]
    valid = valid_messages(worker_id)
    processes = {process.pid for process in system.descendants()}
    log_before = len(system.log())
    sent: collections.Counter = collections.Counter()
    request_ids: list[str] = []

    @given(
        target=st.sampled_from(INPUTS),
        data=st.data(),
        raw_id=st.binary(max_size=40) | st.text(alphabet="abcdef0123456789-", min_size=1, max_size=40),
    )
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def inject(target: str, data, raw_id) -> None:
        sent[target] += 1
        if target == "new_request":  # a new-request entry, whose record is bad (or whose id is)
            payload = data.draw(bad_payloads(valid["record"]))
            request_id = raw_id if isinstance(raw_id, str) else raw_id.decode(errors="replace")
            request_ids.append(request_id)
            pipe = store.pipeline(transaction=True)
            pipe.hset(keys.request_key(request_id), mapping={"record": payload, "status": "waiting"})
            pipe.sadd(keys.ACTIVE_REQUESTS_SET, request_id)
            pipe.xadd(keys.NEW_REQUESTS_STREAM, {"id": raw_id})
            pipe.expire(keys.request_key(request_id), 600)
            pipe.execute()
        elif target == "cancel":
            store.xadd(keys.CANCEL_STREAM, {"id": raw_id} if data.draw(st.booleans()) else {"junk": raw_id})
        elif target == "result":
            store.xadd(keys.RESULTS_STREAM, {"m": data.draw(bad_payloads(valid["result"]))})
        elif target == "worker_heartbeat":  # a worker that announces itself with a bad heartbeat
            fake = f"fuzz-worker-{sent[target] % 5}"
            store.set(keys.worker_heartbeat(fake), data.draw(bad_payloads(valid["worker"])), px=1500)
            store.sadd(keys.WORKERS_SET, fake if data.draw(st.booleans()) else raw_id or b"\xff")
        elif target == "plan":  # straight into the live worker's plan stream
            store.xadd(keys.plan_stream(worker_id), {"m": data.draw(bad_payloads(valid["plan"]))})
        else:  # the gateway's view of the scheduler (health, admission); the scheduler rewrites it
            store.set(keys.SCHEDULER_HEARTBEAT, data.draw(bad_payloads(valid["heartbeat"])), px=1000)

    inject()
    for request_id in request_ids:  # garbage that was valid enough to run: cancel it (as a client would)
        store.xadd(keys.CANCEL_STREAM, {"id": request_id})
    time.sleep(2.0)  # the fake workers' heartbeat keys expire

    deadline = time.monotonic() + 60
    while http(system, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline, f"not healthy after the fuzz:\n{system.log()[-3000:]}"
        time.sleep(0.5)
    reply = client_for(system, KEY_A).completions.create(**openai_completion(max_tokens=8))
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    chat = client_for(system, KEY_B).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert {process.pid for process in system.descendants()} == processes, "a service crashed and was restarted"
    log = system.log()[log_before:]
    assert "event=exited" not in log and "Traceback" not in log, log[-5000:]
    skipped = {name: log.count(name) for name in ("malformed_", "bad_plan", "misaddressed_plan", "item_error",
                                                  "bad scheduler heartbeat", "turn_failed", "plan_failed")}  # fmt: skip
    print(f"figures: msgpack fuzz sent {sum(sent.values())} bad inputs {dict(sent)}; "
          f"log lines {skipped}; crashes 0; a real request completed after")
    assert skipped["turn_failed"] == 0 and skipped["plan_failed"] == 0, skipped
