"""Iteration-level scheduling (Orca, OSDI'22, Algorithm 1) over several workers: pure bookkeeping.

Each worker is an independent replica with its own paged KV cache. For one worker at a time,
`next_plan` picks the requests of its next iteration: its running requests first (decode steps,
then prefill chunks, each first-come first-served), then waiting requests while the batch has
room (max_batch_size requests, max_batch_tokens tokens, and KV blocks), taken round-robin across
client keys (FCFS within a key) so one key's flood cannot starve another. `on_result` takes the
worker's sampled tokens back and decides which requests finished, so a waiting request joins
at the very next iteration. The "request" policy is the FasterTransformer-style baseline: a
worker forms a batch only when it runs nothing, and nothing joins until the whole batch is done
(the service can also hold the batch's results until then: `--request-results batch`).

Pipelining (Orca section 3.1.3, vLLM's async scheduling): up to `pipeline_depth` plans are in
flight per worker, so the next iteration is planned and sent while the one before runs and the
worker never waits on Redis and this bookkeeping. A request whose token is being sampled by a
plan in flight steps again in the next plan with `feeds_sampled`: the worker feeds the token it
sampled itself. Requests that will have reached max_tokens or the context are not planned
again; one that ends on a stop token (or a cancel) costs at most that one speculative step.
A worker group of M pipeline stages has M plans in flight, each of about 1/M of its requests
and none of another's (Orca's figure 8: each stage runs a different iteration).

Prefix caching (services/scheduler/prefix_cache.py): this policy keeps an exact copy of each
worker's cache of full KV blocks, named by hashes of their contents. A request admitted to a worker
starts after the longest prefix of it that worker holds; blocks a result confirms written are
registered; idle cached blocks count as free room and are evicted, least recently used first,
when a step needs them. Placement (`placement`): "least-loaded" sends a waiting request to the
worker running the fewest requests (counting those already meant for it; ties: the most free KV);
the planning worker takes it instead only when that worker is busy and runs no fewer requests;
"cache-aware" sends it to the worker holding the longest prefix of it, unless that prefix is less
than `placement_threshold` of its tokens or that worker runs more than `placement_slack` requests
more than the least loaded one (SGLang's router balances the same way), and falls back to
least-loaded then.

No Redis, no asyncio, no tensors here: services/scheduler/service.py moves the messages.
"""

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Literal, NamedTuple

from services.scheduler.prefix_cache import extend_chain, root_hash
from services.scheduler.request_state import PlanInFlight, RequestState, WorkerState
from shared.config import REQUEST_LOG
from shared.messages import PROTOCOL_VERSION, FinishReason, IterationRow, NewRequest, RequestRecord, SamplingParams
from shared.finishing import finish_reason, length_limit
from shared.plans import MAX_STEPS, ColumnPlan, ResultColumns, split_steps

log = logging.getLogger("iterserve.scheduler")
request_log = logging.getLogger(REQUEST_LOG)  # each request's admission (Settings.log_requests)

Policy = Literal["iteration", "request"]
Placement = Literal["cache-aware", "least-loaded"]
MAX_ITEM_ERRORS = 3  # worker errors on one request's items before it fails (a rebuild fixes most)
# Workers lost while a request ran on them before it fails: a request that makes every engine
# break (a bug it triggers) must not take the fleet down one worker after another, forever.
MAX_WORKERS_LOST = 3


class TokenOutcome(NamedTuple):
    """One sampled token taken into a request's output (a named tuple: one per request per step)."""

    request: RequestState
    token_id: int
    output_index: int
    finish_reason: FinishReason | None  # set when this token ends the request
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()
    written: bool = False  # its worker wrote its token entry (PlanResult.entries_written, not unwritten)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(eq=False)
class _RecordDraft:
    """An IterationRecord whose `finished` may still grow (stop strings are found after on_result)."""

    in_flight: PlanInFlight
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished_at: float = 0.0
    step_seconds: float = 0.0


@dataclass(eq=False)
class _Batch:
    """The iteration being built for one worker: its items as the plan's columns, in wire order
    (decodes that feed the token a plan in flight samples; then the others), each with its request.
    The decodes are written in as they are chosen; the requests stepped one at a time (prefill
    chunks, admissions) go through `chunks` first and are written in last."""

    worker: WorkerState
    budget: int  # tokens left in max_batch_tokens
    chunks: dict[str, int] = field(default_factory=dict)  # request id -> tokens fed this step
    admitted: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)  # requests whose first step on the worker this is
    decode_tokens: int = 0
    prefill_tokens: int = 0
    # The decodes fed by the worker: request, row, output index, start position.
    fed_states: list[RequestState] = field(default_factory=list)
    fed_handles: list[int] = field(default_factory=list)
    fed_outputs: list[int] = field(default_factory=list)
    fed_starts: list[int] = field(default_factory=list)
    # The other items: request, row, start position, token count, samples, output index, and their
    # tokens (flattened).
    states: list[RequestState] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def drop(self, state: RequestState) -> None:
        """A request leaves the batch being built (preempted to make room): its tokens go back."""
        chunk = self.chunks.pop(state.request_id, None)
        if chunk is not None:
            self.budget += chunk
        else:  # a decode written in already (older requests' prefill chunks make room after the decodes)
            for states, columns in ((self.fed_states, (self.fed_handles, self.fed_outputs, self.fed_starts)),
                                    (self.states, (self.handles, self.starts, self.counts, self.samples, self.outputs,
                                                   self.tokens))):
                for index, held in enumerate(states):
                    if held is state:  # (a decode: one token, one count each, so its token is at its index)
                        for column in (states, *columns):
                            del column[index]
                        self.budget += 1
                        self.decode_tokens -= 1
                        break
        if state.request_id in self.joined:
            self.joined.remove(state.request_id)
        if state.request_id in self.admitted:
            self.admitted.remove(state.request_id)


def status_for(reason: FinishReason) -> Literal["finished", "cancelled", "failed"]:
    return {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")  # type: ignore[return-value]


class SchedulerPolicy:
    def __init__(
        self,
        epoch: str,
        *,
        context_length: int,
        stop_token_ids: Iterable[int],
        policy: Policy = "iteration",
        max_batch_size: int = 64,
        max_batch_tokens: int = 512,
        pipeline_depth: int = 1,
        answer_every: int = 1,
        scheduler_steps: int = 1,
        plan_seconds: float = 0.0,
        prefix_caching: bool = False,
        placement: Placement = "least-loaded",
        placement_slack: int = 8,
        placement_threshold: float = 0.5,
        cache_salt: str = "",
        text_context: Callable[..., tuple[int, ...]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """cache_salt: what else makes a block's KV (the model's name): part of every block hash.
        text_context: the tokenizer's (Tokenizer.text_context); given, workers write the token
        entries of tokens that end nothing, for the requests `workers_write_entries` says (the
        iteration policy only). plan_seconds (Settings.scheduler_plan_ms): with scheduler_steps > 1,
        a worker's plans run as many steps as fit in that long of its measured steps (_steps_for)."""
        if policy not in ("iteration", "request"):
            raise ValueError(f"unknown policy {policy!r}")
        if placement not in ("cache-aware", "least-loaded"):
            raise ValueError(f"unknown placement {placement!r}")
        self.prefix_caching, self.placement, self.placement_slack = prefix_caching, placement, placement_slack
        self.placement_threshold = placement_threshold
        self.cache_salt = cache_salt
        # Prefix-cache queries and hits, in prompt (and rebuilt output) tokens, at every admission.
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_mismatches = 0  # results whose worker's cache digest differed from the copy's
        self.epoch = epoch
        self.policy: Policy = policy
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        if pipeline_depth < 1:
            raise ValueError("pipeline_depth must be at least 1")
        self.pipeline_depth = pipeline_depth
        if answer_every < 1:
            raise ValueError("answer_every must be at least 1")
        self.answer_every = answer_every
        if not 1 <= scheduler_steps <= MAX_STEPS:
            raise ValueError(f"scheduler_steps must be in [1, {MAX_STEPS}]")
        self.scheduler_steps = scheduler_steps
        if plan_seconds < 0:
            raise ValueError("plan_seconds must not be negative")
        self.plan_seconds = plan_seconds
        self.context_length = context_length
        self.stop_token_ids = frozenset(stop_token_ids)
        self._text_context = text_context if policy == "iteration" else None
        self._clock = clock
        self._requests: dict[str, RequestState] = {}  # waiting and running
        self._waiting: list[tuple[float, int, str]] = []  # sorted by arrival: FCFS
        # Fairness: when each client key last had a request admitted (an admission count), for the
        # keys that have requests waiting; the key served longest ago goes first.
        self._key_served_at: dict[str, int] = {}
        self._waiting_keys: dict[str, int] = {}  # client key -> its requests waiting
        self._admissions = 0
        self._workers: dict[str, WorkerState] = {}
        self._arrivals = 0
        self._next_plan_id = 1
        self._iterations = 0
        self._drafts: list[_RecordDraft] = []
        self._latest_draft: dict[str, _RecordDraft] = {}
        # Requests cancelled or preempted off a worker after its latest record was taken: they go
        # into its next record (worker id -> (cancelled, preempted)).
        self._left_since_record: dict[str, tuple[list[str], list[str]]] = {}
        self._finished_without_token: list[RequestState] = []

    # The pool of requests

    def add_request(self, record: RequestRecord, output_token_ids: Iterable[int] = ()) -> RequestState:
        """Queue a request (with its output so far when rebuilt after a scheduler restart).

        A request that cannot run, or whose given output already ends it, is finished at once
        and reported by take_finished_without_token().
        """
        existing = self._requests.get(record.request_id)
        if existing is not None:
            return existing
        state = RequestState(record=record, arrival_seq=self._arrivals, output_token_ids=list(output_token_ids),
                             workers_write=self.workers_write_entries(record.sampling),
                             output_limit=length_limit(record.sampling.max_tokens, len(record.prompt_token_ids),
                                                       self.context_length))
        self._arrivals += 1
        reason: FinishReason | None
        if not record.prompt_token_ids:
            reason = "error"
        elif len(record.prompt_token_ids) >= self.context_length:
            reason = "length"
        else:
            reason = self._finish_reason_after_output(state) if state.output_token_ids else None
        if reason is not None:
            state.status, state.finish_reason = status_for(reason), reason
            self._finished_without_token.append(state)
            return state
        self._requests[state.request_id] = state
        self._enqueue(state)
        return state

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def cancel(self, request_id: str) -> RequestState | None:
        """Drop a waiting or running request; its worker frees the KV with its next plan."""
        return self.finish(request_id, "cancelled")

    def finish(self, request_id: str, reason: FinishReason, *, without_token: bool = False) -> RequestState | None:
        """End a request (e.g. a stop string found by the service); None when it was not active.

        without_token: no token event carries the news, so take_finished_without_token() reports it.
        """
        state = self._requests.get(request_id)
        if state is None:
            return None
        self._end(state, reason)
        if without_token:
            self._finished_without_token.append(state)
        return state

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def waiting_tokens(self) -> int:
        """Tokens the waiting requests will need prefilled (prompt, plus output when rebuilt)."""
        return sum(self._requests[request_id].total_tokens for _, _, request_id in self._waiting)

    @property
    def running_count(self) -> int:
        return len(self._requests) - len(self._waiting)

    def take_finished_without_token(self) -> list[RequestState]:
        """Requests that ended without a token to carry the news (bad prompt, no KV can hold them,
        worker errors, output that was already complete when rebuilt)."""
        finished, self._finished_without_token = self._finished_without_token, []
        return finished

    def take_iteration_records(self) -> list[IterationRow]:
        drafts, self._drafts = self._drafts, []
        self._latest_draft.clear()
        records = []
        for draft in drafts:
            flight = draft.in_flight
            self._iterations += 1
            records.append(IterationRow(
                version=PROTOCOL_VERSION,
                iteration=self._iterations,
                worker_id=flight.plan.worker_id,
                plan_id=flight.plan_id,
                request_ids=flight.request_ids,
                joined=flight.joined,
                finished=tuple(draft.finished),
                cancelled=tuple(draft.cancelled),
                preempted=tuple(draft.preempted),
                prefill_tokens=flight.prefill_tokens,
                decode_tokens=flight.decode_tokens,
                started_at=flight.started_at,
                finished_at=draft.finished_at,
                step_seconds=draft.step_seconds,
            ))
        return records

    # Workers

    def worker_up(self, worker_id: str, kv_blocks_total: int, kv_block_size: int, stages: int = 1,
                  kv_identity: str = "") -> None:
        """kv_identity: what else makes the KV of a block of tokens on this worker (its weights'
        hash and KV dtype: WorkerInfo.kv_identity); it and the block size are in its blocks' hashes."""
        cache_root = root_hash(f"{self.cache_salt}\0{kv_block_size}\0{kv_identity}")
        worker = self._workers.get(worker_id)
        if worker is not None:
            if (worker.kv_blocks_total, worker.kv_block_size, worker.stages, worker.cache_root) == (
                    kv_blocks_total, kv_block_size, stages, cache_root):
                return
            self.worker_down(worker_id)  # a different cache: a different worker under the same name
        # Its first plan says free_all: back after being given up on (e.g. heartbeats lost in a Redis
        # outage) it may still hold KV of requests that moved on; it holds nothing of ours yet.
        worker = WorkerState(worker_id, kv_blocks_total, kv_block_size, cache_root=cache_root, free_all=True,
                             stages=stages)
        self._workers[worker_id] = worker
        log.info("worker_up worker_id=%s kv_blocks_total=%d kv_block_size=%d stages=%d kv_identity=%s",
                 worker_id, kv_blocks_total, kv_block_size, stages, kv_identity or "-")

    @property
    def max_depth(self) -> int:
        return max([self.pipeline_depth, *(self.depth(worker) for worker in self._workers.values())])

    def depth(self, worker: WorkerState) -> int:
        """Plans a worker may have in flight: pipeline_depth, and at least one per pipeline stage."""
        return max(self.pipeline_depth, worker.stages)

    def group(self, worker_id: str) -> int:
        """Plans sent to the worker together and answered together (answer_every; one for a worker
        of several pipeline stages, which answers each plan as its tokens come back)."""
        worker = self._workers.get(worker_id)
        return 1 if worker is None else self._group_of(worker)

    def _group_of(self, worker: WorkerState) -> int:
        return 1 if worker.stages > 1 else self.answer_every

    def worker_down(self, worker_id: str) -> list[str]:
        """Forget a worker; its requests wait again (FCFS place kept), to be rebuilt elsewhere."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return []
        moved = list(worker.running)
        for state in list(worker.running.values()):
            state.workers_lost += 1
            if state.workers_lost >= MAX_WORKERS_LOST:
                log.error("failed request_id=%s reason=workers_lost count=%d", state.request_id, state.workers_lost)
                self._end(state, "error")
                self._finished_without_token.append(state)
            else:
                self._requeue(worker, state)
        self._latest_draft.pop(worker_id, None)
        self._left_since_record.pop(worker_id, None)
        log.info("worker_down worker_id=%s requeued=%d abandoned_plans=%s", worker_id, len(moved),
                 [flight.plan_id for flight in worker.in_flight])
        return moved

    def reset_worker(self, worker_id: str) -> list[str]:
        """Abandon a worker's plans in flight (lost, or far too slow) and rebuild its requests:
        its next plan frees them all, whatever it did with the lost ones."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        moved = list(worker.running)
        for state in list(worker.running.values()):
            self._requeue(worker, state)
        worker.known.clear()
        for flight in worker.in_flight:
            plan = flight.plan
            for request_id, row in zip(plan.free_request_ids + tuple(new.request_id for new in plan.new_requests),
                                       plan.free_handles + plan.new_handles, strict=True):
                worker.to_free.setdefault(request_id, row)
        worker.in_flight = []
        if self.prefix_caching:  # what the lost plans did to its cache is unknown: it starts over empty
            worker.clear_cache()
            worker.free_all = True
        log.warning("worker_reset worker_id=%s requeued=%d", worker_id, len(moved))
        return moved

    def set_draining(self, worker_id: str, draining: bool) -> list[str]:
        """A draining worker (stopping) gets no new request. Its running ones are handed over: they
        wait again (FCFS place kept) to be rebuilt on a worker that takes requests, or, while there
        is none, stay and finish where they are. Returns the ids handed over."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        if worker.draining != draining:
            worker.draining = draining
            log.info("worker_draining worker_id=%s draining=%s running=%d", worker_id, draining, len(worker.running))
        if not (draining and worker.running and any(not other.draining for other in self._workers.values())):
            return []
        moved = list(worker.running)
        for state in list(worker.running.values()):
            self._requeue(worker, state)
        log.info("handed_over worker_id=%s requeued=%d", worker_id, len(moved))
        return moved

    def kv_blocks_by_worker(self) -> dict[str, dict[str, int]]:
        """Each worker's KV blocks as this policy knows them: held by requests, cached idle, free."""
        return {worker_id: {"in_use": worker.kv_blocks_total - worker.kv_blocks_available,
                            "cached": worker.cache.blocks_idle, "free": worker.kv_blocks_free}
                for worker_id, worker in self._workers.items()}

    def worker(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def idle_workers(self) -> list[str]:
        """Workers that can take another group of plans (room for `group` more within pipeline_depth
        in flight): the fewest in flight first, then the most free KV (it gets the oldest waiting
        request when several plan at once)."""
        idle = [worker for worker in self._workers.values()
                if worker.plans_in_flight + self._group_of(worker) <= self.depth(worker)]
        idle.sort(key=lambda worker: (worker.plans_in_flight, -worker.kv_blocks_available, worker.worker_id))
        return [worker.worker_id for worker in idle]

    # Iterations

    def next_plan(self, worker_id: str) -> ColumnPlan | None:
        """The worker's next iteration, or None while pipeline_depth plans are in flight or it has
        nothing to do."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.plans_in_flight >= self.depth(worker):
            return None
        batch = _Batch(worker, budget=self.max_batch_tokens)
        forming = not worker.running  # the request policy admits only into an empty worker
        self._schedule_running(batch)
        if not worker.draining and (self.policy == "iteration" or forming):
            self._admit_waiting(batch)
        if not batch.chunks and not batch.fed_states and not batch.states and not worker.to_free:
            return None  # (a pending free_all waits for the first plan with work)
        return self._emit_plan(batch)

    def joined(self, worker_id: str) -> tuple[str, ...]:
        """The requests of the worker's latest plan that step on it for the first time."""
        worker = self._workers.get(worker_id)
        return worker.in_flight[-1].joined if worker is not None and worker.in_flight else ()

    def answers_to_apply(self, result: ResultColumns) -> list[ResultColumns]:
        """A worker's answer as on_result takes it, one after the other (each one's tokens published
        before the next is applied): the answer to a plan of several steps whole, all its steps in
        one pass, or, where _applies_together says no, a step at a time (split_steps), each as it
        would be alone."""
        return [result] if result.steps == 1 or self._applies_together(result) else split_steps(result)

    def _applies_together(self, result: ResultColumns) -> bool:
        """Whether the answer to a plan of several steps can be applied in one pass: not the rare one
        with an item in error or out of step, a stale answer, or a request with stop strings (the
        service finds them in the text: between steps, before the next step's token is applied)."""
        worker = self._workers.get(result.worker_id)
        if worker is None or len(worker.in_flight) < result.steps or result.errors:
            return False
        flight = worker.in_flight[0]
        plan = flight.plan
        if (result.scheduler_epoch != self.epoch or result.plan_id != flight.plan_id or flight.step
                or result.cache_digest is not None and result.cache_digest != flight.cache_digest
                or plan.steps != result.steps or result.handles != flight.handles
                or result.output_indexes != flight.output_indexes
                or result.counts != (plan.item_steps or [plan.steps] * len(flight.handles))):
            return False
        left = flight.left
        return all([(left and state in left) or (not state.sampling.stop and len(state.output_token_ids) == index)
                    for state, index in zip(flight.states, flight.output_indexes)])

    def on_result(self, result: ResultColumns) -> list[TokenOutcome]:
        """Apply a worker's result: tokens appended (idempotent by output_index), finishes decided;
        the tokens whose output is still to write (not those whose entry the worker wrote). The
        answer to a plan of several steps is taken as answers_to_apply gives it (whole, or a step at
        a time)."""
        worker = self._workers.get(result.worker_id)
        flight = worker.in_flight[0] if worker is not None and worker.in_flight else None
        if (
            worker is None
            or flight is None
            or result.scheduler_epoch != self.epoch
            or result.plan_id != flight.plan_id  # a worker answers its plans (and their steps) in order
        ):
            log.debug("stale_result worker_id=%s plan_id=%d epoch=%s",
                      result.worker_id, result.plan_id, result.scheduler_epoch)
            return []
        if result.steps > 1:
            return self._on_steps_result(worker, result)
        if result.cache_digest is not None and result.cache_digest != flight.cache_digest and not any(
                code == "cache_mismatch" for _, code, _ in result.errors):
            self._on_cache_digest_mismatch(worker, flight, result.cache_digest)
            return []
        worker.in_flight.pop(0)
        worker.measured_step(result.step_seconds)
        now = self._clock()
        flight.started_at = max(flight.started_at, worker.last_result_at)  # it ran after the plan before it
        worker.last_result_at = now
        draft = _RecordDraft(flight, finished_at=now, step_seconds=result.step_seconds)
        left = self._left_since_record.pop(worker.worker_id, None)
        if left is not None:
            draft.cancelled.extend(left[0])
            draft.preempted.extend(left[1])
        self._drafts.append(draft)
        self._latest_draft[worker.worker_id] = draft
        if result.errors:
            if self.prefix_caching and any(code in ("cache_mismatch", "out_of_memory") for _, code, _ in result.errors):
                # The worker dropped its cache (a mismatch) or requests it had blocks registered for (out
                # of memory): its cache and this copy may differ. It starts over, empty; its requests are
                # rebuilt, as they would be anyway (every item of such a plan is in error).
                log.warning("worker_cache_reset worker_id=%s plan_id=%d", worker.worker_id, flight.plan_id)
                self.reset_worker(worker.worker_id)
                return []
            errors = {handle: (code, message) for handle, code, message in result.errors}
        else:
            errors = None
        # Each item's token: in item order when the worker answered every item that samples (most
        # results), else found by handle (an item without one is in error, or out of step).
        samples, ends = flight.samples, flight.ends
        sampled = flight.handles if samples is None else [handle for handle, sample in zip(flight.handles, samples)
                                                           if sample]
        handles, token_ids, output_indexes = result.handles, result.token_ids, result.output_indexes
        # (Columns beside the items', not a tuple per item: the loop below builds none per row.)
        if handles == sampled and samples is None:
            positions, answer_tokens, answer_indexes = range(len(handles)), token_ids, output_indexes
        else:
            position_of = {handle: position for position, handle in enumerate(handles)}
            positions = [position_of.get(handle) if sample else None
                         for handle, sample in zip(flight.handles, samples or repeat(True))]
            answer_tokens = [None if position is None else token_ids[position] for position in positions]
            answer_indexes = [None if position is None else output_indexes[position] for position in positions]
        # The worker wrote the token entries of the requests it writes for, all but these (None: none)
        unwritten = set(result.unwritten) if result.entries_written else None
        outcomes: list[TokenOutcome] = []
        prefix_caching, block_size = self.prefix_caching, worker.kv_block_size
        stop_token_ids, logprobs, left = self.stop_token_ids, result.logprobs, flight.left
        for state, output_index, token_id, answered_index, position, sample, end in zip(
                flight.states, flight.output_indexes, answer_tokens, answer_indexes, positions,
                samples or repeat(True), ends or repeat(0)):
            if left and state in left:
                continue  # finished, cancelled, preempted or moved while the plan was in flight
            if sample:
                state.in_flight_samples -= 1
            if errors is not None:
                error = errors.get(state.row)
                if error is not None:
                    self._on_item_error(worker, state, *error)
                    continue
            if prefix_caching:  # (a decode fills a block once in kv_block_size steps: the test first)
                if sample:  # (KV tokens after it: a chunk short of its prompt's end says where it ends)
                    end = state.prompt_length + output_index
                if end // block_size > len(state.held_hashes):
                    self._register_blocks(worker, state, end)
            if not sample:
                continue
            output = state.output_token_ids
            if position is None or answered_index != output_index or output_index != len(output):
                if position is not None and answered_index == output_index < len(output):
                    continue  # already have it
                got = None if position is None else (token_id, answered_index)
                self._on_item_error(worker, state, "bad_item",
                                    f"expected a token at output_index {output_index}, got (token, index) {got}")
                continue
            output.append(token_id)
            written = unwritten is not None and state.workers_write and state.row not in unwritten
            # (_finish_reason_after_output's first test, inline: most tokens end nothing)
            if token_id in stop_token_ids or len(output) >= state.output_limit:
                reason = self._finish_reason_after_output(state)
                if reason is not None:
                    self._end(state, reason)
            elif written:
                continue  # its worker wrote its token entry: nothing is left to do with the token
            else:
                reason = None
            logprob, top = logprobs.get(position, (None, ())) if logprobs else (None, ())
            outcomes.append(TokenOutcome(state, token_id, output_index, reason, logprob, top, written))
        return outcomes

    def _on_cache_digest_mismatch(self, worker: WorkerState, flight: PlanInFlight, reported: int) -> None:
        """The worker's prefix cache and this policy's copy of it hold different hashes although every
        command fitted: nothing of either can be trusted. Its cache starts over, empty, as after a
        cache_mismatch (its requests are rebuilt; this answer's tokens are computed again)."""
        self.prefix_cache_mismatches += 1
        log.error("prefix_cache_digest_mismatch worker_id=%s plan_id=%d reported=%016x expected=%016x",
                  worker.worker_id, flight.plan_id, reported, flight.cache_digest)
        self.reset_worker(worker.worker_id)
        worker.clear_cache()
        worker.free_all = True

    def _on_steps_result(self, worker: WorkerState, result: ResultColumns) -> list[TokenOutcome]:
        """The answer to a plan of several steps, as _applies_together found it (else: ValueError):
        each request's tokens applied at once (up to one that ends it), each step's iteration
        record as on_result makes it."""
        if not self._applies_together(result):
            raise ValueError(f"the answer to plan {result.plan_id} is applied a step at a time (split_steps)")
        steps = result.steps
        flights = worker.in_flight[:steps]
        del worker.in_flight[:steps]
        first = flights[0]
        for seconds in result.steps_seconds:
            worker.measured_step(seconds)
        now = self._clock()
        first.started_at = max(first.started_at, worker.last_result_at)
        worker.last_result_at = now
        # The steps ran one after the other, the last just before the answer came: each one's end
        # from the steps' times after it.
        drafts, finished_at = [], now - sum(result.steps_seconds)
        for flight, seconds in zip(flights, result.steps_seconds):
            if drafts:
                flight.started_at = drafts[-1].finished_at
            finished_at += seconds
            drafts.append(_RecordDraft(flight, finished_at=max(finished_at, flight.started_at), step_seconds=seconds))
        left = self._left_since_record.pop(worker.worker_id, None)
        if left is not None:
            drafts[0].cancelled.extend(left[0])
            drafts[0].preempted.extend(left[1])
        self._drafts.extend(drafts)
        unwritten = set(result.unwritten_tokens) if result.entries_written else None
        outcomes: list[TokenOutcome] = []
        prefix_caching, block_size = self.prefix_caching, worker.kv_block_size
        stop_token_ids, logprobs, left, token_ids = self.stop_token_ids, result.logprobs, first.left, result.token_ids
        end = 0
        for state, first_index, count in zip(first.states, first.output_indexes, result.counts):
            begin, end = end, end + count  # (this item's tokens: token_ids[begin:end])
            if left and state in left:
                continue  # finished, cancelled, preempted or moved while the plan was in flight
            state.in_flight_samples -= count
            tokens = token_ids[begin:end]
            output = state.output_token_ids
            # (a stop token or the output limit ends it: most items neither)
            ends_at, reason = None, None
            if not stop_token_ids.isdisjoint(tokens) or first_index + count >= state.output_limit:
                for step, token_id in enumerate(tokens):
                    reason = finish_reason(token_id, first_index + step + 1, state.output_limit, stop_token_ids,
                                           state.sampling.ignore_eos)
                    if reason is not None:
                        ends_at, tokens = step, tokens[: step + 1]
                        break
            output.extend(tokens)
            if prefix_caching:  # (its KV after its last step applied: the prompt and the outputs before)
                kv_end = state.prompt_length + first_index + len(tokens) - 1
                if kv_end // block_size > len(state.held_hashes):
                    self._register_blocks(worker, state, kv_end)
            if ends_at is not None:
                self._latest_draft[worker.worker_id] = drafts[ends_at]  # (the record of the step it ended in)
                self._end(state, reason)
            if ends_at is None and unwritten is not None and not unwritten and state.workers_write:
                continue  # its worker wrote every token's entry: nothing is left to do with them (most)
            for step, token_id in enumerate(tokens):
                position = begin + step
                written = unwritten is not None and state.workers_write and position not in unwritten
                step_reason = reason if step == ends_at else None
                if written and step_reason is None:
                    continue
                logprob, top = logprobs.get(position, (None, ())) if logprobs else (None, ())
                outcomes.append(TokenOutcome(state, token_id, first_index + step, step_reason, logprob, top, written))
        self._latest_draft[worker.worker_id] = drafts[-1]
        return outcomes

    # Internals: building a plan

    def _schedule_running(self, batch: _Batch) -> None:
        """Running requests step first: decodes (one token each), then prefill chunks, FCFS. The
        decodes, most of a step, are chosen and written into the plan in one pass over the worker's
        requests; the others are stepped after them, one at a time (_schedule_states)."""
        worker = batch.worker
        order = worker.rows.order
        if worker.stages > 1:  # pipeline stages' lanes: one at a time, decodes first
            self._schedule_states(batch, [state for state in order if state.is_decoding] +
                                  [state for state in order if not state.is_decoding])
            return
        block_size = worker.kv_block_size
        others = []
        fed_states, fed_handles, fed_outputs, fed_starts = (batch.fed_states, batch.fed_handles, batch.fed_outputs,
                                                            batch.fed_starts)
        budget = batch.budget  # (making room here changes no budget: the requests it preempts are younger)
        for state in tuple(order):  # (a copy: making room for one may preempt the youngest)
            if state.row < 0:
                continue  # preempted to make room for an older one
            in_flight = state.in_flight_samples
            outputs = len(state.output_token_ids) + in_flight
            computed = state.computed
            if not outputs or computed != state.prompt_length + outputs - 1:  # (RequestState.is_decoding)
                others.append(state)
                continue
            if in_flight and outputs >= state.output_limit:
                continue  # its last token is being sampled (max_tokens or the context reached)
            if budget <= 0:
                break
            # (Within the blocks it holds, as most decode steps are, it needs no room: tested here
            # rather than in _make_room, a call per request per step.)
            if computed >= state.kv_blocks * block_size and not self._make_room(batch, state, computed + 1):
                continue
            budget -= 1
            state.in_flight_samples = in_flight + 1
            state.computed = computed + 1
            if not state.stepped_on_worker:
                batch.joined.append(state.request_id)
                state.stepped_on_worker = True
            if in_flight:  # its input is the token a plan in flight samples: the worker has it
                fed_states.append(state)
                fed_handles.append(state.row)
                fed_outputs.append(outputs)
                fed_starts.append(computed)
            else:  # its input is its last token, named
                self._add_item(batch, state, computed, 1, True, outputs, state.output_token_ids[-1:])
        batch.decode_tokens += batch.budget - budget
        batch.budget = budget
        if others:
            self._schedule_states(batch, others)

    def _schedule_states(self, batch: _Batch, states: list[RequestState]) -> None:
        """These running requests' steps, one at a time in the order given, while the budget lasts."""
        worker = batch.worker
        running, chunks, staged = worker.running, batch.chunks, worker.stages > 1
        # Pipeline stages: the requests whose token is not on its way, in lanes of about 1/stages
        # of the worker's requests, so each stage has a plan's worth while the others run theirs.
        lane = -(-len(running) // worker.stages) if staged else len(running)
        block_size = worker.kv_block_size
        for state in states:
            if batch.budget <= 0 or len(chunks) >= lane:
                break
            in_flight = state.in_flight_samples
            outputs = len(state.output_token_ids) + in_flight
            pending = state.prompt_length + outputs - state.computed
            if pending <= 0 or state.request_id not in running:
                continue  # preempted to make room for an older one
            # Its last token is being sampled (max_tokens or the context reached), or (stages) its next input.
            if in_flight and (staged or outputs >= state.output_limit):
                continue
            chunk = min(pending, batch.budget)
            if -(-(state.computed + chunk) // block_size) <= state.kv_blocks or self._make_room(
                    batch, state, state.computed + chunk):
                chunks[state.request_id] = chunk
                batch.budget -= chunk

    @staticmethod
    def _add_item(batch: _Batch, state: RequestState, start: int, count: int, sample: bool, output_index: int,
                  tokens: Iterable[int]) -> None:
        """An item that names its tokens (not fed by the worker) into the plan being built."""
        batch.states.append(state)
        batch.handles.append(state.row)
        batch.starts.append(start)
        batch.counts.append(count)
        batch.samples.append(sample)
        batch.outputs.append(output_index)
        batch.tokens.extend(tokens)

    def _make_room(self, batch: _Batch, state: RequestState, tokens_after_step: int) -> bool:
        """Reserve KV blocks for a step (evicting idle cached ones if need be), preempting the
        youngest running requests while they do not fit; False when the request itself was the
        youngest and was preempted (or can never fit)."""
        worker = batch.worker
        needed = worker.blocks_for(tokens_after_step) - state.kv_blocks
        if needed <= 0:
            return True  # within the blocks it holds (most decode steps)
        while needed > worker.kv_blocks_available:
            victim = max(worker.running.values(), key=lambda running: running.fcfs_key)
            if victim is state and len(worker.running) == 1:
                # Alone on the worker and still too big: no amount of waiting helps.
                self._end(state, "length")
                self._finished_without_token.append(state)
                return False
            batch.drop(victim)
            self._preempt(worker, victim, "kv_full")
            if victim is state:
                return False
        state.kv_blocks += needed
        worker.take_blocks(needed)
        return True

    def _fair_order(self) -> list[str]:
        """Waiting requests in admission order: round-robin across client keys, FCFS within a key.

        Round r takes the r-th oldest request of every key, the keys in the order they were last
        served (never or longest ago first, then by their oldest request), so a key that floods
        the queue gets one turn per round like any other. With one key this is plain FCFS.
        """
        self._forget_keys_not_waiting()
        if len(self._waiting_keys) <= 1:
            return [request_id for _, _, request_id in self._waiting]
        by_key: dict[str, list[str]] = {}
        for _, _, request_id in self._waiting:
            by_key.setdefault(self._requests[request_id].record.client_key, []).append(request_id)
        turn = sorted(by_key, key=lambda key: self._key_served_at.get(key, -1))  # stable: oldest head first
        order = []
        for round_index in range(max(len(queue) for queue in by_key.values())):
            order.extend(by_key[key][round_index] for key in turn if round_index < len(by_key[key]))
        return order

    def _forget_keys_not_waiting(self) -> None:
        """A key with nothing waiting loses its turn's place: when it sends again, it goes first."""
        if not self._key_served_at.keys() <= self._waiting_keys.keys():
            self._key_served_at = {key: served for key, served in self._key_served_at.items()
                                   if key in self._waiting_keys}

    def _admit_waiting(self, batch: _Batch) -> None:
        """Waiting requests join in fair order while the batch and the KV cache have room."""
        worker = batch.worker
        if len(worker.running) >= self.max_batch_size or self.policy == "iteration" and batch.budget <= 0:
            self._forget_keys_not_waiting()  # (as _fair_order would have)
            return  # no room: nobody is looked at
        claimed: dict[str, tuple[int, int]] = {}  # other workers: blocks, requests meant for them
        for request_id in self._fair_order():
            if len(worker.running) >= self.max_batch_size:
                break
            if self.policy == "iteration" and batch.budget <= 0:
                break
            if request_id in worker.to_free:
                continue  # leaving this worker in this very plan: it may come back in a later one
            state = self._requests[request_id]
            blocks = worker.blocks_for(state.total_tokens)
            target, pinned = self._admission_target(state, worker, claimed)
            if target is None:
                if not any(other.blocks_for(state.total_tokens + 1) <= other.kv_blocks_total
                           for other in self._workers.values()):
                    self._end(state, "length")
                    self._finished_without_token.append(state)
                    log.warning("request_id=%s needs more KV than any worker has", request_id)
                continue
            if target is not worker:
                # Meant for a worker that holds its prefix, or runs fewer requests, or as many with
                # more free KV and plans soon; when that one is busy and no less loaded, the
                # planning worker takes it if it has room rather than let it wait.
                target_blocks, target_count = claimed.get(target.worker_id, (0, 0))
                busy_and_no_less_loaded = target.in_flight and len(target.running) + target_count >= len(worker.running)
                if pinned or not (busy_and_no_less_loaded and blocks <= worker.kv_blocks_available):
                    claimed[target.worker_id] = (target_blocks + target.blocks_for(state.total_tokens),
                                                 target_count + 1)
                    continue
            cached = self._cached_prefix(worker, state)
            idle_cached = worker.cache.idle_among(state.block_chain(worker.cache_root)[:cached]) if cached else 0
            if blocks - cached > worker.kv_blocks_available - idle_cached:
                break  # the next waiting request waits for room; the ones after it do not overtake it
            self._admit(batch, state, blocks, cached)

    def _cached_prefix(self, worker: WorkerState, state: RequestState) -> int:
        """How many of the request's first blocks the worker holds (all but its last token at most:
        that one is fed to sample from)."""
        if not self.prefix_caching or not worker.cache:
            return 0
        limit = (state.total_tokens - 1) // worker.kv_block_size
        chain = state.block_chain(worker.cache_root)
        extend_chain(chain, worker.cache_root, state.tokens, worker.kv_block_size, limit)
        return worker.cache.match(chain, limit)

    def _admission_target(self, state: RequestState, planning: WorkerState,
                          claimed: dict[str, tuple[int, int]]) -> tuple[WorkerState | None, bool]:
        """Where a waiting request should go, and whether it should wait for that worker rather than
        start on another: under cache-aware placement the worker holding the longest prefix of it
        (ties: the least loaded) if that prefix is at least placement_threshold of its tokens and
        that worker's load (requests running and meant for it) is within placement_slack of the least
        loaded worker's; otherwise the least loaded live worker that takes new requests (ties: the
        most free KV blocks, then the planning worker, then the smaller id)."""
        best: tuple[tuple, WorkerState] | None = None
        loads: dict[str, int] = {}
        for worker in self._workers.values():
            if worker.draining or worker.blocks_for(state.total_tokens + 1) > worker.kv_blocks_total:
                continue
            claimed_blocks, claimed_count = claimed.get(worker.worker_id, (0, 0))
            if worker is not planning:
                if self.policy == "request" and worker.running:
                    continue
                if len(worker.running) + claimed_count >= self.max_batch_size:
                    continue
            loads[worker.worker_id] = len(worker.running) + claimed_count
            key = (loads[worker.worker_id], -(worker.kv_blocks_available - claimed_blocks), worker is not planning,
                   worker.worker_id)
            if best is None or key < best[0]:
                best = (key, worker)
        if best is None:
            return None, False
        if self.placement == "cache-aware" and self.prefix_caching:
            least = min(loads.values())
            cached = max(((self._cached_prefix(self._workers[worker_id], state), -load, worker_id)
                          for worker_id, load in loads.items() if load <= least + self.placement_slack))
            # A short match (a chat template's system prompt that one worker has seen and the other not
            # yet) must not draw every new conversation to one worker: SGLang's router's cache_threshold.
            if cached[0] > 0 and cached[0] * self._workers[cached[2]].kv_block_size >= \
                    self.placement_threshold * state.total_tokens:
                return self._workers[cached[2]], True
        return best[1], False

    def _admit(self, batch: _Batch, state: RequestState, blocks: int, cached: int = 0) -> None:
        """Start a request on the batch's worker, after the `cached` first blocks it finds there."""
        worker = batch.worker
        self._dequeue(state)
        hashes = state.block_chain(worker.cache_root)[:cached]
        worker.cache.acquire(hashes)
        state.held_hashes, state.adopted_blocks = list(hashes), cached
        cached_tokens = cached * worker.kv_block_size
        self.prefix_cache_queried_tokens += state.total_tokens
        self.prefix_cache_hit_tokens += cached_tokens
        if state.cached_tokens is None:
            state.cached_tokens = min(cached_tokens, len(state.prompt_token_ids))
        state.status, state.worker_id, state.computed = "running", worker.worker_id, cached_tokens
        state.kv_blocks, state.stepped_on_worker = blocks, False
        worker.take_blocks(blocks - cached)
        worker.running[state.request_id] = state
        worker.rows.add(state)
        batch.admitted.append(state.request_id)
        self._admissions += 1
        self._key_served_at[state.record.client_key] = self._admissions
        chunk = min(state.total_tokens - state.computed, batch.budget)
        if chunk > 0:  # the request policy admits its whole batch even past the token budget
            batch.chunks[state.request_id] = chunk
            batch.budget -= chunk
        request_log.info("admitted request_id=%s worker_id=%s tokens=%d output_tokens=%d cached_tokens=%d",
                         state.request_id, worker.worker_id, state.total_tokens, len(state.output_token_ids),
                         cached_tokens)

    def _steps_for(self, worker: WorkerState) -> int:
        """The most steps the worker's next plan may run: scheduler_steps, or with plan_seconds as
        many as fit in that long of the worker's recent steps (at least one; one until it has
        answered a plan, when how long its steps take is not known). A plan of decodes costs the
        scheduler about the same whatever its steps, so with a target in time a fast worker gets
        plans of many steps and a slow one of one, where its steps hide the scheduler's cost."""
        most = self.scheduler_steps
        if self.plan_seconds and most > 1:
            step_seconds = worker.step_seconds
            if step_seconds is None:
                return 1
            if step_seconds * most > self.plan_seconds:
                most = max(1, int(self.plan_seconds / step_seconds))
        return most

    def _plan_steps(self, batch: _Batch, most: int) -> list[int] | None:
        """A plan whose every item samples (decodes, and prompts whose last chunk it feeds), on a
        worker of one stage: each item's steps (most, fewer for a request that reaches its
        output limit sooner), their KV blocks reserved and their tokens counted in flight; None when
        it runs one step (a prefill chunk short of its prompt's end, or too few KV blocks free for the
        steps: nothing is preempted for them)."""
        worker = batch.worker
        if worker.stages > 1 or self.policy != "iteration" or not all(batch.samples):
            return None
        states = batch.fed_states + batch.states  # (each: its tokens counted in computed, its sample in flight)
        if not states:
            return None
        block_size = worker.kv_block_size
        # Each one's steps: as many more samples as its output limit leaves (this step's sample is
        # counted: at least one step).
        steps = [min(most, state.output_limit - len(state.output_token_ids) - state.in_flight_samples + 1)
                 for state in states]
        if self.plan_seconds and self._waiting:
            # Requests wait for a row (plans in time adapt, fixed ones run their steps): the plan
            # ends at the step where its first request reaches its output limit, so the row it frees
            # takes one of them at the next plan, not up to a plan's steps later.
            end = min(steps)
            if end < most:
                steps = [end] * len(steps)
        # The KV blocks each one's last step needs beyond those it holds.
        more_blocks = []
        for state, count in zip(states, steps):
            last = state.computed + count - 1  # (tokens in its KV after its last step)
            if last > state.kv_blocks * block_size:
                more_blocks.append((state, -(-last // block_size) - state.kv_blocks))
        if more_blocks:
            blocks = sum([count for _, count in more_blocks])
            if blocks > worker.kv_blocks_available:
                return None
            worker.take_blocks(blocks)
            for state, count in more_blocks:
                state.kv_blocks += count
        for state, count in zip(states, steps):
            state.computed += count - 1
            state.in_flight_samples += count - 1
        return steps

    def _emit_plan(self, batch: _Batch) -> ColumnPlan:
        """The plan: the decodes written in already, then the requests stepped one at a time (and
        with scheduler_steps, how many steps each item runs: _plan_steps)."""
        worker = batch.worker
        running = worker.running
        for request_id, chunk in batch.chunks.items():
            state = running[request_id]
            start = state.computed
            end = start + chunk
            outputs = len(state.output_token_ids)
            in_flight = state.in_flight_samples
            if outputs + in_flight and start == state.prompt_length + outputs + in_flight - 1:  # (is_decoding)
                batch.decode_tokens += chunk
            else:
                batch.prefill_tokens += chunk
            if not state.stepped_on_worker:
                batch.joined.append(request_id)
                state.stepped_on_worker = True
            if in_flight:  # its input is the token a plan in flight samples
                if chunk != 1:  # the bookkeeping is broken: better to stop than plan on it
                    raise RuntimeError(f"{request_id}: {chunk} tokens pending behind a token sampled in flight")
                batch.fed_states.append(state)
                batch.fed_handles.append(state.row)
                batch.fed_outputs.append(outputs + in_flight)
                batch.fed_starts.append(start)
                state.in_flight_samples += 1
            else:
                sample = end == state.prompt_length + outputs
                self._add_item(batch, state, start, chunk, sample, outputs, state.tokens(start, end))
                state.in_flight_samples += sample
            state.computed = end
        allowed = self._steps_for(worker) if self.scheduler_steps > 1 else 1
        steps = self._plan_steps(batch, allowed) if allowed > 1 else None
        new_states = [state for request_id, state in running.items() if request_id not in worker.known] \
            if not worker.known.issuperset(running) else []  # (one set operation in the common case)
        worker.known.update(state.request_id for state in new_states)
        states = batch.fed_states + batch.states
        plan = ColumnPlan(
            scheduler_epoch=self.epoch,
            plan_id=self._next_plan_id,
            worker_id=worker.worker_id,
            free_all=worker.free_all,
            new_requests=tuple([self._new_request(worker, state) for state in new_states]),
            new_handles=tuple([state.row for state in new_states]),
            free_request_ids=tuple(worker.to_free),
            free_handles=tuple(worker.to_free.values()),
            register_blocks=tuple([(request_id, index, block_hash) for request_id, index, block_hash, _
                                   in worker.to_register]),
            register_handles=tuple([row for _, _, _, row in worker.to_register]),
            evict_blocks=tuple(worker.to_evict),
            decode_handles=batch.fed_handles, decode_outputs=batch.fed_outputs, decode_starts=batch.fed_starts,
            handles=batch.handles, starts=batch.starts, counts=batch.counts, samples=batch.samples,
            outputs=batch.outputs, tokens=batch.tokens,
            item_ids=tuple([state.request_id for state in states]),
        )
        most = max(steps) if steps else 1
        if most > 1:
            plan.steps = most
            plan.item_steps = () if min(steps) == most else steps
        self._next_plan_id += most
        worker.to_free.clear()
        worker.to_register.clear()
        worker.to_evict.clear()
        worker.free_all = False
        flight = PlanInFlight(plan, self._clock(), tuple(batch.joined), batch.prefill_tokens, batch.decode_tokens,
                              states=states, output_indexes=batch.fed_outputs + batch.outputs,
                              handles=batch.fed_handles + batch.handles, cache_digest=worker.cache.digest)
        if not all(batch.samples):  # (prefill chunks short of a prompt's end: the plan says where their KV ends)
            flight.samples = [True] * len(batch.fed_states) + batch.samples
            flight.ends = [0] * len(batch.fed_states) + [start + count for start, count in zip(batch.starts,
                                                                                              batch.counts)]
        worker.in_flight.append(flight)
        if most > 1:
            self._later_steps(worker, flight)
        return plan

    @staticmethod
    def _later_steps(worker: WorkerState, flight: PlanInFlight) -> None:
        """A plan's steps after its first, in flight each as its own PlanInFlight (each is answered
        by a result of its own): the items that run it, their output indexes one more each step."""
        plan = flight.plan
        steps = plan.item_steps  # (empty: every item runs all the plan's steps)
        states, handles, output_indexes = flight.states, flight.handles, flight.output_indexes
        for step in range(1, plan.steps):
            if not steps:
                step_states, step_handles, request_ids = states, handles, None
                step_outputs = [output_index + step for output_index in output_indexes]
            else:
                kept = [position for position, count in enumerate(steps) if count > step]
                step_states, step_handles = [states[position] for position in kept], [handles[position] for position in kept]
                step_outputs = [output_indexes[position] + step for position in kept]
                request_ids = tuple([state.request_id for state in step_states])
            worker.in_flight.append(PlanInFlight(flight.plan, flight.started_at, (), 0, len(step_states),
                                                 states=step_states, output_indexes=step_outputs,
                                                 handles=step_handles, step=step, step_request_ids=request_ids,
                                                 cache_digest=flight.cache_digest))

    def workers_write_entries(self, sampling: SamplingParams) -> bool:
        """Whether the workers write this request's token entries (those of tokens that end
        nothing): not with stop strings (its text may be held back or cut where it is searched,
        here) or logprobs (they travel in the result)."""
        return self._text_context is not None and not sampling.stop and sampling.logprobs < 0

    def _new_request(self, worker: WorkerState, state: RequestState) -> NewRequest:
        """A request's data for a worker that does not hold it yet (with penalties, the tokens of the
        cached blocks it starts with: they are part of its penalty history, and are not fed)."""
        cached_blocks = tuple(state.held_hashes[: state.adopted_blocks])
        cached_token_ids = (state.tokens(0, len(cached_blocks) * worker.kv_block_size)
                            if cached_blocks and state.sampling.has_penalty else ())
        if not state.workers_write:
            return NewRequest(request_id=state.request_id, sampling=state.sampling, cached_blocks=cached_blocks,
                              cached_token_ids=cached_token_ids)
        outputs = state.output_token_ids
        return NewRequest(request_id=state.request_id, sampling=state.sampling, cached_blocks=cached_blocks,
                          cached_token_ids=cached_token_ids, entries_below=max(len(outputs), state.output_limit),
                          first_output_index=len(outputs),
                          text_context=self._text_context(state.prompt_token_ids, outputs))

    # Internals: request lifecycle

    def _finish_reason_after_output(self, state: RequestState) -> FinishReason | None:
        output = state.output_token_ids
        return finish_reason(output[-1], len(output), state.output_limit, self.stop_token_ids,
                             state.sampling.ignore_eos)

    def _on_item_error(self, worker: WorkerState, state: RequestState, code: str, message: str) -> None:
        state.item_errors += code not in ("kv_cache_full", "out_of_memory")  # reasons to wait, not faults
        if state.item_errors >= MAX_ITEM_ERRORS:
            log.error("failed request_id=%s worker_id=%s code=%s message=%s", state.request_id,
                      worker.worker_id, code, message)
            self._end(state, "error")
            self._finished_without_token.append(state)
            return
        log.warning("item_error request_id=%s worker_id=%s code=%s message=%s", state.request_id,
                    worker.worker_id, code, message)
        self._preempt(worker, state, code)

    def _preempt(self, worker: WorkerState, state: RequestState, why: str) -> None:
        self._note_left(state, cancelled=False)
        self._requeue(worker, state)
        log.info("preempted request_id=%s worker_id=%s reason=%s output_tokens=%d",
                 state.request_id, worker.worker_id, why, len(state.output_token_ids))

    def _release(self, state: RequestState) -> None:
        """Take a request off its worker: the worker frees its KV with its next plan."""
        worker = self._workers.get(state.worker_id) if state.worker_id else None
        if worker is not None and worker.running.pop(state.request_id, None) is not None:
            shared = sum(block_hash is not None for block_hash in state.held_hashes)
            worker.kv_blocks_reserved -= state.kv_blocks - shared
            # Its registered blocks stay cached (one registered and freed before its next plan: that
            # plan registers, then frees, in this order), the last first: of an idle prefix the tail
            # goes before the head, which more requests share (vLLM frees in the same order).
            for block_hash in reversed(state.held_hashes):
                if block_hash is not None:
                    worker.cache.release(block_hash)
            worker.known.discard(state.request_id)
            worker.to_free.setdefault(state.request_id, state.row)
            worker.rows.release(state)
            for flight in worker.in_flight:  # (their answers apply nothing of it)
                flight.left.add(state)
        state.worker_id, state.computed, state.kv_blocks, state.in_flight_samples, state.row = None, 0, 0, 0, -1
        state.held_hashes, state.adopted_blocks = [], 0

    def _register_blocks(self, worker: WorkerState, state: RequestState, end: int) -> None:
        """A result confirmed the request's KV written up to token `end` (all known): its blocks
        filled by then enter the worker's cache (a block whose contents another block holds already
        stays the request's)."""
        block_size = worker.kv_block_size
        full = end // block_size
        chain = state.block_chain(worker.cache_root)
        extend_chain(chain, worker.cache_root, state.tokens, block_size, full)
        for index in range(len(state.held_hashes), full):
            block_hash = chain[index]
            if worker.cache.add(block_hash):
                state.held_hashes.append(block_hash)
                worker.kv_blocks_reserved -= 1  # its own block is now the cache's, held by it
                worker.to_register.append((state.request_id, index, block_hash, state.row))
            else:
                state.held_hashes.append(None)

    def _requeue(self, worker: WorkerState, state: RequestState) -> None:
        self._release(state)
        state.status = "waiting"
        self._enqueue(state)

    def _draft_with(self, state: RequestState) -> _RecordDraft | None:
        """The record of its worker's latest answered iteration, if the request was in that batch."""
        draft = self._latest_draft.get(state.worker_id) if state.worker_id else None
        return draft if draft is not None and draft.in_flight.holds(state) else None

    def _note_left(self, state: RequestState, cancelled: bool) -> None:
        """Record a running request taken off its worker (cancelled or preempted) in the worker's
        current iteration record if it is still open and holds the request, else in its next one."""
        draft = self._draft_with(state)
        if draft is None and state.worker_id:
            draft_lists = self._left_since_record.setdefault(state.worker_id, ([], []))
            (draft_lists[0] if cancelled else draft_lists[1]).append(state.request_id)
        elif draft is not None:
            (draft.cancelled if cancelled else draft.preempted).append(state.request_id)

    def _end(self, state: RequestState, reason: FinishReason) -> None:
        if reason == "cancelled":
            self._note_left(state, cancelled=True)
        else:
            draft = self._draft_with(state)
            if draft is not None:
                draft.finished.append(state.request_id)
        if state.status == "waiting":
            self._dequeue(state)
        self._release(state)
        state.status, state.finish_reason = status_for(reason), reason
        self._requests.pop(state.request_id, None)

    def _enqueue(self, state: RequestState) -> None:
        bisect.insort(self._waiting, (*state.fcfs_key, state.request_id))
        key = state.record.client_key
        self._waiting_keys[key] = self._waiting_keys.get(key, 0) + 1

    def _dequeue(self, state: RequestState) -> None:
        entry = (*state.fcfs_key, state.request_id)
        index = bisect.bisect_left(self._waiting, entry)
        if index < len(self._waiting) and self._waiting[index] == entry:
            del self._waiting[index]
            key = state.record.client_key
            if self._waiting_keys[key] == 1:
                del self._waiting_keys[key]
            else:
                self._waiting_keys[key] -= 1
