"""Decode step time of the packaged SmolLM2-135M (Q4_1 GGUF) with its weights dequantized to a dtype
or kept packed (`--quantization gguf`, services/worker/quantized.py) and multiplied by torch's int4
kernel or the project's own (services/worker/cpu_kernels.cpp, where it builds), the engines taking
turns in one process so a slow spell of the machine hits all alike; also the torch profiler's top
ops of one packed step, and each engine's weight bytes.

    .venv/bin/python benchmarks/quantized.py [--batch-sizes 1 2 4 16 64] [--rounds 3] [--name quantized_amd]

Writes benchmarks/results/NAME.md.
"""

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine import engine_decode_seconds  # noqa: E402
from services.bench.runner import machine_info  # noqa: E402
from services.worker import cpu_kernels  # noqa: E402
from services.worker.engine import Engine, weight_bytes  # noqa: E402
from shared.config import Settings  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = {  # name: (dtype, quantization, packed kernel)
    "float32": ("float32", "none", "int4"),
    "bfloat16": ("bfloat16", "none", "int4"),
    "packed, bfloat16": ("bfloat16", "gguf", "int4"),
    "packed, own kernel, float32": ("float32", "gguf", "native"),
}
# Where the CPU has AVX-512 the own kernel runs its 512-bit form; its AVX2 form is measured beside it.
AVX2_FORM = "packed, own kernel (AVX2 form), float32"
# Packed in float32 through torch's kernel is a reference for exactness (tests/test_models.py), not a
# speed: it has no fast float32 path (148 ms a 1-row step, 603 ms a 4-row one, on an AMD EPYC with AVX-512).
SLOW = {"packed, float32": ("float32", "gguf", "int4")}
OWN = "packed, own kernel, float32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=3, help="turns each engine takes per batch size (best kept)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="quantized")
    parser.add_argument("--with-packed-float32", action="store_true", help="also packed in float32 (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    blocks = max(args.batch_sizes) * ((args.context + args.steps) // 16 + 2)
    engines = {}
    for name, (dtype, quantization, kernel) in (ENGINES | (SLOW if args.with_packed_float32 else {})).items():
        if kernel == "native" and not cpu_kernels.loaded():
            print(f"{name}: not measured, the project's kernels do not build here (see the log)", flush=True)
            continue
        os.environ[cpu_kernels.CHOICE] = kernel  # (read as each projection is packed)
        engines[name] = Engine.from_settings(Settings(kv_blocks=blocks, dtype=dtype, quantization=quantization,
                                                      device="cpu"))
    os.environ.pop(cpu_kernels.CHOICE)
    widest = cpu_kernels.vector_bits() if OWN in engines else 256
    if widest == 512:
        engines[AVX2_FORM] = engines[OWN]  # (the same weights: the form is the process's, set at its turn)
    rows = []
    for batch in args.batch_sizes:
        prompts = [[100 + (index + position) % 40000 for position in range(args.context)] for index in range(batch)]
        best = dict.fromkeys(engines, float("inf"))
        for _ in range(args.rounds):
            for name, engine in engines.items():
                if name in (OWN, AVX2_FORM):
                    cpu_kernels.vector_bits(256 if name == AVX2_FORM else widest)
                best[name] = min(best[name], engine_decode_seconds(engine, prompts, args.steps) / args.steps)
        rows.append((batch, best))
        print(f"batch {batch}: " + ", ".join(f"{name} {1000 * seconds:.1f} ms" for name, seconds in best.items()),
              flush=True)
    one = rows[0][1]
    lines = [f"# Decode steps with the weights dequantized or kept packed (executor: engine, SmolLM2-135M Q4_1)", "",
             f"{machine_info()['cpu']}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}; "
             f"context {args.context} tokens, best of {args.rounds} turns of {args.steps} steps; "
             f"`.venv/bin/python benchmarks/quantized.py {shlex.join(sys.argv[1:])}` ({time.time() - started:.0f} s).", "",
             "| rows | " + " | ".join(f"{name} (ms)" for name in engines) + " | packed bfloat16 / float32 |"
             + (" own kernel / float32 | own kernel / packed bfloat16 |" if OWN in engines else ""),
             "|---|" + "---|" * (len(engines) + 1 + 2 * (OWN in engines))]
    for batch, best in rows:
        lines.append(f"| {batch} | " + " | ".join(f"{1000 * seconds:.1f}" for seconds in best.values())
                     + f" | {best['float32'] / best['packed, bfloat16']:.2f}x faster |"
                     + (f" {best['float32'] / best[OWN]:.2f}x faster | {best['packed, bfloat16'] / best[OWN]:.2f}x "
                        "faster |" if OWN in engines else ""))
    lines += ["", "A step of N rows over a 1-row step: " + "; ".join(
        f"{name} " + " / ".join(f"{best[name] / one[name]:.2f}" for _, best in rows) for name in engines), "",
        "Weight bytes as held: " + ", ".join(f"{name} {weight_bytes(engine.model) / 1e6:.0f} MB"
                                             for name, engine in engines.items())]
    prompts = [[100 + position for position in range(args.context)]]
    if OWN in engines:
        cpu_kernels.vector_bits(widest)
    for name in ("packed, bfloat16", OWN)[:1 + (OWN in engines)]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine_decode_seconds(engines[name], prompts, args.steps)
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
        lines += ["", f"{name.capitalize()}, 1 row: one prefill of {args.context} tokens and {args.steps} decode "
                  "steps, the torch profiler's top ops:", "", "```", table.strip(), "```"]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
