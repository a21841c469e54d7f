"""Speculative decoding through the whole system (issue: speculative decoding, planned by the scheduler).

iterserve with `--speculative-config` (n-gram prompt lookup) beside the same server without it, and
llama.cpp's llama-server with and without its own n-gram speculation where its build has it, on
the same prompts and load, the servers taking turns at each workload (this machine's speed drifts):

- `quotes`: each prompt shows two passages copied line for line and asks for a third copy (the kind
  of output a summary, rewrite or code edit makes: long runs of the prompt's tokens);
- `fresh`: ../shared/peers/load.py's stories (little to quote, though a 135M model repeats itself);
- `sampled`: the same stories sampled at temperature 1.0, top_p 0.95 (most proposals are refused:
  what failing proposals cost).

Closed loop, 64 output tokens forced with ignore_eos, greedy but for `sampled`, streaming (load.py's client), each
request's prompt made unique so that no prompt cache helps. Output tok/s per server and concurrency,
and the speculating server's over the plain one's. Every greedy output of the speculating iterserve
is checked equal to the plain one's, prompt by prompt.

    .venv/bin/python benchmarks/speculation_system.py --dtypes bfloat16 --levels 1,4,64
    .venv/bin/python benchmarks/speculation_system.py --llama-server PATH   # with llama-server, and its
        # `--spec-type ngram-simple` (its defaults) where its build has it

Writes benchmarks/results/speculation_system[_NAME].{md,json}.
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vs_llama_server import LlamaServer  # noqa: E402
from services.bench.runner import machine_info  # noqa: E402
from services.bench.server import ServerProcess  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO.parent / "shared" / "peers"
RESULTS = REPO / "benchmarks" / "results"
CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PASSAGES = [
    "The harbor town woke slowly on winter mornings. Before the sun cleared the hills, the fishing boats were "
    "already back at the pier, their decks crowded with crates of silver mackerel.",
    "Every spring the river rose over the lower fields, and the farmers moved their sheep to the chalk downs, "
    "where the grass was thin but the ground stayed dry until the water went down again.",
    "The library kept three shelves of atlases: two of old maps, drawn by hand on linen, and one of travel "
    "diaries that the librarian read aloud to whoever came in from the cold.",
    "At the top of the pass the road narrowed to a single lane, cut into the rock above a drop of several "
    "hundred metres, and the drivers sounded their horns before every bend.",
]


def quoting_prompt(index: int) -> str:
    """Two passages shown and copied, then a third shown: its copy is the output (unique per index)."""
    shown = [PASSAGES[(index + offset) % len(PASSAGES)] for offset in range(3)]
    examples = "".join(f"Original: {text}\nCopy: {text}\n\n" for text in shown[:2])
    return f"Exercise {index}. Copy each original exactly.\n\n{examples}Original: {shown[2]}\nCopy:"


def load_module():
    spec = importlib.util.spec_from_file_location("peers_load", PEERS / "load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_level(load, url: str, model: str, workload: str, concurrency: int, seed_offset: int, mult: int) -> dict:
    stories = load.__dict__.setdefault("story_prompt", load.make_prompt)
    load.make_prompt = quoting_prompt if workload == "quotes" else stories
    sampled = workload == "sampled"
    args = SimpleNamespace(url=url, model=model, max_tokens=64, temperature=1.0 if sampled else 0.0,
                           top_p=0.95 if sampled else None, force="ignore_eos",
                           timeout=600.0, level_timeout=1800.0, seed_offset=seed_offset, mult=mult)
    return asyncio.run(load.run_level(args, concurrency))


def texts(load, url: str, model: str, workload: str, count: int, seed_offset: int) -> list[str]:
    """Greedy outputs of `count` prompts, one at a time (for the equality check)."""
    import httpx

    stories = load.__dict__.setdefault("story_prompt", load.make_prompt)
    load.make_prompt = quoting_prompt if workload == "quotes" else stories
    args = SimpleNamespace(url=url, model=model, max_tokens=64, temperature=0.0, top_p=None, force="ignore_eos")

    async def collect() -> list[str]:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            return [(await load.one_request(client, args, seed_offset + index))["text"] for index in range(count)]

    return asyncio.run(collect())


def llama_server_has_ngram(binary: Path) -> bool:
    finished = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return "ngram-simple" in finished.stdout + finished.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16", help="iterserve's --dtype, a pair of servers each")
    parser.add_argument("--levels", default="1,4,64")
    parser.add_argument("--workloads", default="quotes,fresh")
    parser.add_argument("--requests", type=int, default=8, help="requests per level: at least this many, and "
                                                                 "at least the concurrency")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", default=json.dumps(CONFIG), help="iterserve's --speculative-config")
    parser.add_argument("--llama-server", type=Path, default=None, help="also llama-server, with and without "
                                                                        "--spec-type ngram where it has it")
    parser.add_argument("--name", default="", help="suffix of the results' file names")
    parser.add_argument("--depth-one", action="store_true", help="also a plain iterserve with --pipeline-depth 1 "
                                                                   "per dtype (what unpipelined steps cost)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    workloads = args.workloads.split(",")
    load = load_module()
    started = time.time()
    results: dict[str, dict[str, list[dict]]] = {}  # workload -> server -> a row per level
    checks: dict[str, list[int]] = {}  # "server workload" -> [outputs equal to the plain server's, outputs]
    acceptance: dict[str, dict[str, float]] = {}  # speculating server -> its drafts, proposed and kept tokens
    with contextlib.ExitStack() as stack:
        servers = []  # (name, url, model, the server it is compared with)
        for dtype in args.dtypes.split(","):
            plain = stack.enter_context(ServerProcess(workers=1, threads=args.threads, extra_args=("--dtype", dtype)))
            speculating = stack.enter_context(ServerProcess(workers=1, threads=args.threads, extra_args=(
                "--dtype", dtype, "--speculative-config", args.config)))
            method = "draft" if "model" in json.loads(args.config) else "ngram"
            servers += [(f"iterserve-{dtype}", plain.url, "smollm2-135m-instruct", None),
                        (f"iterserve-{dtype}+{method}", speculating.url, "smollm2-135m-instruct", f"iterserve-{dtype}")]
            if args.depth_one:
                unpipelined = stack.enter_context(ServerProcess(workers=1, threads=args.threads, extra_args=(
                    "--dtype", dtype, "--pipeline-depth", "1")))
                servers.append((f"iterserve-{dtype}-depth1", unpipelined.url, "smollm2-135m-instruct",
                                f"iterserve-{dtype}"))
        if args.llama_server is not None:
            llama = stack.enter_context(LlamaServer(args.llama_server, args.threads, 64))
            servers.append(("llama-server", llama.url, "smollm2", None))
            if llama_server_has_ngram(args.llama_server):
                speculating_llama = LlamaServer(args.llama_server, args.threads, 64)
                speculating_llama.command += ["--spec-type", "ngram-simple"]  # (its defaults: 12-token lookup, 48 drafted)
                stack.enter_context(speculating_llama)
                servers.append(("llama-server+ngram", speculating_llama.url, "smollm2", "llama-server"))
        for workload in workloads:  # greedy outputs, speculating against plain, before any timing
            for name, url, model, baseline in servers:
                if baseline and name.startswith("iterserve") and workload != "sampled":
                    base_url = next(server[1] for server in servers if server[0] == baseline)
                    ours, theirs = (texts(load, url, model, workload, 4, 50_000),
                                    texts(load, base_url, model, workload, 4, 50_000))
                    checks[f"{name} {workload}"] = [sum(a == b for a, b in zip(ours, theirs)), len(ours)]
        offset = 0
        for workload in workloads:
            for repeat, level in enumerate(levels):
                # The servers take turns, in the other order at every other level (a level given twice
                # measures both orders); fresh prompts every run
                for name, url, model, _ in (servers if repeat % 2 == 0 else servers[::-1]):
                    offset += 1000
                    print(f"{workload} c={level} {name} ...", flush=True)
                    row = run_level(load, url, model, workload, level, 100_000 + offset,
                                    max(1, -(-args.requests // level)))
                    results.setdefault(workload, {}).setdefault(name, []).append(row)
                    print(f"  {row['tok_s']:.1f} tok/s, TPOT {row['tpot_mean_s'] * 1000:.1f} ms", flush=True)
        for name, url, _, baseline in servers:  # what the speculating servers kept, over the whole run
            if baseline and name.startswith("iterserve") and "+" in name:
                import urllib.request

                with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                    metrics = response.read().decode()
                counts = [sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                              if line.startswith(f"vllm:spec_decode_num_{kind}_total"))
                          for kind in ("drafts", "draft_tokens", "accepted_tokens")]
                acceptance[name] = dict(zip(("drafts", "proposed", "kept"), counts))
    shown = " / ".join(map(str, levels))
    lines = ["# Speculative decoding through the whole system (executor: engine, SmolLM2-135M)", "",
             f"Measured on {machine_info()['cpu']}, {os.cpu_count()} cores, {args.threads} "
             f"threads per server, load average at the end {os.getloadavg()[0]:.2f}; "
             f"`.venv/bin/python benchmarks/speculation_system.py {' '.join(sys.argv[1:])}` "
             f"({time.time() - started:.0f} s).",
             f"iterserve: `iterserve up --dtype D` (1 worker), and with `--speculative-config '{args.config}'`. "
             "Closed loop, 64 output tokens (ignore_eos), greedy, streamed; at each concurrency C, "
             f"max(C, {args.requests}) requests (rounded up to a multiple of C).", "",
             f"| workload | server | output tok/s at concurrency {shown} | TPOT at 1 (ms) |", "|---|---|---|---|"]
    for workload, by_server in results.items():
        for name, rows in by_server.items():
            lines.append(f"| {workload} | {name} | " + " / ".join(f"{row['tok_s']:.1f}" for row in rows)
                         + f" | {rows[0]['tpot_mean_s'] * 1000:.1f} |")
    lines += ["", f"| workload | speculating / plain | at concurrency {shown} | greedy outputs equal to the plain "
                  "server's, one request at a time |", "|---|---|---|---|"]
    for workload, by_server in results.items():
        for name, url, model, baseline in servers:
            if baseline:
                ratio = " / ".join(f"{ours['tok_s'] / theirs['tok_s']:.2f}x"
                                   for ours, theirs in zip(by_server[name], by_server[baseline]))
                same = checks.get(f"{name} {workload}")
                lines.append(f"| {workload} | {name} / {baseline} | {ratio} | "
                             f"{'not checked' if same is None else f'{same[0]} of {same[1]}'} |")
    for name, counts in acceptance.items():
        lines.append(f"\n{name}, the whole run (every workload and level, the equality checks too): "
                     f"{counts['drafts']:.0f} verifications, {counts['kept']:.0f} of {counts['proposed']:.0f} "
                     f"proposed tokens kept ({counts['kept'] / max(counts['proposed'], 1):.0%}).")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "speculation_system" + (f"_{args.name}" if args.name else "")
    (args.out / f"{stem}.md").write_text(text + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"executor": "engine", "checks": checks,
                                                       "acceptance": acceptance, **results}, indent=2)
                                           + "\n")


if __name__ == "__main__":
    main()
