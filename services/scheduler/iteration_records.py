"""The scheduler's iteration records (IterationRecord, shared/messages.py): what each worker-iteration
ran, who joined, finished, was cancelled or preempted, and when; the live page, the experiments and the
tests read them.

A record is drafted when the answer to its plan is applied (one per step of a plan of several), and its
`finished` may still grow after (stop strings are found by the service, after the answer); the
service takes the drafts whole with take_iteration_records. A request that leaves a worker between
two answers goes into that worker's next record.
"""

from dataclasses import dataclass, field

from services.scheduler.request_state import PlanInFlight, RequestState, WorkerState
from shared.messages import PROTOCOL_VERSION, IterationRow


@dataclass(eq=False)
class RecordDraft:
    """An IterationRecord whose `finished` may still grow (stop strings are found after on_result)."""

    in_flight: PlanInFlight
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished_at: float = 0.0
    step_seconds: float = 0.0
    proposed_tokens: int = 0  # speculative decoding: proposed in its items, and kept
    accepted_tokens: int = 0


class IterationRecords:
    """SchedulerPolicy's records (a mixin: the state is the policy's, made in its __init__:
    _iterations, _drafts, _latest_draft (each worker's latest answered record), _left_since_record
    (worker id -> the requests cancelled and preempted off it since its latest record))."""

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
                proposed_tokens=draft.proposed_tokens,
                accepted_tokens=draft.accepted_tokens,
            ))
        return records

    def _open_records(self, worker: WorkerState, flights: list[PlanInFlight], steps_seconds: list[float],
                      now: float) -> list[RecordDraft]:
        """The records of an answer's steps (one per plan in flight it answers, in order): the steps
        ran one after the other, the last just before the answer came, each after the one before
        (the first after the worker's previous answer); the requests that left the worker since its
        last record go into the first."""
        first = flights[0]
        first.started_at = max(first.started_at, worker.last_result_at)
        worker.last_result_at = now
        drafts: list[RecordDraft] = []
        finished_at = now - sum(steps_seconds)
        for flight, seconds in zip(flights, steps_seconds):
            if drafts:
                flight.started_at = drafts[-1].finished_at
            finished_at += seconds
            drafts.append(RecordDraft(flight, finished_at=max(finished_at, flight.started_at), step_seconds=seconds))
        left = self._left_since_record.pop(worker.worker_id, None)
        if left is not None:
            drafts[0].cancelled.extend(left[0])
            drafts[0].preempted.extend(left[1])
        self._drafts.extend(drafts)
        self._latest_draft[worker.worker_id] = drafts[-1]
        return drafts

    def _draft_with(self, state: RequestState) -> RecordDraft | None:
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
