"""Prefix caching and cache-aware placement, side by side in one run, through the whole system.

    .venv/bin/python benchmarks/prefix_cache.py [--conversations 8] [--turns 8] [--quick]
    .venv/bin/python benchmarks/prefix_cache.py --by-turns 2,3,4,8
    .venv/bin/python benchmarks/prefix_cache.py --by-turns 3,4,8 --think-time 10 --concurrency 24 \\
        --conversations 32 --turns 4

Each configuration is `iterserve up` as a user runs it (real gateway, Redis, scheduler, workers
and model), driven by `iterserve bench` with the same seeded workload:
1. multiturn, one worker: prefix caching on against --no-prefix-caching (time to first token of
   turns 2 and later, throughput);
2. multiturn, two workers: --placement cache-aware against least-loaded (hit rate, time to first
   token of later turns, and the largest gap in running requests between the two workers, sampled
   from /status every 0.2 s, against --placement-slack);
3. the same two-worker pair with smaller KV pools (--pressure-kv-blocks, one pair per size: 256
   blocks hold about half the conversations' histories), where what one worker caches is what the
   other does not have to (--only-pressured --rounds N: only these, N pairs per size, written to
   prefix_cache_pressured.{json,md});
4. system-prompt, one worker: caching on against off;
5. (--by-turns L1,L2,...: only these) the placement pairs (--workers 2,4: of each fleet) on
   conversations of each length, about conversations x turns turns in all per run, beside the same
   conversations on one worker (the most any placement reaches), written to
   prefix_cache_placement.{json,md}.
Writes benchmarks/results/prefix_cache.json and .md (the ratios first). This machine is shared
and noisy: the ratios are what to read, each pair measured back to back.
"""

import argparse
import asyncio
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.runner import BenchConfig, machine_info, run_benchmark  # noqa: E402
from services.bench.server import ServerProcess  # noqa: E402
from services.bench.workloads import WorkloadConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SLACK = 8  # the default --placement-slack
PLACEMENTS = ("cache-aware", "least-loaded")  # each pair: the first measured first
THINK_TIME, CONCURRENCY = 1.0, 8  # multiturn runs: mean seconds between turns, conversations at a time


class LoadGap:
    """The largest difference in running requests between workers, from /status while a run lasts."""

    def __init__(self, url: str) -> None:
        self.url, self.largest, self.samples = url, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                with urllib.request.urlopen(f"{self.url}/status", timeout=2) as response:
                    running = [worker["running"] for worker in json.loads(response.read())["workers"]]
            except (OSError, ValueError, KeyError):
                continue
            if len(running) > 1:
                self.largest = max(self.largest, max(running) - min(running))
                self.samples += 1

    def __enter__(self) -> "LoadGap":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run(label: str, workers: int, server_args: tuple[str, ...], workload: WorkloadConfig, count: int,
        concurrency: int) -> dict:
    with ServerProcess(workers=workers, extra_args=server_args) as server:
        config = BenchConfig(url=server.url, workload=workload, num_requests=count, concurrency=concurrency,
                             seed=11, warmup=1, progress=False, label=label)
        with LoadGap(server.url) as gap:
            report = asyncio.run(run_benchmark(config))
        summary = report["summary"]
    result = {
        "label": label, "workers": workers, "server_args": list(server_args), "workload": workload.describe(),
        "completed": summary["completed"], "failed": summary["failed"],
        "output_tokens_per_s": summary["output_token_throughput"],
        "hit_rate": summary["prefix_cache"]["hit_rate"] or 0.0,
        "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_later_turns_p50_ms": summary["ttft_ms_later_turns"]["p50"],
        "largest_running_gap": gap.largest if workers > 1 else None,
    }
    print(json.dumps(result), flush=True)
    return result


def save(stem: str, report: dict, lines: list[str]) -> None:
    """RESULTS/stem.json and RESULTS/stem.md, and the table on stdout."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if numerator and denominator else None


def pair_cells(pair: dict) -> str:
    """A cache-aware / least-loaded pair's table cells: hit rates and their ratio, time to first token
    of later turns and its ratio, largest load gaps."""
    aware, least = pair["cache-aware"], pair["least-loaded"]
    return (f"{100 * aware['hit_rate']:.1f}% / {100 * least['hit_rate']:.1f}% | "
            f"{ratio(aware['hit_rate'], least['hit_rate']) or 0:.2f}x | "
            f"{aware['ttft_later_turns_p50_ms']:.0f} / {least['ttft_later_turns_p50_ms']:.0f} | "
            f"{ratio(least['ttft_later_turns_p50_ms'], aware['ttft_later_turns_p50_ms']) or 0:.2f}x | "
            f"{aware['largest_running_gap']} / {least['largest_running_gap']} |")


def run_pressured(placement: str, blocks: int, workload: WorkloadConfig, conversations: int) -> dict:
    """Two workers of `blocks` KV blocks each, at concurrency 8."""
    return run(f"multiturn, 2 workers, {placement}, {blocks} KV blocks", 2,
               ("--placement", placement, "--kv-blocks", str(blocks)), workload, conversations, 8)


def write_pressured(pools: list[int], rounds: int, workload: WorkloadConfig, conversations: int,
                    started: float) -> None:
    """The two placements with small KV pools, pair after pair (so a slow spell of this shared
    machine hits both), `rounds` pairs per pool: each pair's ratios, then the ratios of the means."""
    runs = []
    for round_index in range(rounds):
        for blocks in pools:
            pair = {placement: run_pressured(placement, blocks, workload, conversations)
                    for placement in PLACEMENTS}
            runs.append({"round": round_index + 1, "kv_blocks": blocks, **pair})
    command = " ".join(["benchmarks/prefix_cache.py", *sys.argv[1:]])
    lines = ["# Cache-aware against least-loaded placement with small KV pools (executor: engine, SmolLM2-135M on "
             "the CPU)", "",
             f"`.venv/bin/python {command}` ({time.time() - started:.0f} s, CPU, SmolLM2-135M, 2 workers, "
             f"{workload.describe()}, {conversations} conversations at concurrency 8; load gap: the largest difference "
             f"in running requests between the workers, sampled every 0.2 s, against --placement-slack {SLACK})", "",
             "| KV blocks per worker | round | hit rate cache-aware / least-loaded | ratio | TTFT p50 turns 2+ ms "
             "cache-aware / least-loaded | ratio (lower) | load gap |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {pair['kv_blocks']} | {pair['round']} | {pair_cells(pair)}" for pair in runs]
    for blocks in pools:
        pairs = [pair for pair in runs if pair["kv_blocks"] == blocks]

        def mean(placement: str, field: str) -> float:
            return sum(pair[placement][field] for pair in pairs) / len(pairs)

        hits = mean("cache-aware", "hit_rate"), mean("least-loaded", "hit_rate")
        ttfts = mean("cache-aware", "ttft_later_turns_p50_ms"), mean("least-loaded", "ttft_later_turns_p50_ms")
        lines.append(f"| {blocks} | mean of {len(pairs)} | {100 * hits[0]:.1f}% / {100 * hits[1]:.1f}% | "
                     f"{hits[0] / hits[1]:.2f}x | {ttfts[0]:.0f} / {ttfts[1]:.0f} | {ttfts[1] / ttfts[0]:.2f}x | - |")
    save("prefix_cache_pressured", {"executor": "engine", "command": command, "runs": runs}, lines)


def write_turns(turn_counts: list[int], requests: int, started: float, think_time: float = THINK_TIME,
                concurrency: int = CONCURRENCY, fleets: tuple[int, ...] = (2,)) -> None:
    """The two placements (default KV pools) on conversations of each length, pair after pair, with
    about `requests` turns in all each: how the hit-rate ratio depends on how long conversations are.
    Then the same conversations on one worker: every turn goes where its history is, so its hit
    rate is the most any placement of two workers can reach while the pools hold every history
    (the default pools do), and that over least-loaded's is the largest hit-rate ratio possible.
    Longer think times (with more conversations at once to keep the load) test whether least-loaded's hits are
    more than chance's (benchmarks/placement_ceiling.py). fleets: the worker counts of the pairs."""
    runs = []
    for turns in turn_counts:
        conversations = max(1, requests // turns)
        workload = multiturn_workload(turns, think_time)
        bound = run(f"multiturn, {turns} turns, 1 worker, prefix caching", 1, (), workload, conversations,
                    concurrency)
        for workers in fleets:
            pair = {placement: run(f"multiturn, {turns} turns, {workers} workers, {placement}", workers,
                                   ("--placement", placement), workload, conversations, concurrency)
                    for placement in PLACEMENTS}
            runs.append({"turns": turns, "workers": workers, "conversations": conversations, **pair,
                         "one worker": bound})
    command = " ".join(["benchmarks/prefix_cache.py", *sys.argv[1:]])
    workload = multiturn_workload(1, think_time)
    lines = ["# Cache-aware against least-loaded placement by conversation length (executor: engine, SmolLM2-135M "
             "on the CPU)", "",
             f"`.venv/bin/python {command}` ({time.time() - started:.0f} s on {machine_info()['cpu']}, "
             f"{machine_info()['cores']} cores, executor: engine (SmolLM2-135M on the CPU), "
             f"{'/'.join(map(str, fleets))} workers, default KV "
             f"pools; each turn a new user message of {workload.input_range[0]}-{workload.input_range[1]} tokens after "
             f"{workload.think_time:g} s mean think time, answers of {workload.output_range[0]}-"
             f"{workload.output_range[1]} tokens; about {requests} turns in all per run, {concurrency} conversations "
             f"at a time; load gap: the largest difference in running requests between the workers, sampled every "
             f"0.2 s, against --placement-slack {SLACK})", "",
             "| workers | turns per conversation | conversations | hit rate cache-aware / least-loaded | ratio | TTFT p50 "
             "turns 2+ ms cache-aware / least-loaded | ratio (lower) | load gap | hit rate on one worker (the most any "
             "placement reaches) | cache-aware's distance from it (points) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {pair['workers']} | {pair['turns']} | {pair['conversations']} | {pair_cells(pair)} "
              f"{100 * pair['one worker']['hit_rate']:.1f}% | "
              f"{100 * (pair['one worker']['hit_rate'] - pair['cache-aware']['hit_rate']):.1f} |" for pair in runs]
    # (other think times or concurrencies are other experiments: they do not replace this one's file)
    stem = "prefix_cache_placement" if (think_time, concurrency) == (THINK_TIME, CONCURRENCY) else \
        f"prefix_cache_placement_think{think_time:g}s_c{concurrency}"
    save(stem, {"executor": "engine", "command": command, "think_time": think_time, "concurrency": concurrency,
                "runs": runs}, lines)


def multiturn_workload(turns: int, think_time: float = THINK_TIME) -> WorkloadConfig:
    """Every multiturn run's workload."""
    return WorkloadConfig(name="multiturn", input_range=(16, 48), output_range=(32, 96), turns=turns,
                          think_time=think_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--users", type=int, default=24, help="system-prompt workload: requests")
    parser.add_argument("--pressure-kv-blocks", default="256,160",
                        help="KV blocks per worker of the pressured two-worker pairs, one pair each (default 256,160)")
    parser.add_argument("--only-pressured", action="store_true",
                        help="run only the pressured two-worker pairs, --rounds times each, and write "
                             "prefix_cache_pressured.{json,md}")
    parser.add_argument("--rounds", type=int, default=1, help="--only-pressured: pairs per pool size")
    parser.add_argument("--by-turns", default="",
                        help="only the placement pairs on conversations of these lengths (e.g. 2,4,8), about 64 "
                             "turns in all per run, written to prefix_cache_placement.{json,md}")
    parser.add_argument("--think-time", type=float, default=THINK_TIME,
                        help=f"--by-turns: mean seconds a user pauses between an answer and the next turn "
                             f"(default {THINK_TIME:g})")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY,
                        help=f"--by-turns: conversations at a time (default {CONCURRENCY}; more keep the load with "
                             f"longer pauses)")
    parser.add_argument("--workers", default="2,4",
                        help="--by-turns: the worker counts of the placement pairs (default 2,4)")
    parser.add_argument("--quick", action="store_true", help="4 conversations of 3 turns, 8 users (a smoke run)")
    args = parser.parse_args()
    if not args.by_turns and (args.think_time, args.concurrency) != (THINK_TIME, CONCURRENCY):
        parser.error("--think-time and --concurrency shape the --by-turns runs: give --by-turns too")
    if args.quick:
        args.conversations, args.turns, args.users = 4, 3, 8
    multiturn = multiturn_workload(args.turns)
    shared = WorkloadConfig(name="system-prompt", input_range=(16, 48), output_range=(8, 24), system_prompt_tokens=384)
    pools = [int(blocks) for blocks in args.pressure_kv_blocks.split(",") if blocks]
    started = time.time()
    if args.only_pressured:
        write_pressured(pools, args.rounds, multiturn, args.conversations, started)
        return
    if args.by_turns:
        write_turns([int(turns) for turns in args.by_turns.split(",")], args.conversations * args.turns, started,
                    args.think_time, args.concurrency, tuple(int(count) for count in args.workers.split(",")))
        return
    runs = {}
    for blocks in pools:
        for placement in PLACEMENTS:
            runs[f"pressured_{blocks}_{placement.replace('-', '_')}"] = run_pressured(placement, blocks, multiturn,
                                                                                      args.conversations)
    runs = {
        "one_worker_cached": run("multiturn, 1 worker, prefix caching", 1, (), multiturn, args.conversations, 4),
        "one_worker_uncached": run("multiturn, 1 worker, --no-prefix-caching", 1, ("--no-prefix-caching",), multiturn,
                                   args.conversations, 4),
        "two_workers_cache_aware": run("multiturn, 2 workers, cache-aware", 2, ("--placement", "cache-aware"),
                                       multiturn, args.conversations, 8),
        "two_workers_least_loaded": run("multiturn, 2 workers, least-loaded", 2, ("--placement", "least-loaded"),
                                        multiturn, args.conversations, 8),
        **runs,
        "system_prompt_cached": run("system-prompt, 1 worker, prefix caching", 1, (), shared, args.users, 8),
        "system_prompt_uncached": run("system-prompt, 1 worker, --no-prefix-caching", 1, ("--no-prefix-caching",),
                                      shared, args.users, 8),
    }
    cached, uncached = runs["one_worker_cached"], runs["one_worker_uncached"]
    aware, least = runs["two_workers_cache_aware"], runs["two_workers_least_loaded"]
    ratios = {
        "one_worker_ttft_later_turns_uncached_over_cached": ratio(uncached["ttft_later_turns_p50_ms"],
                                                                  cached["ttft_later_turns_p50_ms"]),
        "one_worker_throughput_cached_over_uncached": ratio(cached["output_tokens_per_s"],
                                                            uncached["output_tokens_per_s"]),
        "two_workers_hit_rate_cache_aware_over_least_loaded": ratio(aware["hit_rate"], least["hit_rate"]),
        "two_workers_ttft_later_turns_least_loaded_over_cache_aware": ratio(least["ttft_later_turns_p50_ms"],
                                                                            aware["ttft_later_turns_p50_ms"]),
        **{name: value for blocks in pools for name, value in (
            (f"pressured_{blocks}_hit_rate_cache_aware_over_least_loaded",
             ratio(runs[f"pressured_{blocks}_cache_aware"]["hit_rate"],
                   runs[f"pressured_{blocks}_least_loaded"]["hit_rate"])),
            (f"pressured_{blocks}_ttft_later_turns_least_loaded_over_cache_aware",
             ratio(runs[f"pressured_{blocks}_least_loaded"]["ttft_later_turns_p50_ms"],
                   runs[f"pressured_{blocks}_cache_aware"]["ttft_later_turns_p50_ms"])))},
        "system_prompt_ttft_uncached_over_cached": ratio(runs["system_prompt_uncached"]["ttft_p50_ms"],
                                                         runs["system_prompt_cached"]["ttft_p50_ms"]),
    }
    report = {"executor": "engine", "command": " ".join(["benchmarks/prefix_cache.py", *sys.argv[1:]]),
              "seconds": round(time.time() - started), "placement_slack": SLACK, "ratios": ratios, "runs": runs}
    lines = ["# Prefix caching and cache-aware placement (executor: engine, SmolLM2-135M on the CPU)", "",
             f"`.venv/bin/python {report['command']}` "
             f"({report['seconds']} s, CPU, SmolLM2-135M; ratios from back-to-back runs of the same seeded workload)",
             "", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" if value else f"| {name} | - |" for name, value in ratios.items()]
    lines += ["", "| run | completed | output tok/s | hit rate | TTFT p50 ms | TTFT p50 turns 2+ ms | "
              "largest running gap |", "|---|---|---|---|---|---|---|"]
    for result in runs.values():
        later = result["ttft_later_turns_p50_ms"]
        lines.append(f"| {result['label']} | {result['completed']} | {result['output_tokens_per_s']:.1f} | "
                     f"{100 * result['hit_rate']:.1f}% | {result['ttft_p50_ms']:.0f} | "
                     f"{'-' if later != later else f'{later:.0f}'} | "
                     f"{'-' if result['largest_running_gap'] is None else result['largest_running_gap']} |")
    save("prefix_cache", report, lines)


if __name__ == "__main__":
    main()
