"""Plans and results by request id, for tools and tests that drive a scheduler policy or an executor
in one process (the engine replay, the overhead microbenchmarks, the tests): the wire and the
scheduler name a request by its handle (shared/plans.py), these by its id.

- PlanCodec: BatchPlans encoded as the scheduler encodes its plans (handles handed out as it hands
  them out), and results read back by request id;
- plan_result: what a worker answers for a plan it ran, built from the executor's outcome;
- result_columns / apply_result: a PlanResult as the wire's columns, which is all the policy reads.
"""

from collections.abc import Sequence

from services.scheduler.policy import SchedulerPolicy, TokenOutcome
from shared.messages import BatchPlan, ItemError, PlanResult, SampledToken, StepItem
from shared.plans import (MAX_HANDLE, ColumnPlan, ResultColumns, encode_plan, read_result, read_result_columns,
                          split_steps)

__all__ = ["PlanCodec", "apply_result", "plan_result", "read_result", "result_columns"]


class PlanCodec:
    """Plans and results by request id, for one worker (tests and tools that make plans as
    BatchPlans): hands out the handles, then encodes as the scheduler does. A handle freed by a
    later plan may name another request by the time an answer comes: it is read as it was sent."""

    def __init__(self) -> None:
        self.epoch = ""
        self._handle_of: dict[str, int] = {}
        self._free_handles: list[int] = []
        self._next_handle = 0
        self._sent: dict[int, dict[int, str]] = {}  # each plan not answered: its items' handle -> request id

    def expect_answer(self, plan_id: int, items: Sequence[StepItem]) -> None:
        """The answer to plan_id will name these items' requests by their handles (encode calls it;
        a benchmark that decodes one answer again and again calls it before each)."""
        self._sent[plan_id] = {self._handle_of[item.request_id]: item.request_id for item in items}

    def encode(self, plan: BatchPlan, answer_with_next: bool = False, steps: int = 1,
               item_steps: Sequence[int] = ()) -> bytes:
        """item_steps: in the plan's item order (encoded in wire order: its fed decodes first)."""
        if plan.scheduler_epoch != self.epoch or plan.free_all:
            self.epoch = plan.scheduler_epoch
            self._handle_of.clear()
            self._free_handles.clear()
            self._next_handle = 0
            self._sent.clear()
        # Registrations name requests this plan may free: their handles are read before the frees.
        registered = tuple(self._handle_of[request_id] for request_id, _, _ in plan.register_blocks)
        freed = []
        for request_id in plan.free_request_ids:
            handle = self._handle_of.pop(request_id, None)
            if handle is not None:
                self._free_handles.append(handle)
                freed.append(handle)
        new_handles = []
        for request in plan.new_requests:
            handle = self._handle_of.get(request.request_id)
            if handle is None:
                if self._free_handles:
                    handle = self._free_handles.pop()
                else:
                    if self._next_handle > MAX_HANDLE:
                        raise ValueError(f"more than {MAX_HANDLE + 1} requests on one worker")
                    handle, self._next_handle = self._next_handle, self._next_handle + 1
                self._handle_of[request.request_id] = handle
            new_handles.append(handle)
        decodes = [item for item in plan.items if item.feeds_sampled and item.sample]
        others = [item for item in plan.items if not (item.feeds_sampled and item.sample)]
        for step in range(steps):  # (a step's answer names the requests that run it)
            self.expect_answer(plan.plan_id + step, plan.items)
        if item_steps:
            steps_of = dict(zip([item.request_id for item in plan.items], item_steps, strict=True))
            item_steps = [steps_of[item.request_id] for item in decodes + others]

        return encode_plan(ColumnPlan(
            scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id, worker_id=plan.worker_id,
            free_all=plan.free_all, new_requests=plan.new_requests, new_handles=tuple(new_handles),
            free_handles=tuple(freed), register_blocks=plan.register_blocks, register_handles=registered,
            evict_blocks=plan.evict_blocks,
            decode_handles=[self._handle_of[item.request_id] for item in decodes],
            decode_outputs=[item.output_index for item in decodes],
            handles=[self._handle_of[item.request_id] for item in others],
            starts=[item.start_position for item in others], counts=[len(item.token_ids) for item in others],
            samples=[item.sample for item in others], outputs=[item.output_index for item in others],
            tokens=[token for item in others for token in item.token_ids], answer_with_next=answer_with_next,
            steps=steps, item_steps=item_steps))

    def decode_results(self, raw: dict) -> list[PlanResult]:
        """A worker's answer (as read_result gave it), one PlanResult per step it answers (the
        answer to a plan of several steps: split_steps), its handles read back as the plan it answers
        named them (an answer to no plan of this codec's, an older epoch's say, comes back with no
        token and no error)."""
        return [self._decode_step(columns) for columns in split_steps(read_result_columns(raw))]

    def _decode_step(self, columns: ResultColumns) -> PlanResult:
        sent = self._sent.pop(columns.plan_id, {}) if columns.scheduler_epoch == self.epoch else {}
        tokens = []
        for position, (handle, token_id, output_index) in enumerate(zip(
                columns.handles, columns.token_ids, columns.output_indexes)):
            request_id = sent.get(handle)
            if request_id is not None:
                logprob, top = columns.logprobs.get(position, (None, ()))
                tokens.append(SampledToken(request_id, token_id, output_index, logprob, top))
        errors = tuple(ItemError(request_id=sent[handle], code=code, message=message)
                       for handle, code, message in columns.errors if handle in sent)
        return PlanResult(
            scheduler_epoch=columns.scheduler_epoch, plan_id=columns.plan_id, worker_id=columns.worker_id,
            tokens=tuple(tokens), errors=errors, kv_blocks_total=columns.kv_blocks_total,
            kv_blocks_free=columns.kv_blocks_free, kv_blocks_cached=columns.kv_blocks_cached,
            step_seconds=columns.step_seconds, entries_written=columns.entries_written,
            unwritten=frozenset(sent[handle] for handle in columns.unwritten if handle in sent),
            cache_digest=columns.cache_digest)

    def decode_result(self, raw: dict) -> PlanResult:
        """The answer to a plan of one step (decode_results: of any)."""
        results = self.decode_results(raw)
        if len(results) != 1:
            raise ValueError(f"an answer to {len(results)} steps: decode_results reads it")
        return results[0]


def plan_result(plan: BatchPlan, outcome, worker_id: str, kv) -> PlanResult:
    """What a worker answers for a plan it ran (outcome: the executor's StepOutcome; kv: its cache),
    as the scheduler reads it, for an executor driven in one process with no wire in between."""
    from services.worker.service import finite

    by_id = {item.request_id: item for item in plan.items}
    tokens = []
    for request_id, token in outcome.tokens.items():
        logprobs = outcome.logprobs.get(request_id)
        tokens.append(SampledToken(
            request_id=request_id, token_id=token, output_index=by_id[request_id].output_index,
            logprob=None if logprobs is None else finite(logprobs.logprob),
            top_logprobs=() if logprobs is None else tuple((top_id, finite(value)) for top_id, value in logprobs.top)))
    return PlanResult(
        scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id, worker_id=worker_id, tokens=tuple(tokens),
        errors=tuple(ItemError(request_id=error.request_id, code=error.code, message=error.message)
                     for error in outcome.errors),
        kv_blocks_total=kv.blocks_total, kv_blocks_free=kv.blocks_free, step_seconds=outcome.seconds,
        kv_blocks_cached=kv.blocks_cached, cache_digest=kv.cache_digest,
    )


def result_columns(policy: SchedulerPolicy, result: PlanResult) -> ResultColumns:
    """A result by request id as the wire's columns: each request named by the handle the plan it
    answers (the worker's oldest in flight) gave it; a token or an error of a request not in that
    plan, or an answer to no plan in flight, names none (the policy then finds it stale)."""
    worker = policy.worker(result.worker_id)
    flight = worker.in_flight[0] if worker is not None and worker.in_flight else None
    handle_of = dict(zip(flight.request_ids, flight.handles)) if flight is not None else {}
    tokens = [token for token in result.tokens if token.request_id in handle_of]
    return ResultColumns(
        scheduler_epoch=result.scheduler_epoch, plan_id=result.plan_id, worker_id=result.worker_id,
        handles=[handle_of[token.request_id] for token in tokens], token_ids=[token.token_id for token in tokens],
        output_indexes=[token.output_index for token in tokens],
        logprobs={position: (token.logprob, token.top_logprobs) for position, token in enumerate(tokens)
                  if token.logprob is not None},
        errors=tuple((handle_of.get(error.request_id, -1), error.code, error.message) for error in result.errors),
        kv_blocks_total=result.kv_blocks_total, kv_blocks_free=result.kv_blocks_free,
        kv_blocks_cached=result.kv_blocks_cached, step_seconds=result.step_seconds,
        entries_written=result.entries_written, cache_digest=result.cache_digest,
        unwritten=[handle_of[request_id] for request_id in result.unwritten if request_id in handle_of])


def apply_result(policy: SchedulerPolicy, result: PlanResult | ResultColumns) -> list[TokenOutcome]:
    """policy.on_result of a result by request id (or of columns, as they are)."""
    return policy.on_result(result_columns(policy, result) if isinstance(result, PlanResult) else result)
