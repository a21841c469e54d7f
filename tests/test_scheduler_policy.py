"""SchedulerPolicy: iteration-level scheduling bookkeeping, without Redis (services/scheduler/policy.py)."""

import dataclasses
import logging
from collections import defaultdict

import pytest

from services.bench.by_request_id import apply_result
from services.scheduler.policy import SchedulerPolicy
from shared import cache_digest
from shared.messages import BatchPlan, ItemError, PlanResult, RequestRecord, SampledToken, SamplingParams
from services.worker.plan_reader import DecodedPlan, PlanReader, StepAnswers
from shared.plans import read_result, read_result_columns

EPOCH = "epoch-test"
STOP_TOKENS = {0, 2}


def record(request_id: str, prompt_len: int = 4, arrival: float = 0.0, *, max_tokens: int = 16,
           ignore_eos: bool = False, first_token: int = 100) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        prompt_token_ids=tuple(range(first_token, first_token + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        arrival_time=arrival,
    )


def token_for(request_id: str, output_index: int) -> int:
    """What the fake model samples: a function of the request and the position only (seeded sampling)."""
    return 17 + (sum(map(ord, request_id)) * 7 + output_index) % 90


def make_policy(**options) -> SchedulerPolicy:
    options.setdefault("context_length", 8192)
    options.setdefault("stop_token_ids", STOP_TOKENS)
    return SchedulerPolicy(EPOCH, **options)


def answer(plan: BatchPlan, token=token_for, errors: tuple[ItemError, ...] = (),
           step_seconds: float = 0.001) -> PlanResult:
    failed = {error.request_id for error in errors}
    return PlanResult(
        scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id, worker_id=plan.worker_id,
        tokens=tuple(SampledToken(request_id=item.request_id, token_id=token(item.request_id, item.output_index),
                                  output_index=item.output_index)
                     for item in plan.items if item.sample and item.request_id not in failed),
        errors=errors, kv_blocks_total=0, kv_blocks_free=0, step_seconds=step_seconds,
    )


def row_disagreements(policy: SchedulerPolicy) -> list[str]:
    """Where a worker's rows (services/scheduler/running_rows.py) and its running requests differ:
    none, or the bookkeeping is broken (checked after every result)."""
    found = []
    for worker_id in policy.worker_ids:
        worker = policy.worker(worker_id)
        rows, running = worker.rows, worker.running
        order = [state.request_id for state in rows.order]
        if sorted(order) != sorted(running):
            found.append(f"{worker_id}: rows hold {sorted(order)}, the worker runs {sorted(running)}")
        if [state.fcfs_key for state in rows.order] != sorted(state.fcfs_key for state in rows.order):
            found.append(f"{worker_id}: rows out of FCFS order")
        found += [f"{worker_id}: {state.request_id}: row {state.row} holds another" for state in rows.order
                  if not 0 <= state.row < len(rows.states) or rows.states[state.row] is not state]
        found += [f"{worker_id}: row {row} held by {state.request_id}, not running"
                  for row, state in enumerate(rows.states) if state is not None and state not in rows.order]
    return found


class FakeWorker:
    """Mirrors what a worker holds, and checks every plan against it: a plan that feeds the wrong
    tokens, at the wrong position, or for a request it never got, fails the test."""

    def __init__(self, prompts: dict[str, tuple[int, ...]], token=token_for, unwritten_at=None,
                 step_seconds: float = 0.001) -> None:
        self.prompts = prompts
        self.step_seconds = step_seconds  # how long it says each step took
        self.token = token
        # (request id, output index) -> whether that token's entry is left to the scheduler; given,
        # the worker writes the others' (PlanResult.entries_written), as a worker told to by the plans
        self.unwritten_at = unwritten_at
        self.kv: dict[str, list[int]] = {}
        self.known: set[str] = set()
        self.last_sampled: dict[str, tuple[int, int]] = {}  # request id -> (output_index, token)
        self.sampled_count: dict[str, int] = defaultdict(int)  # tokens sampled per request, wasted ones too
        self.steps_run: list[int] = []  # each plan's steps (scheduler_steps), as run_all ran them
        self.registered: list[tuple[str, int, bytes]] = []  # the prefix-cache blocks plans registered
        self.cache_digest = 0  # of the blocks registered and not evicted, as a worker reports it

    def run(self, plan: BatchPlan) -> PlanResult:
        self.registered.extend(plan.register_blocks)
        self.cache_digest = cache_digest.after_plan(self.cache_digest, plan)
        for request_id in plan.free_request_ids:
            self.kv.pop(request_id, None)
            self.known.discard(request_id)
            self.last_sampled.pop(request_id, None)
        self.known.update(new.request_id for new in plan.new_requests)
        # (prefix caching: a request sent with cached blocks starts after them, its KV that far there)
        adopting = {new.request_id for new in plan.new_requests if new.cached_blocks}
        for item in plan.items:
            assert item.request_id in self.known, f"{item.request_id} stepped before its NewRequest was sent"
            held = self.kv.setdefault(item.request_id, [])
            if item.start_position == 0:
                held.clear()
            elif item.request_id in adopting:
                held[:] = self.prompts[item.request_id][: item.start_position]
            assert item.start_position == len(held), f"{item.request_id}: start {item.start_position}, KV {len(held)}"
            if item.feeds_sampled:
                assert item.token_ids == () and item.sample
                index, token = self.last_sampled[item.request_id]
                assert index == item.output_index - 1, f"{item.request_id}: feeds {index}, samples {item.output_index}"
                held.append(token)
            else:
                held.extend(item.token_ids)
            expected = list(self.prompts[item.request_id]) + [
                self.token(item.request_id, index) for index in range(len(held) - len(self.prompts[item.request_id]))]
            assert held == expected[: len(held)], f"{item.request_id}: KV holds the wrong tokens"
            if item.sample:
                assert item.output_index == len(held) - len(self.prompts[item.request_id])
                self.last_sampled[item.request_id] = (item.output_index, self.token(item.request_id, item.output_index))
                self.sampled_count[item.request_id] += 1
        result = dataclasses.replace(answer(plan, self.token, step_seconds=self.step_seconds),
                                     cache_digest=self.cache_digest)
        if self.unwritten_at is None:
            return result
        return dataclasses.replace(result, entries_written=True, unwritten=frozenset(
            token.request_id for token in result.tokens if self.unwritten_at(token.request_id, token.output_index)))

    def run_all(self, plan, together: bool = True) -> list:
        """A plan and, for a plan of several steps (scheduler_steps), each later step as the worker
        derives it (PlanReader.next_step: the items that run it, as decodes feeding the token each
        sampled, at the next output index). Its answer as the worker's: one for all its steps
        (StepAnswers, read as the scheduler reads it); together False: a PlanResult for every step."""
        step = DecodedPlan(plan, [*plan.decode_handles, *plan.handles], [], steps=plan.steps,
                           item_steps=list(plan.item_steps) or None)
        self.steps_run.append(plan.steps)
        answers, results = StepAnswers(PlanReader()), []
        while step is not None:
            result = self.run(step.plan)
            answers.add(step, {token.request_id: token.token_id for token in result.tokens}, {},
                        [(error.request_id, error.code, error.message) for error in result.errors],
                        result.step_seconds, result.unwritten if result.entries_written else None)
            results.append(result)
            step = PlanReader.next_step(step, lambda request_id: len(self.kv[request_id]))
        if not together:
            return results
        return [read_result_columns(read_result(answers.packed(0, 0, 0, self.cache_digest))[1])]


def collect(outcomes, outputs: dict[str, list[int]], reasons: dict[str, str], seen: list | None = None) -> None:
    for outcome in outcomes:
        if seen is not None:
            seen.append((outcome.request_id, outcome.output_index, outcome.token_id, outcome.finish_reason,
                         outcome.written))
        output = outcome.request.output_token_ids  # (an answer of several steps: several tokens of a request)
        assert outcome.output_index < len(output) and output[outcome.output_index] == outcome.token_id
        outputs[outcome.request_id].append(outcome.token_id)
        if outcome.finish_reason:
            reasons[outcome.request_id] = outcome.finish_reason


def drive(policy: SchedulerPolicy, workers: dict[str, FakeWorker], max_rounds: int = 500):
    """Run every worker's iterations until no request is left; returns outputs and finish reasons."""
    outputs: dict[str, list[int]] = defaultdict(list)
    reasons: dict[str, str] = {}
    plans: list[BatchPlan] = []
    for _ in range(max_rounds):
        if policy.waiting_count + policy.running_count == 0:
            return outputs, reasons, plans
        for worker_id, worker in workers.items():
            plan = policy.next_plan(worker_id)
            if plan is None:
                continue
            plans.append(plan)
            collect(apply_result(policy, worker.run(plan)), outputs, reasons)
            assert row_disagreements(policy) == []
        for state in policy.take_finished_without_token():
            reasons[state.request_id] = state.finish_reason
    raise AssertionError("requests did not finish")


def drive_pipelined(policy: SchedulerPolicy, workers: dict[str, FakeWorker], max_rounds: int = 2000,
                    sent: dict[str, list[BatchPlan]] | None = None, together: bool = True,
                    seen: list | None = None):
    """Like drive, but every worker takes as many plans as the policy sends (pipeline_depth) and
    answers its oldest one per round, as a real worker runs its plan stream in order.
    sent: plans already sent to a worker and not answered yet; together: FakeWorker.run_all's; seen:
    every outcome, as collect notes them."""
    outputs: dict[str, list[int]] = defaultdict(list)
    reasons: dict[str, str] = {}
    queued: dict[str, list[BatchPlan]] = {worker_id: list((sent or {}).get(worker_id, ())) for worker_id in workers}
    depth_seen = 0
    for _ in range(max_rounds):
        if policy.waiting_count + policy.running_count == 0:
            return outputs, reasons, depth_seen
        for worker_id, worker in workers.items():
            while (plan := policy.next_plan(worker_id)) is not None:
                queued[worker_id].append(plan)
            depth_seen = max(depth_seen, len(queued[worker_id]))
            if queued[worker_id]:
                for result in worker.run_all(queued[worker_id].pop(0), together):
                    # (as the service applies an answer: a plan of several steps whole, or a step at a time)
                    for answer in policy.answers_to_apply(result) if together else [result]:
                        collect(apply_result(policy, answer), outputs, reasons, seen)
                        assert row_disagreements(policy) == []
        for state in policy.take_finished_without_token():
            reasons[state.request_id] = state.finish_reason
    raise AssertionError("requests did not finish")


def expected_output(request_id: str, count: int) -> list[int]:
    return [token_for(request_id, index) for index in range(count)]


def test_fcfs_order_by_arrival_time():
    policy = make_policy(max_batch_size=2)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("late", arrival=3.0))
    policy.add_request(record("first", arrival=1.0))
    policy.add_request(record("second", arrival=2.0))
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["first", "second"]
    assert [new.request_id for new in plan.new_requests] == ["first", "second"]
    assert policy.waiting_count == 1


def test_max_batch_size_and_token_budget_limit_a_batch():
    policy = make_policy(max_batch_size=3, max_batch_tokens=10)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    for index in range(5):
        policy.add_request(record(f"r{index}", prompt_len=4, arrival=index))
    plan = policy.next_plan("w1")
    # 4 + 4 tokens, then the third request gets the 2 tokens left: a chunk that does not sample.
    assert [(item.request_id, len(item.token_ids), item.sample) for item in plan.items] == [
        ("r0", 4, True), ("r1", 4, True), ("r2", 2, False)]
    assert sum(len(item.token_ids) for item in plan.items) <= 10
    apply_result(policy, answer(plan))
    plan = policy.next_plan("w1")
    # Decodes first, then the rest of r2's prompt; no fourth request: the batch is full.
    assert [(item.request_id, item.start_position, len(item.token_ids), item.sample) for item in plan.items] == [
        ("r0", 4, 1, True), ("r1", 4, 1, True), ("r2", 2, 2, True)]


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_its_last_chunk():
    policy = make_policy(max_batch_tokens=10)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    long = record("long", prompt_len=25, max_tokens=2)
    policy.add_request(long)
    fed = []
    for expected_start, expected_len, expected_sample in [(0, 10, False), (10, 10, False), (20, 5, True)]:
        plan = policy.next_plan("w1")
        (item,) = plan.items
        step = (item.start_position, len(item.token_ids), item.sample)
        assert step == (expected_start, expected_len, expected_sample)
        assert item.output_index == 0
        fed.extend(item.token_ids)
        outcomes = apply_result(policy, answer(plan))
        assert len(outcomes) == (1 if expected_sample else 0)
    assert tuple(fed) == long.prompt_token_ids
    plan = policy.next_plan("w1")
    assert [(item.start_position, item.token_ids, item.output_index) for item in plan.items] == [
        (25, (token_for("long", 0),), 1)]


def test_prefill_and_decode_share_a_batch_and_output_index_counts_up():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("a", prompt_len=3, arrival=0, max_tokens=4))
    plan = policy.next_plan("w1")
    assert [item.output_index for item in plan.items] == [0]
    apply_result(policy, answer(plan))
    policy.add_request(record("b", prompt_len=5, arrival=1))
    plan = policy.next_plan("w1")
    assert [(item.request_id, len(item.token_ids), item.output_index) for item in plan.items] == [
        ("a", 1, 1), ("b", 5, 0)]
    apply_result(policy, answer(plan))
    plan = policy.next_plan("w1")
    assert [(item.request_id, item.start_position, item.output_index) for item in plan.items] == [
        ("a", 4, 2), ("b", 5, 1)]
    assert plan.new_requests == ()  # sampling parameters cross the wire once


def test_finished_request_leaves_and_a_waiting_one_joins_at_the_next_plan():
    policy = make_policy(max_batch_size=2)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("short", arrival=0, max_tokens=1))
    policy.add_request(record("long", arrival=1, max_tokens=5))
    policy.add_request(record("next", arrival=2))
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["short", "long"]
    outcomes = apply_result(policy, answer(plan))
    assert {outcome.request_id: outcome.finish_reason for outcome in outcomes} == {"short": "length", "long": None}
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["long", "next"]
    assert plan.free_request_ids == ("short",)
    assert [new.request_id for new in plan.new_requests] == ["next"]
    records = policy.take_iteration_records()
    assert [(record.request_ids, record.joined, record.finished) for record in records] == [
        (("short", "long"), ("short", "long"), ("short",))]


def test_iteration_records_say_which_requests_were_cancelled_or_preempted_off_the_worker():
    """A cancel while the worker's latest record is still open goes into it; one that comes after
    the record was written goes into the worker's next one (the live page shows both)."""
    policy = make_policy(max_batch_size=4)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    for index, name in enumerate(("a", "b", "c")):
        policy.add_request(record(name, arrival=index, max_tokens=8))
    plan = policy.next_plan("w1")
    apply_result(policy, answer(plan))
    policy.cancel("a")  # the record of this iteration is still open
    [first] = policy.take_iteration_records()
    assert (first.cancelled, first.finished) == (("a",), ())
    plan = policy.next_plan("w1")
    policy.cancel("b")  # its latest record is written: the next one says it
    apply_result(policy, answer(plan))
    [second] = policy.take_iteration_records()
    assert second.cancelled == ("b",) and second.finished == () and second.preempted == ()


def _long_and_short_requests(policy_name: str):
    policy = make_policy(policy=policy_name, max_batch_size=2)
    policy.worker_up("w1", kv_blocks_total=1000, kv_block_size=4)
    prompts = {}
    for index, (name, max_tokens) in enumerate([("long", 12), ("s1", 2), ("s2", 2), ("s3", 2), ("s4", 2)]):
        policy.add_request(rec := record(name, arrival=index, max_tokens=max_tokens))
        prompts[name] = rec.prompt_token_ids
    worker = FakeWorker(prompts)
    finished_at, started_at = {}, {}
    for iteration in range(100):
        plan = policy.next_plan("w1")
        if plan is None:
            break
        for item in plan.items:
            started_at.setdefault(item.request_id, iteration)
        for outcome in apply_result(policy, worker.run(plan)):
            if outcome.finish_reason:
                finished_at[outcome.request_id] = iteration
    assert set(finished_at) == set(prompts), "every request finishes"
    return started_at, finished_at


def test_iteration_policy_lets_short_requests_come_and_go_while_a_long_one_runs():
    started_at, finished_at = _long_and_short_requests("iteration")
    for short in ("s1", "s2", "s3", "s4"):
        assert finished_at[short] < finished_at["long"], f"{short} waited for the long request"
    assert started_at["s2"] == finished_at["s1"] + 1, "s2 joins at the iteration after s1 finished"


def test_request_policy_admits_nobody_until_the_whole_batch_is_done():
    started_at, finished_at = _long_and_short_requests("request")
    assert finished_at["s1"] < finished_at["long"]
    for later in ("s2", "s3", "s4"):
        assert started_at[later] > finished_at["long"], f"{later} joined a batch that was still running"


def test_no_admission_without_kv_room():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=4, kv_block_size=4)
    policy.add_request(record("big", prompt_len=12, arrival=0, max_tokens=1))  # 3 blocks
    policy.add_request(record("other", prompt_len=8, arrival=1, max_tokens=1))  # 2 blocks: 1 left
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["big"]
    assert policy.worker("w1").kv_blocks_free == 1
    apply_result(policy, answer(plan))  # big finishes (max_tokens=1)
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["other"]
    assert plan.free_request_ids == ("big",)


def old_and_young_in_a_full_cache(**options):
    """A worker of 4 blocks of 4 tokens and two requests of 7-token prompts (2 blocks each)."""
    policy = make_policy(**options)
    policy.worker_up("w1", kv_blocks_total=4, kv_block_size=4)
    old = record("old", prompt_len=7, arrival=0, max_tokens=6)
    young = record("young", prompt_len=7, arrival=1, max_tokens=3)
    policy.add_request(old)
    policy.add_request(young)
    return policy, young, FakeWorker({"old": old.prompt_token_ids, "young": young.prompt_token_ids})


def test_kv_full_preempts_the_youngest_which_is_rebuilt_with_the_same_output():
    policy, young, worker = old_and_young_in_a_full_cache()
    plan = policy.next_plan("w1")  # 2 blocks each: the cache is full
    assert len(plan.items) == 2
    apply_result(policy, worker.run(plan))
    plan = policy.next_plan("w1")  # both feed position 7: still 2 blocks each
    assert len(plan.items) == 2
    apply_result(policy, worker.run(plan))
    plan = policy.next_plan("w1")  # position 8 needs a third block: the youngest makes room
    assert [item.request_id for item in plan.items] == ["old"]
    assert plan.free_request_ids == ("young",)
    young_state = policy.get("young")
    assert (young_state.status, young_state.worker_id, young_state.computed) == ("waiting", None, 0)
    assert len(young_state.output_token_ids) == 2, "a preempted request keeps its output"
    apply_result(policy, worker.run(plan))
    outputs, reasons, plans = drive(policy, {"w1": worker})
    rebuild = next(item for plan in plans for item in plan.items if item.request_id == "young")
    assert rebuild.start_position == 0
    assert rebuild.token_ids == young.prompt_token_ids + tuple(expected_output("young", 2))
    assert rebuild.output_index == 2
    assert outputs["young"] == expected_output("young", 3)[2:]
    assert reasons == {"old": "length", "young": "length"}


def test_a_plan_runs_several_steps_only_within_free_kv_blocks_and_preempts_nobody_for_them():
    """scheduler_steps: a plan's later steps need KV blocks of their own; when they are not free the
    plan runs one step (the preemption a step needs happens as without steps, never one for more)."""
    policy, _, worker = old_and_young_in_a_full_cache(scheduler_steps=4)
    plans = []
    for _ in range(2):  # 2 blocks each (the cache full), 3 each for 3 more steps: one step each time
        plans.append(policy.next_plan("w1"))
        for result in worker.run_all(plans[-1]):
            apply_result(policy, result)
    assert [(plan.steps, len(plan.items), plan.free_request_ids) for plan in plans] == [(1, 2, ()), (1, 2, ())]
    plan = policy.next_plan("w1")  # position 8 needs a third block: the youngest makes room, as before
    assert [item.request_id for item in plan.items] == ["old"] and plan.free_request_ids == ("young",)
    assert plan.steps == 4, "alone, the old one's 3 blocks hold its next 4 tokens (its last 4: max_tokens 6)"
    outputs, reasons = defaultdict(list), {}
    for result in worker.run_all(plan):
        collect(apply_result(policy, result), outputs, reasons)
    assert outputs["old"] == expected_output("old", 6)[2:] and reasons == {"old": "length"}
    rest, reasons, _ = drive_pipelined(policy, {"w1": worker})
    assert rest["young"] == expected_output("young", 3)[2:] and reasons == {"young": "length"}
    assert policy.worker("w1").kv_blocks_reserved == 0


def test_kv_cache_full_error_from_the_worker_requeues_the_request():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("a", arrival=0))
    policy.add_request(record("b", arrival=1))
    plan = policy.next_plan("w1")
    error = ItemError(request_id="b", code="kv_cache_full", message="no blocks")
    outcomes = apply_result(policy, answer(plan, errors=(error,)))
    assert [outcome.request_id for outcome in outcomes] == ["a"]
    assert policy.get("b").status == "waiting"
    plan = policy.next_plan("w1")
    assert "b" in plan.free_request_ids
    assert "b" not in [item.request_id for item in plan.items], "not re-admitted in the plan that frees it"
    apply_result(policy, answer(plan))
    plan = policy.next_plan("w1")
    assert [(item.request_id, item.start_position) for item in plan.items if item.request_id == "b"] == [("b", 0)]
    assert "b" in [new.request_id for new in plan.new_requests]


def two_requests_running_on_w1(max_tokens: int, steps: int):
    """r0 and r1 after `steps` iterations on worker w1; returns the policy, their prompts and w1."""
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    prompts = {}
    for index in range(2):
        policy.add_request(rec := record(f"r{index}", arrival=index, max_tokens=max_tokens))
        prompts[rec.request_id] = rec.prompt_token_ids
    w1 = FakeWorker(prompts)
    for _ in range(steps):
        apply_result(policy, w1.run(policy.next_plan("w1")))
    return policy, prompts, w1


def test_worker_down_moves_its_requests_to_another_worker_rebuilt_from_prompt_and_output():
    policy, prompts, _ = two_requests_running_on_w1(max_tokens=5, steps=3)
    in_flight = policy.next_plan("w1")  # a plan in flight when w1 dies is abandoned
    policy.worker_up("w2", kv_blocks_total=100, kv_block_size=4)
    assert sorted(policy.worker_down("w1")) == ["r0", "r1"]
    for request_id in prompts:
        state = policy.get(request_id)
        assert (state.status, state.worker_id, state.computed) == ("waiting", None, 0)
        assert len(state.output_token_ids) == 3
    assert apply_result(policy, answer(in_flight)) == [], "the dead worker's result is ignored"
    plan = policy.next_plan("w2")
    assert [new.request_id for new in plan.new_requests] == ["r0", "r1"]
    for item in plan.items:
        assert item.start_position == 0 and item.sample and item.output_index == 3
        assert item.token_ids == prompts[item.request_id] + tuple(expected_output(item.request_id, 3))
    w2 = FakeWorker(prompts)
    apply_result(policy, w2.run(plan))
    outputs, reasons, _ = drive(policy, {"w2": w2})
    assert {request_id: len(tokens) for request_id, tokens in outputs.items()} == {"r0": 1, "r1": 1}
    assert reasons == {"r0": "length", "r1": "length"}


def test_a_worker_given_up_on_that_comes_back_frees_what_it_held():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("r0", arrival=0, max_tokens=5))
    first = policy.next_plan("w1")
    assert first.free_all, "a worker's first plan drops whatever it held before"
    apply_result(policy, answer(first))
    later = policy.next_plan("w1")
    assert not later.free_all
    apply_result(policy, answer(later))
    policy.worker_down("w1")  # e.g. its heartbeats were lost while Redis restarted
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    plan = policy.next_plan("w1")
    assert plan.free_all, "it may still hold r0's KV: its first plan back drops it"
    assert [(item.request_id, item.start_position, item.output_index) for item in plan.items] == [("r0", 0, 2)]
    apply_result(policy, answer(plan))
    assert not policy.next_plan("w1").free_all


def test_a_request_whose_workers_keep_dying_fails_instead_of_taking_down_the_next():
    """A request that breaks every engine it runs on (a poison pill): after MAX_WORKERS_LOST workers
    died under it, it fails; another request that lived through fewer deaths goes on."""
    from services.scheduler.policy import MAX_WORKERS_LOST

    policy = make_policy()
    policy.add_request(record("pill", arrival=0, max_tokens=50))
    for death in range(MAX_WORKERS_LOST):
        worker_id = f"w{death}"
        policy.worker_up(worker_id, kv_blocks_total=100, kv_block_size=4)
        if death == MAX_WORKERS_LOST - 1:
            policy.add_request(record("bystander", arrival=1, max_tokens=3))
        plan = policy.next_plan(worker_id)
        assert "pill" in [item.request_id for item in plan.items]
        policy.worker_down(worker_id)
    assert policy.get("pill") is None, "the request that took three workers down still runs"
    failed = policy.take_finished_without_token()
    assert [(state.request_id, state.finish_reason) for state in failed] == [("pill", "error")]
    assert policy.get("bystander") is not None and policy.get("bystander").status == "waiting"


def test_new_requests_are_spread_over_idle_workers_by_free_kv():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.worker_up("w2", kv_blocks_total=100, kv_block_size=4)
    for index in range(4):
        policy.add_request(record(f"r{index}", arrival=index))
    first = policy.next_plan("w1")
    second = policy.next_plan("w2")
    assert [item.request_id for item in first.items] == ["r0", "r2"]
    assert [item.request_id for item in second.items] == ["r1", "r3"]


def test_an_idle_worker_with_room_does_not_leave_requests_to_a_busy_one():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.worker_up("w2", kv_blocks_total=200, kv_block_size=4)
    policy.add_request(record("r0", arrival=0))
    busy = policy.next_plan("w2")
    assert [item.request_id for item in busy.items] == ["r0"]
    policy.add_request(record("r1", arrival=1))
    assert policy.next_plan("w2") is None, "one plan in flight per worker"
    plan = policy.next_plan("w1")  # w2 has more free KV but is busy
    assert [item.request_id for item in plan.items] == ["r1"]


def test_a_planning_worker_does_not_take_every_waiting_request_from_a_busy_less_loaded_one():
    """Eleven requests arrive while w1 runs one with a plan in flight: w2 takes only its share (the
    least loaded by running requests), the rest wait for w1's next plan, so a burst is spread."""
    policy = make_policy(pipeline_depth=2)
    policy.worker_up("w1", kv_blocks_total=200, kv_block_size=4)
    policy.worker_up("w2", kv_blocks_total=200, kv_block_size=4)
    policy.add_request(record("first", arrival=0))
    assert [item.request_id for item in policy.next_plan("w1").items] == ["first"]
    for index in range(11):
        policy.add_request(record(f"r{index}", arrival=1 + index))
    taken = [item.request_id for item in policy.next_plan("w2").items]
    assert len(taken) == 6, taken  # 6 here, 5 meant for w1 (which runs one): 6 and 6
    joined = [item.request_id for item in policy.next_plan("w1").items if item.request_id != "first"]
    assert sorted(taken + joined) == sorted(f"r{index}" for index in range(11)), (taken, joined)


def test_a_worker_answering_plans_in_pairs_takes_plans_only_where_a_whole_pair_fits():
    """answer_every 2 with 4 plans in flight: a worker is idle with room for a pair (it answers two
    plans with one write, so a single free place would wait for the pair's other half); a worker of
    pipeline stages answers each plan and takes them one by one."""
    policy = make_policy(pipeline_depth=4, answer_every=2)
    policy.worker_up("w1", kv_blocks_total=200, kv_block_size=4)
    policy.worker_up("staged", kv_blocks_total=200, kv_block_size=4, stages=4)
    assert (policy.group("w1"), policy.group("staged")) == (2, 1)
    for index in range(4):
        policy.add_request(record(f"r{index}", arrival=index))
    plans = [policy.next_plan("w1") for _ in range(3)]
    assert all(plans) and "w1" not in policy.idle_workers(), "3 in flight: no room for a pair"
    apply_result(policy, answer(plans[0]))
    assert "w1" in policy.idle_workers(), "2 in flight: room for a pair"
    for _ in range(3):
        policy.next_plan("staged")
    assert "staged" in policy.idle_workers(), "3 of 4 in flight: room for one plan"


def test_answering_in_groups_needs_room_for_two_groups_in_flight():
    """A group runs while the next is planned: answer_every K takes pipeline_depth of 2K at least."""
    from pydantic import ValidationError

    from shared.config import Settings

    with pytest.raises(ValidationError, match="answer_every 2 needs pipeline_depth at least 4"):
        Settings(answer_every=2, pipeline_depth=3)
    assert Settings(answer_every=2, pipeline_depth=4).answer_every == 2
    # Plans of several steps are answered as one already: not grouped besides
    with pytest.raises(ValidationError, match="scheduler_steps 4 and answer_every 2"):
        Settings(answer_every=2, pipeline_depth=4, scheduler_steps=4)
    with pytest.raises(ValidationError):
        Settings(scheduler_steps=17)
    assert Settings(scheduler_steps=4).scheduler_steps == 4
    with pytest.raises(ValidationError, match="scheduler_plan_ms 25.0 needs scheduler_steps above 1"):
        Settings(scheduler_plan_ms=25)
    assert Settings(scheduler_steps=16, scheduler_plan_ms=25).scheduler_plan_ms == 25


def test_draining_worker_gets_no_new_requests():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.set_draining("w1", True)
    policy.add_request(record("r0"))
    assert policy.next_plan("w1") is None


def test_a_draining_worker_hands_its_requests_over_to_another_which_rebuilds_them():
    policy, prompts, w1 = two_requests_running_on_w1(max_tokens=6, steps=2)
    assert policy.set_draining("w1", True) == [], "no other worker: they stay and finish on w1"
    plan = policy.next_plan("w1")
    assert sorted(item.request_id for item in plan.items) == ["r0", "r1"]
    apply_result(policy, w1.run(plan))
    policy.worker_up("w2", kv_blocks_total=100, kv_block_size=4)
    assert sorted(policy.set_draining("w1", True)) == ["r0", "r1"], "handed over once w2 takes requests"
    plan = policy.next_plan("w1")
    assert sorted(plan.free_request_ids) == ["r0", "r1"] and plan.items == (), "w1 frees them, runs nothing"
    apply_result(policy, w1.run(plan))
    assert policy.next_plan("w1") is None
    outputs, reasons, plans = drive(policy, {"w1": w1, "w2": FakeWorker(prompts)})
    assert all(plan.worker_id == "w2" for plan in plans)
    assert {request_id: len(tokens) for request_id, tokens in outputs.items()} == {"r0": 3, "r1": 3}
    assert reasons == {"r0": "length", "r1": "length"}


def test_stale_results_are_ignored():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("a", max_tokens=10))
    plan = policy.next_plan("w1")
    assert apply_result(policy, answer(dataclasses.replace(plan, plan_id=plan.plan_id + 7))) == []
    assert apply_result(policy, answer(dataclasses.replace(plan, scheduler_epoch="older"))) == []
    assert policy.next_plan("w1") is None, "the real plan is still in flight"
    assert len(apply_result(policy, answer(plan))) == 1
    assert apply_result(policy, answer(plan)) == [], "a duplicate result adds nothing"
    assert policy.get("a").output_token_ids == expected_output("a", 1)


def test_cancel_a_waiting_and_a_running_request():
    policy = make_policy(max_batch_size=1)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("running", arrival=0))
    policy.add_request(record("waiting", arrival=1))
    policy.add_request(record("after", arrival=2))
    plan = policy.next_plan("w1")
    assert policy.cancel("waiting").status == "cancelled"
    assert policy.cancel("running").finish_reason == "cancelled"
    assert policy.cancel("running") is None, "cancelling twice is a no-op"
    assert apply_result(policy, answer(plan)) == [], "the cancelled request's token is dropped"
    plan = policy.next_plan("w1")
    assert plan.free_request_ids == ("running",)
    assert [item.request_id for item in plan.items] == ["after"]


def test_stop_token_ends_a_request_unless_ignore_eos():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("eos", arrival=0))
    policy.add_request(record("ignores", arrival=1, ignore_eos=True, max_tokens=2))
    plan = policy.next_plan("w1")
    outcomes = apply_result(policy, answer(plan, token=lambda request_id, index: 2))
    assert [(outcome.request_id, outcome.token_id, outcome.finish_reason) for outcome in outcomes] == [
        ("eos", 2, "stop"), ("ignores", 2, None)]
    assert outcomes[0].request.output_token_ids == [2], "the stop token counts as a completion token"


def test_context_length_ends_a_request():
    policy = make_policy(context_length=10)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("a", prompt_len=8, max_tokens=100))
    outputs, reasons, _ = drive(policy, {"w1": FakeWorker({"a": record("a", prompt_len=8).prompt_token_ids})})
    assert len(outputs["a"]) == 2 and reasons == {"a": "length"}
    too_long = policy.add_request(record("b", prompt_len=10))
    assert too_long.finish_reason == "length"
    assert [state.request_id for state in policy.take_finished_without_token()] == ["b"]


def test_rebuild_after_a_scheduler_restart_continues_the_output():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    rec = record("a", prompt_len=3, max_tokens=5)
    policy.add_request(rec, output_token_ids=expected_output("a", 2))
    plan = policy.next_plan("w1")
    (item,) = plan.items
    assert item.token_ids == rec.prompt_token_ids + tuple(expected_output("a", 2))
    assert (item.start_position, item.sample, item.output_index) == (0, True, 2)
    done = policy.add_request(record("done", max_tokens=2), output_token_ids=[40, 41])
    assert done.finish_reason == "length", "output given at add that already ends the request"


def test_request_too_big_for_any_worker_finishes_with_length():
    policy = make_policy()
    policy.worker_up("w1", kv_blocks_total=2, kv_block_size=4)
    policy.add_request(record("huge", prompt_len=9))
    policy.add_request(record("fits", prompt_len=3, arrival=1, max_tokens=1))
    plan = policy.next_plan("w1")
    assert [item.request_id for item in plan.items] == ["fits"]
    assert [(state.request_id, state.finish_reason) for state in policy.take_finished_without_token()] == [
        ("huge", "length")]


@pytest.mark.parametrize("scheduler_steps", [1, 3])
@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("policy_name", ["iteration", "request"])
def test_many_requests_over_two_workers_all_finish_with_the_right_output(policy_name, pipeline_depth,
                                                                         scheduler_steps):
    policy = make_policy(policy=policy_name, max_batch_size=4, max_batch_tokens=16, pipeline_depth=pipeline_depth,
                         scheduler_steps=scheduler_steps)
    prompts = {}
    for worker_id in ("w1", "w2"):
        policy.worker_up(worker_id, kv_blocks_total=12, kv_block_size=4)
    for index in range(20):
        rec = record(f"r{index}", prompt_len=3 + index % 7, arrival=index, max_tokens=2 + index % 9,
                     first_token=200 + index)
        policy.add_request(rec)
        prompts[rec.request_id] = rec.prompt_token_ids
    workers = {"w1": FakeWorker(prompts), "w2": FakeWorker(prompts)}
    outputs, reasons, depth_seen = drive_pipelined(policy, workers)
    assert depth_seen == pipeline_depth
    steps_run = workers["w1"].steps_run + workers["w2"].steps_run
    assert max(steps_run) == (scheduler_steps if policy_name == "iteration" else 1)
    for index in range(20):
        assert outputs[f"r{index}"] == expected_output(f"r{index}", 2 + index % 9)
        assert reasons[f"r{index}"] == "length"
    assert all(worker.kv_blocks_reserved == 0 and not worker.running for worker in map(policy.worker, ("w1", "w2")))


def test_plans_as_long_as_plan_seconds_of_each_workers_own_steps():
    """plan_seconds (Settings.scheduler_plan_ms): one policy, one target, workers of different step
    times. A worker of 3.4 ms steps gets plans of 25 // 3.4 = 7 steps (once its first answer has said
    how long its steps take: one step until then); one of 60 ms steps (this CPU engine's) plans of
    one; and every output is the oracle's, as with plans of fixed steps."""
    policy = make_policy(max_batch_size=8, max_batch_tokens=64, pipeline_depth=2, scheduler_steps=16,
                         plan_seconds=0.025)
    prompts = {}
    for worker_id in ("fast", "slow"):
        policy.worker_up(worker_id, kv_blocks_total=64, kv_block_size=4)
    for index in range(12):
        rec = record(f"r{index}", prompt_len=3 + index % 5, arrival=index, max_tokens=40, ignore_eos=True,
                     first_token=300 + index)
        policy.add_request(rec)
        prompts[rec.request_id] = rec.prompt_token_ids
    workers = {"fast": FakeWorker(prompts, step_seconds=0.0034), "slow": FakeWorker(prompts, step_seconds=0.060)}
    outputs, reasons, _ = drive_pipelined(policy, workers)
    fast, slow = workers["fast"].steps_run, workers["slow"].steps_run
    assert fast[0] == 1 and max(fast) == 7 and fast.count(7) >= len(fast) // 2, fast
    assert set(slow) == {1}, slow
    assert policy.worker("fast").step_seconds == pytest.approx(0.0034)
    for index in range(12):
        assert outputs[f"r{index}"] == expected_output(f"r{index}", 40)
        assert reasons[f"r{index}"] == "length"
    # The target is a bound: a worker of steps longer than it runs one step a plan, and with 0
    # (off) every plan of decodes runs scheduler_steps.
    assert make_policy(scheduler_steps=4)._steps_for(policy.worker("slow")) == 4
    assert make_policy(scheduler_steps=4, plan_seconds=0.001)._steps_for(policy.worker("fast")) == 1


def test_while_requests_wait_a_timed_plan_ends_where_its_first_request_does():
    """plan_seconds: while requests wait for a row, a plan of several steps ends at the step where
    its first request reaches its output limit (every item runs the same steps), so the row it frees
    takes a waiting request at the next plan, not up to a plan's length later; with nobody waiting,
    a plan runs its steps and the requests that end sooner stop inside it. Outputs are the oracle's."""
    policy = make_policy(max_batch_size=4, max_batch_tokens=64, pipeline_depth=2, scheduler_steps=16,
                         plan_seconds=0.025)
    policy.worker_up("w1", kv_blocks_total=256, kv_block_size=4)
    prompts, limits = {}, {}
    for index in range(12):
        limits[f"r{index}"] = 4 + (index * 5) % 17
        rec = record(f"r{index}", prompt_len=3 + index % 4, arrival=index, max_tokens=limits[f"r{index}"],
                     ignore_eos=True, first_token=300 + index)
        policy.add_request(rec)
        prompts[rec.request_id] = rec.prompt_token_ids
    plans = []  # each plan of several steps: (its items' steps, whether requests waited after it was made)
    next_plan = policy.next_plan

    def recording_next_plan(worker_id):
        plan = next_plan(worker_id)
        if plan is not None and plan.steps > 1:
            plans.append((list(plan.item_steps) or [plan.steps] * len(plan.items), policy.waiting_count > 0))
        return plan

    policy.next_plan = recording_next_plan
    outputs, reasons, _ = drive_pipelined(policy, {"w1": FakeWorker(prompts, step_seconds=0.0034)})
    for index in range(12):
        assert outputs[f"r{index}"] == expected_output(f"r{index}", limits[f"r{index}"])
        assert reasons[f"r{index}"] == "length"
    waited = [steps for steps, waiting in plans if waiting]
    assert waited and all(len(set(steps)) == 1 for steps in waited), waited
    assert any(len(set(steps)) > 1 for steps, waiting in plans if not waiting), plans


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_the_answer_to_a_plan_of_steps_applies_at_once_as_its_steps_one_by_one(prefix_caching):
    """The worker answers a plan of several steps at once; applied in one pass (most answers) or a
    step at a time, everything the scheduler keeps comes out the same: outputs, finishes (stop
    tokens, max_tokens), the outcomes left to publish (tokens whose entries the worker left to the
    scheduler, finishing ones), iteration records, the prefix cache's registrations and every KV
    count. Requests join and leave meanwhile (pipelined plans, a full KV cache: preemptions), with a
    stop string on one (its plans go a step at a time)."""
    stop_at = {f"r{index}": 3 + index % 11 for index in range(0, 24, 3)}  # where some sample a stop token

    def token(request_id: str, index: int) -> int:
        return 2 if stop_at.get(request_id) == index else token_for(request_id, index)

    def run(together: bool):
        policy = make_policy(max_batch_size=6, max_batch_tokens=24, pipeline_depth=2, scheduler_steps=4,
                             prefix_caching=prefix_caching, text_context=lambda prompt, output: ())
        prompts = {}
        for worker_id in ("w1", "w2"):
            policy.worker_up(worker_id, kv_blocks_total=14, kv_block_size=4)
        for index in range(24):
            rec = record(f"r{index}", prompt_len=5 + index % 6, arrival=index, max_tokens=3 + index % 13,
                         first_token=200 + index % 4)  # (prompts sharing prefixes)
            if index == 7:
                rec = rec.model_copy(update={"sampling": rec.sampling.model_copy(update={"stop": ("never",)})})
            policy.add_request(rec)
            prompts[rec.request_id] = rec.prompt_token_ids
        workers = {worker_id: FakeWorker(prompts, token, unwritten_at=lambda request_id, index: index % 5 == 1)
                   for worker_id in ("w1", "w2")}
        applied = []  # each answer of several steps: applied whole (True) or a step at a time
        answers_to_apply = policy.answers_to_apply
        policy.answers_to_apply = lambda result: applied.append(len(answers_to_apply(result)) == 1) or \
            answers_to_apply(result)
        seen = []
        outputs, reasons, _ = drive_pipelined(policy, workers, together=together, seen=seen)
        records = [row._replace(started_at=0.0, finished_at=0.0) for row in policy.take_iteration_records()]
        kv = [(worker.kv_blocks_reserved, worker.kv_blocks_free, len(worker.running), len(worker.cache),
               worker.cache.blocks_idle) for worker in map(policy.worker, ("w1", "w2"))]
        registered = [sorted(worker.registered) for worker in workers.values()]
        return dict(outputs), reasons, sorted(seen), records, kv, registered, applied

    *together, applied = run(True)
    *one_by_one, _ = run(False)
    assert together == one_by_one
    # Each request ends where it should: its stop token, else its max_tokens (the finishing token is
    # the scheduler's to publish; the others only where the worker left them)
    ends = {request_id: (index, reason) for request_id, index, _, reason, _ in together[2] if reason}
    for number in range(24):
        request_id, max_tokens = f"r{number}", 3 + number % 13
        stop = stop_at.get(request_id, max_tokens)
        assert ends[request_id] == ((stop, "stop") if stop < max_tokens else (max_tokens - 1, "length")), request_id
    assert {index % 5 for request_id, index, _, reason, _ in together[2] if not reason and request_id != "r7"} == {1}
    assert len([request_id for request_id, *_ in together[2] if request_id == "r7"]) == 3 + 7 % 13  # (stop string)
    assert sum(applied) > len(applied) / 2 and not all(applied), "most answers applied whole, some a step at a time"


@pytest.mark.parametrize("stages", [2, 3])
def test_a_pipeline_group_gets_one_plan_per_stage_each_of_other_requests(stages):
    """Orca's figure 8: a worker of M stages has M plans in flight, each of about 1/M of its
    requests and never one whose token a plan in flight samples; every output stays exact."""
    policy = make_policy(max_batch_size=16, pipeline_depth=2)
    policy.worker_up("group", kv_blocks_total=200, kv_block_size=4, stages=stages)
    prompts = {}
    for index in range(12):
        rec = record(f"r{index}", prompt_len=3 + index % 5, arrival=index, max_tokens=3 + index % 4,
                     first_token=300 + index)
        policy.add_request(rec)
        prompts[rec.request_id] = rec.prompt_token_ids
    worker, outputs, reasons = FakeWorker(prompts), defaultdict(list), {}
    first = policy.next_plan("group")
    assert len(first.items) == 12, "all admitted at once, prefilled in one plan"
    assert policy.next_plan("group") is None, "every request's first token is on its way"
    collect(apply_result(policy, worker.run(first)), outputs, reasons)
    lanes = [policy.next_plan("group") for _ in range(stages)]
    assert policy.next_plan("group") is None, "one plan per stage"
    requests = [{item.request_id for item in plan.items} for plan in lanes]
    assert set().union(*requests) == set(prompts) and all(len(lane) == 12 // stages for lane in requests), requests
    assert not any(item.feeds_sampled for plan in lanes for item in plan.items)
    follows = []
    for plan in lanes:  # each lane's next plan follows its own result, with the same requests
        collect(apply_result(policy, worker.run(plan)), outputs, reasons)
        follow = policy.next_plan("group")
        assert {item.request_id for item in follow.items} == {item.request_id for item in plan.items
                                                              if item.request_id not in reasons}
        follows.append(follow)
    rest, rest_reasons, depth_seen = drive_pipelined(policy, {"group": worker}, sent={"group": follows})
    assert depth_seen <= stages
    for request_id, tokens in rest.items():
        outputs[request_id].extend(tokens)
    for index in range(12):
        assert outputs[f"r{index}"] == expected_output(f"r{index}", 3 + index % 4)


# Pipelining: the next plan is sent while the one before runs


def test_the_next_plan_feeds_the_token_the_plan_in_flight_samples():
    policy = make_policy(pipeline_depth=2)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    policy.add_request(record("a", prompt_len=3, max_tokens=3))
    first = policy.next_plan("w1")
    second = policy.next_plan("w1")
    assert policy.next_plan("w1") is None, "two plans in flight at most"
    (item,) = second.items
    assert (item.feeds_sampled, item.token_ids, item.start_position, item.sample, item.output_index) == (
        True, (), 3, True, 1)
    worker = FakeWorker({"a": record("a", prompt_len=3).prompt_token_ids})
    assert [outcome.token_id for outcome in apply_result(policy, worker.run(first))] == expected_output("a", 1)
    third = policy.next_plan("w1")
    assert [(item.feeds_sampled, item.start_position, item.output_index) for item in third.items] == [(True, 4, 2)]
    apply_result(policy, worker.run(second))
    assert policy.next_plan("w1") is None, "its last token (max_tokens 3) is in flight: nothing more to plan"
    outcomes = apply_result(policy, worker.run(third))
    assert [(outcome.token_id, outcome.finish_reason) for outcome in outcomes] == [(expected_output("a", 3)[-1], "length")]
    assert worker.sampled_count["a"] == 3, "no token wasted when max_tokens ends it"


@pytest.mark.parametrize("scheduler_steps", [1, 4])
def test_a_stop_token_costs_at_most_one_speculative_token(scheduler_steps):
    """... one plan's worth: with scheduler_steps, a plan's steps after the stop token's, and one
    step of the plan planned meanwhile."""
    stop_at = {"a": 2, "b": 0, "c": 5}  # the output index where each samples a stop token

    def token(request_id: str, index: int) -> int:
        return 2 if index == stop_at[request_id] else token_for(request_id, index)

    policy = make_policy(pipeline_depth=2, scheduler_steps=scheduler_steps)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    prompts = {}
    for index, request_id in enumerate(stop_at):
        rec = record(request_id, prompt_len=4, arrival=index, max_tokens=20, first_token=300 + 10 * index)
        policy.add_request(rec)
        prompts[request_id] = rec.prompt_token_ids
    worker = FakeWorker(prompts, token)
    outputs, reasons, _ = drive_pipelined(policy, {"w1": worker})
    for request_id, index in stop_at.items():
        assert outputs[request_id] == [token(request_id, i) for i in range(index + 1)]
        assert reasons[request_id] == "stop"
        assert worker.sampled_count[request_id] - len(outputs[request_id]) <= 2 * scheduler_steps - 1
    assert max(worker.steps_run) == scheduler_steps
    assert policy.worker("w1").kv_blocks_reserved == 0


def test_cancel_and_preemption_with_two_plans_in_flight():
    policy = make_policy(pipeline_depth=2)
    policy.worker_up("w1", kv_blocks_total=6, kv_block_size=4)  # 24 tokens
    prompts = {}
    for index, request_id in enumerate(("old", "young", "gone")):
        rec = record(request_id, prompt_len=4, arrival=index, max_tokens=10, first_token=400 + 10 * index)
        policy.add_request(rec)
        prompts[request_id] = rec.prompt_token_ids
    worker = FakeWorker(prompts)
    first, second = policy.next_plan("w1"), policy.next_plan("w1")
    assert {item.request_id for item in second.items} == {"old", "young", "gone"}
    policy.cancel("gone")
    first_tokens = {outcome.request_id: outcome.token_id for outcome in apply_result(policy, worker.run(first))}
    assert set(first_tokens) == {"old", "young"}, "the cancelled request's token is dropped"
    third = policy.next_plan("w1")
    assert "gone" in third.free_request_ids and "gone" not in {item.request_id for item in third.items}
    outputs, reasons, _ = drive_pipelined(policy, {"w1": worker}, sent={"w1": [second, third]})
    for request_id in ("old", "young"):  # they outgrow the pool: the young one is preempted and rebuilt
        assert [first_tokens[request_id]] + outputs[request_id] == expected_output(request_id, 10)
    assert reasons == {"old": "length", "young": "length"}
    assert policy.worker("w1").kv_blocks_reserved == 0 and "gone" not in worker.kv


def test_a_row_taken_over_while_a_plan_naming_it_is_in_flight_gets_nothing_of_that_plan():
    # A request's row is its handle in the worker's plans, and a cancelled request's row is free at
    # once: the next request can take it while a plan that named the first is still on the worker.
    policy = make_policy(pipeline_depth=2, max_batch_size=1)
    policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
    prompts = {}
    for index, request_id in enumerate(("first", "second")):
        rec = record(request_id, prompt_len=4, arrival=index, max_tokens=5, first_token=500 + 10 * index)
        policy.add_request(rec)
        prompts[request_id] = rec.prompt_token_ids
    worker = FakeWorker(prompts)
    in_flight = policy.next_plan("w1")
    row = policy.get("first").row
    policy.cancel("first")
    takeover = policy.next_plan("w1")
    assert [item.request_id for item in takeover.items] == ["second"] and policy.get("second").row == row
    assert apply_result(policy, worker.run(in_flight)) == [], "the answer for the row's former holder applies to nobody"
    assert policy.get("second").output_token_ids == []
    outputs, reasons, _ = drive_pipelined(policy, {"w1": worker}, sent={"w1": [takeover]})
    assert outputs["second"] == expected_output("second", 5) and reasons == {"second": "length"}
    assert "first" not in outputs and policy.worker("w1").kv_blocks_reserved == 0


@pytest.mark.parametrize("log_requests", [False, True])
def test_the_admission_line_is_logged_only_with_log_requests(log_requests, caplog):
    # Settings.log_requests (services/cli.py configure_logging): off, the scheduler's per-request
    # lines stay off at any level (the chaos suite's clusters turn them on and replay them).
    from services.cli import configure_logging
    from shared.config import REQUEST_LOG, Settings

    configure_logging(Settings(log_requests=log_requests))
    try:
        with caplog.at_level(logging.DEBUG):
            policy = make_policy()
            policy.worker_up("w1", kv_blocks_total=100, kv_block_size=4)
            policy.add_request(record("a"))
            assert policy.next_plan("w1") is not None
        admitted = [entry.getMessage() for entry in caplog.records if entry.getMessage().startswith("admitted ")]
        assert admitted == (["admitted request_id=a worker_id=w1 tokens=4 output_tokens=0 cached_tokens=0"]
                            if log_requests else [])
    finally:
        logging.getLogger(REQUEST_LOG).setLevel(logging.NOTSET)
