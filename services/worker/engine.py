"""The execution engine: one iteration at a time, tensors in, tokens out.

A step takes any mix of prompt chunks and decode tokens (StepItems), reserves their KV
blocks, runs the model once on all their tokens (selective batching) and samples the next
token of every item that reaches the end of its known tokens, all rows at once.

Every request the engine holds has a row (vLLM v1's persistent input batch): its KV block table
is a row of the cache's preallocated table, its last sampled token a row of a device tensor
(a pipelined plan feeds it from there, never through the host), its sampling parameters are
kept from the plan that introduced it, a penalised row's tokens so far are a row of a device
tensor (services/worker/token_history.py). A step's index arrays (positions, slot mapping, logit
rows) are computed with vectorized numpy over the items and copied to the device once; the
sampler picks its row subsets from host arrays, with no Python per row.

Where a step waits for the device: fetching the sampled tokens at its end, always; and inside the
sampler only for rows that ask for the stages that need it (services/worker/sampler.py): top_p's
rejection rounds (three waits a round: the rows to check, the blocks above a drawn token, the rows
rejected; a round or two a step on real logits) and top_k's check for a tie run past its
candidates (one). Those stages work on data-dependent row subsets, which keep sampling cheap on the
CPU, where a wait costs nothing; on a GPU each is a round trip to the queue
(benchmarks/results/sampler_host.md counts them, with the eager ops and step times).
"""

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from services.worker import cpu_kernels
from services.worker.attention import AttentionMode, StepLayout, build_batch
from services.worker.decode_graphs import DecodeGraphs
from services.worker.decode_workspace import DecodeWorkspace
from services.worker.kv_cache import PagedKVCache
from services.worker.model import Llama
from services.worker.grammar_rows import GrammarRows
from services.worker.prompt_logprobs import PromptLogprobRows
from services.worker.sampler import LogitAdjustments, SamplerOutput, sample
from services.worker.sampling_table import SamplingTable
from services.worker.speculation import accepted, ragged_arange
from services.worker.rows import ItemRefusal, RequestRows, StepColumns, StepOutcome, TokenLogprobs
from services.worker.staging import Staging
from services.worker.token_history import TokenHistory
from shared.model_file import ModelConfig, serving_config

if TYPE_CHECKING:  # the engine imports only torch and numpy: it runs where the service's packages are not
    from services.worker.draft import DraftProposer
    from shared.speculative import SpeculativeConfig
    from shared.config import Settings
    from shared.grammar import GrammarCompiler
    from shared.messages import SamplingParams, StepItem

log = logging.getLogger("iterserve.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, stored: str = "", quantization: str = "none") -> torch.dtype:
    """auto: float32 on the CPU (with packed weights, their kernel's fast path: bfloat16 for torch's
    int4 kernel, float32 for the project's); on CUDA the checkpoint's own float16 or bfloat16, else
    bfloat16."""
    if name == "auto":
        if device.type != "cuda" and (quantization == "none" or cpu_kernels.packed_dtype() == torch.float32):
            return torch.float32
        return torch.float16 if stored == "float16" else torch.bfloat16
    return DTYPES[name]


def own_bytes(config: ModelConfig, settings: "Settings", dtype: torch.dtype, held_weights: int | None = None) -> int:
    """What a worker holds besides its KV pool (what vLLM's profile run measures): the weights, as the
    loaded model holds them (held_weights: weight_bytes, packed ones at their packed size) or else
    counted from the model's shape, a draft model's too; and the activations of the largest step
    (max_batch_tokens tokens through the widest layer, and float32 logits for max_batch_size rows)."""
    widest = max(config.hidden_size * 4, config.ffn_size * 2 + config.hidden_size)
    activations = (settings.max_batch_tokens * widest * torch.finfo(dtype).bits // 8
                   + settings.max_batch_size * config.vocab_size * 4)
    weights = shaped_weight_bytes(config, dtype) if held_weights is None else held_weights
    if (draft := draft_config(settings)) is not None:  # (loaded after: packed ones counted unpacked, a bound)
        weights += shaped_weight_bytes(draft[0], draft_dtype(draft[1], dtype))
    return weights + activations


def shaped_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """A model's weights in `dtype`, from its shape."""
    attention = config.hidden_size * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
    layer = attention + 3 * config.hidden_size * config.ffn_size + 2 * config.hidden_size
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tied_embeddings else 2)
    return (config.n_layers * layer + embeddings + config.hidden_size) * torch.finfo(dtype).bits // 8


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """A KV block's keys and values over all of a model's layers."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * block_size * torch.finfo(dtype).bits // 8


def draft_config(settings: "Settings") -> tuple[ModelConfig, "SpeculativeConfig"] | None:
    """The draft model's config and the speculative config that names it (services/worker/draft.py), if any."""
    from shared.speculative import parse_speculative_config

    speculative = parse_speculative_config(settings.speculative_config)
    if speculative is None or not speculative.proposed_by_worker:
        return None
    from shared.model_file import load_metadata

    return load_metadata(speculative.model).config, speculative


def draft_dtype(speculative: "SpeculativeConfig", target_dtype: torch.dtype) -> torch.dtype:
    """The draft's: the target's, or with its GGUF kept packed the packed kernel's fast path (bfloat16
    for torch's int4 kernel, float32 for the project's)."""
    return cpu_kernels.packed_dtype() if speculative.draft_packed else target_dtype


def weight_bytes(model) -> int:
    """What the model's weights take in memory, as held (packed ones at their packed size)."""
    seen, total = set(), 0
    for holder in [model, *getattr(model, "layers", ())]:
        for name, value in vars(holder).items():
            held = isinstance(value, torch.Tensor) or hasattr(value, "nbytes")  # (a PackedLinear too)
            if name.startswith("rope_") or id(value) in seen or not held:
                continue
            seen.add(id(value))
            total += value.nbytes
    return total


def free_memory_bytes(device: torch.device) -> int:
    """Memory the KV pool may take a fraction of: free GPU memory, or available RAM."""
    return memory_bytes(device)[0]


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) memory of the device: the GPU's, or the machine's (available, total RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024


def release_freed_heap() -> None:
    """Give the C heap's freed pages back to the system (glibc's malloc_trim): loading frees far more
    than it keeps (GGUF blocks, int32 copies to pack, float32 to convert: 255 MB resident after a packed
    SmolLM2 loads, 104 MB of it weights), which glibc otherwise keeps resident, and which the KV
    pool's share of the machine's available memory would not see."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc: nothing to give back this way)
        pass


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class KVPoolTooSmall(ValueError):
    """The memory the settings give the KV pool holds not one block (a setting that can never work)."""


# Defaults of an engine made directly (tests, benchmarks); a service's come from its Settings.
DECODE_WORKSPACE_TOKENS = 65536
MAX_BATCH_SIZE = 64


@dataclass(eq=False)
class _AwaitedTokens:
    """A step's sampled tokens on their way back from the last pipeline stage, and whose they are."""

    request_ids: list[str]
    rows: np.ndarray
    serials: np.ndarray  # the rows' serials at the step: a row given up since is left alone
    output_indices: np.ndarray
    params: list["SamplingParams"]
    work: Any  # the receive, posted at the step
    buffer: torch.Tensor
    received: bool = False

    def wait(self) -> None:
        if not self.received:  # (a gloo receive waited on twice waits for another message)
            self.work.wait()
            self.received = True


class Engine(RequestRows):
    def __init__(self, model: Llama, kv_cache: PagedKVCache, attention: AttentionMode = "batched",
                 decode_workspace_tokens: int = DECODE_WORKSPACE_TOKENS, max_batch_size: int = MAX_BATCH_SIZE,
                 static_decode: bool = False):
        """static_decode: decode-only steps in fixed shapes (DecodeGraphs), captured as CUDA graphs
        on CUDA; the KV cache needs a scratch block for it."""
        super().__init__(kv_cache, model.config.context_length, model.config.vocab_size)
        self.model, self.attention = model, attention
        self.config: ModelConfig = model.config
        self.executor = "engine"
        self.device_name = str(model.device)
        device = model.device
        self._sampling = SamplingTable(self.max_rows, device)
        # The token each row sampled last, on the device: a pipelined plan feeds it from there.
        self.last_token = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        # Rows with penalties or a constraint: their tokens so far (prompt and output)
        self._history = TokenHistory(self.max_rows, model.config.context_length, device)
        self._grammars: GrammarRows | None = None  # constrained rows' matchers (constrain_with)
        self._prompt_logprobs = PromptLogprobRows(self.max_rows)  # rows that asked for their prompt's
        self._staging = Staging(device)
        self.workspace = (DecodeWorkspace(kv_cache, decode_workspace_tokens, rows_hint=max_batch_size)
                          if attention == "batched" and decode_workspace_tokens > 0 else None)
        self.graphs = (DecodeGraphs(model, kv_cache, self.max_rows, capture=device.type == "cuda")
                       if static_decode else None)
        # A pipeline stage before the last (services/worker/parallel.py) has no logits: the last
        # stage samples and sends each step's tokens back. They are taken at the end of the step,
        # or, with defer_sampled (a worker group overlapping its stages), by take_sampled later.
        self.samples = getattr(model, "samples", True)
        self.sends_sampled = hasattr(model, "send_sampled") and model.layout.pipeline > 1
        self.defer_sampled = False
        self._awaiting: deque[_AwaitedTokens | None] = deque()  # per step run here, oldest first (None: no token)
        # A draft model (speculative_config method draft_model, services/worker/draft.py): it proposes
        # the speculating items' tokens. None: a plan's proposals are the scheduler's own.
        self.draft: "DraftProposer | None" = None

    @classmethod
    def from_settings(cls, settings: "Settings") -> "Engine":
        from services.worker.weights import load_weights
        from shared.grammar import GrammarCompiler
        from shared.model_file import ModelFileError, load_metadata
        from shared.tokenizer import Tokenizer

        started = time.perf_counter()
        metadata = load_metadata(settings.model)
        config = serving_config(metadata.config, settings.max_model_len)
        device = pick_device(settings.device)
        dtype = pick_dtype(settings.dtype, device, metadata.stored_dtype, settings.quantization)
        if settings.quantization != "none" and device.type != "cpu":
            raise ModelFileError(f"--quantization {settings.quantization} runs on the CPU only for now, not {device}")
        graphs = settings.cuda_graphs and device.type == "cuda" and not settings.enforce_eager
        compile = settings.compile and not settings.enforce_eager
        if settings.cuda_graphs and device.type != "cuda":
            log.warning("event=cuda_graphs_ignored device=%s reason=not_cuda", device)
        # The decode workspace (a second, contiguous copy of the decoding requests' KV) pays on the
        # CPU, where gathering from the pool is slow; on CUDA it would commit gigabytes: the pool only.
        workspace_tokens = settings.decode_workspace_tokens if device.type == "cpu" else 0
        if settings.group_size > 1:  # one rank of a worker group (services/worker/group.py)
            from services.worker.parallel import Layout, ParallelLlama

            model = ParallelLlama(config, load_weights(metadata), device, dtype,
                                  Layout(settings.tensor_parallel, settings.pipeline_parallel))
        else:
            model = Llama(config, load_weights(metadata, settings.quantization), device, dtype, compile=compile)
        release_freed_heap()  # (before the pool is sized from the memory available)
        # model.config: this rank's heads and layers in a group, so its KV pool holds only those
        engine = cls(model, cls.kv_cache_for(model.config, settings, device, dtype, scratch_block=graphs,
                                             held_weights=weight_bytes(model)),
                     settings.attention, workspace_tokens, settings.max_batch_size, static_decode=graphs)
        if (draft := draft_config(settings)) is not None:
            from services.worker.draft import load_draft

            speculative = draft[1]
            engine.draft = load_draft(speculative.model, settings.model, settings.tokenizer, engine.kv_cache,
                                      engine.max_rows, config.context_length, config.vocab_size, device,
                                      draft_dtype(speculative, dtype), speculative.quantization,
                                      settings.max_batch_tokens)
            log.info("event=draft_ready model=%s quantization=%s dtype=%s bytes=%d", speculative.model,
                     speculative.quantization, engine.draft.model.dtype, engine.draft.nbytes)
        engine.constrain_with(lambda: GrammarCompiler(
            Tokenizer.for_serving(settings.model, settings.tokenizer, settings.chat_template)))
        release_freed_heap()
        log.info("event=engine_ready model=%s device=%s dtype=%s quantization=%s weight_bytes=%d kv_blocks=%d "
                 "context=%d compile=%s cuda_graphs=%s resident_bytes=%d seconds=%.2f", metadata.name, device, dtype,
                 settings.quantization, weight_bytes(model), engine.kv_cache.blocks_total, config.context_length,
                 compile, graphs, resident_bytes(), time.perf_counter() - started)
        return engine

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's keys and values take in this engine's cache, over all layers (a draft
        model's too: its KV sits at every slot of the pool)."""
        config, cache = self.config, self.kv_cache
        target = 2 * config.n_layers * config.n_kv_heads * config.head_dim * cache.keys[0].element_size()
        if self.draft is None:
            return target
        pool = self.draft.pool
        return target + 2 * pool.keys[:, 0].numel() * pool.keys.element_size()  # (layers, Hkv, D at a slot)

    @staticmethod
    def kv_blocks_in(config: ModelConfig, settings: "Settings", device: torch.device, dtype: torch.dtype,
                     held_weights: int | None = None) -> int:
        """The pool's blocks: kv_blocks; or kv_memory_fraction of the device's free memory; or, with
        gpu_memory_utilization (vLLM's meaning: the share of the device's whole memory this worker
        may use), that share less this worker's own weights and activations (own_bytes: not what
        other processes hold, so that two workers of 0.45 share a device as two vLLMs would; the weights
        as held where the model is loaded: held_weights), refused
        (KVPoolTooSmall) when it leaves no block or when the device's free memory cannot hold it."""
        bytes_per_block = kv_block_bytes(config, settings.kv_block_size, dtype)
        draft_weights = 0  # (loaded after the pool is sized: what is free now is not free for the pool)
        if (draft := draft_config(settings)) is not None:  # (a draft's KV sits at every slot of the pool too)
            shape, speculative = draft
            bytes_per_block += kv_block_bytes(shape, settings.kv_block_size, draft_dtype(speculative, dtype))
            draft_weights = shaped_weight_bytes(shape, draft_dtype(speculative, dtype))
        if settings.gpu_memory_utilization > 0:
            free, total = memory_bytes(device)
            share = int(settings.gpu_memory_utilization * total)
            own = own_bytes(config, settings, dtype, held_weights)
            room = share - own
            if room < bytes_per_block:
                raise KVPoolTooSmall(f"--gpu-memory-utilization {settings.gpu_memory_utilization:g}: {share} of {total} "
                                     f"bytes of {device}, less this worker's weights and activations ({own}), leave "
                                     f"no room for a KV block of {bytes_per_block} bytes")
            if room > free - draft_weights:
                raise KVPoolTooSmall(f"--gpu-memory-utilization {settings.gpu_memory_utilization:g}: its KV pool "
                                     f"({room} bytes) is more than {device} has free ({free} of {total}): other "
                                     f"processes hold the rest; give each a smaller share")
            return room // bytes_per_block
        if settings.kv_memory_fraction <= 0:
            return settings.kv_blocks
        return max(1, int((free_memory_bytes(device) - draft_weights) * settings.kv_memory_fraction) // bytes_per_block)

    @classmethod
    def blocks_for_settings(cls, settings: "Settings") -> int:
        """kv_blocks_in for a model file, before it is loaded (rank 0's heads and layers in a group)."""
        from services.worker.parallel import Layout, rank_config
        from shared.model_file import load_metadata

        metadata = load_metadata(settings.model)
        device = pick_device(settings.device)
        config = rank_config(serving_config(metadata.config, settings.max_model_len),
                             Layout(settings.tensor_parallel, settings.pipeline_parallel), 0)
        return cls.kv_blocks_in(config, settings, device, pick_dtype(settings.dtype, device, metadata.stored_dtype))

    @classmethod
    def kv_cache_for(cls, config: ModelConfig, settings: "Settings", device: torch.device, dtype: torch.dtype,
                     scratch_block: bool = False, held_weights: int | None = None) -> PagedKVCache:
        blocks = cls.kv_blocks_in(config, settings, device, dtype, held_weights)
        return PagedKVCache(config.n_layers, config.n_kv_heads, config.head_dim, blocks, settings.kv_block_size,
                            device, dtype, max_rows=settings.max_batch_size,
                            max_blocks_per_row=-(-config.context_length // settings.kv_block_size),
                            scratch_block=scratch_block)

    # Requests (the rows themselves: services/worker/rows.py)

    def constrain_with(self, compiler: "Callable[[], GrammarCompiler]") -> None:
        """Serve structured outputs, with the grammar compiler of the model's tokenizer (made on the
        first constrained request). An engine without one refuses constrained requests."""
        self._grammars = GrammarRows(self.max_rows, self.config.vocab_size, compiler)

    def _row_added(self, row: int, sampling: "SamplingParams", history: Sequence[int]) -> None:
        if self.draft is not None and history:
            self.draft.start(row, history)
        self._sampling.set(row, sampling)
        self._prompt_logprobs.start(row, sampling.prompt_logprobs)
        if not sampling.needs_history:
            self._history.stop(row)
        elif history or not self._history.tracked[row]:
            self._history.start(row, history)  # its cached prefix's tokens: the rest is fed
        if self._grammars is not None:
            if sampling.structured is None:
                self._grammars.stop(row)
            else:
                self._grammars.start(row, sampling.structured)

    def _draft_refusal(self, item: "StepItem", count: int, row: int) -> str | None:
        if not self.samples or self.sends_sampled:  # (the tokens kept would have to travel back between stages)
            return "speculation is not served by pipeline-parallel workers"
        if self._params[row].logprobs >= 0:
            return "a request that asks for logprobs is not speculated"
        return super()._draft_refusal(item, count, row)

    def _refusal(self, sampling: "SamplingParams") -> str | None:
        if sampling.structured is not None and self._grammars is None:
            return "this engine was made without a grammar compiler: it cannot constrain an output"
        if sampling.prompt_logprobs >= 0 and getattr(getattr(self.model, "layout", None), "pipeline", 1) > 1:
            # (the last stage has the logits, and only the tokens travel back to the first)
            return "prompt log-probabilities are not served by pipeline-parallel workers"
        return None

    def _row_freed(self, row: int) -> None:
        if self.draft is not None:
            self.draft.start(row, ())
        self._history.stop(row)
        self._prompt_logprobs.stop(row)
        if self._grammars is not None:
            self._grammars.stop(row)

    def reset(self) -> None:
        super().reset()
        if self.workspace is not None:
            self.workspace.forget()

    def _free_kv(self, row: int) -> None:
        self.kv_cache.free(row)
        if self.workspace is not None:
            self.workspace.drop(row)

    # One iteration

    def step(self, items: Sequence["StepItem"]) -> StepOutcome:
        started = time.perf_counter()
        outcome = StepOutcome()
        if self._history.any_tracked:
            items = self._with_whole_history(items, outcome)
        columns = self.columns(items, outcome)
        if columns is not None:
            self._run(columns, outcome)
            if self.draft is not None:
                self.draft.fed(columns)
        elif not self.samples:
            self._await_sampled(None, outcome)
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _await_sampled(self, entry: _AwaitedTokens | None, outcome: StepOutcome) -> None:
        self._awaiting.append(entry)
        if not self.defer_sampled:
            self.take_sampled(outcome)

    def take_sampled(self, outcome: StepOutcome | None = None) -> StepOutcome:
        """A stage before the last: the oldest step's tokens as the last stage sampled them, noted
        as if sampled here (not on a row given up, or given to another request, since that step)."""
        outcome = outcome if outcome is not None else StepOutcome()
        if self.samples:  # the last stage: it has its tokens already
            return outcome
        entry = self._awaiting.popleft()
        if entry is None:
            return outcome
        from services.worker.parallel import SampledBack

        entry.wait()
        rows, params = entry.rows, entry.params
        back = SampledBack.unpack(entry.buffer, any(getattr(value, "logprobs", -1) >= 0 for value in params))
        tokens = back.token_ids.cpu().numpy()
        kept = np.flatnonzero(self._row_serial[rows] == entry.serials)
        self._last_output_index[rows[kept]] = entry.output_indices[kept]
        self._last_token_host[rows[kept]] = tokens[kept]
        if kept.size:
            self.last_token.index_copy_(0, torch.from_numpy(rows[kept]).to(self.last_token.device),
                                        back.token_ids[torch.from_numpy(kept).to(back.token_ids.device)])
        outcome.tokens = dict(zip(entry.request_ids, tokens.tolist()))
        if back.logprob is not None:
            self._take_logprobs(back, entry.request_ids, params, outcome)
        return outcome

    def wait_sampled(self) -> None:
        """Until the oldest step's tokens are back (from any thread: take_sampled then has them)."""
        if self._awaiting and self._awaiting[0] is not None:
            self._awaiting[0].wait()

    def _run(self, columns: StepColumns, outcome: StepOutcome) -> None:
        if columns.drafts and self.draft is not None:
            self.draft.propose(columns)  # (over the plan's placeholders)
        device, kv_cache, stage = self.model.device, self.kv_cache, self._staging.to_device
        rows, starts, counts = (np.asarray(values, dtype=np.int64) for values in
                                (columns.rows, columns.starts, columns.counts))
        sampled = np.asarray(columns.sample, dtype=bool)
        query_starts = np.cumsum(counts) - counts
        num_tokens = int(counts.sum())
        positions = np.repeat(starts - query_starts, counts) + np.arange(num_tokens)
        token_ids = stage("token_ids", np.asarray(columns.token_ids, dtype=np.int64))
        if columns.feed_positions:  # pipelined: their input is what the step before sampled, on the device
            feed_rows = stage("feed_rows", np.asarray(columns.feed_rows, dtype=np.int64))
            token_ids[stage("feed_positions", np.asarray(columns.feed_positions, dtype=np.int64))] = \
                self.last_token.index_select(0, feed_rows)
        slot_mapping = stage("slot_mapping", kv_cache.slots(np.repeat(rows, counts), positions))
        config = self.config
        decodes = counts == 1
        all_output_indices = np.asarray(columns.output_indices, dtype=np.int64)
        prompt = self._prompt_logprobs.asking(rows, all_output_indices, query_starts, counts, sampled)
        # The positions whose next token is sampled: each sampled item's last, and a speculating item's
        # last draft_tokens + 1 (services/worker/speculation.py)
        per_item = None
        if columns.drafts:
            per_column = np.ones(rows.size, dtype=np.int64)
            per_column[list(columns.drafts)] += list(columns.drafts.values())
            per_item = per_column[sampled]
        if per_item is None:
            sample_positions = (query_starts + counts - 1)[sampled]
        else:
            sample_positions = np.repeat((query_starts + counts)[sampled] - per_item, per_item) + ragged_arange(per_item)
        try:
            if (self.graphs is not None and prompt is None and per_item is None and decodes.all()
                    and self.graphs.fits(rows.size, int(starts.max()) + 1)):
                logits = self.graphs.run(token_ids, stage("positions", positions), slot_mapping, rows, starts + 1)
                if not sampled.all():
                    logits = logits[stage("sampled", np.flatnonzero(sampled))]
            else:
                workspace = None
                if self.workspace is not None and self.attention == "batched" and decodes.any():
                    workspace_rows = self.workspace.prepare(list(zip(rows[decodes].tolist(), starts[decodes].tolist())))
                    if workspace_rows is not None:
                        workspace = (self.workspace.layer_keys, self.workspace.layer_values, workspace_rows)
                layout = StepLayout(rows, query_starts, counts, starts)
                batch = build_batch(self.attention, layout, slot_mapping, kv_cache, config.n_heads // config.n_kv_heads,
                                    config.n_kv_heads * config.head_dim, device, self.model.dtype, workspace)
                logit_rows = sample_positions
                if prompt is not None:  # and the prompt positions whose log-probabilities are asked for
                    logit_rows = np.concatenate([logit_rows, prompt.positions])
                logits = self.model.forward(token_ids, stage("positions", positions), batch, kv_cache,
                                            stage("logit_rows", logit_rows))
        except BaseException:
            if self.workspace is not None:
                self.workspace.forget()  # rows may be half-written: none can be trusted
            raise
        kv_cache.lengths[rows] = starts + counts
        self._history.fed(np.repeat(rows, counts), positions, token_ids, rows, starts + counts)
        sampled_rows = rows[sampled]
        output_indices = all_output_indices[sampled]
        if prompt is not None and logits is not None:
            outcome.prompt_logprobs = self._prompt_logprobs.take(
                prompt, logits[sample_positions.size :], columns.request_ids, rows, starts, counts, columns.fed_tokens)
            logits = logits[: sample_positions.size]
        if per_item is not None:
            self._verify(columns, logits, rows, starts, counts, sampled, all_output_indices, per_item, outcome)
            return
        if logits is None:  # a stage before the last: its tokens come from the last stage
            entry = None
            if sampled_rows.size:
                entry = _AwaitedTokens(
                    [request_id for request_id, sample_it in zip(columns.request_ids, columns.sample) if sample_it],
                    sampled_rows, self._row_serial[sampled_rows].copy(), output_indices,
                    [self._params[row] for row in sampled_rows.tolist()],
                    *self.model.receive_sampled(int(sampled_rows.size)))
            self._await_sampled(entry, outcome)
            return
        if not sampled.any():
            return
        result = self._sample(logits, sampled_rows, output_indices)
        if self.sends_sampled:
            self.model.send_sampled(result)
        self.last_token.index_copy_(0, stage("sampled_rows", sampled_rows), result.token_ids)
        tokens = result.token_ids.cpu().numpy()  # (the step's last wait for the device)
        if self._grammars is not None:
            self._grammars.consume(sampled_rows, output_indices, tokens)
        request_ids = self.sampled(columns, tokens)
        outcome.tokens = dict(zip(request_ids, tokens.tolist()))
        if result.logprob is not None:
            self._take_logprobs(result, request_ids, [self._params[row] for row in sampled_rows.tolist()], outcome)

    def _verify(self, columns: StepColumns, logits: torch.Tensor, rows: np.ndarray, starts: np.ndarray,
                counts: np.ndarray, sampled: np.ndarray, output_indices: np.ndarray, per_item: np.ndarray,
                outcome: StepOutcome) -> None:
        """A step with speculating items (services/worker/speculation.py): sample every item's
        per_item positions ([sum(per_item), V] logits), keep each item's proposals while they equal
        the tokens sampled, and roll its KV length back to what it kept."""
        item_rows = rows[sampled]
        sample_rows = np.repeat(item_rows, per_item)
        result = self._sample(logits, sample_rows, np.repeat(output_indices[sampled], per_item) + ragged_arange(per_item))
        tokens = result.token_ids.cpu().numpy()  # (the step's last wait for the device)
        proposed = [tuple(fed[len(fed) - count + 1 :]) for fed, count in
                    zip((fed for fed, sample_it in zip(columns.fed_tokens, columns.sample) if sample_it), per_item)]
        kept = accepted(tokens, proposed, per_item)
        firsts = np.cumsum(per_item) - per_item
        lasts = firsts + kept  # each item's last token: the one sampled after its last proposal kept
        self.kv_cache.lengths[item_rows] = (starts + counts)[sampled] - per_item + 1 + kept
        self.last_token.index_copy_(0, self._staging.to_device("sampled_rows", item_rows),
                                    result.token_ids[self._staging.to_device("kept_last", lasts)])
        # (the rows beside the speculating ones, one token each, as in _run: constraints, logprobs)
        if self._grammars is not None:
            self._grammars.consume(item_rows, output_indices[sampled] + kept, tokens[lasts])
        request_ids = self.sampled(columns, tokens[lasts])
        self._last_output_index[item_rows] = output_indices[sampled] + kept
        if result.logprob is not None:  # (a speculating row asks for none: its last token is its only one)
            picked = self._staging.to_device("kept_last", lasts)
            self._take_logprobs(SamplerOutput(result.token_ids[picked], result.logprob[picked], result.top_ids[picked],
                                              result.top_logprobs[picked]),
                                request_ids, [self._params[row] for row in item_rows.tolist()], outcome)
        listed = tokens.tolist()
        outcome.tokens = {request_id: listed[first] for request_id, first in zip(request_ids, firsts.tolist())}
        outcome.speculated = {request_id: listed[first : last + 1] for request_id, first, last, count in
                              zip(request_ids, firsts.tolist(), lasts.tolist(), per_item.tolist()) if count > 1}

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, output_indices: np.ndarray) -> SamplerOutput:
        """The next token of each sampled row ([rows, V] logits, in the order of `rows`)."""
        sampling_rows = self._sampling.rows(rows, output_indices, self.config.vocab_size)
        history = self._history.for_sample(rows, output_indices) if self._history.any_tracked else None
        return sample(logits, sampling_rows, history, adjust=self._adjustments(rows, output_indices))

    def _adjustments(self, rows: np.ndarray, output_indices: np.ndarray) -> LogitAdjustments | None:
        """The constrained rows' masks (filled here, on the host, while a GPU runs the step's forward
        pass) and the logit biases of the sampled rows, or None when none has either."""
        device = self.model.device
        masks = None
        if self._grammars is not None:
            masks = self._grammars.masks(rows, output_indices, self._history.outputs, device)
        bias = self._sampling.biases(rows)
        if masks is None and bias is None:
            return None
        adjust = LogitAdjustments()
        if masks is not None:
            adjust.mask_rows, adjust.bitmask = masks
        if bias is not None:
            adjust.bias_rows, adjust.bias_ids, adjust.bias_values = bias
        return adjust

    def _with_whole_history(self, items: Sequence["StepItem"], outcome: StepOutcome) -> Sequence["StepItem"]:
        """The items, but those of rows with penalties or a constraint whose history would have a gap
        (tokens before the item's start that the row was neither fed nor given): a penalty over part
        of a request's tokens, or a constraint replayed from part of its output, is a wrong output, so
        such an item is refused (the scheduler rebuilds the request)."""
        kept, tracked, lengths = [], self._history.tracked, self._history.lengths
        for item in items:
            row = self._row_of.get(item.request_id)
            if row is not None and tracked[row] and item.start_position > lengths[row]:
                outcome.errors.append(ItemRefusal(
                    item.request_id, "bad_item", f"its token history holds {lengths[row]} tokens, but the item "
                                                 f"starts at {item.start_position}"))
                continue
            kept.append(item)
        return kept

    @staticmethod
    def _take_logprobs(result, request_ids: list[str], params: list["SamplingParams"], outcome: StepOutcome) -> None:
        chosen = result.logprob.float().cpu().tolist()
        top_ids = result.top_ids.cpu().tolist()
        top_logprobs = result.top_logprobs.float().cpu().tolist()
        for index, (request_id, request_params) in enumerate(zip(request_ids, params)):
            wanted = getattr(request_params, "logprobs", -1)
            if wanted < 0:
                continue
            top = tuple(zip(top_ids[index][:wanted], top_logprobs[index][:wanted]))
            outcome.logprobs[request_id] = TokenLogprobs(chosen[index], top)
