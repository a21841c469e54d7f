"""Batch formation: the requests of a worker's next iteration, written into its plan.

Orca's Algorithm 1 for one worker: its running requests step first (decodes, then prefill chunks,
first come first served), within max_batch_tokens; each step's KV blocks are reserved, and when the
pool has too few the youngest running request is preempted (_make_room). Waiting requests join while
the batch has room (services/scheduler/placement.py). The plan is written as the wire's columns as
the requests are chosen (shared/plans.py ColumnPlan): the decodes fed by the worker (a plan in flight
samples their input) as a handle and an output index each, the other items with their tokens. With
scheduler_steps > 1 a plan whose every item samples runs several steps (_plan_steps), as many as
fit in plan_seconds of the worker's recent steps when that is set (_steps_for). With speculative
decoding, a decode whose last token is known may feed proposed tokens after it
(services/scheduler/speculation.py); such a plan runs one step.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.scheduler.request_state import PlanInFlight, RequestState, WorkerState
from services.scheduler.speculation import Speculation
from shared.messages import NewRequest
from shared.plans import ColumnPlan


@dataclass(eq=False)
class Batch:
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
    drafts: list[int] = field(default_factory=list)  # each one's proposed tokens (speculative decoding)

    def drop(self, state: RequestState) -> None:
        """A request leaves the batch being built (preempted to make room): its tokens go back."""
        chunk = self.chunks.pop(state.request_id, None)
        if chunk is not None:
            self.budget += chunk
        else:  # a decode written in already (older requests' prefill chunks make room after the decodes)
            for index, held in enumerate(self.fed_states):
                if held is state:
                    for column in (self.fed_states, self.fed_handles, self.fed_outputs, self.fed_starts):
                        del column[index]
                    self.budget += 1
                    self.decode_tokens -= 1
                    break
            for index, held in enumerate(self.states):
                if held is state:  # (a decode: its last token, and any proposals after it)
                    count, begin = self.counts[index], sum(self.counts[:index])
                    del self.tokens[begin : begin + count]
                    for column in (self.states, self.handles, self.starts, self.counts, self.samples, self.outputs,
                                   self.drafts):
                        del column[index]
                    self.budget += count
                    self.decode_tokens -= count
                    break
        if state.request_id in self.joined:
            self.joined.remove(state.request_id)
        if state.request_id in self.admitted:
            self.admitted.remove(state.request_id)


class BatchFormation(Speculation):
    """SchedulerPolicy's batch formation (a mixin: the state is the policy's, made in its __init__:
    its settings, _workers, _next_plan_id, _text_context, _clock)."""

    def _schedule_running(self, batch: Batch) -> None:
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
        speculating = self.speculative is not None and self._speculates_on(worker)
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
            # A verification in flight: how many tokens it makes is known only from its answer. A
            # request backed off from proposing sits out a plan now and then, to propose at the next.
            if in_flight and (state.drafts_in_flight or speculating and state.speculable
                              and self._waits_to_propose(state)):
                continue
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
            else:  # its input is its last token, named (and tokens it proposes after it)
                proposal = self._proposal(worker, state, computed, outputs, budget) \
                    if speculating and state.speculable else None
                if proposal:
                    budget -= len(proposal)
                    state.drafts_in_flight = len(proposal)
                    self._add_item(batch, state, computed, 1 + len(proposal), True, outputs,
                                   [state.output_token_ids[-1], *proposal], len(proposal))
                else:
                    self._add_item(batch, state, computed, 1, True, outputs, state.output_token_ids[-1:])
        batch.decode_tokens += batch.budget - budget
        batch.budget = budget
        if others:
            self._schedule_states(batch, others)

    def _schedule_states(self, batch: Batch, states: list[RequestState]) -> None:
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
    def _add_item(batch: Batch, state: RequestState, start: int, count: int, sample: bool, output_index: int,
                  tokens: Iterable[int], drafts: int = 0) -> None:
        """An item that names its tokens (not fed by the worker) into the plan being built (the last
        `drafts` of them proposed)."""
        batch.states.append(state)
        batch.handles.append(state.row)
        batch.starts.append(start)
        batch.counts.append(count)
        batch.samples.append(sample)
        batch.outputs.append(output_index)
        batch.tokens.extend(tokens)
        batch.drafts.append(drafts)

    def _make_room(self, batch: Batch, state: RequestState, tokens_after_step: int) -> bool:
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

    def _plan_steps(self, batch: Batch, most: int) -> list[int] | None:
        """A plan whose every item samples (decodes, and prompts whose last chunk it feeds), on a
        worker of one stage: each item's steps (most, fewer for a request that reaches its
        output limit sooner), their KV blocks reserved and their tokens counted in flight; None when
        it runs one step (a prefill chunk short of its prompt's end, or too few KV blocks free for the
        steps: nothing is preempted for them)."""
        worker = batch.worker
        if worker.stages > 1 or self.policy != "iteration" or not all(batch.samples) or any(batch.drafts):
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

    def _emit_plan(self, batch: Batch) -> ColumnPlan:
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
            drafts=batch.drafts if self.speculative is not None and any(batch.drafts) else (),
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

    def _new_request(self, worker: WorkerState, state: RequestState) -> NewRequest:
        """A request's data for a worker that does not hold it yet (with penalties or a constraint,
        the tokens of the cached blocks it starts with: they are part of the history its penalties
        count and its constraint replays, and are not fed; and where the worker's draft model
        proposes: the draft is fed them, its KV in those blocks not being the request's)."""
        cached_blocks = tuple(state.held_hashes[: state.adopted_blocks])
        history = state.sampling.needs_history or (state.speculable and self.speculative is not None
                                                   and self.speculative.proposed_by_worker)
        cached_token_ids = (state.tokens(0, len(cached_blocks) * worker.kv_block_size)
                            if cached_blocks and history else ())
        if not state.workers_write:
            return NewRequest(request_id=state.request_id, sampling=state.sampling, cached_blocks=cached_blocks,
                              cached_token_ids=cached_token_ids)
        outputs = state.output_token_ids
        return NewRequest(request_id=state.request_id, sampling=state.sampling, cached_blocks=cached_blocks,
                          cached_token_ids=cached_token_ids, entries_below=max(len(outputs), state.output_limit),
                          first_output_index=len(outputs),
                          text_context=self._text_context(state.prompt_token_ids, outputs))
