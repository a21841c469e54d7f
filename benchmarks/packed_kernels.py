"""The packed-weight kernels alone: SmolLM2-135M's projections (30 layers of fused Q/K/V, output,
fused gate/up and down) and its lm head, summed over one step, at each row count, for torch's int4
kernel (bfloat16 x) and each form of the project's kernel (services/worker/cpu_kernels.cpp, float32
x: its AVX-512 form where the CPU has it, and its AVX2 form), taking turns so a slow spell of the
machine hits all alike; best of --rounds. Random weights of the file's types (Q4_1 matrices, a Q8_0
lm head; torch's kernel takes the lm head as 4-bit, as one of its two parts).

    .venv/bin/python benchmarks/packed_kernels.py [--rows 1 2 4 8 16] [--rounds 9] [--name packed_kernels_intel]

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

from services.bench.runner import machine_info  # noqa: E402
from services.worker import cpu_kernels  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, FFN, LAYERS, VOCAB, QKV = 576, 1536, 30, 49152, 576 + 2 * 192
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]  # [N, K] of each projection
GROUP = 32


def own_weights() -> tuple[list, tuple]:
    def nibbles(n: int, k: int):
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), (torch.rand(n, k // GROUP) / 100).half(),
                (torch.rand(n, k // GROUP) / 100).half())

    head = (torch.randint(-128, 128, (VOCAB, HIDDEN), dtype=torch.int8),
            (torch.rand(VOCAB, HIDDEN // GROUP) / 100).half())
    return [[nibbles(n, k) for n, k in SHAPES] for _ in range(LAYERS)], head


def int4_weights() -> tuple[list, tuple]:
    def packed(n: int, k: int):
        q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                (torch.rand(k // GROUP, n, 2) / 100).bfloat16())

    return [[packed(n, k) for n, k in SHAPES] for _ in range(LAYERS)], packed(VOCAB, HIDDEN)


def own_step(weights, rows: int) -> None:
    layers, head = weights
    x = {k: torch.randn(rows, k) for k in (HIDDEN, FFN)}
    for layer in layers:
        for (_, k), (q, scales, offsets) in zip(SHAPES, layer):
            cpu_kernels.nibble_mm(x[k], q, scales, offsets, 0)
    cpu_kernels.byte_mm(x[HIDDEN], *head)


def int4_step(weights, rows: int) -> None:
    layers, (head, head_scales) = weights
    x = {k: torch.randn(rows, k).bfloat16() for k in (HIDDEN, FFN)}
    for layer in layers:
        for (_, k), (packed, scales_and_zeros) in zip(SHAPES, layer):
            torch.ops.aten._weight_int4pack_mm_for_cpu(x[k], packed, GROUP, scales_and_zeros)
    torch.ops.aten._weight_int4pack_mm_for_cpu(x[HIDDEN], head, GROUP, head_scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="packed_kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    kernels = {"torch's int4, bfloat16": (int4_step, int4_weights(), None)}
    if cpu_kernels.loaded():
        widest, own = cpu_kernels.vector_bits(), own_weights()
        kernels[f"own, {'AVX-512' if widest == 512 else 'AVX2'} form, float32"] = (own_step, own, widest)
        if widest == 512:
            kernels["own, AVX2 form, float32"] = (own_step, own, 256)
    else:
        print("the project's kernels do not build here (see the log): torch's alone", flush=True)
    table = []
    for rows in args.rows:
        best = dict.fromkeys(kernels, float("inf"))
        for turn in range(args.rounds + 1):  # (the first turn warms up)
            for name, (step, weights, bits) in kernels.items():
                if bits:
                    cpu_kernels.vector_bits(bits)
                began = time.perf_counter()
                step(weights, rows)
                if turn:
                    best[name] = min(best[name], time.perf_counter() - began)
        table.append((rows, best))
        print(f"{rows} rows: " + ", ".join(f"{name} {1000 * seconds:.1f} ms" for name, seconds in best.items()),
              flush=True)
    lines = ["# Packed-weight kernels alone, one step's projections and lm head (executor: engine, SmolLM2-135M's "
             "shapes)", "",
             f"{machine_info()['cpu']}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}; "
             f"best of {args.rounds} turns; `.venv/bin/python benchmarks/packed_kernels.py {shlex.join(sys.argv[1:])}` "
             f"({time.time() - started:.0f} s).", "",
             "| rows | " + " | ".join(f"{name} (ms)" for name in kernels) + " |", "|---|" + "---|" * len(kernels)]
    lines += [f"| {rows} | " + " | ".join(f"{1000 * seconds:.1f}" for seconds in best.values()) + " |"
              for rows, best in table]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
