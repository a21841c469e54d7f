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

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.kv_cache import PagedKVCache
from services.worker.paged_attention import paged_decode

AttentionMode = Literal["batched", "per_request"]


@dataclass(frozen=True)
class StepLayout:
    """The step's requests as columns, in item order, as the engine hands them to build_batch."""

    rows: np.ndarray  # [n] each request's row in the KV cache's block tables
    query_starts: np.ndarray  # [n] first row of each request in the step's [T, ...] tensors
    query_counts: np.ndarray  # [n] L: tokens of each request in the step
    start_positions: np.ndarray  # [n] tokens already in its KV before this step


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

    layer_keys: list[torch.Tensor]  # per layer [rows, Hkv, capacity, D]: the workspace's tensors
    layer_values: list[torch.Tensor]
    token_rows: torch.Tensor  # [R]: the step row of workspace row r's token
    row_index: torch.Tensor  # [R]: 0 .. R-1
    positions: torch.Tensor  # [R]: where row r's new K/V goes in its row
    mask: torch.Tensor  # [R, 1, 1, max_context] bool
    max_context: int
    # Set for a decode-only step (every token of the step is a row here; the common step): where
    # step token t's K/V goes in its row, and its row (None when that is t itself). Then no
    # per-layer op reorders rows or scatters the output (the fewer ops a layer launches, the less a
    # GPU step waits on the host).
    position_of_token: torch.Tensor | None = None  # [T]
    row_of_token: torch.Tensor | None = None  # [T]

    @property
    def every_token(self) -> bool:
        return self.position_of_token is not None


@dataclass(frozen=True)
class StaticDecode:
    """A decode-only step in fixed shapes (CUDA graphs): B padded rows of one token each, their
    block tables cut to a bucketed context. Nothing here depends on the values, so a captured graph
    replays for any batch that fits. Two ways to attend, chosen once per engine (DecodeGraphs):
    - in place (CUDA, services/worker/paged_attention.py): a kernel walks each row's block table in
      the pool; only block_tables and context_lengths are set.
    - gathering (elsewhere): each layer gathers the rows' blocks into a step buffer and runs SDPA
      under an additive mask; blocks (the flattened tables) and mask are made once per step
      (static_decode), not in every layer: in a graph each is a kernel, and a step's time on a GPU
      is mostly its count of small kernels."""

    max_context: int  # the bucket: the tables' width x block_size
    blocks: torch.Tensor | None = None  # [B * width] int64: each row's blocks in turn (padding: block 0)
    # [B, 1, 1, context] in the model's dtype: 0 where a row may attend (its context; padding rows:
    # position 0), -inf elsewhere (additive: a boolean mask is turned into this inside every call)
    mask: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None  # [B, width] (in place)
    context_lengths: torch.Tensor | None = None  # [B]: tokens each row attends to (in place)


def static_decode(block_tables: torch.Tensor, context_lengths: torch.Tensor, block_size: int,
                  dtype: torch.dtype, in_place: bool = False) -> StaticDecode:
    """block_tables [B, width] (a view of the graphs' buffers), context_lengths [B]: the step's
    StaticDecode, computed on the device (captured into the graph with the layers)."""
    rows, width = block_tables.shape
    context = width * block_size
    if in_place:
        return StaticDecode(context, block_tables=block_tables, context_lengths=context_lengths)
    outside = torch.arange(context, device=block_tables.device).unsqueeze(0) >= context_lengths.unsqueeze(1)
    mask = torch.zeros((rows, context), dtype=dtype, device=block_tables.device).masked_fill_(outside, float("-inf"))
    return StaticDecode(context, block_tables.reshape(-1), mask.view(rows, 1, 1, context))


@dataclass(frozen=True)
class AttentionBatch:
    mode: AttentionMode
    num_tokens: int  # T
    block_size: int
    slot_mapping: torch.Tensor  # [T]: where each new token's K and V are written
    spans: tuple[RequestSpan, ...]
    groups: tuple[PaddedGroup, ...]
    workspace_group: WorkspaceGroup | None = None
    static_decode: StaticDecode | None = None  # then every token is a row of it, in order


def causal_mask(start: int, query_count: int, context: int, group: int) -> torch.Tensor:
    """[G*L, context]: query i (position start+i) sees positions 0 .. start+i; rows (g, i)."""
    positions = torch.arange(context)
    query_positions = torch.arange(start, start + query_count)
    return (positions.unsqueeze(0) <= query_positions.unsqueeze(1)).repeat(group, 1)


def _long(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device, non_blocking=True)


def build_batch(mode: AttentionMode, layout: StepLayout, slot_mapping: torch.Tensor, kv_cache: PagedKVCache,
                group: int, kv_width: int, device: torch.device, dtype: torch.dtype,
                workspace: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None) -> AttentionBatch:
    """Everything attention needs for one step, built once and shared by all layers.
    group: query heads per KV head (G); kv_width: Hkv * D. workspace (batched mode): a
    DecodeWorkspace's per-layer keys and values and the row of each decode request (query_count
    1), in item order, as DecodeWorkspace.prepare returned them."""
    num_tokens = slot_mapping.numel()
    block_size = kv_cache.block_size
    if mode == "per_request":  # Orca's reference: one attention call per request (a loop on purpose)
        spans = []
        for row, query_start, count, start in zip(layout.rows.tolist(), layout.query_starts.tolist(),
                                                  layout.query_counts.tolist(), layout.start_positions.tolist()):
            spans.append(RequestSpan(
                query_start, count, start + count, _long(kv_cache.block_table(row), device),
                None if count == 1 else causal_mask(start, count, start + count, group).to(device)))
        return AttentionBatch(mode, num_tokens, block_size, slot_mapping, tuple(spans), ())
    decodes = np.flatnonzero(layout.query_counts == 1)
    chunks = np.flatnonzero(layout.query_counts > 1)
    workspace_group = None
    if workspace is not None and decodes.size:
        workspace_group = _workspace_group(layout, decodes, *workspace, num_tokens, device)
        decodes = decodes[:0]
    groups = tuple(_padded_group(layout, members, num_tokens, kv_cache, group, kv_width, device, dtype)
                   for members in (decodes, chunks) if members.size)
    return AttentionBatch(mode, num_tokens, block_size, slot_mapping, (), groups, workspace_group)


def _workspace_group(layout: StepLayout, decodes: np.ndarray, layer_keys: list[torch.Tensor],
                     layer_values: list[torch.Tensor], rows: list[int], num_tokens: int,
                     device: torch.device) -> WorkspaceGroup:
    rows_array = np.asarray(rows)
    order = np.argsort(rows_array, kind="stable")  # workspace row r <- its decode request
    if not np.array_equal(rows_array[order], np.arange(len(rows))):
        raise ValueError(f"workspace rows must be exactly 0 .. {len(rows) - 1}, got {sorted(rows)}")
    members = decodes[order]
    starts = layout.start_positions[members]
    max_context = int(starts.max()) + 1
    starts_tensor = _long(starts, device)
    every_token = len(rows) == num_tokens  # then decode i is step token i
    in_order = every_token and np.array_equal(rows_array, np.arange(len(rows)))
    return WorkspaceGroup(
        layer_keys=layer_keys, layer_values=layer_values,
        token_rows=_long(layout.query_starts[members], device),
        row_index=torch.arange(len(rows), device=device),
        positions=starts_tensor,
        mask=(torch.arange(max_context, device=device).unsqueeze(0) <= starts_tensor.unsqueeze(1))
        .view(len(rows), 1, 1, max_context),
        max_context=max_context,
        position_of_token=(starts_tensor if in_order else _long(layout.start_positions[decodes], device))
        if every_token else None,
        row_of_token=None if in_order or not every_token else _long(rows_array, device),
    )


def _padded_group(layout: StepLayout, members: np.ndarray, num_tokens: int, kv_cache: PagedKVCache, group: int,
                  kv_width: int, device: torch.device, dtype: torch.dtype) -> PaddedGroup:
    block_size = kv_cache.block_size
    counts, starts = layout.query_counts[members], layout.start_positions[members]
    query_starts, rows = layout.query_starts[members], layout.rows[members]
    batch, max_queries = members.size, int(counts.max())
    max_blocks = int(kv_cache.blocks_held[rows].max())
    max_context = max_blocks * block_size
    query_index = np.arange(max_queries)
    real = query_index[None, :] < counts[:, None]  # [B, Lmax]: a real query, or padding
    query_rows = np.where(real, query_starts[:, None] + query_index[None, :], num_tokens)  # padding: a zero row
    # Block tables, padded with block 0 (masked). Entries past a row's own blocks are stale: zero them.
    blocks = kv_cache.block_tables[rows, :max_blocks] * (np.arange(max_blocks)[None, :] < kv_cache.blocks_held[rows, None])
    query_positions = torch.from_numpy(np.where(real, starts[:, None] + query_index[None, :], 0)).to(device)
    context = torch.arange(max_context, device=device)
    mask = context.view(1, 1, max_context) <= query_positions.unsqueeze(-1)  # [B, Lmax, C]: causal
    padding = torch.from_numpy(~real).to(device)
    mask = mask & ~padding.unsqueeze(-1) | (padding.unsqueeze(-1) & (context == 0).view(1, 1, max_context))
    mask = mask.unsqueeze(1).expand(batch, group, max_queries, max_context)  # padding queries look at slot 0
    real_flat = real.reshape(-1)
    return PaddedGroup(
        query_rows=_long(query_rows.reshape(-1), device),
        blocks=_long(blocks, device),
        mask=mask.reshape(batch, 1, group * max_queries, max_context),
        max_queries=max_queries,
        real_rows=_long(np.flatnonzero(real_flat), device),
        token_rows=_long(query_rows.reshape(-1)[real_flat], device),
        key_buffer=torch.empty(batch * max_blocks, block_size * kv_width, device=device, dtype=dtype),
        value_buffer=torch.empty(batch * max_blocks, block_size * kv_width, device=device, dtype=dtype),
    )


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor, block_size: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The KV of whole blocks: pool [slots, Hkv, D], blocks [n] -> [n*block_size, Hkv, D]."""
    by_block = pool.view(pool.shape[0] // block_size, -1)
    gathered = by_block.index_select(0, blocks) if out is None else torch.index_select(by_block, 0, blocks, out=out)
    return gathered.view(blocks.numel() * block_size, *pool.shape[1:])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
           batch: AttentionBatch, layer: int) -> torch.Tensor:
    """q [T, Hq, D], this step's k and v [T, Hkv, D], this layer's pools [slots, Hkv, D] (k and v
    already written there) -> [T, Hq*D]."""
    num_tokens, n_heads, head_dim = q.shape
    n_kv_heads = key_pool.shape[1]
    group = n_heads // n_kv_heads
    block_size = batch.block_size
    if (static := batch.static_decode) is not None:
        return _attend_static_decode(q, key_pool, value_pool, static, block_size)
    ws = batch.workspace_group
    if ws is not None and ws.every_token:
        return _attend_workspace_only(q, k, v, ws, layer)
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
    if ws is not None:
        rows = ws.row_index.numel()
        ws_keys, ws_values = ws.layer_keys[layer], ws.layer_values[layer]  # [rows, Hkv, capacity, D]
        ws_keys[ws.row_index, :, ws.positions] = k.index_select(0, ws.token_rows)
        ws_values[ws.row_index, :, ws.positions] = v.index_select(0, ws.token_rows)
        q_w = q.index_select(0, ws.token_rows).view(rows, n_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q_w, ws_keys[:rows, :, : ws.max_context],
                                           ws_values[:rows, :, : ws.max_context], attn_mask=ws.mask)
        out[ws.token_rows] = o.reshape(rows, n_heads * head_dim)
    return out


def _attend_workspace_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ws: WorkspaceGroup,
                           layer: int) -> torch.Tensor:
    """A decode-only step, every row in the workspace: the new K and V go to their rows straight
    from the step's tensors, and the output needs no scatter (nor, rows in step order, a gather)."""
    rows, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    ws_keys, ws_values = ws.layer_keys[layer], ws.layer_values[layer]  # [rows, Hkv, capacity, D]
    write_rows = ws.row_index if ws.row_of_token is None else ws.row_of_token
    ws_keys[write_rows, :, ws.position_of_token] = k
    ws_values[write_rows, :, ws.position_of_token] = v
    q_w = q if ws.row_of_token is None else q.index_select(0, ws.token_rows)  # workspace row order
    o = F.scaled_dot_product_attention(q_w.view(rows, n_kv_heads, n_heads // n_kv_heads, head_dim),
                                       ws_keys[:rows, :, : ws.max_context], ws_values[:rows, :, : ws.max_context],
                                       attn_mask=ws.mask).reshape(rows, n_heads * head_dim)
    return o if ws.row_of_token is None else o.index_select(0, ws.row_of_token)  # back in step order


def _attend_static_decode(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, static: StaticDecode,
                          block_size: int) -> torch.Tensor:
    """One query per row against its blocks, in fixed shapes: read in place by the paged kernel, or
    gathered from the pool into a step-local buffer (either way the pool stays the only copy of the
    KV: no workspace kept across steps)."""
    if static.block_tables is not None:
        return paged_decode(q, key_pool, value_pool, static.block_tables, static.context_lengths, block_size)
    rows, n_heads, head_dim = q.shape
    n_kv_heads = key_pool.shape[1]
    context = static.max_context
    keys = gather_blocks(key_pool, static.blocks, block_size).view(rows, context, n_kv_heads,
                                                                   head_dim).transpose(1, 2)
    values = gather_blocks(value_pool, static.blocks, block_size).view(rows, context, n_kv_heads,
                                                                        head_dim).transpose(1, 2)
    queries = q.view(rows, n_kv_heads, n_heads // n_kv_heads, head_dim)  # grouped heads on the query axis
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=static.mask)
    return out.reshape(rows, n_heads * head_dim)
