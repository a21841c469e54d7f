"""Model parallelism (Megatron-style, as Orca splits GPT-3): one rank's share of the model.

Tensor parallel (`tensor` ranks per stage): each rank holds 1/tensor of every layer of its stage:
Q/K/V and gate/up split by output rows (column-parallel: whole attention heads and whole FFN
columns), the attention output and down projections split by input columns (row-parallel), so each
layer needs one all-reduce after the attention output and one after the feed-forward. KV heads are
split with the query heads that use them, or replicated when there are fewer KV heads than ranks
(each rank keeps the one its query heads read). The LM head is split by vocabulary rows and the
logits gathered before sampling.

Pipeline parallel (`pipeline` stages): stage s holds a contiguous run of layers (the last stage
fewer, by what its LM head costs: `stage_layers`); a step's hidden states [T, H] go from each rank to the
rank of the same tensor index in the next stage (point-to-point, sent without waiting, so a stage
goes on to its next step while the next stage works on this one: Orca's figure 8). Only the last
stage has logits and samples; its first rank sends each step's sampled tokens (with their
log-probabilities, SAMPLED_COLUMNS per token) back to every rank of the earlier stages, which take
them when they are needed (services/worker/engine.py `take_sampled`). Rank r is stage r // tensor,
tensor index r % tensor.

Each rank's paged KV cache holds only its KV heads of its layers and follows the same block tables.

Communication per step: per layer two all-reduces of [T, H] activations within a stage (T tokens
of the step, H hidden); between stages one [T, H] send per boundary; one all-gather of
[B, V / tensor] logits in the last stage and, with stages, [B, SAMPLED_COLUMNS] sampled tokens sent
back to each earlier rank.

This module is the model's arithmetic only; a worker group (ranks started together, one of which
talks to the scheduler) is built on it (services/worker/group.py).
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from services.worker.attention import AttentionBatch
from services.worker.kv_cache import PagedKVCache
from services.worker.model import Llama, linear, rms_norm
from services.worker.sampler import MAX_TOP_LOGPROBS
from shared.model_file import ModelConfig

# A sampled token as the last stage sends it back: token id, its log-probability, then the top
# log-probabilities' token ids and values (NaN / -1 where none was asked), in float64 (exact ids).
SAMPLED_COLUMNS = 2 + 2 * MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class Layout:
    """How a group's ranks split the model: `tensor` ranks per stage, `pipeline` stages."""

    tensor: int = 1
    pipeline: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline

    def stage(self, rank: int) -> int:
        return rank // self.tensor

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tensor, (stage + 1) * self.tensor))

    def layers(self, n_layers: int, stage: int, head_layers: float = 0.0) -> range:
        """The stage's layers, contiguous. The stages take equal shares of the work, the last one's
        LM head counted as `head_layers` layers (at least one layer each); the stages before the
        last split theirs evenly, the first (n % stages) one more."""
        last = n_layers - self.pipeline + 1
        if head_layers:
            last = min(last, max(1, round((n_layers + head_layers) / self.pipeline - head_layers)))
        else:
            last = min(last, n_layers // self.pipeline)
        if stage == self.pipeline - 1:
            return range(n_layers - last, n_layers)
        base, extra = divmod(n_layers - last, self.pipeline - 1)
        first = stage * base + min(stage, extra)
        return range(first, first + base + (stage < extra))

    def describe(self) -> str:
        parts = [f"tensor parallel {self.tensor}"] if self.tensor > 1 else []
        return " x ".join(parts + ([f"pipeline parallel {self.pipeline}"] if self.pipeline > 1 else []))


def check_split(config: ModelConfig, layout: Layout) -> None:
    """Refuse a split that does not fall on whole heads and whole KV groups, or leaves a stage no layer."""
    if layout.tensor > 1:
        check_divisible(config, layout.tensor)
    if layout.pipeline > config.n_layers:
        raise ValueError(f"pipeline parallel size {layout.pipeline} exceeds the model's {config.n_layers} layers")


def head_cost_in_layers(config: ModelConfig) -> float:
    """The LM head's weights over one layer's: what projecting a decoded token costs, in layers
    (SmolLM2-135M: 8.0 of its 30 layers, its 49k vocabulary over a 576 hidden size; Llama-3-8B: 2.4)."""
    attention = 2 * config.hidden_size * (config.n_heads + config.n_kv_heads) * config.head_dim
    return config.vocab_size * config.hidden_size / (attention + 3 * config.hidden_size * config.ffn_size)


def stage_layers(config: ModelConfig, layout: Layout, stage: int) -> range:
    """A stage's layers, balanced for decoding (every token then goes through the LM head): the
    last stage holds fewer layers, as many fewer as its LM head costs."""
    return layout.layers(config.n_layers, stage, head_cost_in_layers(config) if layout.pipeline > 1 else 0.0)


def rank_config(config: ModelConfig, layout: Layout, rank: int) -> ModelConfig:
    """One rank's shape: its heads and feed-forward columns, its stage's layers."""
    local = local_config(config, layout.tensor) if layout.tensor > 1 else config
    return replace(local, n_layers=len(stage_layers(config, layout, layout.stage(rank))))


def rank_weights(weights: dict[str, torch.Tensor], config: ModelConfig, layout: Layout,
                 rank: int) -> dict[str, torch.Tensor]:
    """The GGUF-named weights of one rank, its stage's layers renumbered from 0. The embedding,
    final norm and LM head stay on every stage (the first stage embeds, the last projects; a
    stage that needs neither could drop them: a few percent of a large model's weights)."""
    if layout.tensor > 1:
        weights = shard_weights(weights, config, layout.tensor_rank(rank), layout.tensor)
    if layout.pipeline == 1:
        return weights
    layers = stage_layers(config, layout, layout.stage(rank))
    kept = {}
    for name, tensor in weights.items():
        if not name.startswith("blk."):
            kept[name] = tensor
            continue
        _, index, rest = name.split(".", 2)
        if int(index) in layers:
            kept[f"blk.{int(index) - layers.start}.{rest}"] = tensor
    return kept


def kv_bytes_per_token(config: ModelConfig, layout: Layout, element_size: int) -> int:
    """What one token's keys and values take over all ranks of a group (replicated KV heads counted
    on every rank that keeps them)."""
    return sum(2 * local.n_layers * local.n_kv_heads * local.head_dim * element_size
               for local in (rank_config(config, layout, rank) for rank in range(layout.world)))


_tensor_group: dist.ProcessGroup | None = None  # this process's stage's group (None: the default group)


def make_tensor_groups(layout: Layout) -> None:
    """Called by every rank of the group, in the same order (torch.distributed's rule for new
    groups): one group per stage's tensor ranks; with one stage, the default group serves."""
    global _tensor_group
    rank = dist.get_rank()
    _tensor_group = None
    if layout.pipeline > 1 and layout.tensor > 1:
        for stage in range(layout.pipeline):
            made = dist.new_group(layout.stage_ranks(stage))
            if stage == layout.stage(rank):
                _tensor_group = made


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


class ParallelLlama(Llama):
    """One rank of a tensor- and/or pipeline-parallel Llama: the same forward pass on its share,
    with an all-reduce after each row-parallel projection, hidden states passed between stages, and
    the full logits on every rank at the end."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, layout: Layout, rank: int | None = None,
                 tensor_group: dist.ProcessGroup | None = None):
        rank = dist.get_rank() if rank is None else rank
        self.layout, self.rank, self.full_config = layout, rank, config
        self.tensor_group = tensor_group if tensor_group is not None else _tensor_group
        stage = layout.stage(rank)
        self.first_stage, self.last_stage = stage == 0, stage == layout.pipeline - 1
        self.previous_rank, self.next_rank = rank - layout.tensor, rank + layout.tensor
        self.logits_source = (layout.pipeline - 1) * layout.tensor  # the last stage's first rank
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # sends in progress, and what they send
        super().__init__(rank_config(config, layout, rank), rank_weights(weights, config, layout, rank),
                         device, dtype)
        if layout.tensor > 1:  # each row-parallel projection's partial sums added over the stage
            self.attention_output_and_ffn = self._attention_output_and_ffn_all_reduced

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.tensor_group)
        return partial

    def _attention_output_and_ffn_all_reduced(self, x: torch.Tensor, attended: torch.Tensor, out: torch.Tensor,
                                              norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                                              eps: float) -> torch.Tensor:
        x = x + self._all_reduce(linear(attended, out))
        gate, up = linear(rms_norm(x, norm, eps), gate_up).chunk(2, dim=-1)
        return x + self._all_reduce(linear(torch.nn.functional.silu(gate) * up, down))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_cache: PagedKVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        if self.first_stage:
            x = self.embedding.index_select(0, token_ids)
        else:  # the previous stage's hidden states
            x = torch.empty((token_ids.shape[0], self.config.hidden_size), dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.previous_rank)
        x = self.run_layers(x, positions, batch, kv_cache)  # this rank's heads, columns and layers
        if not self.last_stage:  # on to its next step while the next stage runs this one
            self._send(x.contiguous(), self.next_rank)
            return None
        logits = self.final_logits(x.index_select(0, logit_rows), self.final_norm, self.lm_head,
                                   self.config.rms_norm_eps)
        if self.layout.tensor > 1:
            shards = [torch.empty_like(logits) for _ in range(self.layout.tensor)]
            dist.all_gather(shards, logits.contiguous(), group=self.tensor_group)
            logits = torch.cat(shards, dim=-1)  # [B, V]
        return logits

    def _send(self, tensor: torch.Tensor, destination: int) -> None:
        """Send without waiting (the tensor is kept until the send is done)."""
        self._sends = [(work, sent) for work, sent in self._sends if not work.is_completed()]
        self._sends.append((dist.isend(tensor, dst=destination), tensor))

    # Pipeline stages: the sampled tokens go back from the last stage to every earlier rank

    @property
    def samples(self) -> bool:
        """Whether this rank has logits and samples (every rank but the earlier stages')."""
        return self.last_stage

    def send_sampled(self, result) -> None:
        """The last stage's first rank: a step's sampled tokens to every earlier rank."""
        if self.rank == self.logits_source:
            packed = pack_sampled(result)
            for rank in range(self.logits_source):
                self._send(packed, rank)

    def receive_sampled(self, count: int) -> tuple[dist.Work, torch.Tensor]:
        """An earlier stage's rank: where a step's sampled tokens will arrive (posted at once, taken
        when needed: the receives of successive steps complete in order)."""
        buffer = torch.empty((count, SAMPLED_COLUMNS), dtype=torch.float64, device=self.device)
        return dist.irecv(buffer, src=self.logits_source), buffer


def pack_sampled(result) -> torch.Tensor:
    """A step's sampler output as the last stage sends it back: [B, SAMPLED_COLUMNS] float64."""
    count = result.token_ids.shape[0]
    packed = torch.full((count, SAMPLED_COLUMNS), float("nan"), dtype=torch.float64, device=result.token_ids.device)
    packed[:, 0] = result.token_ids
    packed[:, 2 : 2 + MAX_TOP_LOGPROBS] = -1
    if result.logprob is not None:
        wanted = result.top_ids.shape[1]
        packed[:, 1] = result.logprob
        packed[:, 2 : 2 + wanted] = result.top_ids
        packed[:, 2 + MAX_TOP_LOGPROBS : 2 + MAX_TOP_LOGPROBS + wanted] = result.top_logprobs
    return packed


@dataclass(frozen=True)
class SampledBack:
    """What pack_sampled packed, as the sampler's output reads (token ids; log-probabilities when
    asked: the top ones MAX_TOP_LOGPROBS wide, each request takes as many as it asked for)."""

    token_ids: torch.Tensor  # [B] int64
    logprob: torch.Tensor | None  # [B] float64
    top_ids: torch.Tensor | None  # [B, MAX_TOP_LOGPROBS] int64
    top_logprobs: torch.Tensor | None

    @classmethod
    def unpack(cls, packed: torch.Tensor, with_logprobs: bool) -> "SampledBack":
        if not with_logprobs:
            return cls(packed[:, 0].long(), None, None, None)
        return cls(packed[:, 0].long(), packed[:, 1], packed[:, 2 : 2 + MAX_TOP_LOGPROBS].long(),
                   packed[:, 2 + MAX_TOP_LOGPROBS :])


def communication_bytes_per_token(config: ModelConfig, world: int, bytes_per_value: int,
                                  pipeline: int = 1) -> dict[str, int]:
    """Bytes a rank sends per token of a step: within a stage of `world` tensor ranks, for a ring
    all-reduce (2 (world - 1) / world of the tensor) and the logits' all-gather ((world - 1) /
    world); across `pipeline` stages, one hidden state per boundary and each sampled token sent back."""
    sent = {"all_reduce_per_layer": 0, "all_reduce_per_step": 0, "logits_all_gather": 0,
            "stage_boundary": 0, "sampled_tokens": 0}
    if world > 1:
        per_all_reduce = 2 * (world - 1) * config.hidden_size * bytes_per_value // world
        sent.update(all_reduce_per_layer=2 * per_all_reduce, all_reduce_per_step=2 * per_all_reduce * config.n_layers,
                    logits_all_gather=(world - 1) * config.vocab_size * 4 // world)  # float32 logits
    if pipeline > 1:  # per sampled token, to each earlier rank
        sent.update(stage_boundary=config.hidden_size * bytes_per_value, sampled_tokens=SAMPLED_COLUMNS * 8)
    return sent
