"""How often does a request's output depend on its batch? (issue: claims that hold)

The sampler's randomness is batch-invariant (token k of a seeded request depends on its seed and k
only), but the forward pass is not bit-for-bit: a row's logits change in the last bits with the
batch around it (the projections' kernels differ with the number of rows, attention pads to the
batch's longest context) and when its KV is rebuilt by one long prefill instead of token by token.
This measures what that does to outputs: each request is run alone, then inside batches of other
requests that join and leave at staggered steps, then rebuilt mid-way (as after a worker death or
a preemption), and its tokens are compared with the alone run.

    .venv/bin/python benchmarks/batch_invariance.py [--requests 48] [--tokens 48] [--threads 2]

Prints a markdown table and writes benchmarks/results/batch_invariance.{md,json}.
"""

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.worker.engine import Engine  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.messages import SamplingParams, StepItem  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_SIZES = (4, 16, 64)


def prompts(tokenizer: Tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Real-text prompts of 16 to 160 tokens."""
    ids = tokenizer.encode(Path(__file__).resolve().parent.joinpath("corpus.txt").read_text())
    rng = random.Random(seed)
    chosen = []
    for _ in range(count):
        length = rng.randint(16, 160)
        start = rng.randrange(0, len(ids) - length)
        chosen.append(ids[start : start + length])
    return chosen


def sampling(index: int) -> SamplingParams:
    """Half greedy, half seeded sampling at temperature 0.8, top_p 0.95."""
    if index % 2 == 0:
        return SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + index, max_tokens=1 << 20, ignore_eos=True)


class Run:
    """Requests stepped through one engine the way the scheduler plans them: a prefill, then one
    decode item per step; `join_at` staggers arrivals, `rebuild_at` re-prefills prompt + output."""

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.engine, self.tokens = engine, tokens

    def run(self, requests: dict[str, tuple[list[int], SamplingParams]], join_at: dict[str, int],
            rebuild_at: dict[str, int] | None = None) -> dict[str, list[int]]:
        engine = self.engine
        engine.reset()
        rebuild_at = rebuild_at or {}
        outputs: dict[str, list[int]] = {request_id: [] for request_id in requests}
        step = 0
        while any(len(output) < self.tokens for output in outputs.values()):
            items = []
            for request_id, (prompt, params) in requests.items():
                output = outputs[request_id]
                if step < join_at[request_id] or len(output) >= self.tokens:
                    continue
                if step == join_at[request_id]:
                    engine.add_request(request_id, params)
                    items.append(StepItem(request_id=request_id, token_ids=tuple(prompt), start_position=0,
                                          sample=True, output_index=0))
                elif rebuild_at.get(request_id) == len(output):
                    rebuild_at.pop(request_id)  # its KV is lost: prompt + output prefilled again
                    items.append(StepItem(request_id=request_id, token_ids=tuple(prompt + output), start_position=0,
                                          sample=True, output_index=len(output)))
                else:
                    items.append(StepItem(request_id=request_id, token_ids=(output[-1],),
                                          start_position=len(prompt) + len(output) - 1, sample=True,
                                          output_index=len(output)))
            if items:
                outcome = engine.step(items)
                if outcome.errors:
                    raise RuntimeError(f"engine refused items: {outcome.errors}")
                for item in items:
                    outputs[item.request_id].append(outcome.tokens[item.request_id])
                for item in items:
                    if len(outputs[item.request_id]) >= self.tokens:
                        engine.free(item.request_id)
            step += 1
        engine.reset()
        return outputs


def divergence(reference: list[int], other: list[int]) -> int | None:
    """The first output index where the two differ, or None."""
    return next((index for index, (a, b) in enumerate(zip(reference, other)) if a != b), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    tokenizer = Tokenizer.load()
    engine = Engine.from_settings(Settings(kv_blocks=2048, device="cpu", max_batch_size=64))
    chosen = prompts(tokenizer, max(args.requests, max(BATCH_SIZES)))
    requests = {f"r{index}": (prompt, sampling(index)) for index, prompt in enumerate(chosen)}
    measured = list(requests)[: args.requests]
    runner = Run(engine, args.tokens)

    alone = {}
    for request_id in measured:
        alone |= runner.run({request_id: requests[request_id]}, {request_id: 0})
    rows = []

    def compare(case: str, outputs: dict[str, list[int]]) -> None:
        for kind, parity in (("greedy", 0), ("seeded", 1)):
            ids = [request_id for request_id in measured if int(request_id[1:]) % 2 == parity]
            firsts = [divergence(alone[request_id], outputs[request_id]) for request_id in ids]
            diverged = [first for first in firsts if first is not None]
            rows.append({"case": case, "kind": kind, "requests": len(ids), "diverged": len(diverged),
                         "first_divergence": sorted(diverged)})

    rng = random.Random(1)
    for size in BATCH_SIZES:
        outputs: dict[str, list[int]] = {}
        for start in range(0, len(measured), size):  # every measured request in a batch of `size`
            group = measured[start : start + size]
            companions = [request_id for request_id in requests if request_id not in group]
            members = group + rng.sample(companions, max(0, size - len(group)))
            join_at = {request_id: rng.randrange(0, 8) for request_id in members}  # staggered arrivals
            outputs |= runner.run({request_id: requests[request_id] for request_id in members}, join_at)
        compare(f"batch of {size}, staggered joins", outputs)
    rebuilt = runner.run({request_id: requests[request_id] for request_id in measured},
                         {request_id: 0 for request_id in measured},
                         {request_id: rng.randrange(1, args.tokens) for request_id in measured})
    compare(f"batch of {len(measured)}, each rebuilt once mid-way", rebuilt)

    lines = ["# Seeded and greedy outputs across batches and a rebuild (executor: engine, SmolLM2-135M on the CPU)", "",
             f"Command: `.venv/bin/python benchmarks/batch_invariance.py --requests {args.requests} "
             f"--tokens {args.tokens} --threads {args.threads}` ({platform.processor() or platform.machine()}, "
             f"{time.time() - started:.0f} s).",
             f"{args.requests} requests (prompts of 16-160 tokens of real text), {args.tokens} output tokens each, "
             "half greedy, half seeded (temperature 0.8, top_p 0.95); each compared token by token with the same "
             "request run alone.", "",
             "| case | requests | outputs that differ from alone | first differing token (output index) |",
             "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['case']}, {row['kind']} | {row['requests']} | {row['diverged']} | "
                     f"{', '.join(map(str, row['first_divergence'])) or '-'} |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_invariance.md").write_text(text + "\n")
    (args.out / "batch_invariance.json").write_text(json.dumps({"executor": "engine", "rows": rows, "args": vars(args) | {"out": str(args.out)}},
                                                               indent=2) + "\n")


if __name__ == "__main__":
    main()
