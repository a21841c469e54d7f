"""Attention of one step, split per request against each request's own paged KV.

Two interchangeable paths (Settings.attention):
- "per_request": Orca's reference: one attention call per request per layer.
- "batched": requests padded into at most two groups (decode tokens, and prompt chunks),
  one masked attention call per group per layer, no Python loop over requests. The decode
  group reads its context from a DecodeWorkspace (services/worker/decode_workspace.py) when
  the engine has one: contiguous rows kept across steps, so a steady decode batch gathers nothing.

Both read a request's context by whole KV blocks (a block's rows are contiguous in the pool,
so gathering blocks is about twice as fast as gathering token slots on the CPU).
Grouped-query attention without copying K/V: the query heads that share a KV head are
folded into the query-length axis, so K and V keep their Hkv heads ([B, Hkv, G*L, D]).
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

AttentionMode = Literal["batched", "per_request"]


@dataclass(frozen=True)
class StepRequest:
    """One request's part of the step, as the engine hands it to build_batch."""

    query_start: int  # first row of this request in the step's [T, ...] tensors
    query_count: int  # L: tokens of this request in the step
    start_position: int  # tokens already in its KV before this step
    blocks: list[int]  # its block table, covering positions 0 .. start + L - 1


@dataclass(frozen=True)
class RequestSpan:
    """Per-request path: one request's queries and the KV blocks they attend to."""

    query_start: int
    query_count: int
    context_length: int  # C = start + L
    blocks: torch.Tensor  # [nblk]
    mask: torch.Tensor | None  # [G*L, C] bool, True = may attend; None when L == 1


@dataclass(frozen=True)
class PaddedGroup:
    """Batched path: requests padded to a common query count and block count."""

    query_rows: torch.Tensor  # [B*Lmax]: row of each padded query in q (T = an all-zero row)
    blocks: torch.Tensor  # [B, nblk_max]: block tables (padding points at block 0, masked)
    mask: torch.Tensor  # [B, 1, G*Lmax, nblk_max*block_size] bool
    max_queries: int  # Lmax
    real_rows: torch.Tensor  # [n]: positions in the padded B*Lmax queries that are real
    token_rows: torch.Tensor  # [n]: their rows in the step's [T, ...] output
    # Reused by every layer: a fresh multi-MB tensor per gather costs page faults.
    key_buffer: torch.Tensor  # [B*nblk_max, block_size*Hkv*D]
    value_buffer: torch.Tensor


@dataclass(frozen=True)
class WorkspaceGroup:
    """Batched path, decode tokens whose context sits in a DecodeWorkspace, one row each."""

    keys: torch.Tensor  # [layers, rows, Hkv, capacity, D]: the workspace's tensors
    values: torch.Tensor
    token_rows: torch.Tensor  # [R]: the step row of workspace row r's token
    row_index: torch.Tensor  # [R]: 0 .. R-1
    positions: torch.Tensor  # [R]: where row r's new K/V goes in its row
    slots: torch.Tensor  # [R]: and in the pool (written there first, copied from there)
    mask: torch.Tensor  # [R, 1, 1, max_context] bool
    max_context: int


@dataclass(frozen=True)
class AttentionBatch:
    mode: AttentionMode
    num_tokens: int  # T
    block_size: int
    slot_mapping: torch.Tensor  # [T]: where each new token's K and V are written
    spans: tuple[RequestSpan, ...]
    groups: tuple[PaddedGroup, ...]
    workspace_group: WorkspaceGroup | None = None


def causal_mask(start: int, query_count: int, context: int, group: int) -> torch.Tensor:
    """[G*L, context]: query i (position start+i) sees positions 0 .. start+i; rows (g, i)."""
    positions = torch.arange(context)
    query_positions = torch.arange(start, start + query_count)
    return (positions.unsqueeze(0) <= query_positions.unsqueeze(1)).repeat(group, 1)


def build_batch(mode: AttentionMode, requests: list[StepRequest], slot_mapping: list[int], block_size: int,
                group: int, kv_width: int, device: torch.device, dtype: torch.dtype,
                workspace: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None) -> AttentionBatch:
    """Everything attention needs for one step, built once and shared by all layers.
    group: query heads per KV head (G); kv_width: Hkv * D. workspace (batched mode): a
    DecodeWorkspace's keys and values and the row of each decode request (query_count 1), in
    the order of `requests`, as DecodeWorkspace.prepare returned them."""
    num_tokens = len(slot_mapping)
    slot_tensor = torch.tensor(slot_mapping, dtype=torch.long, device=device)
    if mode == "per_request":
        spans = tuple(
            RequestSpan(
                request.query_start, request.query_count, request.start_position + request.query_count,
                torch.tensor(request.blocks, dtype=torch.long, device=device),
                None if request.query_count == 1 else causal_mask(
                    request.start_position, request.query_count, request.start_position + request.query_count,
                    group).to(device),
            )
            for request in requests
        )
        return AttentionBatch(mode, num_tokens, block_size, slot_tensor, spans, ())
    decodes = [request for request in requests if request.query_count == 1]
    chunks = [request for request in requests if request.query_count > 1]
    workspace_group = None
    if workspace is not None and decodes:
        workspace_group = _workspace_group(decodes, *workspace, slot_mapping, device)
        decodes = []
    groups = tuple(_padded_group(members, num_tokens, block_size, group, kv_width, device, dtype)
                   for members in (decodes, chunks) if members)
    return AttentionBatch(mode, num_tokens, block_size, slot_tensor, (), groups, workspace_group)


def _workspace_group(decodes: list[StepRequest], keys: torch.Tensor, values: torch.Tensor, rows: list[int],
                     slot_mapping: list[int], device: torch.device) -> WorkspaceGroup:
    by_row = sorted(zip(rows, decodes, strict=True), key=lambda pair: pair[0])
    if [row for row, _ in by_row] != list(range(len(rows))):
        raise ValueError(f"workspace rows must be exactly 0 .. {len(rows) - 1}, got {sorted(rows)}")
    starts = torch.tensor([request.start_position for _, request in by_row], dtype=torch.long)
    max_context = int(starts.max()) + 1
    return WorkspaceGroup(
        keys=keys, values=values,
        token_rows=torch.tensor([request.query_start for _, request in by_row], dtype=torch.long, device=device),
        row_index=torch.arange(len(rows), device=device),
        positions=starts.to(device),
        slots=torch.tensor([slot_mapping[request.query_start] for _, request in by_row], dtype=torch.long,
                           device=device),
        mask=(torch.arange(max_context).unsqueeze(0) <= starts.unsqueeze(1)).view(len(rows), 1, 1, max_context)
        .to(device),
        max_context=max_context,
    )


def _padded_group(members: list[StepRequest], num_tokens: int, block_size: int, group: int, kv_width: int,
                  device: torch.device, dtype: torch.dtype) -> PaddedGroup:
    max_queries = max(request.query_count for request in members)
    max_blocks = max(len(request.blocks) for request in members)
    max_context = max_blocks * block_size
    query_rows, blocks, real_rows, token_rows = [], [], [], []
    mask = torch.zeros(len(members), 1, group, max_queries, max_context, dtype=torch.bool)
    for b, request in enumerate(members):
        start, count = request.start_position, request.query_count
        query_rows += list(range(request.query_start, request.query_start + count)) + [num_tokens] * (max_queries - count)
        blocks.append(request.blocks + [0] * (max_blocks - len(request.blocks)))
        real_rows += range(b * max_queries, b * max_queries + count)
        token_rows += range(request.query_start, request.query_start + count)
        mask[b, 0, :, :count, : start + count] = causal_mask(start, count, start + count, 1)
        mask[b, 0, :, count:, 0] = True  # padding queries look at one slot: no all-masked row
    return PaddedGroup(
        query_rows=torch.tensor(query_rows, dtype=torch.long, device=device),
        blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        mask=mask.view(len(members), 1, group * max_queries, max_context).to(device),
        max_queries=max_queries,
        real_rows=torch.tensor(real_rows, dtype=torch.long, device=device),
        token_rows=torch.tensor(token_rows, dtype=torch.long, device=device),
        key_buffer=torch.empty(len(members) * max_blocks, block_size * kv_width, device=device, dtype=dtype),
        value_buffer=torch.empty(len(members) * max_blocks, block_size * kv_width, device=device, dtype=dtype),
    )


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor, block_size: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The KV of whole blocks: pool [slots, Hkv, D], blocks [n] -> [n*block_size, Hkv, D]."""
    by_block = pool.view(pool.shape[0] // block_size, -1)
    gathered = by_block.index_select(0, blocks) if out is None else torch.index_select(by_block, 0, blocks, out=out)
    return gathered.view(blocks.numel() * block_size, *pool.shape[1:])


def attend(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, batch: AttentionBatch,
           layer: int) -> torch.Tensor:
    """q [T, Hq, D], this layer's pools [slots, Hkv, D] (this step's K/V already written) -> [T, Hq*D]."""
    num_tokens, n_heads, head_dim = q.shape
    n_kv_heads = key_pool.shape[1]
    group = n_heads // n_kv_heads
    block_size = batch.block_size
    out = q.new_empty(num_tokens, n_heads * head_dim)
    for span in batch.spans:
        count, context = span.query_count, span.context_length
        q_r = q[span.query_start : span.query_start + count].view(count, n_kv_heads, group, head_dim)
        q_r = q_r.permute(1, 2, 0, 3).reshape(1, n_kv_heads, group * count, head_dim)
        k_r = gather_blocks(key_pool, span.blocks, block_size)[:context].transpose(0, 1).unsqueeze(0)  # [1,Hkv,C,D]
        v_r = gather_blocks(value_pool, span.blocks, block_size)[:context].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=span.mask)
        o = o.view(n_kv_heads, group, count, head_dim).permute(2, 0, 1, 3)
        out[span.query_start : span.query_start + count] = o.reshape(count, n_heads * head_dim)
    if batch.groups:
        q_padded_source = torch.cat([q, q.new_zeros(1, n_heads, head_dim)])
    for padded in batch.groups:
        b, max_blocks = padded.blocks.shape
        max_context, lmax = max_blocks * block_size, padded.max_queries
        q_g = q_padded_source[padded.query_rows].view(b, lmax, n_kv_heads, group, head_dim)
        q_g = q_g.permute(0, 2, 3, 1, 4).reshape(b, n_kv_heads, group * lmax, head_dim)
        flat_blocks = padded.blocks.view(-1)
        k_g = gather_blocks(key_pool, flat_blocks, block_size, padded.key_buffer)
        v_g = gather_blocks(value_pool, flat_blocks, block_size, padded.value_buffer)
        k_g = k_g.view(b, max_context, n_kv_heads, head_dim).transpose(1, 2)
        v_g = v_g.view(b, max_context, n_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=padded.mask)  # [b, Hkv, G*Lmax, D]
        o = o.view(b, n_kv_heads, group, lmax, head_dim).permute(0, 3, 1, 2, 4).reshape(b * lmax, n_heads * head_dim)
        out[padded.token_rows] = o[padded.real_rows]
    if (ws := batch.workspace_group) is not None:
        rows = ws.row_index.numel()
        ws_keys, ws_values = ws.keys[layer], ws.values[layer]  # [rows, Hkv, capacity, D]
        ws_keys[ws.row_index, :, ws.positions] = key_pool.index_select(0, ws.slots)
        ws_values[ws.row_index, :, ws.positions] = value_pool.index_select(0, ws.slots)
        q_w = q.index_select(0, ws.token_rows).view(rows, n_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q_w, ws_keys[:rows, :, : ws.max_context],
                                           ws_values[:rows, :, : ws.max_context], attn_mask=ws.mask)
        out[ws.token_rows] = o.reshape(rows, n_heads * head_dim)
    return out
