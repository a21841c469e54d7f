"""Tensor parallelism (Megatron-style, as Orca splits each layer): one rank's shard of the model.

Each of `world` ranks holds 1/world of every layer: Q/K/V and gate/up split by output rows
(column-parallel: whole attention heads and whole FFN columns), the attention output and down
projections split by input columns (row-parallel), so each layer needs one all-reduce after the
attention output and one after the feed-forward. KV heads are split with the query heads that use
them, or replicated when there are fewer KV heads than ranks (each rank keeps the one its query
heads read). The LM head is split by vocabulary rows and the logits gathered before sampling, so
every rank samples the same token from the same full logits. Each rank's paged KV cache holds
only its KV heads and follows the same block tables.

Communication per step and layer: two all-reduces of [T, H] activations (T tokens of the step,
H hidden), plus one all-gather of [B, V / world] logits per step.

This module is the model's arithmetic only; a worker group (ranks started together, one of which
talks to the scheduler) is built on it.
"""

from dataclasses import replace

import torch
import torch.distributed as dist

from services.worker.attention import AttentionBatch, attend
from services.worker.kv_cache import PagedKVCache
from services.worker.model import Llama, attention_inputs, linear, rms_norm
from shared.model_file import ModelConfig


def check_divisible(config: ModelConfig, world: int) -> None:
    """Refuse a split that does not fall on whole heads and whole KV groups."""
    problems = []
    if config.n_heads % world:
        problems.append(f"{config.n_heads} attention heads")
    if config.n_kv_heads % world and world % config.n_kv_heads:
        problems.append(f"{config.n_kv_heads} KV heads")
    if config.ffn_size % world:
        problems.append(f"a feed-forward size of {config.ffn_size}")
    if config.vocab_size % world:
        problems.append(f"a vocabulary of {config.vocab_size}")
    if problems:
        raise ValueError(f"tensor parallel size {world} does not divide " + ", ".join(problems))


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's shape: its heads and feed-forward columns (the vocabulary stays whole: logits are
    gathered)."""
    check_divisible(config, world)
    return replace(config, n_heads=config.n_heads // world, n_kv_heads=max(1, config.n_kv_heads // world),
                   ffn_size=config.ffn_size // world)


def kv_heads_of(config: ModelConfig, rank: int, world: int) -> range:
    """The KV heads rank `rank` keeps: its share, or the one its query heads read when there are
    fewer KV heads than ranks."""
    if config.n_kv_heads >= world:
        share = config.n_kv_heads // world
        return range(rank * share, (rank + 1) * share)
    group = config.n_heads // config.n_kv_heads  # query heads per KV head
    first_query_head = rank * (config.n_heads // world)
    return range(first_query_head // group, first_query_head // group + 1)


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, rank: int,
                  world: int) -> dict[str, torch.Tensor]:
    """The GGUF-named weights of one rank (views where possible: nothing is copied twice)."""
    check_divisible(config, world)
    head_dim = config.head_dim
    query_heads = config.n_heads // world
    q_rows = slice(rank * query_heads * head_dim, (rank + 1) * query_heads * head_dim)
    kv = kv_heads_of(config, rank, world)
    kv_rows = slice(kv.start * head_dim, kv.stop * head_dim)
    ffn = config.ffn_size // world
    ffn_rows = slice(rank * ffn, (rank + 1) * ffn)
    vocab = config.vocab_size // world
    sharded = {}
    for name, tensor in weights.items():
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            sharded[name] = tensor[q_rows]
        elif name.endswith(("attn_k.weight", "attn_v.weight", "attn_k.bias", "attn_v.bias")):
            sharded[name] = tensor[kv_rows]
        elif name.endswith("attn_output.weight"):
            sharded[name] = tensor[:, q_rows]
        elif name.endswith(("ffn_gate.weight", "ffn_up.weight")):
            sharded[name] = tensor[ffn_rows]
        elif name.endswith("ffn_down.weight"):
            sharded[name] = tensor[:, ffn_rows]
        else:  # norms, the embedding, rope factors: whole on every rank
            sharded[name] = tensor
    lm_head = weights.get("output.weight", weights["token_embd.weight"])  # tied: the embedding
    sharded["output.weight"] = lm_head[rank * vocab : (rank + 1) * vocab]
    return sharded


class TensorParallelLlama(Llama):
    """One rank of a tensor-parallel Llama: the same forward pass on its shard, with an all-reduce
    after each row-parallel projection and the logits gathered at the end."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.full_config = config
        super().__init__(local_config(config, self.world), shard_weights(weights, config, self.rank, self.world),
                         device, dtype)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.group)
        return partial

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_cache: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        config = self.config  # this rank's heads and columns
        eps = config.rms_norm_eps
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        x = self.embedding.index_select(0, token_ids)
        for layer_index, layer in enumerate(self.layers):
            q, k, v = attention_inputs(x, layer.attn_norm, layer.qkv, layer.qkv_bias, layer.q_norm, layer.k_norm,
                                       cos, sin, config.n_heads, config.n_kv_heads, config.head_dim, eps)
            kv_cache.write(layer_index, batch.slot_mapping, k, v)
            attended = attend(q, kv_cache.keys[layer_index], kv_cache.values[layer_index], batch, layer_index)
            x = x + self._all_reduce(linear(attended, layer.out))
            gate, up = linear(rms_norm(x, layer.ffn_norm, eps), layer.gate_up).chunk(2, dim=-1)
            x = x + self._all_reduce(linear(torch.nn.functional.silu(gate) * up, layer.down))
        local = linear(rms_norm(x.index_select(0, logit_rows), self.final_norm, eps), self.lm_head).float()
        shards = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(shards, local.contiguous(), group=self.group)
        return torch.cat(shards, dim=-1)  # [B, V]


def communication_bytes_per_token(config: ModelConfig, world: int, bytes_per_value: int) -> dict[str, int]:
    """Bytes each rank sends per token of a step, for a ring all-reduce (2 (world - 1) / world of
    the tensor) and the logits' all-gather ((world - 1) / world), by kind."""
    if world < 2:
        return {"all_reduce_per_layer": 0, "all_reduce_per_step": 0, "logits_all_gather": 0}
    per_all_reduce = 2 * (world - 1) * config.hidden_size * bytes_per_value // world
    return {"all_reduce_per_layer": 2 * per_all_reduce,
            "all_reduce_per_step": 2 * per_all_reduce * config.n_layers,
            "logits_all_gather": (world - 1) * config.vocab_size * 4 // world}  # float32 logits
