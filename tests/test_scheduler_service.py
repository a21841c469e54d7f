"""The scheduler process against a private Redis, with a fake worker (a test double of the worker
process only: the scheduler, the policy and the tokenizer are the real ones)."""

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from redis.exceptions import OutOfMemoryError

from services.gateway.store import Store
from services.scheduler.liveness import WorkerLiveness
from services.scheduler.policy import SchedulerPolicy
from services.scheduler.redis_link import RedisLink
from services.scheduler.service import run_scheduler
from shared import cache_digest, keys
from shared.config import Settings
from shared.messages import (
    BatchPlan,
    IterationRecord,
    PlanResult,
    RequestRecord,
    SampledToken,
    SamplingParams,
    SchedulerInfo,
    TokenEvent,
    WorkerInfo,
)
from services.worker.plan_reader import PlanReader, StepAnswers
from shared.tokenizer import Tokenizer
from services.worker.token_writer import STALE, WRITE_SCRIPT, TokenWriter
from shared.redis_connection import connect
from shared.wire import WireError, decode, decode_token_event, encode
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.timeout(60)

STOP_AT = {(7, 3)}  # (seed, output_index) where the fake model samples the stop token 2


def fake_token(seed: int, output_index: int) -> int:
    """The fake model's output: printable ASCII (ids 17..106 are "!".."z"), a function of (seed, index)."""
    if (seed, output_index) in STOP_AT:
        return 2
    return 17 + (seed + output_index) % 90


class FakeWorker:
    """Speaks the worker side of docs/protocol.md and checks every plan it gets: the KV it would
    hold must be exactly prompt + output so far, or the plan was wrong."""

    def __init__(self, redis_url: str, worker_id: str, prompts: dict[str, tuple[int, ...]],
                 kv_blocks_total: int = 512, kv_block_size: int = 16, step_seconds: float = 0.002,
                 timeout_ms: int = 600, writes_entries: bool = False) -> None:
        self.redis = connect(redis_url)
        self.worker_id = worker_id
        self.prompts = prompts
        self.kv_blocks_total, self.kv_block_size = kv_blocks_total, kv_block_size
        self.step_seconds = step_seconds
        self.timeout_ms = timeout_ms
        self.started_at = time.time()
        self.epoch: str | None = None
        self.cache_digest, self.digest_epoch = 0, ""
        self.kv: dict[str, list[int]] = {}
        self.seeds: dict[str, int] = {}
        self.last_sampled: dict[str, tuple[int, int]] = {}  # request id -> (output_index, token)
        self.errors: list[str] = []
        self.plans: list[BatchPlan] = []
        self.answer_with_next: list[bool] = []  # each plan's flag (Settings.answer_every)
        self.answers_written: list[list[int]] = []  # the plan ids of each result write
        self.steps_sent: list[int] = []  # the steps of each plan of several (Settings.scheduler_steps)
        self.steps_answered: list[int] = []  # the steps each answer holds
        self.reader = PlanReader()  # the handles the scheduler gives this worker's requests
        # The real worker's token entries (services/worker/token_writer.py), when asked: written with
        # each result, as the worker writes them
        self.token_writer = TokenWriter(Tokenizer.load()) if writes_entries else None
        self.entries_written = 0
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "FakeWorker":
        await self._heartbeat_once()
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._serve())]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()
        # A clean exit, as a worker stopping gracefully would leave it: no heartbeat key behind.
        await self.redis.delete(keys.worker_heartbeat(self.worker_id))
        await self.redis.srem(keys.WORKERS_SET, self.worker_id)
        await self.redis.aclose()

    def lose_state(self) -> None:
        """Forget every request and its handle, as a worker whose state was lost would (the epoch stays)."""
        epoch = self.reader.epoch
        self.reader = PlanReader()
        self.reader.epoch = epoch
        self.kv.clear()
        self.seeds.clear()
        self.last_sampled.clear()

    async def kill(self) -> None:
        """Stop answering and stop the heartbeat (its key expires: the scheduler sees it dead)."""
        self.stop.set()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _heartbeat_once(self) -> None:
        info = WorkerInfo(worker_id=self.worker_id, pid=os.getpid(), host=socket.gethostname(), device="fake",
                          kv_block_size=self.kv_block_size, kv_blocks_total=self.kv_blocks_total,
                          kv_blocks_free=self.kv_blocks_total, running=len(self.kv),
                          started_at=self.started_at, heartbeat_at=time.time())
        await self.redis.set(keys.worker_heartbeat(self.worker_id), encode(info), px=self.timeout_ms)
        await self.redis.sadd(keys.WORKERS_SET, self.worker_id)

    async def _heartbeats(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
            with contextlib.suppress(OutOfMemoryError):
                await self._heartbeat_once()

    async def _serve(self) -> None:
        last_id = "0-0"
        held: list[tuple[int, bytes, list]] = []  # results held for the next plan's (plan id, payload, writes)
        while not self.stop.is_set():
            reply = await self.redis.xread({keys.plan_stream(self.worker_id): last_id}, count=10, block=50)
            for _, entries in reply or ():
                for position, (entry_id, fields) in enumerate(entries):
                    last_id = entry_id
                    kv_length = lambda request_id: len(self.kv.get(request_id, ()))  # noqa: E731
                    decoded = self.reader.decode(fields[b"m"], kv_length, self.worker_id)
                    if decoded is None:  # a resent copy of a plan run already (the real worker skips it too)
                        continue
                    if decoded.steps > 1:
                        self.steps_sent.append(decoded.steps)
                    answers, writes = StepAnswers(self.reader), []
                    answer_with_next = decoded.answer_with_next
                    while decoded is not None:  # (a plan of several steps: each, as the real worker runs them)
                        plan = decoded.plan
                        self.plans.append(plan)
                        result = self._run(plan)
                        for handle, message in decoded.unknown:
                            self.errors.append(f"plan {plan.plan_id}: handle {handle}: {message}")
                        sampled = {token.request_id: token.token_id for token in result.tokens}
                        step_writes, unwritten = (self.token_writer.after_step(plan, sampled) if self.token_writer
                                                  else ([], None))
                        writes += step_writes
                        answers.add(decoded, sampled, {},
                                    [(error.request_id, error.code, error.message) for error in result.errors],
                                    result.step_seconds, unwritten)
                        await asyncio.sleep(self.step_seconds)
                        decoded = self.reader.next_step(decoded, kv_length)
                    # (one answer for all its steps, as the real worker's)
                    held.append((answers.plan.plan_id, answers.packed(result.kv_blocks_total, result.kv_blocks_free,
                                                                      0, self.cache_digest), writes))
                    self.answer_with_next.append(answer_with_next)
                    self.steps_answered.append(len(answers.seconds))
                    if answer_with_next and position + 1 < len(entries):
                        continue  # as the real worker: held while the next plan (read with it) runs
                    payloads = [payload for _, payload, _ in held]
                    writes = [write for _, _, plan_writes in held for write in plan_writes]
                    self.answers_written.append([plan_id for plan_id, _, _ in held])
                    held = []
                    entries_arg = self.token_writer.entries(writes) if writes else b""
                    while True:  # as the real worker: a Redis that refuses writes for a while is waited out
                        try:
                            if writes:
                                reply = await self.redis.eval(WRITE_SCRIPT, 2, keys.RESULTS_STREAM, keys.INCARNATION,
                                                              entries_arg, payloads[0], 1000, plan.scheduler_epoch,
                                                              *payloads[1:])
                                self.entries_written += len(writes) if reply != STALE else 0
                            else:
                                for payload in payloads:
                                    await self.redis.xadd(keys.RESULTS_STREAM, {"m": payload})
                            break
                        except OutOfMemoryError:
                            await asyncio.sleep(0.05)

    def _run(self, plan: BatchPlan) -> PlanResult:
        if plan.scheduler_epoch != self.epoch:
            self.epoch = plan.scheduler_epoch
            self.kv.clear()
            self.seeds.clear()
            self.last_sampled.clear()
        if plan.free_all:
            self.kv.clear()
            self.last_sampled.clear()
        if plan.scheduler_epoch != self.digest_epoch:  # (a new epoch: the real worker drops its cache)
            self.cache_digest, self.digest_epoch = 0, plan.scheduler_epoch
        self.cache_digest = cache_digest.after_plan(self.cache_digest, plan)  # as the real worker's
        for request_id in plan.free_request_ids:
            self.kv.pop(request_id, None)
            self.seeds.pop(request_id, None)
            self.last_sampled.pop(request_id, None)
        for new in plan.new_requests:
            self.seeds[new.request_id] = new.sampling.seed
        tokens = []
        for item in plan.items:
            if item.request_id not in self.seeds:
                self.errors.append(f"plan {plan.plan_id}: {item.request_id} has no NewRequest")
                continue
            held = self.kv.setdefault(item.request_id, [])
            if item.start_position == 0:
                held.clear()
            if item.start_position != len(held):
                self.errors.append(f"{item.request_id}: start {item.start_position} but KV holds {len(held)}")
                continue
            if item.feeds_sampled:  # a pipelined plan: the token sampled in the plan before
                index, token = self.last_sampled.get(item.request_id, (-1, -1))
                if index != item.output_index - 1 or item.token_ids:
                    self.errors.append(f"{item.request_id}: feeds output {index} to sample {item.output_index}")
                    continue
                held.append(token)
            else:
                held.extend(item.token_ids)
            seed, prompt = self.seeds[item.request_id], self.prompts[item.request_id]
            expected = list(prompt) + [fake_token(seed, index) for index in range(len(held) - len(prompt))]
            if held != expected[: len(held)]:
                self.errors.append(f"{item.request_id}: KV holds {held}, expected {expected[: len(held)]}")
            if item.sample:
                if item.output_index != len(held) - len(prompt):
                    self.errors.append(f"{item.request_id}: output_index {item.output_index} after {len(held)} tokens")
                tokens.append(SampledToken(request_id=item.request_id, token_id=fake_token(seed, item.output_index),
                                           output_index=item.output_index))
                self.last_sampled[item.request_id] = (item.output_index, tokens[-1].token_id)
        return PlanResult(scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id, worker_id=self.worker_id,
                          tokens=tuple(tokens), kv_blocks_total=self.kv_blocks_total,
                          kv_blocks_free=self.kv_blocks_total, step_seconds=self.step_seconds)


@pytest.fixture
def settings(redis_url) -> Settings:
    return Settings(redis_url=redis_url, heartbeat_seconds=0.1, worker_timeout_seconds=0.6,
                    max_batch_size=8, max_batch_tokens=64, request_ttl_seconds=120)


@contextlib.asynccontextmanager
async def running_scheduler(settings: Settings):
    stop = asyncio.Event()
    task = asyncio.create_task(run_scheduler(settings, stop))
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=15)


async def kill(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)


async def submit(redis, request_id: str, prompt: tuple[int, ...], **sampling) -> RequestRecord:
    """What the gateway does (docs/protocol.md, "Accepting a request")."""
    sampling.setdefault("seed", 1)
    record = RequestRecord(request_id=request_id, prompt_token_ids=prompt, sampling=SamplingParams(**sampling),
                           arrival_time=time.time())
    pipe = redis.pipeline(transaction=True)
    pipe.hset(keys.request_key(request_id), mapping={"record": encode(record), "status": "waiting"})
    pipe.sadd(keys.ACTIVE_REQUESTS_SET, request_id)
    pipe.xadd(keys.NEW_REQUESTS_STREAM, {"id": request_id})
    await pipe.execute()
    return record


async def cancel(redis, request_id: str) -> None:
    """What the gateway does (docs/protocol.md, "Cancelling"): flag and cancel-stream entry."""
    await Store(redis).cancel(request_id)


async def read_events(redis, request_id: str) -> list[tuple[bytes, TokenEvent]]:
    entries = await redis.xrange(keys.token_stream(request_id))
    return [(entry_id, decode_token_event(fields[b"m"])) for entry_id, fields in entries]


async def wait_finished(redis, request_id: str, timeout: float = 20.0) -> list[TokenEvent]:
    deadline = time.monotonic() + timeout
    while True:
        events = await read_events(redis, request_id)
        if events and events[-1][1].finish_reason is not None:
            return [event for _, event in events]
        if time.monotonic() > deadline:
            raise AssertionError(f"{request_id} did not finish in {timeout}s: {len(events)} events")
        await asyncio.sleep(0.02)


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def check_stream(request_id: str, events: list[TokenEvent], seed: int, prompt_len: int, completion_tokens: int,
                 finish_reason: str) -> None:
    assert [event.index for event in events] == list(range(len(events))), f"{request_id}: indexes out of order"
    assert all(event.finish_reason is None for event in events[:-1]), f"{request_id}: finish before the end"
    final = events[-1]
    assert final.finish_reason == finish_reason, f"{request_id}: finished {final.finish_reason}"
    assert (final.prompt_tokens, final.completion_tokens) == (prompt_len, completion_tokens), request_id
    assert [event.token_id for event in events] == [fake_token(seed, index) for index in range(completion_tokens)]


@pytest.mark.parametrize("answer_every", [1, 2, "steps"], ids=["answered-each", "answered-in-pairs", "multi-step"])
@pytest.mark.parametrize("writes_entries", [False, True], ids=["scheduler-entries", "worker-entries"])
async def test_tokens_stream_in_order_with_the_right_final_event(redis_client, settings, writes_entries, answer_every):
    if answer_every == "steps":  # plans of decodes run 4 steps each, answered together (Settings.scheduler_steps)
        settings = Settings(**(settings.model_dump() | {"scheduler_steps": 4}))
    elif answer_every > 1:  # plans sent in pairs, the first answered with the second (Settings.answer_every)
        settings = Settings(**(settings.model_dump() | {"answer_every": answer_every, "pipeline_depth": 2 * answer_every}))
    prompts = {"cmpl-len": (1, 2, 3), "cmpl-eos": (4, 5), "cmpl-stopstr": (6, 7, 8, 9),
               "cmpl-long": tuple(range(300, 400))}
    async with FakeWorker(settings.redis_url, "w1", prompts, writes_entries=writes_entries) as worker, \
            running_scheduler(settings):
        await submit(redis_client, "cmpl-len", prompts["cmpl-len"], seed=1, max_tokens=5)
        await submit(redis_client, "cmpl-eos", prompts["cmpl-eos"], seed=7, max_tokens=20)
        # seed 0 writes "!\"#$%&'()...": the stop string "%&" ends the text at "!\"#$"
        await submit(redis_client, "cmpl-stopstr", prompts["cmpl-stopstr"], seed=0, max_tokens=20, stop=("%&",))
        await submit(redis_client, "cmpl-long", prompts["cmpl-long"], seed=3, max_tokens=4)  # 100 tokens: chunked
        finished = {request_id: await wait_finished(redis_client, request_id) for request_id in prompts}
        check_stream("cmpl-len", finished["cmpl-len"], 1, 3, 5, "length")
        assert "".join(event.text for event in finished["cmpl-len"]) == '"#$%&'
        check_stream("cmpl-eos", finished["cmpl-eos"], 7, 2, 4, "stop")
        assert finished["cmpl-eos"][-1].token_id == 2 and finished["cmpl-eos"][-1].text == ""
        stop_events = finished["cmpl-stopstr"]
        check_stream("cmpl-stopstr", stop_events, 0, 4, 6, "stop")
        assert [event.text for event in stop_events] == ["!", '"', "#", "$", "", ""], "'%' held back, then dropped"
        check_stream("cmpl-long", finished["cmpl-long"], 3, 100, 4, "length")
        entry_ids = [entry_id for entry_id, _ in await read_events(redis_client, "cmpl-len")]
        assert entry_ids == [b"0-1", b"0-2", b"0-3", b"0-4", b"0-5"]

        for request_id, reason in [("cmpl-len", b"length"), ("cmpl-eos", b"stop"), ("cmpl-stopstr", b"stop")]:
            status = await redis_client.hmget(keys.request_key(request_id), ["status", "finish_reason"])
            assert status == [b"finished", reason], request_id
            assert 0 < await redis_client.ttl(keys.token_stream(request_id)) <= settings.request_ttl_seconds
            assert 0 < await redis_client.ttl(keys.request_key(request_id)) <= settings.request_ttl_seconds
        assert await redis_client.smembers(keys.ACTIVE_REQUESTS_SET) == set()
        info = decode(SchedulerInfo, await redis_client.get(keys.SCHEDULER_HEARTBEAT))
        await wait_until(lambda: _heartbeat_shows_iterations(redis_client), what="a heartbeat with iterations")
        assert info.policy == "iteration"
        records = [decode(IterationRecord, fields[b"m"])
                   for _, fields in await redis_client.xrange(keys.ITERATIONS_STREAM)]
        assert records and all(record.worker_id == "w1" for record in records)
        assert sum(record.prefill_tokens for record in records) >= sum(map(len, prompts.values()))
        assert {request_id for record in records for request_id in record.finished} == set(prompts)
        # Every step has its record, once the answers of plans still in flight after the last finish
        # are in (a stop string's speculative plan, which may reach the worker after the finish; one
        # that only frees has no record to wait for): the plans stepped so far, at every look
        async def every_step_recorded() -> bool:
            stepped = sorted(plan.plan_id for plan in worker.plans if plan.items)
            recorded = sorted(decode(IterationRecord, fields[b"m"]).plan_id
                              for _, fields in await redis_client.xrange(keys.ITERATIONS_STREAM)
                              if decode(IterationRecord, fields[b"m"]).request_ids)
            return recorded == stepped

        await wait_until(every_step_recorded, what="an iteration record for every step")
        assert max(len(item.token_ids) for plan in worker.plans for item in plan.items) <= settings.max_batch_tokens
        assert any(item.feeds_sampled for plan in worker.plans for item in plan.items), "plans were pipelined"
        assert worker.errors == []
        max_tokens = {"cmpl-len": 5, "cmpl-eos": 20, "cmpl-stopstr": 20, "cmpl-long": 4}
        assert all(item.output_index < max_tokens[item.request_id] for plan in worker.plans for item in plan.items), \
            "a step sampled past its request's max_tokens"
        if answer_every == "steps":  # each plan of several steps answered in one write; max_tokens never passed
            assert worker.steps_sent and max(worker.steps_sent) == 4 and max(worker.steps_answered) == 4
            assert {len(ids) for ids in worker.answers_written} == {1}, "one answer a plan"
        elif answer_every == 1:
            assert not any(worker.answer_with_next) and {len(ids) for ids in worker.answers_written} == {1}
        else:  # in pairs (one alone where the second of a pair had nothing to run)
            assert sum(len(ids) == 2 for ids in worker.answers_written) > len(worker.answers_written) / 2
            assert {len(ids) for ids in worker.answers_written} <= {1, 2}
        # the worker's: cmpl-len's 4 first, cmpl-eos's 3 first (not the stop token), cmpl-long's 3 first
        assert worker.entries_written == (10 if writes_entries else 0)


async def _heartbeat_shows_iterations(redis_client) -> bool:
    info = decode(SchedulerInfo, await redis_client.get(keys.SCHEDULER_HEARTBEAT))
    return info.iterations > 0 and info.last_iteration_at > 0 and info.waiting == 0 and info.running == 0


async def test_malformed_messages_are_skipped(redis_client, settings):
    prompts = {"cmpl-ok": (10, 11, 12)}
    async with FakeWorker(settings.redis_url, "w1", prompts) as worker, running_scheduler(settings) as task:
        await redis_client.xadd(keys.RESULTS_STREAM, {"m": b"\xc1 not msgpack"})
        await redis_client.xadd(keys.RESULTS_STREAM, {"m": encode(SamplingParams())})  # msgpack, wrong shape
        await redis_client.xadd(keys.RESULTS_STREAM, {"other": b"field"})
        await redis_client.xadd(keys.NEW_REQUESTS_STREAM, {"m": b"\xc1\xc1"})  # no id field
        await redis_client.xadd(keys.NEW_REQUESTS_STREAM, {"id": b"cmpl-missing"})  # no such request
        await redis_client.xadd(keys.CANCEL_STREAM, {"nothing": b"here"})
        await redis_client.hset(keys.request_key("cmpl-garbled"),
                                mapping={"record": b"\xc1garbage", "status": "waiting"})
        await redis_client.sadd(keys.ACTIVE_REQUESTS_SET, "cmpl-garbled")
        await redis_client.xadd(keys.NEW_REQUESTS_STREAM, {"id": b"cmpl-garbled"})
        await redis_client.set(keys.worker_heartbeat("w-bad"), b"\xc1")
        await redis_client.sadd(keys.WORKERS_SET, "w-bad")
        await submit(redis_client, "cmpl-ok", prompts["cmpl-ok"], seed=5, max_tokens=3)
        events = await wait_finished(redis_client, "cmpl-ok")
        check_stream("cmpl-ok", events, 5, 3, 3, "length")
        garbled = await wait_finished(redis_client, "cmpl-garbled")
        assert [(event.token_id, event.finish_reason) for event in garbled] == [(-1, "error")]
        assert await redis_client.hget(keys.request_key("cmpl-garbled"), "status") == b"failed"
        assert not task.done(), "the scheduler is still running"
        assert worker.errors == []


@pytest.mark.parametrize("writes_entries", [False, True], ids=["scheduler-entries", "worker-entries"])
async def test_cancel_a_running_and_a_waiting_request(redis_client, settings, writes_entries):
    settings = settings.model_copy(update={"max_batch_size": 1})
    prompts = {"cmpl-running": (1, 2, 3), "cmpl-waiting": (4, 5, 6), "cmpl-after": (7, 8)}
    async with FakeWorker(settings.redis_url, "w1", prompts, step_seconds=0.005, writes_entries=writes_entries) \
            as worker, running_scheduler(settings):
        await submit(redis_client, "cmpl-running", prompts["cmpl-running"], seed=2, max_tokens=100_000)
        await wait_until(lambda: _has_events(redis_client, "cmpl-running", 3), what="first tokens")
        await submit(redis_client, "cmpl-waiting", prompts["cmpl-waiting"], seed=2, max_tokens=5)
        await submit(redis_client, "cmpl-after", prompts["cmpl-after"], seed=4, max_tokens=2)
        await cancel(redis_client, "cmpl-waiting")
        waiting = await wait_finished(redis_client, "cmpl-waiting")
        assert [(event.index, event.token_id, event.text, event.finish_reason) for event in waiting] == [
            (0, -1, "", "cancelled")]
        await cancel(redis_client, "cmpl-running")
        running = await wait_finished(redis_client, "cmpl-running")
        final = running[-1]
        assert (final.token_id, final.text, final.finish_reason) == (-1, "", "cancelled")
        assert [event.index for event in running[:-1]] == list(range(len(running) - 1))
        assert [event.token_id for event in running[:-1]] == [fake_token(2, index) for index in range(len(running) - 1)]
        if writes_entries:  # the worker may have written the entry of a token in flight, which was dropped
            assert final.completion_tokens == final.index <= len(running) - 1 <= final.index + settings.pipeline_depth
            assert worker.entries_written > 0
        else:
            assert final.completion_tokens == final.index == len(running) - 1
        assert await redis_client.hmget(keys.request_key("cmpl-running"), ["status", "finish_reason"]) == [
            b"cancelled", b"cancelled"]
        check_stream("cmpl-after", await wait_finished(redis_client, "cmpl-after"), 4, 2, 2, "length")
        assert any("cmpl-running" in plan.free_request_ids for plan in worker.plans), "its KV was freed"
        assert all(item.request_id != "cmpl-waiting" for plan in worker.plans for item in plan.items)
        assert worker.errors == []


@pytest.mark.parametrize("request_results", ["batch", "stream"])
async def test_request_level_batch_results_come_when_the_whole_batch_is_done(redis_client, settings, request_results):
    """Orca's request-level baseline returns a batch's results at once; "stream" returns each as sampled."""
    settings = settings.model_copy(update={"policy": "request", "request_results": request_results})
    prompts = {"cmpl-short": (1, 2, 3), "cmpl-long": (4, 5, 6), "cmpl-cancelled": (7, 8), "cmpl-next": (9,)}
    async with FakeWorker(settings.redis_url, "w1", prompts, step_seconds=0.01) as worker:
        for request_id, max_tokens in [("cmpl-short", 2), ("cmpl-long", 40), ("cmpl-cancelled", 1000)]:
            await submit(redis_client, request_id, prompts[request_id], seed=5, max_tokens=max_tokens)
        async with running_scheduler(settings):  # all three are waiting: they form one batch
            def long_done_plus(later_plans: int) -> bool:
                last = [index for index, plan in enumerate(list(worker.plans))
                        if any(item.request_id == "cmpl-long" and item.output_index == 39 for item in plan.items)]
                return bool(last) and len(worker.plans) > last[0] + later_plans

            async def long_done_and_taken_back() -> bool:  # 2 plans later its result was applied
                return long_done_plus(settings.pipeline_depth + 1)

            await wait_until(long_done_and_taken_back, what="the long request's last step and two more plans")
            visible = [await redis_client.xlen(keys.token_stream(request_id)) for request_id in ("cmpl-short", "cmpl-long")]
            if request_results == "batch":
                assert visible == [0, 0], "results of a batch still running (cmpl-cancelled) were written"
            else:
                assert visible == [2, 40]
            await submit(redis_client, "cmpl-next", prompts["cmpl-next"], seed=6, max_tokens=3)
            await cancel(redis_client, "cmpl-cancelled")
            cancelled = await wait_finished(redis_client, "cmpl-cancelled")
            assert cancelled[-1].finish_reason == "cancelled" and len(cancelled) > 40
            assert [event.index for event in cancelled] == list(range(len(cancelled))), "held tokens, then the cancel"
            check_stream("cmpl-short", await wait_finished(redis_client, "cmpl-short"), 5, 3, 2, "length")
            check_stream("cmpl-long", await wait_finished(redis_client, "cmpl-long"), 5, 3, 40, "length")
            check_stream("cmpl-next", await wait_finished(redis_client, "cmpl-next"), 6, 1, 3, "length")
        first_batch = {"cmpl-short", "cmpl-long", "cmpl-cancelled"}
        assert {new.request_id for new in worker.plans[0].new_requests} == first_batch
        assert worker.errors == []


async def _has_events(redis_client, request_id: str, count: int) -> bool:
    return await redis_client.xlen(keys.token_stream(request_id)) >= count


WORKLOAD = [  # (name, prompt, sampling): stop strings, a stop token, chunked prefill, long outputs
    ("a", tuple(range(20, 30)), {"seed": 0, "max_tokens": 40, "stop": ("DEF",)}),  # stops at its 38th token
    ("b", tuple(range(40, 43)), {"seed": 7, "max_tokens": 40}),  # stop token at index 3
    ("c", tuple(range(100, 250)), {"seed": 11, "max_tokens": 60}),  # 150-token prompt over 3 chunks
    ("d", (5, 6), {"seed": 30, "max_tokens": 50, "stop": ("never", "~~")}),
    ("e", tuple(range(60, 90)), {"seed": 50, "max_tokens": 45}),
    ("f", (9,), {"seed": 80, "max_tokens": 55, "ignore_eos": True}),
]


async def _run_workload(redis_client, settings, prefix: str, interrupt: bool) -> dict[str, list[TokenEvent]]:
    prompts = {f"{prefix}-{name}": prompt for name, prompt, _ in WORKLOAD}

    async def halfway() -> bool:
        counts = [await redis_client.xlen(keys.token_stream(f"{prefix}-{name}")) for name in ("d", "e", "f")]
        return sum(counts) >= 40

    async with FakeWorker(settings.redis_url, f"w-{prefix}", prompts, step_seconds=0.004) as worker:
        schedulers = [asyncio.create_task(run_scheduler(settings, asyncio.Event()))]
        try:
            for name, prompt, sampling in WORKLOAD:
                await submit(redis_client, f"{prefix}-{name}", prompt, **sampling)
            if interrupt:
                await wait_until(halfway, what="tokens before the kill")
                await kill(schedulers[0])
                assert await redis_client.scard(keys.ACTIVE_REQUESTS_SET) > 0, "killed mid-run"
                schedulers.append(asyncio.create_task(run_scheduler(settings, asyncio.Event())))
            results = {name: await wait_finished(redis_client, f"{prefix}-{name}") for name, _, _ in WORKLOAD}
        finally:
            for task in schedulers:
                await kill(task)
        if interrupt:
            assert len({plan.scheduler_epoch for plan in worker.plans}) == 2, "both schedulers sent plans"
        assert worker.errors == []
    return results


async def test_a_restarted_scheduler_finishes_every_request_with_the_same_output(redis_client, settings, caplog):
    caplog.set_level(logging.INFO, logger="iterserve.scheduler")
    uninterrupted = await _run_workload(redis_client, settings, "once", interrupt=False)
    restarted = await _run_workload(redis_client, settings, "twice", interrupt=True)
    # (the fake tokens are a function of (seed, index): only the log tells output loaded from computed again)
    loaded = [int(match.group(1)) for record in caplog.records
              if (match := re.match(r"loaded request_id=twice-\S+ .*output_tokens=(\d+)", record.getMessage()))]
    assert any(loaded), f"the restarted scheduler loaded no request with its output so far: {loaded}"
    for name, _, _ in WORKLOAD:
        assert restarted[name] == uninterrupted[name], f"request {name} differs after the restart"
    assert "".join(event.text for event in uninterrupted["a"]).endswith("ABC"), "text ends before the stop string"
    assert (uninterrupted["a"][-1].finish_reason, uninterrupted["a"][-1].completion_tokens) == ("stop", 38)
    assert uninterrupted["b"][-1].finish_reason == "stop" and uninterrupted["b"][-1].completion_tokens == 4
    assert uninterrupted["f"][-1].completion_tokens == 55


async def test_a_dead_workers_requests_are_rebuilt_on_another_and_its_keys_deleted(redis_client, settings):
    """The protocol only: the fake model's tokens are a function of (seed, index), so equal output
    holds here by construction. That a real engine gives the same output after a worker dies is
    proved by tests/test_chaos.py::test_sigkill_a_worker_mid_run_outputs_equal_a_fault_free_run."""
    prompts = {f"cmpl-{index}": tuple(range(30 + index, 40 + index)) for index in range(6)}
    async with (FakeWorker(settings.redis_url, "w-stays", prompts, step_seconds=0.004) as stays,
                FakeWorker(settings.redis_url, "w-dies", prompts, step_seconds=0.004) as dies,
                running_scheduler(settings)):
        for index, request_id in enumerate(prompts):
            await submit(redis_client, request_id, prompts[request_id], seed=index * 5, max_tokens=60)
        await wait_until(lambda: _has_events(redis_client, "cmpl-5", 5), what="tokens before the worker dies")
        assert any(plan.items for plan in dies.plans), "the dying worker had requests"
        await dies.kill()
        for index, request_id in enumerate(prompts):
            check_stream(request_id, await wait_finished(redis_client, request_id), index * 5, 10, 60, "length")
        assert await redis_client.sismember(keys.WORKERS_SET, "w-dies") == 0
        assert not await redis_client.exists(keys.plan_stream("w-dies")), "the dead worker's plan stream is left"
        assert not await redis_client.exists(keys.worker_heartbeat("w-dies"))
        assert await redis_client.exists(keys.plan_stream("w-stays")), "the live worker's plan stream is kept"
        assert stays.errors == [] and dies.errors == []


async def test_a_live_worker_missing_from_the_workers_set_keeps_its_requests_until_its_heartbeat_key_goes(
        redis_client, caplog):
    """Liveness is the heartbeat key: a worker the scheduler knows that is not listed in the set
    (its listing lost, as in a Redis restart that dropped it) is asked about by its key, and stays,
    requests and all; once the key is gone too, it left (worker_gone) and its requests wait again."""
    caplog.set_level(logging.INFO, logger="iterserve.scheduler")
    policy = SchedulerPolicy("epoch", context_length=256, stop_token_ids=())
    link = RedisLink(redis_client, on_write_failed=lambda write, error: None)
    link.run_id = (await redis_client.info("server"))["run_id"]  # (a scheduler's pool loading notes it)
    liveness = WorkerLiveness(link, policy, stall_seconds=60)
    info = WorkerInfo(worker_id="w1", pid=os.getpid(), host="here", device="fake", kv_block_size=16,
                      kv_blocks_total=64, kv_blocks_free=64, running=0, started_at=1.0, heartbeat_at=time.time())
    await redis_client.set(keys.worker_heartbeat("w1"), encode(info), px=60_000)
    await redis_client.sadd(link.keys.workers, "w1")
    await liveness.poll()
    policy.add_request(RequestRecord(request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4),
                                     arrival_time=time.time()))
    assert policy.next_plan("w1") is not None and policy.running_count == 1

    await redis_client.srem(link.keys.workers, "w1")
    await liveness.poll()
    assert policy.worker_ids == ("w1",) and policy.running_count == 1, "a live worker was given up"
    assert "worker_unlisted worker_id=w1" in caplog.text and "worker_gone" not in caplog.text

    await redis_client.delete(keys.worker_heartbeat("w1"))
    await liveness.poll()
    assert policy.worker_ids == () and policy.waiting_count == 1
    assert "worker_gone worker_id=w1" in caplog.text and "worker_dead" not in caplog.text

    # Listed without a heartbeat key: it died. A member that is not UTF-8 is dropped from the set.
    await redis_client.set(keys.worker_heartbeat("w2"), encode(info.model_copy(update={"worker_id": "w2"})),
                           px=60_000)
    await redis_client.sadd(link.keys.workers, "w2", b"\xff")
    await liveness.poll()
    assert policy.worker_ids == ("w2",) and "malformed_worker_id" in caplog.text
    await redis_client.delete(keys.worker_heartbeat("w2"))
    await liveness.poll()
    assert policy.worker_ids == () and "worker_dead worker_id=w2" in caplog.text


async def test_a_worker_that_lost_a_request_answers_unknown_request_and_the_scheduler_rebuilds_it(
        redis_client, settings):
    prompts = {"cmpl-lost": (1, 2, 3)}
    async with FakeWorker(settings.redis_url, "w1", prompts, step_seconds=0.01) as worker, \
            running_scheduler(settings):
        await submit(redis_client, "cmpl-lost", prompts["cmpl-lost"], seed=4, max_tokens=60)
        await wait_until(lambda: _has_events(redis_client, "cmpl-lost", 5), what="tokens before the loss")
        worker.lose_state()
        check_stream("cmpl-lost", await wait_finished(redis_client, "cmpl-lost"), 4, 3, 60, "length")
    # The only complaints are the deltas for the forgotten handle; then a rebuild from position 0
    # carrying the prompt and the output so far, after which the KV checks held for every step.
    assert worker.errors and all("does not hold" in error for error in worker.errors), worker.errors
    rebuilds = [item for plan in worker.plans for item in plan.items
                if item.start_position == 0 and len(item.token_ids) > len(prompts["cmpl-lost"])]
    assert len(rebuilds) == 1 and rebuilds[0].token_ids[:3] == prompts["cmpl-lost"]


async def test_streams_hold_only_what_a_reader_still_needs(redis_client, settings):
    """The input streams are trimmed to the scheduler's read position, the iteration records to
    Settings.iteration_records: 300 requests leave at most a few entries behind."""
    settings = settings.model_copy(update={"iteration_records": 30})
    prompts = {f"cmpl-t{index}": (1 + index % 50, 2, 3) for index in range(300)}
    async with FakeWorker(settings.redis_url, "w1", prompts, step_seconds=0.001), running_scheduler(settings):
        for request_id in prompts:
            await submit(redis_client, request_id, prompts[request_id], seed=3, max_tokens=2)
        for request_id in list(prompts)[::4]:
            await cancel(redis_client, request_id)
        for request_id in prompts:
            await wait_finished(redis_client, request_id)

        async def trimmed() -> bool:  # at the next heartbeat
            lengths = [await redis_client.xlen(stream)
                       for stream in (keys.NEW_REQUESTS_STREAM, keys.CANCEL_STREAM, keys.RESULTS_STREAM)]
            return max(lengths) <= 1

        await wait_until(trimmed, what="the input streams trimmed to what the scheduler read")
        assert await redis_client.xlen(keys.ITERATIONS_STREAM) == 30


async def test_a_request_cancelled_while_no_scheduler_runs_is_cancelled_by_the_next(redis_client, settings):
    """The cancel stream is gone (trimmed): the flag in the request's hash is what the loader reads."""
    prompts = {"cmpl-gone": (1, 2, 3), "cmpl-kept": (4, 5)}
    await submit(redis_client, "cmpl-gone", prompts["cmpl-gone"], seed=1, max_tokens=50)
    await submit(redis_client, "cmpl-kept", prompts["cmpl-kept"], seed=2, max_tokens=3)
    await cancel(redis_client, "cmpl-gone")
    await redis_client.delete(keys.CANCEL_STREAM)
    async with FakeWorker(settings.redis_url, "w1", prompts) as worker, running_scheduler(settings):
        gone = await wait_finished(redis_client, "cmpl-gone")
        assert [(event.token_id, event.finish_reason) for event in gone] == [(-1, "cancelled")]
        check_stream("cmpl-kept", await wait_finished(redis_client, "cmpl-kept"), 2, 2, 3, "length")
    assert all(item.request_id != "cmpl-gone" for plan in worker.plans for item in plan.items)


async def test_an_end_without_a_token_is_written_past_every_token_entry(redis_client, settings):
    """A cancel (or any end without a token) must not be hidden by an entry at the next token's index
    that the scheduler has not seen (docs/scaling.md, step 1: a worker's). Here that entry is one no
    reader can decode, so the scheduler loads the request with no output; its end goes to 1-0, past
    every token's 0-(index + 1), not to 0-1, where Redis would skip it as already written."""
    await submit(redis_client, "cmpl-taken", (1, 2, 3), seed=1, max_tokens=50)
    await redis_client.xadd(keys.token_stream("cmpl-taken"), {"m": b"\xc1"}, id="0-1")
    await cancel(redis_client, "cmpl-taken")
    async with FakeWorker(settings.redis_url, "w1", {"cmpl-taken": (1, 2, 3)}), running_scheduler(settings):
        async def ended() -> bool:
            return (await redis_client.hget(keys.request_key("cmpl-taken"), "status")) == b"cancelled"

        await wait_until(ended, what="the cancel")
        entries = await redis_client.xrange(keys.token_stream("cmpl-taken"))
    assert [entry_id for entry_id, _ in entries] == [b"0-1", b"1-0"]
    end = decode_token_event(entries[-1][1][b"m"])
    assert (end.index, end.token_id, end.finish_reason) == (0, -1, "cancelled")


async def test_writes_redis_refuses_for_a_while_are_sent_again_in_order(redis_client, settings, caplog):
    """Out of memory refuses every write for half a second: the scheduler backs off and sends them
    again, whole and in order, so no token stream has a gap or a duplicate."""
    prompts = {f"cmpl-oom{index}": (10 + index, 11, 12) for index in range(4)}
    async with FakeWorker(settings.redis_url, "w1", prompts, step_seconds=0.003, timeout_ms=5000), \
            running_scheduler(settings) as task:
        for index, request_id in enumerate(prompts):
            await submit(redis_client, request_id, prompts[request_id], seed=index, max_tokens=150)
        await wait_until(lambda: _has_events(redis_client, "cmpl-oom3", 5), what="tokens before Redis is full")
        await redis_client.config_set("maxmemory", "1")  # noeviction: every write is refused
        try:
            await asyncio.sleep(0.5)
        finally:
            await redis_client.config_set("maxmemory", "0")
        for index, request_id in enumerate(prompts):
            check_stream(request_id, await wait_finished(redis_client, request_id), index, 3, 150, "length")
        assert not task.done()
    assert "RedisWritesRefused" in caplog.text, "Redis never refused a round trip: the test did not test"


@pytest.mark.parametrize("writes_entries", [False, True], ids=["scheduler-entries", "worker-entries"])
async def test_a_write_failing_on_one_requests_key_fails_that_request_alone(redis_client, settings, writes_entries):
    """A request whose token stream is not a stream (broken before it was loaded, or while it runs)
    ends failed, and says so in its hash; the others are untouched and the scheduler runs on (the
    worker too, when it writes the entries: it names the request with its result)."""
    prompts = {"cmpl-broken-before": (1, 2, 3), "cmpl-broken-during": (7, 8), "cmpl-fine": (4, 5, 6)}
    await redis_client.set(keys.token_stream("cmpl-broken-before"), b"not a stream")
    async with FakeWorker(settings.redis_url, "w1", prompts, step_seconds=0.01, writes_entries=writes_entries) \
            as worker, running_scheduler(settings) as task:
        await submit(redis_client, "cmpl-broken-before", prompts["cmpl-broken-before"], seed=1, max_tokens=40)
        await submit(redis_client, "cmpl-broken-during", prompts["cmpl-broken-during"], seed=3, max_tokens=200)
        await submit(redis_client, "cmpl-fine", prompts["cmpl-fine"], seed=2, max_tokens=40)
        await wait_until(lambda: _has_events(redis_client, "cmpl-broken-during", 3), what="its first tokens")
        async with redis_client.pipeline(transaction=True) as pipe:  # its next XADD fails inside Redis
            pipe.delete(keys.token_stream("cmpl-broken-during"))
            pipe.set(keys.token_stream("cmpl-broken-during"), b"not a stream")
            await pipe.execute()
        check_stream("cmpl-fine", await wait_finished(redis_client, "cmpl-fine"), 2, 3, 40, "length")
        for request_id in ("cmpl-broken-before", "cmpl-broken-during"):
            async def failed() -> bool:
                return await redis_client.hmget(keys.request_key(request_id), ["status", "finish_reason"]) == [
                    b"failed", b"error"]

            await wait_until(failed, what=f"{request_id}, whose stream cannot be written, to fail")
            assert not await redis_client.sismember(keys.ACTIVE_REQUESTS_SET, request_id)
            assert await redis_client.ttl(keys.request_key(request_id)) > 0
        assert not task.done()
        if writes_entries:  # they failed on the worker's report, long before their last token
            assert worker.entries_written > 0
            assert not any(item.request_id == request_id and item.output_index >= 30 for plan in worker.plans
                           for item in plan.items for request_id in ("cmpl-broken-before", "cmpl-broken-during"))
    assert worker.errors == []


async def test_an_unexpected_error_in_the_bookkeeping_ends_the_scheduler(redis_client, settings, monkeypatch):
    """No catch-all: a bug could leave the policy half-applied, so the process ends (and its restart
    rebuilds everything from Redis) instead of going on."""
    from services.scheduler.policy import SchedulerPolicy

    def on_result(self, result):
        raise KeyError("half-applied")

    monkeypatch.setattr(SchedulerPolicy, "on_result", on_result)
    prompts = {"cmpl-a": (1, 2)}
    async with FakeWorker(settings.redis_url, "w1", prompts):
        task = asyncio.create_task(run_scheduler(settings, asyncio.Event()))
        try:
            await submit(redis_client, "cmpl-a", prompts["cmpl-a"], seed=1, max_tokens=3)
            with pytest.raises(KeyError, match="half-applied"):
                await asyncio.wait_for(asyncio.shield(task), 10)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KeyError):
                await task


def test_wire_error_is_what_decoding_raises():
    from services.worker.plan_reader import PlanReader
    from shared.plans import read_result

    for data in (b"\xc1", encode(SamplingParams()), b"\x93\x01\x02\x03"):
        with pytest.raises(WireError):
            read_result(data)
        with pytest.raises(WireError):
            PlanReader().decode(data, lambda request_id: 0, "w1")


async def test_the_scheduler_survives_a_redis_restart():
    server = RedisProcess().start()
    settings = Settings(redis_url=server.url, heartbeat_seconds=0.1, worker_timeout_seconds=3.0,
                        scheduler_timeout_seconds=3.0, max_batch_size=8, max_batch_tokens=64)
    prompts = {"cmpl-before": (1, 2), "cmpl-across": (3, 4), "cmpl-after": (5, 6)}
    redis = connect(server.url)
    try:
        async with FakeWorker(server.url, "w1", prompts, step_seconds=0.01, timeout_ms=3000), \
                running_scheduler(settings) as task:
            await submit(redis, "cmpl-before", prompts["cmpl-before"], seed=1, max_tokens=3)
            check_stream("cmpl-before", await wait_finished(redis, "cmpl-before"), 1, 2, 3, "length")
            await submit(redis, "cmpl-across", prompts["cmpl-across"], seed=2, max_tokens=150)
            await wait_until(lambda: _has_events(redis, "cmpl-across", 5), what="tokens before the restart")
            server.stop()  # SIGTERM: Redis writes its append-only file and exits
            await asyncio.sleep(0.3)
            server.start()
            await submit(redis, "cmpl-after", prompts["cmpl-after"], seed=3, max_tokens=4)
            check_stream("cmpl-after", await wait_finished(redis, "cmpl-after"), 3, 2, 4, "length")
            check_stream("cmpl-across", await wait_finished(redis, "cmpl-across"), 2, 2, 150, "length")
            assert not task.done()
    finally:
        await redis.aclose()
        server.close()


def test_python_m_services_scheduler_stops_cleanly_on_sigterm(redis_url):
    import redis as sync_redis

    client = sync_redis.Redis.from_url(redis_url)
    client.delete(keys.SCHEDULER_HEARTBEAT)
    environment = {**os.environ, "REDIS_URL": redis_url, "ITERSERVE_HEARTBEAT_SECONDS": "0.1"}
    process = subprocess.Popen([sys.executable, "-m", "services.scheduler"], env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while client.get(keys.SCHEDULER_HEARTBEAT) is None:
            assert process.poll() is None, f"the scheduler exited: {process.communicate()[0]}"
            assert time.monotonic() < deadline, "no scheduler heartbeat"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=15)
        assert process.returncode == 0, output
        assert "scheduler_stopped" in output
        assert client.get(keys.SCHEDULER_HEARTBEAT) is None, "a clean stop takes the heartbeat down"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        client.close()
