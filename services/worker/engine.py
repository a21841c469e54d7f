"""The execution engine: one iteration at a time, tensors in, tokens out.

A step takes any mix of prompt chunks and decode tokens (StepItems), reserves their KV
blocks, runs the model once on all their tokens (selective batching) and samples the next
token of every item that reaches the end of its known tokens.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from services.worker.attention import AttentionMode, StepRequest, build_batch
from services.worker.decode_workspace import DecodeWorkspace
from services.worker.kv_cache import KVCacheFull, PagedKVCache
from services.worker.model import Llama
from services.worker.sampling import sample_tokens
from services.worker.weights import load_weights
from shared.config import Settings
from shared.messages import ItemError, SamplingParams, StepItem
from shared.model_file import ModelConfig, load_metadata

log = logging.getLogger("iterserve.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepOutcome:
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    errors: list[ItemError] = field(default_factory=list)  # items that did not run
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # when asked: [V] float32
    seconds: float = 0.0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def free_memory_bytes(device: torch.device) -> int:
    """Memory the KV pool may take a fraction of: free GPU memory, or available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


def default(setting: str):
    return Settings.model_fields[setting].default


class Engine:
    def __init__(self, model: Llama, kv_cache: PagedKVCache, attention: AttentionMode = "batched",
                 decode_workspace_tokens: int = default("decode_workspace_tokens"),
                 max_batch_size: int = default("max_batch_size")):
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.config: ModelConfig = model.config
        self._sampling: dict[str, SamplingParams] = {}
        self._last_sampled: dict[str, tuple[int, int]] = {}  # request id -> (output_index, token) sampled last
        self.workspace = (DecodeWorkspace(kv_cache, decode_workspace_tokens, rows_hint=max_batch_size)
                          if attention == "batched" and decode_workspace_tokens > 0 else None)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Engine":
        started = time.perf_counter()
        metadata = load_metadata(settings.model)
        device = pick_device(settings.device)
        dtype = pick_dtype(settings.dtype, device)
        model = Llama(metadata.config, load_weights(metadata), device, dtype)
        engine = cls(model, cls.kv_cache_for(metadata.config, settings, device, dtype), settings.attention,
                     settings.decode_workspace_tokens, settings.max_batch_size)
        log.info("event=engine_ready model=%s device=%s dtype=%s kv_blocks=%d seconds=%.2f",
                 metadata.name, device, dtype, settings.kv_blocks, time.perf_counter() - started)
        return engine

    @staticmethod
    def kv_cache_for(config: ModelConfig, settings: Settings, device: torch.device, dtype: torch.dtype) -> PagedKVCache:
        blocks = settings.kv_blocks
        if settings.kv_memory_fraction > 0:
            bytes_per_block = (2 * config.n_layers * config.n_kv_heads * config.head_dim * settings.kv_block_size
                               * torch.finfo(dtype).bits // 8)
            blocks = max(1, int(free_memory_bytes(device) * settings.kv_memory_fraction) // bytes_per_block)
        return PagedKVCache(config.n_layers, config.n_kv_heads, config.head_dim, blocks, settings.kv_block_size,
                            device, dtype)

    # Requests

    def add_request(self, request_id: str, sampling: SamplingParams) -> None:
        self._sampling[request_id] = sampling

    def free(self, request_id: str) -> None:
        """Forget a request and return its KV blocks to the pool (harmless when unknown)."""
        self._sampling.pop(request_id, None)
        self._last_sampled.pop(request_id, None)
        self._free_kv(request_id)

    def reset(self) -> None:
        self._sampling.clear()
        self._last_sampled.clear()
        self.kv_cache.free_all()
        if self.workspace is not None:
            self.workspace.forget()

    def _free_kv(self, request_id: str) -> None:
        self.kv_cache.free(request_id)
        if self.workspace is not None:
            self.workspace.drop(request_id)

    @property
    def running(self) -> int:
        return len(self._sampling)

    # One iteration

    def _resolve(self, item: StepItem) -> StepItem | ItemError:
        """The item with its input token filled in when it feeds the token sampled before it."""
        if not item.feeds_sampled:
            return item
        last = self._last_sampled.get(item.request_id)
        if item.token_ids or last is None or last[0] != item.output_index - 1:
            return ItemError(request_id=item.request_id, code="bad_item",
                             message=f"no token sampled at output_index {item.output_index - 1} to feed")
        return item.model_copy(update={"token_ids": (last[1],), "feeds_sampled": False})

    def _check(self, item: StepItem) -> ItemError | None:
        def error(code, message):
            return ItemError(request_id=item.request_id, code=code, message=message)

        if item.request_id not in self._sampling:
            return error("unknown_request", "no sampling parameters were sent for this request")
        if not item.token_ids:
            return error("bad_item", "no tokens to feed")
        if item.start_position + len(item.token_ids) > self.config.context_length:
            return error("bad_item", f"exceeds the context length {self.config.context_length}")
        if min(item.token_ids) < 0 or max(item.token_ids) >= self.config.vocab_size:
            return error("bad_item", "token id outside the vocabulary")
        held = self.kv_cache.length(item.request_id)
        if item.start_position == 0 and held:
            self._free_kv(item.request_id)  # a rebuild from the first token
        elif item.start_position != held:
            return error("bad_item", f"start_position {item.start_position} but {held} tokens are in the KV cache")
        return None

    def step(self, items: Sequence[StepItem], return_logits: bool = False) -> StepOutcome:
        started = time.perf_counter()
        outcome = StepOutcome()
        runnable: list[StepItem] = []
        seen: set[str] = set()
        for item in items:
            if item.request_id in seen:
                outcome.errors.append(ItemError(request_id=item.request_id, code="bad_item",
                                                message="a request may have one item per step"))
                continue
            seen.add(item.request_id)
            if item.feeds_sampled and item.request_id in self._sampling:
                item = self._resolve(item)
                if isinstance(item, ItemError):
                    outcome.errors.append(item)
                    continue
            if (problem := self._check(item)) is not None:
                outcome.errors.append(problem)
                continue
            try:
                self.kv_cache.grow(item.request_id, item.start_position + len(item.token_ids))
            except KVCacheFull as full:
                outcome.errors.append(ItemError(request_id=item.request_id, code="kv_cache_full", message=str(full)))
                continue
            runnable.append(item)
        if runnable:
            self._run(runnable, outcome, return_logits)
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _run(self, items: list[StepItem], outcome: StepOutcome, return_logits: bool) -> None:
        device = self.model.device
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        requests: list[StepRequest] = []
        logit_rows: list[int] = []
        sampled: list[StepItem] = []
        for item in items:
            start, count = item.start_position, len(item.token_ids)
            blocks = self.kv_cache.block_table(item.request_id)
            requests.append(StepRequest(len(token_ids), count, start, blocks))
            token_ids.extend(item.token_ids)
            positions.extend(range(start, start + count))
            slot_mapping.extend(self.kv_cache.slots(item.request_id, start, start + count))
            if item.sample:
                logit_rows.append(len(token_ids) - 1)
                sampled.append(item)
        config = self.config
        workspace = None
        decodes = [(item.request_id, item.start_position) for item in items if len(item.token_ids) == 1]
        if self.workspace is not None and decodes and self.attention == "batched":
            rows = self.workspace.prepare(decodes)
            if rows is not None:
                workspace = (self.workspace.keys, self.workspace.values, rows)
        batch = build_batch(self.attention, requests, slot_mapping, self.kv_cache.block_size,
                            config.n_heads // config.n_kv_heads, config.n_kv_heads * config.head_dim, device,
                            self.model.dtype, workspace)
        try:
            logits = self.model.forward(
                torch.tensor(token_ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                batch, self.kv_cache,
                torch.tensor(logit_rows, dtype=torch.long, device=device),
            )
        except BaseException:
            if self.workspace is not None:
                self.workspace.forget()  # rows may be half-written: none can be trusted
            raise
        for item in items:
            self.kv_cache.set_length(item.request_id, item.start_position + len(item.token_ids))
        if not sampled:
            return
        params = [self._sampling[item.request_id] for item in sampled]
        tokens = sample_tokens(logits, params, [item.output_index for item in sampled])
        for row, (item, token) in enumerate(zip(sampled, tokens)):
            outcome.tokens[item.request_id] = token
            self._last_sampled[item.request_id] = (item.output_index, token)
            if return_logits:
                outcome.logits[item.request_id] = logits[row].cpu()
