"""A starting scheduler rebuilds the pool from Redis: every request of the active set, with its
output so far from its token stream (a restart loses no accepted request, and none is duplicated).
So does a running one when Redis restarted (a new run_id), which may have lost its last writes.

Cancels need no replay: the gateway flags a cancelled request in its hash as well as in the cancel
stream, and loading a request reads that flag. New requests are loaded the same way, a batch of
ids at a time, as the new-request stream names them.
"""

import logging
from collections.abc import Callable

from services.scheduler.output import RequestOutputs
from services.scheduler.policy import SchedulerPolicy
from services.scheduler.redis_link import REDIS_SLACK_SECONDS, RedisLink, bounded, text_of
from shared import keys
from shared.messages import RequestRecord, TokenEvent
from shared.redis_exchange import stream_entries
from shared.tokenizer import find_stop
from shared.wire import WireError, decode, decode_token_event

log = logging.getLogger("iterserve.scheduler")

LOAD_BATCH = 256  # requests loaded per round trip
# The pool is loaded under this epoch (ARGV[1]) from this Redis server: "EPOCH RUN_ID" into
# ModelKeys.incarnation, at one instant with reading the server's run_id, which comes back. From
# then on no worker writes an entry for a plan of an older epoch or from before a Redis restart.
INCARNATION_SCRIPT = f"""
local run_id = {keys.REDIS_RUN_ID_LUA}
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. run_id)
return run_id
"""


class PoolLoader:
    def __init__(self, link: RedisLink, policy: SchedulerPolicy, outputs: RequestOutputs, request_ttl_seconds: int,
                 cancel: Callable[[str], None]) -> None:
        self.link, self.policy, self.outputs = link, policy, outputs
        self.request_ttl_seconds = request_ttl_seconds
        self.cancel = cancel  # cancels a loaded request (its hash carries the gateway's cancel flag)

    async def load_state(self, epoch: str) -> None:
        """Take the pool for this epoch (the workers' entries of older plans are refused from now
        on, so the streams read below only grow by whole tokens of this epoch), note where the input
        streams end, then load every active request with its output so far."""
        redis = self.link.redis
        run_id = await bounded(redis.eval(INCARNATION_SCRIPT, 1, self.link.keys.incarnation, epoch),
                               REDIS_SLACK_SECONDS)
        self.link.run_id = text_of(run_id)
        pipe = redis.pipeline(transaction=False)
        for stream in self.link.input_streams:
            pipe.xrevrange(stream, count=1)
        pipe.smembers(self.link.keys.active_requests)
        pipe.smembers(self.link.keys.workers)
        *tails, active, workers = await bounded(pipe.execute(), REDIS_SLACK_SECONDS)
        for stream, tail in zip(self.link.input_streams, tails, strict=True):
            if tail:
                self.link.read_ids[stream] = text_of(tail[0][0])
        await self._delete_orphan_plan_streams(workers)
        active_ids = []
        for member in active:
            request_id = keys.valid_request_id(member)
            if request_id is None:
                log.warning("malformed_active_id member=%r", member[:80])
                self.link.queue("srem", self.link.keys.active_requests, member)
            else:
                active_ids.append(request_id)
        active_ids.sort()
        for start in range(0, len(active_ids), LOAD_BATCH):
            await self.load_requests(active_ids[start : start + LOAD_BATCH])
        log.info("pool_loaded epoch=%s active=%d waiting=%d redis_run_id=%s", epoch, len(active_ids),
                 self.policy.waiting_count, self.link.run_id)

    async def load_shard_state(self, epoch: str) -> None:
        """One of several schedulers joining: it owns nothing yet (its first poll takes its workers,
        and the requests that no live scheduler owns: services/scheduler/shards.py); it reads the
        shared input streams from their ends."""
        pipe = self.link.redis.pipeline(transaction=False)
        for stream in self.link.input_streams:
            pipe.xrevrange(stream, count=1)
        tails = await bounded(pipe.execute(), REDIS_SLACK_SECONDS)
        for stream, tail in zip(self.link.input_streams, tails, strict=True):
            if tail:
                self.link.read_ids[stream] = text_of(tail[0][0])
        log.info("scheduler_joining scheduler_id=%s", epoch)

    async def _delete_orphan_plan_streams(self, registered: set[bytes]) -> None:
        """Plan streams of workers that are no longer registered (gone while no scheduler ran)."""
        prefix = keys.plan_stream("")
        orphans = [key async for key in self.link.redis.scan_iter(match=prefix + "*", count=1000)
                   if key[len(prefix):] not in registered]
        for key in orphans:
            self.link.queue("delete", key)
        if orphans:
            log.info("orphan_plan_streams deleted=%d", len(orphans))

    async def load_requests(self, request_ids: list[str]) -> None:
        """Add requests (new ones, or active ones after a restart with their output so far)."""
        request_ids = [request_id for request_id in dict.fromkeys(request_ids)
                       if self.policy.get(request_id) is None and request_id not in self.outputs.recently_finished]
        if not request_ids:
            return
        # On the round trip's own connection, between two round trips (an Exchange: a new request's
        # load is one of the scheduler's hot calls, and redis-py's pipeline cost 5-6 times as much)
        commands = []
        for request_id in request_ids:
            commands += [("HMGET", keys.request_key(request_id), "record", keys.CANCEL_FLAG),
                         ("SISMEMBER", self.link.keys.active_requests, request_id),
                         ("XRANGE", keys.token_stream(request_id), "-", "+")]
        replies = await bounded(self.link.exchange.send(commands), REDIS_SLACK_SECONDS)
        for position, request_id in enumerate(request_ids):
            fields, active, entries = replies[3 * position : 3 * position + 3]
            if not isinstance(entries, Exception):
                entries = stream_entries(entries)
            if isinstance(active, Exception):
                raise active  # the active set itself is broken: nothing here can be trusted
            if isinstance(fields, Exception) or isinstance(entries, Exception):
                # One request's keys hold the wrong type of value: that request cannot be served.
                log.error("unreadable_request request_id=%s error=%s", request_id,
                          fields if isinstance(fields, Exception) else entries)
                self.outputs.expire_unreadable(request_id)
                continue
            raw_record, cancel_flag = fields
            self._load_one(request_id, raw_record, bool(active), entries, cancelled=cancel_flag is not None)
        self.outputs.publish_finished_without_token()

    def _load_one(self, request_id: str, raw_record: bytes | None, active: bool, entries: list,
                  cancelled: bool = False) -> None:
        if not active:
            return  # finished before we saw it (a duplicate stream entry, or a restart)
        events: dict[int, TokenEvent] = {}
        for entry_id, fields in entries:
            try:
                event = decode_token_event(fields.get(b"m", b""))
            except WireError as error:
                log.warning("malformed_token_event request_id=%s entry=%s error=%s", request_id, text_of(entry_id),
                            error)
                continue
            if event.finish_reason is not None:
                log.info("already_finished request_id=%s reason=%s", request_id, event.finish_reason)
                self.outputs.write_end(request_id, event.finish_reason, event.completion_tokens)
                return
            events.setdefault(event.index, event)
        output_token_ids: list[int] = []
        while len(output_token_ids) in events and events[len(output_token_ids)].token_id >= 0:
            output_token_ids.append(events[len(output_token_ids)].token_id)
        if raw_record is None:
            log.warning("request_without_record request_id=%s", request_id)
            self.link.queue("srem", self.link.keys.active_requests, request_id)
            self.link.queue("expire", keys.request_key(request_id), self.request_ttl_seconds)  # what is left goes
            self.link.queue("expire", keys.token_stream(request_id), self.request_ttl_seconds)
            return
        try:
            record = decode(RequestRecord, raw_record)
            if record.request_id != request_id:
                raise WireError(f"RequestRecord: request_id {record.request_id!r} under the key of {request_id!r}")
        except WireError as error:
            log.error("malformed_record request_id=%s error=%s", request_id, error)
            self.outputs.token_event(request_id, len(output_token_ids), -1, "", finish_reason="error")
            self.outputs.write_end(request_id, "error", len(output_token_ids))
            return
        text = self.outputs.start(record, output_token_ids,
                                  emitted_text=sum(len(events[index].text) for index in range(len(output_token_ids))))
        state = self.policy.add_request(record, output_token_ids)
        # (a new request at debug level: its admission and its end are logged, at every step's rate of them;
        # one rebuilt with output so far, after a restart, at info)
        log.log(logging.INFO if output_token_ids else logging.DEBUG, "loaded request_id=%s prompt_tokens=%d "
                "output_tokens=%d", request_id, len(record.prompt_token_ids), len(output_token_ids))
        if state.is_active and record.sampling.stop and find_stop(text, record.sampling.stop) != -1:
            self.policy.finish(request_id, "stop", without_token=True)  # output already holds a stop string
        if cancelled:
            self.cancel(request_id)
