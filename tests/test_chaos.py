"""Chaos suite: faults injected into the running services (real processes, real model, a private
Redis, all on 127.0.0.1), and what must hold afterwards: nothing lost, nothing duplicated, every
output unchanged.

Every scenario runs against the model, and against emulated workers (`executor` below: plans of one
step, of 4, and as long as a time), each with one scheduler and with two (`schedulers`: each leasing
one of the two workers, services/scheduler/shards.py), compared with the same fault-free run of one.
Greedy and seeded requests are deterministic (the randomness of token k is a function of the
request's seed and k only), so each scenario's outputs are compared with a fault-free run of the
same requests (the module's `baseline`). Each test runs its own Cluster (tests/cluster.py): every
process it started is killed and reaped when the test ends, pass or fail.

What each fault costs is measured as it runs and printed at the end of the module (docs/operations.md,
"Faults: what each costs"); with ITERSERVE_CHAOS_REPORT=path it is also written there as JSON:

    ITERSERVE_CHAOS_REPORT=/tmp/chaos.json .venv/bin/python -m pytest -m chaos -s tests/test_chaos.py
"""

import asyncio
import json
import os
import random
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import aiohttp
import psutil
import pytest

from shared import keys
from shared.config import Settings
from shared.messages import IterationRecord, RequestRecord, TokenEvent
from shared.wire import decode, decode_token_event
from tests.cluster import Cluster

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m-instruct"
FINISH_SECONDS = 180  # a scenario's requests all end within this, or something is stuck
PIPELINE_DEPTH = Settings().pipeline_depth  # plans in flight per worker (the clusters' default)
STEPS_A_PLAN = 1  # the executor's scheduler_steps (each plan in flight may sample that many tokens)
TOKENS_A_STEP = 1  # the most tokens one step makes for a request (1 + its proposals, speculating)
REPORT: dict[str, dict] = {}  # what each fault cost, filled by the tests
REPORT_SUFFIX = ""  # the executor of the scenarios running now: "" for the model, "@emulated"
SCHEDULERS_SUFFIX = ""  # and their schedulers: "" for one, "+2-schedulers"

# Workloads

SUBJECTS = ["the sea", "a lighthouse keeper", "fresh bread", "volcanoes", "the moon", "a lost key", "winter mornings",
            "old trains", "honey bees", "a quiet library", "chess", "summer rain", "mountain goats", "the desert",
            "paper boats", "a robot cook", "northern lights", "city traffic", "a violin", "coffee"]
TEMPLATES = ["Tell me about {}.", "Write one sentence about {}.", "Once upon a time, {}",
             "Q: What do you know about {}?\nA:", "Here is a short poem about {}:\n",
             "Explain to a child why {} matters, in simple words, with one example and one question at the end."]


def prompt(index: int) -> str:
    subject = SUBJECTS[(index // len(TEMPLATES)) % len(SUBJECTS)]
    return f"{index}. " + TEMPLATES[index % len(TEMPLATES)].format(subject)


@dataclass(frozen=True)
class Spec:
    """One request; `seed` is always sent (greedy ignores it) and is unique: it finds the request
    in Redis for a client that has no id yet."""

    name: str
    prompt: str
    max_tokens: int
    seed: int
    temperature: float = 0.0
    ignore_eos: bool = False
    model: str = MODEL

    def body(self, stream: bool) -> dict:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "seed": self.seed,
                "temperature": self.temperature, "stream": stream}
        if self.temperature:
            body["top_p"] = 0.95
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def mixed(prefix: str, count: int, first_prompt: int, first_seed: int, max_tokens: Callable[[int], int],
          ignore_eos: bool = False) -> list[Spec]:
    """Even ones greedy, odd ones seeded sampling."""
    return [Spec(f"{prefix}-{index}", prompt(first_prompt + index), max_tokens(index), first_seed + index,
                 temperature=0.8 if index % 2 else 0.0, ignore_eos=ignore_eos) for index in range(count)]


# Long enough (40 tokens each, ignore_eos) that a fault lands mid-run.
FAULT_WORKLOAD = mixed("fault", 12, 0, 1000, lambda index: 40, ignore_eos=True)
EXTRA = mixed("extra", 2, 40, 2000, lambda index: 12, ignore_eos=True)  # submitted while a service is down
PRESSURE = mixed("pressure", 8, 60, 3000, lambda index: 48, ignore_eos=True)  # more KV than one small worker has
LONG = mixed("long", 6, 70, 4000, lambda index: 120, ignore_eos=True)  # still running a second or two on


@dataclass(frozen=True)
class StormRequest:
    spec: Spec
    stream: bool
    arrive_after: float  # seconds after the storm starts
    cancel: str | None  # None, "delete" or "disconnect"
    cancel_after: float  # seconds after it arrives


# Every storm request starts with it: their cached blocks are shared while some are cancelled.
STORM_PREAMBLE = ("You are the storyteller of a children's radio show. Every answer is warm and short, and it "
                  "ends with a gentle question for the listener. ")


def storm_plan(count: int = 200, seed: int = 4) -> list[StormRequest]:
    rng = random.Random(seed)
    specs = [replace(spec, prompt=STORM_PREAMBLE + spec.prompt)
             for spec in mixed("storm", count, 500, 5000, lambda index: rng.randint(4, 24))]
    cancelled = set(rng.sample(range(count), count // 2))
    plan = []
    for index, spec in enumerate(specs):
        how = rng.choice(["delete", "disconnect"]) if index in cancelled else None
        plan.append(StormRequest(spec, stream=rng.random() < 0.5, arrive_after=rng.uniform(0, 3), cancel=how,
                                 cancel_after=rng.uniform(0, 4)))
    return plan


STORM = storm_plan()


# Clients


@dataclass
class Output:
    """What one client received."""

    request_id: str | None = None
    pieces: list[tuple[int | None, str, float]] = field(default_factory=list)  # (SSE id, text, monotonic time)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    resume_from: int = 0  # the last SSE id seen: where a re-attach starts
    reattached: int = 0

    @property
    def text(self) -> str:
        return "".join(text for _, text, _ in self.pieces)


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=FINISH_SECONDS, sock_connect=5))


async def sse_events(response: aiohttp.ClientResponse):
    """(id or None, data) of each SSE event."""
    event_id, data = None, None
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data is not None:
                yield event_id, data
            event_id, data = None, None
        elif line.startswith("id: "):
            event_id = int(line.removeprefix("id: "))
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")


async def read_stream(response: aiohttp.ClientResponse, output: Output) -> None:
    """Take the stream's events into `output`, checking that no event is seen twice."""
    assert response.status == 200, f"{output.request_id}: HTTP {response.status}: {await response.text()}"
    output.request_id = output.request_id or response.headers["X-Request-Id"]
    async for event_id, data in sse_events(response):
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        assert "error" not in chunk, f"{output.request_id}: {chunk}"
        if chunk.get("usage"):
            output.completion_tokens = chunk["usage"]["completion_tokens"]
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        if event_id is not None:
            assert event_id > output.resume_from, f"{output.request_id}: event {event_id} after {output.resume_from}"
            output.resume_from = event_id
        output.pieces.append((event_id, choice["text"], time.monotonic()))
        if choice["finish_reason"]:
            output.finish_reason = choice["finish_reason"]
    raise aiohttp.ClientPayloadError(f"{output.request_id}: stream ended without [DONE]")


async def stream_request(http: aiohttp.ClientSession, cluster: Cluster, spec: Spec, output: Output,
                         reattach: bool = False) -> Output:
    """A streaming client; with reattach, one whose gateway may vanish: it re-attaches from the last
    SSE id it got (GET /v1/requests/{id}/stream?from=N) until the request ends."""
    body = {**spec.body(stream=True), "stream_options": {"include_usage": True}}
    async with http.post(f"{cluster.base_url}/v1/completions", json=body) as response:
        try:
            await read_stream(response, output)
            return output
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            if not reattach:
                raise
    deadline = time.monotonic() + FINISH_SECONDS
    while True:
        output.reattached += 1
        url = f"{cluster.base_url}/v1/requests/{output.request_id}/stream"
        try:
            params = {"from": str(output.resume_from), "include_usage": "true"}
            async with http.get(url, params=params) as response:
                await read_stream(response, output)
                return output
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            assert time.monotonic() < deadline, f"{output.request_id}: could not re-attach"
            await asyncio.sleep(0.2)


async def whole_request(http: aiohttp.ClientSession, cluster: Cluster, spec: Spec, output: Output) -> Output:
    async with http.post(f"{cluster.base_url}/v1/completions", json=spec.body(stream=False)) as response:
        body = await response.json()
        assert response.status == 200, f"{spec.name}: HTTP {response.status}: {body}"
    output.request_id = body["id"]
    output.pieces.append((None, body["choices"][0]["text"], time.monotonic()))
    output.finish_reason = body["choices"][0]["finish_reason"]
    output.completion_tokens = body["usage"]["completion_tokens"]
    return output


async def run_all(cluster: Cluster, specs: list[Spec], fault: Callable[[dict[str, Output]], Awaitable[None]],
                  stream: bool = True, reattach: bool = False) -> dict[str, Output]:
    """Every spec as a concurrent client, and `fault` beside them; all must end in FINISH_SECONDS."""
    outputs = {spec.name: Output() for spec in specs}
    async with session() as http:
        clients = [stream_request(http, cluster, spec, outputs[spec.name], reattach) if stream
                   else whole_request(http, cluster, spec, outputs[spec.name]) for spec in specs]
        async with asyncio.timeout(FINISH_SECONDS):
            await asyncio.gather(fault(outputs), *clients)
    return outputs


async def until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.05)


def all_have(outputs: dict[str, Output], pieces: int) -> Callable[[], bool]:
    return lambda: all(len(output.pieces) >= pieces for output in outputs.values())


# What must hold after a fault


def check_same_as_baseline(outputs: dict[str, Output], baseline: dict[str, Output], what: str) -> None:
    for name, output in outputs.items():
        expected = baseline[name]
        assert (output.text, output.finish_reason) == (expected.text, expected.finish_reason), (
            f"{what}: {name} ({output.request_id}) differs from its fault-free run:\n"
            f"  got      {output.finish_reason} {output.text!r}\n  expected {expected.finish_reason} {expected.text!r}")
        if output.completion_tokens is not None:
            assert output.completion_tokens == expected.completion_tokens, f"{what}: {name} usage differs"


def token_events(cluster: Cluster, request_id: str) -> list[TokenEvent]:
    client = cluster.redis_client()
    try:
        return [decode_token_event(fields[b"m"]) for _, fields in client.xrange(keys.token_stream(request_id))]
    finally:
        client.close()


def check_token_streams(cluster: Cluster, outputs: dict[str, Output]) -> None:
    """In Redis too: output token i is entry i, once, and the final event is the last one. An end
    without a token (a cancel) counts the tokens the scheduler applied: a worker may have written the
    entries of tokens its plans in flight sampled (docs/protocol.md), at most the plans in flight."""
    for name, output in outputs.items():
        events = token_events(cluster, output.request_id)
        tokens = [event for event in events if event.token_id >= 0]
        assert [event.index for event in tokens] == list(range(len(tokens))), f"{name}: gap or duplicate in Redis"
        assert events and events[-1].finish_reason and all(event.finish_reason is None for event in events[:-1])
        final = events[-1]
        if final.token_id < 0:
            assert tokens == events[:-1], f"{name}: an end without a token before a token"
            in_flight = PIPELINE_DEPTH * STEPS_A_PLAN * TOKENS_A_STEP  # tokens the plans in flight may make
            assert len(tokens) - in_flight <= final.index == final.completion_tokens <= len(tokens), \
                f"{name}: its end counts {final.completion_tokens} of {len(tokens)} tokens"


def check_nothing_left(cluster: Cluster) -> None:
    client = cluster.redis_client()
    try:
        active = client.smembers(keys.ACTIVE_REQUESTS_SET)
    finally:
        client.close()
    assert not active, f"requests still active: {sorted(active)[:5]}"


def check_recovered_by_liveness_not_by_the_stall_fallback(cluster: Cluster, outputs: dict[str, Output]) -> None:
    """A fault is noticed by the liveness checks (heartbeat keys, epochs), not by the last resort
    of abandoning a plan after stall_seconds: no plan stalled, and no stream waited that long.
    (A bound by mechanism, not by a wall-clock figure that a loaded 2-core machine could miss.)"""
    assert not cluster.log_events("scheduler", "plan_stalled"), "a plan was only given up after stall_seconds"
    gap = longest_gap(outputs)
    assert gap < Settings().stall_seconds, f"a stream waited {gap:.1f} s: as long as the stall fallback"


def check_no_dead_worker_left(cluster: Cluster, worker_id: str) -> None:
    """A dead or departed worker leaves no key, stream or set membership behind."""
    client = cluster.redis_client()
    try:
        assert not client.sismember(keys.WORKERS_SET, worker_id), f"{worker_id} still registered"
        assert not client.exists(keys.plan_stream(worker_id)), f"{worker_id}'s plan stream is left"
        assert not client.exists(keys.worker_heartbeat(worker_id)), f"{worker_id}'s heartbeat key is left"
    finally:
        client.close()


def iteration_records(cluster: Cluster) -> list[IterationRecord]:
    client = cluster.redis_client()
    try:
        return [decode(IterationRecord, fields[b"m"]) for _, fields in client.xrange(keys.ITERATIONS_STREAM)]
    finally:
        client.close()


def tokens_recomputed(cluster: Cluster) -> int:
    """KV rebuilt: tokens prefilled beyond each request's prompt (its output so far, and its prompt
    again when it was rebuilt), from the scheduler's iteration records."""
    records = iteration_records(cluster)
    request_ids = {request_id for record in records for request_id in record.request_ids}
    client = cluster.redis_client()
    try:
        prompts = sum(len(decode(RequestRecord, client.hget(keys.request_key(request_id), "record")).prompt_token_ids)
                      for request_id in request_ids)
    finally:
        client.close()
    return sum(record.prefill_tokens for record in records) - prompts


def longest_gap(outputs: dict[str, Output]) -> float:
    """The longest wait between two pieces of one stream, over all streams (seconds)."""
    gaps = [later[2] - earlier[2] for output in outputs.values()
            for earlier, later in zip(output.pieces, output.pieces[1:], strict=False)]
    return max(gaps, default=0.0)


def status_workers(cluster: Cluster) -> list[dict]:
    return cluster.get_json("/status")[1]["workers"]


async def busiest_worker(cluster: Cluster) -> tuple[str, str]:
    """(service name, worker id) of the worker running the most requests: the fault costs most there.
    /status shows each worker's last heartbeat (every 0.5 s): with fast steps the one before the
    requests started may still be the latest, so wait (bounded) for one that shows them."""
    await until(lambda: any(worker["running"] > 0 for worker in status_workers(cluster)),
                "a heartbeat showing a worker running requests", 5)
    worker = max(status_workers(cluster), key=lambda worker: (worker["running"], worker["id"]))
    return cluster.name_of_worker(worker["id"]), worker["id"]


async def until_kv_all_free(cluster: Cluster, timeout: float = 10.0) -> float:
    """Until every live worker reports no KV block held by a request (each free, or cached for a
    later prefix and evictable), and the scheduler's copy of every worker's cache counts the same
    blocks cached and free as the worker itself; returns how long that took."""
    started = time.monotonic()

    def released() -> bool:
        _, status = cluster.get_json("/status")
        workers, scheduler = status["workers"], status["scheduler"]
        return bool(workers) and scheduler is not None and all(
            w["kv_blocks_in_use"] == 0 and w["running"] == 0
            and scheduler["kv_blocks"].get(w["id"]) == {"in_use": 0, "cached": w["kv_blocks_cached"],
                                                         "free": w["kv_blocks_free"]}
            for w in workers)

    await until(released, "every reference to a KV block returned, as the scheduler counts too", timeout)
    return time.monotonic() - started


def report(scenario: str, **measures: object) -> None:
    several = "" if scenario.startswith("one_of_two_schedulers") else SCHEDULERS_SUFFIX  # (those have two)
    REPORT.setdefault(scenario + several + REPORT_SUFFIX, {}).update(measures)


@pytest.fixture(scope="module", autouse=True)
def chaos_report():
    yield
    if not REPORT:
        return
    text = json.dumps(REPORT, indent=2, sort_keys=True)
    print(f"\nchaos measurements:\n{text}")
    path = os.environ.get("ITERSERVE_CHAOS_REPORT")
    if path:
        with open(path, "w") as file:
            file.write(text + "\n")


# The harness itself


def test_a_failing_scenario_leaves_no_process_behind():
    with pytest.raises(RuntimeError, match="the scenario failed"):
        with Cluster(workers=1) as cluster:
            pids = [service.process.pid for service in cluster.history] + [cluster.redis.process.pid]
            raise RuntimeError("the scenario failed")
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {alive}"
    assert not cluster.directory.exists(), "its logs and Redis data are removed"


# The executors: the model on the CPU, and emulated GPU steps (h100-qwen2.5-32b: ~25 ms each, 4-10x
# faster than the CPU's, yet long enough that a fault lands while 40-token requests run), which
# expose races that slow steps hide. Emulated tokens are exact functions of (seed, output index), so the same
# checks hold: each executor's faulty runs are compared with its own fault-free run.

EXECUTORS = {
    "engine": {},
    # Speculative decoding (services/scheduler/speculation.py) in every batch: n-gram proposals from
    # one-token matches, most refused, some kept, so faults and cancels land on verification steps,
    # KV reserved for proposals, rolled-back rows and requests sitting out the pipeline.
    "engine-speculating": {"speculative_config": json.dumps({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 64})},
    "emulated": {"executor": "emulated", "hardware": "h100-qwen2.5-32b"},
    # Plans of decodes run 4 steps each (Settings.scheduler_steps): a fault or a cancel lands in the
    # middle of a plan's steps, whose later tokens are dropped, and the same checks hold.
    "emulated-4-steps": {"executor": "emulated", "hardware": "h100-qwen2.5-32b", "scheduler_steps": 4},
    # Plans as long as a time (Settings.scheduler_plan_ms): each worker's plans run as many steps as
    # fit in 100 ms of its recent steps (one until its first answer, then about 4 of these, at most
    # 8), and while requests wait a plan ends where its first request does, so plans of a varying
    # number of steps are in flight when a fault lands.
    "emulated-steps-in-time": {"executor": "emulated", "hardware": "h100-qwen2.5-32b", "scheduler_steps": 8,
                               "scheduler_plan_ms": 100},
}


@pytest.fixture(scope="module", params=list(EXECUTORS))
def executor(request) -> dict[str, str]:
    global REPORT_SUFFIX, STEPS_A_PLAN, TOKENS_A_STEP
    REPORT_SUFFIX = "" if request.param == "engine" else f"@{request.param}"
    STEPS_A_PLAN = int(EXECUTORS[request.param].get("scheduler_steps", 1))
    speculative = json.loads(EXECUTORS[request.param].get("speculative_config", "{}"))
    TOKENS_A_STEP = 1 + speculative.get("num_speculative_tokens", 0)
    return EXECUTORS[request.param]


# One scheduler, and two (each leasing a shard of the workers: services/scheduler/shards.py): every
# scenario below runs with both, and is compared with the same fault-free run (one scheduler).

@pytest.fixture(scope="module", params=[1, 2], ids=["1-scheduler", "2-schedulers"])
def schedulers(request) -> int:
    global SCHEDULERS_SUFFIX
    SCHEDULERS_SUFFIX = "" if request.param == 1 else f"+{request.param}-schedulers"
    yield request.param
    SCHEDULERS_SUFFIX = ""


# The fault-free run


@pytest.fixture(scope="module")
def baseline(executor: dict[str, str]) -> dict[str, Output]:
    """Every request the scenarios compare, run once without any fault (two workers, batched)."""
    specs = FAULT_WORKLOAD + EXTRA + PRESSURE + LONG + [request.spec for request in STORM if request.cancel is None]

    async def nothing(outputs: dict[str, Output]) -> None:
        return None

    started = time.monotonic()
    with Cluster(**executor, workers=2) as cluster:
        outputs = asyncio.run(run_all(cluster, specs, nothing, stream=False))
        check_nothing_left(cluster)
        if STEPS_A_PLAN > 1:  # plans of several steps ran (else the executor is the one-step one again)
            def several_steps_a_plan() -> bool:  # (/status: the scheduler's heartbeat, every 0.5 s)
                scheduler = cluster.get_json("/status")[1]["scheduler"]
                return scheduler["iterations"] > 1.5 * scheduler["plans"]
            asyncio.run(until(several_steps_a_plan, "iterations of plans of several steps", 5))
        if TOKENS_A_STEP > 1:  # it speculated: proposals were made, some kept (the scheduler's totals)
            client = cluster.redis_client()  # (counted in Redis at the scheduler's heartbeat, every 0.5 s)
            try:
                asyncio.run(until(lambda: int(client.hget(keys.ModelKeys("").counters, "spec_accepted_tokens") or 0) > 0,
                                  "speculative proposals kept", 5))
            finally:
                client.close()
    report("baseline", requests=len(specs), seconds=round(time.monotonic() - started, 1))
    return outputs


# Cancellation


async def cancel_one_long_request(cluster: Cluster) -> None:
    """One long request cancelled by DELETE mid-run: no token after the iteration in flight, its KV
    free at once (/status, /metrics), its Redis state cancelled and expiring."""
    spec = Spec("long", prompt(900) + " Tell it at length, with many details.", 400, seed=9, ignore_eos=True)
    output = Output()
    async with session() as http:
        client = asyncio.create_task(stream_request(http, cluster, spec, output))
        await until(lambda: len(output.pieces) >= 5, "the long request's first tokens")
        # /status shows each worker's last heartbeat (every 0.5 s): wait for one taken while it runs.
        await until(lambda: any(worker["kv_blocks_in_use"] > 0
                                for worker in status_workers(cluster)), "a heartbeat showing its KV held", 10)
        cancel_sent_unix, cancel_sent_at = time.time(), time.monotonic()
        async with http.delete(f"{cluster.base_url}/v1/requests/{output.request_id}") as response:
            assert response.status == 200 and (await response.json())["cancelled"] is True
        await asyncio.wait_for(client, 30)
        await until_kv_all_free(cluster, timeout=30)  # a hang guard: the bound is in iterations, below
        freed_at_unix = time.time()
        freed_after = time.monotonic() - cancel_sent_at  # includes up to one heartbeat (0.5 s)
        async with http.delete(f"{cluster.base_url}/v1/requests/{output.request_id}") as again:
            assert again.status == 200
            assert await again.json() == {"id": output.request_id, "object": "request.cancel",
                                          "status": "cancelled", "cancelled": False}, "a second cancel is harmless"
        async with http.delete(f"{cluster.base_url}/v1/requests/cmpl-{'0' * 32}") as unknown:
            assert unknown.status == 404 and "error" in await unknown.json()
    assert output.finish_reason == "cancelled"
    metrics = cluster.get_text("/metrics")
    for worker in status_workers(cluster):
        free, cached = worker["kv_blocks_free"], worker["kv_blocks_cached"]
        assert free + cached == worker["kv_blocks_total"], worker
        labels = f'executor="{worker["executor"]}",worker_id="{worker["id"]}"'
        assert f'iterserve_worker_kv_blocks_free{{{labels}}} {free}.0' in metrics and \
            f'iterserve_worker_kv_blocks_cached{{{labels}}} {cached}.0' in metrics, \
            f"/metrics does not show {worker['id']}'s blocks free or cached"
    final = token_events(cluster, output.request_id)[-1]
    assert final.finish_reason == "cancelled" and final.token_id == -1
    # Its end counts the tokens the scheduler applied; the worker may have written one of a plan in
    # flight at the cancel before it (docs/protocol.md): check_token_streams bounds that.
    check_token_streams(cluster, {"long": output})
    with_it = [record for record in iteration_records(cluster) if output.request_id in record.request_ids]
    # Each iteration it was in gave it a token (up to TOKENS_A_STEP, speculating), except the ones in
    # flight when the cancel came (plans are pipelined: up to pipeline_depth of them, each of up to
    # STEPS_A_PLAN steps), whose tokens were discarded.
    in_flight_at_most = PIPELINE_DEPTH * STEPS_A_PLAN
    assert final.completion_tokens <= len(with_it) * TOKENS_A_STEP and \
        len(with_it) <= final.completion_tokens + in_flight_at_most, (
        f"{len(with_it)} iterations for {final.completion_tokens} tokens: it ran on after the cancel")
    # Its KV is free once the plans in flight at the cancel and the one plan that frees it have run.
    worker_id = with_it[-1].worker_id
    after_cancel = [record for record in iteration_records(cluster) if record.worker_id == worker_id
                    and cancel_sent_unix <= record.started_at and record.finished_at <= freed_at_unix]
    assert len(after_cancel) <= in_flight_at_most + 1, (
        f"{len(after_cancel)} iterations ran on its worker before its KV was free")
    client = cluster.redis_client()
    try:
        state = client.hmget(keys.request_key(output.request_id), ["status", "finish_reason"])
        ttls = client.ttl(keys.request_key(output.request_id)), client.ttl(keys.token_stream(output.request_id))
    finally:
        client.close()
    assert state == [b"cancelled", b"cancelled"] and all(ttl > 0 for ttl in ttls), (state, ttls)
    report("cancel_delete", kv_free_in_status_seconds_after_delete=round(freed_after, 2),
           iterations_with_it=len(with_it), tokens_before_cancel=final.completion_tokens,
           iterations_until_kv_free=len(after_cancel))


@dataclass
class StormResult:
    request: StormRequest
    output: Output
    delete_answer: bool | None = None  # DELETE's `cancelled`: False when the request had ended before
    cancel_sent: bool = False  # the DELETE was sent, or the client closed its connection, before the end


async def storm(cluster: Cluster) -> dict[str, StormResult]:
    """Every STORM request as its own client; the chosen half cancelled, by DELETE or disconnect."""
    results: dict[str, StormResult] = {}
    by_seed: dict[int, str] = {}  # seed -> request id (each storm request has its own seed)
    client = cluster.redis_client()

    def index_new_requests() -> None:
        by_seed.update(requests_by_seed(client))

    async def request_id_of(output: Output, spec: Spec) -> str | None:
        """A streaming client has it from the headers; a waiting one finds it in Redis by its seed
        (None: the gateway never accepted it, its client left first)."""
        deadline = time.monotonic() + 5
        while output.request_id is None and spec.seed not in by_seed and time.monotonic() < deadline:
            index_new_requests()
            await asyncio.sleep(0.05)
        return output.request_id or by_seed.get(spec.seed)

    async def one(http: aiohttp.ClientSession, request: StormRequest) -> None:
        await asyncio.sleep(request.arrive_after)
        output = Output()
        result = StormResult(request, output)
        call = stream_request(http, cluster, request.spec, output) if request.stream else \
            whole_request(http, cluster, request.spec, output)
        client_task = asyncio.create_task(call)
        if request.cancel is not None:
            done, _ = await asyncio.wait({client_task}, timeout=request.cancel_after)
            if not done:
                result.cancel_sent = True
                if request.cancel == "disconnect":
                    client_task.cancel()  # the connection closes: the gateway cancels the request
                else:
                    request_id = await request_id_of(output, request.spec)
                    assert request_id is not None, f"{request.spec.name} was never accepted"
                    async with http.delete(f"{cluster.base_url}/v1/requests/{request_id}") as response:
                        assert response.status == 200
                        result.delete_answer = (await response.json())["cancelled"]
                        output.request_id = request_id
        try:
            await client_task
        except asyncio.CancelledError:
            output.request_id = await request_id_of(output, request.spec)
        results[request.spec.name] = result

    try:
        async with session() as http, asyncio.timeout(FINISH_SECONDS):
            await asyncio.gather(*(one(http, request) for request in STORM))
    finally:
        client.close()
    return results


def requests_by_seed(client) -> dict[int, str]:
    """Every request in Redis by its seed (the new-request stream is trimmed as soon as the
    scheduler reads it, so the records themselves are searched)."""
    found = {}
    request_keys = list(client.scan_iter(match=keys.request_key("*"), count=1000))
    pipe = client.pipeline(transaction=False)
    for key in request_keys:
        pipe.hget(key, "record")
    for key, raw in zip(request_keys, pipe.execute(), strict=True):
        if raw is not None:
            found[decode(RequestRecord, raw).sampling.seed] = key.decode().removeprefix(keys.request_key(""))
    return found


def test_cancellation_storm_frees_every_block_and_leaves_uncancelled_outputs_unchanged(baseline, executor, schedulers):
    started = time.monotonic()
    with Cluster(**executor, workers=2, max_batch_size=128, schedulers=schedulers) as cluster:
        asyncio.run(cancel_one_long_request(cluster))
        storm_started = time.monotonic()
        results = asyncio.run(storm(cluster))
        storm_seconds = time.monotonic() - storm_started

        async def settled() -> float:
            client = cluster.redis_client()
            try:
                await until(lambda: not client.smembers(keys.ACTIVE_REQUESTS_SET), "every request to end", 60)
            finally:
                client.close()
            return await until_kv_all_free(cluster)

        asyncio.run(settled())
        client = cluster.redis_client()
        try:
            accepted_by_seed = requests_by_seed(client)
            for result in results.values():
                if result.output.request_id is None:  # its client may have left before the gateway answered
                    result.output.request_id = accepted_by_seed.get(result.request.spec.seed)
            statuses = {name: client.hget(keys.request_key(result.output.request_id), "status")
                        for name, result in results.items() if result.output.request_id is not None}
        finally:
            client.close()
        never_accepted = [name for name, result in results.items() if result.output.request_id is None]
        assert all(results[name].request.cancel == "disconnect" and results[name].cancel_sent
                   for name in never_accepted), "only a client that left early may go unaccepted"
        _, status = cluster.get_json("/status")
        assert status["waiting"] == 0 and status["running"] == 0 and status["active_requests"] == 0, status
        assert len(status["workers"]) == 2 and all(
            w["kv_blocks_in_use"] == 0 and w["kv_blocks_free"] + w["kv_blocks_cached"] == w["kv_blocks_total"] == 256
            for w in status["workers"]), status["workers"]
        shared_prefix_hits = status["scheduler"]["prefix_cache_hit_tokens"]
        assert shared_prefix_hits > 0, "the storm's shared preamble was never found cached"
        stuck = {name: value for name, value in statuses.items() if value not in (b"finished", b"cancelled")}
        assert not stuck, f"not ended: {stuck}"
        accepted = {name: result for name, result in results.items() if result.output.request_id is not None}
        uncancelled = {name: result.output for name, result in accepted.items() if not result.cancel_sent}
        assert {name for name, result in uncancelled.items() if statuses[name] != b"finished"} == set(), \
            "a request nobody cancelled did not finish"
        check_same_as_baseline({name: output for name, output in uncancelled.items()
                                if results[name].request.cancel is None}, baseline, "after the storm")
        check_token_streams(cluster, {name: result.output for name, result in accepted.items()})
        raced = []
        for name, result in accepted.items():
            if not result.cancel_sent:
                continue
            final = token_events(cluster, result.output.request_id)[-1]
            if result.delete_answer is False:  # it had ended before the DELETE came
                assert statuses[name] == b"finished", name
            elif result.delete_answer is True:  # the DELETE answers how the request ended
                assert (statuses[name], final.finish_reason) == (b"cancelled", "cancelled"), name
            elif statuses[name] == b"finished":  # a disconnect as the last token was written: no loss
                assert final.finish_reason in ("length", "stop"), name
                raced.append(name)
            else:
                assert final.finish_reason == "cancelled", name
        sent = sum(result.cancel_sent for result in results.values())
        cancelled_count = sum(value == b"cancelled" for value in statuses.values())
        ended_first = sum(result.delete_answer is False for result in results.values())
        assert cancelled_count + ended_first + len(raced) == sent - len(never_accepted), \
            "a sent cancel is unaccounted for"
        assert len(raced) <= max(2, sent // 10), f"{len(raced)} disconnected clients' requests finished anyway"
        preempted = len(cluster.log_events("scheduler", "preempted request_id="))
    report("cancellation_storm", requests=len(STORM), cancels_sent=sent, cancelled=cancelled_count,
           ended_before_the_delete=ended_first, disconnect_raced_the_end=len(raced), never_accepted=len(never_accepted),
           cancelled_by_delete=sum(r.cancel == "delete" for r in STORM),
           cancelled_by_disconnect=sum(r.cancel == "disconnect" for r in STORM),
           storm_seconds=round(storm_seconds, 1), preempted=preempted, prefix_cache_hit_tokens=shared_prefix_hits,
           test_seconds=round(time.monotonic() - started, 1))


def test_kv_pressure_preempts_the_youngest_and_outputs_are_unchanged(baseline, executor, schedulers):
    # (10 blocks, 160 tokens: two of these requests at their longest)
    with Cluster(**executor, workers=1, kv_blocks=10, schedulers=schedulers) as cluster:
        outputs = asyncio.run(run_all(cluster, PRESSURE, lambda outputs: asyncio.sleep(0), stream=False))
        asyncio.run(until_kv_all_free(cluster))
        check_same_as_baseline(outputs, baseline, "under KV pressure")
        check_nothing_left(cluster)
        preempted = cluster.log_events("scheduler", "reason=kv_full")
        assert preempted, "the pool never ran out: nothing was preempted"
        assert not cluster.log_events("scheduler", "kv_cache_full"), "the worker's pool overflowed"
        check_each_preemption_took_the_youngest(cluster, outputs)
        recomputed = tokens_recomputed(cluster)
        assert recomputed > 0, "preempted requests were never rebuilt"
        report("kv_pressure", preempted=len(preempted), tokens_recomputed=recomputed)


def check_each_preemption_took_the_youngest(cluster: Cluster, outputs: dict[str, Output]) -> None:
    """Replaying the scheduler's log (admitted / preempted / finished, in order): every preempted
    request was the most recent arrival among the requests running at that moment."""
    client = cluster.redis_client()
    try:
        arrival = {output.request_id: decode(RequestRecord, client.hget(keys.request_key(output.request_id),
                                                                         "record")).arrival_time
                   for output in outputs.values()}
    finally:
        client.close()
    line_pattern = re.compile(r"^\S+ \S+ \S+ \S+ (admitted|preempted|finished) request_id=(\S+)")
    victims = 0
    for text in cluster.logs("scheduler"):  # (each scheduler's apart: one preempts among its own requests)
        running: set[str] = set()
        for line in text.splitlines():
            match = line_pattern.match(line)
            if match is None or match.group(2) not in arrival:
                continue
            event, request_id = match.groups()
            if event == "admitted":
                running.add(request_id)
            elif event == "preempted":
                youngest = max(running, key=lambda other: arrival[other])
                assert request_id == youngest, f"preempted {request_id}, but {youngest} arrived later"
                running.discard(request_id)
                victims += 1
            else:
                running.discard(request_id)
    assert victims > 0, "no preemption found in the log"


# Worker faults


def test_sigkill_a_worker_mid_run_outputs_equal_a_fault_free_run_with_no_gap_or_duplicate(
        baseline, executor, schedulers):
    with Cluster(**executor, workers=2, schedulers=schedulers) as cluster:
        killed: dict[str, float] = {}
        victim: list[str] = []

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            name, worker_id = await busiest_worker(cluster)
            victim.extend([worker_id, next(w["id"] for w in status_workers(cluster) if w["id"] != worker_id)])
            killed["at"], killed["monotonic"] = cluster.kill(name), time.monotonic()

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        check_same_as_baseline(outputs, baseline, "after a worker was killed")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        dead_id, survivor_id = victim
        dead = cluster.log_events("scheduler", f"worker_dead worker_id={dead_id}")
        assert dead, "the scheduler never noticed the dead worker"
        detected = dead[0][0] - killed["at"]
        check_recovered_by_liveness_not_by_the_stall_fallback(cluster, outputs)
        check_no_dead_worker_left(cluster, dead_id)
        moved = [line for when, line in cluster.log_events("scheduler", "admitted request_id=")
                 if when > killed["at"] and f"worker_id={survivor_id}" in line and "output_tokens=0" not in line]
        assert moved, "no request was rebuilt on the surviving worker"
        resumed = max(min(t for _, _, t in output.pieces if t > killed["monotonic"])
                      for output in outputs.values() if output.pieces[-1][2] > killed["monotonic"])
        report("worker_sigkill", detected_seconds=round(detected, 2), requests_moved=len(moved),
               recovery_seconds=round(resumed - killed["monotonic"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2),
               tokens_recomputed=tokens_recomputed(cluster))


def test_a_worker_whose_engine_breaks_leaves_and_its_requests_finish_elsewhere_token_exact(
        baseline, executor, schedulers):
    """An engine that can no longer compute (tests/faulty_worker.py: the forward pass raises a
    device-side assert from its 13th call) is not a failed plan but a broken worker: it deregisters
    and exits non-zero, and its requests are rebuilt on the other worker with the same output."""
    from services.worker.service import ENGINE_BROKEN_EXIT_CODE
    from tests.faulty_worker import INJECTED

    with Cluster(**executor, workers=1, schedulers=schedulers) as cluster:
        faulty = cluster.start_worker(module="tests.faulty_worker", ITERSERVE_TEST_BREAK_AFTER_STEPS="12")
        cluster.wait_ready(2)
        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, lambda outputs: asyncio.sleep(0)))
        check_same_as_baseline(outputs, baseline, "after a worker's engine broke")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        code = faulty.process.wait(timeout=30)
        assert code == ENGINE_BROKEN_EXIT_CODE, f"exit code {code}:\n{cluster.log(faulty.name)[-2000:]}"
        worker_log = cluster.log(faulty.name)
        assert "event=engine_broken" in worker_log and INJECTED in worker_log
        assert "event=plan_failed" not in worker_log
        ran_there = [line for _, line in cluster.log_events("scheduler", "admitted request_id=")
                     if f"worker_id={faulty.worker_id}" in line]
        assert ran_there, "the faulty worker never got a request: the fault tested nothing"
        gone = cluster.log_events("scheduler", f"worker_gone worker_id={faulty.worker_id}")
        assert gone, ("the scheduler never saw the broken worker leave",
                      [line for _, line in cluster.log_events("scheduler", f"worker_id={faulty.worker_id}")
                       if "admitted" not in line])
        check_no_dead_worker_left(cluster, faulty.worker_id)
        report("engine_fault", requests_on_faulty_worker=len(ran_there), tokens_recomputed=tokens_recomputed(cluster))


def test_sigterm_hands_over_then_the_last_worker_drains_and_requests_wait_for_a_new_one(baseline, executor, schedulers):
    # Long enough for a handover to finish on a loaded machine, short enough that the last worker
    # leaves requests unfinished. Emulated: the slower a100-qwen2.5-32b (~43 ms steps, 40-token
    # requests take ~1.7 s; emulated tokens do not depend on the profile, so the baseline holds).
    emulated = executor.get("executor") == "emulated"
    settings = executor | {"hardware": "a100-qwen2.5-32b"} if emulated else executor
    drain_seconds = 0.8 if emulated else 2.0
    with Cluster(**settings, workers=2, drain_seconds=drain_seconds, schedulers=schedulers) as cluster:
        stopped: dict[str, float] = {}
        names: list[str] = []

        async def scale_down(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 5), "5 tokens in every stream")
            name, worker_id = await busiest_worker(cluster)
            names.extend([name, worker_id, "worker-2" if name == "worker-1" else "worker-1"])
            stopped["at"] = cluster.kill(name, signal.SIGTERM)
            code = await asyncio.to_thread(cluster.wait_exit, name, drain_seconds + 8)
            stopped["exited"] = time.time()
            assert code == 0, cluster.log(name)[-2000:]

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, scale_down))
        check_same_as_baseline(outputs, baseline, "after a worker was stopped")
        stopped_name, stopped_id, last_name = names
        worker_log = cluster.log(stopped_name)
        assert "event=draining" in worker_log and "event=drained" in worker_log, worker_log[-2000:]
        assert cluster.log_events("scheduler", f"handed_over worker_id={stopped_id}"), "nothing was handed over"
        handover_seconds = stopped["exited"] - stopped["at"]
        handover_recomputed = tokens_recomputed(cluster)

        # The last worker stops: nobody to hand over to, so it runs on for drain_seconds, then goes.
        waiting_cancelled = Output()
        last: dict[str, float] = {}

        async def last_worker_goes(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 5), "5 tokens in every stream")
            last["at"] = cluster.kill(last_name, signal.SIGTERM)
            code = await asyncio.to_thread(cluster.wait_exit, last_name, drain_seconds + 8)
            last["exited"] = time.time()
            assert code == 0, cluster.log(last_name)[-2000:]
            await until(lambda: cluster.get_json("/health")[0] == 503, "/health to say no worker is left", 10)
            assert cluster.get_json("/health")[1]["missing"] == ["workers"]
            # A request that arrives now waits; cancelled while waiting, it never runs.
            async with session() as http:
                spec = Spec("never-runs", prompt(950), 8, seed=77)
                client = asyncio.create_task(stream_request(http, cluster, spec, waiting_cancelled))
                await until(lambda: waiting_cancelled.request_id is not None or client.done(), "its headers", 10)
                await asyncio.sleep(0.5)
                async with http.delete(f"{cluster.base_url}/v1/requests/{waiting_cancelled.request_id}") as response:
                    answer = await response.json()  # how it ended: cancelled, never having run
                    assert (answer["status"], answer["cancelled"]) == ("cancelled", True)
                await asyncio.wait_for(client, 10)
            assert any(output.finish_reason is None for output in outputs.values()), \
                "the last worker finished everything: nothing was left waiting"
            last["worker_started"] = time.time()
            cluster.start_worker()

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, last_worker_goes))
        check_same_as_baseline(outputs, baseline, "after the last worker was stopped and a new one started")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        assert waiting_cancelled.finish_reason == "cancelled" and waiting_cancelled.text == ""
        assert not any(waiting_cancelled.request_id in record.request_ids for record in iteration_records(cluster))
        assert "event=drain_timeout" in cluster.log(last_name) or "event=drained" in cluster.log(last_name)
        assert last["exited"] - last["at"] < drain_seconds + 5, "drain_seconds bounds how long a stop takes"
        report("worker_sigterm", handover_exit_seconds=round(handover_seconds, 2),
               handover_tokens_recomputed=handover_recomputed, drain_seconds_setting=drain_seconds,
               last_worker_exit_seconds=round(last["exited"] - last["at"], 2),
               tokens_recomputed_total=tokens_recomputed(cluster))


# Scheduler, Redis and gateway faults


def test_sigkill_the_scheduler_mid_run_and_start_a_new_one(baseline, executor, schedulers):
    with Cluster(**executor, workers=2, schedulers=schedulers) as cluster:
        times: dict[str, float] = {}
        extra: dict[str, Output] = {}
        victim = cluster.scheduler_names[0]  # (with two, the other runs on: a new one joins beside it)

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            times["killed"] = cluster.kill(victim)
            times["killed_monotonic"] = time.monotonic()
            # Accepted while no scheduler runs: they wait in Redis for the next one.
            async with session() as http:
                accepted = [
                    asyncio.create_task(whole_request(http, cluster, spec, extra.setdefault(spec.name, Output())))
                    for spec in EXTRA
                ]
                await asyncio.sleep(1.0)
                times["restarted"] = time.time()
                cluster.start("scheduler", victim)
                await asyncio.gather(*accepted)

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        check_same_as_baseline(outputs, baseline, "after the scheduler was killed")
        check_same_as_baseline(extra, baseline, "accepted while the scheduler was down")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        loaded = cluster.log_events(victim, "pool_loaded" if schedulers == 1 else "scheduler_joining")
        assert len(loaded) == 2, "the new scheduler did not load the pool (or join)"
        check_recovered_by_liveness_not_by_the_stall_fallback(cluster, outputs)
        resumed = min(t for output in outputs.values() for _, _, t in output.pieces if t > times["killed_monotonic"])
        report("scheduler_sigkill", restart_to_pool_loaded_seconds=round(loaded[-1][0] - times["restarted"], 2),
               first_token_after_kill_seconds=round(resumed - times["killed_monotonic"], 2),
               scheduler_down_seconds=round(times["restarted"] - times["killed"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2), tokens_recomputed=tokens_recomputed(cluster))


# Several schedulers (--schedulers 2: services/scheduler/shards.py)


def schedulers_status(cluster: Cluster) -> list[dict]:
    """Each scheduler of the model, with its leases ({worker id: fencing token}), from /status."""
    return cluster.get_json("/status")[1]["models"][MODEL]["schedulers"]


async def until_each_scheduler_leases_one_worker(cluster: Cluster) -> None:
    def each_one() -> bool:
        schedulers = schedulers_status(cluster)
        return len(schedulers) == 2 and all(len(scheduler["leases"]) == 1 for scheduler in schedulers)
    await until(each_one, "a worker leased by each of the two schedulers", 10)


class PlanWatch:
    """Every plan added to the workers' plan streams while it runs: (worker id, scheduler epoch)."""

    def __init__(self, cluster: Cluster, worker_ids: list[str]) -> None:
        import threading

        from shared.plans import read_plan

        self.client, self.read_plan = cluster.redis_client(), read_plan
        self.last = {}
        for worker_id in worker_ids:
            tail = self.client.xrevrange(keys.plan_stream(worker_id), count=1)
            self.last[keys.plan_stream(worker_id)] = tail[0][0] if tail else b"0-0"
        self.plans: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopping.is_set():
            for stream, entries in self.client.xread(self.last, block=100) or ():
                for entry_id, fields in entries:
                    self.last[stream.decode()] = entry_id
                    worker_id = stream.decode().removeprefix(keys.plan_stream(""))
                    self.plans.append((worker_id, self.read_plan(fields[b"m"], worker_id).epoch))

    def stop(self) -> list[tuple[str, str]]:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.client.close()
        return self.plans


def check_the_other_scheduler_took_over(cluster: Cluster, stopped: str, outputs: dict[str, Output]) -> None:
    assert cluster.log_events(stopped, "admitted"), f"{stopped} had taken no request: nothing was taken over"
    assert cluster.log_events("scheduler-2", "scheduler_taken_over"), "scheduler-2 took nothing over"
    taken_over_at = cluster.log_events("scheduler-2", "scheduler_taken_over")[0][0]
    assert [when for when, _ in cluster.log_events("scheduler-2", "worker_leased") if when >= taken_over_at - 0.01], \
        "scheduler-2 did not take the other's worker"
    # (a worker handed over to a scheduler that joined again is unleased for up to a poll: wait)
    leases = lambda: sorted(worker for scheduler in schedulers_status(cluster) for worker in scheduler["leases"])  # noqa: E731
    asyncio.run(until(lambda: leases() == ["chaos-w1", "chaos-w2"], "every worker leased after the takeover", 10))
    gap = longest_gap(outputs)
    assert gap < 5.0, f"a stream waited {gap:.1f} s"


def test_one_of_two_schedulers_sigkilled_mid_run_the_other_takes_its_workers_and_requests_token_exact(
        baseline, executor):
    with Cluster(**executor, workers=2, schedulers=2) as cluster:
        asyncio.run(until_each_scheduler_leases_one_worker(cluster))
        times: dict[str, float] = {}

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            times["killed"] = cluster.kill("scheduler-1")

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        check_same_as_baseline(outputs, baseline, "after one of two schedulers was killed")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        check_the_other_scheduler_took_over(cluster, "scheduler-1", outputs)
        taken = cluster.log_events("scheduler-2", "scheduler_taken_over")[0][0]
        report("one_of_two_schedulers_sigkill", takeover_after_kill_seconds=round(taken - times["killed"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2), tokens_recomputed=tokens_recomputed(cluster))


def test_one_of_two_schedulers_sigstopped_is_taken_over_and_after_sigcont_writes_no_plan_or_token(
        baseline, executor):
    with Cluster(**executor, workers=2, schedulers=2) as cluster:
        asyncio.run(until_each_scheduler_leases_one_worker(cluster))
        pid = cluster.services["scheduler-1"].process.pid
        stopped_id = next(scheduler["scheduler_id"] for scheduler in schedulers_status(cluster)
                          if scheduler["pid"] == pid)
        times: dict[str, float] = {}
        watch: list[PlanWatch] = []

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            cluster.kill("scheduler-1", signal.SIGSTOP)
            times["stopped"] = time.monotonic()
            await until(lambda: cluster.log_events("scheduler-2", "scheduler_taken_over"), "the takeover", 10)
            times["taken"] = time.monotonic()
            watch.append(PlanWatch(cluster, ["chaos-w1", "chaos-w2"]))
            times["continued"] = time.time()
            cluster.kill("scheduler-1", signal.SIGCONT)
            await until(lambda: cluster.log_events("scheduler-1", "lease_lost scheduler_id"), "scheduler-1 finding it was taken "
                        "over", 10)

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        plans = watch[0].stop()
        stale = [plan for plan in plans if plan[1] == stopped_id]
        assert not stale, f"the stalled scheduler sent {len(stale)} plans after it was taken over"
        assert plans, "no plan was seen after the SIGCONT (the watch saw nothing)"
        for name in ("worker-1", "worker-2"):  # no worker wrote (or tried to write) for a stale plan
            assert not [line for when, line in cluster.log_events(name, "stale_write") if when >= times["continued"]]
        check_same_as_baseline(outputs, baseline, "after one of two schedulers stalled")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        check_the_other_scheduler_took_over(cluster, "scheduler-1", outputs)
        rejoined = [scheduler for scheduler in schedulers_status(cluster) if scheduler["pid"] == pid]
        assert rejoined and rejoined[0]["scheduler_id"] != stopped_id, "the stalled scheduler did not join again"
        report("one_of_two_schedulers_sigstop", takeover_after_stop_seconds=round(times["taken"] - times["stopped"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2), tokens_recomputed=tokens_recomputed(cluster))


def test_one_of_two_schedulers_loses_its_only_worker_and_its_requests_finish_on_the_others(baseline, executor):
    with Cluster(**executor, workers=2, schedulers=2) as cluster:
        asyncio.run(until_each_scheduler_leases_one_worker(cluster))
        pid = cluster.services["scheduler-1"].process.pid
        [worker_id] = next(scheduler["leases"] for scheduler in schedulers_status(cluster) if scheduler["pid"] == pid)
        times: dict[str, float] = {}

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            times["killed"] = cluster.kill(cluster.name_of_worker(worker_id))

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        check_same_as_baseline(outputs, baseline, "after the only worker of one of two schedulers was killed")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        assert cluster.log_events("scheduler-1", "admitted"), "scheduler-1 had taken no request"
        # It lets go of them; or, its lease run out first (a slow turn under load), it finds itself
        # taken over (or joins again and leaves them for the one with a worker).
        let_go = cluster.log_events("scheduler-1", "no_worker_letting_go") or \
            cluster.log_events("scheduler-1", "lease_lost scheduler_id") or \
            cluster.log_events("scheduler-2", "scheduler_taken_over")
        assert let_go, "scheduler-1 kept its requests with no worker"
        let_go = let_go[0][0]
        continued = [line for _, line in cluster.log_events("scheduler-2", "loaded request_id")
                     if "output_tokens=0" not in line]  # (taken with their output so far)
        assert continued, "scheduler-2 continued none of scheduler-1's requests"
        asyncio.run(until(lambda: sorted(len(scheduler["leases"]) for scheduler in schedulers_status(cluster)) == [0, 1],
                          "the live worker leased, the other scheduler standing by", 10))
        gap = longest_gap(outputs)  # (a worker's death is noticed in 1.5 s, then its requests are rebuilt)
        assert gap < Settings().stall_seconds, f"a stream waited {gap:.1f} s: as long as the stall fallback"
        report("one_of_two_schedulers_loses_its_worker", let_go_after_kill_seconds=round(let_go - times["killed"], 2),
               longest_stream_gap=round(gap, 2), tokens_recomputed=tokens_recomputed(cluster))


def check_pool_loaded_again_after_the_redis_restart(cluster: Cluster) -> None:
    """The scheduler saw Redis's new run_id once and loaded the pool again under a new epoch, and
    no worker's entry of an older plan landed after that (check_token_streams: no gap)."""
    if len(cluster.scheduler_names) > 1:
        # Several: each joins again under a new id, having seen the new run_id, or its lease gone
        # first (Redis down longer than a lease, or a promoted replica without the last renewal).
        for name in cluster.scheduler_names:
            left = cluster.log_events(name, "redis_restarted") + cluster.log_events(name, "lease_lost")
            joins = cluster.log_events(name, "scheduler_joining")
            assert left and len(joins) >= 2 and joins[-1][0] >= min(left)[0], (name, left, joins)
        return
    restarts = cluster.log_events("scheduler", "redis_restarted")
    loads = cluster.log_events("scheduler", "pool_loaded")
    assert len(restarts) == 1 and len(loads) == 2, (restarts, loads)
    assert restarts[0][0] <= loads[1][0]
    epochs = {re.search(r" epoch=(\w+)", line).group(1) for _, line in loads}
    assert len(epochs) == 2, loads


async def extra_after_redis_restart(cluster: Cluster, restarted: tuple[float, float], times: dict[str, float],
                                    extra: dict[str, Output]) -> None:
    """Note when Redis stopped and answered again, then run the EXTRA requests (whole) on it."""
    times["stopped"], times["answering"] = restarted
    times["restarted_monotonic"] = time.monotonic()
    async with session() as http:
        await asyncio.gather(*(whole_request(http, cluster, spec, extra.setdefault(spec.name, Output()))
                               for spec in EXTRA))


@pytest.mark.parametrize("down_seconds", [0.0, 3.0], ids=["at-once", "down-3s"])
def test_restart_redis_mid_run_every_request_completes(baseline, executor, schedulers, down_seconds):
    """Redis (`appendfsync everysec`) may lose its last writes with its process, acknowledged or
    not (docs/operations.md, "fsync policy"), so on its new run_id the scheduler loads the pool again as a new
    scheduler would, and every request runs on, exact, from what Redis kept. Down 3 s: the
    workers' heartbeat keys expire meanwhile; the new epoch finds them again as they beat."""
    with Cluster(**executor, workers=2, schedulers=schedulers) as cluster:
        times: dict[str, float] = {}
        extra: dict[str, Output] = {}

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            restarted = await asyncio.to_thread(cluster.restart_redis, True, down_seconds)
            await extra_after_redis_restart(cluster, restarted, times, extra)

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        check_same_as_baseline(outputs, baseline, "after Redis restarted")
        check_same_as_baseline(extra, baseline, "accepted after Redis restarted")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        check_pool_loaded_again_after_the_redis_restart(cluster)
        resumed = min(t for output in outputs.values() for _, _, t in output.pieces if t > times["restarted_monotonic"])
        check_recovered_by_liveness_not_by_the_stall_fallback(cluster, outputs)
        recomputed = tokens_recomputed(cluster)
        assert recomputed > 0, "the requests in flight were not rebuilt"
        report(f"redis_sigkill_restart_{down_seconds:g}s",
               redis_down_seconds=round(times["answering"] - times["stopped"], 2),
               first_token_after_restart_seconds=round(resumed - times["restarted_monotonic"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2), tokens_recomputed=recomputed)


def test_sigkill_the_redis_primary_sentinel_promotes_its_replica_and_every_accepted_request_completes(
        baseline, executor, schedulers):
    """A Redis that fails over (a primary, a replica, three Sentinels; every service through the
    Sentinels; a request accepted once the replica holds it): the primary SIGKILLed mid-run, as when
    its host is lost. The Sentinels promote the replica, every service's next connection goes to
    it, the scheduler loads the pool from it as after a restart (another run_id), and every request,
    those running and those accepted during the failover, completes exact, with no gap or duplicate
    in its stream. The old primary, started again, is made a replica of the new one."""
    with Cluster(**executor, workers=2, redis_replicas=1, schedulers=schedulers) as cluster:
        times: dict[str, float] = {}
        extra: dict[str, Output] = {}

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 8), "8 tokens in every stream")
            first = cluster.redis.primary_port()
            times["killed"] = time.monotonic()
            await asyncio.to_thread(cluster.redis.kill_primary)

            def promoted() -> bool:
                try:
                    return cluster.redis.primary_port() != first
                except RuntimeError:
                    return False
            await until(promoted, "the Sentinels to promote the replica", 30)
            times["promoted"] = time.monotonic()
            await asyncio.to_thread(cluster.redis.restart_stopped)  # the old primary comes back, a replica
            async with session() as http:
                await asyncio.gather(*(whole_request(http, cluster, spec, extra.setdefault(spec.name, Output()))
                                       for spec in EXTRA))

        outputs = asyncio.run(run_all(cluster, FAULT_WORKLOAD, fault))
        check_same_as_baseline(outputs, baseline, "after the Redis primary was lost")
        check_same_as_baseline(extra, baseline, "accepted after the failover")
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        check_pool_loaded_again_after_the_redis_restart(cluster)
        assert cluster.redis.primary_port() != cluster.redis.group.primary_port, "no promotion happened"
        resumed = min(t for output in outputs.values() for _, _, t in output.pieces if t > times["promoted"])
        report("redis_primary_sigkill_sentinel_failover",
               promoted_after_seconds=round(times["promoted"] - times["killed"], 2),
               first_token_after_promotion_seconds=round(resumed - times["promoted"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2), tokens_recomputed=tokens_recomputed(cluster))


def test_redis_loses_its_last_writes_and_every_request_completes_exact_with_no_gap(baseline, executor, schedulers):
    """Redis killed with its last writes lost, as `appendfsync everysec` loses them when an fsync
    is slow (or with its machine): its append-only file is cut back to a second before the kill.
    The plans, results, token entries and heartbeats of the lost 0.6 s are gone, while
    the scheduler, the workers and the clients remember them. The pool is loaded again from what
    Redis kept: every request completes exact, with no gap or duplicate in its stream. Two requests
    accepted in the lost 0.6 s (their every key gone) are submitted again by the gateway that
    accepted them, and their clients get the whole output, exact, with nothing twice."""
    with Cluster(**executor, workers=2, redis_args=("--aof-timestamp-enabled", "yes"),
                 schedulers=schedulers) as cluster:
        times: dict[str, float] = {}
        extra: dict[str, Output] = {}
        counts: dict[str, int] = {}
        lost = {spec.name: Output() for spec in LONG[:2]}  # the same requests again, accepted in the lost writes

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 4), "4 tokens in every stream")
            kept = int(time.time())
            await asyncio.sleep(kept + 1.05 - time.time())  # the writes from second kept + 1 on are lost
            async with session() as http:
                accepted = [asyncio.create_task(stream_request(http, cluster, spec, lost[spec.name]))
                            for spec in LONG[:2]]
                await until(lambda: all(output.request_id for output in lost.values()), "accepted (headers sent)")
                await asyncio.sleep(max(0.0, kept + 1.6 - time.time()))
                counts["tokens_seen"] = sum(len(output.pieces) for output in outputs.values())
                restarted = await asyncio.to_thread(cluster.restart_redis_losing_writes_after, kept)
                client = cluster.redis_client()
                try:
                    counts["entries_kept"] = sum(client.xlen(keys.token_stream(output.request_id))
                                                 for output in outputs.values())
                    counts["lost_requests_kept"] = sum(client.exists(keys.request_key(output.request_id))
                                                       for output in lost.values())
                finally:
                    client.close()
                await extra_after_redis_restart(cluster, restarted, times, extra)
                await asyncio.gather(*accepted)

        outputs = asyncio.run(run_all(cluster, LONG, fault))
        assert counts["entries_kept"] < counts["tokens_seen"], f"no token entry was lost: {counts}"
        assert counts["lost_requests_kept"] == 0, f"a request accepted in the lost writes was kept: {counts}"
        check_same_as_baseline(outputs, baseline, "after Redis lost its last writes")
        check_same_as_baseline(extra, baseline, "accepted after Redis lost its last writes")
        check_same_as_baseline(lost, baseline, "accepted in the writes Redis lost")
        submitted_again = cluster.log_events("gateway", "submitted again")
        assert {re.search(r" id=(\S+)", line).group(1) for _, line in submitted_again} == {
            output.request_id for output in lost.values()}, submitted_again
        check_token_streams(cluster, outputs)
        check_token_streams(cluster, lost)
        check_nothing_left(cluster)
        check_pool_loaded_again_after_the_redis_restart(cluster)
        check_recovered_by_liveness_not_by_the_stall_fallback(cluster, outputs)
        report("redis_sigkill_losing_writes", tokens_seen_by_clients=counts["tokens_seen"],
               token_entries_kept=counts["entries_kept"],
               redis_down_seconds=round(times["answering"] - times["stopped"], 2),
               longest_stream_gap=round(longest_gap(outputs), 2), tokens_recomputed=tokens_recomputed(cluster),
               lost_requests_longest_stream_gap=round(longest_gap(lost), 2))


def test_sigkill_the_gateway_and_clients_reattach_from_their_last_event(baseline, executor, schedulers):
    specs = FAULT_WORKLOAD[:6]
    with Cluster(**executor, workers=2, schedulers=schedulers) as cluster:
        times: dict[str, float] = {}

        async def fault(outputs: dict[str, Output]) -> None:
            await until(all_have(outputs, 6), "6 tokens in every stream")
            times["killed"] = cluster.kill("gateway")
            cluster.start("gateway")
            await asyncio.to_thread(cluster.wait_ready, 2)
            times["ready"] = time.time()

        outputs = asyncio.run(run_all(cluster, specs, fault, reattach=True))
        check_same_as_baseline(outputs, baseline, "re-attached after the gateway was killed")
        assert all(output.reattached >= 1 for output in outputs.values()), "some stream was never cut"
        check_token_streams(cluster, outputs)
        check_nothing_left(cluster)
        report("gateway_sigkill", gateway_restart_seconds=round(times["ready"] - times["killed"], 2),
               tokens_recomputed=tokens_recomputed(cluster))
