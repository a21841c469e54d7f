"""The gateway's side of the Redis protocol (docs/protocol.md): accept, follow, cancel, look up.

Every call is bounded: a Redis that is down or restarting makes a call fail with
ServiceUnavailable (HTTP 503) after REDIS_TIMEOUT_SECONDS instead of hanging the client.

No Redis command is ever cancelled: redis-py 8's asyncio client can swallow a cancellation that
lands mid-read (it turns it into a retried ConnectionError), leaving the task hung for good.
So each command runs in its own task; a caller that times out, or whose handler aiohttp
cancels because the client left, stops waiting and the command finishes on its own (an XREAD
within BLOCK_MS).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.gateway.errors import ServiceUnavailable
from shared import keys, prefix_anchors
from shared.keys import ModelKeys
from shared.messages import IterationRecord, PromptLogprobsChunk, RequestRecord, SchedulerInfo, TokenEvent, WorkerInfo
from shared.wire import WireError, decode, decode_token_event, encode

log = logging.getLogger("iterserve.gateway")

REDIS_TIMEOUT_SECONDS = 4.0  # one command; connect() retries inside this through a restart
BLOCK_MS = 1000  # one XREAD wait: also how often a follower checks on its client
STATUS_CHECK_EVERY = 5  # idle XREADs between looks at the request's status (a final event may never come)
# ... and a first look after one: a request Redis lost (follow_tokens) is found a second after its last token
OUTAGE_SECONDS = 30.0  # how long a follower rides out an unreachable Redis before giving up
MAX_RESUBMITS = 3  # times a follower submits again a request Redis lost (follow_tokens)
READ_COUNT = 256
TERMINAL_STATUSES = frozenset({"finished", "cancelled", "failed"})
STATUS_FINISH_REASON = {"finished": "stop", "cancelled": "cancelled", "failed": "error"}

T = TypeVar("T")

# KEYS: request_key(id), the model's cancel stream; ARGV: id, CANCEL_FLAG.
CANCEL_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[2], '1') end
return redis.call('XADD', KEYS[2], '*', 'id', ARGV[1])
"""


@dataclass(frozen=True)
class RequestState:
    status: str
    finish_reason: str | None
    record: RequestRecord | None  # None when the stored record does not decode
    model: str = ""  # the API name of the model it was sent to ("" for requests stored before models had names)
    tool_format: str = ""  # its answer may hold tool calls in this format (services/gateway/tools.py)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class ClusterView:
    """What the heartbeat keys say: the scheduler (several: summed) and every live worker."""

    scheduler: SchedulerInfo | None
    scheduler_key_exists: bool
    workers: list[WorkerInfo]
    live_worker_ids: list[str]
    registered_worker_ids: list[str]
    active_requests: int
    counters: dict[str, int] = field(default_factory=dict)  # the scheduler's lasting counters (ModelKeys.counters)
    schedulers: list[SchedulerInfo] = field(default_factory=list)  # each one's heartbeat


def summed_schedulers(infos: list[SchedulerInfo]) -> SchedulerInfo:
    """Several schedulers of one model as one: the pool's counts and totals summed, the latest
    times, every executor, every worker's blocks."""
    first = infos[0]
    summed = {name: sum(getattr(info, name) for info in infos) for name in (
        "iterations", "waiting", "running", "waiting_tokens", "cpu_seconds", "round_trips", "plans",
        "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prefix_cache_mismatches")}
    phases: dict[str, float] = {}
    for info in infos:
        for phase, seconds in info.phase_cpu_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    # (requests none has taken yet wait too: counted once)
    summed["waiting"] += max(info.unclaimed for info in infos)
    return first.model_copy(update=summed | {
        "heartbeat_at": max(info.heartbeat_at for info in infos),
        "last_iteration_at": max(info.last_iteration_at for info in infos),
        "started_at": min(info.started_at for info in infos),
        "phase_cpu_seconds": phases,
        "kv_blocks": {worker: blocks for info in infos for worker, blocks in info.kv_blocks.items()},
        "executors": sorted({executor for info in infos for executor in info.executors}),
        "cpus": sorted({cpu for info in infos for cpu in info.cpus}),
        "leases": {worker: fence for info in infos for worker, fence in info.leases.items()},
        "unclaimed": max(info.unclaimed for info in infos),
        "scheduler_id": "",
    })


class Store:
    """The gateway's Redis client with every call bounded and none ever cancelled."""

    def __init__(self, redis: aioredis.Redis, wait_replicas: int = 0, wait_ms: int = 1000,
                 unreplicated: Callable[[], None] = lambda: None, sharded: bool = False) -> None:
        """wait_replicas: a request is accepted once this many replicas hold it, or after wait_ms
        (then `unreplicated` is called). sharded: several schedulers a model (Settings.schedulers):
        a new request's entry says what they choose by (services/scheduler/shards.py, CLAIM_SCRIPT)."""
        self.redis = redis
        self.sharded = sharded
        self.wait_replicas, self.wait_ms, self.unreplicated = wait_replicas, wait_ms, unreplicated
        self._calls: set[asyncio.Task] = set()
        self._cancel_script = redis.register_script(CANCEL_SCRIPT)

    async def _call(
        self,
        call: Coroutine[Any, Any, T],
        timeout: float = REDIS_TIMEOUT_SECONDS,
        on_late_success: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> T:
        """The call's result, or ServiceUnavailable when Redis errs or does not answer in time.

        on_late_success runs (in the background) when the caller stopped waiting, by timeout or
        cancellation, and the command then succeeded anyway.
        """
        task = asyncio.ensure_future(call)
        self._track(task)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)  # a cancelled caller leaves the task running
        finally:
            if on_late_success is not None and not task.done():
                task.add_done_callback(lambda finished: self._after_late_success(finished, on_late_success))
        if not done:
            raise ServiceUnavailable("redis did not answer in time")
        try:
            return task.result()
        except (RedisError, OSError) as error:
            raise ServiceUnavailable(f"redis: {type(error).__name__}") from error

    def _track(self, task: asyncio.Task) -> None:
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        task.add_done_callback(_settle)

    def _after_late_success(self, task: asyncio.Task, then: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._track(asyncio.ensure_future(then()))

    async def aclose(self) -> None:
        """Let abandoned commands finish (an XREAD ends within BLOCK_MS), then close the client."""
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=BLOCK_MS / 1000 + 1)
        await self.redis.aclose()

    async def submit(self, record: RequestRecord, model: str = "", model_keys: ModelKeys = keys.SINGLE_MODEL,
                     tool_format: str = "") -> None:
        """Accept a request for a model: record, its pool's active set and new-request stream in one MULTI/EXEC.
        tool_format: its answer may hold tool calls in this format (a re-attached stream reads them).

        When the caller gives up first (its client left, or Redis was too slow) and the
        transaction commits anyway, the request is cancelled at once: nobody waits for it.
        """
        request_id = record.request_id

        async def transaction() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                fields = {"record": encode(record), "status": "waiting", "model": model}
                if tool_format:
                    fields["tool_format"] = tool_format
                pipe.hset(keys.request_key(request_id), mapping=fields)
                pipe.sadd(model_keys.active_requests, request_id)
                pipe.xadd(model_keys.new_requests, self._new_entry(record))
                await pipe.execute()
            if self.wait_replicas:  # accepted once a replica holds it: a failover loses no accepted request
                held_by = await self.redis.execute_command("WAIT", self.wait_replicas, self.wait_ms)
                if held_by < self.wait_replicas:
                    self.unreplicated()
                    log.warning("accepted without its replicas id=%s replicas=%d of %d after_ms=%d", request_id,
                                held_by, self.wait_replicas, self.wait_ms)

        async def cancel_orphan() -> None:
            log.info("accepted after its caller left, cancelling id=%s", request_id)
            try:
                await self.cancel(request_id, model_keys)
            except ServiceUnavailable as error:
                log.warning("cancel failed id=%s error=%s", request_id, error.message)

        await self._call(transaction(), on_late_success=cancel_orphan)

    def _new_entry(self, record: RequestRecord) -> dict[str, Any]:
        """A new-request entry: the id; for several schedulers also its client key (they take waiting
        requests key by key in turn), its prompt's length and its prefix anchors (the scheduler whose
        worker holds its prefix takes it: shared/prefix_anchors.py)."""
        if not self.sharded:
            return {"id": record.request_id}
        return {"id": record.request_id, "k": record.client_key, "n": len(record.prompt_token_ids),
                "a": prefix_anchors.packed(record.prompt_token_ids)}

    async def cancel(self, request_id: str, model_keys: ModelKeys = keys.SINGLE_MODEL) -> None:
        """Flag the request cancelled in its hash (read by a scheduler that loads it later), then
        tell its model's scheduler through the cancel stream, atomically. An expired request's hash
        is not brought back: the flag is set only on a key that exists."""
        await self._call(self._cancel_script(keys=[keys.request_key(request_id), model_keys.cancels],
                                             args=[request_id, keys.CANCEL_FLAG]))

    async def request_state(self, request_id: str) -> RequestState | None:
        """The request's status and record, or None when the request is unknown (or expired)."""
        raw = await self._call(self.redis.hgetall(keys.request_key(request_id)))
        if not raw:
            return None
        record = None
        if b"record" in raw:
            try:
                record = decode(RequestRecord, raw[b"record"])
            except WireError as error:
                log.warning("bad record id=%s error=%s", request_id, error)
        finish_reason = raw.get(b"finish_reason")
        return RequestState(
            status=raw.get(b"status", b"waiting").decode(errors="replace"),
            finish_reason=finish_reason.decode(errors="replace") if finish_reason else None,
            record=record,
            model=raw.get(b"model", b"").decode(errors="replace"),
            tool_format=raw.get(b"tool_format", b"").decode(errors="replace"),
        )

    async def prompt_logprobs_chunks(self, request_id: str) -> list[PromptLogprobsChunk]:
        """The prompt log-probabilities the workers wrote into the request's hash (malformed ones left out)."""
        raw = await self._call(self.redis.hgetall(keys.request_key(request_id)))
        prefix, chunks = keys.PROMPT_LOGPROBS_FIELD.encode(), []
        for name, value in (raw or {}).items():
            if name.startswith(prefix):
                try:
                    chunks.append(decode(PromptLogprobsChunk, value))
                except WireError as error:
                    log.warning("bad prompt logprobs id=%s field=%s error=%s", request_id, name, error)
        return chunks

    async def token_event_count(self, request_id: str) -> int:
        return await self._call(self.redis.xlen(keys.token_stream(request_id)))

    async def follow_tokens(self, request_id: str, start_index: int = 0,
                            resubmit: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[TokenEvent | None]:
        """Each TokenEvent from output index start_index on, ending with the final one.

        Yields None after every idle wait (about BLOCK_MS) so the caller can check on its client.
        When the request ended without a final event (its status is terminal, or its key is gone),
        yields a synthesized final event with token_id -1. Rides out a Redis outage of up to
        OUTAGE_SECONDS, then raises ServiceUnavailable.

        resubmit (the gateway that accepted the request, while it waits for it): a request whose key
        is gone while it has not ended (looked at after one idle wait, then every STATUS_CHECK_EVERY)
        was accepted in writes a restarted Redis lost (docs/operations.md, "fsync policy"); it is submitted
        again, as it was, up to MAX_RESUBMITS times, and followed on from the entry read last. Its
        output is the same again (seeded, and its entries' ids are their output indexes), so the
        reader misses nothing and sees nothing twice.
        """
        stream = keys.token_stream(request_id)
        last_entry_id: bytes | str = "0-0"
        idle_waits = resubmits = 0
        outage_since: float | None = None
        while True:
            try:
                reply = await self._call(
                    self.redis.xread({stream: last_entry_id}, count=READ_COUNT, block=BLOCK_MS),
                    BLOCK_MS / 1000 + REDIS_TIMEOUT_SECONDS,
                )
                outage_since = None
            except ServiceUnavailable:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > OUTAGE_SECONDS:
                    raise
                log.warning("redis unreachable while following id=%s, retrying", request_id)
                await asyncio.sleep(0.2)
                yield None
                continue
            entries = reply[0][1] if reply else []
            if not entries:
                idle_waits += 1
                if idle_waits == 1 or idle_waits % STATUS_CHECK_EVERY == 0:
                    state = await self.request_state(request_id)
                    if state is None and resubmit is not None and resubmits < MAX_RESUBMITS:
                        resubmits += 1
                        log.warning("request lost by Redis, submitted again id=%s after_entry=%s", request_id,
                                    last_entry_id.decode() if isinstance(last_entry_id, bytes) else last_entry_id)
                        await resubmit()
                        yield None
                        continue
                    final = await self._final_without_event(request_id, stream, last_entry_id, state)
                    if final is not None:
                        yield final
                        return
                yield None
                continue
            idle_waits = 0
            for entry_id, fields in entries:
                last_entry_id = entry_id
                event = _decode_event(request_id, fields)
                if event is None:
                    continue
                if event.index < start_index and event.token_id >= 0:
                    if event.finish_reason is None:
                        continue
                    event = event.model_copy(update={"text": ""})  # the reader has this token's text already
                yield event
                if event.finish_reason is not None:
                    return

    async def follow_iterations(self, streams: dict[str, str], backlog: int) -> AsyncIterator[
            list[tuple[str, IterationRecord]]]:
        """The iteration records of several models' streams (stream -> model name): the last
        `backlog` of each first, then each new one as it comes; an empty list after every idle wait
        (about BLOCK_MS) or Redis error, so the caller can check on its client."""
        positions: dict[str, bytes | str] = {}
        for stream, model in streams.items():
            try:
                entries = await self._call(self.redis.xrevrange(stream, count=backlog))
            except ServiceUnavailable:
                entries = []
            positions[stream] = entries[0][0] if entries else "0-0"
            yield [(model, record) for _, fields in reversed(entries) if (record := _decode_record(fields))]
        while True:
            try:
                reply = await self._call(self.redis.xread(positions, count=READ_COUNT, block=BLOCK_MS),
                                         BLOCK_MS / 1000 + REDIS_TIMEOUT_SECONDS)
            except ServiceUnavailable:
                await asyncio.sleep(0.2)
                yield []
                continue
            records = []
            for stream, entries in reply or []:
                name = stream.decode() if isinstance(stream, bytes) else stream
                for entry_id, fields in entries:
                    positions[name] = entry_id
                    record = _decode_record(fields)
                    if record is not None:
                        records.append((streams[name], record))
            yield records

    async def _final_without_event(
        self, request_id: str, stream: str, last_entry_id: bytes | str, state: RequestState | None
    ) -> TokenEvent | None:
        """A final event standing in for one that will never come, or None while the request lives
        (state: its status, just read)."""
        if state is not None and not state.terminal:
            return None
        # The scheduler may set the status just before it appends the final event: look once more.
        reply = await self._call(self.redis.xread({stream: last_entry_id}, count=READ_COUNT))
        if reply and reply[0][1]:
            return None  # more events arrived: the follower reads them next
        if state is None:
            log.warning("request vanished id=%s", request_id)
            reason = "error"
        else:
            reason = state.finish_reason or STATUS_FINISH_REASON.get(state.status, "error")
            log.warning("request ended without a final event id=%s status=%s", request_id, state.status)
        return TokenEvent(index=-1, token_id=-1, text="", finish_reason=reason)

    async def cluster_view(self, model_keys: ModelKeys = keys.SINGLE_MODEL,
                           timeout: float = REDIS_TIMEOUT_SECONDS) -> ClusterView:
        """One model's pool: its scheduler and workers."""
        async def read() -> ClusterView:
            redis = self.redis
            (scheduler, schedulers), members, active_requests, counters = await asyncio.gather(
                self._schedulers(model_keys),
                redis.smembers(model_keys.workers),
                redis.scard(model_keys.active_requests),
                redis.hgetall(model_keys.counters),
            )
            registered = sorted(member.decode(errors="replace") for member in members)
            heartbeat_keys = [keys.worker_heartbeat(worker_id) for worker_id in registered]
            values = await redis.mget(heartbeat_keys) if registered else []
            workers, live = [], []
            for worker_id, value in zip(registered, values, strict=True):
                if value is None:
                    continue
                live.append(worker_id)
                try:
                    workers.append(decode(WorkerInfo, value))
                except WireError as error:
                    log.warning("bad worker heartbeat worker=%s error=%s", worker_id, error)
            lasting = {}
            for name, value in counters.items():
                try:
                    lasting[name.decode()] = int(value)
                except (UnicodeDecodeError, ValueError):
                    log.warning("bad scheduler counter %r=%r", name[:40], value[:40])
            return ClusterView(scheduler, bool(schedulers), workers, live, registered, active_requests,
                               lasting, schedulers)

        return await self._call(read(), timeout)

    async def scheduler_info(self, model_keys: ModelKeys = keys.SINGLE_MODEL,
                             timeout: float = REDIS_TIMEOUT_SECONDS) -> SchedulerInfo | None:
        """A model's scheduler's last heartbeat, or None (no scheduler, or a heartbeat that does not decode)."""
        scheduler, _ = await self._call(self._schedulers(model_keys), timeout)
        return scheduler

    async def _schedulers(self, model_keys: ModelKeys) -> tuple[SchedulerInfo | None, list[SchedulerInfo]]:
        """A model's scheduler's heartbeat, or those of its several schedulers (Settings.schedulers
        > 1) summed into one (the pool's counts, for admission and /health), with each one's."""
        raw_one, ids = await asyncio.gather(self.redis.get(model_keys.scheduler_heartbeat),
                                            self.redis.smembers(model_keys.schedulers))
        names = sorted(member.decode(errors="replace") for member in ids)
        raws = ([raw_one] if raw_one is not None else []) + [
            raw for raw in (await self.redis.mget([model_keys.scheduler_heartbeat_of(name) for name in names])
                            if names else []) if raw is not None]
        infos = []
        for raw in raws:
            try:
                infos.append(decode(SchedulerInfo, raw))
            except WireError as error:
                log.warning("bad scheduler heartbeat error=%s", error)
        if not infos:
            return None, infos
        if len(infos) == 1 and not infos[0].scheduler_id:
            return infos[0], infos
        return summed_schedulers(infos), infos

    async def ping(self, timeout: float) -> bool:
        try:
            return bool(await self._call(self.redis.ping(), timeout))
        except ServiceUnavailable:
            return False


def _settle(task: asyncio.Task) -> None:
    """Retrieve an abandoned command's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _decode_record(fields: dict) -> IterationRecord | None:
    try:
        return decode(IterationRecord, fields.get(b"m", b""))
    except WireError as error:
        log.warning("bad iteration record error=%s", error)
        return None


def _decode_event(request_id: str, fields: dict) -> TokenEvent | None:
    try:
        return decode_token_event(fields[b"m"])
    except (KeyError, WireError) as error:
        log.warning("skipping malformed token event id=%s error=%s", request_id, error)
        return None
