"""`iterserve bench serve`: `vllm bench serve`'s flags, datasets and summary, so that a run compares
with vLLM's line by line (same file, same seed: the same ShareGPT prompts in the same order).

  iterserve bench serve --base-url http://127.0.0.1:8000 --dataset-name sharegpt \\
      --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 200 --request-rate 4 \\
      --max-concurrency 32 --save-result --result-dir results/

Datasets (vLLM's rules):
  sharegpt  a JSON list of {"conversations": [{"from": ..., "value": ...}, ...]}: each entry with two
            turns or more gives its first turn as the prompt and its second's length in tokens as the
            output length (--sharegpt-output-len overrides); pairs with fewer than 4 tokens either side,
            prompts over 1024 tokens or totals over 2048 are skipped; entries shuffled with --seed
            (Python's random, as vLLM's); too few for --num-prompts: drawn again (--no-oversample: not).
  random    --random-input-len / --random-output-len tokens (each within --random-range-ratio of it),
            after --random-prefix-len tokens shared by all; ignore_eos forced, as vLLM forces it.
Requests arrive at --request-rate (Poisson; --burstiness < 1 burstier) and wait on the client for one
of --max-concurrency slots. Without --temperature none is sent (the server's default applies), as
vLLM's. Only iterserve's own line comes before vLLM's block: the executor that served the run.
"""

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np

from services.bench.arrivals import arrival_offsets
from services.bench.cli import executor_words
from services.bench.client import RequestResult, send_request
from services.bench.runner import Progress
from services.bench.workloads import BenchRequest
from shared.tokenizer import Tokenizer

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
BACKENDS = ("openai", "vllm", "openai-chat")  # vLLM's OpenAI-compatible backends; all three are HTTP + SSE
# vLLM's --percentile-metrics: attribute, name in the lines, section header.
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's is_valid_sequence for ShareGPT pairs
REQUEST_TIMEOUT_S = 6 * 3600  # vLLM's aiohttp timeout: a saturated run may queue for long
LINE, NUMBER = "{:<40} {:<10}", "{:<40} {:<10.2f}"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS, default="openai")
    parser.add_argument("--base-url", help="the server, without the endpoint (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    parser.add_argument("--model", help="the model to ask for (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", help="counts the dataset's tokens (default: the model's; a name, GGUF or "
                        "checkpoint directory)")
    parser.add_argument("--dataset-name", choices=("sharegpt", "random"), default="random")
    parser.add_argument("--dataset-path", help="sharegpt: the JSON file")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, help="at most this many requests at once (the rest wait)")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", type=int, default=0)
    parser.add_argument("--sharegpt-output-len", type=int, help="every ShareGPT request's output length")
    parser.add_argument("--no-oversample", action="store_true", help="fewer ShareGPT pairs than --num-prompts: "
                        "send those, not repeats")
    parser.add_argument("--disable-shuffle", action="store_true", help="ShareGPT entries in the file's order")
    parser.add_argument("--ignore-eos", action="store_true", help="every output runs to its length")
    parser.add_argument("--temperature", type=float, help="(default: none sent, the server's applies)")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help=f"which of {','.join(METRICS)} to report (default %(default)s)")
    parser.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99 (default %(default)s)")
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs in ms, e.g. ttft:500 tpot:50")
    parser.add_argument("--num-warmups", type=int, default=0, help="uncounted requests first (the first prompt)")
    parser.add_argument("--save-result", action="store_true", help="write the result as vLLM's JSON")
    parser.add_argument("--save-detailed", action="store_true", help="with each request's lengths, times, texts")
    parser.add_argument("--result-dir", help="where --save-result writes (default: here)")
    parser.add_argument("--result-filename", help="(default LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    parser.add_argument("--label", help="names the run in the result (default: the backend)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress on stderr")
    return parser


def checked_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with what vLLM refuses refused here too (and what iterserve does not do)."""
    arguments = parser()
    args = arguments.parse_args(argv)
    if args.num_prompts < 1:
        arguments.error("--num-prompts must be >= 1")
    if not args.request_rate > 0 or args.burstiness <= 0:
        arguments.error("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        arguments.error("--max-concurrency must be > 0")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        arguments.error("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    if args.dataset_name == "random" and args.dataset_path:
        arguments.error("--dataset-name random takes no --dataset-path")
    if not 0 <= args.random_range_ratio < 1:
        arguments.error("--random-range-ratio must be in [0, 1)")
    if min(args.random_input_len, args.random_output_len) < 1 or args.random_prefix_len < 0:
        arguments.error("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        arguments.error("--sharegpt-output-len must be >= 1")
    if args.backend == "openai-chat" and args.endpoint != "/v1/chat/completions":
        arguments.error("--backend openai-chat needs --endpoint /v1/chat/completions")
    args.metrics = [name.strip() for name in args.percentile_metrics.split(",") if name.strip()]
    unknown = [name for name in args.metrics if name not in METRICS]
    if unknown:
        arguments.error(f"--percentile-metrics: unknown {', '.join(unknown)} (choose from {', '.join(METRICS)})")
    try:
        args.percentiles = [float(value) for value in args.metric_percentiles.split(",")]
    except ValueError:
        arguments.error(f"--metric-percentiles: not numbers: {args.metric_percentiles!r}")
    if not all(0 < value <= 100 for value in args.percentiles):
        arguments.error("--metric-percentiles must be in (0, 100]")
    args.slos = {}
    for item in args.goodput or ():
        name, _, value = item.partition(":")
        try:
            if name not in GOODPUT_METRICS or float(value) < 0:
                raise ValueError
        except ValueError:
            arguments.error(f"--goodput {item!r}: KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}, MS >= 0")
        args.slos[name] = float(value)
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


# The datasets


def sharegpt_requests(path: str, count: int, tokenizer: Tokenizer, *, seed: int = 0, output_len: int | None = None,
                      shuffle: bool = True, oversample: bool = True, endpoint: str = "completions",
                      ignore_eos: bool = False) -> list[BenchRequest]:
    """`count` prompts from a ShareGPT file as vLLM picks them (see the module's docstring)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the ShareGPT file {path}: {error}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path} is not a ShareGPT file: a JSON list of {{\"conversations\": [...]}} entries")
    entries = [entry for entry in data if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
               and len(entry["conversations"]) >= 2]
    if shuffle:
        random.Random(seed).shuffle(entries)  # what random.seed(seed); random.shuffle(...) gives (vLLM)
    requests: list[BenchRequest] = []
    for entry in entries:
        if len(requests) == count:
            break
        first, second = entry["conversations"][:2]
        prompt, completion = _turn_text(first), _turn_text(second)
        if prompt is None or completion is None:
            continue
        prompt_len = len(tokenizer.encode_prompt(prompt))  # as vLLM's tokenizer(prompt).input_ids counts
        out_len = output_len or len(tokenizer.encode_prompt(completion))
        if prompt_len < MIN_LEN or (output_len is None and out_len < MIN_LEN) or prompt_len > MAX_PROMPT_LEN \
                or prompt_len + out_len > MAX_TOTAL_LEN:
            continue
        requests.append(_request(len(requests), endpoint, prompt_len, out_len, seed, prompt, (), ignore_eos))
    if not requests:
        raise ValueError(f"{path} has no usable conversation (two turns or more, 4-{MAX_PROMPT_LEN} prompt tokens, "
                         f"at most {MAX_TOTAL_LEN} in all)")
    if oversample and len(requests) < count:
        # vLLM's maybe_oversample_requests: random.seed(seed); random.choices(requests, k=...)
        picked = random.Random(seed).choices(requests, k=count - len(requests))
        requests += [_request(len(requests) + index, endpoint, request.prompt_tokens, request.max_tokens, seed,
                              request.prompt_text, (), ignore_eos) for index, request in enumerate(picked)]
    return requests


def _turn_text(turn) -> str | None:
    return turn["value"] if isinstance(turn, dict) and isinstance(turn.get("value"), str) else None


def random_requests(count: int, tokenizer: Tokenizer, *, seed: int = 0, input_len: int = 1024,
                    output_len: int = 128, range_ratio: float = 0.0, prefix_len: int = 0,
                    endpoint: str = "completions") -> list[BenchRequest]:
    """vLLM's random dataset: runs of consecutive vocabulary ids (no special token) from a seeded
    offset, each length within range_ratio of its target, after one shared random prefix. Sent as
    token ids (exact lengths; text for chat); ignore_eos forced."""
    rng = np.random.default_rng(seed)
    allowed = np.array([token for token in range(tokenizer.vocab_size) if token not in tokenizer.special_token_ids])
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    input_lens = rng.integers(math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio)),
                              size=count, endpoint=True)
    output_lens = rng.integers(max(1, math.floor(output_len * (1 - range_ratio))),
                               math.ceil(output_len * (1 + range_ratio)), size=count, endpoint=True)
    offsets = rng.integers(0, len(allowed), size=count)
    requests = []
    for index in range(count):
        ids = prefix + allowed[(offsets[index] + index + np.arange(input_lens[index])) % len(allowed)].tolist()
        text = tokenizer.decode(ids) if endpoint == "chat" else ""
        requests.append(_request(index, endpoint, len(ids), int(output_lens[index]), seed, text, tuple(ids), True))
    return requests


def _request(index: int, endpoint: str, prompt_len: int, out_len: int, seed: int, text: str,
             ids: tuple[int, ...], ignore_eos: bool) -> BenchRequest:
    if endpoint == "chat":
        return BenchRequest(index, "chat", prompt_len, out_len, seed + index, messages=({"role": "user", "content": text},),
                            ignore_eos=ignore_eos)
    return BenchRequest(index, "completions", prompt_len, out_len, seed + index, prompt=ids, prompt_text=text,
                        ignore_eos=ignore_eos)


# The run


async def run_requests(requests: list[BenchRequest], *, base_url: str, model: str, temperature: float | None,
                       rate: float, burstiness: float, max_concurrency: int | None, seed: int, api_key: str | None,
                       warmups: int = 0, progress: bool = True) -> tuple[list[RequestResult], list[float], float]:
    """Each request at its arrival time, waiting for one of max_concurrency slots: the results, each
    one's wait on the client (s), and the run's duration (s)."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        for _ in range(warmups):
            await send_request(session, base_url, requests[0], model, temperature, time.perf_counter(),
                               timeout_s=REQUEST_TIMEOUT_S)
        bar = Progress(len(requests), progress)
        run_start = time.perf_counter()
        waits = [0.0] * len(requests)

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, run_start + offset - time.perf_counter()))
            arrived = time.perf_counter() - run_start
            if slots is None:
                result = await send_request(session, base_url, request, model, temperature, run_start,
                                            timeout_s=REQUEST_TIMEOUT_S)
            else:
                async with slots:
                    result = await send_request(session, base_url, request, model, temperature, run_start,
                                                timeout_s=REQUEST_TIMEOUT_S)
            waits[request.index] = result.sent_at - arrived
            bar.finished(result)
            return result

        results = await asyncio.gather(*(one(request, offset) for request, offset in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - run_start
        bar.draw(final=True)
    return list(results), waits, duration


# The figures, as vLLM computes and prints them


def serve_metrics(results: list[RequestResult], waits: list[float], duration: float, metrics: list[str],
                  percentiles: list[float], slos: dict[str, float]) -> dict:
    """vLLM's result: totals, throughputs, peaks, and mean/median/std/percentiles (ms) per metric."""
    ok = [result for result in results if result.ok]
    output_lens = [result.output_tokens for result in ok]
    total_input = sum(result.prompt_tokens for result in ok)
    values = {
        "ttft": [result.ttft for result in ok if result.ttft is not None],
        "tpot": [result.tpot for result in ok if result.tpot is not None],
        "itl": [gap for result in ok for gap in result.itls],
        "e2el": [result.e2e for result in ok if result.e2e is not None],
        "client_queue_time": [waits[result.index] for result in ok],
        "e2el_including_client_queue": [waits[result.index] + (result.e2e or 0.0) for result in ok],
    }
    good = [result for result in ok if _meets(result, slos)]
    figures = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": sum(output_lens),
        "request_throughput": len(ok) / duration,
        "request_goodput": len(good) / duration if slos else None,
        "output_throughput": sum(output_lens) / duration,
        "total_token_throughput": (total_input + sum(output_lens)) / duration,
        "max_output_tokens_per_s": _peak_tokens_per_second(ok),
        "max_concurrent_requests": _peak_concurrency(ok),
    }
    for name in metrics:
        seconds = values[name] or [0.0]  # vLLM reports 0 for a metric with no values
        ms = np.array(seconds) * 1000
        figures[f"mean_{name}_ms"] = float(np.mean(ms))
        figures[f"median_{name}_ms"] = float(np.median(ms))
        figures[f"std_{name}_ms"] = float(np.std(ms))
        for value in percentiles:
            figures[f"p{_p_word(value)}_{name}_ms"] = float(np.percentile(ms, value))
    figures["latencies"] = values["e2el"]
    figures["queue_times"] = values["client_queue_time"]
    return figures


def _meets(result: RequestResult, slos: dict[str, float]) -> bool:
    """Every SLO met (ms); a one-token request's TPOT counts as 0, as vLLM counts it."""
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2e}
    return all(measured[name] is not None and measured[name] * 1000 <= slo for name, slo in slos.items())


def _peak_tokens_per_second(results: list[RequestResult]) -> float:
    """The most output arriving within one second of the run (content chunks: a token each)."""
    seconds = [int(at) for result in results for at in result.chunk_times]
    return float(max(np.bincount(seconds))) if seconds else 0.0


def _peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at once (each from sent to its end)."""
    events = sorted([(result.sent_at, 1) for result in results] +
                    [(result.finished_at or result.sent_at, -1) for result in results], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def _p_word(value: float) -> str:
    return str(int(value)) if int(value) == value else str(value)


def summary_lines(figures: dict, args: argparse.Namespace) -> list[str]:
    """vLLM's block, line for line ("{:<40} {:<10}" and .2f, its order, its conditions)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             LINE.format("Successful requests:", figures["completed"]),
             LINE.format("Failed requests:", figures["failed"])]
    if args.max_concurrency is not None:
        lines.append(LINE.format("Maximum request concurrency:", args.max_concurrency))
    if not math.isinf(args.request_rate):
        lines.append(NUMBER.format("Request rate configured (RPS):", args.request_rate))
    lines += [NUMBER.format("Benchmark duration (s):", figures["duration"]),
              LINE.format("Total input tokens:", figures["total_input_tokens"]),
              LINE.format("Total generated tokens:", figures["total_output_tokens"]),
              NUMBER.format("Request throughput (req/s):", figures["request_throughput"])]
    if figures["request_goodput"] is not None:
        lines.append(NUMBER.format("Request goodput (req/s):", figures["request_goodput"]))
    lines += [NUMBER.format("Output token throughput (tok/s):", figures["output_throughput"]),
              NUMBER.format("Peak output token throughput (tok/s):", figures["max_output_tokens_per_s"]),
              NUMBER.format("Peak concurrent requests:", figures["max_concurrent_requests"]),
              NUMBER.format("Total token throughput (tok/s):", figures["total_token_throughput"])]
    for name, (label, header) in METRICS.items():
        if name not in args.metrics:
            continue
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  NUMBER.format(f"Mean {label} (ms):", figures[f"mean_{name}_ms"]),
                  NUMBER.format(f"Median {label} (ms):", figures[f"median_{name}_ms"])]
        lines += [NUMBER.format(f"P{_p_word(value)} {label} (ms):", figures[f"p{_p_word(value)}_{name}_ms"])
                  for value in args.percentiles]
    return lines + ["=" * 50]


def result_json(figures: dict, results: list[RequestResult], args: argparse.Namespace, model: str,
                tokenizer_id: str, executor: str) -> dict:
    """vLLM's --save-result JSON (its keys), with the executor that served the run first."""
    record = {"executor": executor, "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend,
              "backend": args.backend, "label": args.label, "model_id": model, "tokenizer_id": tokenizer_id,
              "num_prompts": args.num_prompts,
              "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **figures}
    if args.save_detailed:
        record.update(input_lens=[result.prompt_tokens for result in results],
                      output_lens=[result.output_tokens for result in results],
                      ttfts=[result.ttft or 0.0 for result in results],
                      itls=[result.itls for result in results],
                      start_times=[result.sent_at for result in results],
                      generated_texts=[result.text for result in results],
                      errors=[result.error or "" for result in results])
    return record


def result_path(args: argparse.Namespace, model: str, date: str) -> Path:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or \
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    directory = Path(args.result_dir or ".")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model of /v1/models (vLLM's default for --model)."""
    request = urllib.request.Request(f"{base_url}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise SystemExit(f"iterserve bench serve: no model from {base_url}/v1/models ({error}): pass --model") from None


def main(argv: list[str]) -> None:
    args = checked_args(argv)
    api_key = os.environ.get("OPENAI_API_KEY") or os.environ.get("ITERSERVE_API_KEY")
    model = args.model or served_model(args.base_url, api_key)
    tokenizer_id = args.tokenizer or model
    try:
        tokenizer = Tokenizer.load(tokenizer_id)
    except (OSError, ValueError) as error:
        raise SystemExit(f"iterserve bench serve: cannot load the tokenizer of {tokenizer_id!r} ({error}): pass "
                         f"--tokenizer with a model name, GGUF file or checkpoint directory") from None
    endpoint = ENDPOINTS[args.endpoint]
    try:
        if args.dataset_name == "sharegpt":
            requests = sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, seed=args.seed,
                                         output_len=args.sharegpt_output_len, shuffle=not args.disable_shuffle,
                                         oversample=not args.no_oversample, endpoint=endpoint,
                                         ignore_eos=args.ignore_eos)
        else:
            requests = random_requests(args.num_prompts, tokenizer, seed=args.seed, input_len=args.random_input_len,
                                       output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                       prefix_len=args.random_prefix_len, endpoint=endpoint)
    except ValueError as error:
        raise SystemExit(f"iterserve bench serve: {error}") from None
    results, waits, duration = asyncio.run(run_requests(
        requests, base_url=args.base_url, model=model, temperature=args.temperature, rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, api_key=api_key,
        warmups=args.num_warmups, progress=not args.disable_tqdm))
    figures = serve_metrics(results, waits, duration, args.metrics, args.percentiles, args.slos)
    executor = ",".join(sorted({result.executor for result in results if result.executor})) or "unknown"
    print(f"iterserve bench serve ({executor_words(executor)}): {len(requests)} {args.dataset_name} prompts, "
          f"{model} at {args.base_url}{args.endpoint}")
    print("\n".join(summary_lines(figures, args)))
    errors = sorted({result.error for result in results if result.error})
    if errors:
        print("Errors: " + "; ".join(errors[:10]), file=sys.stderr)
    if args.save_result:
        record = result_json(figures, results, args, model, tokenizer_id, executor)
        path = result_path(args, model, record["date"])
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"Saved {path}", file=sys.stderr)
    if figures["completed"] == 0:
        sys.exit(1)
