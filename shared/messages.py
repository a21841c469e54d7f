"""Typed messages between the gateway, the scheduler and the workers.

Each crosses a process boundary as msgpack (see shared/wire.py) and is validated where
it enters a process. PROTOCOL_VERSION changes whenever a message changes shape.
"""

from dataclasses import dataclass
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1

FinishReason = Literal["stop", "length", "cancelled", "error"]
RequestStatus = Literal["waiting", "running", "finished", "cancelled", "failed"]


class Frozen(BaseModel):
    # No NaN or infinity anywhere: a NaN arrival time would break the scheduler's sorted queue.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class StructuredOutput(Frozen):
    """A constraint on a request's output text (OpenAI's response_format, vLLM's structured_outputs):
    the worker masks every token that cannot continue it (shared/grammar.py)."""

    # json: a JSON Schema (spec, as JSON text); json_object: any JSON object (spec empty); regex: a
    # regular expression; choice: one of the strings of spec (a JSON list); grammar: Lark or GBNF.
    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str = ""


MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)


class SamplingParams(Frozen):
    temperature: float = Field(0.0, ge=0.0, le=100.0)  # 0 means greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=2**31)  # 0 means no top-k cut
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # drop tokens below min_p x the top probability
    # OpenAI's penalties on the output so far: logit -= frequency x count + presence x (count > 0).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # HF/vLLM's, on tokens of the prompt or the output: logit / r when > 0, logit x r otherwise.
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    # -1: no logprobs; n >= 0: the chosen token's log-probability and the n most likely tokens'.
    logprobs: int = Field(-1, ge=-1, le=20)
    # -1: none; n >= 0: each prompt token's log-probability and rank, and the n most likely tokens at
    # its position (vLLM's prompt_logprobs; the completions' echo with logprobs). The worker writes
    # them into the request's hash before the first token's entry (services/worker/prompt_logprobs.py).
    prompt_logprobs: int = Field(-1, ge=-1, le=20)
    # Always set (the gateway draws one when the client gives none): the randomness of
    # output token k is a function of (seed, k) only, so a request samples the same
    # tokens whatever its batch, its worker, or a rebuild of its KV.
    seed: int = Field(0, ge=0, lt=2**63)
    max_tokens: int = Field(16, ge=1)
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first one
    ignore_eos: bool = False  # benchmarks force output lengths
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the token's logit, sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = Field((), max_length=MAX_LOGIT_BIAS)
    structured: StructuredOutput | None = None  # the output follows this constraint

    @property
    def has_penalty(self) -> bool:
        """Whether a token's logit depends on the tokens before it (its prompt and output so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether a worker needs the request's tokens so far, not only its KV: penalties count them,
        and a constraint's state is a function of its output tokens (replayed after a move)."""
        return self.has_penalty or self.structured is not None


class RequestRecord(Frozen):
    """An accepted request, written to Redis by the gateway before it answers."""

    version: Literal[1] = PROTOCOL_VERSION
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float  # unix seconds at the gateway
    client_key: str = ""  # which API key sent it (fairness); empty when the server is open


Logprob = tuple[int, float]  # (token id, log-probability)


class TokenEvent(Frozen):
    """One entry of a request's output stream (scheduler -> gateway)."""

    index: int  # position among the request's output tokens, 0-based
    token_id: int  # -1 for an entry that carries no token (a finish without one)
    text: str  # the text this token completes (held-back bytes come with a later token)
    finish_reason: FinishReason | None = None  # set on the request's last entry
    prompt_tokens: int = 0  # on the last entry, for usage
    completion_tokens: int = 0  # on the last entry, for usage
    cached_tokens: int = 0  # on the last entry: prompt tokens found in the prefix cache at its admission
    logprob: float | None = None  # the token's log-probability, when the request asked for logprobs
    top_logprobs: tuple[Logprob, ...] = ()  # the most likely tokens at this position, most likely first


# One prompt token's log-probabilities: (its token id, its log-probability, its rank among the vocabulary
# from 1, the most likely tokens at its position, most likely first).
PromptTokenLogprobs = tuple[int, float, int, tuple[Logprob, ...]]


class PromptLogprobsChunk(Frozen):
    """The prompt tokens' log-probabilities one step computed (worker -> gateway): a field of the
    request's hash (keys.prompt_logprobs_field), written with the result of that step."""

    first_position: int = Field(ge=1, lt=2**31)  # the prompt position of the first entry's token
    entries: tuple[PromptTokenLogprobs, ...] = Field(max_length=2**20)  # consecutive positions from there


# The per-iteration messages between the scheduler and a worker are plain dataclasses, not models:
# a plan holds an item per request of the batch and a result a token per request, built and read
# once per iteration each. They cross the wire in a compact columnar form (shared/plans.py), whose
# decoder validates every field as the models above do (ranges, types, consistent lengths).


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequest:
    """A request's data a worker needs once, the first time it is scheduled there."""

    request_id: str
    sampling: SamplingParams
    # Prefix caching: hashes of cached blocks the worker holds that are this request's first blocks
    # (its first step starts after them).
    cached_blocks: tuple[bytes, ...] = ()
    # The tokens those blocks hold, sent only for a request with penalties: its penalty history is
    # its whole prompt and output, and the worker is fed only what follows the cached blocks.
    cached_token_ids: tuple[int, ...] = ()
    # Token entries the worker writes itself (docs/protocol.md, "Token entries from the workers"):
    # those of output indexes first_output_index .. entries_below - 2 that end nothing (the token at
    # entries_below - 1 ends the request by length: the scheduler writes it, with the finish). 0:
    # none (stop strings, logprobs, the request-level baseline: the scheduler writes every entry).
    entries_below: int = 0
    first_output_index: int = 0  # the request's output tokens when the plan was made
    text_context: tuple[int, ...] = ()  # its last tokens (prompt and output): the detokenizer's start


class StepItem(NamedTuple):
    """One request's share of an iteration. (A named tuple, not a frozen dataclass: one is made for
    every request at every step, and a tuple costs a third as much to build.)"""

    request_id: str
    # Tokens fed this step: a chunk of the prompt (or of prompt + output when a request's
    # KV is rebuilt), or the one token sampled at the previous step.
    token_ids: tuple[int, ...]
    start_position: int  # tokens of this request already in the worker's KV (0 .. 2**31)
    sample: bool  # this step reaches the last known token: sample the next one
    output_index: int  # index of the token sampled (its seeded randomness; 0 .. 2**31)
    # Pipelined plans: feed the token this worker sampled for the request at output_index - 1
    # (in the plan before, still running when this one was planned); token_ids is then empty.
    feeds_sampled: bool = False
    # Speculative decoding: the last draft_tokens of token_ids are proposed, not known. The step
    # samples output indexes output_index .. output_index + draft_tokens, keeps the proposals while
    # each equals the token sampled before it, and the token after the last one kept: tokens equal to
    # decoding one at a time (services/worker/speculation.py). Needs sample; no penalties or constraint.
    draft_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPlan:
    """What one worker runs in one iteration (scheduler -> worker)."""

    # Which scheduler run made the plan: a worker that sees a new epoch drops all its KV,
    # since a restarted scheduler re-queues every request to be rebuilt from its tokens.
    scheduler_epoch: str
    plan_id: int
    worker_id: str
    new_requests: tuple[NewRequest, ...] = ()
    items: tuple[StepItem, ...] = ()
    # Requests that finished, were cancelled or were preempted: free their KV before the step.
    free_request_ids: tuple[str, ...] = ()
    # The worker's first plan since it (re)joined: drop every request's KV first. A worker that was
    # given up on (heartbeats lost in a Redis outage) and comes back may still hold some.
    free_all: bool = False
    # Prefix caching (services/scheduler/prefix_cache.py), carried out in this order: register
    # (request, block index, hash), then free_request_ids, then evict (hashes of idle cached
    # blocks), then new_requests' cached_blocks, then the step.
    register_blocks: tuple[tuple[str, int, bytes], ...] = ()
    evict_blocks: tuple[bytes, ...] = ()


class SampledToken(NamedTuple):
    """One token a worker sampled (a named tuple, as StepItem: one per request per step)."""

    request_id: str
    token_id: int
    output_index: int
    logprob: float | None = None  # when its request asked for logprobs (from the raw logits)
    top_logprobs: tuple[Logprob, ...] = ()


# A named tuple (StepItem, SampledToken) made from all of its fields at once, without its own
# __new__ (a Python function call): the hot paths' way, one per request per step.
from_fields = tuple.__new__


ItemErrorCode = Literal["kv_cache_full", "out_of_memory", "unknown_request", "bad_item", "cache_mismatch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemError:
    request_id: str
    # kv_cache_full and out_of_memory are no fault of the request: it waits and is rebuilt. The
    # others count towards failing it (a rebuild fixes most). cache_mismatch: the plan's prefix-cache
    # commands did not fit what the worker held; it dropped everything (the scheduler starts it over).
    code: ItemErrorCode
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """What a worker answers for one plan (worker -> scheduler)."""

    scheduler_epoch: str  # copied from the plan: results of an older scheduler run are ignored
    plan_id: int
    worker_id: str
    tokens: tuple[SampledToken, ...] = ()
    errors: tuple[ItemError, ...] = ()  # items that did not run; their KV is left as before
    kv_blocks_total: int
    kv_blocks_free: int
    step_seconds: float  # time spent in the engine for this plan
    kv_blocks_cached: int = 0  # idle cached blocks (prefix caching), after the step
    # The worker wrote the token entries of its tokens whose requests it was told to write for
    # (NewRequest.entries_below), except those of `unwritten` (request ids: the ones that end their
    # request, or that it could not); False: it wrote none (the scheduler writes them all).
    entries_written: bool = False
    unwritten: frozenset[str] = frozenset()
    cache_digest: int | None = None  # of its prefix cache after the plan's commands (shared/cache_digest.py)


class WorkerInfo(Frozen):
    """A worker's registration, renewed with every heartbeat."""

    version: Literal[1] = PROTOCOL_VERSION
    worker_id: str
    pid: int
    host: str
    device: str
    kv_block_size: int = Field(ge=1)  # the scheduler divides by it
    kv_blocks_total: int = Field(ge=0)
    kv_blocks_free: int = Field(ge=0)  # neither held by a request nor cached
    kv_blocks_cached: int = Field(0, ge=0)  # prefix cache: held by no request, kept until evicted
    running: int = Field(ge=0)  # requests holding KV on this worker
    draining: bool = False  # stopping: takes no new requests
    started_at: float
    heartbeat_at: float
    executor: Literal["engine", "emulated"] = "engine"  # emulated: no model runs (a benchmarking instrument)
    hardware: str = ""  # the emulated executor's profile
    busy_seconds: float = Field(0.0, ge=0)  # time inside steps since it started: busy fraction = its rate of change
    # The model it holds: its API name, a content hash of its weights (shared/model_file.py
    # weights_sha256) and what one token of KV costs (0 for the emulated executor).
    model: str = ""
    weights_sha256: str = ""
    kv_bytes_per_token: int = Field(0, ge=0)
    kv_dtype: str = ""  # its KV cache's element type ("emulated" for the emulated executor)
    # A worker group's pipeline stages: it runs that many plans at once, each on different requests.
    pipeline_stages: int = Field(1, ge=1, le=64)

    @property
    def kv_identity(self) -> str:
        """What, beside the tokens and the block size, makes the KV of its cached blocks: part of
        their hashes (services/scheduler/prefix_cache.py), so two workers that would compute a
        block's KV differently never share a name for it."""
        return f"{self.executor}:{self.weights_sha256}:{self.kv_dtype}"


class SchedulerInfo(Frozen):
    version: Literal[1] = PROTOCOL_VERSION
    pid: int
    policy: str
    started_at: float
    heartbeat_at: float
    last_iteration_at: float  # when an iteration last completed (0: none yet)
    iterations: int
    waiting: int
    running: int
    waiting_tokens: int = 0  # prompt (and rebuilt output) tokens of the waiting requests: gateway admission
    cpu_seconds: float = 0.0  # the scheduler process's CPU time since it started
    phase_cpu_seconds: dict[str, float] = {}  # of it, by phase (services/scheduler/service.py PHASES)
    round_trips: int = 0  # Redis round trips of its loop since it started (each sends writes and reads inputs)
    # Plans sent since it started: iterations over plans is the steps a plan runs (Settings.scheduler_steps).
    plans: int = 0
    # Prefix caching: prompt (and rebuilt output) tokens looked up at admissions, and found cached.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Results whose worker's prefix-cache digest differed from its copy's: that worker's cache started over.
    prefix_cache_mismatches: int = 0
    # Its exact copy of each worker's KV blocks: {worker id: {"in_use", "cached", "free"}}.
    kv_blocks: dict[str, dict[str, int]] = {}
    cpus: list[int] = []  # the CPUs it may run on (Settings.scheduler_cpus pins it)
    # The executors of the workers it schedules ("emulated": a hardware profile's times, no model):
    # the gateway says so on every answer (x-iterserve-executor) and in /health.
    executors: list[str] = []
    # One of several schedulers of its model (Settings.schedulers > 1): its id, and the workers it
    # leases with each one's fencing token (how many times that worker's lease changed owner).
    scheduler_id: str = ""
    leases: dict[str, int] = {}
    # (then) active requests no scheduler has taken yet, waiting in Redis for one with room: counted
    # once, beside every scheduler's own waiting ones, where the gateway sums them (admission, /status).
    unclaimed: int = 0
    # Its --speculative-config's method ("ngram", "draft_model"; "": none) and proposals per step.
    speculative_method: str = ""
    num_speculative_tokens: int = 0


class IterationRecord(Frozen):
    """What the scheduler ran in one iteration on one worker (for tests and observability)."""

    version: Literal[1] = PROTOCOL_VERSION
    iteration: int
    worker_id: str
    plan_id: int
    request_ids: tuple[str, ...]  # every request in the batch
    joined: tuple[str, ...]  # requests whose first step this is
    finished: tuple[str, ...]  # requests that finished with this iteration's tokens
    cancelled: tuple[str, ...] = ()  # requests of this batch cancelled after it was planned
    preempted: tuple[str, ...] = ()  # requests of this batch taken off the worker (KV full, worker errors)
    prefill_tokens: int
    decode_tokens: int
    started_at: float
    finished_at: float
    step_seconds: float = 0.0  # the worker's time in the engine for this plan
    # Speculative decoding: tokens its items proposed, and of them the ones kept (each kept one is a
    # token more than the step's one per request)
    proposed_tokens: int = 0
    accepted_tokens: int = 0


# An IterationRecord as the scheduler makes one every worker-iteration: the same fields in the same
# order (derived from the record's), not validated (they come from its own bookkeeping; validating a
# batch's 64 request ids cost about 6 us warm, more inside the system). shared/wire.py encode_row
# writes the record's bytes, and readers decode an IterationRecord.
IterationRow = NamedTuple("IterationRow", [(name, info.annotation)
                                           for name, info in IterationRecord.model_fields.items()])
