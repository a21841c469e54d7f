"""The experiments of benchmarks/results/, in one command:

    iterserve bench experiments            full run (sized for about 20 minutes on a quiet 2-core machine)
    iterserve bench experiments --quick    everything at toy size (under 3 minutes), into benchmarks/results/quick/
    python benchmarks/experiments.py ...   the same

1. Orca against request-level batching: `--policy iteration` and `--policy request`, same engine,
   workload and machine, swept over arrival rates; median normalized latency against throughput,
   and the throughput ratio at equal median normalized latency. Two request-level baselines:
   Orca's (a batch's results return when the whole batch is done, `--request-results batch`) and
   a stronger one that streams each token as it comes (`--request-results stream`).
2. Serving overhead: throughput of the whole system at saturation over the engine alone running
   the same workload's batches back to back in one process; where the rest goes.
3. Horizontal scaling: 1 worker against 2 (threads per worker = cores / workers).
4. Cancellation under load: survivors' throughput and latency when 30% are cancelled half-way.

Arrival rates are fractions of the capacity measured first (the saturation run of experiment 2),
so the sweep fits whatever machine runs it. Each system is a real `iterserve up` (its own Redis,
gateway, scheduler, workers) on a free port, stopped and reaped after its experiments.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from services.bench import plots
from services.bench.overhead import microbenchmarks, read_iterations, timeline
from services.bench.runner import BenchConfig, finite, machine_info, run_benchmark
from services.bench.server import REPO, ServerProcess
from services.bench.workloads import BenchRequest, PromptSource, WorkloadConfig, build_requests
from shared.tokenizer import Tokenizer

RESULTS = REPO / "benchmarks" / "results"
REPLAY_TIMEOUT_SECONDS = 1200
SATURATED = 0.8  # a run that served less than this share of its offered rate was saturated
# Experiment 1's systems: curve name -> (policy, more `iterserve up` options). "request" is Orca's baseline.
ORCA_SYSTEMS = {
    "iteration": ("iteration", ()),
    "request": ("request", ("--request-results", "batch")),
    "request-stream": ("request", ("--request-results", "stream")),
}
BASELINES = ("request", "request-stream")
ITERATION_RECORDS_KEPT = 500_000  # more than a run makes: the overhead timeline reads them all


@dataclass(frozen=True)
class Sizes:
    name: str
    workload: WorkloadConfig
    saturation_requests: int  # experiments 2 and 3: all sent at once
    rate_fractions: tuple[float, ...]  # experiment 1: arrival rates as fractions of the measured capacity
    point_seconds: float  # experiment 1: requests per point = rate x this, clamped to point_requests
    point_requests: tuple[int, int]
    load_fraction: float  # experiments 3 and 4: open-loop rate as a fraction of capacity
    load_requests: int
    kv_blocks: int
    ttft_slo: float  # goodput targets, seconds (CPU-sized)
    tpot_slo: float
    note: str


FULL = Sizes(
    name="full", workload=WorkloadConfig("orca"), saturation_requests=48,
    rate_fractions=(0.25, 0.5, 0.75, 0.9, 1.1, 1.4), point_seconds=45, point_requests=(20, 64),
    load_fraction=0.8, load_requests=40, kv_blocks=2048, ttft_slo=2.0, tpot_slo=0.25,
    note="Orca's length distributions; 20 to 64 requests per rate point (about 45 s each) instead of "
         "Orca's thousands, to fit 2 CPU cores.",
)
QUICK = Sizes(
    name="quick", workload=WorkloadConfig("orca", input_range=(32, 96), output_range=(1, 24)), saturation_requests=10,
    rate_fractions=(0.5, 1.2), point_seconds=5, point_requests=(5, 8),
    load_fraction=0.8, load_requests=8, kv_blocks=512, ttft_slo=2.0, tpot_slo=0.25,
    note="toy size: Orca's workload scaled down (input 32-96, output 1-24 tokens), 5 to 10 requests per run; "
         "checks that everything works end to end, not a measurement.",
)


def log(message: str) -> None:
    print(f"experiments: {message}", file=sys.stderr, flush=True)


class Experiments:
    def __init__(self, sizes: Sizes, out_dir: Path, seed: int) -> None:
        self.sizes, self.out_dir, self.seed = sizes, out_dir, seed
        self.tokenizer = Tokenizer.load()
        self.source = PromptSource(self.tokenizer)
        self.results: dict = {
            "sizes": {**asdict(sizes), "workload": sizes.workload.describe()},
            "machine": machine_info(),
            "seed": seed,
            "command": "iterserve bench experiments" + (" --quick" if sizes.name == "quick" else ""),
            "load_average_at_start": _load_average(),
        }
        self.capacity = 0.0  # requests/s of one iteration-level worker at saturation
        self.started = time.monotonic()

    # Runs

    def requests(self, count: int) -> list[BenchRequest]:
        return build_requests(self.sizes.workload, count, self.seed, self.source)

    def bench(self, server: ServerProcess, label: str, count: int, rate: float = math.inf,
              cancel_fraction: float = 0.0) -> dict:
        config = BenchConfig(url=server.url, workload=self.sizes.workload, num_requests=count, rate=rate,
                             seed=self.seed, ttft_slo=self.sizes.ttft_slo, tpot_slo=self.sizes.tpot_slo,
                             cancel_fraction=cancel_fraction, warmup=0, label=label,
                             max_duration=min(3600.0, max(600.0, 20 * count / max(self.capacity, 0.01))))
        requests = self.requests(count)
        cpu_before, client_before = server.cpu_seconds(), os.times()
        report = asyncio.run(run_benchmark(config, requests))
        client_after, cpu_after = os.times(), server.cpu_seconds()
        report["cpu_seconds"] = {name: cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0) for name in cpu_after}
        report["cpu_seconds"]["bench client"] = (client_after.user + client_after.system
                                                 - client_before.user - client_before.system)
        report["system"] = server.describe()
        report["requests"] = [_compact(record) for record in report["requests"]]
        summary = report["summary"]
        log(f"{label}: {summary['completed']}/{summary['requests']} done, {summary['request_throughput']:.3f} req/s, "
            f"{summary['output_token_throughput']:.1f} tok/s, p50 normalized latency "
            f"{summary['normalized_latency_ms_per_token']['p50']:.0f} ms/token")
        if not server.wait_idle(timeout=300):
            log(f"{label}: the system did not drain within 300 s")
        return report

    @contextlib.contextmanager
    def system(self, name: str, workers: int) -> Iterator[ServerProcess]:
        """A running, warmed-up `iterserve up` with ORCA_SYSTEMS[name]'s options; stopped and reaped
        on the way out, whatever happens."""
        policy, options = ORCA_SYSTEMS[name]
        described = " ".join(("--policy", policy, *options, "--workers", str(workers)))
        log(f"starting iterserve up {described}")
        # The timelines are read from the iteration records: keep all of a run's.
        env = {"ITERSERVE_ITERATION_RECORDS": str(ITERATION_RECORDS_KEPT)}
        with ServerProcess(policy=policy, workers=workers, kv_blocks=self.sizes.kv_blocks, extra_args=options,
                           env=env) as server:
            self._warm_up(server, workers)
            yield server
        log(f"stopped iterserve up {described}")

    def _warm_up(self, server: ServerProcess, workers: int) -> None:
        # Every worker's first steps (allocation, kernel choice) happen here, uncounted: short requests
        # sent at once, so they spread over the workers.
        tiny = WorkloadConfig("orca", input_range=(16, 64), output_range=(4, 8))
        warm = BenchConfig(url=server.url, workload=tiny, num_requests=2 * workers, seed=self.seed + 1, warmup=0,
                           progress=False)
        asyncio.run(run_benchmark(warm))
        server.wait_idle(timeout=120)

    def rate_point_requests(self, rate: float) -> int:
        low, high = self.sizes.point_requests
        return max(low, min(high, round(rate * self.sizes.point_seconds)))

    # The experiments, grouped by the system they need

    def run(self) -> None:
        try:
            with self.system("iteration", 1) as server:
                self.saturation(server)
                self.engine_alone()  # now, while the system idles: the machine as it was a moment ago
                self.sweep(server, "iteration")
                self.cancellation(server)
            for baseline in BASELINES:
                with self.system(baseline, 1) as server:
                    self.sweep(server, baseline)
            with self.system("iteration", 2) as server:
                self.scaling(server)
        finally:
            self.write()

    def saturation(self, server: ServerProcess) -> None:
        """Experiment 2's system run (also experiment 3's one-worker saturation run): all at once."""
        report = self.bench(server, "saturation, 1 worker", self.sizes.saturation_requests)
        self.capacity = report["summary"]["request_throughput"]
        rows = read_iterations(server.redis_url, report["started_at_unix"], report["finished_at_unix"])
        split = timeline(rows)
        self.results["overhead"] = {
            "system_run": report,
            "timeline": split,
            "microbenchmarks": microbenchmarks(self.tokenizer, round(split["mean_batch_size"]), server.redis_url),
        }
        self.results["capacity_requests_per_s"] = self.capacity
        log(f"capacity of one worker: {self.capacity:.3f} req/s")
        self.write()

    def sweep(self, server: ServerProcess, policy: str) -> None:
        """Rising arrival rates until the policy saturates: past that point only queues grow (the
        curve goes straight up), so two saturated points in a row show it (one could be noise) and
        more would only take time."""
        points = []
        for fraction in self.sizes.rate_fractions:
            rate = fraction * self.capacity
            report = self.bench(server, f"{policy} at {rate:.3g} req/s", self.rate_point_requests(rate), rate=rate)
            points.append(rate_point(report, rate))
            self.results.setdefault("orca_vs_request", {})[policy] = points
            self.write()
            if len(points) >= 2 and all(point["request_throughput"] < SATURATED * point["rate"] for point in points[-2:]):
                log(f"{policy}: saturated at {rate:.3g} req/s offered ({points[-1]['request_throughput']:.3g} served)")
                break

    def cancellation(self, server: ServerProcess) -> None:
        rate = self.sizes.load_fraction * self.capacity
        runs = {}
        for fraction in (0.0, 0.3):
            label = f"{fraction:.0%} cancelled at {rate:.3g} req/s"
            runs[f"{fraction:.1f}"] = self.bench(server, label, self.sizes.load_requests, rate=rate,
                                                 cancel_fraction=fraction)
        self.results["cancellation"] = {"rate": rate, "runs": runs}
        self.write()

    def scaling(self, server: ServerProcess) -> None:
        rate = self.sizes.load_fraction * self.capacity
        self.results["scaling"] = {
            "rate": rate,
            "one_worker": {"saturation": self.results["overhead"]["system_run"],
                           "at_rate": self.results["cancellation"]["runs"]["0.0"]},
            "two_workers": {"saturation": self.bench(server, "saturation, 2 workers", self.sizes.saturation_requests),
                            "at_rate": self.bench(server, f"2 workers at {rate:.3g} req/s", self.sizes.load_requests,
                                                  rate=rate)},
        }
        self.write()

    def engine_alone(self) -> None:
        log("engine alone: replaying the saturation workload in one process")
        spec = {"workload": asdict(self.sizes.workload), "num_requests": self.sizes.saturation_requests,
                "seed": self.seed, "kv_blocks": self.sizes.kv_blocks, "policy": "iteration"}
        with tempfile.TemporaryDirectory(prefix="iterserve-replay-") as folder:
            output = Path(folder) / "replay.json"
            command = [sys.executable, "-m", "services.bench.engine_replay", "--spec", json.dumps(spec),
                       "--output", str(output)]
            completed = subprocess.run(command, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                       timeout=REPLAY_TIMEOUT_SECONDS)
            if completed.returncode != 0:
                raise RuntimeError(f"engine replay failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
            self.results["overhead"]["engine_alone"] = json.loads(output.read_text())
        self.write()

    # Output

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = time.monotonic() - self.started
        self.results["load_average_at_end"] = _load_average()
        (self.out_dir / "experiments.json").write_text(
            json.dumps({"executor": "engine", **finite(self.results)}, indent=1, default=str, allow_nan=False) + "\n")
        report = render(self.results, self.out_dir)
        (self.out_dir / "experiments.md").write_text(report)


def _load_average() -> float | None:
    """The 1-minute load average: other work on the machine skews every number here."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _compact(record: dict) -> dict:
    """A request's record without its chunk times (the summaries keep the distributions)."""
    compact = {key: value for key, value in record.items() if key != "chunk_times"}
    compact["chunks"] = len(record.get("chunk_times", ()))
    return compact


def rate_point(report: dict, rate: float) -> dict:
    """One offered rate's figures, from its bench report (a point of a policy's frontier)."""
    summary = report["summary"]
    return {
        "rate": rate,
        "requests": summary["requests"],
        "completed": summary["completed"],
        "request_throughput": summary["request_throughput"],
        "output_token_throughput": summary["output_token_throughput"],
        "normalized_latency_p50_ms": summary["normalized_latency_ms_per_token"]["p50"],
        "normalized_latency_mean_ms": summary["normalized_latency_ms_per_token"]["mean"],
        "normalized_latency_p99_ms": summary["normalized_latency_ms_per_token"]["p99"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
        "e2e_p50_s": summary["e2e_s"]["p50"],
        "e2e_p99_s": summary["e2e_s"]["p99"],
        "goodput": summary["goodput"],
        "report": report,
    }


# Throughput at equal latency

def throughput_at_latency(points: list[dict], latency: float) -> tuple[float | None, bool]:
    """Highest throughput the policy reached with median normalized latency <= latency, interpolated
    linearly between measured points; (None, _) when even its lowest latency is higher. The flag is
    True when `latency` lies beyond the policy's highest measured one (the value is a lower bound)."""
    measured = sorted((point["normalized_latency_p50_ms"], point["request_throughput"]) for point in points
                      if math.isfinite(point["normalized_latency_p50_ms"]))
    frontier: list[tuple[float, float]] = []
    for point_latency, throughput in measured:
        best = max(throughput, frontier[-1][1]) if frontier else throughput
        frontier.append((point_latency, best))
    if not frontier or latency < frontier[0][0]:
        return None, False
    if latency >= frontier[-1][0]:
        return frontier[-1][1], latency > frontier[-1][0]
    for (low_latency, low_throughput), (high_latency, high_throughput) in zip(frontier, frontier[1:]):
        if low_latency <= latency <= high_latency:
            if high_latency == low_latency:
                return high_throughput, False
            share = (latency - low_latency) / (high_latency - low_latency)
            return low_throughput + share * (high_throughput - low_throughput), False
    return frontier[-1][1], False


def throughput_ratios(iteration: list[dict], request: list[dict]) -> list[dict]:
    """iteration / request throughput at each median normalized latency the request policy reached."""
    rows = []
    for point in sorted(request, key=lambda point: point["rate"]):
        latency = point["normalized_latency_p50_ms"]
        iteration_throughput, lower_bound = throughput_at_latency(iteration, latency)
        request_throughput, _ = throughput_at_latency(request, latency)
        if iteration_throughput is None or not request_throughput:
            continue
        rows.append({"rate": point["rate"], "latency_ms": latency, "iteration": iteration_throughput,
                     "request": request_throughput,
                     "ratio": iteration_throughput / request_throughput, "lower_bound": lower_bound})
    return rows


def headline_ratio(rows: list[dict]) -> dict | None:
    """At the request policy's most loaded point (its highest offered rate): the figure Orca reports."""
    return max(rows, key=lambda row: row["rate"]) if rows else None


# Markdown

def figure(value, digits: int = 1) -> str:
    """A number as the reports print it: `digits` decimals, "-" for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def machine_line(results: dict) -> str:
    machine = results["machine"]
    return f"{machine['cpu']}, {machine['cores']} cores, {machine['platform']}, Python {machine['python']}"


def render(results: dict, out_dir: Path) -> str:
    sizes = results["sizes"]
    lines = [f"# iterserve experiments ({sizes['name']}; executor: engine, SmolLM2-135M on the CPU)", "",
             f"Machine: {machine_line(results)}. Model: SmolLM2-135M-Instruct, float32 on CPU.", "",
             f"Command: `{results['command']}`. Workload: {sizes['workload']}, forced output lengths "
             f"(`max_tokens` + `ignore_eos`), seed {results['seed']}. {sizes['note']}", "",
             f"Capacity of one worker at saturation (sets the arrival rates): "
             f"{figure(results.get('capacity_requests_per_s'), 3)} req/s. Total time {results.get('elapsed_s', 0) / 60:.1f} min.",
             "",
             f"Load average (1 min) at the start and end: {figure(results.get('load_average_at_start'), 2)} and "
             f"{figure(results.get('load_average_at_end'), 2)}: well above 0 means other work shared the cores, and "
             f"every number below is skewed by it.", ""]
    lines += render_orca(results, out_dir)
    lines += render_overhead(results, out_dir)
    lines += render_scaling(results, out_dir)
    lines += render_cancellation(results, out_dir)
    return "\n".join(lines) + "\n"


def orca_table(curves: dict) -> list[str]:
    lines = ["| policy | rate (req/s) | requests | throughput (req/s) | output tok/s | normalized latency p50 / mean / p99 "
             "(ms/token) | TTFT p50 (ms) | TPOT p50 (ms) | e2e p50 / p99 (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for policy in ORCA_SYSTEMS:
        for point in curves.get(policy, []):
            lines.append(
                f"| {policy} | {point['rate']:.3g} | {point['completed']}/{point['requests']} | "
                f"{point['request_throughput']:.3f} | {point['output_token_throughput']:.1f} | "
                f"{figure(point['normalized_latency_p50_ms'], 0)} / {figure(point['normalized_latency_mean_ms'], 0)} / "
                f"{figure(point['normalized_latency_p99_ms'], 0)} | {figure(point['ttft_p50_ms'], 0)} | "
                f"{figure(point['tpot_p50_ms'], 0)} | {figure(point['e2e_p50_s'], 2)} / {figure(point['e2e_p99_s'], 2)} |")
    return lines


def render_orca(results: dict, out_dir: Path) -> list[str]:
    curves = results.get("orca_vs_request")
    if not curves:
        return []
    lines = ["## 1. Orca (iteration-level) against request-level batching", "",
             "Same engine, workload, seeds and machine; `--policy iteration` against `--policy request`; "
             "Poisson arrivals. Two request-level baselines: `request` is Orca's (section 2.2: the engine returns "
             "a batch's results when the whole batch is done, so early-finished requests cannot return; "
             "`--request-results batch`), `request-stream` streams every token as it is sampled "
             "(`--request-results stream`: early-finished requests return at once, a stronger baseline). "
             "Both admit nothing into a running batch.", ""]
    if plots.available():
        path = out_dir / "orca_vs_request.png"
        plots.latency_vs_throughput(curves, path, f"SmolLM2-135M on {results['machine']['cores']} CPU cores: "
                                                  "median normalized latency vs throughput")
        lines += [f"![normalized latency against throughput]({path.name})", ""]
    lines += orca_table(curves) + [""]
    results["orca_headline"] = {}
    for baseline in BASELINES:
        rows = throughput_ratios(curves.get("iteration", []), curves.get(baseline, []))
        if not rows:
            continue
        lines += [f"Against `{baseline}`: throughput at equal median normalized latency (highest throughput each "
                  "policy reached at or below that latency, interpolated between measured points; ≥: the "
                  "iteration-level policy was not pushed that far, so its figure is a lower bound):", "",
                  f"| median normalized latency (ms/token) | iteration req/s | {baseline} req/s | ratio |",
                  "|---|---|---|---|"]
        for row in rows:
            bound = "≥ " if row["lower_bound"] else ""
            lines.append(f"| {row['latency_ms']:.0f} | {bound}{row['iteration']:.3f} | {row['request']:.3f} | "
                         f"{bound}{row['ratio']:.2f}x |")
        best = headline_ratio(rows)
        results["orca_headline"][baseline] = best
        lines += ["", f"At the median normalized latency of `{baseline}`'s most loaded point "
                      f"({best['rate']:.3g} req/s offered, {best['latency_ms']:.0f} ms/token), the iteration-level "
                      f"policy serves {'at least ' if best['lower_bound'] else ''}**{best['ratio']:.2f}x** the "
                      f"throughput; the highest ratio in the table is {max(row['ratio'] for row in rows):.2f}x.", ""]
    return lines


def render_overhead(results: dict, out_dir: Path) -> list[str]:
    overhead = results.get("overhead")
    if not overhead:
        return []
    run, split, micro = overhead["system_run"], overhead["timeline"], overhead["microbenchmarks"]
    summary = run["summary"]
    lines = ["## 2. Serving overhead", "",
             f"{summary['requests']} requests sent at once (saturation) through the whole system "
             f"({run['system']}), against the engine alone replaying the same workload in one process: "
             "the same scheduler policy forms the batches, the engine runs them back to back, no Redis, no HTTP, "
             "no detokenization.", ""]
    alone = overhead.get("engine_alone")
    system_tps = summary["output_token_throughput"]
    if alone:
        lines += ["| | output tok/s | iterations | mean batch | mean step (ms) |", "|---|---|---|---|---|",
                  f"| whole system (client-side, first request sent to last token) | {system_tps:.1f} | "
                  f"{split['iterations']} | {split['mean_batch_size']:.1f} | {split['engine_ms_per_iteration']:.1f} |",
                  f"| engine alone: steps only | {alone['output_token_throughput_engine']:.1f} | {alone['iterations']} | "
                  f"{alone['mean_batch_size']:.1f} | {alone['mean_step_ms']:.1f} |",
                  f"| engine alone + in-process scheduling | {alone['output_token_throughput_replay']:.1f} | | | |", "",
                  f"**System / engine alone: {system_tps / alone['output_token_throughput_engine']:.2f}** "
                  f"({system_tps / alone['output_token_throughput_replay']:.2f} against engine + in-process scheduling).",
                  ""]
    duration = summary["duration_s"]
    edges = max(0.0, duration - split["window_s"] / max(split["workers"], 1))
    engine_alone_s = (alone["step_s"] * summary["output_tokens"] / max(alone["output_tokens"], 1)) if alone else None
    parts = [("engine steps", split["engine_s"]),
             ("plan in flight outside the engine (Redis round trips, (de)serialization, thread hop)", split["transport_s"]),
             ("scheduler between iterations (tokens, detokenization, token events, next plan)", split["scheduler_s"]),
             ("edges: HTTP, gateway, first and last Redis hops", edges)]
    lines += ["Where the system run's time goes (the worker's timeline from the scheduler's iteration records and "
              "the worker's step times in Redis):", "",
              "| part | seconds | share | per iteration (ms) |", "|---|---|---|---|"]
    for name, seconds in parts:
        per_iteration = 1000 * seconds / max(split["iterations"], 1)
        lines.append(f"| {name} | {seconds:.2f} | {100 * seconds / duration:.0f}% | {per_iteration:.2f} |")
    if engine_alone_s is not None:
        lines += ["", f"The engine alone would take about {engine_alone_s:.2f} s for the same output: inside the "
                      f"system its steps took {split['engine_s'] / max(engine_alone_s, 1e-9):.2f}x that (the gateway, "
                      "scheduler, Redis and this load generator share the cores with the worker's torch threads; the "
                      "batches differ a little, as requests reach the scheduler one by one)."]
    lines += ["", f"Measured costs of the pieces, per iteration at a decode batch of {micro['batch_size']}:", "",
              "| piece | ms per iteration |", "|---|---|",
              f"| Redis round trip (PING, median; an iteration has two stream hops) | {figure(micro.get('redis_ping_ms'), 3)} |",
              f"| plan + result msgpack/pydantic encode + decode ({micro['plan_bytes']} + {micro['result_bytes']} bytes) "
              f"| {micro['serialization_ms']:.3f} |",
              f"| detokenization ({micro['batch_size']} tokens) | {micro['detokenization_ms']:.3f} |",
              f"| token events encode ({micro['batch_size']} tokens) | {micro['token_events_ms']:.3f} |"]
    if alone:
        lines.append(f"| scheduling policy (next plan + results, measured in the replay) | "
                     f"{alone['scheduling_ms_per_iteration']:.3f} |")
    cpu = run.get("cpu_seconds", {})
    if cpu:
        lines += ["", f"CPU seconds used during the run ({duration:.1f} s wall, "
                      f"{results['machine']['cores']} cores = {duration * results['machine']['cores']:.0f} CPU s):", "",
                  "| process | CPU s | share of the machine |", "|---|---|---|"]
        for name, seconds in sorted(cpu.items(), key=lambda item: -item[1]):
            lines.append(f"| {name} | {seconds:.1f} | {100 * seconds / (duration * results['machine']['cores']):.0f}% |")
    if plots.available():
        path = out_dir / "overhead.png"
        plots.stacked_bar({name.split(" (")[0]: seconds for name, seconds in parts}, path,
                          f"Where the saturation run's {duration:.1f} s go (1 worker)", "seconds")
        lines += ["", f"![where the time goes]({path.name})"]
    return lines + [""]


def render_scaling(results: dict, out_dir: Path) -> list[str]:
    scaling = results.get("scaling")
    if not scaling:
        return []
    cores = results["machine"]["cores"]
    lines = ["## 3. Horizontal scaling: 1 worker against 2", "",
             f"Same workload; threads per worker = cores / workers ({cores} and {max(1, cores // 2)}).", "",
             "| workers | saturation req/s | saturation output tok/s | at rate: req/s | TTFT p50 (ms) | TPOT p50 (ms) | "
             "normalized latency p50 (ms/token) | e2e p99 (s) |", "|---|---|---|---|---|---|---|---|"]
    values = {}
    for key, workers in (("one_worker", 1), ("two_workers", 2)):
        saturation, at_rate = scaling[key]["saturation"]["summary"], scaling[key]["at_rate"]["summary"]
        values[workers] = saturation["request_throughput"]
        lines.append(f"| {workers} | {saturation['request_throughput']:.3f} | {saturation['output_token_throughput']:.1f} | "
                     f"{at_rate['request_throughput']:.3f} | {figure(at_rate['ttft_ms']['p50'], 0)} | "
                     f"{figure(at_rate['tpot_ms']['p50'], 0)} | {figure(at_rate['normalized_latency_ms_per_token']['p50'], 0)} | "
                     f"{figure(at_rate['e2e_s']['p99'], 2)} |")
    lines += ["", f"Rate runs at {scaling['rate']:.3g} req/s (Poisson). Saturation throughput, 2 workers / 1: "
                  f"**{values[2] / max(values[1], 1e-9):.2f}x**."]
    if plots.available():
        path = out_dir / "scaling.png"
        plots.bars(["1 worker", "2 workers"], {"saturation req/s": [values[1], values[2]]}, path,
                   f"Horizontal scaling on {cores} CPU cores", "requests/s")
        lines += ["", f"![scaling]({path.name})"]
    return lines + [""]


def render_cancellation(results: dict, out_dir: Path) -> list[str]:
    cancellation = results.get("cancellation")
    if not cancellation:
        return []
    lines = ["## 4. Cancellation under load", "",
             f"The same arrivals ({cancellation['rate']:.3g} req/s, Poisson) with none, then 30%, of the requests "
             "cancelled half-way through their output (the client closes the stream; the gateway cancels the "
             "request and the scheduler evicts it at the next iteration). Latencies are the survivors'.", "",
             "| cancelled | completed | survivors req/s | survivors output tok/s | tok/s streamed (all) | TTFT p50 / p99 (ms) "
             "| TPOT p50 (ms) | e2e p50 / p99 (s) | normalized latency p50 (ms/token) |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = {}
    for key, run in cancellation["runs"].items():
        summary = run["summary"]
        rows[key] = summary
        lines.append(f"| {float(key):.0%} ({summary['cancelled']} of {summary['requests']}) | {summary['completed']} | "
                     f"{summary['request_throughput']:.3f} | {summary['output_token_throughput']:.1f} | "
                     f"{summary['delivered_token_throughput']:.1f} | {figure(summary['ttft_ms']['p50'], 0)} / "
                     f"{figure(summary['ttft_ms']['p99'], 0)} | {figure(summary['tpot_ms']['p50'], 0)} | "
                     f"{figure(summary['e2e_s']['p50'], 2)} / {figure(summary['e2e_s']['p99'], 2)} | "
                     f"{figure(summary['normalized_latency_ms_per_token']['p50'], 0)} |")
    if plots.available() and len(rows) == 2:
        path = out_dir / "cancellation.png"
        keys = sorted(rows)
        plots.bars(["TTFT p50 (s)", "e2e p50 (s)", "e2e p99 (s)"],
                   {f"{float(key):.0%} cancelled": [rows[key]["ttft_ms"]["p50"] / 1000, rows[key]["e2e_s"]["p50"],
                                                   rows[key]["e2e_s"]["p99"]] for key in keys},
                   path, "Survivors' latency with and without 30% cancelled half-way", "seconds")
        lines += ["", f"![cancellation]({path.name})"]
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "control-plane":
        from services.bench.control_plane import main as control_plane_main

        control_plane_main(argv[1:])
        return
    if argv and argv[0] == "orca-emulated":
        from services.bench.orca_emulated import main as orca_emulated_main

        orca_emulated_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="iterserve bench experiments", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes (about 3 minutes), into benchmarks/results/quick/")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results, or .../quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--saturation-requests", type=int, help="override the size of the saturation runs")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.saturation_requests:
        sizes = replace(sizes, saturation_requests=args.saturation_requests)
    out_dir = (args.out or (RESULTS / "quick" if args.quick else RESULTS)).resolve()
    # SIGTERM unwinds like Ctrl-C, so every system started so far is stopped and reaped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    experiments = Experiments(sizes, out_dir, args.seed)
    experiments.run()
    log(f"done in {(time.monotonic() - experiments.started) / 60:.1f} min: {out_dir}/experiments.md")
    print((out_dir / "experiments.md").read_text())


if __name__ == "__main__":
    main()
