"""One projection of SmolLM2-135M's shapes alone, both forms (x @ W.T and (W @ x.T).T), float32 and
bfloat16, 1-16 rows: microseconds per call (best of 3 rounds), printed as rows:x@W.T/skinny.

    .venv/bin/python benchmarks/projection_shapes.py

Says which BLAS path a shape and row count take on this host (benchmarks/projections.py measures
whole decode steps); benchmarks/results/projections.md holds both, per host class.
"""
import torch, time
torch.set_num_threads(2)
shapes = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576), "gate+up fused 3072x576": (3072,576)}
def t(f, n=200):
    for _ in range(10): f()
    best = 1e9
    for _ in range(3):
        s = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - s) / n)
    return best * 1e6
for dtype in (torch.float32, torch.bfloat16):
    for name, (o, i) in shapes.items():
        W = torch.randn(o, i, dtype=dtype)
        row = []
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, i, dtype=dtype)
            a = t(lambda: torch.nn.functional.linear(x, W), 50 if o > 10000 else 300)
            b = t(lambda: (W @ x.T).T, 50 if o > 10000 else 300)
            row.append(f"{rows}:{a:.0f}/{b:.0f}")
        print(f"{str(dtype)[6:]:9} {name:24}", "  ".join(row), flush=True)
