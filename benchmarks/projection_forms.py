"""Every projection of a SmolLM2-135M decode step, cold: the 30 layers' weights and the lm head
(538 MB in float32, far more than the caches) multiplied in turn, as a step does, in each form
services/worker/model.py `linear` may take, per row count and dtype: milliseconds per pass (best of
the rounds, the forms taking turns).

    .venv/bin/python benchmarks/projection_forms.py [--rows 1 2 4 8 16 32] [--rounds 3]

Forms: `x @ W.T`; `skinny`, (W @ x.T).T; for one row, `row copied` (the row twice, a real second
row) and `row broadcast` (x.expand(2, -1): a stride-0 second row). benchmarks/projection_shapes.py
times one projection alone (hot in the caches), which hides what streaming the weights costs;
benchmarks/projections.py times whole decode steps.
"""

import argparse
import time

import torch

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576

def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows added up to `rows` (a row's result depends on its own row only)."""
    return x if x.shape[0] >= rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


FORMS = {
    "x @ W.T": lambda x, w: x @ w.T,
    "skinny": lambda x, w: (w @ x.T).T.contiguous(),
    # rows added up to a multiple of 4 below 12 (x @ W.T), or up to 12 (skinny): the counts whose
    # rows an AMD Zen 5's float32 kernels compute as in any larger step (benchmarks/row_exactness.py)
    "x @ W.T to 4k": lambda x, w: (padded(x, -(-x.shape[0] // 4) * 4) @ w.T)[:x.shape[0]],
    "skinny to 12": lambda x, w: (w @ padded(x, 12).T)[:, :x.shape[0]].T.contiguous(),
    "row copied": lambda x, w: (w @ x.repeat(2, 1).T)[:, :1].T.contiguous(),
    "row broadcast": lambda x, w: (w @ x.expand(2, -1).T)[:, :1].T.contiguous(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=4, help="passes over all the weights per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator().manual_seed(0)
        weights = [torch.randn(out, inner, generator=generator).to(dtype)
                   for _ in range(LAYERS) for out, inner in LAYER] + [torch.randn(VOCAB, HIDDEN).to(dtype)]
        for rows in args.rows:
            inputs = {inner: torch.randn(rows, inner).to(dtype) for inner in (576, 1536)}
            forms = {name: form for name, form in FORMS.items() if rows == 1 or not name.startswith("row")}
            best = dict.fromkeys(forms, float("inf"))
            for _ in range(args.rounds):
                for name, form in forms.items():
                    for weight in weights:  # a warm-up pass
                        form(inputs[weight.shape[1]], weight)
                    started = time.perf_counter()
                    for _ in range(args.passes):
                        for weight in weights:
                            form(inputs[weight.shape[1]], weight)
                    best[name] = min(best[name], (time.perf_counter() - started) / args.passes)
            print(f"{str(dtype)[6:]:9} {rows:3} rows: " + "  ".join(f"{name} {1000 * seconds:6.1f} ms"
                                                                  for name, seconds in best.items()), flush=True)


if __name__ == "__main__":
    main()
