"""Iteration-level scheduling (Orca, OSDI'22, Algorithm 1) over several workers: pure bookkeeping,
no Redis, no asyncio, no tensors (services/scheduler/service.py moves the messages).

Each worker is an independent replica with its own paged KV cache. The loop, per worker, is:

    plan = policy.next_plan(worker)      # its running requests step, waiting ones join while there is room
    ... the worker runs it ...
    policy.on_result(answer)             # tokens applied, finishes decided: a finished request leaves,
                                         # a waiting one joins at the very next plan

Its parts, one module each:
- batch formation (services/scheduler/batch_formation.py): which requests step, and how many tokens,
  within max_batch_size, max_batch_tokens and the KV pool (preempting the youngest when it is full),
  written as the plan's columns; plans of several steps (scheduler_steps, plan_seconds);
- placement (services/scheduler/placement.py): waiting requests in fair order across client keys,
  each to the worker holding its longest cached prefix or the least loaded one, and the scheduler's
  exact copy of every worker's prefix cache;
- result application (services/scheduler/result_application.py): one path for every answer;
- iteration records (services/scheduler/iteration_records.py).
This module holds the pool of requests, the workers, and a request's lifecycle (queued, running,
preempted, ended).

Pipelining (Orca section 3.1.3, vLLM's async scheduling): up to `pipeline_depth` plans are in flight
per worker, so the next iteration is planned and sent while the one before runs. A request whose
token a plan in flight samples steps again with `feeds_sampled`: the worker feeds the token it sampled
itself. A request that will have reached max_tokens or the context is not planned again; one that ends
on a stop token (or a cancel) costs at most that one speculative step. A worker group of M pipeline
stages has M plans in flight, each of about 1/M of its requests and none of another's (Orca's figure
8). The "request" policy is the FasterTransformer-style baseline: a worker forms a batch only when it
runs nothing, and nothing joins until the whole batch is done.
"""

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal

from services.scheduler.batch_formation import Batch, BatchFormation
from services.scheduler.iteration_records import IterationRecords, RecordDraft
from services.scheduler.placement import RequestPlacement
from services.scheduler.prefix_cache import root_hash
from services.scheduler.request_state import RequestState, WorkerState
from services.scheduler.result_application import ResultApplication, TokenOutcome
from shared.finishing import finish_reason, length_limit
from shared.messages import FinishReason, RequestRecord, SamplingParams
from shared.plans import MAX_STEPS, ColumnPlan
from shared.speculative import ACCEPTANCE_COUNTERS, SpeculativeConfig

__all__ = ["SchedulerPolicy", "TokenOutcome", "Policy", "Placement"]

log = logging.getLogger("iterserve.scheduler")

Policy = Literal["iteration", "request"]
Placement = Literal["cache-aware", "least-loaded"]
# Workers lost while a request ran on them before it fails: a request that makes every engine
# break (a bug it triggers) must not take the fleet down one worker after another, forever.
MAX_WORKERS_LOST = 3


def status_for(reason: FinishReason) -> Literal["finished", "cancelled", "failed"]:
    return {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")  # type: ignore[return-value]


class SchedulerPolicy(BatchFormation, RequestPlacement, ResultApplication, IterationRecords):
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
        speculative: SpeculativeConfig | None = None,
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
        self._drafts: list[RecordDraft] = []
        self._latest_draft: dict[str, RecordDraft] = {}
        # Requests cancelled or preempted off a worker after its latest record was taken: they go
        # into its next record (worker id -> (cancelled, preempted)).
        self._left_since_record: dict[str, tuple[list[str], list[str]]] = {}
        self._finished_without_token: list[RequestState] = []
        self.ended: list[RequestState] = []  # requests that ended since the service last looked (it clears it)
        if speculative is not None and policy != "iteration":
            raise ValueError("speculative decoding needs the iteration policy")
        self.speculative = speculative
        # Speculative decoding's totals (vLLM's spec_decode counters): verification items, tokens
        # proposed, proposals kept.
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_request_acceptance = dict.fromkeys(ACCEPTANCE_COUNTERS, 0)  # (Speculation._note_acceptance)

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
                             speculable=self.speculative is not None and self.speculable(record.sampling),
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
                             stages=stages, speculates=stages == 1 and not kv_identity.startswith("emulated"))
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

    def set_draining(self, worker_id: str, draining: bool, elsewhere: bool = False) -> list[str]:
        """A draining worker (stopping) gets no new request. Its running ones are handed over: they
        wait again (FCFS place kept) to be rebuilt on a worker that takes requests, or, while there
        is none, stay and finish where they are. elsewhere: another scheduler of the model holds a
        worker (one of several: this one lets its waiting requests go to it when it has no worker
        that takes them). Returns the ids handed over."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        if worker.draining != draining:
            worker.draining = draining
            log.info("worker_draining worker_id=%s draining=%s running=%d", worker_id, draining, len(worker.running))
        if not (draining and worker.running and (elsewhere or self.takes_requests)):
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

    @property
    def frees_unsent(self) -> bool:
        """Whether a worker has requests to free that no plan has told it yet."""
        return any(worker.to_free for worker in self._workers.values())

    @property
    def takes_requests(self) -> bool:
        """Whether a worker it plans for takes new requests (one not draining)."""
        return any(not worker.draining for worker in self._workers.values())

    def idle_workers(self) -> list[str]:
        """Workers that can take another group of plans (room for `group` more within pipeline_depth
        in flight): the fewest in flight first, then the most free KV (it gets the oldest waiting
        request when several plan at once)."""
        idle = [worker for worker in self._workers.values()
                if worker.plans_in_flight + self._group_of(worker) <= self.depth(worker)]
        idle.sort(key=lambda worker: (worker.plans_in_flight, -worker.kv_blocks_available, worker.worker_id))
        return [worker.worker_id for worker in idle]

    # Iterations: the plans (batch_formation.py, placement.py); the answers: on_result (result_application.py)

    def next_plan(self, worker_id: str) -> ColumnPlan | None:
        """The worker's next iteration, or None while pipeline_depth plans are in flight or it has
        nothing to do."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.plans_in_flight >= self.depth(worker):
            return None
        batch = Batch(worker, budget=self.max_batch_tokens)
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

    def workers_write_entries(self, sampling: SamplingParams) -> bool:
        """Whether the workers write this request's token entries (those of tokens that end
        nothing): not with stop strings (its text may be held back or cut where it is searched,
        here) or logprobs (they travel in the result)."""
        return self._text_context is not None and not sampling.stop and sampling.logprobs < 0

    @staticmethod
    def speculable(sampling: SamplingParams) -> bool:
        """Whether a request may speculate: not with penalties or a constraint (the worker's history of
        its tokens would hold the proposals refused), logprobs (one token's a step travel back), or
        stop strings (searched in the text between tokens, which a step of several would pass)."""
        return not sampling.needs_history and sampling.logprobs < 0 and not sampling.stop

    # A request's lifecycle

    def _finish_reason_after_output(self, state: RequestState) -> FinishReason | None:
        output = state.output_token_ids
        return finish_reason(output[-1], len(output), state.output_limit, self.stop_token_ids,
                             state.sampling.ignore_eos)

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
        state.drafts_in_flight = 0
        state.held_hashes, state.adopted_blocks = [], 0

    def _requeue(self, worker: WorkerState, state: RequestState) -> None:
        self._release(state)
        state.status = "waiting"
        self._enqueue(state)

    def _end(self, state: RequestState, reason: FinishReason) -> None:
        self._note_acceptance(state)
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
        self.ended.append(state)

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
