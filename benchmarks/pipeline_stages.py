"""A pipeline-parallel worker group's stages overlapping (Orca's figure 8), side by side in one run.

    .venv/bin/python benchmarks/pipeline_stages.py [--baseline-checkout PATH] [--requests 48]

Each configuration is `iterserve up` with one worker on this machine's 2 cores, driven by `iterserve
bench` with the same seeded chat workload (closed loop, 16 clients):
1. one single-process worker on 2 threads (the model whole, torch's intra-op parallelism);
2. `--pipeline-parallel 2`: two ranks of one thread, 15 layers each, the stages running different
   plans at once;
3. with --baseline-checkout (a checkout of an earlier version, e.g. `git worktree add /tmp/lockstep
   f1bb7e2`): the same group as it ran before its stages overlapped (a step through both stages,
   then the next).
Writes benchmarks/results/pipeline_stages.md and .json. On a CPU the two stages are two cores; on
GPUs they would be two devices.
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from services.bench.server import ServerProcess  # noqa: E402
from services.bench.workloads import WorkloadConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run(label: str, server: ServerProcess, requests: int) -> dict:
    workload = WorkloadConfig(name="chat", input_range=(16, 64), output_range=(48, 96))
    with server:
        config = BenchConfig(url=server.url, workload=workload, num_requests=requests, concurrency=16, seed=5,
                             warmup=1, progress=False, label=label)
        report = asyncio.run(run_benchmark(config))
    summary = report["summary"]
    result = {"label": label, "command": " ".join(server.command[2:]), "completed": summary["completed"],
              "failed": summary["failed"], "output_tokens_per_s": summary["output_token_throughput"],
              "ttft_p50_ms": summary["ttft_ms"]["p50"], "tpot_p50_ms": summary["tpot_ms"]["p50"]}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-checkout", type=Path,
                        help="an earlier checkout, whose group runs its stages in turn")
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    started = time.time()
    runs = {
        "single_2_threads": run("1 worker, single process, 2 threads", ServerProcess(threads=2), args.requests),
        "pipeline_2": run("1 worker, --pipeline-parallel 2 (stages overlap)",
                          ServerProcess(extra_args=("--pipeline-parallel", "2")), args.requests),
    }
    if args.baseline_checkout:
        runs["pipeline_2_in_turn"] = run(f"1 worker, --pipeline-parallel 2, stages in turn ({args.baseline_checkout})",
                                         ServerProcess(extra_args=("--pipeline-parallel", "2"),
                                                       checkout=args.baseline_checkout.resolve()), args.requests)
    overlap = runs["pipeline_2"]["output_tokens_per_s"]
    ratios = {"pipeline_2_over_single_2_threads": overlap / runs["single_2_threads"]["output_tokens_per_s"]}
    if "pipeline_2_in_turn" in runs:
        ratios["overlapped_over_in_turn"] = overlap / runs["pipeline_2_in_turn"]["output_tokens_per_s"]
    report = {"command": " ".join(["benchmarks/pipeline_stages.py", *sys.argv[1:]]),
              "seconds": round(time.time() - started), "ratios": ratios, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_stages.json").write_text(json.dumps({"executor": "engine", **report}, indent=1) + "\n")
    lines = ["# Pipeline-parallel stages overlapping (executor: engine, SmolLM2-135M on the CPU)", "",
             f"`.venv/bin/python {report['command']}` ({report['seconds']} s, CPU, 2 cores, SmolLM2-135M, "
             f"{args.requests} chat requests of 16-64 prompt and 48-96 output tokens, 16 clients; back to back)",
             "", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in ratios.items()]
    lines += ["", "| run | completed | output tok/s | TTFT p50 ms | TPOT p50 ms |", "|---|---|---|---|---|"]
    lines += [f"| {result['label']} | {result['completed']} | {result['output_tokens_per_s']:.1f} | "
              f"{result['ttft_p50_ms']:.0f} | {result['tpot_p50_ms']:.1f} |" for result in runs.values()]
    (RESULTS / "pipeline_stages.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
