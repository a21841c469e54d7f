"""The scheduler process: moves SchedulerPolicy's plans and results over Redis (docs/protocol.md).

One asyncio task, one loop. Each turn: check worker liveness (every few hundred ms), load the
requests that arrived, send a plan to every idle worker that has work, then in one Redis round
trip write everything the turn produced (plans, output tokens, finishes, iteration records)
and wait briefly (XREAD BLOCK) on the new-request, cancel and result streams at once. So each
worker runs at its own cadence: its next plan leaves as soon as its result is read.

Output token i of a request is stream entry id 0-(i+1) of its token stream: a write repeated
after a lost reply, or by a restarted scheduler, is refused by Redis instead of duplicated.

With `--policy request --request-results batch` (Orca's request-level baseline) a request's
token events and end are held here while its batch runs and written when the worker's whole
batch is done; a scheduler restart loses only held writes, which the rebuilt requests redo.
"""

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
from redis.exceptions import ExecAbortError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from services.scheduler.policy import SchedulerPolicy, TokenOutcome, status_for
from services.scheduler.request_state import RequestState
from shared import keys
from shared.config import Settings
from shared.messages import (
    FinishReason,
    PlanResult,
    RequestRecord,
    SchedulerInfo,
    TokenEvent,
    WorkerInfo,
)
from shared.model_file import load_metadata
from shared.redis_connection import RECONNECT_ERRORS, connect
from shared.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, held_back_length
from shared.plans import PlanCodec, read_result
from shared.wire import WireError, decode, decode_token_event, encode, encode_token_event

log = logging.getLogger("iterserve.scheduler")
T = TypeVar("T")

READ_COUNT = 512  # entries per stream per XREAD
LOAD_BATCH = 256  # requests loaded per round trip
MAX_BLOCK_MS = 50  # longest XREAD BLOCK: timers (liveness, heartbeat) run between reads
REDIS_SLACK_SECONDS = 10.0  # a Redis call may take this much longer than its own block time
BACKOFF_START_SECONDS, BACKOFF_CAP_SECONDS = 0.05, 2.0
PLAN_STREAM_MAXLEN = 1000  # a guard only: each worker trims its own plan stream as it reads it
# The input streams are trimmed to the scheduler's own read position (nobody else reads them, and
# a restarted scheduler starts from the active set, not from them): after this many entries read,
# or on the heartbeat timer, whichever comes first.
TRIM_EVERY_ENTRIES = 256
REMEMBERED_IDS = 100_000  # recently finished ids: a duplicate new-request entry is not loaded again
# Every token entry of a round trip in one command: XADD, server side, for each (key, id, payload) of
# a msgpack array; an entry written before (a round trip sent again) is skipped; the reply lists
# (position, error) of the entries that failed otherwise. EVAL with the script's text, not EVALSHA:
# a restarted Redis has no script cache, and an EVALSHA inside the round trip's MULTI would fail.
TOKENS_SCRIPT = """
local entries = cmsgpack.unpack(ARGV[1])
local failed = {}
for i = 1, #entries do
  local entry = entries[i]
  local reply = redis.pcall('XADD', entry[1], entry[2], 'm', entry[3])
  if type(reply) == 'table' and reply.err and not string.find(reply.err, 'equal or smaller', 1, true) then
    failed[#failed + 1] = i - 1
    failed[#failed + 1] = reply.err
  end
end
return failed
"""
TOKEN_ENTRY = "token"  # a Write's command for a token stream entry: args (stream key, entry id, payload)
# Redis refused a whole round trip's writes up front (EXECABORT): they are all sent again.
REFUSED_WRITES = (ExecAbortError, OutOfMemoryError, ReadOnlyError)
REFUSAL_PREFIXES = ("OOM", "READONLY", "MISCONF", "NOREPLICAS", "MASTERDOWN", "EXECABORT")


def refused_up_front(error: Exception) -> bool:
    """Redis refused a command before running it, for a reason that passes (memory, replication,
    persistence): retrying later is right."""
    return isinstance(error, REFUSED_WRITES) or str(error).startswith(REFUSAL_PREFIXES)


class RedisWritesRefused(RedisError):
    """Redis refused the round trip's writes before running any (out of memory, a read-only
    replica, failing persistence): nothing was written, everything is sent again after a backoff."""


class SchedulerStateError(Exception):
    """A write to a key the scheduler owns failed inside Redis (e.g. a key of the wrong type): the
    scheduler's memory and Redis disagree, so the process stops and the restart path rebuilds."""


@dataclass(frozen=True)
class Write:
    """One Redis command of the next round trip."""

    command: str
    args: tuple
    kwargs: dict
    request_id: str | None = None  # the request whose keys it writes (None: a shared key)


@dataclass(eq=False)
class HeldResults:
    """A request's token events and end, not yet written: its request-level batch still runs."""

    worker_id: str
    writes: list["Write"] = field(default_factory=list)


async def bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """Await with a time limit. (asyncio.wait_for before 3.12 can swallow a cancellation that
    arrives as the awaited call completes, which would make the scheduler task unkillable.)"""
    async with asyncio.timeout(seconds):
        return await awaitable


def token_entry_id(index: int) -> str:
    return f"0-{index + 1}"


@dataclass(eq=False)
class OutputText:
    """A request's output text as streamed so far."""

    detokenizer: IncrementalDetokenizer
    emitted: int = 0  # characters of detokenizer.text already sent in TokenEvents
    checked: int = 0  # characters already searched for stop strings


class BoundedSet:
    """Insertion-ordered set that forgets its oldest members beyond a limit."""

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def add(self, item: str) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def discard(self, item: str) -> None:
        self._items.pop(item, None)

    def __contains__(self, item: object) -> bool:
        return item in self._items


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


class SchedulerService:
    def __init__(self, settings: Settings, redis: Any, tokenizer: Tokenizer, context_length: int,
                 epoch: str | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.tokenizer = tokenizer
        self.epoch = epoch or uuid.uuid4().hex
        self.policy = SchedulerPolicy(
            self.epoch,
            context_length=context_length,
            stop_token_ids=tokenizer.stop_token_ids,
            policy=settings.policy,
            max_batch_size=settings.max_batch_size,
            pipeline_depth=settings.pipeline_depth,
            max_batch_tokens=settings.max_batch_tokens,
        )
        self.started_at = time.time()
        self.last_iteration_at = 0.0
        self.iterations = 0
        self._outputs: dict[str, OutputText] = {}
        self._writes: list[Write] = []  # commands for the next round trip
        self._marked_running: set[str] = set()  # status "running" written in this run
        self._recently_finished = BoundedSet(REMEMBERED_IDS)
        self._write_failures = BoundedSet(REMEMBERED_IDS)  # requests failed for a write Redis refused
        self._pending_new: list[str] = []  # ids read from NEW_REQUESTS_STREAM, not loaded yet
        self._worker_started_at: dict[str, float] = {}
        self._codecs: dict[str, PlanCodec] = {}  # each worker's request handles and plans in flight
        self._stream_ids = {keys.NEW_REQUESTS_STREAM: "0-0", keys.CANCEL_STREAM: "0-0", keys.RESULTS_STREAM: "0-0"}
        self._trimmed_ids = dict(self._stream_ids)  # where each input stream was last trimmed
        self._read_since_trim = 0
        self._loaded = False
        self._poll_interval = min(0.25, settings.heartbeat_seconds / 2)
        self._next_poll = 0.0
        self._next_heartbeat = 0.0
        self._published_counts: tuple[int, int] | None = None
        self._holds_results = settings.policy == "request" and settings.request_results == "batch"
        self._held: dict[str, HeldResults] = {}  # request id -> its writes held until its batch ends

    # Running

    async def run(self, stop_event: asyncio.Event) -> None:
        log.info("scheduler_started epoch=%s policy=%s pid=%d", self.epoch, self.settings.policy, os.getpid())
        backoff = BACKOFF_START_SECONDS
        task = asyncio.current_task()
        while not stop_event.is_set():
            if task is not None and task.cancelling():
                # A cancel swallowed below us (redis-py sends with asyncio.wait_for, which before
                # Python 3.12 can drop a cancel that arrives as the send completes): honour it.
                raise asyncio.CancelledError
            try:
                if not self._loaded:
                    await self.load_state()
                await self.turn()
                backoff = BACKOFF_START_SECONDS
            except (*RECONNECT_ERRORS, asyncio.TimeoutError, RedisWritesRefused) as error:
                log.warning("redis_unavailable error=%s:%s retry_in=%.2fs", type(error).__name__, error, backoff)
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
            self._queue("delete", keys.SCHEDULER_HEARTBEAT)
            await bounded(self._round_trip(block_ms=None, read=False), REDIS_SLACK_SECONDS)
        except (*RECONNECT_ERRORS, asyncio.TimeoutError, RedisError, SchedulerStateError) as error:
            log.warning("shutdown_write_failed error=%r", error)
        log.info("scheduler_stopped epoch=%s iterations=%d", self.epoch, self.iterations)

    async def turn(self) -> None:
        now = time.monotonic()
        if now >= self._next_poll:
            await self.poll_workers()
            self._next_poll = now + self._poll_interval
        self._abandon_stalled_plans()
        if self._pending_new:
            batch = self._pending_new[:LOAD_BATCH]
            await self.load_requests(batch)
            del self._pending_new[: len(batch)]
        self._dispatch()
        if now >= self._next_heartbeat or self._published_counts != self._counts():
            if now >= self._next_heartbeat:
                self._queue_trims()
            self._queue_heartbeat()
            self._next_heartbeat = now + self.settings.heartbeat_seconds
        elif self._read_since_trim >= TRIM_EVERY_ENTRIES:
            self._queue_trims()
        if self._pending_new:
            block_ms = None  # more requests to load: do not wait
        else:
            until_timer = min(self._next_poll, self._next_heartbeat) - time.monotonic()
            block_ms = max(1, min(MAX_BLOCK_MS, int(until_timer * 1000)))
        entries = await self._round_trip(block_ms)
        self._handle_entries(entries)

    # Startup: rebuild the pool from Redis

    async def load_state(self) -> None:
        """Note where the streams end, then load every active request with its output so far.

        Cancels need no replay: the gateway flags a cancelled request in its hash as well as in the
        cancel stream, and loading a request reads that flag."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(keys.NEW_REQUESTS_STREAM, count=1)
        pipe.xrevrange(keys.CANCEL_STREAM, count=1)
        pipe.xrevrange(keys.RESULTS_STREAM, count=1)
        pipe.smembers(keys.ACTIVE_REQUESTS_SET)
        pipe.smembers(keys.WORKERS_SET)
        new_tail, cancel_tail, results_tail, active, workers = await bounded(pipe.execute(), REDIS_SLACK_SECONDS)
        for stream, tail in ((keys.NEW_REQUESTS_STREAM, new_tail), (keys.CANCEL_STREAM, cancel_tail),
                             (keys.RESULTS_STREAM, results_tail)):
            if tail:
                self._stream_ids[stream] = _text(tail[0][0])
        await self._delete_orphan_plan_streams(workers)
        active_ids = []
        for member in active:
            request_id = keys.valid_request_id(member)
            if request_id is None:
                log.warning("malformed_active_id member=%r", member[:80])
                self._queue("srem", keys.ACTIVE_REQUESTS_SET, member)
            else:
                active_ids.append(request_id)
        active_ids.sort()
        for start in range(0, len(active_ids), LOAD_BATCH):
            await self.load_requests(active_ids[start : start + LOAD_BATCH])
        self._loaded = True
        log.info("pool_loaded epoch=%s active=%d waiting=%d", self.epoch, len(active_ids), self.policy.waiting_count)

    async def _delete_orphan_plan_streams(self, registered: set[bytes]) -> None:
        """Plan streams of workers that are no longer registered (gone while no scheduler ran)."""
        prefix = keys.plan_stream("")
        orphans = []
        async for key in self.redis.scan_iter(match=prefix + "*", count=1000):
            worker_id = key[len(prefix):]
            if worker_id not in registered:
                orphans.append(key)
        for key in orphans:
            self._queue("delete", key)
        if orphans:
            log.info("orphan_plan_streams deleted=%d", len(orphans))

    async def load_requests(self, request_ids: list[str]) -> None:
        """Add requests (new ones, or active ones after a restart with their output so far)."""
        request_ids = [request_id for request_id in dict.fromkeys(request_ids)
                       if self.policy.get(request_id) is None and request_id not in self._recently_finished]
        if not request_ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hmget(keys.request_key(request_id), ["record", keys.CANCEL_FLAG])
            pipe.sismember(keys.ACTIVE_REQUESTS_SET, request_id)
            pipe.xrange(keys.token_stream(request_id))
        replies = await bounded(pipe.execute(raise_on_error=False), REDIS_SLACK_SECONDS)
        for position, request_id in enumerate(request_ids):
            fields, active, entries = replies[3 * position : 3 * position + 3]
            if isinstance(active, Exception):
                raise active  # the active set itself is broken: nothing here can be trusted
            if isinstance(fields, Exception) or isinstance(entries, Exception):
                # One request's keys hold the wrong type of value: that request cannot be served.
                log.error("unreadable_request request_id=%s error=%s", request_id,
                          fields if isinstance(fields, Exception) else entries)
                self._write_failures.add(request_id)
                self._write_end(request_id, "error", 0)
                continue
            raw_record, cancel_flag = fields
            self._load_one(request_id, raw_record, bool(active), entries, cancelled=cancel_flag is not None)
        self._publish_finished_without_token()

    def _load_one(self, request_id: str, raw_record: bytes | None, active: bool, entries: list,
                  cancelled: bool = False) -> None:
        if not active:
            return  # finished before we saw it (a duplicate stream entry, or a restart)
        events: dict[int, TokenEvent] = {}
        for entry_id, fields in entries:
            try:
                event = decode_token_event(fields.get(b"m", b""))
            except WireError as error:
                log.warning("malformed_token_event request_id=%s entry=%s error=%s", request_id, _text(entry_id), error)
                continue
            if event.finish_reason is not None:
                log.info("already_finished request_id=%s reason=%s", request_id, event.finish_reason)
                self._write_end(request_id, event.finish_reason, event.completion_tokens)
                return
            events.setdefault(event.index, event)
        output_token_ids: list[int] = []
        while len(output_token_ids) in events and events[len(output_token_ids)].token_id >= 0:
            output_token_ids.append(events[len(output_token_ids)].token_id)
        if raw_record is None:
            log.warning("request_without_record request_id=%s", request_id)
            self._queue("srem", keys.ACTIVE_REQUESTS_SET, request_id)
            ttl = self.settings.request_ttl_seconds  # whatever is left of it goes in time
            self._queue("expire", keys.request_key(request_id), ttl)
            self._queue("expire", keys.token_stream(request_id), ttl)
            return
        try:
            record = decode(RequestRecord, raw_record)
            if record.request_id != request_id:
                raise WireError(f"RequestRecord: request_id {record.request_id!r} under the key of {request_id!r}")
        except WireError as error:
            log.error("malformed_record request_id=%s error=%s", request_id, error)
            self._token_event(request_id, len(output_token_ids), -1, "", finish_reason="error")
            self._write_end(request_id, "error", len(output_token_ids))
            return
        output = OutputText(IncrementalDetokenizer(self.tokenizer, record.prompt_token_ids))
        for token_id in output_token_ids:
            output.detokenizer.push(token_id)
        output.emitted = sum(len(events[index].text) for index in range(len(output_token_ids)))
        output.checked = len(output.detokenizer.text)
        self._outputs[request_id] = output
        state = self.policy.add_request(record, output_token_ids)
        log.info("loaded request_id=%s prompt_tokens=%d output_tokens=%d", request_id,
                 len(record.prompt_token_ids), len(output_token_ids))
        if state.is_active and record.sampling.stop and find_stop(output.detokenizer.text, record.sampling.stop) != -1:
            self.policy.finish(request_id, "stop", without_token=True)  # output already holds a stop string
        if cancelled:
            self._cancel(request_id)

    # Workers

    async def poll_workers(self) -> None:
        """Liveness: a worker is alive while its heartbeat key exists."""
        members = await bounded(self.redis.smembers(keys.WORKERS_SET), REDIS_SLACK_SECONDS)
        worker_ids = []
        for member in members:
            try:
                worker_ids.append(member.decode())
            except UnicodeDecodeError:
                log.warning("malformed_worker_id member=%r", member[:80])
                self._queue("srem", keys.WORKERS_SET, member)
        worker_ids.sort()
        values = []
        if worker_ids:
            values = await bounded(
                self.redis.mget([keys.worker_heartbeat(worker_id) for worker_id in worker_ids]), REDIS_SLACK_SECONDS)
        seen = set()
        for worker_id, value in zip(worker_ids, values, strict=True):
            if value is None:
                if worker_id in self.policy.worker_ids:
                    log.warning("worker_dead worker_id=%s", worker_id)
                self._forget_worker(worker_id)
                continue
            try:
                info = decode(WorkerInfo, value)
            except WireError as error:
                log.warning("malformed_worker_info worker_id=%s error=%s", worker_id, error)
                seen.add(worker_id)  # alive, whatever it wrote: keep what we know
                continue
            seen.add(worker_id)
            started_at = self._worker_started_at.get(worker_id)
            if started_at is not None and started_at != info.started_at:
                log.warning("worker_restarted worker_id=%s", worker_id)
                self.policy.worker_down(worker_id)
                self._codecs.pop(worker_id, None)
            if worker_id not in self.policy.worker_ids:
                self.policy.worker_up(worker_id, info.kv_blocks_total, info.kv_block_size)
            self._worker_started_at[worker_id] = info.started_at
            self.policy.set_draining(worker_id, info.draining)
        for worker_id in self.policy.worker_ids:
            if worker_id not in seen:
                log.warning("worker_gone worker_id=%s", worker_id)
                self._forget_worker(worker_id)

    def _forget_worker(self, worker_id: str) -> None:
        """A dead or departed worker: its requests wait again (to be rebuilt elsewhere), and its
        registration and plan stream go (a worker that comes back under the same id re-registers,
        and its first plan tells it to drop whatever KV it still holds)."""
        self.policy.worker_down(worker_id)
        self._codecs.pop(worker_id, None)
        self._worker_started_at.pop(worker_id, None)
        self._queue("srem", keys.WORKERS_SET, worker_id)
        self._queue("delete", keys.plan_stream(worker_id))

    def _abandon_stalled_plans(self) -> None:
        """A plan or its result lost (e.g. Redis restarted without it): the worker would wait forever."""
        now = time.time()
        for worker_id in self.policy.worker_ids:
            worker = self.policy.worker(worker_id)
            if worker.in_flight and now - worker.in_flight[0].started_at > self.settings.stall_seconds:
                log.warning("plan_stalled worker_id=%s plan_id=%d", worker_id, worker.in_flight[0].plan.plan_id)
                codec = self._codecs.get(worker_id)
                for flight in worker.in_flight:
                    if codec is not None:
                        codec.forget(flight.plan.plan_id)
                self.policy.reset_worker(worker_id)

    def _dispatch(self) -> None:
        """Write the results of request-level batches that are done, then send every plan the
        workers can take now: with pipelining, up to pipeline_depth each."""
        self._release_finished_batches()
        for _ in range(self.policy.pipeline_depth):
            if not any([self._send_plan(worker_id) for worker_id in self.policy.idle_workers()]):
                break
        self._publish_finished_without_token()

    def _send_plan(self, worker_id: str) -> bool:
        plan = self.policy.next_plan(worker_id)
        if plan is None:
            return False
        codec = self._codecs.setdefault(worker_id, PlanCodec())
        self._queue("xadd", keys.plan_stream(worker_id), {"m": codec.encode(plan)},
                    maxlen=PLAN_STREAM_MAXLEN, approximate=True)
        for item in plan.items:
            if item.request_id not in self._marked_running:
                self._marked_running.add(item.request_id)
                self._queue("hset", keys.request_key(item.request_id), "status", "running")
        log.debug("plan_sent worker_id=%s plan_id=%d items=%d new=%d free=%d", worker_id, plan.plan_id,
                  len(plan.items), len(plan.new_requests), len(plan.free_request_ids))
        return True

    # Streams

    def _handle_entries(self, entries: Iterable) -> None:
        by_stream = {_text(stream): items for stream, items in entries or ()}
        self._read_since_trim += sum(len(items) for items in by_stream.values())
        for entry_id, fields in by_stream.get(keys.NEW_REQUESTS_STREAM, ()):
            self._stream_ids[keys.NEW_REQUESTS_STREAM] = _text(entry_id)
            request_id = keys.valid_request_id(fields.get(b"id"))
            if not request_id:
                log.warning("malformed_new_request entry=%s", _text(entry_id))
                continue
            self._pending_new.append(request_id)
        for entry_id, fields in by_stream.get(keys.CANCEL_STREAM, ()):
            self._stream_ids[keys.CANCEL_STREAM] = _text(entry_id)
            request_id = keys.valid_request_id(fields.get(b"id"))
            if not request_id:
                log.warning("malformed_cancel entry=%s", _text(entry_id))
                continue
            self._cancel(request_id)
        for entry_id, fields in by_stream.get(keys.RESULTS_STREAM, ()):
            self._stream_ids[keys.RESULTS_STREAM] = _text(entry_id)
            try:
                worker_id, raw = read_result(fields.get(b"m", b""))
                codec = self._codecs.get(worker_id)
                if codec is None:
                    continue  # a worker given up on (or never planned for): nothing of it is awaited
                result = codec.decode_result(raw)
            except WireError as error:
                log.warning("malformed_result entry=%s error=%s", _text(entry_id), error)
                continue
            self._apply_result(result)

    def _cancel(self, request_id: str) -> None:
        self._release_held(request_id)
        state = self.policy.cancel(request_id)
        if state is None:
            return  # ended already, or not loaded yet: loading it reads its cancel flag
        completion_tokens = len(state.output_token_ids)
        self._token_event(request_id, completion_tokens, -1, "", finish_reason="cancelled",
                          prompt_tokens=len(state.prompt_token_ids), completion_tokens=completion_tokens)
        self._write_end(request_id, "cancelled", completion_tokens)

    def _apply_result(self, result: PlanResult) -> None:
        for outcome in self.policy.on_result(result):
            if self._holds_results:
                self._hold(outcome.request_id, result.worker_id)
            self._publish_token(outcome)
        self._publish_finished_without_token()
        records = self.policy.take_iteration_records()
        if not records:
            log.debug("stale_result worker_id=%s plan_id=%d", result.worker_id, result.plan_id)
            return
        self.iterations += len(records)
        self.last_iteration_at = time.time()
        if self.settings.iteration_records:
            for record in records:
                self._queue("xadd", keys.ITERATIONS_STREAM, {"m": encode(record)},
                            maxlen=self.settings.iteration_records, approximate=False)

    # Output

    def _publish_token(self, outcome: TokenOutcome) -> None:
        state = outcome.request
        request_id = state.request_id
        output = self._outputs[request_id]
        finish = outcome.finish_reason
        output.detokenizer.push(outcome.token_id)
        if finish is not None:
            output.detokenizer.flush()
        text = output.detokenizer.text
        end = len(text)
        stop = state.sampling.stop
        if stop:
            found = find_stop(text, stop, output.checked)
            output.checked = len(text)
            if found != -1:
                end = found
                if finish is None:
                    self.policy.finish(request_id, "stop")
                finish = "stop"
            elif finish is None:
                end -= held_back_length(text, stop)  # might be the start of a stop string
        piece = text[output.emitted : end] if end > output.emitted else ""
        output.emitted = max(output.emitted, end)
        completion_tokens = len(state.output_token_ids)
        self._token_event(request_id, outcome.output_index, outcome.token_id, piece, finish_reason=finish,
                          prompt_tokens=len(state.prompt_token_ids) if finish else 0,
                          completion_tokens=completion_tokens if finish else 0,
                          logprob=outcome.logprob, top_logprobs=outcome.top_logprobs)
        if finish is not None:
            self._write_end(request_id, finish, completion_tokens)

    def _publish_finished_without_token(self) -> None:
        for state in self.policy.take_finished_without_token():
            self._final_event_without_token(state)

    def _final_event_without_token(self, state: RequestState) -> None:
        """A request that ended between tokens: release its held-back text in a token-less entry."""
        request_id = state.request_id
        reason = state.finish_reason or "error"
        piece = ""
        output = self._outputs.get(request_id)
        if output is not None and reason != "cancelled":
            output.detokenizer.flush()
            text = output.detokenizer.text
            end = len(text)
            if state.sampling.stop and (found := find_stop(text, state.sampling.stop)) != -1:
                end = found
            piece = text[output.emitted : end] if end > output.emitted else ""
        completion_tokens = len(state.output_token_ids)
        self._token_event(request_id, completion_tokens, -1, piece, finish_reason=reason,
                          prompt_tokens=len(state.prompt_token_ids), completion_tokens=completion_tokens)
        self._write_end(request_id, reason, completion_tokens)

    def _token_event(self, request_id: str, index: int, token_id: int, text: str, **rest: Any) -> None:
        """One entry of the request's token stream (batched with the round trip's others: one EVAL)."""
        self._write(request_id, TOKEN_ENTRY, keys.token_stream(request_id), token_entry_id(index),
                    encode_token_event(index, token_id, text, **rest))

    def _write_end(self, request_id: str, reason: FinishReason, completion_tokens: int) -> None:
        ttl = self.settings.request_ttl_seconds
        self._write(request_id, "hset", keys.request_key(request_id),
                    mapping={"status": status_for(reason), "finish_reason": reason})
        self._write(request_id, "srem", keys.ACTIVE_REQUESTS_SET, request_id)
        self._write(request_id, "expire", keys.request_key(request_id), ttl)
        self._write(request_id, "expire", keys.token_stream(request_id), ttl)
        self._outputs.pop(request_id, None)
        self._marked_running.discard(request_id)
        self._recently_finished.add(request_id)
        log.info("finished request_id=%s reason=%s completion_tokens=%d", request_id, reason, completion_tokens)

    # Request-level batches' results, held until the batch is done

    def _hold(self, request_id: str, worker_id: str) -> None:
        """Hold the request's writes until the batch it runs in on this worker is done."""
        held = self._held.setdefault(request_id, HeldResults(worker_id))
        held.worker_id = worker_id  # moved (rebuilt elsewhere): its earlier writes wait with it

    def _write(self, request_id: str, command: str, *args: Any, **kwargs: Any) -> None:
        """A write to one request's keys (held while its request-level batch runs)."""
        write = Write(command, args, kwargs, request_id)
        held = self._held.get(request_id)
        if held is None:
            self._writes.append(write)
        else:
            held.writes.append(write)

    def _release_held(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self._writes.extend(held.writes)

    def _release_finished_batches(self) -> None:
        """A worker whose batch is done (nothing running: all finished, or it went down) returns the
        results of every request held for it, in the order they were produced."""
        for request_id, held in list(self._held.items()):
            worker = self.policy.worker(held.worker_id)
            if worker is None or not worker.running:
                self._release_held(request_id)

    def _counts(self) -> tuple[int, int]:
        return self.policy.waiting_count, self.policy.running_count

    def _queue_heartbeat(self) -> None:
        """The heartbeat carries the pool's counts for /status; it goes first in the next round trip,
        so a reader never sees a request gone from the active set while the counts still hold it."""
        now = time.time()
        self._published_counts = self._counts()
        info = SchedulerInfo(
            pid=os.getpid(), policy=self.settings.policy, started_at=self.started_at, heartbeat_at=now,
            last_iteration_at=self.last_iteration_at, iterations=self.iterations,
            waiting=self.policy.waiting_count, running=self.policy.running_count,
            waiting_tokens=self.policy.waiting_tokens,
        )
        self._writes.insert(0, Write("set", (keys.SCHEDULER_HEARTBEAT, encode(info)),
                                     {"px": int(self.settings.scheduler_timeout_seconds * 1000)}))

    def _queue_trims(self) -> None:
        """Trim each input stream up to what this scheduler has read: nobody else reads them."""
        for stream, read_up_to in self._stream_ids.items():
            if read_up_to != self._trimmed_ids[stream]:
                self._queue("xtrim", stream, minid=read_up_to, approximate=False)  # keeps that last entry: a restart starts after it
                self._trimmed_ids[stream] = read_up_to
        self._read_since_trim = 0

    # Redis round trips

    def _queue(self, command: str, *args: Any, **kwargs: Any) -> None:
        self._writes.append(Write(command, args, kwargs))

    async def _round_trip(self, block_ms: int | None, read: bool = True) -> list:
        """Every queued write as one MULTI/EXEC, then one XREAD of the three input streams, in one
        pipeline (one network round trip).

        Writes leave the queue only once Redis has run them. A round trip lost to a connection
        error, or refused whole by Redis (EXECABORT: out of memory, a read-only replica, failing
        persistence refuse a transaction before any of it runs), is sent again by the next one, so
        no write is skipped and none reordered: a token stream never has a gap. A write that fails
        inside the transaction fails for its key (e.g. a key of the wrong type): a duplicate token
        entry is expected and skipped; any other error fails that request, or, on a shared key,
        stops the scheduler.
        """
        writes = list(self._writes)
        # The token entries all go in one EVAL, where the first of them stood: every write queued
        # after a request's last token (its end, its expiries) still runs after it.
        commands: list[Write | list[Write]] = []
        tokens: list[Write] | None = None
        for write in writes:
            if write.command != TOKEN_ENTRY:
                commands.append(write)
            elif tokens is None:
                tokens = [write]
                commands.append(tokens)
            else:
                tokens.append(write)
        pipe = self.redis.pipeline(transaction=False)
        if commands:
            pipe.execute_command("MULTI")
            for command in commands:
                if isinstance(command, list):
                    # use_bin_type=False: Redis's Lua cmsgpack reads only the raw string type
                    pipe.eval(TOKENS_SCRIPT, 0, msgpack.packb([write.args for write in command], use_bin_type=False))
                else:
                    getattr(pipe, command.command)(*command.args, **command.kwargs)
            pipe.execute_command("EXEC")
        if read:
            pipe.xread(dict(self._stream_ids), count=READ_COUNT, block=block_ms)
        wait_seconds = (block_ms or 0) / 1000 + REDIS_SLACK_SECONDS
        replies = await bounded(pipe.execute(raise_on_error=False), wait_seconds)
        if commands:
            outcomes = replies[len(commands) + 1]
            if isinstance(outcomes, Exception):
                first = next((reply for reply in replies[: len(commands) + 1] if isinstance(reply, Exception)),
                             outcomes)
                if not refused_up_front(first):
                    raise first  # a command Redis cannot parse: a bug
                raise RedisWritesRefused(f"{len(writes)} writes refused: {first}")
            del self._writes[: len(writes)]
            for command, outcome in zip(commands, outcomes, strict=True):
                if isinstance(command, list):
                    if isinstance(outcome, Exception):  # the script itself failed: no entry is known written
                        raise SchedulerStateError(f"writing {len(command)} token entries failed: {outcome}")
                    for position, message in zip(outcome[::2], outcome[1::2]):
                        self._write_failed(command[position], ResponseError(_text(message)))
                elif isinstance(outcome, Exception):
                    self._write_failed(command, outcome)
        if not read:
            return []
        entries = replies[-1]
        if isinstance(entries, Exception):
            raise entries
        return entries or []

    def _write_failed(self, write: Write, error: Exception) -> None:
        if write.command == "xadd" and write.request_id and "equal or smaller" in str(error):
            return  # this token entry was written before (a round trip sent again): nothing to redo
        key = write.args[0] if write.args else ""
        log.error("redis_write_failed command=%s key=%s request_id=%s error=%s", write.command, key,
                  write.request_id, error)
        if write.request_id is None:
            raise SchedulerStateError(f"{write.command} {key!r} failed in Redis: {error}")
        if write.request_id in self._write_failures:
            return  # its end was written (or failed) once already
        self._write_failures.add(write.request_id)
        # Its output can no longer be written whole: end it as failed, which its client is told
        # (the status in its hash, or, if that key is broken too, its key's absence, ends the follower).
        state = self.policy.finish(write.request_id, "error")
        if state is not None:
            self._held.pop(write.request_id, None)
            self._write_end(write.request_id, "error", len(state.output_token_ids))


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
    tokenizer = Tokenizer.load(settings.model)
    redis = connect(settings.redis_url)
    service = SchedulerService(settings, redis, tokenizer, metadata.config.context_length)
    try:
        await service.run(stop_event)
    finally:
        for signal_number in installed:
            asyncio.get_running_loop().remove_signal_handler(signal_number)
        with contextlib.suppress(Exception):
            await bounded(redis.aclose(), 5)
