"""Soak: thousands of short requests through `iterserve up`, half of them dropped by their clients
mid-stream, two workers SIGKILLed in the middle (`up` restarts them under new ids). Afterwards
Redis holds no more than it held after the first 200 requests: every global stream at most 1,000
entries, every per-request key expiring (finished results are kept request_ttl_seconds), no more
keys without an expiry, nothing of a dead worker.

    .venv/bin/python -m pytest -m soak -s tests/test_soak.py     # prints its figures
"""

import asyncio
import json
import os
import random
import signal
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import pytest
import redis

from shared import keys
from tests.system import System

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(1500)]

MODEL = "smollm2-135m-instruct"
TOTAL_REQUESTS = 3000
FIRST_REQUESTS = 200  # Redis's key census is taken after these, and again at the end
CONCURRENCY = 32
MAX_TOKENS = 6
KILL_AFTER = (1000, 2000)  # a worker is SIGKILLed once this many requests have been sent
GLOBAL_STREAMS = (keys.NEW_REQUESTS_STREAM, keys.CANCEL_STREAM, keys.RESULTS_STREAM, keys.ITERATIONS_STREAM)
WORDS = ("sea", "bread", "moon", "chess", "rain", "train", "honey", "lamp", "river", "stone", "bell", "cloud")


@dataclass
class Tally:
    completed: int = 0
    dropped: int = 0
    problems: list[str] = field(default_factory=list)
    sent: int = 0


def body(index: int) -> dict:
    rng = random.Random(index)
    prompt = f"{index}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    request = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}, "seed": index}
    request["temperature"] = 0.0 if index % 2 else 0.8
    return request


async def one_request(http: aiohttp.ClientSession, url: str, index: int, tally: Tally) -> None:
    """Even-numbered requests are dropped after their first 1-3 events (the client closes)."""
    drop_after = 1 + index % 3 if index % 4 in (0, 2) else None
    events = 0
    try:
        async with http.post(f"{url}/v1/completions", json=body(index)) as response:
            if response.status != 200:
                tally.problems.append(f"{index}: HTTP {response.status} {await response.text()}")
                return
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.problems.append(f"{index}: {chunk}")
                    return
                if chunk.get("usage"):
                    if chunk["usage"]["completion_tokens"] != MAX_TOKENS:
                        tally.problems.append(f"{index}: usage {chunk['usage']}")
                events += 1
                if drop_after is not None and events >= drop_after:
                    response.close()  # the client goes away mid-stream: the gateway cancels
                    tally.dropped += 1
                    return
        tally.completed += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        tally.problems.append(f"{index}: {type(error).__name__}: {error}")


async def drive(url: str, first: int, count: int, tally: Tally, on_sent=None) -> None:
    """Requests first .. first+count-1, at most CONCURRENCY in flight."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=180, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        slots = asyncio.Semaphore(CONCURRENCY)

        async def run(index: int) -> None:
            try:
                await one_request(http, url, index, tally)
            finally:
                slots.release()

        tasks = []
        for index in range(first, first + count):
            await slots.acquire()
            tally.sent += 1
            if on_sent is not None:
                on_sent(tally.sent)
            tasks.append(asyncio.create_task(run(index)))
        await asyncio.gather(*tasks)


def census(client: redis.Redis) -> dict:
    """What Redis holds: keys without an expiry, per-request keys among them, stream lengths."""
    without_expiry, per_request_without_expiry, plan_streams, per_request = [], [], {}, 0
    for key in client.scan_iter(match=f"{keys.PREFIX}:*", count=1000):
        name = key.decode()
        is_request_key = name.startswith((keys.request_key(""), keys.token_stream("")))
        per_request += is_request_key
        if name.startswith(keys.plan_stream("")):
            plan_streams[name] = client.xlen(key)
        if client.ttl(key) == -1:
            without_expiry.append(name)
            if is_request_key:
                per_request_without_expiry.append(name)
    return {
        "without_expiry": sorted(without_expiry),
        "per_request_without_expiry": per_request_without_expiry,
        "per_request_keys": per_request,
        "streams": {stream: client.xlen(stream) for stream in GLOBAL_STREAMS if client.exists(stream)},
        "plan_streams": plan_streams,
        "workers_set": sorted(member.decode() for member in client.smembers(keys.WORKERS_SET)),
        "used_memory": client.info("memory")["used_memory"],
    }


def live_workers(system: System) -> list[dict]:
    with urllib.request.urlopen(f"{system.url}/status", timeout=5) as response:
        return json.loads(response.read())["workers"]


def wait_settled(system: System, workers: int, timeout: float = 240.0) -> None:
    """No request held anywhere, `workers` live workers, and a heartbeat since (streams trimmed)."""
    deadline = time.monotonic() + timeout
    while True:
        assert system.wait_idle(timeout=max(1.0, deadline - time.monotonic())), "requests still held"
        if len(live_workers(system)) == workers:
            break
        assert time.monotonic() < deadline, f"live workers: {live_workers(system)}"
        time.sleep(0.5)
    time.sleep(1.5)  # the scheduler trims its input streams on its heartbeat timer (0.5 s)


def test_soak_redis_holds_flat_through_drops_and_worker_kills():
    started = time.monotonic()
    with System(workers=2) as system:
        client = redis.Redis.from_url(system.redis_url, socket_timeout=10)
        try:
            tally = Tally()
            asyncio.run(drive(system.url, 0, FIRST_REQUESTS, tally))
            wait_settled(system, 2)
            after_first = census(client)
            killed: list[str] = []

            def kill_a_worker(sent: int) -> None:  # sent: requests sent so far, the first 200 included
                if sent in KILL_AFTER:
                    victim = live_workers(system)[0]
                    killed.append(victim["id"])
                    os.kill(victim["pid"], signal.SIGKILL)

            asyncio.run(drive(system.url, FIRST_REQUESTS, TOTAL_REQUESTS - FIRST_REQUESTS, tally, kill_a_worker))
            wait_settled(system, 2)
            at_end = census(client)
            live = {worker["id"] for worker in live_workers(system)}
        finally:
            client.close()
    seconds = time.monotonic() - started
    figures = {"seconds": round(seconds, 1), "completed": tally.completed, "dropped": tally.dropped,
               "killed_workers": killed, "after_first_200": after_first,
               "at_end": at_end}
    print("\nsoak figures:\n" + json.dumps(figures, indent=2))

    assert not tally.problems, f"{len(tally.problems)} requests went wrong: {tally.problems[:5]}"
    assert tally.completed + tally.dropped == TOTAL_REQUESTS
    assert tally.dropped >= TOTAL_REQUESTS // 2 * 0.9, "half the clients were to drop mid-stream"
    assert len(killed) == 2 and not set(killed) & live, "two workers were killed and replaced"
    for stream, length in at_end["streams"].items():
        assert length <= 1000, f"{stream} holds {length} entries"
    for stream, length in at_end["plan_streams"].items():
        assert length <= 10, f"{stream} holds {length} entries: its worker does not trim it"
    assert not at_end["per_request_without_expiry"], at_end["per_request_without_expiry"][:5]
    assert at_end["per_request_keys"] > after_first["per_request_keys"], "finished results are kept (TTL)"
    assert len(at_end["without_expiry"]) <= len(after_first["without_expiry"]), (
        f"keys without an expiry: {after_first['without_expiry']} after the first {FIRST_REQUESTS}, "
        f"now {at_end['without_expiry']}")
    assert set(at_end["workers_set"]) == live, f"registered {at_end['workers_set']}, live {sorted(live)}"
    for worker_id in killed:
        assert all(worker_id not in key for key in at_end["without_expiry"]), f"a key of dead {worker_id} remains"
        assert keys.plan_stream(worker_id) not in at_end["plan_streams"]

