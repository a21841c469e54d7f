"""The worker's side of the plans: the handle table, and its answers.

A request is known to a worker by a small integer handle, given with its data the first time a plan
sends it there (shared/plans.py, the wire format); every later plan names only the handle.
PlanReader keeps the table (handle -> request id), starting over with a new scheduler epoch or a plan
that says free_all, and turns each plan read off the wire (read_plan, validated whole first) into a
BatchPlan of request ids. A plan naming a handle it does not hold gets an `unknown_request` error for
that item. A plan of several steps is run step by step (next_step), and StepAnswers gathers the steps'
outcomes into the one answer (pack_result).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate, repeat

from shared.messages import BatchPlan, StepItem, from_fields
from shared.plans import MAX_HANDLE, pack_result, read_plan


@dataclass(eq=False)
class DecodedPlan:
    """A plan as the worker reads it: the plan (items with request ids) and the handle of each item."""

    plan: BatchPlan
    item_handles: list[int]
    unknown: list[tuple[int, str]]  # (handle, message) of items naming a handle this worker does not hold
    answer_with_next: bool = False  # its result may wait for the next plan's, to go out with it
    # A plan of several steps (ColumnPlan.steps): which step this is (0: the plan as sent), how many
    # the plan runs and each item's (None: all `steps`).
    step: int = 0
    steps: int = 1
    item_steps: list[int] | None = None


class PlanReader:
    """The worker's handle table: plans from bytes (each item's request resolved from its handle)."""

    def __init__(self) -> None:
        self.epoch = ""
        self.last_plan_id = 0  # of this epoch: plan ids only grow within a scheduler's run
        self._request_of: dict[int, str] = {}
        self._handle_of: dict[str, int] = {}

    def handle_of(self, request_id: str) -> int | None:
        return self._handle_of.get(request_id)

    def decode(self, data: bytes, kv_length, worker_id: str) -> DecodedPlan | None:
        """kv_length(request_id): the worker's own KV length of a request, a decode item's start
        position (the item feeds the token the worker sampled last; the engine checks its index).
        A plan that does not read (WireError) or is for another worker changes nothing. A plan read
        before (the scheduler's Redis client resends a pipeline that failed half-way: its plans come
        twice) is None, before it changes anything: run twice, it would free handles since given to
        others and repeat prefix-cache commands."""
        wire = read_plan(data, worker_id)
        if wire.epoch == self.epoch and wire.plan_id <= self.last_plan_id:
            return None
        request_of, handle_of = self._request_of, self._handle_of
        if wire.epoch != self.epoch or wire.free_all:
            self.epoch = wire.epoch
            request_of.clear()
            handle_of.clear()
        # Read before the frees: a request may be registered and freed by one plan. A handle this
        # worker does not hold reads as "" (the worker finds its cache and the scheduler's differ).
        registered = [(request_of.get(handle, ""), index, block_hash) for handle, index, block_hash
                      in zip(wire.register_handles, wire.register_indexes, wire.register_hashes)]
        freed = []
        for handle in wire.free_handles:
            request_id = request_of.pop(handle, None)
            if request_id is not None:
                handle_of.pop(request_id, None)
                freed.append(request_id)
        for handle, request in wire.new:
            stale = request_of.get(handle)
            if stale is not None and stale != request.request_id:
                handle_of.pop(stale, None)
            request_of[handle] = request.request_id
            handle_of[request.request_id] = handle
        items, item_handles, unknown = [], [], []
        wire_steps = wire.item_steps
        item_steps = [] if wire_steps else None  # each decoded item's, where they differ
        for position, (handle, output_index) in enumerate(zip(wire.decode_handles, wire.decode_outputs)):
            request_id = request_of.get(handle)
            if request_id is None:
                unknown.append((handle, "a decode for a handle this worker does not hold"))
                continue
            if wire_steps:
                item_steps.append(wire_steps[position])
            items.append(from_fields(StepItem, (request_id, (), kv_length(request_id), True, output_index, True, 0)))
            item_handles.append(handle)
        token_list, decodes, drafts = wire.tokens, len(wire.decode_handles), wire.drafts
        for index, (handle, start, end, count, sample, output_index) in enumerate(zip(
                wire.handles, wire.starts, accumulate(wire.counts), wire.counts, wire.samples, wire.outputs)):
            request_id = request_of.get(handle)
            if request_id is None:
                unknown.append((handle, "an item for a handle this worker does not hold"))
                continue
            if wire_steps:
                item_steps.append(wire_steps[decodes + index])
            items.append(StepItem(request_id=request_id, token_ids=tuple(token_list[end - count : end]),
                                  start_position=start, sample=bool(sample), output_index=output_index,
                                  draft_tokens=drafts[index] if drafts else 0))
            item_handles.append(handle)
        self.last_plan_id = wire.plan_id + wire.steps - 1  # (the later steps' results answer the ids after it)
        plan = BatchPlan(scheduler_epoch=wire.epoch, plan_id=wire.plan_id, worker_id=worker_id,
                         new_requests=tuple(request for _, request in wire.new), items=tuple(items),
                         free_request_ids=tuple(freed), free_all=wire.free_all, register_blocks=tuple(registered),
                         evict_blocks=wire.evict_hashes)
        return DecodedPlan(plan, item_handles, unknown, wire.answer_with_next, steps=wire.steps, item_steps=item_steps)

    @staticmethod
    def next_step(decoded: DecodedPlan, kv_length) -> DecodedPlan | None:
        """A plan of several steps: its next step, once the step before has run (None after its last):
        the items that run it, each a decode feeding the token it sampled in the step before
        (kv_length as for decode), under the next plan id; its unknown handles were answered with
        the first step. (The plan's answer holds every step's: StepAnswers.)"""
        step = decoded.step + 1
        if step >= decoded.steps:
            return None
        plan, item_steps = decoded.plan, decoded.item_steps
        kept = [(item, handle) for item, handle, count in zip(plan.items, decoded.item_handles,
                                                              item_steps or repeat(decoded.steps)) if count > step]
        items = tuple([from_fields(StepItem, (item.request_id, (), kv_length(item.request_id), True,
                                              item.output_index + 1, True, 0)) for item, _ in kept])
        return DecodedPlan(
            BatchPlan(scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id + 1, worker_id=plan.worker_id,
                      items=items),
            [handle for _, handle in kept], [], decoded.answer_with_next, step=step, steps=decoded.steps,
            item_steps=None if item_steps is None else [count for count in item_steps if count > step])

    def encode_result(self, decoded: DecodedPlan, tokens: dict[str, int], logprobs: dict[str, tuple[float, tuple]],
                      errors: list[tuple[str, str, str]], kv_blocks_total: int, kv_blocks_free: int,
                      step_seconds: float, kv_blocks_cached: int = 0,
                      unwritten: Iterable[str] | None = None, cache_digest: int = 0) -> bytes:
        """The answer to a plan of one step (StepAnswers: of any), as StepAnswers.add takes it."""
        answers = StepAnswers(self)
        answers.add(decoded, tokens, logprobs, errors, step_seconds, unwritten)
        return answers.packed(kv_blocks_total, kv_blocks_free, kv_blocks_cached, cache_digest)


class StepAnswers:
    """A plan's answer, gathered as its steps run (one, or several: PlanReader.next_step) and packed
    as one result (shared/plans.py ResultColumns says how one of several steps reads): each item's
    tokens in order from the first step, until a step it has no token in (an error)."""

    def __init__(self, reader: PlanReader) -> None:
        self.reader = reader
        self._first: DecodedPlan | None = None
        self._slot_of: dict[int, int] = {}  # handle -> its slot: its place among the answer's items
        self._open: list[bool] = []  # each slot: answered every step so far
        self.handles: list[int] = []
        self.first_indexes: list[int] = []
        self.tokens: list[list[int]] = []  # each slot's
        self.logprobs: list[tuple[int, int, float, list]] = []  # (slot, its token's, logprob, top)
        self.unwritten: list[tuple[int, int]] = []  # (slot, its token's)
        self.entries_written = False
        self.errors: list[list] = []
        self._erred: set[int] = set()  # handles answered with an error
        self.seconds: list[float] = []

    def add(self, decoded: DecodedPlan, tokens: dict[str, int], logprobs: dict[str, tuple[float, tuple]],
            errors: list[tuple[str, str, str]], step_seconds: float, unwritten: Iterable[str] | None = None,
            speculated: dict[str, list[int]] | None = None) -> None:
        """A step's outcome: tokens: request id -> token sampled; logprobs: request id -> (logprob,
        top); errors: (request id, code, message) of the items that did not run; unwritten: None when
        this worker wrote no token entry, else the requests whose token entries it was to write and
        did not (a dict: from which of the request's tokens this step on, for a speculating one);
        speculated: request id -> every token a speculating item kept (its first is in tokens)."""
        first = self._first is None
        if first:
            self._first = decoded
        slot_of, is_open = self._slot_of, self._open
        for (request_id, _, _, _, output_index, _, _), handle in zip(decoded.plan.items, decoded.item_handles):
            token = tokens.get(request_id)
            slot = slot_of.get(handle)
            if token is None or not (first or slot is not None and is_open[slot]):
                if slot is not None:
                    is_open[slot] = False  # (its tokens stop at the step before)
                continue
            if slot is None:
                slot = slot_of[handle] = len(self.handles)
                self.handles.append(handle)
                self.first_indexes.append(output_index)
                self.tokens.append([])
                is_open.append(True)
            kept = speculated.get(request_id) if speculated else None
            if kept is not None:  # (one step, whose item kept proposals: every token, the first unwritten on)
                first_unwritten = len(kept)
                if unwritten and request_id in unwritten:
                    first_unwritten = unwritten[request_id] if isinstance(unwritten, dict) else 0
                self.unwritten += [(slot, at) for at in range(first_unwritten, len(kept))]
                self.tokens[slot] += kept
                continue
            if unwritten and request_id in unwritten:
                self.unwritten.append((slot, len(self.tokens[slot])))
            if logprobs and request_id in logprobs:
                logprob, top = logprobs[request_id]
                self.logprobs.append((slot, len(self.tokens[slot]), logprob, [list(pair) for pair in top]))
            self.tokens[slot].append(token)
        for request_id, code, message in errors:
            handle = self.reader.handle_of(request_id)
            handle = MAX_HANDLE if handle is None else handle
            if handle not in self._erred:  # (the first error of an item: its later steps had nothing to feed)
                self._erred.add(handle)
                self.errors.append([handle, code, message])
        if first:
            self.errors += [[handle, "unknown_request", message] for handle, message in decoded.unknown]
        self.entries_written = self.entries_written or unwritten is not None
        self.seconds.append(step_seconds)

    @property
    def plan(self) -> BatchPlan:
        """The plan answered (as its first step runs it)."""
        return self._first.plan

    def packed(self, kv_blocks_total: int, kv_blocks_free: int, kv_blocks_cached: int = 0,
               cache_digest: int = 0) -> bytes:
        """The result on the wire (after the plan's last step: the KV figures are its)."""
        plan = self.plan
        return pack_result(plan.scheduler_epoch, plan.plan_id, plan.worker_id, self.handles, self.first_indexes,
                           self.tokens, self.errors, self.seconds, self.logprobs,
                           self.unwritten if self.entries_written else None, kv_blocks_total, kv_blocks_free,
                           kv_blocks_cached, cache_digest)
