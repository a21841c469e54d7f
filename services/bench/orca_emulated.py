"""Orca's experiment at GPU cost (`iterserve bench experiments orca-emulated`). EMULATED.

The CPU sweep (experiment 1 of `iterserve bench experiments`) cannot show Orca's result: on 2 CPU
cores prefill is half the engine's time and a 64-request decode step costs 4-5x one request's. Here
the worker is `--executor emulated --hardware a100-gpt3-13b`: a GPT-3 13B-like model on one A100
(Orca's setting), each step taking the time the profile's roofline gives, so decode is memory-bound
and a batch costs about what one request does. Everything else is real: the gateway, Redis, the
scheduler's policies, the HTTP streaming clients.

- Orca's workload: input 32-512 tokens and output 1-128, uniform; Poisson arrivals.
- Two systems up at once, each its own `iterserve up` with one emulated worker: iteration-level
  (Orca) and request-level with results at batch end (Orca's baseline, `--request-results batch`).
- Rates are fractions of the iteration-level system's capacity (a saturation run first); at each
  rate point both policies run, one after the other, the first of them alternating from point to
  point (interleaved: machine noise falls on both curves alike); every seed repeats the sweep
  with other requests and arrivals.
- At each point: throughput, median normalized latency (end-to-end / output tokens, Orca's
  metric) and goodput (requests/s meeting a TTFT and a TPOT target); then the throughput ratio at
  equal median normalized latency, per seed.
"""

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.bench import plots
from services.bench.experiments import figure, headline_ratio, rate_point, throughput_ratios
from services.bench.runner import BenchConfig, finite, machine_info, run_benchmark
from services.bench.server import REPO, ServerProcess
from services.bench.workloads import PromptSource, WorkloadConfig, build_requests
from shared.tokenizer import Tokenizer

RESULTS = REPO / "benchmarks" / "results"
SYSTEMS = {"iteration": ("iteration", ()), "request": ("request", ("--request-results", "batch"))}


@dataclass(frozen=True)
class Sizes:
    profile: str = "a100-gpt3-13b"
    max_batch_size: int = 16  # both policies alike (Orca's evaluation runs batches of 8-32 on one GPU)
    input_range: tuple[int, int] = (32, 512)
    output_range: tuple[int, int] = (1, 128)
    capacity_requests: int = 200
    rate_fractions: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2)
    point_requests: int = 200
    seeds: tuple[int, ...] = (0, 1)
    ttft_slo: float = 1.0  # seconds: goodput targets sized for an interactive GPU service
    tpot_slo: float = 0.1
    kv_blocks: int = 8192


FULL = Sizes()
QUICK = Sizes(capacity_requests=24, rate_fractions=(0.5, 1.0), point_requests=16, seeds=(0,), output_range=(1, 32))


def log(message: str) -> None:
    print(f"[orca-emulated] {message}", file=sys.stderr, flush=True)


class Sweep:
    def __init__(self, sizes: Sizes, out_dir: Path, quick: bool) -> None:
        self.sizes, self.out_dir, self.quick = sizes, out_dir, quick
        self.workload = WorkloadConfig("orca", input_range=sizes.input_range, output_range=sizes.output_range)
        self.source = PromptSource(Tokenizer.load())
        self.started = time.monotonic()
        self.results: dict = {"executor": "emulated", "profile": sizes.profile, "sizes": asdict(sizes),
                              "workload": self.workload.describe(), "machine": machine_info(),
                              "command": "iterserve bench experiments orca-emulated" + (" --quick" if quick else ""),
                              "seeds": {}}

    def bench(self, server: ServerProcess, label: str, count: int, seed: int, rate: float = math.inf) -> dict:
        requests = build_requests(self.workload, count, seed, self.source)
        config = BenchConfig(url=server.url, workload=self.workload, num_requests=count, rate=rate, seed=seed,
                             ttft_slo=self.sizes.ttft_slo, tpot_slo=self.sizes.tpot_slo, label=label,
                             progress=False, max_duration=1800.0)
        report = asyncio.run(run_benchmark(config, requests))
        summary = report["summary"]
        log(f"{label}: {summary['completed']}/{summary['requests']} done, {summary['request_throughput']:.2f} req/s, "
            f"p50 normalized latency {summary['normalized_latency_ms_per_token']['p50']:.1f} ms/token, "
            f"goodput {summary['goodput']:.2f} req/s")
        server.wait_idle(timeout=300)
        return report

    def run(self, systems: dict[str, ServerProcess]) -> None:
        capacity_report = self.bench(systems["iteration"], "capacity (iteration, all at once)",
                                     self.sizes.capacity_requests, seed=1000)
        summary = capacity_report["summary"]
        if summary["completed"] < summary["requests"]:
            raise RuntimeError(f"capacity run: {summary['requests'] - summary['completed']} requests failed: "
                               f"{summary.get('errors')}")
        capacity = summary["request_throughput"]
        self.results["capacity_requests_per_s"] = capacity
        log(f"capacity of the iteration-level system: {capacity:.2f} req/s (emulated {self.sizes.profile})")
        for seed in self.sizes.seeds:
            curves: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
            self.results["seeds"][str(seed)] = {"curves": curves}
            for index, fraction in enumerate(self.sizes.rate_fractions):
                rate = fraction * capacity
                order = list(SYSTEMS) if index % 2 == 0 else list(reversed(SYSTEMS))
                for name in order:
                    report = self.bench(systems[name], f"seed {seed}, {name} at {rate:.2f} req/s",
                                        self.sizes.point_requests, seed, rate)
                    report["requests"] = []  # the summary keeps the distributions
                    curves[name].append(rate_point(report, rate))
                self.write()
            rows = throughput_ratios(curves["iteration"], curves["request"])
            self.results["seeds"][str(seed)]["ratios"] = rows
            self.results["seeds"][str(seed)]["headline"] = headline_ratio(rows)
            self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results["minutes"] = (time.monotonic() - self.started) / 60
        (self.out_dir / "orca_emulated.json").write_text(json.dumps(finite(self.results), indent=1, default=str) + "\n")
        (self.out_dir / "orca_emulated.md").write_text(render(self.results, self.out_dir))


def render(results: dict, out_dir: Path) -> str:
    sizes = results["sizes"]
    lines = [f"# Orca's experiment at GPU cost (EMULATED {results['profile']})", "",
             f"`{results['command']}` on {results['machine']['cores']} cores. One worker per system, "
             f"`--executor emulated --hardware {results['profile']}` (no model runs: each step takes the profile's "
             f"roofline time, at the memory efficiency it assumes, 0.77, where the one measured fit, Llama-3.2-1B's "
             f"shape on an H200, gave 0.20); max batch {sizes['max_batch_size']} for both policies; {results['workload']}; "
             f"{sizes['point_requests']} requests per rate point, Poisson arrivals, the two policies interleaved at "
             f"each point; goodput = requests/s with TTFT ≤ {sizes['ttft_slo']:g} s and TPOT ≤ "
             f"{sizes['tpot_slo'] * 1000:g} ms. Capacity of the iteration-level system (all at once): "
             f"{figure(results.get('capacity_requests_per_s'), 2)} req/s.", ""]
    for seed, data in results["seeds"].items():
        curves = data["curves"]
        lines += [f"## Seed {seed}", ""]
        if plots.available() and all(curves.values()):
            path = out_dir / f"orca_emulated_seed{seed}.png"
            plots.latency_vs_throughput(curves, path, f"EMULATED {results['profile']}: median normalized latency "
                                                      f"vs throughput (seed {seed})")
            lines += [f"![normalized latency against throughput]({path.name})", ""]
        lines += ["| policy | rate (req/s) | completed | throughput (req/s) | output tok/s | normalized latency p50 "
                  "(ms/token) | TTFT p50 (ms) | TPOT p50 (ms) | goodput (req/s) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, points in curves.items():
            for point in points:
                lines.append(f"| {name} | {point['rate']:.2f} | {point['completed']}/{point['requests']} | "
                             f"{point['request_throughput']:.2f} | {point['output_token_throughput']:.0f} | "
                             f"{figure(point['normalized_latency_p50_ms'], 1)} | {figure(point['ttft_p50_ms'], 0)} | "
                             f"{figure(point['tpot_p50_ms'], 1)} | {figure(point['goodput'], 2)} |")
        rows = data.get("ratios") or []
        if rows:
            lines += ["", "Throughput at equal median normalized latency (≥: a lower bound, the iteration-level "
                          "policy was not pushed that far):", "",
                      "| median normalized latency (ms/token) | iteration req/s | request req/s | ratio |", "|---|---|---|---|"]
            for row in rows:
                bound = "≥ " if row["lower_bound"] else ""
                lines.append(f"| {row['latency_ms']:.1f} | {bound}{row['iteration']:.2f} | {row['request']:.2f} | "
                             f"{bound}{row['ratio']:.2f}x |")
            best = data.get("headline")
            if best:
                lines += ["", f"At request-level's most loaded point ({best['rate']:.2f} req/s offered, "
                              f"{best['latency_ms']:.1f} ms/token): iteration-level serves "
                              f"{'at least ' if best['lower_bound'] else ''}**{best['ratio']:.2f}x** the throughput; "
                              f"highest ratio {max(row['ratio'] for row in rows):.2f}x."]
        lines.append("")
    return "\n".join(lines)


@contextlib.contextmanager
def systems(sizes: Sizes):
    """Both systems up at once (an idle emulated system costs little), stopped and reaped after."""
    with contextlib.ExitStack() as stack:
        started = {}
        for name, (policy, options) in SYSTEMS.items():
            log(f"starting iterserve up --policy {policy} {' '.join(options)} (emulated {sizes.profile})")
            started[name] = stack.enter_context(ServerProcess(
                policy=policy, workers=1, kv_blocks=sizes.kv_blocks,
                extra_args=(*options, "--executor", "emulated", "--hardware", sizes.profile,
                            "--max-batch-size", str(sizes.max_batch_size)),
                # One client sends every request: the per-key stream limit (128) would refuse the
                # queue a saturated policy builds up, and refused requests would leave its latencies.
                env={"ITERSERVE_MAX_STREAMS_PER_KEY": "100000"}))
        yield started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="iterserve bench experiments orca-emulated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy size: checks it works, measures nothing")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results, or .../quick)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    out_dir = (args.out or (RESULTS / "quick" if args.quick else RESULTS)).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: both systems are stopped
    sweep = Sweep(sizes, out_dir, args.quick)
    with systems(sizes) as started:
        sweep.run(started)
    sweep.write()
    print((out_dir / "orca_emulated.md").read_text())


if __name__ == "__main__":
    main()
