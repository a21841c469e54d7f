"""One request's state in the scheduler, and one worker's (the nano-vllm Sequence and block
manager, split across processes): pure data, no Redis, no tensors."""

from dataclasses import dataclass, field
from typing import Literal

from services.scheduler.prefix_cache import WorkerPrefixCache
from services.scheduler.running_rows import RunningRows
from shared.messages import FinishReason, RequestRecord, SamplingParams
from shared.plans import ColumnPlan

Phase = Literal["waiting", "running", "finished", "cancelled", "failed"]


@dataclass(eq=False, slots=True)
class RequestState:
    record: RequestRecord
    arrival_seq: int  # breaks ties between equal arrival times, so FCFS stays deterministic
    output_token_ids: list[int] = field(default_factory=list)
    worker_id: str | None = None  # the worker holding its KV (None while waiting)
    # Tokens of prompt + output in that worker's KV once the plans sent to it have run (plans
    # are pipelined: the next one is planned while the one before runs).
    computed: int = 0
    in_flight_samples: int = 0  # tokens it samples in plans sent but not answered yet
    row: int = -1  # its row on that worker (RunningRows): its handle in that worker's plans
    kv_blocks: int = 0  # KV blocks reserved for it on that worker (its own and shared cached ones)
    # Prefix caching: the hashes of its full known blocks, one chain per kind of worker cache (its
    # root: WorkerState.cache_root, which says the block size and what else makes the blocks' KV), a
    # function of its tokens kept when it moves; and on its current worker the hash of each of its
    # blocks registered in that worker's cache (None: its own); the first `adopted_blocks` came
    # from the cache when it was admitted.
    block_chains: dict[bytes, list[bytes]] = field(default_factory=dict)
    held_hashes: list[bytes | None] = field(default_factory=list)
    adopted_blocks: int = 0
    cached_tokens: int | None = None  # prompt tokens found cached when it was first admitted (usage)
    status: Phase = "waiting"
    finish_reason: FinishReason | None = None
    stepped_on_worker: bool = False  # has had a step on its current worker (for IterationRecord.joined)
    item_errors: int = 0  # worker errors on its items; too many fail the request
    workers_lost: int = 0  # workers that died while it ran on them; too many fail it
    workers_write: bool = False  # its workers write its token entries (SchedulerPolicy.workers_write_entries)
    output_limit: int = 0  # output tokens at which it ends by length (shared/finishing.py's length_limit)
    # Speculative decoding (services/scheduler/speculation.py): the tokens its item in flight
    # proposes (0: none; its KV then holds `computed` plus those kept), whether its sampling lets it
    # speculate, and the back-off after proposals that found nothing or were all refused: plans to
    # run pipelined before it proposes again, and how many misses in a row.
    drafts_in_flight: int = 0
    speculable: bool = False
    speculation_wait: int = 0
    speculation_misses: int = 0
    draft_length: int = 0  # a draft model's proposals for its next verification (0: the config's most)
    spec_proposed: int = 0  # its tokens proposed and kept, over its verifications (on this scheduler)
    spec_kept: int = 0

    # Copied from the record once: read for every request at every step (the record never changes).
    request_id: str = field(init=False)
    prompt_token_ids: tuple[int, ...] = field(init=False)
    prompt_length: int = field(init=False)
    sampling: SamplingParams = field(init=False)
    fcfs_key: tuple[float, int] = field(init=False)

    def __post_init__(self) -> None:
        record = self.record
        self.request_id, self.sampling = record.request_id, record.sampling
        self.prompt_token_ids = record.prompt_token_ids
        self.prompt_length = len(record.prompt_token_ids)
        self.fcfs_key = (record.arrival_time, self.arrival_seq)

    @property
    def total_tokens(self) -> int:
        return self.prompt_length + len(self.output_token_ids)

    @property
    def planned_outputs(self) -> int:
        """Output tokens once the plans in flight are answered."""
        return len(self.output_token_ids) + self.in_flight_samples

    @property
    def planned_tokens(self) -> int:
        """Prompt + output tokens once the plans in flight are answered."""
        return self.prompt_length + len(self.output_token_ids) + self.in_flight_samples

    @property
    def pending_tokens(self) -> int:
        """Tokens not yet sent to the worker's KV (1 for a decode step, more for a (re)prefill)."""
        return self.prompt_length + len(self.output_token_ids) + self.in_flight_samples - self.computed

    @property
    def is_decoding(self) -> bool:
        """Its next step feeds only the token sampled at its previous step."""
        outputs = len(self.output_token_ids) + self.in_flight_samples
        return outputs > 0 and self.computed == self.prompt_length + outputs - 1

    @property
    def is_active(self) -> bool:
        return self.status in ("waiting", "running")

    def block_chain(self, root: bytes) -> list[bytes]:
        """Its chain of block hashes under a cache root (as far as it was extended: extend_chain)."""
        chain = self.block_chains.get(root)
        if chain is None:
            chain = self.block_chains[root] = []
        return chain

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) of prompt + output, without joining the two."""
        prompt = self.record.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        from_output = tuple(self.output_token_ids[max(0, start - len(prompt)) : end - len(prompt)])
        return (prompt[start:] if start < len(prompt) else ()) + from_output


@dataclass(eq=False)
class PlanInFlight:
    """A plan sent to a worker, kept until its result comes back: each of its items' request, as
    columns in the plan's wire order (the decodes it feeds, then the others)."""

    plan: ColumnPlan
    started_at: float  # when it was sent (its step starts when the plan before it is done)
    joined: tuple[str, ...]
    prefill_tokens: int
    decode_tokens: int
    states: list[RequestState]
    output_indexes: list[int]  # of the token each item samples (or would: the next output's)
    handles: list[int]  # each one's row when sent
    # Items that do not sample (prefill chunks short of a prompt's end): False here, with the tokens
    # in the worker's KV after them in `ends`. None when every item samples (most plans): a sampling
    # item's KV ends at its prompt plus its output index.
    samples: list[bool] | None = None
    ends: list[int] | None = None
    # Its requests that left the worker since it was sent (finished, cancelled, preempted, moved):
    # nothing of their items is applied (a request back on the worker meanwhile is in later plans).
    left: set[RequestState] = field(default_factory=set)
    # A plan of several steps (Settings.scheduler_steps) is in flight as one of these per step, each
    # answered by a result of its own: this one's step (0: the plan as sent), and the request ids
    # of the items that run it where they are fewer than the plan's (None: the plan's item_ids).
    step: int = 0
    step_request_ids: tuple[str, ...] | None = None
    # Its worker's prefix-cache digest once the plan's commands are carried out (as the scheduler's
    # copy has it then: shared/cache_digest.py); its result must report the same.
    cache_digest: int = 0

    @property
    def plan_id(self) -> int:
        """The plan id its result answers (a plan's later steps answer the ids after the plan's)."""
        return self.plan.plan_id + self.step

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.plan.item_ids if self.step_request_ids is None else self.step_request_ids

    def holds(self, state: RequestState) -> bool:
        """The plan has an item of this request."""
        return any(held is state for held in self.states)


@dataclass(eq=False)
class WorkerState:
    worker_id: str
    kv_blocks_total: int
    kv_block_size: int
    # The root of its cache's block hashes: the model, the block size and what else makes a block's
    # KV (the weights, the KV dtype: WorkerInfo). Workers whose blocks of the same tokens may differ
    # name them differently, so a request's chain for one is never matched against another.
    cache_root: bytes = b""
    draining: bool = False  # takes no new requests
    # Verifies proposed tokens (speculative decoding): a worker of one stage that runs the model (not
    # the emulated executor, nor pipeline stages, whose last stage's tokens travel back one a step).
    speculates: bool = True
    free_all: bool = False  # its next plan tells it to drop all its KV first (set when it comes up)
    running: dict[str, RequestState] = field(default_factory=dict)  # in admission order
    rows: RunningRows = field(default_factory=RunningRows)  # their rows (handles) and FCFS order
    known: set[str] = field(default_factory=set)  # got their NewRequest since they were last freed here
    to_free: dict[str, int] = field(default_factory=dict)  # left this worker since its last plan: their rows
    kv_blocks_reserved: int = 0  # blocks its running requests hold as their own (not registered)
    cache: WorkerPrefixCache = field(default_factory=WorkerPrefixCache)
    to_register: list[tuple[str, int, bytes, int]] = field(default_factory=list)  # (request, block index, hash, row)
    to_evict: list[bytes] = field(default_factory=list)
    in_flight: list[PlanInFlight] = field(default_factory=list)  # oldest first; the worker runs them in order
    last_result_at: float = 0.0
    # A worker group of several pipeline stages runs that many plans at once: each of different
    # requests (a request's next token needs its last), about 1/stages of them each (Orca fig. 8).
    stages: int = 1
    # How long its steps take, recently (seconds, a moving average of the steps its answers report;
    # None before its first answer): how many steps its plans run with Settings.scheduler_plan_ms.
    step_seconds: float | None = None

    def measured_step(self, seconds: float) -> None:
        """A step's time from its answer, into the moving average (a quarter weight: a prefill-heavy
        step or a pause moves it, and a few steps later it is back)."""
        average = self.step_seconds
        self.step_seconds = seconds if average is None else average + 0.25 * (seconds - average)

    @property
    def plans_in_flight(self) -> int:
        """Plans sent and not answered (a plan of several steps is one, however many it has left)."""
        return sum([not flight.step for flight in self.in_flight])

    @property
    def kv_blocks_free(self) -> int:
        """Blocks neither held by a request nor cached."""
        return self.kv_blocks_total - self.kv_blocks_reserved - len(self.cache)

    @property
    def kv_blocks_available(self) -> int:
        """Free blocks and idle cached ones (evicted when needed): room for admission."""
        return self.kv_blocks_free + self.cache.blocks_idle

    def take_blocks(self, count: int) -> None:
        """Reserve `count` blocks of a request's own, evicting idle cached ones if too few are free
        (the caller checked kv_blocks_available)."""
        if count > self.kv_blocks_free:
            self.to_evict.extend(self.cache.evict(count - self.kv_blocks_free))
        self.kv_blocks_reserved += count

    def clear_cache(self) -> None:
        self.cache.clear()
        self.to_register.clear()
        self.to_evict.clear()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.kv_block_size)
