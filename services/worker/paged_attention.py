"""Decode attention that reads the paged KV pool in place: a Triton kernel (CUDA).

A decode-only step in fixed shapes (StaticDecode, what CUDA graphs replay) has one query per row.
Without this kernel each layer first gathers every row's blocks out of the pool into a step-local
buffer (two copies of the context's K and V per layer per step, then SDPA over them). Here each
program takes one (row, KV head), walks the row's block table and reads K and V straight from the
pool's blocks, with an online softmax in float32 (vLLM's PagedAttention V1 and FlashAttention's
decode split the same way, without the split over the context). The query heads that share a KV
head are one program's [group, head_dim] tile, so grouped-query attention reads K and V once.

No tensor-core dot: a decode tile is [group, block_size] (group can be 1, below tl.dot's minimum
of 16), so the products are elementwise and reduced, exact in float32 and fast enough at one query
per head. The loop runs over the bucket's width (a compile-time constant: one kernel per context
bucket, as one graph per bucket) and skips the blocks past a row's length.

Tested without a GPU in Triton's interpreter (TRITON_INTERPRET=1: numpy executes the kernel),
which is also why `usable` accepts the CPU then; on CUDA benchmarks/gpu_check.py checks graph
replays, which run this kernel, against eager steps, and the engine runs `self_check` before it
takes the kernel (a wrong or failing kernel leaves the gathering path in use).
"""

import functools
import logging
import os

import torch

log = logging.getLogger("iterserve.worker")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(q_ptr, key_ptr, value_ptr, tables_ptr, lengths_ptr, out_ptr,
                            q_row_stride, q_head_stride, slot_stride, pool_head_stride, table_row_stride,
                            out_row_stride, scale,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, WIDTH: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        heads = tl.arange(0, GROUP_P)
        dims = tl.arange(0, DIM_P)
        tokens = tl.arange(0, BLOCK_P)
        head_ok = heads < GROUP
        dim_ok = dims < HEAD_DIM
        q_heads = kv_head * GROUP + heads
        q_mask = head_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptr + row * q_row_stride + q_heads[:, None] * q_head_stride + dims[None, :], mask=q_mask,
                    other=0.0).to(tl.float32) * scale  # [GROUP_P, DIM_P]
        length = tl.load(lengths_ptr + row)
        running_max = tl.full([GROUP_P], float("-inf"), tl.float32)
        denominator = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
        for j in range(WIDTH):
            if j * BLOCK_SIZE < length:  # (block 0 always is: a row attends to at least one token)
                block = tl.load(tables_ptr + row * table_row_stride + j).to(tl.int64)
                token_ok = (tokens < BLOCK_SIZE) & (j * BLOCK_SIZE + tokens < length)
                offsets = (block * BLOCK_SIZE + tokens)[:, None] * slot_stride + kv_head * pool_head_stride \
                    + dims[None, :]
                kv_mask = token_ok[:, None] & dim_ok[None, :]
                keys = tl.load(key_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_P, DIM_P]
                scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [GROUP_P, BLOCK_P]
                scores = tl.where(token_ok[None, :], scores, float("-inf"))
                new_max = tl.maximum(running_max, tl.max(scores, axis=1))
                weights = tl.exp(scores - new_max[:, None])
                rescale = tl.exp(running_max - new_max)
                values = tl.load(value_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
                acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
                denominator = denominator * rescale + tl.sum(weights, axis=1)
                running_max = new_max
        out = acc / denominator[:, None]
        tl.store(out_ptr + row * out_row_stride + q_heads[:, None] * HEAD_DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)

    return paged_decode_kernel


def usable(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int,
           block_size: int) -> bool:
    """Whether decode steps of this model on this device can read the pool in place: CUDA with Triton
    (which CUDA builds of torch bring), or Triton's interpreter (a test on the CPU), and the kernel,
    compiled for this shape, passes a self-check against plain attention on the device. A kernel that
    fails to build or to agree is logged and not used (the gathering path is): a GPU it was never
    run on cannot make the engine crash or answer wrong."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        error = self_check(device, dtype, n_heads, n_kv_heads, head_dim, block_size)
    except Exception as failure:  # no Triton, one this torch cannot use, or a kernel that does not compile
        log.warning("event=paged_decode_kernel_unavailable device=%s error=%r", device, failure)
        return False
    tolerance = SELF_CHECK_TOLERANCE.get(dtype, SELF_CHECK_TOLERANCE[torch.bfloat16])
    if not error <= tolerance:  # (NaN fails too)
        log.error("event=paged_decode_kernel_self_check_failed device=%s dtype=%s relative_error=%.2e tolerance=%.0e",
                  device, dtype, error, tolerance)
        return False
    log.info("event=paged_decode_kernel device=%s dtype=%s relative_error=%.1e", device, dtype, error)
    return True


# The kernel accumulates in float32: against float32 math it differs by rounding; in a 16-bit dtype
# by at most one step of the output (2^-7 of it in bfloat16).
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def self_check(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int,
               block_size: int) -> float:
    """The kernel on random data of the model's head shape against softmax attention in float32 over
    the same blocks gathered: the largest error relative to the output (at least 1)."""
    from services.worker.attention import gather_blocks  # (that module imports this one)

    generator = torch.Generator().manual_seed(0)
    rows, width, pool_blocks = 3, 3, 12
    shape = (pool_blocks * block_size, n_kv_heads, head_dim)
    key_pool, value_pool = (torch.randn(shape, generator=generator).to(device, dtype) for _ in range(2))
    q = torch.randn(rows, n_heads, head_dim, generator=generator).to(device, dtype)
    tables = torch.randperm(pool_blocks, generator=generator)[: rows * width].view(rows, width).to(device)
    lengths = torch.tensor([1, width * block_size, block_size + 1], device=device)
    out = paged_decode(q, key_pool, value_pool, tables, lengths, block_size).float()
    group = n_heads // n_kv_heads
    worst = 0.0
    for row in range(rows):
        length = int(lengths[row])
        keys, values = (gather_blocks(pool, tables[row], block_size)[:length].float()  # [Hq, C, D] each
                        .repeat_interleave(group, dim=1).transpose(0, 1) for pool in (key_pool, value_pool))
        scores = (q[row].float().unsqueeze(1) @ keys.transpose(1, 2)) * head_dim ** -0.5  # [Hq, 1, C]
        expected = (scores.softmax(dim=-1) @ values).reshape(-1)
        worst = max(worst, ((out[row] - expected).abs() / expected.abs().clamp(min=1.0)).max().item())
    return worst


def _power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def paged_decode(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
                 context_lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """q [B, Hq, D] (one query per row), this layer's pools [slots, Hkv, D], block_tables [B, width]
    (a row's blocks in order; entries past its length are not read), context_lengths [B] (at least 1)
    -> [B, Hq*D]: softmax(q K^T / sqrt(D)) V over each row's first context_lengths tokens."""
    kernel = _kernel()
    rows, n_heads, head_dim = q.shape
    n_kv_heads = key_pool.shape[1]
    group = n_heads // n_kv_heads
    if key_pool.stride(2) != 1 or q.stride(2) != 1 or value_pool.stride() != key_pool.stride():
        raise ValueError("paged_decode needs the head dimension contiguous and both pools laid out alike")
    out = q.new_empty(rows, n_heads * head_dim)
    kernel[(rows, n_kv_heads)](
        q, key_pool, value_pool, block_tables, context_lengths, out,
        q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), block_tables.stride(0), out.stride(0),
        head_dim ** -0.5,
        GROUP=group, GROUP_P=_power_of_two(group), HEAD_DIM=head_dim, DIM_P=_power_of_two(head_dim),
        BLOCK_SIZE=block_size, BLOCK_P=_power_of_two(block_size), WIDTH=block_tables.shape[1])
    return out
