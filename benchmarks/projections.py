"""Decode step time with the skinny projections (services/worker/model.py `linear`) on and off,
alternating in one process so a slow spell of the machine hits both alike.

    .venv/bin/python benchmarks/projections.py [--batch-sizes 1 2 4 16 64] [--rounds 3] [--context 300]

Prints one line per batch size: the best mean step time of each variant and their ratio (the
engine's own choice on this host is model.SKINNY_FLOAT32: float32 takes the skinny form only off
Intel's MKL).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services.worker.model as model  # noqa: E402
from benchmarks.engine import engine_decode_seconds  # noqa: E402
from services.worker.engine import Engine  # noqa: E402
from shared.config import Settings  # noqa: E402

VARIANTS = {"x @ W.T": 0, "(W @ x.T).T up to 64 rows": model.SKINNY_ROWS}


def decode_step_seconds(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Mean decode step of `batch` requests whose KV holds `context` tokens (prefill excluded)."""
    prompts = [[100 + (index + position) % 40000 for position in range(context)] for index in range(batch)]
    return engine_decode_seconds(engine, prompts, steps) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=3, help="turns each variant takes per batch size (best kept)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (float32, bfloat16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks_per_request = (args.context + args.steps) // 16 + 2
    engine = Engine.from_settings(Settings(kv_blocks=max(args.batch_sizes) * blocks_per_request, dtype=args.dtype))
    try:
        for batch in args.batch_sizes:
            best = {name: float("inf") for name in VARIANTS}
            for _ in range(args.rounds):
                for name, rows in VARIANTS.items():
                    model.SKINNY_ROWS, model.SKINNY_FLOAT32 = rows, True
                    best[name] = min(best[name], decode_step_seconds(engine, batch, args.context, args.steps))
            old, new = (1000 * best[name] for name in VARIANTS)
            print(f"batch {batch}: x @ W.T {old:.1f} ms, skinny {new:.1f} ms, {old / new:.2f}x", flush=True)
    finally:
        model.SKINNY_ROWS, model.SKINNY_FLOAT32 = VARIANTS["(W @ x.T).T up to 64 rows"], not model._intel_cpu()


if __name__ == "__main__":
    main()
