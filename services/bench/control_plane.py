"""Does one scheduler keep a fleet of fast workers busy? (`iterserve bench experiments control-plane`)

EMULATED: every worker here runs `--executor emulated --hardware PROFILE` (profiles/*.json): the
real gateway, Redis, scheduler and worker processes run; only the model's arithmetic is replaced by
the time the profile's roofline says the step takes on that GPU. Figures are labelled with the profile.

For each profile (decode steps of about 3, 10 and 26 ms at batch 64) and fleet size N, one
`iterserve up` runs N emulated workers at saturating load: the request pool is kept at 96 active
requests per worker (32-token prompts, 256 output tokens, greedy), more than a worker's batch of 64,
so no worker ever lacks work the scheduler could give it. The load is written straight into the
pool (the gateway's own Store.submit: hash, active set, new-request stream) rather than through
HTTP: at 3 ms steps a fleet of 16 produces ~300k tokens/s, which no client on this 2-core machine
could read, and the question is the scheduler's, not the gateway's (gateways scale out; the
HTTP case below measures the whole path at a rate one machine can read).

After a warm-up, two /status snapshots `seconds` apart give, from counters the system keeps anyway:
  busy      each worker's share of wall time inside steps (its busy_seconds over its heartbeats)
  plans/s   worker-iterations through the scheduler per second
  CPU/it    the scheduler's CPU time per worker-iteration, and by phase (plan, encode, Redis,
            decode, apply, fan-out, timers: services/scheduler/service.py PHASES)
  gap/it    each worker's mean time between steps (wall time not in steps over iterations)
and the last 1000 iteration records give the mean batch and step time.

The HTTP case: 4 emulated h100-llama3-8b workers under 16 streaming clients with 256-token outputs
(the issue's "steady load" on this machine), through the real gateway.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis

from services.bench.experiments import figure
from services.bench.runner import BenchConfig, finite, machine_info, run_benchmark
from services.bench.server import REPO, ServerProcess
from services.bench.workloads import WorkloadConfig
from services.gateway.store import Store
from services.scheduler.service import PHASES
from shared import keys
from shared.config import cpu_list
from shared.messages import IterationRecord, RequestRecord, SamplingParams
from shared.wire import WireError, decode

RESULTS = REPO / "benchmarks" / "results"
BUSY_TARGET = 0.95
STATUS_TIMEOUT_SECONDS = 10.0
SUBMIT_CHUNK = 16


@dataclass(frozen=True)
class Sizes:
    profiles: tuple[str, ...] = ("h100-llama3.2-3b", "a100-llama3-8b", "h100-qwen2.5-32b")
    fleets: tuple[int, ...] = (1, 2, 4, 8, 16)
    seconds: float = 12.0  # the measured window
    warmup_seconds: float = 6.0  # after the pool is full: every worker's batch fills up
    requests_per_worker: int = 96  # active in the pool: more than a batch, so nobody waits for work
    prompt_tokens: int = 32
    output_tokens: int = 256
    max_batch_size: int = 64
    pipeline_depth: int = 2  # plans in flight per worker (the system's default)
    answer_every: int = 1  # plans a worker answers with one result write (the system's default)
    scheduler_steps: int = 1  # decode steps one plan runs (the system's default)
    scheduler_plan_ms: float = 0.0  # with scheduler_steps: plans as long as this (0, the system's default: off)
    scheduler_token_entries: bool = False  # the scheduler writes every token entry (not the system's default)
    scheduler_cpus: str = ""  # the scheduler on these CPUs alone, kept from idling (default: no pinning)
    schedulers: int = 1  # schedulers of the model, each leasing a shard of the fleet (--schedulers)
    http_profile: str = "h100-llama3-8b"
    http_workers: int = 4
    http_clients: int = 16


FULL = Sizes()
QUICK = Sizes(profiles=("h100-llama3-8b",), fleets=(1, 2), seconds=3.0, warmup_seconds=2.0, http_workers=2,
              http_clients=4, output_tokens=64)


def log(message: str) -> None:
    print(f"[control-plane] {message}", file=sys.stderr, flush=True)


def status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/status", timeout=STATUS_TIMEOUT_SECONDS) as response:
        return json.loads(response.read())


class PoolFeeder:
    """Keeps `target` requests active in the pool, as gateways would write them."""

    def __init__(self, redis_url: str, target: int, sizes: Sizes, seed: int) -> None:
        self.redis = aioredis.Redis.from_url(redis_url)
        self.store = Store(self.redis)
        self.target, self.sizes = target, sizes
        self.random = random.Random(seed)
        self.submitted = 0
        self._stop = asyncio.Event()

    def _record(self) -> RequestRecord:
        self.submitted += 1
        prompt = tuple(self.random.randrange(100, 10_000) for _ in range(self.sizes.prompt_tokens))
        sampling = SamplingParams(max_tokens=self.sizes.output_tokens, ignore_eos=True,
                                  seed=self.random.randrange(2**62))
        return RequestRecord(request_id=f"cp-{self.submitted}-{self.random.getrandbits(48):012x}",
                             prompt_token_ids=prompt, sampling=sampling, arrival_time=time.time())

    async def active(self) -> int:
        return await self.redis.scard(keys.ACTIVE_REQUESTS_SET)

    async def run(self) -> None:
        while not self._stop.is_set():
            missing = self.target - await self.active()
            while missing > 0:  # a few at a time: the client's connection pool is bounded
                chunk = min(missing, SUBMIT_CHUNK)
                await asyncio.gather(*(self.store.submit(self._record()) for _ in range(chunk)))
                missing -= chunk
            try:
                await asyncio.wait_for(self._stop.wait(), 0.05)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        self._stop.set()

    async def aclose(self) -> None:
        await self.store.aclose()


def iteration_records(redis_url: str, count: int = 1000) -> list[IterationRecord]:
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        entries = client.xrevrange(keys.ITERATIONS_STREAM, count=count)
    finally:
        client.close()
    records = []
    for _, fields in entries:
        try:
            records.append(decode(IterationRecord, fields[b"m"]))
        except (WireError, KeyError):
            continue
    return records


def measure(before: dict, after: dict, records: list[IterationRecord]) -> dict:
    """The window's figures from two /status snapshots and the latest iteration records."""
    workers_before = {worker["id"]: worker for worker in before["workers"]}
    busy = []
    for worker in after["workers"]:
        earlier = workers_before.get(worker["id"])
        if earlier is None:
            continue
        elapsed = worker["heartbeat_at"] - earlier["heartbeat_at"]
        if elapsed > 0:
            busy.append((worker["busy_seconds"] - earlier["busy_seconds"]) / elapsed)
    scheduler_before, scheduler_after = before["scheduler"], after["scheduler"]
    wall = scheduler_after["heartbeat_at"] - scheduler_before["heartbeat_at"]
    iterations = scheduler_after["iterations"] - scheduler_before["iterations"]
    cpu = scheduler_after["cpu_seconds"] - scheduler_before["cpu_seconds"]
    phases = {phase: (scheduler_after["phase_cpu_seconds"].get(phase, 0.0)
                      - scheduler_before["phase_cpu_seconds"].get(phase, 0.0)) for phase in PHASES}
    per_iteration = 1e6 / iterations if iterations else float("nan")
    decode_records = [record for record in records if record.prefill_tokens == 0 and record.step_seconds > 0]
    batch = [len(record.request_ids) for record in records]
    busy_total = sum(busy) * wall
    return {
        "workers_measured": len(busy),
        "busy_min": min(busy) if busy else float("nan"),
        "busy_mean": sum(busy) / len(busy) if busy else float("nan"),
        "plans_per_s": iterations / wall if wall > 0 else float("nan"),
        "scheduler_cpu_share": cpu / wall if wall > 0 else float("nan"),
        "scheduler_cpu_us_per_iteration": cpu * per_iteration,
        "phase_cpu_us_per_iteration": {phase: seconds * per_iteration for phase, seconds in phases.items()},
        # (a plan of several steps is several worker-iterations: Settings.scheduler_steps)
        "iterations_per_plan": (iterations / (scheduler_after.get("plans", 0) - scheduler_before.get("plans", 0))
                                if scheduler_after.get("plans", 0) > scheduler_before.get("plans", 0) else float("nan")),
        "round_trips_per_iteration": ((scheduler_after["round_trips"] - scheduler_before["round_trips"]) / iterations
                                      if iterations else float("nan")),
        "gap_ms_per_iteration": ((len(busy) * wall - busy_total) / iterations * 1000) if iterations else float("nan"),
        "mean_batch": sum(batch) / len(batch) if batch else float("nan"),
        "mean_decode_step_ms": (sum(record.step_seconds for record in decode_records) / len(decode_records) * 1000
                                if decode_records else float("nan")),
        "window_s": wall,
        "iterations": iterations,
    }


def _server(profile: str, workers: int, sizes: Sizes) -> ServerProcess:
    # room for every active request at its longest (16-token blocks), so KV never limits the batch
    blocks_per_worker = sizes.requests_per_worker * -(-(sizes.prompt_tokens + sizes.output_tokens) // 16) + 256
    return ServerProcess(workers=workers, kv_blocks=blocks_per_worker,
                         extra_args=("--executor", "emulated", "--hardware", profile,
                                     "--max-batch-size", str(sizes.max_batch_size),
                                     "--pipeline-depth", str(sizes.pipeline_depth),
                                     "--answer-every", str(sizes.answer_every),
                                     "--scheduler-steps", str(sizes.scheduler_steps),
                                     *(["--scheduler-plan-ms", f"{sizes.scheduler_plan_ms:g}"]
                                       if sizes.scheduler_plan_ms else []),
                                     *(["--scheduler-token-entries"] if sizes.scheduler_token_entries else []),
                                     *(["--scheduler-cpus", sizes.scheduler_cpus] if sizes.scheduler_cpus else []),
                                     "--schedulers", str(sizes.schedulers)),
                         env={"ITERSERVE_REQUEST_TTL_SECONDS": "30"})


@contextlib.contextmanager
def off_cpus(cpus: str):
    """The load (this process) off the scheduler's CPUs while the system runs, as every process of it
    but the scheduler is (--scheduler-cpus); the system is started before, with every CPU to give."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, before - cpu_list(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def _window(url: str, seconds: float) -> tuple[dict, dict]:
    before = await asyncio.to_thread(status, url)
    await asyncio.sleep(seconds)
    after = await asyncio.to_thread(status, url)
    return before, after


async def pool_case(profile: str, workers: int, sizes: Sizes, seed: int) -> dict:
    with _server(profile, workers, sizes) as server, off_cpus(sizes.scheduler_cpus):
        feeder = PoolFeeder(server.redis_url, workers * sizes.requests_per_worker, sizes, seed)
        feeding = asyncio.create_task(feeder.run())
        try:
            await asyncio.sleep(sizes.warmup_seconds)
            cpu_before = server.cpu_seconds()
            before, after = await _window(server.url, sizes.seconds)
            cpu_after = server.cpu_seconds()
        finally:
            await feeder.stop()
            await feeding
            await feeder.aclose()
        figures = measure(before, after, iteration_records(server.redis_url))
        # Where the host's CPU goes (on a machine of few cores, every process's is the fleet's): each
        # kind of process's CPU time in the window per worker-iteration, the workers' summed.
        iterations = figures["iterations"]
        figures["cpu_us_per_iteration_by_component"] = {
            name: 1e6 * (seconds - cpu_before.get(name, 0.0)) / iterations for name, seconds in cpu_after.items()
        } if iterations else {}
        executors = {(worker["executor"], worker.get("hardware")) for worker in after["workers"]}
    if executors != {("emulated", profile)}:
        raise RuntimeError(f"expected emulated {profile} workers, /status says {executors}")
    if sizes.scheduler_cpus and set(after["scheduler"]["cpus"]) != cpu_list(sizes.scheduler_cpus):
        raise RuntimeError(f"expected the scheduler on CPUs {sizes.scheduler_cpus}, /status says "
                           f"{after['scheduler']['cpus']}")
    return {"case": "pool", "executor": "emulated", "profile": profile, "workers": workers, **figures}


async def http_case(sizes: Sizes, seed: int) -> dict:
    """Streaming clients through the gateway: the whole path, at a rate this machine can read."""
    with _server(sizes.http_profile, sizes.http_workers, sizes) as server, off_cpus(sizes.scheduler_cpus):
        workload = WorkloadConfig(name="orca", input_range=(sizes.prompt_tokens, sizes.prompt_tokens),
                                  output_range=(sizes.output_tokens, sizes.output_tokens))
        duration = sizes.warmup_seconds + sizes.seconds + 5
        config = BenchConfig(url=server.url, workload=workload, num_requests=64 * sizes.http_clients,
                             concurrency=sizes.http_clients,
                             seed=seed, max_duration=duration, progress=False, label="control-plane http")
        running = asyncio.create_task(run_benchmark(config))
        await asyncio.sleep(sizes.warmup_seconds)
        before, after = await _window(server.url, sizes.seconds)
        report = await running
        figures = measure(before, after, iteration_records(server.redis_url))
        cpu = server.cpu_seconds()
    completed = [request for request in report["requests"]
                 if request["error"] is None and request["finish_reason"] in ("stop", "length")]
    tokens = sum(request.get("output_tokens", 0) for request in completed)
    return {"case": "http", "executor": "emulated", "profile": sizes.http_profile, "workers": sizes.http_workers,
            "clients": sizes.http_clients, "completed_requests": len(completed), "client_output_tokens": tokens,
            "cpu_seconds_by_component": cpu, **figures}


def _component_cpu(row: dict, name: str) -> str:
    value = row.get("cpu_us_per_iteration_by_component", {}).get(name)
    return "" if value is None else f"{value:.0f}"


def largest_busy_fleet(rows: list[dict], profile: str) -> int:
    """The largest fleet whose every worker was at least 95% busy (0: not even one)."""
    kept = [row["workers"] for row in rows if row["profile"] == profile and row["busy_min"] >= BUSY_TARGET]
    return max(kept, default=0)


def markdown(report: dict) -> str:
    rows = report["pool"]
    lines = [
        "# Control plane at GPU step times (EMULATED workers)",
        "",
        f"`iterserve bench experiments control-plane{' --quick' if report['quick'] else ''}` on "
        f"{report['machine'].get('cores', '?')} cores, {report['date']}. Every worker is "
        "`--executor emulated --hardware PROFILE`: real gateway, Redis, scheduler and worker processes; the step "
        "takes the time the profile's roofline gives (no model runs; the profiles assume a memory efficiency "
        "of 0.77, from a published vLLM decode, where the one measured fit, Llama-3.2-1B's shape on an H200, gave "
        "0.20: benchmarks/results/measured-nvidia-h200-llama3.2-1b.json). The pool holds "
        f"{report['sizes']['requests_per_worker']} active requests per worker ({report['sizes']['prompt_tokens']}-token "
        f"prompts, {report['sizes']['output_tokens']} output tokens), max batch {report['sizes']['max_batch_size']}, "
        f"{report['sizes']['pipeline_depth']} plans in flight per worker (`--pipeline-depth`), "
        f"answered {report['sizes'].get('answer_every', 1)} at a time (`--answer-every`), "
        f"plans of decodes running {report['sizes'].get('scheduler_steps', 1)} steps each (`--scheduler-steps`)"
        + (f" at most, as many as fit in {report['sizes']['scheduler_plan_ms']:g} ms of the worker's steps "
           "(`--scheduler-plan-ms`); " if report["sizes"].get("scheduler_plan_ms") else "; ")
        + ("the scheduler writes every token entry (`--scheduler-token-entries`); "
           if report["sizes"].get("scheduler_token_entries")
           else "the workers write the token entries of plain tokens; ")
        + (f"the scheduler alone on CPU {report['sizes']['scheduler_cpus']}, kept from idling, everything else on "
           "the others (`--scheduler-cpus`); " if report["sizes"].get("scheduler_cpus") else "")
        + f"measured over {report['sizes']['seconds']:g} s after a "
        f"{report['sizes']['warmup_seconds']:g} s warm-up.",
        "",
        "| profile (emulated) | step ms | workers | batch | busy min | busy mean | plans/s | scheduler CPU | "
        "CPU µs / it | plan | encode | redis | decode | apply | fan-out | timers | other | round trips / it | it / plan | "
        "gap ms / it | workers' CPU µs / it | Redis's CPU µs / it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        phases = row["phase_cpu_us_per_iteration"]
        lines.append(
            f"| {row['profile']} | {figure(row['mean_decode_step_ms'], 2)} | {row['workers']} | {row['mean_batch']:.1f} | "
            f"{row['busy_min']:.2f} | {row['busy_mean']:.2f} | {row['plans_per_s']:.0f} | "
            f"{row['scheduler_cpu_share']:.0%} | {row['scheduler_cpu_us_per_iteration']:.0f} | "
            + " | ".join(f"{phases.get(phase, float('nan')):.0f}" for phase in PHASES)
            + f" | {row['scheduler_cpu_us_per_iteration'] - sum(phases.values()):.0f}"
            + f" | {figure(row['round_trips_per_iteration'], 2)} | {figure(row.get('iterations_per_plan', float('nan')), 2)}"
            f" | {figure(row['gap_ms_per_iteration'], 2)} | "
            f"{_component_cpu(row, 'worker')} | {_component_cpu(row, 'redis')} |")
    lines += ["", "Largest fleet one scheduler keeps every worker at least 95% busy:", ""]
    for profile, fleet in report["largest_busy_fleet"].items():
        lines.append(f"- {profile} (emulated): {fleet or 'none of the fleets measured'}")
    http = report.get("http")
    if http:
        lines += [
            "",
            f"HTTP case (EMULATED {http['profile']}): {http['workers']} workers, {http['clients']} streaming clients, "
            f"{report['sizes']['output_tokens']}-token outputs through the gateway: busy min {http['busy_min']:.2f}, "
            f"mean {http['busy_mean']:.2f}, batch {http['mean_batch']:.1f}, {http['plans_per_s']:.0f} plans/s, "
            f"{http['completed_requests']} requests completed.",
        ]
    lines += [
        "",
        "Columns: step ms = mean emulated decode step; busy = share of wall time inside steps (per worker, from "
        "/status busy_seconds); plans/s = worker-iterations through the scheduler; scheduler CPU = its CPU time over "
        "wall time; CPU µs / it = its CPU time per worker-iteration, then by phase (timers: workers' liveness, the "
        "heartbeat and the trims, which run on timers, not per worker-iteration; other: the loop itself and the rest); "
        "round trips / it = its Redis "
        "round trips per worker-iteration (one each: no result read with another); it / plan = worker-iterations "
        "per plan the scheduler sent (more than one with `--scheduler-steps`); gap ms / it = a worker's mean "
        "time between steps; workers' and Redis's CPU µs / it = their CPU time per worker-iteration (the workers' "
        "summed): with the scheduler's, what one worker-iteration costs the host.",
        "",
    ]
    return "\n".join(lines)


async def run(sizes: Sizes, out_dir: Path, seed: int, http: bool = True, quick: bool = False) -> dict:
    started = time.monotonic()
    rows = []
    for profile in sizes.profiles:
        for workers in sizes.fleets:
            log(f"{profile} (emulated) x {workers} workers")
            row = await pool_case(profile, workers, sizes, seed)
            log(f"  busy min {row['busy_min']:.2f} mean {row['busy_mean']:.2f}, {row['plans_per_s']:.0f} plans/s, "
                f"{row['scheduler_cpu_us_per_iteration']:.0f} us CPU per iteration, batch {row['mean_batch']:.1f}")
            rows.append(row)
    report = {
        "quick": quick,
        "date": time.strftime("%Y-%m-%d"),
        "executor": "emulated",
        "machine": machine_info(),
        "sizes": asdict(sizes),
        "pool": rows,
        "largest_busy_fleet": {profile: largest_busy_fleet(rows, profile) for profile in sizes.profiles},
    }
    if http:
        log(f"HTTP case: {sizes.http_workers} x {sizes.http_profile} (emulated), {sizes.http_clients} clients")
        report["http"] = await http_case(sizes, seed)
    report["minutes"] = (time.monotonic() - started) / 60
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "control_plane.json").write_text(json.dumps({"executor": "emulated", **finite(report)}, indent=1))
    (out_dir / "control_plane.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="iterserve bench experiments control-plane", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one profile, fleets 1 and 2, short windows")
    parser.add_argument("--profiles", help="comma-separated profile names (default: the three step times)")
    parser.add_argument("--fleets", help="comma-separated worker counts (default 1,2,4,8,16)")
    parser.add_argument("--seconds", type=float, help="measured window per configuration")
    parser.add_argument("--pipeline-depth", type=int, help="plans in flight per worker (default 2, the system's)")
    parser.add_argument("--answer-every", type=int,
                        help="plans a worker answers with one result write (default 1, the system's; K > 1 "
                             "needs --pipeline-depth 2K)")
    parser.add_argument("--scheduler-steps", type=int,
                        help="decode steps one plan runs, answered together (default 1, the system's)")
    parser.add_argument("--scheduler-plan-ms", type=float,
                        help="with --scheduler-steps N: plans of as many steps (up to N) as fit in this many ms")
    parser.add_argument("--scheduler-token-entries", action="store_true",
                        help="the scheduler writes every token entry (default: the workers write most)")
    parser.add_argument("--scheduler-cpus",
                        help="the scheduler alone on these CPUs, kept from idling; the rest on the others")
    parser.add_argument("--schedulers", type=int, help="schedulers of the model, each leasing a shard (default 1)")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results, or .../quick)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    overrides = {}
    if args.profiles:
        overrides["profiles"] = tuple(args.profiles.split(","))
    if args.fleets:
        overrides["fleets"] = tuple(int(value) for value in args.fleets.split(","))
    if args.seconds:
        overrides["seconds"] = args.seconds
    if args.pipeline_depth:
        overrides["pipeline_depth"] = args.pipeline_depth
    if args.answer_every:
        overrides["answer_every"] = args.answer_every
    if args.scheduler_steps:
        overrides["scheduler_steps"] = args.scheduler_steps
    if args.scheduler_plan_ms:
        overrides["scheduler_plan_ms"] = args.scheduler_plan_ms
    if args.scheduler_token_entries:
        overrides["scheduler_token_entries"] = True
    if args.scheduler_cpus:
        overrides["scheduler_cpus"] = args.scheduler_cpus
    if args.schedulers:
        overrides["schedulers"] = args.schedulers
    if overrides:
        sizes = Sizes(**{**asdict(sizes), **overrides})
    out_dir = (args.out or (RESULTS / "quick" if args.quick else RESULTS)).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: every system started is stopped
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(run(sizes, out_dir, args.seed, http=not args.no_http, quick=args.quick))
    print((out_dir / "control_plane.md").read_text())


if __name__ == "__main__":
    main()
