"""Result application: a worker's answer to a plan taken back into the requests' state.

One path for every answer (on_result): the answer to a plan of one step, or to a plan of several
(--scheduler-steps) whole, each item's tokens appended at once up to one that ends its request. Each
token is applied exactly once, at its output index (an answer read twice adds nothing); each finish
is decided here (a stop token, the output limit; stop strings are the service's, in the text); the
blocks a result confirms written enter the worker's prefix cache; an item in error is preempted (and
rebuilt) or, after too many errors, fails its request. What is left to publish comes back as
TokenOutcomes: every token whose entry the worker did not write itself, and every finishing one.
"""

import logging
from itertools import repeat
from typing import NamedTuple

from services.scheduler.request_state import PlanInFlight, RequestState, WorkerState
from shared.finishing import finish_reason
from shared.messages import FinishReason
from shared.plans import ResultColumns, split_steps

log = logging.getLogger("iterserve.scheduler")

MAX_ITEM_ERRORS = 3  # worker errors on one request's items before it fails (a rebuild fixes most)


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


class ResultApplication:
    """SchedulerPolicy's result application (a mixin: the state is the policy's, made in its
    __init__: epoch, _workers, stop_token_ids, prefix_caching, _clock, the records')."""

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
        """Apply a worker's answer to its oldest plan in flight (a stale one changes nothing); the
        tokens whose output is still to write. The answer to a plan of several steps is taken as
        answers_to_apply gives it (whole, or a step at a time)."""
        worker = self._workers.get(result.worker_id)
        flight = worker.in_flight[0] if worker is not None and worker.in_flight else None
        if (
            worker is None
            or flight is None
            or result.scheduler_epoch != self.epoch
            or result.plan_id != flight.plan_id  # a worker answers its plans (and their steps) in order
        ):
            # (a late answer: of a worker given up and back, or to an earlier scheduler; rare, so
            # said at INFO: a late result of a worker this scheduler holds again passes the
            # worker's lease check, and is refused here)
            log.info("stale_result worker_id=%s plan_id=%d epoch=%s",
                     result.worker_id, result.plan_id, result.scheduler_epoch)
            return []
        steps = result.steps
        if steps > 1 and not self._applies_together(result):
            raise ValueError(f"the answer to plan {result.plan_id} is applied a step at a time (split_steps)")
        if result.cache_digest is not None and result.cache_digest != flight.cache_digest and not any(
                code == "cache_mismatch" for _, code, _ in result.errors):
            self._on_cache_digest_mismatch(worker, flight, result.cache_digest)
            return []
        flights = worker.in_flight[:steps]
        del worker.in_flight[:steps]
        steps_seconds = result.steps_seconds or [result.step_seconds]
        for seconds in steps_seconds:
            worker.measured_step(seconds)
        drafts = self._open_records(worker, flights, steps_seconds, self._clock())
        errors = None
        if result.errors:
            if self.prefix_caching and any(code in ("cache_mismatch", "out_of_memory") for _, code, _ in result.errors):
                # The worker dropped its cache (a mismatch) or requests it had blocks registered for (out
                # of memory): its cache and this copy may differ. It starts over, empty; its requests are
                # rebuilt, as they would be anyway (every item of such a plan is in error).
                log.warning("worker_cache_reset worker_id=%s plan_id=%d", worker.worker_id, flight.plan_id)
                self.reset_worker(worker.worker_id)
                return []
            errors = {handle: (code, message) for handle, code, message in result.errors}
        # Where each item's tokens are among the answer's (token_ids[begin : begin + count]), and the
        # output index the answer gives its first. Several steps: in item order, as _applies_together
        # checked. One step: in item order when the worker answered every item (most results), else
        # found by handle (an item without a token is in error or out of step: count 0).
        samples, ends = flight.samples, flight.ends
        handles, output_indexes = result.handles, result.output_indexes
        if steps > 1:
            counts = result.counts
            begins, total = [], 0
            for count in counts:
                begins.append(total)
                total += count
            answered_indexes = output_indexes
            unwritten = set(result.unwritten_tokens) if result.entries_written else None
        elif result.counts:  # one step where items kept proposed tokens: found by handle, each with its count
            position_of = {handle: position for position, handle in enumerate(handles)}
            starts, total = [], 0
            for count in result.counts:
                starts.append(total)
                total += count
            positions = [position_of.get(handle) if sample else None
                         for handle, sample in zip(flight.handles, samples or repeat(True))]
            begins = [None if position is None else starts[position] for position in positions]
            answered_indexes = [None if position is None else output_indexes[position] for position in positions]
            counts = [0 if position is None else result.counts[position] for position in positions]
            unwritten = set(result.unwritten_tokens) if result.entries_written else None
        else:
            if samples is None and handles == flight.handles:
                begins, answered_indexes = range(len(handles)), output_indexes
                counts = repeat(1)
            else:
                position_of = {handle: position for position, handle in enumerate(handles)}
                begins = [position_of.get(handle) if sample else None
                          for handle, sample in zip(flight.handles, samples or repeat(True))]
                answered_indexes = [None if begin is None else output_indexes[begin] for begin in begins]
                counts = [0 if begin is None else 1 for begin in begins]
            # (the worker wrote the entries of the requests it writes for, all but these handles')
            unwritten = None
            if result.entries_written:
                left_to_write = set(result.unwritten)
                unwritten = {position for position, handle in enumerate(handles) if handle in left_to_write} \
                    if left_to_write else set()
        outcomes: list[TokenOutcome] = []
        prefix_caching, block_size = self.prefix_caching, worker.kv_block_size
        stop_token_ids, logprobs, token_ids, left = self.stop_token_ids, result.logprobs, result.token_ids, flight.left
        for state, output_index, begin, count, answered_index, sample, end in zip(
                flight.states, flight.output_indexes, begins, counts, answered_indexes, samples or repeat(True),
                ends or repeat(0)):
            if left and state in left:
                continue  # finished, cancelled, preempted or moved while the plan was in flight
            if sample:  # (one sample in flight a step, however many tokens a verification made)
                state.in_flight_samples -= (count or 1) if steps > 1 else 1
            if errors is not None:
                error = errors.get(state.row)
                if error is not None:
                    self._on_item_error(worker, state, *error)
                    continue
            if not sample:  # a prompt's chunk short of its end: its KV up to `end` is written
                if prefix_caching and end // block_size > len(state.held_hashes):
                    self._register_blocks(worker, state, end)
                continue
            output = state.output_token_ids
            if steps == 1 and (count == 0 or answered_index != output_index or output_index != len(output)):
                if count and answered_index == output_index < len(output):
                    continue  # already have it
                got = None if count == 0 else (token_ids[begin], answered_index)
                self._on_item_error(worker, state, "bad_item",
                                    f"expected a token at output_index {output_index}, got (token, index) {got}")
                continue
            if state.drafts_in_flight:  # a verification: its last token and the proposals kept are in its KV
                if count > state.drafts_in_flight + 1:
                    self._on_item_error(worker, state, "bad_item", f"{count} tokens for {state.drafts_in_flight} "
                                                                   "proposals")
                    continue
                drafts[0].proposed_tokens += state.drafts_in_flight  # (an answer of one step: one record)
                drafts[0].accepted_tokens += count - 1
                self._verified(state, count - 1)
            elif steps == 1 and count > 1:
                self._on_item_error(worker, state, "bad_item", f"{count} tokens for an item of one")
                continue
            # Its tokens, up to one that ends it (a stop token, or the output limit: most end nothing)
            reason, ends_at = None, None
            if count == 1:
                token_id = token_ids[begin]
                output.append(token_id)
                applied = 1
                if token_id in stop_token_ids or len(output) >= state.output_limit:
                    reason = finish_reason(token_id, len(output), state.output_limit, stop_token_ids,
                                           state.sampling.ignore_eos)
                    ends_at = 0 if reason is not None else None
            else:
                tokens = token_ids[begin : begin + count]
                if not stop_token_ids.isdisjoint(tokens) or output_index + count >= state.output_limit:
                    for step, step_token in enumerate(tokens):
                        reason = finish_reason(step_token, output_index + step + 1, state.output_limit,
                                               stop_token_ids, state.sampling.ignore_eos)
                        if reason is not None:
                            ends_at, tokens = step, tokens[: step + 1]
                            break
                output.extend(tokens)
                applied = len(tokens)
            if prefix_caching:  # (its KV after its last token applied: the prompt and the outputs before)
                kv_end = state.prompt_length + output_index + applied - 1
                if kv_end // block_size > len(state.held_hashes):
                    self._register_blocks(worker, state, kv_end)
            if ends_at is not None:
                self._latest_draft[worker.worker_id] = drafts[ends_at if steps > 1 else 0]  # (the step it ended in)
                self._end(state, reason)
            elif unwritten is not None and state.workers_write and (
                    not unwritten or count == 1 and begin not in unwritten):
                continue  # its worker wrote every token's entry: nothing is left to do with them (most)
            for step in range(applied):
                position = begin + step
                written = unwritten is not None and state.workers_write and position not in unwritten
                step_reason = reason if step == ends_at else None
                if written and step_reason is None:
                    continue
                logprob, top = logprobs.get(position, (None, ())) if logprobs else (None, ())
                outcomes.append(TokenOutcome(state, token_ids[position], output_index + step, step_reason, logprob,
                                             top, written))
        self._latest_draft[worker.worker_id] = drafts[-1]
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
