"""Attention of one step, split per request against each request's own paged KV.

Two interchangeable paths (Settings.attention):
- "per_request": Orca's reference: one attention call per request per layer.
- "batched": requests padded into at most two groups (decode tokens, and prompt chunks),
  one masked attention call per group per layer, no Python loop over requests.

Grouped-query attention without copying K/V: the query heads that share a KV head are
folded into the query-length axis, so K and V keep their Hkv heads ([B, Hkv, G*L, D]).
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

AttentionMode = Literal["batched", "per_request"]


@dataclass(frozen=True)
class RequestSpan:
    """One request's queries in the step and the KV they attend to."""

    query_start: int  # first row of this request in the step's [T, ...] tensors
    query_count: int  # L: tokens of this request in the step
    context_slots: torch.Tensor  # [C]: pool slots of positions 0 .. start + L - 1
    mask: torch.Tensor | None  # [G*L, C] bool, True = may attend; None when L == 1


@dataclass(frozen=True)
class PaddedGroup:
    """Requests padded to a common query count and context length."""

    query_rows: torch.Tensor  # [B*Lmax]: row of each padded query in q (T = an all-zero row)
    context_slots: torch.Tensor  # [B, Cmax]: pool slots (padding points at slot 0, masked)
    mask: torch.Tensor  # [B, 1, G*Lmax, Cmax] bool
    max_queries: int  # Lmax
    real_rows: torch.Tensor  # [n]: positions in the padded B*Lmax queries that are real
    token_rows: torch.Tensor  # [n]: their rows in the step's [T, ...] output
    # Reused by every layer: a fresh multi-MB tensor per gather costs page faults.
    key_buffer: torch.Tensor  # [B*Cmax, Hkv*D]
    value_buffer: torch.Tensor


@dataclass(frozen=True)
class AttentionBatch:
    mode: AttentionMode
    num_tokens: int  # T
    slot_mapping: torch.Tensor  # [T]: where each new token's K and V are written
    spans: tuple[RequestSpan, ...]
    groups: tuple[PaddedGroup, ...]


def causal_mask(start: int, query_count: int, group: int, device: torch.device) -> torch.Tensor:
    """[G*L, start+L]: query i (position start+i) sees positions 0 .. start+i; rows (g, i)."""
    positions = torch.arange(start + query_count, device=device)
    query_positions = torch.arange(start, start + query_count, device=device)
    mask = positions.unsqueeze(0) <= query_positions.unsqueeze(1)  # [L, C]
    return mask.repeat(group, 1)


def build_batch(
    mode: AttentionMode,
    requests: list[tuple[int, int, int, list[int]]],  # (query_start, L, start position, context slots)
    slot_mapping: list[int],
    group: int,  # G = query heads per KV head
    kv_width: int,  # Hkv * D
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionBatch:
    """Everything attention needs for one step, built once and shared by all layers."""
    num_tokens = len(slot_mapping)
    slot_tensor = torch.tensor(slot_mapping, dtype=torch.long, device=device)
    if mode == "per_request":
        spans = tuple(
            RequestSpan(
                query_start, count, torch.tensor(slots, dtype=torch.long, device=device),
                None if count == 1 else causal_mask(start, count, group, device),
            )
            for query_start, count, start, slots in requests
        )
        return AttentionBatch(mode, num_tokens, slot_tensor, spans, ())
    decodes = [request for request in requests if request[1] == 1]
    chunks = [request for request in requests if request[1] > 1]
    groups = tuple(
        _padded_group(members, num_tokens, group, kv_width, device, dtype) for members in (decodes, chunks) if members
    )
    return AttentionBatch(mode, num_tokens, slot_tensor, (), groups)


def _padded_group(members, num_tokens: int, group: int, kv_width: int, device: torch.device,
                  dtype: torch.dtype) -> PaddedGroup:
    max_queries = max(count for _, count, _, _ in members)
    max_context = max(len(slots) for _, _, _, slots in members)
    query_rows, context_slots, real_rows, token_rows = [], [], [], []
    mask = torch.zeros(len(members), 1, group, max_queries, max_context, dtype=torch.bool)
    for b, (query_start, count, start, slots) in enumerate(members):
        query_rows += list(range(query_start, query_start + count)) + [num_tokens] * (max_queries - count)
        context_slots.append(slots + [0] * (max_context - len(slots)))
        real_rows += range(b * max_queries, b * max_queries + count)
        token_rows += range(query_start, query_start + count)
        mask[b, 0, :, :count, : start + count] = causal_mask(start, count, 1, torch.device("cpu"))
        mask[b, 0, :, count:, 0] = True  # padding queries look at one slot: no all-masked row
    return PaddedGroup(
        query_rows=torch.tensor(query_rows, dtype=torch.long, device=device),
        context_slots=torch.tensor(context_slots, dtype=torch.long, device=device),
        mask=mask.view(len(members), 1, group * max_queries, max_context).to(device),
        max_queries=max_queries,
        real_rows=torch.tensor(real_rows, dtype=torch.long, device=device),
        token_rows=torch.tensor(token_rows, dtype=torch.long, device=device),
        key_buffer=torch.empty(len(members) * max_context, kv_width, device=device, dtype=dtype),
        value_buffer=torch.empty(len(members) * max_context, kv_width, device=device, dtype=dtype),
    )


def gather_slots(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """pool[slots] ([S, Hkv, D] -> [N, Hkv, D]); index_select on a 2-D view is several times
    faster than advanced indexing on the CPU."""
    flat = pool.view(pool.shape[0], -1)
    gathered = flat.index_select(0, slots) if out is None else torch.index_select(flat, 0, slots, out=out)
    return gathered.view(slots.numel(), *pool.shape[1:])


def attend(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """q [T, Hq, D], pools [slots, Hkv, D] (this step's K/V already written) -> [T, Hq*D]."""
    num_tokens, n_heads, head_dim = q.shape
    n_kv_heads = key_pool.shape[1]
    group = n_heads // n_kv_heads
    out = q.new_empty(num_tokens, n_heads * head_dim)
    for span in batch.spans:
        count = span.query_count
        q_r = q[span.query_start : span.query_start + count].view(count, n_kv_heads, group, head_dim)
        q_r = q_r.permute(1, 2, 0, 3).reshape(1, n_kv_heads, group * count, head_dim)
        k_r = gather_slots(key_pool, span.context_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
        v_r = gather_slots(value_pool, span.context_slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=span.mask)
        o = o.view(n_kv_heads, group, count, head_dim).permute(2, 0, 1, 3)
        out[span.query_start : span.query_start + count] = o.reshape(count, n_heads * head_dim)
    if batch.groups:
        q_padded_source = torch.cat([q, q.new_zeros(1, n_heads, head_dim)])
    for padded in batch.groups:
        b, max_context = padded.context_slots.shape
        lmax = padded.max_queries
        q_g = q_padded_source[padded.query_rows].view(b, lmax, n_kv_heads, group, head_dim)
        q_g = q_g.permute(0, 2, 3, 1, 4).reshape(b, n_kv_heads, group * lmax, head_dim)
        flat_slots = padded.context_slots.view(-1)
        k_g = gather_slots(key_pool, flat_slots, padded.key_buffer).view(b, max_context, n_kv_heads, head_dim).transpose(1, 2)
        v_g = gather_slots(value_pool, flat_slots, padded.value_buffer).view(b, max_context, n_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=padded.mask)  # [b, Hkv, G*Lmax, D]
        o = o.view(b, n_kv_heads, group, lmax, head_dim).permute(0, 3, 1, 2, 4).reshape(b * lmax, n_heads * head_dim)
        out[padded.token_rows] = o[padded.real_rows]
    return out
