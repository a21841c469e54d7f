"""Which row counts give a row the same bits as a large projection, on this host: per dtype, form
and thread count. A request's logits are then independent of the step's other rows exactly when
every row count the engine may run is exact (seeded sampling follows any difference, however
small: benchmarks/batch_invariance.py measures what it does to outputs).

    .venv/bin/python benchmarks/row_exactness.py [--threads 1 2 3 4 8] [--rows 64]

For each of SmolLM2-135M's projection shapes and its lm head: the projection of `--rows` counts
(1..N) against the first rows of a 256-row x @ W.T; prints the counts that differ (none: `exact`).
Forms as services/worker/model.py `linear` takes them: `x @ W.T`; `skinny`, (W @ x.T).T; and the
int4 kernel of packed GGUF weights (`--quantization gguf`, bfloat16 activations).
"""

import argparse
import platform

import torch

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate_up, down, lm head
REFERENCE_ROWS = 256


def differing_counts(form, x: torch.Tensor, weight, counts: range) -> list[int]:
    reference = x[:REFERENCE_ROWS] @ weight.T if isinstance(weight, torch.Tensor) else form(x[:REFERENCE_ROWS], weight)
    return [rows for rows in counts if not torch.equal(form(x[:rows], weight), reference[:rows])]


def int4_weight(out: int, inner: int, generator: torch.Generator):
    integers = torch.randint(0, 16, (out, inner), dtype=torch.int32, generator=generator)
    scales = torch.randn(inner // 32, out, 2, generator=generator).bfloat16()
    return torch._convert_weight_to_int4pack_for_cpu(integers, 1), scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    with open("/proc/cpuinfo") as cpuinfo:
        fields = dict(line.split(":", 1) for line in cpuinfo if ":" in line)  # (the last CPU's: all alike)
    model_name = fields.get("model name\t", platform.processor()).strip()
    family = fields.get("cpu family\t", "?").strip()
    print(f"{model_name} (family {family}), torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; row counts 1-{args.rows} against a {REFERENCE_ROWS}-row "
          f"x @ W.T, every shape of SmolLM2-135M")
    counts = range(1, args.rows + 1)
    generator = torch.Generator().manual_seed(0)
    weights = {dtype: [torch.randn(*shape, generator=generator).to(dtype) for shape in SHAPES]
               for dtype in (torch.float32, torch.bfloat16)}
    packed = [int4_weight(*shape, generator) for shape in SHAPES]
    inputs = {inner: torch.randn(REFERENCE_ROWS, inner, generator=generator) for inner in (576, 1536)}
    forms = {
        "x @ W.T": lambda x, w: x @ w.T,
        "skinny": lambda x, w: (w @ x.T).T,
    }
    int4 = lambda x, w: torch._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])  # noqa: E731
    for threads in args.threads:
        torch.set_num_threads(threads)
        results = []
        for dtype, dtype_weights in weights.items():
            for name, form in forms.items():
                differing = sorted({count for weight in dtype_weights
                                    for count in differing_counts(form, inputs[weight.shape[1]].to(dtype), weight, counts)})
                results.append((f"{str(dtype)[6:]} {name}", differing))
        differing = sorted({count for weight in packed
                            for count in differing_counts(int4, inputs[weight[0].shape[1] * 2].bfloat16(), weight, counts)})
        results.append(("int4 (packed GGUF, bfloat16)", differing))
        for name, differing in results:
            print(f"{threads} threads, {name:28}: {'exact' if not differing else 'differ at ' + str(differing)}",
                  flush=True)


if __name__ == "__main__":
    main()
