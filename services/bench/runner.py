"""A benchmark run: build the workload, send it on schedule, collect timings, report.

Open loop (`rate`, Poisson or gamma arrivals) or closed loop (`concurrency` clients, each sending
its next request when the last one ends). Everything drawn comes from `seed`, so two runs with
the same options send the same requests at the same offsets.
"""

import asyncio
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from services.bench.arrivals import arrival_offsets
from services.bench.client import CancelMode, RequestResult, send_request
from services.bench.metrics import summarize
from services.bench.workloads import (
    DEFAULT_CORPUS,
    BenchRequest,
    Conversation,
    PromptSource,
    WorkloadConfig,
    build_conversations,
    build_requests,
)
from shared.config import DEFAULT_MODEL
from shared.tokenizer import Tokenizer

CANCELS_STREAM = 4  # sub-stream of the run's seed: which requests are cancelled


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    num_requests: int = 100
    rate: float = math.inf  # requests/s; inf sends all at once (ignored with concurrency)
    burstiness: float = 1.0  # gamma shape: 1 is Poisson
    concurrency: int | None = None  # closed loop with this many clients instead of a rate
    seed: int = 0
    ttft_slo: float | None = None  # seconds
    tpot_slo: float | None = None  # seconds
    cancel_fraction: float = 0.0  # this share of requests is cancelled half-way through its output
    cancel_mode: CancelMode = "disconnect"
    request_timeout: float = 600.0
    max_duration: float | None = None  # seconds: then stop sending and abandon what is running
    warmup: int = 0  # short requests sent (and not counted) before the run
    model: str = DEFAULT_MODEL
    api_key: str | None = None
    corpus: str = str(DEFAULT_CORPUS)
    progress: bool = True
    label: str = ""

    def describe(self) -> str:
        load = (f"concurrency {self.concurrency}" if self.concurrency else
                "all at once" if math.isinf(self.rate) else
                f"{self.rate:g} req/s " + ("Poisson" if self.burstiness == 1 else f"gamma burstiness {self.burstiness:g}"))
        cancel = f", {self.cancel_fraction:.0%} cancelled half-way" if self.cancel_fraction else ""
        return f"{self.num_requests} requests, {load}, seed {self.seed}{cancel}; {self.workload.describe()}"


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    WIDTH = 30

    def __init__(self, total: int, enabled: bool, label: str = "") -> None:
        self.total, self.enabled, self.label = total, enabled, label
        self.done = self.failed = self.tokens = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_draw = 0.0
        self._last_decile = -1

    def finished(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok and not result.cancelled
        self.tokens += result.output_tokens
        self.draw()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.started
        fraction = self.done / self.total if self.total else 1.0
        text = (f"{self.label}{self.done}/{self.total} requests, {self.failed} failed, "
                f"{self.tokens / max(elapsed, 1e-9):.0f} tok/s, {elapsed:.0f}s")
        if self.tty:
            if not final and now - self._last_draw < 0.2 and self.done < self.total:
                return
            filled = int(self.WIDTH * fraction)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {text}\033[K" + ("\n" if final else ""))
        else:
            decile = int(10 * fraction)
            if decile == self._last_decile and not final:
                return
            self._last_decile = decile
            sys.stderr.write(f"bench: {text}\n")
        sys.stderr.flush()
        self._last_draw = now


def cancel_plan(requests: list[BenchRequest], fraction: float, seed: int) -> dict[int, int]:
    """Which requests the run cancels, and after how many content chunks (half their output)."""
    if fraction <= 0:
        return {}
    eligible = [request for request in requests if request.max_tokens >= 2]  # one token has no "half-way"
    count = min(len(eligible), round(fraction * len(requests)))
    rng = np.random.default_rng([seed, CANCELS_STREAM])
    chosen = rng.choice(len(eligible), size=count, replace=False) if count else []
    return {eligible[position].index: max(1, eligible[position].max_tokens // 2) for position in chosen}


def machine_info() -> dict:
    """The host, its CPU named with its family and model and the vector extensions that decide which
    kernels torch runs (the host class changes between sessions: every figure names it)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            fields = dict(line.split(":", 1) for line in cpuinfo.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        fields = {}
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    if "model name" in fields:
        flags = fields.get("flags", "").split()
        extensions = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
                                              ("amx_tile", "AMX")) if flag in flags] or (
            ["AVX2"] if "avx2" in flags else [])
        cpu = (f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; "
               f"{', '.join(extensions) or 'no AVX2'})")
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


async def server_info(session: aiohttp.ClientSession, url: str) -> dict:
    """What the gateway says about the deployment (policy, workers), best effort."""
    try:
        async with session.get(url.rstrip("/") + "/status", timeout=aiohttp.ClientTimeout(total=5)) as response:
            status = await response.json()
        scheduler = status.get("scheduler") or {}
        return {"policy": scheduler.get("policy"), "workers": len(status.get("workers", [])),
                "devices": sorted({worker.get("device") for worker in status.get("workers", [])})}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


async def run_benchmark(config: BenchConfig, requests: list[BenchRequest] | None = None) -> dict:
    """Run the benchmark; returns the report (config, machine, summary, per-request records).
    Multiturn: num_requests conversations, started at `rate` per second (or `concurrency` at a
    time), each sending its turns in order; a turn that fails ends its conversation."""
    conversations: list[Conversation] = []
    chat_overhead = 0
    if requests is None:
        source = PromptSource(Tokenizer.load(config.model), Path(config.corpus))
        chat_overhead = source.chat_overhead
        if config.workload.name == "multiturn":
            conversations = build_conversations(config.workload, config.num_requests, config.seed, source)
        else:
            requests = build_requests(config.workload, config.num_requests, config.seed, source)
    starts = conversations or requests
    offsets = arrival_offsets(len(starts), config.rate, config.burstiness, config.seed)
    cancels = cancel_plan(requests, config.cancel_fraction, config.seed) if requests else {}
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue requests in the client
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        server = await server_info(session, config.url)
        await _warm_up(session, config)
        total = len(conversations) * config.workload.turns if conversations else len(requests)
        progress = Progress(total, config.progress, f"{config.label}: " if config.label else "")
        run_start = time.perf_counter()
        started_at_unix = time.time()
        finished: dict[int, RequestResult] = {}

        async def one(request: BenchRequest) -> RequestResult:
            result = await send_request(session, config.url, request, config.model, config.workload.temperature,
                                        run_start, cancel_after_chunks=cancels.get(request.index),
                                        cancel_mode=config.cancel_mode, timeout_s=config.request_timeout)
            progress.finished(result)
            finished[request.index] = result
            return result

        if conversations:
            def one_conversation(conversation: Conversation):
                return _conversation(conversation, config.workload, chat_overhead, one)

            work = (_closed_loop(conversations, config.concurrency, one_conversation) if config.concurrency else
                    _open_loop(conversations, offsets, run_start, one_conversation))
            work = _flattened(work)
        elif config.concurrency:
            work = _closed_loop(requests, config.concurrency, one)
        else:
            work = _open_loop(requests, offsets, run_start, one)
        results = await _bounded(work, config.max_duration, requests or [], finished, run_start)
        progress.draw(final=True)
        finished_at_unix = time.time()
    results.sort(key=lambda result: result.index)
    summary = summarize(results, config.ttft_slo, config.tpot_slo)
    return {
        # What served the run, as its answers said: "engine", or "emulated" (no model: a hardware
        # profile's step times), first, so that no figure of an emulated run is read as a model's.
        "executor": ",".join(sorted({result.executor for result in results if result.executor})) or "unknown",
        "label": config.label,
        "description": config.describe(),
        "config": {**asdict(config), "workload": asdict(config.workload), "api_key": None,
                   "rate": None if math.isinf(config.rate) else config.rate},
        "machine": machine_info(),
        "server": server,
        "started_at_unix": started_at_unix,
        "finished_at_unix": finished_at_unix,
        "summary": summary,
        "requests": [result.to_json() for result in results],
    }


async def _conversation(conversation: Conversation, workload: WorkloadConfig, chat_overhead: int,
                        one) -> list[RequestResult]:
    """Its turns in order, each with the whole history, after the think time since the last answer."""
    history: tuple[dict, ...] = ()
    results = []
    for turn in range(workload.turns):
        if turn:
            await asyncio.sleep(conversation.think_seconds[turn - 1])
        request = conversation.request(turn, history, chat_overhead, workload.turns)
        result = await one(request)
        results.append(result)
        if not result.ok:
            break
        history = request.messages + ({"role": "assistant", "content": result.text},)
    return results


async def _flattened(work) -> list[RequestResult]:
    return [result for results in await work for result in results]


async def _open_loop(requests, offsets, run_start, one) -> list[RequestResult]:
    tasks = []
    for request, offset in zip(requests, offsets, strict=True):
        delay = run_start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(requests, concurrency, one) -> list[RequestResult]:
    queue = list(reversed(requests))
    results: list[RequestResult] = []

    async def client() -> None:
        while queue:
            results.append(await one(queue.pop()))

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(requests)))))
    return results


async def _bounded(work, max_duration, requests, finished, run_start) -> list[RequestResult]:
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.wait_for(task, max_duration) if max_duration else await task
    except TimeoutError:
        # What did not end in time counts as failed; its abandoned stream is cancelled server-side.
        now = time.perf_counter() - run_start
        if not requests:  # multiturn: the turns not sent are not counted
            return list(finished.values())
        return [finished.get(request.index) or RequestResult(
            request.index, request.prompt_tokens, request.max_tokens, now, finished_at=now,
            error=f"run stopped after {max_duration:.0f}s") for request in requests]


async def _warm_up(session: aiohttp.ClientSession, config: BenchConfig) -> None:
    """A few short requests, so the first measured ones do not pay for cold caches."""
    body = {"model": config.model, "prompt": "The harbor town woke slowly", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    for _ in range(config.warmup):
        async with session.post(config.url.rstrip("/") + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=120)) as response:
            await response.read()


def finite(value):
    """The report with NaN and infinities as null: strict JSON, readable by any parser."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def write_report(report: dict, path: str) -> None:
    with open(path, "w") as output:
        json.dump(finite(report), output, indent=1, default=str, allow_nan=False)
        output.write("\n")
