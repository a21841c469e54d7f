"""Decode step time with the skinny projections (services/worker/model.py `linear`) on and off,
alternating in one process so a slow spell of the machine hits both alike.

    .venv/bin/python benchmarks/projections.py [--batch-sizes 1 2 4 16 64] [--rounds 3] [--context 300]
    .venv/bin/python benchmarks/projections.py --against-earlier --dtype bfloat16

Prints one line per batch size: the best mean step time of each variant and their ratio (the
engine's own choice on this host is model.SKINNY_FLOAT32 and SKINNY_BFLOAT16: float32 takes the
skinny form only off Intel's MKL, bfloat16 not on AMD's AVX-512 classes, Zen 4 and 5; a one-row projection's padding to
two rows, where the host takes it, stays in both variants). --against-earlier compares instead the
engine's choices on this host with the rules before the AMD AVX-512 classes had their own (every form
skinny up to 64 rows off Intel, a one-row bfloat16 projection as two rows where bfloat16 is native,
a one-row float32 one as one).
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
FLAGS = ("SKINNY_FLOAT32", "SKINNY_BFLOAT16", "PAD_ONE_ROW_FLOAT32", "PAD_ONE_ROW_BFLOAT16")
HOST = {name: getattr(model, name) for name in FLAGS}  # this host's choices
EARLIER = HOST | {"SKINNY_FLOAT32": not model._intel_cpu(), "SKINNY_BFLOAT16": True, "PAD_ONE_ROW_FLOAT32": False}


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
    parser.add_argument("--against-earlier", action="store_true", help="this host's choices against the earlier rules")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks_per_request = (args.context + args.steps) // 16 + 2
    engine = Engine.from_settings(Settings(kv_blocks=max(args.batch_sizes) * blocks_per_request, dtype=args.dtype))
    if args.against_earlier:
        return against_earlier(engine, args)
    try:
        for batch in args.batch_sizes:
            best = {name: float("inf") for name in VARIANTS}
            for _ in range(args.rounds):
                for name, rows in VARIANTS.items():
                    model.SKINNY_ROWS, model.SKINNY_FLOAT32, model.SKINNY_BFLOAT16 = rows, True, True
                    best[name] = min(best[name], decode_step_seconds(engine, batch, args.context, args.steps))
            old, new = (1000 * best[name] for name in VARIANTS)
            print(f"batch {batch}: x @ W.T {old:.1f} ms, skinny {new:.1f} ms, {old / new:.2f}x", flush=True)
    finally:
        model.SKINNY_ROWS = VARIANTS["(W @ x.T).T up to 64 rows"]
        for flag, value in HOST.items():
            setattr(model, flag, value)


def against_earlier(engine: Engine, args: argparse.Namespace) -> None:
    try:
        for batch in args.batch_sizes:
            best = {"earlier": float("inf"), "host": float("inf")}
            for _ in range(args.rounds):
                for name, flags in (("earlier", EARLIER), ("host", HOST)):
                    for flag, value in flags.items():
                        setattr(model, flag, value)
                    best[name] = min(best[name], decode_step_seconds(engine, batch, args.context, args.steps))
            old, new = (1000 * best[name] for name in ("earlier", "host"))
            print(f"{args.dtype} batch {batch}: earlier rules {old:.1f} ms, this host's {new:.1f} ms, {old / new:.2f}x",
                  flush=True)
    finally:
        for flag, value in HOST.items():
            setattr(model, flag, value)


if __name__ == "__main__":
    main()
