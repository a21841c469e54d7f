"""Which workers are alive: a worker is alive while its heartbeat key exists.

A dead or departed worker's requests wait again (rebuilt elsewhere from prompt + output), and its
registration and plan stream are deleted (a worker that comes back under the same id registers
again, and its first plan tells it to drop whatever KV it still holds). A worker that restarted
under the same id (a new start time) is a new worker. A plan or its result lost (a Redis restart
without it) would leave a worker waiting forever: after stall_seconds its plans are given up and
its requests rebuilt. Each poll also reads Redis's run_id: a new one is a Redis restart
(RedisRestarted: the scheduler loads the pool again).
"""

import logging
import time
from collections.abc import Callable

from services.scheduler.policy import SchedulerPolicy
from services.scheduler.redis_link import REDIS_SLACK_SECONDS, RedisLink, RedisRestarted, bounded, text_of
from services.scheduler.shards import ShardMembership
from shared import keys
from shared.messages import WorkerInfo
from shared.wire import WireError, decode

log = logging.getLogger("iterserve.scheduler")

# The workers set, and the heartbeat of every worker it lists or the scheduler knows (ARGV[2..]), read
# at one instant (a script runs whole): a departing worker leaves the set and then deletes its key,
# so no poll sees it listed without its key (a death) when it left. A worker the scheduler knows that
# is not listed (a listing lost) is alive while its key is there; its own next beat lists it again.
# Reply: the number listed, then the ids (listed first) and their heartbeats (nil: no key), and
# the Redis server's run_id (new at each start of redis-server).
# (Standalone Redis: the heartbeat keys are not declared, as TOKENS_SCRIPT's streams are not.)
LIVENESS_SCRIPT = f"""
local run_id = {keys.REDIS_RUN_ID_LUA}
""" + """local ids = redis.call('SMEMBERS', KEYS[1])
local listed, asked = #ids, {}
for _, id in ipairs(ids) do asked[id] = true end
for i = 2, #ARGV do
  if not asked[ARGV[i]] then
    asked[ARGV[i]] = true
    ids[#ids + 1] = ARGV[i]
  end
end
local values = {}
for i, id in ipairs(ids) do values[i] = redis.call('GET', ARGV[1] .. id) end
return {listed, ids, values, run_id}
"""


class WorkerLiveness:
    def __init__(self, link: RedisLink, policy: SchedulerPolicy, stall_seconds: float,
                 shards: ShardMembership | None = None, room: Callable[[], int] = lambda: 0,
                 nothing_pending: Callable[[], bool] = lambda: True) -> None:
        self.link, self.policy = link, policy
        self.stall_seconds = stall_seconds
        self._started_at: dict[str, float] = {}
        self.executors: dict[str, str] = {}  # each live worker's (WorkerInfo.executor)
        self.shards = shards  # one of several schedulers: its leases (it plans for the workers it holds)
        self.held: set[str] = set()  # (then) the workers it holds
        self.claimed: list[str] = []  # (then) requests it took at a poll, to load
        self.room = room  # (then) how many more requests it takes now
        self.nothing_pending = nothing_pending  # (then) whether none of the new requests it read waits for its room
        self.others_holding = 0  # (then) other live schedulers holding a worker, at the last poll
        self.handing_over: str | None = None  # (then) a worker drained to give its lease to one that holds fewer

    async def _poll_shards(self) -> None:
        """One of several schedulers: renew its leases, take over, take workers and requests."""
        shard = await self.shards.poll(sorted(self.held), self.room(), self.nothing_pending())
        if not self.link.run_id:
            self.link.run_id = shard.run_id  # (its join: the server its leases name)
        elif shard.run_id != self.link.run_id:
            raise RedisRestarted(self.link.run_id, shard.run_id)
        for worker_id in shard.lost_workers:  # (its lease ran out: another may hold it now)
            self.held.discard(worker_id)
            self.forget(worker_id, delete_keys=False)
        self.held.update(shard.taken_workers)
        self.claimed += shard.claimed_requests
        self.others_holding = shard.others_holding
        if self.handing_over not in self.held:
            self.handing_over = None
        if self.handing_over is None and 0 <= shard.fewest_other <= len(self.held) - 2:
            # Two more than another holds (a scheduler that joined again, or took another over): hand
            # one over, the one running the fewest, drained first so no request's KV is lost mid-step.
            self.handing_over = min(sorted(self.held), key=lambda worker_id: len(
                self.policy.worker(worker_id).running) if self.policy.worker(worker_id) else 0)
            log.info("worker_handing_over worker_id=%s held=%d fewest_other=%d", self.handing_over, len(self.held),
                     shard.fewest_other)

    async def poll(self) -> None:
        """Raises RedisRestarted, before anything else, when Redis is not the server the pool was
        loaded from (the scheduler then loads it again); one of several schedulers raises LeaseLost
        when its lease is gone."""
        redis = self.link.redis
        if self.shards is not None:
            await self._poll_shards()
        known = sorted(self.policy.worker_ids)
        listed, members, values, run_id = await bounded(
            redis.eval(LIVENESS_SCRIPT, 1, self.link.keys.workers, keys.worker_heartbeat(""), *known),
            REDIS_SLACK_SECONDS)
        if text_of(run_id) != self.link.run_id:
            raise RedisRestarted(self.link.run_id, text_of(run_id))
        found = []  # (not listed, worker id, heartbeat)
        for position, (member, value) in enumerate(zip(members, values, strict=True)):
            try:
                worker_id = member.decode()
            except UnicodeDecodeError:
                log.warning("malformed_worker_id member=%r", member[:80])
                self.link.queue("srem", self.link.keys.workers, member)
                continue
            if self.shards is None or worker_id in self.held:  # (one of several: another's are not its)
                found.append((position >= listed, worker_id, value))
        for unlisted, worker_id, value in sorted(found, key=lambda entry: entry[:2]):  # the listed first, by id
            if value is None:
                if worker_id in self.policy.worker_ids:  # listed: it died; not listed: it left
                    log.warning("%s worker_id=%s", "worker_gone" if unlisted else "worker_dead", worker_id)
                self.forget(worker_id)
                if self.shards is not None and worker_id in self.held:
                    # Given up at once, not left to run out: until then a late write of the worker
                    # (a link back within the lease's time) would pass its lease check (the
                    # worker's WRITE_SCRIPT) and land entries for requests now run elsewhere. It may
                    # come back under its id, leased anew.
                    await self.shards.release_worker(worker_id, self.link.run_id)
                self.held.discard(worker_id)
                continue
            if unlisted:
                log.info("worker_unlisted worker_id=%s", worker_id)  # alive: its heartbeat key is there
            try:
                info = decode(WorkerInfo, value)
            except WireError as error:
                log.warning("malformed_worker_info worker_id=%s error=%s", worker_id, error)
                continue  # alive, whatever it wrote: keep what we know
            started_at = self._started_at.get(worker_id)
            if started_at is not None and started_at != info.started_at:
                log.warning("worker_restarted worker_id=%s", worker_id)
                self.policy.worker_down(worker_id)
            if worker_id not in self.policy.worker_ids:
                self.policy.worker_up(worker_id, info.kv_blocks_total, info.kv_block_size, info.pipeline_stages,
                                      info.kv_identity)
            self._started_at[worker_id] = info.started_at
            self.executors[worker_id] = info.executor
            self.policy.set_draining(worker_id, info.draining or worker_id == self.handing_over,
                                     elsewhere=self.others_holding > 0)
        if self.handing_over is not None:
            await self._hand_over()

    async def _hand_over(self) -> None:
        """The worker being handed over, once nothing of it is in flight: its lease given up."""
        worker_id = self.handing_over
        worker = self.policy.worker(worker_id)
        if worker is not None and (worker.running or worker.in_flight):
            return
        await self.shards.release_worker(worker_id, self.link.run_id)
        self.handing_over = None
        self.held.discard(worker_id)
        if worker is not None:
            self.forget(worker_id, delete_keys=False)
        log.info("worker_handed_over worker_id=%s", worker_id)

    def forget(self, worker_id: str, delete_keys: bool = True) -> None:
        """A dead or departed worker: its requests wait again, its keys and per-worker state go.
        (A worker whose lease this scheduler lost lives on, another's: its keys stay.)"""
        self.policy.worker_down(worker_id)
        self._started_at.pop(worker_id, None)
        self.executors.pop(worker_id, None)
        if delete_keys:
            self.link.queue("srem", self.link.keys.workers, worker_id)
            self.link.queue("delete", keys.plan_stream(worker_id))

    def abandon_stalled_plans(self) -> None:
        now = time.time()
        for worker_id in self.policy.worker_ids:
            worker = self.policy.worker(worker_id)
            if worker.in_flight and now - worker.in_flight[0].started_at > self.stall_seconds:
                log.warning("plan_stalled worker_id=%s plan_id=%d", worker_id, worker.in_flight[0].plan_id)
                self.policy.reset_worker(worker_id)
