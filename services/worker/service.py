"""The worker process: holds the model and its KV cache, runs the plans addressed to it.

Loop: take the next BatchPlan, free what the plan says, run the step in the engine (in a thread,
so heartbeats go on), publish the PlanResult. Redis round trips overlap the steps: a reader task
fetches the plans ahead into a small queue (the scheduler sends the next plan while one runs), and
a step's result is published while the next step runs (in order). Run one after the other, the two
round trips and the thread hop left a GPU-speed step idle 3-4 ms per iteration (measured with
emulated 26 ms steps: 88% busy). The step thread also decodes each plan and encodes its result,
and goes on to the next plan read ahead without a hop back to the event loop: two hops and a turn
of the loop were a third of what remained between two steps (measured with emulated 3.4 ms steps:
0.24 -> 0.16-0.18 ms). A worker group of several pipeline stages (services/worker/group.py) starts
a plan and reads the next while the plan's later stages run, and publishes each result, in order,
when its tokens are back. A heartbeat key with a TTL
announces the worker; when the key expires the scheduler moves its requests elsewhere.

SIGTERM drains: the heartbeat says `draining` (the scheduler admits nothing new here and hands
the running requests over to another worker, or lets them finish when there is none); the
worker goes on running plans until it holds no request or `drain_seconds` have passed, then
deregisters and exits. Whatever it still held is re-queued by the scheduler when it is gone.
An engine that can no longer compute (any exception from a step but out-of-memory, which may
pass) makes the worker deregister and exit non-zero the same way (EngineBroken).
No Redis command is ever cancelled (see shared/redis_connection.py): loops stop on flags.
"""

import asyncio
import collections
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from redis.exceptions import OutOfMemoryError, ReadOnlyError

from services.worker.engine import Engine, KVPoolTooSmall
from services.worker.token_writer import STALE, WRITE_SCRIPT, TokenWriter, Write
from services.worker.rows import ItemRefusal, StepOutcome
from services.worker.kv_cache import CacheMismatch
from shared import keys
from shared.config import Settings, threads_per_worker
from shared.exits import configuration_error
from shared.model_file import load_metadata, weights_sha256
from shared.served_models import served_models
from shared.messages import BatchPlan, PromptLogprobsChunk, WorkerInfo
from shared.plans import plan_epoch
from shared.redis_connection import RECONNECT_ERRORS, connect
from shared.redis_exchange import Exchange, xread_entries
from shared.startup_heap import freeze_startup_heap
from services.worker.plan_reader import DecodedPlan, PlanReader, StepAnswers
from shared.tokenizer import Tokenizer
from shared.wire import WireError, encode

log = logging.getLogger("iterserve.worker")

PLAN_BLOCK_MS = 250  # one wait for a plan: also how soon an idle worker notices a SIGTERM
DRAIN_BLOCK_MS = 100  # while draining: look at the exit conditions this often
READ_BLOCK_MS = 100  # the plan reader's wait: also how soon it notices the worker stopping
READ_SLACK_SECONDS = 10.0  # a blocked read may take this much longer than READ_BLOCK_MS before it is given up
PREFETCH_PLANS = 8  # plans read ahead (the scheduler keeps pipeline_depth <= 8 in flight)
EXIT_WRITE_SECONDS = 3.0  # how long a stopping worker waits on Redis to deregister
# A guard only: the scheduler trims the results stream to what it has read. Results it has not
# read after this many are of no use (a scheduler that was down this long starts a new epoch).
RESULTS_KEPT = 1000
RESULT_SEND_SECONDS = 10.0  # a result's write not answered in this long is sent again, on a new connection
PLAN_EPOCH_WITHIN = 64  # a plan's epoch is among its first bytes (shared/plans.py: "f", then "e")
# Out of memory in a step fails that plan's items (the scheduler retries them, maybe in smaller
# batches); this many in a row mean the device is in no state to compute: the worker leaves.
MAX_CONSECUTIVE_OOM = 3
ENGINE_BROKEN_EXIT_CODE = 3


class EngineBroken(Exception):
    """The engine can no longer compute (a device-side assert, a poisoned CUDA context, repeated
    out-of-memory, or any exception from a step that is not an item's fault): the worker leaves,
    so its requests move to other workers as if it had been killed."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


class Answer(NamedTuple):
    """A plan's result as it waits to be published: its bytes, its token entries, the plan and its
    entry in the plan stream."""

    result: bytes
    writes: list[Write]
    plan: BatchPlan
    entry_id: bytes


class Worker:
    def __init__(self, settings: Settings, engine: Engine, worker_id: str):
        self.settings, self.engine, self.worker_id = settings, engine, worker_id
        self.redis = connect(settings.redis_url)
        self.results = Exchange(self.redis)  # every result goes out on it (shared/redis_exchange.py)
        self.plan_reads = Exchange(self.redis)  # the plan reader's XREADs, one after the other
        self.started_at = time.time()
        self.scheduler_epoch = ""
        self.draining = False
        self.device = engine.device_name
        self.busy_seconds = 0.0  # inside steps, since it started
        self._heartbeat_stop = asyncio.Event()
        self._reading_stop = asyncio.Event()
        self._publishing: asyncio.Task | None = None  # the last result's publish
        # Plans read ahead, in order: the reader appends, the step thread takes (a deque's append
        # and popleft are atomic); _plan_arrived wakes the loop when it waits for one.
        self._ready: collections.deque[tuple[bytes, dict]] = collections.deque()
        self._plan_arrived = asyncio.Event()
        self._consecutive_oom = 0
        # A worker group of several pipeline stages runs up to `stages` plans at once: each launched
        # in the engine's own thread (one at a time, in order), finished when the last stage's
        # tokens are back (services/worker/group.py).
        self.stages = getattr(engine, "stages", 1)
        self._engine_thread = ThreadPoolExecutor(1, "engine") if self.stages > 1 else None
        self._sampling_in_flight: list[set[str]] = []  # per plan launched and not finished: who samples
        self._busy_until = 0.0  # monotonic: the end of the busy time already counted
        self.reader = PlanReader()  # the handles the scheduler gave this worker's requests
        self._leased_epoch = b""  # the epoch whose plans are known to run here (one of several's: under its lease)
        served = served_models(settings)[0]  # a worker serves one model, in its model's pool of keys
        self.model_name, self.keys = served.name, served.keys
        self.weights_sha256 = weights_sha256(load_metadata(settings.model))
        self.token_writer = TokenWriter(  # the token entries it writes
            Tokenizer.for_serving(settings.model, settings.tokenizer, settings.chat_template))
        keys_tensor = getattr(engine.kv_cache, "keys", None)
        self.kv_dtype = "emulated" if keys_tensor is None else str(keys_tensor.dtype).removeprefix("torch.")

    def info(self) -> WorkerInfo:
        kv = self.engine.kv_cache
        return WorkerInfo(
            worker_id=self.worker_id, pid=os.getpid(), host=socket.gethostname(), device=self.device,
            kv_block_size=kv.block_size, kv_blocks_total=kv.blocks_total, kv_blocks_free=kv.blocks_free,
            kv_blocks_cached=kv.blocks_cached, running=self.engine.running, draining=self.draining,
            started_at=self.started_at, heartbeat_at=time.time(), executor=self.engine.executor,
            hardware=self.engine.profile.name if self.engine.executor == "emulated" else "",
            busy_seconds=self.busy_seconds, model=self.model_name, weights_sha256=self.weights_sha256,
            kv_bytes_per_token=getattr(self.engine, "kv_bytes_per_token", 0), pipeline_stages=self.stages,
            kv_dtype=self.kv_dtype,
        )

    async def beat(self) -> None:
        timeout_ms = int(self.settings.worker_timeout_seconds * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.worker_heartbeat(self.worker_id), encode(self.info()), px=timeout_ms)
            pipe.sadd(self.keys.workers, self.worker_id)
            await pipe.execute()

    async def heartbeat_forever(self) -> None:
        """Until _heartbeat_stop is set (never cancelled: it may be waiting on Redis)."""
        while not self._heartbeat_stop.is_set():
            try:
                # A beat later than the key's own life is no use: one stuck on a connection to a host
                # that is gone (a Redis primary lost, until the Sentinels' promotion) is given up and
                # sent again on a new connection, so the worker is not taken for dead meanwhile.
                async with asyncio.timeout(max(1.0, self.settings.worker_timeout_seconds)):
                    await self.beat()
            except RECONNECT_ERRORS as error:
                log.warning("event=heartbeat_failed worker=%s error=%r", self.worker_id, error)
            except Exception:  # a heartbeat that stops for good would get this worker declared dead
                log.exception("event=heartbeat_error worker=%s", self.worker_id)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_seconds):
                    await self._heartbeat_stop.wait()

    def launch(self, decoded: DecodedPlan) -> StepOutcome:
        """A plan's changes and its step (with pipeline stages: the step's first stage; a refused
        plan's outcome has its errors set and no step)."""
        plan = decoded.plan
        if plan.scheduler_epoch != self.scheduler_epoch:
            if self.scheduler_epoch:
                log.info("event=new_scheduler_epoch worker=%s dropping=%d", self.worker_id, self.engine.running)
            self.engine.reset()  # the new scheduler rebuilds every request from its tokens
            self.scheduler_epoch = plan.scheduler_epoch
        elif plan.free_all:
            log.info("event=free_all worker=%s dropping=%d", self.worker_id, self.engine.running)
            self.engine.reset()
        try:
            self.engine.take_plan(plan)
        except CacheMismatch as mismatch:
            # The scheduler's copy of this cache and the cache differ: nothing of either can be
            # trusted. Drop everything; the scheduler starts this worker over on seeing the code.
            log.error("event=cache_mismatch worker=%s plan=%d error=%s", self.worker_id, plan.plan_id, mismatch)
            self.engine.reset()
            return self.failed(plan, "cache_mismatch", str(mismatch))
        return self.engine.step(plan.items)

    def _gather(self, answers: StepAnswers, decoded: DecodedPlan, outcome: StepOutcome) -> list[Write]:
        """A step's outcome into its plan's answer; the token entries to write with it (called once
        for every step run, in order: the token writer follows the plans' new and freed requests)."""
        writes, unwritten = self.token_writer.after_step(decoded.plan, outcome.tokens, outcome.speculated)
        if outcome.prompt_logprobs:
            self.token_writer.note_prompt_logprobs({
                request_id: PromptLogprobsChunk(first_position=chunk.first_position, entries=tuple(
                    (token, finite(logprob), rank, tuple((top_id, finite(top)) for top_id, top in tops))
                    for token, logprob, rank, tops in chunk.entries))
                for request_id, chunk in outcome.prompt_logprobs.items()})
        logprobs = {request_id: (finite(value.logprob), tuple((token, finite(top)) for token, top in value.top))
                    for request_id, value in outcome.logprobs.items()}
        answers.add(decoded, outcome.tokens, logprobs,
                    [(error.request_id, error.code, error.message) for error in outcome.errors], outcome.seconds,
                    unwritten, outcome.speculated)
        return writes

    def _packed(self, answers: StepAnswers) -> bytes:
        kv = self.engine.kv_cache
        return answers.packed(kv.blocks_total, kv.blocks_free, kv.blocks_cached, kv.cache_digest)

    async def serve(self, stop_event: asyncio.Event) -> None:
        stream = keys.plan_stream(self.worker_id)
        last = await self.redis.xrevrange(stream, count=1)
        last_id = last[0][0] if last else b"0-0"
        heartbeat = asyncio.create_task(self.heartbeat_forever())
        reading = asyncio.create_task(self._read_plans(stream, last_id))
        log.info("event=worker_ready worker=%s pid=%d device=%s kv_blocks=%d threads=%d", self.worker_id,
                 os.getpid(), self.device, self.engine.kv_cache.blocks_total, torch.get_num_threads())
        drain_deadline = 0.0
        loop = asyncio.get_running_loop()
        try:
            while True:
                if stop_event.is_set():
                    if not self.draining:
                        drain_deadline = time.monotonic() + self.settings.drain_seconds
                        await self._start_draining()
                    if self.engine.running == 0:
                        log.info("event=drained worker=%s", self.worker_id)
                        break
                    if time.monotonic() >= drain_deadline:
                        log.warning("event=drain_timeout worker=%s still_running=%d", self.worker_id,
                                    self.engine.running)
                        break
                block_ms = DRAIN_BLOCK_MS if self.draining else PLAN_BLOCK_MS
                if reading.done():
                    reading.result()  # it ends only when told to, or by failing: then so does the worker
                if self.stages == 1 and self._publishing is not None and self._publishing.done():
                    self._publishing.result()  # a result Redis refused for good ends the worker, as it did
                if not self._ready:  # (at load the next plan was read ahead during the step: every one)
                    self._plan_arrived.clear()
                    try:  # an event, not a Redis command: safe to time out
                        await asyncio.wait_for(self._plan_arrived.wait(), block_ms / 1000)
                    except TimeoutError:
                        pass
                    continue  # the stop and drain checks first
                if self.stages > 1:
                    entry_id, fields = self._ready.popleft()
                    await self.handle(fields, stream, entry_id)
                else:
                    await asyncio.to_thread(self._run_ready, stream, loop, stop_event)
        finally:
            self.draining = True
            self._reading_stop.set()
            self._ready.clear()  # plans read ahead and not run
            # Bounded, and without raising over what ended the loop: every step that ran has its
            # result out (or Redis is gone), and the reader stops after its current XREAD.
            tasks = {reading} | ({self._publishing} if self._publishing is not None else set())
            await asyncio.wait(tasks, timeout=READ_BLOCK_MS / 1000 + EXIT_WRITE_SECONDS)
            self._heartbeat_stop.set()
            await self._deregister(heartbeat)

    async def _read_plans(self, stream: str, last_id: bytes) -> None:
        """Fetch this worker's plans ahead while steps run, in order, until told to stop."""
        while not self._reading_stop.is_set():
            if len(self._ready) >= PREFETCH_PLANS:  # enough ahead (the scheduler keeps fewer in flight)
                await asyncio.sleep(0.002)
                continue
            try:
                async with asyncio.timeout(READ_BLOCK_MS / 1000 + READ_SLACK_SECONDS):
                    [reply] = await self.plan_reads.send([("XREAD", "COUNT", PREFETCH_PLANS - len(self._ready),
                                                           "BLOCK", READ_BLOCK_MS, "STREAMS", stream, last_id)])
            except RECONNECT_ERRORS as error:
                log.warning("event=redis_unavailable worker=%s error=%r", self.worker_id, error)
                await asyncio.sleep(0.5)
                continue
            if isinstance(reply, Exception):
                raise reply  # (not a lost connection: a reply Redis will give again)
            for _, entries in xread_entries(reply):
                for entry_id, fields in entries:
                    last_id = entry_id
                    if await self._under_lease(fields.get(b"m", b"")):
                        self._ready.append((entry_id, fields))
                        self._plan_arrived.set()

    async def _under_lease(self, data: bytes) -> bool:
        """A plan of one of several schedulers (services/scheduler/shards.py) runs only if its
        scheduler holds this worker's lease: one of a scheduler that lost it (taken over, its lease run
        out) would make this worker drop the KV of the requests its new scheduler runs here. Looked
        up when the epoch changes, not for every plan."""
        if self._leased_epoch and self._leased_epoch in data[:PLAN_EPOCH_WITHIN]:
            return True
        try:
            epoch = plan_epoch(data)
        except WireError:
            return True  # (refused, and logged, where it is decoded)
        if not epoch.startswith(keys.SHARDED_EPOCH_PREFIX):
            self._leased_epoch = epoch.encode()  # (the one scheduler's: no lease; looked at again when it changes)
            return True
        while True:
            try:
                lease = await self.redis.get(keys.worker_lease(self.worker_id))
                break
            except RECONNECT_ERRORS as error:
                log.warning("event=redis_unavailable worker=%s error=%r", self.worker_id, error)
                await asyncio.sleep(0.5)
        if lease is not None and lease.split(b" ")[0] == epoch.encode():
            self._leased_epoch = epoch.encode()
            return True
        log.warning("event=plan_without_lease worker=%s epoch=%s lease=%r", self.worker_id, epoch, lease)
        return False

    async def _start_draining(self) -> None:
        """Say so at once (not at the next heartbeat): the scheduler stops sending new requests."""
        self.draining = True
        log.info("event=draining worker=%s running=%d drain_seconds=%.1f", self.worker_id, self.engine.running,
                 self.settings.drain_seconds)
        try:
            await self.beat()
        except RECONNECT_ERRORS as error:
            log.warning("event=heartbeat_failed worker=%s error=%r", self.worker_id, error)

    async def _deregister(self, heartbeat: asyncio.Task) -> None:
        """Take the heartbeat key down at once rather than let it expire (the scheduler re-queues
        what this worker still held); bounded, and without cancelling a Redis command."""

        async def writes() -> None:
            await heartbeat  # it stops at its next wait; a beat after the delete would re-register
            # Out of the set first: a scheduler polling between the two writes then sees a worker
            # that left (worker_gone), not one registered without a heartbeat (worker_dead).
            await self.redis.srem(self.keys.workers, self.worker_id)
            await self.redis.delete(keys.worker_heartbeat(self.worker_id))

        task = asyncio.create_task(writes())
        done, _ = await asyncio.wait({task}, timeout=EXIT_WRITE_SECONDS)
        if task in done and task.exception() is None:
            await self.redis.aclose()
        else:  # Redis unreachable: the key expires on its own
            log.warning("event=deregister_failed worker=%s error=%r", self.worker_id,
                        task.exception() if task in done else "timeout")

    def _run_ready(self, stream: str, loop: asyncio.AbstractEventLoop, stop_event: asyncio.Event) -> None:
        """In the step thread: run the plans read ahead (at least one: the loop calls it with one
        ready), one after the other, until none is left or the worker is told to stop (after each
        plan the loop then checks whether to drain or leave); each result is handed to the loop to
        publish, in order. A plan that says "answer with the next" has its result held while the
        next plan runs, and written with that one's (of the same scheduler epoch); never longer than
        this runs: a held result with no plan after it here goes out as this returns."""
        held: list[Answer] = []
        try:
            while True:
                entry_id, fields = self._ready.popleft()
                decoded = self._decode(fields, entry_id)
                if decoded is not None:
                    answer = self._run_plan(decoded, entry_id)
                    if held and held[-1].plan.scheduler_epoch != answer.plan.scheduler_epoch:
                        loop.call_soon_threadsafe(self._queue_publish, held, stream)
                        held = []
                    held.append(answer)
                    if not decoded.answer_with_next:
                        loop.call_soon_threadsafe(self._queue_publish, held, stream)
                        held = []
                if not self._ready or stop_event.is_set():
                    return
        finally:
            if held:  # no next plan here (yet), or it was not one to run, or a step raised
                loop.call_soon_threadsafe(self._queue_publish, held, stream)

    def _run_plan(self, decoded: DecodedPlan, entry_id: bytes) -> Answer:
        """One plan, every step of it (a plan of several: PlanReader.next_step): its answer (one
        result, its token entries, the plan). Raises EngineBroken when the engine can no longer compute."""
        answers, writes = StepAnswers(self.reader), []
        while decoded is not None:
            writes += self._gather(answers, decoded, self._run_step(decoded))
            decoded = self.reader.next_step(decoded, self.engine.kv_length)
        return Answer(self._packed(answers), writes, answers.plan, entry_id)

    def _run_step(self, decoded: DecodedPlan) -> StepOutcome:
        plan = decoded.plan
        try:
            outcome = self.launch(decoded)
            self.busy_seconds += outcome.seconds
            self._consecutive_oom = 0
        except Exception as failure:
            # Every item's own problem is a typed refusal inside the result; an exception is the
            # engine's. Out of memory may pass (smaller batches); anything else will not.
            if not is_out_of_memory(failure):
                raise EngineBroken(f"a step raised {type(failure).__name__}: {failure}") from failure
            self._consecutive_oom += 1
            log.warning("event=out_of_memory worker=%s plan=%d consecutive=%d", self.worker_id, plan.plan_id,
                        self._consecutive_oom)
            if self._consecutive_oom >= MAX_CONSECUTIVE_OOM:
                raise EngineBroken(f"{self._consecutive_oom} steps in a row ran out of memory") from failure
            outcome = self.failed(plan, "out_of_memory", f"the worker ran out of memory: {failure}")
        self._log_refusals(decoded, outcome)
        return outcome

    def _queue_publish(self, answers: list[Answer], stream: str) -> None:
        """Publish results after the ones before them (results go out in order)."""
        self._publishing = asyncio.create_task(self._publish(answers, stream, after=self._publishing))

    def _decode(self, fields: dict, entry_id: bytes) -> DecodedPlan | None:
        try:
            decoded = self.reader.decode(fields.get(b"m", b""), self.engine.kv_length, self.worker_id)
        except WireError as error:
            log.warning("event=bad_plan worker=%s error=%s", self.worker_id, error)
            return None
        if decoded is None:  # run already: its result is out (or lost with the Redis that lost it)
            log.warning("event=duplicate_plan worker=%s entry=%s", self.worker_id, entry_id)
        return decoded

    async def handle(self, fields: dict, stream: str, entry_id: bytes) -> None:
        """A worker group of pipeline stages: start one plan (its result is published when its
        tokens are back). Raises EngineBroken when the engine can no longer compute."""
        decoded = self._decode(fields, entry_id)
        while decoded is not None:
            await self._launch_staged(decoded, stream, entry_id)
            if decoded.steps == 1:
                return
            # (The scheduler sends several steps to no worker of stages; were it to, each step
            # feeds the tokens of the one before: they are back first. Each is answered apart, under
            # its own plan id, as the scheduler also reads the steps of a plan.)
            await self._publishing
            decoded = self.reader.next_step(decoded, self.engine.kv_length)

    async def _launch_staged(self, decoded: DecodedPlan, stream: str, entry_id: bytes) -> None:
        """Pipeline stages: start the plan's step and return (the next plan's first stage may run
        while this one's later stages do); its result goes out when its tokens are back, in order.
        A plan that feeds a token still in the pipeline waits for every plan before it first."""
        plan = decoded.plan
        if self._publishing is not None and self._publishing.done() and self._publishing.exception():
            raise EngineBroken(f"a plan could not finish: {self._publishing.exception()!r}")
        sampling = {item.request_id for item in plan.items if item.sample}
        if self._publishing is not None and any(item.request_id in sampled for item in plan.items
                                                for sampled in self._sampling_in_flight):
            try:
                await self._publishing
            except Exception as failure:
                raise EngineBroken(f"a plan could not finish: {failure!r}") from failure
        loop = asyncio.get_running_loop()
        launched_at = time.monotonic()
        try:
            outcome = await loop.run_in_executor(self._engine_thread, self.launch, decoded)
        except Exception as failure:  # a group's ranks are in the middle of the step: no retrying it
            raise EngineBroken(f"a step raised {type(failure).__name__}: {failure}") from failure
        stepped = not any(error.code == "cache_mismatch" for error in outcome.errors)  # (else no step ran)
        self._sampling_in_flight.append(sampling)
        self._publishing = asyncio.create_task(self._finish_staged(self._publishing, decoded, outcome, stepped,
                                                                   launched_at, stream, entry_id))

    async def _finish_staged(self, previous: asyncio.Task | None, decoded: DecodedPlan, outcome: StepOutcome,
                             stepped: bool, launched_at: float, stream: str, entry_id: bytes) -> None:
        if previous is not None:  # plans finish, and their results go out, in order
            await previous
        try:
            if stepped:
                await asyncio.to_thread(self.engine.wait_sampled)  # not in the engine's thread: it launches on
                outcome = await asyncio.get_running_loop().run_in_executor(self._engine_thread, self.engine.finish,
                                                                           outcome)
        finally:
            self._sampling_in_flight.pop(0)
        now = time.monotonic()
        outcome.seconds = now - launched_at  # through every stage
        self.busy_seconds += now - max(launched_at, self._busy_until)  # overlapping plans counted once
        self._busy_until = now
        self._log_refusals(decoded, outcome)
        answers = StepAnswers(self.reader)
        writes = self._gather(answers, decoded, outcome)
        await self._publish([Answer(self._packed(answers), writes, decoded.plan, entry_id)], stream)

    def _log_refusals(self, decoded: DecodedPlan, outcome: StepOutcome) -> None:
        for error in outcome.errors:
            log.warning("event=item_error worker=%s request=%s code=%s message=%s", self.worker_id,
                        error.request_id, error.code, error.message)
        for handle, message in decoded.unknown:
            log.warning("event=item_error worker=%s handle=%d code=unknown_request message=%s", self.worker_id,
                        handle, message)

    async def _publish(self, answers: list[Answer], stream: str, after: asyncio.Task | None = None) -> None:
        """The results of consecutive plans of one scheduler epoch (after their token entries, in
        one script: services/worker/token_writer.py), and the plan stream trimmed up to the last
        plan (nobody else reads it), once the publish `after` is done. Sent again until Redis takes
        it: at once the first time (a connection Redis dropped since the last result, say on a
        restart), then every half second. (A result written twice is read once: the scheduler
        takes one answer per plan; an entry written twice is skipped.)"""
        if after is not None:
            await after
        writes = [write for answer in answers for write in answer.writes]
        results = [answer.result for answer in answers]
        plan = answers[-1].plan
        # (detokenized here, in the event loop, while the step thread runs the next step)
        if plan.scheduler_epoch.startswith(keys.SHARDED_EPOCH_PREFIX):
            # One of several schedulers (services/scheduler/shards.py): its own result stream, and
            # nothing lands unless it holds this worker's lease now (a scheduler taken over, or one
            # whose lease ran out, is not answered: its plans were the last it sent this worker).
            commands = [("EVAL", WRITE_SCRIPT, 2, self.keys.results_of(plan.scheduler_epoch),
                         keys.worker_lease(self.worker_id), self.token_writer.entries(writes), results[0],
                         RESULTS_KEPT, plan.scheduler_epoch, *results[1:])]
        elif writes or self.token_writer.has_fields:
            commands = [("EVAL", WRITE_SCRIPT, 2, self.keys.results, self.keys.incarnation,
                         self.token_writer.entries(writes), results[0], RESULTS_KEPT, plan.scheduler_epoch,
                         *results[1:])]
        else:
            commands = [("XADD", self.keys.results, "MAXLEN", "~", RESULTS_KEPT, "*", "m", result)
                        for result in results]
        commands.append(("XTRIM", stream, "MINID", answers[-1].entry_id))
        wait = 0.0
        while True:
            try:
                async with asyncio.timeout(RESULT_SEND_SECONDS):  # (on a connection to a host gone: given up)
                    replies = await self.results.send(commands)
                failed = [reply for reply in replies if isinstance(reply, Exception)]
                if failed:
                    raise failed[0]
                if replies[0] == STALE:  # a restarted Redis or a new scheduler: its next plans say
                    log.warning("event=stale_write worker=%s plan=%d epoch=%s", self.worker_id, plan.plan_id,
                                plan.scheduler_epoch)
                return
            except (*RECONNECT_ERRORS, OutOfMemoryError, ReadOnlyError, TimeoutError) as error:
                log.warning("event=publish_failed worker=%s plan=%d error=%r", self.worker_id, plan.plan_id, error)
                await asyncio.sleep(wait)
                wait = 0.5

    def failed(self, plan: BatchPlan, code: str, message: str) -> StepOutcome:
        """Every item of the plan in error: the scheduler rebuilds those requests elsewhere or later."""
        for item in plan.items:
            self.engine.free(item.request_id)  # the step may have stopped half-way through its KV
        return StepOutcome(errors=[ItemRefusal(request_id, code, message)
                                   for request_id in dict.fromkeys(item.request_id for item in plan.items)])


def finite(logprob: float) -> float:
    """A log-probability the wire takes (no NaN or infinity: a broken row reads as impossible)."""
    return logprob if math.isfinite(logprob) else -9999.0


def new_worker_id() -> str:
    return f"worker-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EmulatedLogLines(logging.Filter):
    """Every log line of an emulated worker says so: its numbers are a profile's, not a model's."""

    def __init__(self, hardware: str) -> None:
        super().__init__()
        self.prefix = f"EMULATED[{hardware}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True


def make_engine(settings: Settings):
    """The worker's executor: the model (the default), or the emulated one (a benchmarking
    instrument) with its hardware profile; a setting that can never work (a bad profile or model
    file, a device that is not there) stops the worker with a clear message and the exit code
    that says not to restart it (shared/exits.py)."""
    if settings.executor == "emulated":
        if settings.group_size > 1:
            raise configuration_error("iterserve worker: --tensor-parallel and --pipeline-parallel need the model "
                                      "(--executor engine): the emulated executor's profile already stands for the "
                                      "whole device group")
        from services.worker.emulated import EmulatedEngine
        from services.worker.hardware import ProfileError

        for handler in logging.getLogger().handlers:
            handler.addFilter(EmulatedLogLines(settings.hardware or "?"))
        try:
            return EmulatedEngine.from_settings(settings)
        except ProfileError as error:
            log.error("event=bad_hardware_profile error=%s", error)
            raise configuration_error(f"iterserve worker: {error}") from None
    from shared.model_file import ModelFileError

    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise configuration_error(f"iterserve worker: --device {settings.device}, but torch sees no CUDA device "
                                  f"here (torch {torch.__version__}); --device auto runs on the CPU") from None

    try:
        if settings.group_size > 1:
            from services.worker.group import start_group

            return start_group(settings)
        return Engine.from_settings(settings)
    except ModelFileError as error:  # found only once the weights are opened (a tensor missing)
        log.error("event=bad_model error=%s", error)
        raise configuration_error(f"iterserve worker: {error}") from None
    except KVPoolTooSmall as error:
        raise configuration_error(f"iterserve worker: {error}") from None


async def run_worker(settings: Settings, stop_event: asyncio.Event | None = None) -> None:
    torch.set_num_threads(settings.threads or threads_per_worker(settings.workers * settings.group_size))
    engine = await asyncio.to_thread(make_engine, settings)
    worker = Worker(settings, engine, settings.worker_id or new_worker_id())
    freeze_startup_heap("worker")
    try:
        await worker.serve(stop_event or asyncio.Event())
    except EngineBroken as broken:
        # serve() has deregistered (its heartbeat key is gone): the scheduler moves its requests
        # at its next look, as for a killed worker. Exit non-zero so a supervisor restarts it.
        log.error("event=engine_broken worker=%s error=%s cause=%r", worker.worker_id, broken, broken.__cause__)
        raise SystemExit(ENGINE_BROKEN_EXIT_CODE) from None
    log.info("event=worker_stopped worker=%s", worker.worker_id)
