"""What waiting for a replica costs a request's acceptance (and so its time to first token): the
gateway's Store.submit against a Redis that fails over (services/redis_group.py: a primary, a replica,
three Sentinels on this host), with Settings.redis_wait_replicas 0 and 1, in interleaved pairs.

    python -m benchmarks.acceptance_wait [--requests 400] [--out benchmarks/results/acceptance_wait.md]
"""

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from services.gateway.store import Store
from services.launcher import Child, free_port, wait_for_group
from services.redis_group import SENTINELS, RedisGroup
from shared.messages import RequestRecord, SamplingParams
from shared.redis_connection import connect


def cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                    platform.machine())


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * len(ordered))],
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


async def measure(url: str, requests: int) -> dict[int, list[float]]:
    stores = {replicas: Store(connect(url), wait_replicas=replicas, wait_ms=1000) for replicas in (0, 1)}
    seconds: dict[int, list[float]] = {0: [], 1: []}
    prompt = tuple(range(200))  # a chat turn's worth of tokens in the record
    for index in range(requests + 20):  # (the first 20 pairs warm the connections up)
        for replicas in ((0, 1) if index % 2 else (1, 0)):
            record = RequestRecord(request_id=f"{index:016x}{replicas:016x}", prompt_token_ids=prompt,
                                   sampling=SamplingParams(), arrival_time=time.time())
            started = time.perf_counter()
            await stores[replicas].submit(record)
            if index >= 20:
                seconds[replicas].append(time.perf_counter() - started)
    for store in stores.values():
        await store.redis.aclose()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/acceptance_wait.md"))
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="iterserve-wait-"))
    group = RedisGroup(directory, free_port(), (free_port(),), tuple(free_port() for _ in range(SENTINELS)))
    children = [Child(name, command, dict(os.environ)) for name, command in group.commands(shutil.which("redis-server"))]
    try:
        for child in children:
            child.start()
        wait_for_group(group)
        seconds = asyncio.run(measure(group.url, args.requests))
    finally:
        for child in children:
            child.process.kill()
            child.process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)
    rows = {replicas: {name: value * 1000 for name, value in quantiles(samples).items()}
            for replicas, samples in seconds.items()}
    lines = [
        "# Acceptance with and without waiting for a replica",
        "",
        f"`python -m benchmarks.acceptance_wait --requests {args.requests}`: the gateway's submit (one MULTI/EXEC of "
        "the record, the active set and the new-request stream; then `WAIT 1 1000` when waiting), through three "
        "Sentinels to a primary with one replica, all on this host; pairs interleaved. "
        f"Host: {cpu_model()}, {os.cpu_count()} CPUs.",
        "",
        "| redis_wait_replicas | median ms | p90 ms | p99 ms |",
        "|---|---|---|---|",
        *(f"| {replicas} | {row['median']:.3f} | {row['p90']:.3f} | {row['p99']:.3f} |" for replicas, row in rows.items()),
        "",
        f"Waiting adds {rows[1]['median'] - rows[0]['median']:.3f} ms to the median acceptance (and so to the time to "
        "first token), on one host: between hosts add a network round trip to the replica.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
