"""Decode-only steps in fixed shapes, replayed from CUDA graphs (as vLLM and SGLang do).

A step whose every item is one decode token is padded up to a batch bucket, its block tables cut
to a context bucket, and run through the model with StaticDecode attention (no value-dependent
shape anywhere): on CUDA the first step of a (batch, context) bucket pair is captured as a graph
into static input buffers, and every later one copies its inputs in and replays it, so a decode
step costs one graph launch instead of thousands of kernel launches. Padding rows feed token 0 at
position 0, attend to one token of block 0, and write their K/V to a scratch slot that no request
owns. Sampling stays outside the graph (its stages depend on the values). Attention reads the paged
KV in place where the Triton kernel runs (CUDA: services/worker/paged_attention.py); elsewhere each
layer gathers the rows' blocks into a step buffer first.

On the CPU nothing is captured: the same padded, static-shape step runs eagerly from the same
buffers. That is how the bucketing and padding are tested here (and the in-place kernel, in Triton's
interpreter); only the capture itself needs a GPU (benchmarks/gpu_check.py checks that replays
equal eager steps).
"""

import logging

import numpy as np
import torch

from services.worker.attention import AttentionBatch, static_decode
from services.worker.kv_cache import PagedKVCache
from services.worker.model import Llama
from services.worker.paged_attention import usable

log = logging.getLogger("iterserve.worker")

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT_BUCKET = 64  # tokens; buckets double from there up to the context length


def bucket(value: int, buckets) -> int:
    return next(size for size in buckets if size >= value)


class DecodeGraphs:
    def __init__(self, model: Llama, kv_cache: PagedKVCache, max_batch: int, capture: bool):
        if kv_cache.scratch_slot is None:
            raise ValueError("decode graphs need a KV cache with a scratch block for padding rows")
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        config = model.config  # attention reads the pool's blocks where they are (the kernel checked first)
        self.in_place = usable(model.device, model.dtype, config.n_heads, config.n_kv_heads, config.head_dim,
                               kv_cache.block_size)
        self.batch_buckets = tuple(size for size in BATCH_BUCKETS if size < max_batch) + (max_batch,)
        context, contexts = MIN_CONTEXT_BUCKET, []
        while context < model.config.context_length:
            contexts.append(context)
            context *= 2
        self.context_buckets = tuple(contexts) + (model.config.context_length,)
        device, rows = model.device, self.batch_buckets[-1]
        self.token_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), kv_cache.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((rows, kv_cache.max_blocks_per_row), dtype=torch.long, device=device)
        self.context_lengths = torch.ones(rows, dtype=torch.long, device=device)
        self.logit_rows = torch.arange(rows, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # decode steps run this way
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, batch: int, longest_context: int) -> bool:
        return batch <= self.batch_buckets[-1] and longest_context <= self.context_buckets[-1]

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, rows: np.ndarray,
            context_lengths: np.ndarray) -> torch.Tensor:
        """[B, V] logits of a decode-only step: row i feeds token_ids[i] at positions[i] (its KV
        slot slot_mapping[i]) for the request of block-table row rows[i], which then attends to
        context_lengths[i] tokens."""
        self.steps += 1
        batch = rows.size
        padded = bucket(batch, self.batch_buckets)
        context = bucket(int(context_lengths.max()), self.context_buckets)
        width = -(-context // self.kv_cache.block_size)
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.context_lengths[:batch].copy_(torch.from_numpy(context_lengths).to(self.model.device, non_blocking=True))
        if self.kv_cache.device_block_tables is not None:
            index = torch.from_numpy(rows).to(self.model.device, non_blocking=True)
            self.block_tables[:batch, :width].copy_(self.kv_cache.device_block_tables[:, :width].index_select(0, index))
        else:
            self.block_tables[:batch, :width].copy_(torch.from_numpy(self.kv_cache.block_tables[rows, :width]))
        if padded > batch:  # padding rows: token 0 at position 0, one token of block 0, K/V to the scratch slot
            self.token_ids[batch:padded].zero_()
            self.positions[batch:padded].zero_()
            self.slot_mapping[batch:padded].fill_(self.kv_cache.scratch_slot)
            self.block_tables[batch:padded, :width].zero_()
            self.context_lengths[batch:padded].fill_(1)
        if not self.capture:
            return self._forward(padded, width)[:batch]
        key = (padded, width)
        if key not in self._graphs:
            self._graphs[key] = self._capture(padded, width)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:batch]

    def _forward(self, padded: int, width: int) -> torch.Tensor:
        block_size = self.kv_cache.block_size
        static = static_decode(self.block_tables[:padded, :width], self.context_lengths[:padded], block_size,
                               self.model.dtype, self.in_place)
        batch = AttentionBatch("batched", padded, block_size, self.slot_mapping[:padded], (), (), None, static)
        return self.model.forward(self.token_ids[:padded], self.positions[:padded], batch, self.kv_cache,
                                  self.logit_rows[:padded])

    def _capture(self, padded: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up once on a side stream (lazy initialisation must not be captured), then capture.
        The warm-up writes the same K/V the replay writes: harmless."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(padded, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(padded, width)
        log.info("event=decode_graph_captured batch=%d context=%d graphs=%d attention=%s", padded,
                 width * self.kv_cache.block_size, len(self._graphs) + 1, "in_place" if self.in_place else "gather")
        return graph, logits
