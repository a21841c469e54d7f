"""The in-place paged decode kernel (services/worker/paged_attention.py) in Triton's interpreter.

Run by tests/test_paged_attention.py in a subprocess whose environment has TRITON_INTERPRET=1 and
Triton on its path (the CPU build of torch brings none): the kernel executes on CPU tensors, so the
checks need no GPU. Exits non-zero on the first failure.

1. The kernel against SDPA over each row's gathered blocks, in float32 (to rounding) and bfloat16
   (to one step of bfloat16 in the output, which the kernel accumulates in float32: the
   interpreter's cast may truncate rather than round), over grouped-query shapes, head
   sizes and block sizes that are and are not powers of two, and context lengths from one token to
   the whole width.
2. The engine's decode-only fixed-shape steps (what CUDA graphs replay) with the kernel reading the
   pool in place equal the per-request path: the same check as the gathering path's test.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.worker.attention import gather_blocks  # noqa: E402
from services.worker.paged_attention import paged_decode, usable  # noqa: E402
from tests.engine_helpers import static_decode_steps_agree_with_the_per_request_path  # noqa: E402

SHAPES = (  # (query heads, KV heads, head dim, block size)
    (4, 2, 16, 4), (3, 1, 24, 16), (8, 8, 64, 16), (9, 3, 8, 5), (15, 5, 64, 16),
)


def gathered_attention(q, key_pool, value_pool, tables, lengths, block_size):
    """paged_decode's contract in plain torch, in float32: per row, its blocks gathered, SDPA over
    its first `length` tokens."""
    rows, n_heads, head_dim = q.shape
    n_kv_heads = key_pool.shape[1]
    out = torch.empty(rows, n_heads * head_dim)
    for row in range(rows):
        length = int(lengths[row])
        keys = gather_blocks(key_pool, tables[row], block_size)[:length].float().transpose(0, 1)  # [Hkv, C, D]
        values = gather_blocks(value_pool, tables[row], block_size)[:length].float().transpose(0, 1)
        queries = q[row].float().view(n_kv_heads, n_heads // n_kv_heads, head_dim)
        out[row] = F.scaled_dot_product_attention(queries, keys, values).reshape(-1)
    return out


def check_kernel() -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 2 ** -7)):
        for n_heads, n_kv_heads, head_dim, block_size in SHAPES:
            rows, width, pool_blocks = 5, 6, 40
            shape = (pool_blocks * block_size, n_kv_heads, head_dim)
            key_pool = torch.randn(shape, generator=generator).to(dtype)
            value_pool = torch.randn(shape, generator=generator).to(dtype)
            q = torch.randn(rows, n_heads, head_dim, generator=generator).to(dtype)
            tables = torch.randperm(pool_blocks, generator=generator)[: rows * width].view(rows, width)
            lengths = torch.tensor([1, width * block_size, 7, block_size, width * block_size - 3])
            out = paged_decode(q, key_pool, value_pool, tables, lengths, block_size)
            expected = gathered_attention(q, key_pool, value_pool, tables, lengths, block_size)
            assert out.dtype == dtype and out.shape == expected.shape
            # relative to the output's magnitude (one step of bfloat16 is 2^-7 of it at most)
            error = ((out.float() - expected).abs() / expected.abs().clamp(min=1.0)).max().item()
            print(f"kernel {str(dtype).removeprefix('torch.')} heads {n_heads}/{n_kv_heads} dim {head_dim} "
                  f"block {block_size}: max relative error {error:.1e}")
            assert error <= tolerance, f"{error} > {tolerance}"
        # The pool's other tokens do not leak in: poisoning every slot outside the rows' contexts
        # changes nothing.
        poisoned_keys, poisoned_values = key_pool.clone(), value_pool.clone()
        used = torch.zeros(key_pool.shape[0], dtype=torch.bool)
        for row in range(rows):
            slots = (tables[row].unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)
            used[slots[: int(lengths[row])]] = True
        poisoned_keys[~used], poisoned_values[~used] = float("nan"), float("nan")
        again = paged_decode(q, poisoned_keys, poisoned_values, tables, lengths, block_size)
        assert torch.equal(again, out), "tokens outside a row's context changed its output"


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (tests/test_paged_attention.py does)")
    for dtype in (torch.float32, torch.bfloat16):  # the engine's own check before it takes the kernel
        assert usable(torch.device("cpu"), dtype, 4, 2, 16, 4), f"the kernel's self-check failed in {dtype}"
    check_kernel()
    # The engine's fixed-shape steps run this very kernel (counted through the name the attention
    # module calls it by), one call per layer per step, and equal the per-request path.
    from services.worker import attention

    calls = []
    kernel = attention.paged_decode

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)

    attention.paged_decode = counted
    try:
        graphs = static_decode_steps_agree_with_the_per_request_path(steps=12)
    finally:
        attention.paged_decode = kernel
    assert graphs.in_place, "the engine's fixed-shape decode steps did not take the in-place kernel"
    layers = 2  # (tests/engine_helpers.TINY_CONFIG)
    assert len(calls) >= layers * graphs.steps, f"{len(calls)} kernel calls for {graphs.steps} steps of {layers} layers"
    print(f"engine: {graphs.steps} fixed-shape decode steps ran the kernel {len(calls)} times, reading the pool in "
          f"place, and equal the per-request path")
    print("ok")


if __name__ == "__main__":
    main()
