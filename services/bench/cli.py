"""`iterserve bench`: load generator against a running gateway.

  iterserve bench --url http://127.0.0.1:8000 --workload orca --rate 2 --num-requests 200 \\
                  --seed 0 --output run.json [--ttft-slo 1000 --tpot-slo 100] [--cancel-fraction 0.3]
  iterserve bench --concurrency 8 ...         closed loop instead of a rate
  iterserve bench serve --dataset-name sharegpt --dataset-path F ...   vllm bench serve's flags and summary
  iterserve bench experiments [--quick]       every experiment; writes benchmarks/results/
  iterserve bench experiments control-plane   emulated fleets: does one scheduler keep them busy?
  iterserve bench experiments orca-emulated   Orca against request-level at GPU cost (emulated A100, 13B)

Prints a markdown table; --output writes the JSON report (summary and per-request timings).
"""

import argparse
import asyncio
import math
import os
import re
import sys

from services.bench.metrics import markdown
from services.bench.runner import BenchConfig, run_benchmark, write_report
from services.bench.workloads import WORKLOADS, WorkloadConfig


def duration_seconds(text: str) -> float:
    """'500', '500ms', '0.5s' -> 0.5 (a bare number is milliseconds)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 500, 500ms, 0.5s)")
    value = float(match.group(1))
    return value if match.group(2) == "s" else value / 1000


def rate(text: str) -> float:
    value = math.inf if text.lower() in ("inf", "infinity") else float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("rate must be > 0 (or inf: all at once)")
    return value


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default %(default)s)")
    parser.add_argument("--workload", choices=WORKLOADS, default="orca")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=rate, default=math.inf,
                      help="requests per second, open loop (default inf: all at once)")
    load.add_argument("--concurrency", type=int, help="closed loop: this many clients, one request each at a time")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier (default 1)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="same seed, same requests at the same times")
    parser.add_argument("--input-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="prompt tokens: orca's uniform range (32 512), chat's clip range (8 2048)")
    parser.add_argument("--output-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="output tokens: orca's uniform range (1 128), chat's clip range (1 512)")
    parser.add_argument("--input-median", type=int, default=128, help="chat: median prompt tokens")
    parser.add_argument("--output-median", type=int, default=64, help="chat: median output tokens")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation (default 4); "
                        "--num-requests counts conversations, --rate and --concurrency start conversations")
    parser.add_argument("--think-time", type=float, default=1.0,
                        help="multiturn: mean seconds between an answer and the next turn (exponential, default 1)")
    parser.add_argument("--system-prompt-tokens", type=int, default=512,
                        help="system-prompt: tokens of the system prompt every user shares (default 512)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    parser.add_argument("--ttft-slo", type=duration_seconds, help="goodput target for time to first token (ms)")
    parser.add_argument("--tpot-slo", type=duration_seconds, help="goodput target for time per output token (ms)")
    parser.add_argument("--cancel-fraction", type=float, default=0.0,
                        help="share of requests cancelled half-way through their output (e.g. 0.3)")
    parser.add_argument("--cancel-mode", choices=("disconnect", "delete"), default="disconnect",
                        help="cancel by closing the stream, or by DELETE /v1/requests/{id}")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--max-duration", type=float, help="seconds: stop the run and count the rest as failed")
    parser.add_argument("--warmup", type=int, default=1, help="short uncounted requests first (default 1)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default=os.environ.get("ITERSERVE_API_KEY"),
                        help="sent as a Bearer token (env ITERSERVE_API_KEY)")
    parser.add_argument("--corpus", help="text file the prompts are cut from (default benchmarks/corpus.txt)")
    parser.add_argument("--output", help="write the JSON report here")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def config_from(args: argparse.Namespace) -> BenchConfig:
    workload = WorkloadConfig(
        name=args.workload,
        input_range=tuple(args.input_range) if args.input_range else None,
        output_range=tuple(args.output_range) if args.output_range else None,
        input_median=args.input_median, output_median=args.output_median, temperature=args.temperature,
        turns=args.turns, think_time=args.think_time, system_prompt_tokens=args.system_prompt_tokens,
    )
    config = BenchConfig(
        url=args.url, workload=workload, num_requests=args.num_requests, rate=args.rate,
        burstiness=args.burstiness, concurrency=args.concurrency, seed=args.seed, ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo, cancel_fraction=args.cancel_fraction, cancel_mode=args.cancel_mode,
        request_timeout=args.request_timeout, max_duration=args.max_duration, warmup=args.warmup,
        model=args.model, api_key=args.api_key, progress=not args.no_progress, label=args.label,
    )
    if args.corpus:
        config.corpus = args.corpus
    return config


def executor_words(executor: str) -> str:
    """A report's executor as its first line says it: EMULATED stands out (no model ran)."""
    return "EMULATED workers: no model ran" if "emulated" in executor else f"executor: {executor}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        from services.bench.serve import main as serve_main

        serve_main(argv[1:])
        return
    if argv and argv[0] == "experiments":
        from services.bench.experiments import main as experiments_main

        experiments_main(argv[1:])
        return
    args = parser().parse_args(argv)
    if args.num_requests < 1:
        parser().error("--num-requests must be >= 1")
    if not 0 <= args.cancel_fraction <= 1:
        parser().error("--cancel-fraction must be between 0 and 1")
    try:
        config = config_from(args)
    except ValueError as error:
        parser().error(str(error))
    report = asyncio.run(run_benchmark(config))
    if args.output:
        write_report(report, args.output)
    print(markdown(report["summary"], title=f"iterserve bench ({executor_words(report['executor'])}): "
                                            f"{report['description']}"))
    if report["summary"]["completed"] == 0 and report["summary"]["cancelled"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
