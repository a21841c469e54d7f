"""Structured outputs through the whole system (`iterserve up`, the packaged SmolLM2, real HTTP):

  python -m benchmarks.structured_outputs [--requests 200] [--concurrency 16] [--base REF]

1. Validity: REQUESTS chat requests at temperature 1.0, max_tokens 512, each under one of the ten
   schemas of benchmarks/schemas.py (json_schema, strict): how many finish with `stop`, and of those
   how many parse and validate (jsonschema), per schema.
2. Throughput at CONCURRENCY: the constrained requests' output tok/s against the same requests
   unconstrained, each held to its constrained run's output length (ignore_eos, max_tokens), run
   back to back on the same system.
3. With --base REF (a git ref, checked out in a temporary worktree): the unconstrained requests on
   that version too, side by side: unconstrained throughput with the feature present.
4. Grammar compile time of each schema (llguidance, in this process) and the TTFT of the first
   request with a new schema against the second, sequentially on an idle system.

The last line is the constrained / unconstrained throughput ratio. Results: stdout, and
benchmarks/results/structured_outputs.md with --write.
"""

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import jsonschema

from benchmarks.schemas import SCHEMAS
from services.bench.server import REPO, ServerProcess

MODEL = "smollm2-135m-instruct"
RESULTS = REPO / "benchmarks" / "results" / "structured_outputs.md"
# The prompt names the schema, as OpenAI's guide and vLLM's examples advise (the constraint holds
# the output to it; the prompt tells the model what to put there)
ASK = {name: f"Reply with JSON only: a realistic {name.replace('_', ' ')}, following this JSON Schema: "
             f"{json.dumps(schema)}" for name, schema, _ in SCHEMAS}


def constrained_body(name: str, schema: dict, seed: int, max_tokens: int = 512) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": ASK[name]}], "temperature": 1.0, "seed": seed,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                         "strict": True}}}


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    started = time.perf_counter()
    ttft, text, finish, tokens = None, [], None, 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(choice["delta"]["content"])
                finish = choice.get("finish_reason") or finish
    return {"ttft": ttft, "text": "".join(text), "finish": finish, "tokens": tokens,
            "seconds": time.perf_counter() - started}


async def run_all(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(body: dict) -> dict:
            async with semaphore:
                return await stream(session, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(body) for body in bodies))
        return results, time.perf_counter() - started


def validity(url: str, requests: int, concurrency: int) -> tuple[list[str], list[dict], list[dict]]:
    schemas = SCHEMAS[:10]
    plan = [(schemas[i % 10], i) for i in range(requests)]
    bodies = [constrained_body(name, schema, seed) for (name, schema, _), seed in plan]
    results, seconds = asyncio.run(run_all(url, bodies, concurrency))
    rows = []
    for name, schema, _ in schemas:
        mine = [result for ((other, _, _), _), result in zip(plan, results) if other == name]
        stopped = [result for result in mine if result["finish"] == "stop"]
        valid = 0
        for result in stopped:
            try:
                jsonschema.validate(json.loads(result["text"]), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        rows.append({"schema": name, "requests": len(mine), "stop": len(stopped), "valid": valid,
                     "length": sum(result["finish"] == "length" for result in mine),
                     "tokens": statistics.mean(result["tokens"] for result in mine)})
    lines = ["| schema | requests | finished (stop) | valid of those | ended by length | mean output tokens |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {row['schema']} | {row['requests']} | {row['stop']} | {row['valid']} | {row['length']} "
              f"| {row['tokens']:.0f} |" for row in rows]
    total = {key: sum(row[key] for row in rows) for key in ("requests", "stop", "valid", "length")}
    lines.append(f"| all | {total['requests']} | {total['stop']} ({100 * total['stop'] / total['requests']:.1f}%) "
                 f"| {total['valid']} ({100 * total['valid'] / max(1, total['stop']):.1f}%) | {total['length']} "
                 f"| {sum(row['tokens'] * row['requests'] for row in rows) / total['requests']:.0f} |")
    lines.append(f"\n{requests} requests at concurrency {concurrency} in {seconds:.0f} s.")
    return lines, results, [body for body in bodies]


def unconstrained_twins(bodies: list[dict], results: list[dict]) -> list[dict]:
    twins = []
    for body, result in zip(bodies, results):
        twin = {key: value for key, value in body.items() if key != "response_format"}
        twins.append(twin | {"max_tokens": max(1, result["tokens"]), "ignore_eos": True})
    return twins


def throughput(results: list[dict], seconds: float) -> float:
    return sum(result["tokens"] for result in results) / seconds


def compile_times() -> list[str]:
    from shared.grammar import GrammarCompiler
    from shared.messages import StructuredOutput
    from shared.tokenizer import Tokenizer

    compiler = GrammarCompiler(Tokenizer.load())
    cells = []
    for name, schema, _ in SCHEMAS[:10]:
        started = time.perf_counter()
        compiler.check(StructuredOutput(kind="json", spec=json.dumps(schema)))
        cells.append(f"{name} {1000 * (time.perf_counter() - started):.1f}")
    return ["Compile time per schema (ms, llguidance, first time): " + ", ".join(cells)]


def first_and_second_ttft(url: str) -> list[str]:
    """Each schema made new (a unique title: no cache holds it), sent twice in a row on an idle system."""
    lines, gaps = [], []
    for index, (name, schema, _) in enumerate(SCHEMAS[:10]):
        fresh = dict(schema, title=f"fresh-{time.time_ns()}-{index}")
        body = constrained_body(name, fresh, seed=1, max_tokens=1)
        body["temperature"] = 0
        first = asyncio.run(run_all(url, [body], 1))[0][0]["ttft"]
        second = asyncio.run(run_all(url, [body], 1))[0][0]["ttft"]
        gaps.append(1000 * (first - second))
        lines.append(f"{name} {1000 * first:.0f}/{1000 * second:.0f}")
    return [f"TTFT of the first / second request with a new schema (ms): {', '.join(lines)}; the first is "
            f"{statistics.median(gaps):.1f} ms slower in the median, {max(gaps):.1f} at most"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--base", default="", help="a git ref to run the unconstrained requests on as well")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    host = platform.processor() or platform.machine()
    out = [f"# Structured outputs through the whole system (executor: engine, {args.workers} worker(s), host: "
           f"{_cpu_name() or host})", "", f"Command: `python -m benchmarks.structured_outputs --requests "
           f"{args.requests} --concurrency {args.concurrency}{' --base ' + args.base if args.base else ''}`", ""]
    with ServerProcess(workers=args.workers) as server:
        table, results, bodies = validity(server.url, args.requests, args.concurrency)
        out += ["## Validity at temperature 1.0, max_tokens 512", "", *table, ""]
        print("\n".join(out), flush=True)
        constrained, constrained_seconds = asyncio.run(run_all(server.url, bodies, args.concurrency))
        twins = unconstrained_twins(bodies, constrained)
        plain, plain_seconds = asyncio.run(run_all(server.url, twins, args.concurrency))
        out += first_and_second_ttft(server.url)
    with_feature = throughput(plain, plain_seconds)
    base_line = ""
    if args.base:
        with tempfile.TemporaryDirectory() as directory:
            worktree = Path(directory) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.base], cwd=REPO, check=True,
                           capture_output=True, timeout=120)
            try:
                with ServerProcess(workers=args.workers, checkout=worktree) as server:
                    base, base_seconds = asyncio.run(run_all(server.url, twins, args.concurrency))
                base_line = (f"; on {args.base} (no structured outputs) {throughput(base, base_seconds):.1f} tok/s: "
                             f"{with_feature / throughput(base, base_seconds):.2f}x")
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, timeout=120)
    out += compile_times()
    ratio = throughput(constrained, constrained_seconds) / with_feature
    out += ["", f"## Throughput at concurrency {args.concurrency} (the same requests, the same output lengths)", "",
            f"Constrained {throughput(constrained, constrained_seconds):.1f} output tok/s "
            f"({constrained_seconds:.0f} s), unconstrained {with_feature:.1f} ({plain_seconds:.0f} s){base_line}.", "",
            f"constrained / unconstrained output tok/s at concurrency {args.concurrency}: {ratio:.2f}"]
    print("\n".join(out[-6:]))
    if args.write:
        RESULTS.write_text("\n".join(out) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
