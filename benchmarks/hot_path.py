"""Per-step costs around the model, at one request per row (issue: the hot path at accelerator speed).

1. Host time per decode step at batch 64 with the model's forward stubbed (a preallocated logits
   tensor comes back at once): everything a step costs besides the model itself, item parsing and
   validation, KV bookkeeping, index arrays, attention metadata, sampling (greedy, so sampling is
   one argmax), the token copy.
2. Torch ops dispatched per decode step at batch 16 (torch profiler: every aten op the step
   launches, counted), eager and with --compile.

    .venv/bin/python benchmarks/hot_path.py [--threads 2]

Runs against whatever engine the checkout has: run it in a worktree of an older commit to get the
numbers before a change (side by side, as every table in docs/benchmarks.md was made).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.worker.engine import Engine  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.messages import SamplingParams, StepItem  # noqa: E402

GREEDY = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
PROMPT = tuple(range(1, 200))


def engine(compile: bool = False) -> Engine:
    settings = Settings(kv_blocks=2048, device="cpu")
    if compile:
        settings = settings.model_copy(update={"compile": True})
    return Engine.from_settings(settings)


def fill(instance: Engine, batch: int) -> None:
    instance.reset()
    for index in range(batch):
        instance.add_request(f"r{index}", GREEDY)
        instance.step([StepItem(request_id=f"r{index}", token_ids=PROMPT, start_position=0, sample=True,
                                output_index=0)])


def decode_items(batch: int, step: int) -> list[StepItem]:
    return [StepItem(request_id=f"r{index}", token_ids=(5,), start_position=len(PROMPT) + step, sample=True,
                     output_index=step + 1) for index in range(batch)]


def host_ms(instance: Engine, batch: int, steps: int) -> float:
    logits = torch.zeros(batch, instance.config.vocab_size)
    forward = instance.model.forward
    instance.model.forward = lambda token_ids, positions, attention, kv_cache, logit_rows: logits[: logit_rows.numel()]
    try:
        fill(instance, batch)
        for step in range(3):
            instance.step(decode_items(batch, step))
        started = time.perf_counter()
        for step in range(3, 3 + steps):
            instance.step(decode_items(batch, step))
        return 1000 * (time.perf_counter() - started) / steps
    finally:
        instance.model.forward = forward
        instance.reset()


def ops_per_step(instance: Engine, batch: int) -> int:
    fill(instance, batch)
    for step in range(3):  # compiles (when compiled) and warms up here
        instance.step(decode_items(batch, step))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        instance.step(decode_items(batch, 3))
    instance.reset()

    def dispatched(event) -> bool:  # an aten op called from Python (or from compiled code), not from inside another
        parent = event.cpu_parent
        return event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::"))

    return sum(1 for event in profile.events() if dispatched(event))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled engine (compiling takes ~1 min)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    eager = engine()
    rounds = [host_ms(eager, 64, 50) for _ in range(3)]
    print(f"host time per decode step at batch 64, forward stubbed: {min(rounds):.2f} ms (best of 3 rounds of 50)")
    print(f"torch ops dispatched per decode step at batch 16, eager: {ops_per_step(eager, 16)}")
    if not args.no_compile:
        print(f"torch ops dispatched per decode step at batch 16, --compile: {ops_per_step(engine(compile=True), 16)}")


if __name__ == "__main__":
    main()
