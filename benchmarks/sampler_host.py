"""What sampling costs the host per step, inside the real engine: eager ops, the points a GPU would
wait for the host (syncs), and the step's host time, at decode batches of 16 and 64.

    .venv/bin/python benchmarks/sampler_host.py [--threads 1] [--steps 40] [--context 400]

A tiny random model (2 layers, hidden 64) with SmolLM2's vocabulary (49152), so the step is mostly
the engine's own host work and the sampler's passes over the logits, on the CPU. Two mixes of rows:
all greedy, and mixed (greedy; temperature 0.8 with top_p 0.95; with top_k 50; with all three
penalties; with 5 logprobs, in turn), every row `--context` tokens into its request. Syncs are the
ops whose result the host must read before it goes on (aten::nonzero's data-dependent shape,
aten::_local_scalar_dense: .item() and bool()); the step's last fetch of its tokens is one more.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.messages import SamplingParams, StepItem  # noqa: E402
from tests.engine_helpers import TINY_CONFIG, tiny_engine  # noqa: E402

SYNC_OPS = ("aten::nonzero", "aten::_local_scalar_dense")
MIXES = {
    "greedy": [SamplingParams(max_tokens=10_000, ignore_eos=True)],
    "mixed": [SamplingParams(max_tokens=10_000, ignore_eos=True),
              SamplingParams(max_tokens=10_000, temperature=0.8, top_p=0.95, seed=1),
              SamplingParams(max_tokens=10_000, temperature=0.8, top_k=50, seed=2),
              SamplingParams(max_tokens=10_000, temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.1, seed=3),
              SamplingParams(max_tokens=10_000, temperature=0.8, logprobs=5, seed=4)],
}


def run(batch: int, mix: str, steps: int, context: int) -> dict:
    config = TINY_CONFIG.__class__(**{**TINY_CONFIG.__dict__, "vocab_size": 49152, "context_length": 4096})
    engine = tiny_engine(kv_blocks=batch * (context + steps + 16) // 16 + 16, kv_block_size=16, config=config,
                         max_batch_size=batch)
    params = MIXES[mix]
    last = {}
    for row in range(batch):
        request_id = f"r{row}"
        engine.add_request(request_id, params[row % len(params)])
        prompt = tuple((row * 7919 + index * 104729) % 49000 + 100 for index in range(context))
        last[request_id] = engine.step([StepItem(request_id, prompt, 0, True, 0)]).tokens[request_id]

    def step(index: int) -> None:
        items = [StepItem(request_id, (), context + index, True, index + 1, True) for request_id in last]
        engine.step(items)

    for index in range(3):  # warm
        step(index)
    seconds = []
    for index in range(3, steps + 3):
        started = time.perf_counter()
        step(index)
        seconds.append(time.perf_counter() - started)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step(steps + 3)
    events = [event for event in profile.events() if event.name.startswith("aten::")]
    top_level = [event for event in events if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")]
    return {"batch": batch, "mix": mix, "step_ms": 1000 * statistics.median(seconds),
            "eager_ops": len(top_level), "syncs": sum(event.name in SYNC_OPS for event in events)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| batch | rows | step (ms, median of {args.steps}) | eager ops | syncs besides the token fetch |")
    print("|---|---|---|---|---|")
    for batch in (16, 64):
        for mix in MIXES:
            row = run(batch, mix, args.steps, args.context)
            print(f"| {row['batch']} | {row['mix']} | {row['step_ms']:.2f} | {row['eager_ops']} | {row['syncs']} |")


if __name__ == "__main__":
    main()
