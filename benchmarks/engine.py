"""Engine benchmark (issue: worker engine): prefill and decode throughput of both attention
paths beside Hugging Face transformers generate(), same weights, prompts and threads, one run.

    .venv/bin/python benchmarks/engine.py [--threads 2] [--decode-steps 32] [--rounds 2]

Prints a markdown table and writes benchmarks/results/engine.{md,json}.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from services.worker.engine import Engine  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.messages import SamplingParams, StepItem  # noqa: E402
from shared.model_file import locate_gguf  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_SIZES = (1, 4, 16, 64)
PROMPT_TOKENS = 128
GREEDY = SamplingParams(max_tokens=1 << 20, ignore_eos=True)


def prompt_ids(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """`count` different real-text prompts of exactly PROMPT_TOKENS tokens."""
    text = Path(__file__).resolve().parent.joinpath("corpus.txt").read_text()
    ids = tokenizer.encode(text)
    return [(ids * 4)[i * 37 : i * 37 + PROMPT_TOKENS] for i in range(count)]


def item(request_id, tokens, start, sample=True, index=0) -> StepItem:
    return StepItem(request_id=request_id, token_ids=tuple(tokens), start_position=start, sample=sample,
                    output_index=index)


def engine_prefill_seconds(engine: Engine, prompt: list[int], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        engine.reset()
        engine.add_request("p", GREEDY)
        started = time.perf_counter()
        engine.step([item("p", prompt, 0)])
        times.append(time.perf_counter() - started)
    engine.reset()
    return statistics.median(times)


def engine_decode_seconds(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """Seconds for `steps` decode iterations of all requests (prefill excluded)."""
    engine.reset()
    last, context = {}, {}
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), GREEDY)
        last[str(index)] = engine.step([item(str(index), prompt, 0)]).tokens[str(index)]
        context[str(index)] = len(prompt)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        outcome = engine.step([item(rid, (last[rid],), context[rid] + step - 1, index=step) for rid in last])
        last = outcome.tokens
    elapsed = time.perf_counter() - started
    engine.reset()
    return elapsed


def transformers_decode_seconds(model, prompts: list[list[int]], steps: int) -> float:
    """generate() on a static batch: time(1 + steps tokens) - time(1 token) = the decode part."""
    inputs = torch.tensor(prompts)
    mask = torch.ones_like(inputs)

    def run(new_tokens: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(inputs, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - started

    return run(1 + steps) - run(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="turns each system takes per batch size (best kept)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.load()
    engine = Engine.from_settings(Settings(kv_blocks=(max(args.batch_sizes) * (PROMPT_TOKENS + args.decode_steps + 16)) // 16 + 8,
                                           device="cpu", dtype="float32"))
    prompts = prompt_ids(tokenizer, max(args.batch_sizes))
    hf_model = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        path = locate_gguf()
        hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    rows = []
    for mode in ("per_request", "batched"):
        engine.attention = mode
        engine_prefill_seconds(engine, prompts[0], repeats=1)  # warm-up
        seconds = engine_prefill_seconds(engine, prompts[0])
        rows.append({"system": f"iterserve {mode}", "what": f"prefill {PROMPT_TOKENS} tokens", "batch": 1,
                     "tokens_per_second": PROMPT_TOKENS / seconds})
        print(rows[-1], flush=True)
    results: dict[tuple[str, int], float] = {}
    names = {"per_request": "iterserve per_request", "batched": "iterserve batched",
             "transformers": "transformers generate()"}
    for batch in args.batch_sizes:
        # The systems take turns, round after round, and each keeps its best round: a shared
        # machine's slow spells then hit them alike instead of whichever ran during one.
        for _ in range(args.rounds):
            for system in ("per_request", "batched", "transformers"):
                if system == "transformers":
                    if hf_model is None:
                        continue
                    seconds = transformers_decode_seconds(hf_model, prompts[:batch], args.decode_steps)
                else:
                    engine.attention = system
                    seconds = engine_decode_seconds(engine, prompts[:batch], args.decode_steps)
                throughput = batch * args.decode_steps / seconds
                print({"system": names[system], "batch": batch, "tokens_per_second": round(throughput, 1)}, flush=True)
                results[(system, batch)] = max(results.get((system, batch), 0.0), throughput)
        rows += [{"system": names[system], "what": "decode", "batch": batch, "tokens_per_second": results[(system, batch)]}
                 for system in names if (system, batch) in results]

    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, float32"
    lines = [f"# Engine throughput (executor: engine, SmolLM2-135M; {machine})", "",
             f"Command: `.venv/bin/python benchmarks/engine.py --threads {args.threads} --decode-steps {args.decode_steps} "
             f"--rounds {args.rounds}`",
             f"Each system's best of {args.rounds} rounds, the systems taking turns. Load average (1 min) at the start "
             f"and end: {load_at_start:.2f} and {os.getloadavg()[0]:.2f}.",
             f"Prompts: {PROMPT_TOKENS} tokens of real text; decode: {args.decode_steps} steps after the prefill, KV context "
             f"{PROMPT_TOKENS} to {PROMPT_TOKENS + args.decode_steps}.", "",
             "| batch | per-request attention tok/s | batched attention tok/s | transformers generate() tok/s | batched / per-request | batched / transformers |",
             "|---|---|---|---|---|---|"]
    for batch in args.batch_sizes:
        per_request, batched = results[("per_request", batch)], results[("batched", batch)]
        hf = results.get(("transformers", batch))
        lines.append(f"| {batch} | {per_request:.1f} | {batched:.1f} | {hf:.1f} | {batched / per_request:.2f}x | "
                     f"{batched / hf:.2f}x |" if hf else f"| {batch} | {per_request:.1f} | {batched:.1f} | - | "
                     f"{batched / per_request:.2f}x | - |")
    lines += ["", "| prefill | tok/s |", "|---|---|"]
    lines += [f"| {row['system']} | {row['tokens_per_second']:.1f} |" for row in rows if row["what"].startswith("prefill")]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.md").write_text(table)
    (RESULTS / "engine.json").write_text(json.dumps({"executor": "engine", "machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
