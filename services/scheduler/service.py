"""The scheduler process: SchedulerPolicy's plans and results moved over Redis (docs/protocol.md).

One asyncio task, one loop; each turn:

    schedule()     workers' liveness (every few hundred ms), the requests that arrived, a plan for
                   every worker that can take one (up to pipeline_depth in flight each)
    round trip     every write the turn produced (plans, token events, ends, iteration records,
                   the heartbeat) and a wait (XREAD BLOCK) on the new-request, cancel and result
                   streams, in one Redis round trip (services/scheduler/redis_link.py)
    postprocess()  new requests to load, cancels, results: tokens into requests' output
                   (services/scheduler/output.py), finishes decided

So each worker runs at its own cadence: its next plan leaves as soon as its result is read.
The pieces: the policy (services/scheduler/policy.py: who runs, pure bookkeeping), recovery after
a restart (recovery.py), workers' liveness (liveness.py), requests' output (output.py), the
request-level baseline's held results (held_results.py), the compact plans (shared/plans.py).

Unexpected exceptions end the process: a bug could leave the bookkeeping half-applied, and a
restarted scheduler rebuilds everything from Redis. Redis being unreachable (or refusing writes)
is waited out, with backoff; a Redis restarted (a new run_id: it may have lost its last writes)
has the pool loaded again from what it kept, under a new epoch, in this same process.
"""

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgpack
from redis.exceptions import RedisError, ResponseError

from services.scheduler.held_results import ResultHolding
from services.scheduler.liveness import WorkerLiveness
from services.scheduler.output import RequestOutputs
from services.scheduler.policy import SchedulerPolicy
from services.scheduler.recovery import LOAD_BATCH, PoolLoader
from services.scheduler.shards import NewRequestEntry, ShardMembership, lease_problem
from services.scheduler.redis_link import (
    REDIS_SLACK_SECONDS,
    LeaseLost,
    RedisLink,
    RedisRestarted,
    RedisWritesRefused,
    TOKEN_ENTRY,
    SchedulerStateError,
    Write,
    bounded,
    text_of,
)
from shared import keys
from shared.config import Settings, executor_label
from shared.exits import configuration_error
from shared.messages import SchedulerInfo
from shared.model_file import load_metadata, serving_config
from shared.plans import ResultColumns, encode_plan, read_result, read_result_columns
from shared.speculative import ACCEPTANCE_COUNTERS, parse_speculative_config
from shared.redis_connection import RECONNECT_ERRORS, connect
from shared.startup_heap import freeze_startup_heap
from shared.tokenizer import Tokenizer
from shared.wire import WireError, encode, encode_row

log = logging.getLogger("iterserve.scheduler")

# Kept in Redis across restarts: the prefix cache's, and speculative decoding's (verification items,
# tokens proposed, proposals kept).
COUNTERS = ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "spec_drafts", "spec_draft_tokens",
            "spec_accepted_tokens")
# One of several schedulers takes new requests while its workers' batches have room, and this many
# more per worker it holds: the rest wait in Redis for whichever scheduler has room first.
WAITING_PER_WORKER = 4
PENDING_KEPT = 4 * LOAD_BATCH  # new request ids one of several schedulers keeps while it has no room
MAX_BLOCK_MS = 50  # longest XREAD BLOCK: timers (liveness, heartbeat) run between reads
BACKOFF_START_SECONDS, BACKOFF_CAP_SECONDS = 0.05, 2.0
PLAN_STREAM_MAXLEN = 1000  # a guard only: each worker trims its own plan stream as it reads it
# Where the scheduler's CPU time goes: choosing plans, encoding them, the Redis round trip (packing
# the writes and parsing what it read), decoding results, applying them to the bookkeeping, the
# requests' output (detokenization, stop strings, token events, iteration records), and what runs
# on timers, not per worker-iteration (workers' liveness, the heartbeat, the input streams' trims).
PHASES = ("plan", "encode", "redis", "decode", "apply", "fanout", "timers")


class SchedulerService:
    def __init__(self, settings: Settings, redis: Any, tokenizer: Tokenizer, context_length: int,
                 epoch: str | None = None) -> None:
        self.settings, self.redis, self.tokenizer, self.context_length = settings, redis, tokenizer, context_length
        self.started_at = time.time()
        self.last_iteration_at = 0.0
        self.iterations = 0
        self.phase_cpu = dict.fromkeys(PHASES, 0.0)  # CPU seconds of each phase, since the start
        self.round_trips = 0
        self.plans = 0  # sent since the start (a plan of several steps is one)
        self._poll_interval = min(0.25, settings.heartbeat_seconds / 2)
        self._begin(epoch or self._new_epoch())

    def _new_epoch(self) -> str:
        """A new epoch; one of several schedulers' says so (its workers answer it by its lease)."""
        return (keys.SHARDED_EPOCH_PREFIX if self.settings.schedulers > 1 else "") + uuid.uuid4().hex

    def _begin(self, epoch: str) -> None:
        """Everything a scheduler knows of the pool, empty, under a new epoch: at start, and when
        Redis restarted (it may have lost its last writes: the pool is loaded again from what it
        kept, as a new scheduler would, and the workers drop their KV on the new epoch)."""
        settings = self.settings
        self.epoch = epoch
        self.policy = SchedulerPolicy(
            self.epoch,
            context_length=self.context_length,
            stop_token_ids=self.tokenizer.stop_token_ids,
            policy=settings.policy,
            max_batch_size=settings.max_batch_size,
            pipeline_depth=settings.pipeline_depth,
            answer_every=settings.answer_every,
            scheduler_steps=settings.scheduler_steps,
            plan_seconds=settings.scheduler_plan_ms / 1000,
            max_batch_tokens=settings.max_batch_tokens,
            prefix_caching=settings.prefix_caching,
            placement=settings.placement,
            placement_slack=settings.placement_slack,
            placement_threshold=settings.placement_threshold,
            cache_salt=settings.model_group or settings.model,
            text_context=self.tokenizer.text_context if settings.worker_token_entries else None,
            speculative=parse_speculative_config(settings.speculative_config),
        )
        sharded = settings.schedulers > 1  # one of several: its id is its epoch (services/scheduler/shards.py)
        self.link = RedisLink(self.redis, on_write_failed=self._write_failed,
                              model_keys=keys.ModelKeys(settings.model_group), scheduler_id=epoch if sharded else "")
        self.shards = ShardMembership(self.link, epoch, settings.scheduler_lease_ms) if sharded else None
        self.holding = ResultHolding(settings.policy == "request" and settings.request_results == "batch")
        self.outputs = RequestOutputs(self.tokenizer, self.policy, self.link, self.holding,
                                      settings.request_ttl_seconds)
        self.liveness = WorkerLiveness(self.link, self.policy, settings.stall_seconds, self.shards, self._room,
                                       lambda: not self._pending_new)
        self.loader = PoolLoader(self.link, self.policy, self.outputs, settings.request_ttl_seconds, self._cancel)
        self._pending_new: list[NewRequestEntry] = []  # read from NEW_REQUESTS_STREAM, not loaded yet
        self._cancels_unheld: list[str] = []  # one of several: cancels of requests it does not hold
        self._loaded = False
        self._next_poll = 0.0
        self._next_heartbeat = 0.0
        self._published_counts: tuple[int, int, tuple[str, ...]] | None = None
        self._counted = dict.fromkeys((*COUNTERS, *ACCEPTANCE_COUNTERS), 0)  # the counters as last added to Redis's totals

    # Running

    async def run(self, stop_event: asyncio.Event) -> None:
        log.info("scheduler_started epoch=%s policy=%s pid=%d executor=%s", self.epoch, self.settings.policy,
                 os.getpid(), executor_label(self.settings))
        backoff = BACKOFF_START_SECONDS
        task = asyncio.current_task()
        while not stop_event.is_set():
            if task is not None and task.cancelling():
                # A cancel swallowed below us (redis-py sends with asyncio.wait_for, which before
                # Python 3.12 can drop a cancel that arrives as the send completes): honour it.
                raise asyncio.CancelledError
            try:
                if not self._loaded:
                    if self.shards is None:
                        await self.loader.load_state(self.epoch)
                    else:
                        await self.loader.load_shard_state(self.epoch)
                    self._loaded = True
                await self.turn()
                backoff = BACKOFF_START_SECONDS
            except LeaseLost as lost:
                epoch = self._new_epoch()
                log.warning("lease_lost scheduler_id=%s new_scheduler_id=%s requests=%d error=%s", self.epoch, epoch,
                            self.policy.waiting_count + self.policy.running_count, lost)
                with contextlib.suppress(*RECONNECT_ERRORS):
                    await self.link.exchange.close()
                self._begin(epoch)
            except RedisRestarted as restart:
                epoch = self._new_epoch()
                log.warning("redis_restarted run_id=%s was=%s epoch=%s new_epoch=%s requests=%d", restart.run_id,
                            restart.was, self.epoch, epoch, self.policy.waiting_count + self.policy.running_count)
                with contextlib.suppress(*RECONNECT_ERRORS):
                    await self.link.exchange.close()
                self._begin(epoch)
            except (*RECONNECT_ERRORS, asyncio.TimeoutError, RedisWritesRefused) as error:
                log.warning("redis_unavailable error=%s:%s retry_in=%.2fs", type(error).__name__, error, backoff)
                self._next_poll = 0.0  # before any write: is it the same Redis (liveness.poll)?
                await self._sleep(stop_event, backoff)
                backoff = min(backoff * 2, BACKOFF_CAP_SECONDS)
            # Anything else is a bug or a Redis that disagrees with our memory: carrying on could run
            # on half-applied bookkeeping, so it ends the process (the restart rebuilds from Redis).
        await self._shutdown()

    @staticmethod
    async def _sleep(stop_event: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await bounded(stop_event.wait(), seconds)

    async def _shutdown(self) -> None:
        """Best effort: write what is pending and take the heartbeat key down."""
        try:
            self.link.queue("delete", self._heartbeat_key)
            if self.shards is not None:
                self.shards.queue_release()  # the others take over at their next poll
            await bounded(self.link.round_trip(block_ms=None, read=False), REDIS_SLACK_SECONDS)
        except (*RECONNECT_ERRORS, asyncio.TimeoutError, RedisError, SchedulerStateError, LeaseLost) as error:
            log.warning("shutdown_write_failed error=%r", error)
        log.info("scheduler_stopped epoch=%s iterations=%d", self.epoch, self.iterations)

    async def _let_go_without_workers(self) -> None:
        """One of several schedulers holding requests but no live worker that takes them, while another
        holds one (its workers died, were cut off, or are stopping: their requests were handed over):
        it lets go of everything (its lease deleted, so the others take it over at their next poll, its
        requests with their output so far) and joins again. What it queued (a dead worker's keys
        deleted, a stopping one's requests freed) goes first, in the same transaction."""
        if self.policy.takes_requests or not self.liveness.others_holding or \
                not (self.policy.waiting_count or self.policy.running_count or self.liveness.claimed):
            return
        if self.policy.running_count or self.policy.frees_unsent:
            # Running on a stopping worker that nobody else takes (they finish there), or handed
            # over and not yet freed there (its next plan frees them, once its plans in flight are
            # answered: then it drains at once rather than after drain_seconds).
            return
        log.warning("no_worker_letting_go scheduler_id=%s requests=%d", self.epoch, self.policy.waiting_count)
        self.link.queue("delete", self.shards.lease_key)
        await bounded(self.link.round_trip(block_ms=None, read=False), REDIS_SLACK_SECONDS)
        raise LeaseLost(f"scheduler {self.epoch}: no live worker; its requests go to the others")

    @property
    def _heartbeat_key(self) -> str:
        model_keys = self.link.keys
        return model_keys.scheduler_heartbeat if self.shards is None else model_keys.scheduler_heartbeat_of(self.epoch)

    @property
    def _prefix_aware(self) -> bool:
        return self.settings.prefix_caching and self.settings.placement == "cache-aware"

    def _name_prefixes_held(self, requests: list) -> None:
        """One of several, prefix-aware: the prefixes of requests it loaded or ended (ids or states)
        are named its own (shared/prefix_anchors.py), so the next request sharing one comes here."""
        if self.shards is None or not self._prefix_aware or not requests:
            return
        states = [self.policy.get(request) if isinstance(request, str) else request for request in requests]
        self.shards.queue_anchors([state.tokens(0, state.total_tokens) for state in states if state is not None])

    def _room(self) -> int:
        """How many new requests to load now: all there are for the one scheduler; one of several
        takes as many as its workers' batches hold, and WAITING_PER_WORKER more per worker."""
        if self.shards is None:
            return LOAD_BATCH
        places = len(self.policy.worker_ids) * (self.settings.max_batch_size + WAITING_PER_WORKER)
        return max(0, min(LOAD_BATCH, places - self.policy.waiting_count - self.policy.running_count))

    async def turn(self) -> None:
        await self.schedule()
        if (self._pending_new and self._room()) or self.liveness.claimed:
            block_ms = None  # more requests to load: do not wait
        else:
            until_timer = min(self._next_poll, self._next_heartbeat) - time.monotonic()
            block_ms = max(1, min(MAX_BLOCK_MS, int(until_timer * 1000)))
        started = time.process_time()
        entries = await self.link.round_trip(block_ms)
        self.phase_cpu["redis"] += time.process_time() - started
        self.round_trips += 1
        self.postprocess(entries)

    # Schedule: liveness, loading, plans

    async def schedule(self) -> None:
        now = time.monotonic()
        started = time.process_time()
        if now >= self._next_poll:
            await self.liveness.poll()
            self._next_poll = now + self._poll_interval
            if self.shards is not None:
                await self._let_go_without_workers()
        self.liveness.abandon_stalled_plans()
        self.phase_cpu["timers"] += time.process_time() - started
        if self._cancels_unheld:  # one of several: cancels of requests no scheduler may hold (no room anywhere)
            batch, self._cancels_unheld = await self.shards.take(self._cancels_unheld[:LOAD_BATCH]), []
            await self.loader.load_requests(batch)  # (each loaded request reads its cancel flag: it ends)
        if self.liveness.claimed:  # one of several: requests it took over, or found without a live owner
            batch = self.liveness.claimed[:LOAD_BATCH]
            await self.loader.load_requests(batch)
            del self.liveness.claimed[: len(batch)]
            self._name_prefixes_held(batch)
        room = self._room()
        if self._pending_new and room:
            if self.shards is None:
                batch = [new.request_id for new in self._pending_new[:room]]
                del self._pending_new[: len(batch)]
            else:  # those it takes (key by key in turn; a prefix another's worker holds is left to it)
                batch, forget = await self.shards.claim(self._pending_new, room, self.settings.placement_threshold,
                                                        self._prefix_aware)
                settled = set(batch) | set(forget)
                self._pending_new = [new for new in self._pending_new if new.request_id not in settled]
            await self.loader.load_requests(batch)
            self._name_prefixes_held(batch)
        self._dispatch()
        if self.policy.ended:
            self._name_prefixes_held(self.policy.ended)
            self.policy.ended.clear()
        started = time.process_time()
        if now >= self._next_heartbeat or self._published_counts != self._counts():
            if now >= self._next_heartbeat:
                self.link.queue_trims()
            self._queue_heartbeat()
            self._next_heartbeat = now + self.settings.heartbeat_seconds
        elif self.link.trim_due:
            self.link.queue_trims()
        self.phase_cpu["timers"] += time.process_time() - started

    def _dispatch(self) -> None:
        """Write the results of request-level batches that are done, then send every plan the
        workers can take now: with pipelining, up to pipeline_depth each (a worker group of
        several pipeline stages: one per stage), in groups of answer_every."""
        started = time.process_time()
        self.link.extend(self.holding.release_finished_batches(self.policy))
        self.phase_cpu["fanout"] += time.process_time() - started
        for _ in range(self.policy.max_depth):
            if not any([self._send_plans(worker_id) for worker_id in self.policy.idle_workers()]):
                break
        started = time.process_time()
        self.outputs.publish_finished_without_token()
        self.phase_cpu["fanout"] += time.process_time() - started

    def _send_plans(self, worker_id: str) -> bool:
        """The worker's next group of plans (one, unless answer_every): every plan of it but the
        last says "answer with the next" (the worker holds its result for the next one's, so the
        group's results come back in one write and are read in one round trip)."""
        plans = []
        for _ in range(self.policy.group(worker_id)):
            started = time.process_time()
            plan = self.policy.next_plan(worker_id)
            planned = time.process_time()
            self.phase_cpu["plan"] += planned - started
            if plan is None:
                break
            plans.append(plan)
            for request_id in self.policy.joined(worker_id):  # (the others have stepped before: marked then)
                self.outputs.mark_running(request_id)
            self.phase_cpu["encode"] += time.process_time() - planned
        if not plans:
            return False
        self.plans += len(plans)
        started = time.process_time()
        stream = keys.plan_stream(worker_id)
        for plan in plans:
            plan.answer_with_next = plan is not plans[-1]
            self.link.queue("xadd", stream, {"m": encode_plan(plan)}, maxlen=PLAN_STREAM_MAXLEN, approximate=True)
            log.debug("plan_sent worker_id=%s plan_id=%d items=%d new=%d free=%d", worker_id, plan.plan_id,
                      plan.item_count, len(plan.new_requests), len(plan.free_request_ids))
        self.phase_cpu["encode"] += time.process_time() - started
        return True

    # Postprocess: what the round trip read

    def postprocess(self, entries: Iterable) -> None:
        by_stream = {text_of(stream): items for stream, items in entries or ()}
        for entry_id, fields in by_stream.get(self.link.keys.new_requests, ()):
            self.link.note_read(self.link.keys.new_requests, entry_id)
            request_id = keys.valid_request_id(fields.get(b"id"))
            if not request_id:
                log.warning("malformed_new_request entry=%s", text_of(entry_id))
                continue
            self._pending_new.append(NewRequestEntry(request_id) if self.shards is None else
                                     NewRequestEntry.of_entry(request_id, fields))
        if self.shards is not None and len(self._pending_new) > PENDING_KEPT:
            # One of several without room for long: the oldest it read are others' by now, or wait
            # unowned in Redis, where a poll of whichever scheduler has room takes them.
            del self._pending_new[:-PENDING_KEPT]
        for entry_id, fields in by_stream.get(self.link.keys.cancels, ()):
            self.link.note_read(self.link.keys.cancels, entry_id)
            request_id = keys.valid_request_id(fields.get(b"id"))
            if not request_id:
                log.warning("malformed_cancel entry=%s", text_of(entry_id))
                continue
            self._cancel(request_id)
        for entry_id, fields in by_stream.get(self.link.results, ()):
            self.link.note_read(self.link.results, entry_id)
            started = time.process_time()
            try:
                worker_id, raw = read_result(fields.get(b"m", b""))
                if self.policy.worker(worker_id) is None:
                    continue  # a worker given up on (or never planned for): nothing of it is awaited
                result = read_result_columns(raw)
            except WireError as error:
                log.warning("malformed_result entry=%s error=%s", text_of(entry_id), error)
                continue
            finally:
                self.phase_cpu["decode"] += time.process_time() - started
            self._take_result(result)
            if b"f" in fields:
                self._entries_failed(fields[b"f"])

    def _cancel(self, request_id: str) -> None:
        self.link.extend(self.holding.release(request_id))
        state = self.policy.cancel(request_id)
        if state is None:
            if self.shards is not None and request_id not in self.outputs.recently_finished:
                self._cancels_unheld.append(request_id)  # (another's, or nobody's: then it ends it)
            return  # ended already, or not loaded yet: loading it reads its cancel flag
        self.outputs.cancelled(state)

    def _take_result(self, result: ResultColumns) -> None:
        """A worker's answer applied (the answer to a plan of several steps: whole, or a step at a
        time: SchedulerPolicy.answers_to_apply)."""
        started = time.process_time()
        answers = self.policy.answers_to_apply(result)
        self.phase_cpu["apply"] += time.process_time() - started
        for answer in answers:
            self._apply_result(answer)

    def _apply_result(self, result: ResultColumns) -> None:
        """An answer applied, its tokens published and its iteration records written."""
        started = time.process_time()
        outcomes = self.policy.on_result(result)
        applied = time.process_time()
        self.phase_cpu["apply"] += applied - started
        # (may end requests on stop strings: before the records)
        self.outputs.publish_tokens(outcomes, result.worker_id)
        self.outputs.publish_finished_without_token()
        records = self.policy.take_iteration_records()
        self.phase_cpu["fanout"] += time.process_time() - applied
        if not records:
            log.debug("stale_result worker_id=%s plan_id=%d", result.worker_id, result.plan_id)
            return
        self.iterations += len(records)
        self.last_iteration_at = time.time()
        if self.settings.iteration_records:
            for record in records:
                self.link.queue("xadd", self.link.keys.iterations, {"m": encode_row(record)},
                                maxlen=self.settings.iteration_records, approximate=False)

    def _write_failed(self, write: Write, error: Exception) -> None:
        self.outputs.write_failed(write, error)

    def _entries_failed(self, data: bytes) -> None:
        """Requests whose token entry a worker could not write, for its key (a result's field `f`:
        services/worker/token_writer.py): they fail, as when a write of the scheduler's fails so."""
        try:
            request_ids = msgpack.unpackb(data, raw=False)
        except Exception:  # msgpack raises several unrelated types for bad input
            request_ids = None
        if not isinstance(request_ids, list):
            log.warning("malformed_failed_entries data=%r", data[:100])
            return
        for request_id in filter(None, map(keys.valid_request_id, request_ids)):
            self._write_failed(Write(TOKEN_ENTRY, (keys.token_stream(request_id),), {}, request_id),
                               ResponseError("a worker's token entry failed for its key"))

    # The heartbeat

    def _counts(self) -> tuple[int, int, tuple[str, ...]]:
        """What a reader must never see stale: the pool's counts, and the executors of the live workers
        (the gateway labels every answer with them from the moment /health says ready)."""
        return self.policy.waiting_count, self.policy.running_count, self._executors()

    def _executors(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.liveness.executors.values())))

    def _queue_heartbeat(self) -> None:
        """The heartbeat carries the pool's counts for /status; it goes first in the next round trip,
        so a reader never sees a request gone from the active set while the counts still hold it."""
        now = time.time()
        self._published_counts = self._counts()
        info = SchedulerInfo(
            pid=os.getpid(), policy=self.settings.policy, started_at=self.started_at, heartbeat_at=now,
            last_iteration_at=self.last_iteration_at, iterations=self.iterations,
            waiting=self.policy.waiting_count, running=self.policy.running_count,
            waiting_tokens=self.policy.waiting_tokens, cpu_seconds=time.process_time(),
            phase_cpu_seconds=dict(self.phase_cpu), round_trips=self.round_trips, plans=self.plans,
            prefix_cache_queried_tokens=self.policy.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.policy.prefix_cache_hit_tokens,
            prefix_cache_mismatches=self.policy.prefix_cache_mismatches,
            kv_blocks=self.policy.kv_blocks_by_worker(), cpus=sorted(os.sched_getaffinity(0)),
            executors=list(self._executors()),
            scheduler_id=self.epoch if self.shards is not None else "",
            leases=dict(self.shards.fences) if self.shards is not None else {},
            unclaimed=self.shards.unclaimed if self.shards is not None else 0,
            speculative_method=self.policy.speculative.method if self.policy.speculative else "",
            num_speculative_tokens=self.policy.speculative.num_speculative_tokens if self.policy.speculative else 0,
        )
        self.link.queue_first(Write("set", (self._heartbeat_key, encode(info)),
                                    {"px": int(self.settings.scheduler_timeout_seconds * 1000)}))
        # The counters that outlive this process (vLLM's prefix-cache counters, read by /metrics):
        # what was counted since the last heartbeat, added to Redis's totals.
        totals = {name: getattr(self.policy, name) for name in COUNTERS} | self.policy.spec_request_acceptance
        for name, counted in totals.items():
            if counted != self._counted[name]:
                self.link.queue("hincrby", self.link.keys.counters, name, counted - self._counted[name])
                self._counted[name] = counted


async def run_scheduler(settings: Settings, stop_event: asyncio.Event | None = None) -> None:
    """Run the scheduler until stop_event is set (or, without one, until SIGTERM/SIGINT)."""
    installed: list[int] = []
    if stop_event is None:
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal_number, stop_event.set)
                installed.append(signal_number)
    metadata = load_metadata(settings.model)
    tokenizer = Tokenizer.for_serving(settings.model, settings.tokenizer, settings.chat_template)
    redis = connect(settings.redis_url)
    if settings.schedulers > 1 and (problem := await lease_problem(redis, keys.ModelKeys(settings.model_group))):
        await redis.aclose()
        raise configuration_error(f"iterserve scheduler --schedulers {settings.schedulers}: {problem}")
    service = SchedulerService(settings, redis, tokenizer,
                               serving_config(metadata.config, settings.max_model_len).context_length)
    freeze_startup_heap("scheduler")
    try:
        await service.run(stop_event)
    finally:
        for signal_number in installed:
            asyncio.get_running_loop().remove_signal_handler(signal_number)
        with contextlib.suppress(Exception):
            await bounded(redis.aclose(), 5)
