"""Several schedulers per model (Settings.schedulers > 1): each leases a shard of the model's
workers and owns the requests it took; the others take both over when it dies or stalls.

Keys (shared/keys.py, ModelKeys): each scheduler's id is its epoch (new at every start and rejoin).
It is listed in `schedulers` and holds `scheduler_lease(id)` = its id, with a time to live
(Settings.scheduler_lease_ms) that every poll renews. It holds each of its workers by
`worker_lease(worker)` = "ID RUN_ID", renewed likewise: the value a worker's writes are checked
against (services/worker/token_writer.py), so nothing of a plan lands unless its scheduler holds
that worker now. `request_owners` maps each request to the scheduler that took it.

One script a poll (SHARD_SCRIPT), atomic:
- renew this scheduler's leases (its own gone: LeaseLost);
- take over every listed scheduler whose lease no longer holds its id: write its fence ("taken",
  for a day: RedisLink WATCHes it, so its next transaction does not run; the lease itself cannot be
  the WATCHed key, as every renewal writes it), delete its worker leases, and take its requests if
  this scheduler holds a worker (else leave them unowned, for one that has room);
- take free live workers while holding no more than the fewest any live scheduler holds;
- with room, take active requests no live scheduler owns (they waited in Redis, or were left).
New requests are taken by CLAIM_SCRIPT, only while this scheduler's lease holds: key by key in turn
across schedulers (keys:turns), each one by the scheduler that named its prefix if that one has room,
the others by whichever live scheduler has the most room (scheduler:rooms), so a burst is shared out.

And in the scheduler (services/scheduler/service.py, liveness.py): one left with requests and no
live worker while another holds one deletes its own lease and joins again (its requests run on
elsewhere); one holding two workers more than another drains one and gives its lease up.

A scheduler that finds its lease gone drops everything it knows and joins again under a new id:
what it held was, or will be, taken over.
"""

import logging
import time
from typing import NamedTuple

from services.scheduler.redis_link import (
    REDIS_SLACK_SECONDS,
    LeaseLost,
    RedisLink,
    RedisRestarted,
    bounded,
    text_of,
)
from shared import keys, prefix_anchors

log = logging.getLogger("iterserve.scheduler")

SWEEP_SECONDS = 5.0  # how often a scheduler looks for active requests no live scheduler owns
# How long a prefix anchor names its scheduler: about how long an idle prefix stays in a worker's
# cache under load (a stale one only misplaces a request: shared/prefix_anchors.py).
PREFIX_ANCHOR_SECONDS = 300


class NewRequestEntry(NamedTuple):
    """A new-request entry as one of several schedulers reads it (services/gateway/store.py)."""

    request_id: str
    client_key: str = ""
    prompt_tokens: int = 0
    anchors: str = ""  # hex, shallowest first

    @classmethod
    def of_entry(cls, request_id: str, fields: dict) -> "NewRequestEntry":
        try:
            client_key = fields.get(b"k", b"").decode()
            prompt_tokens = int(fields.get(b"n", b"0"))
        except (UnicodeDecodeError, ValueError):
            return cls(request_id)  # (malformed hints: taken as any other request)
        return cls(request_id, client_key, prompt_tokens,
                   "".join(anchor.hex() for anchor in prefix_anchors.unpacked(fields.get(b"a", b""))))

# ARGV: 1 this scheduler's id, 2 lease ms, 3 "1" at its join, 4 how many unowned requests to take,
# 5-16 key names (below), 17 how many more requests it takes now (its room), 18 the run_id of the Redis
# server it joined ("" at its join), 19.. the workers it holds. Reply: {status, run_id, lost workers, taken
# workers, claimed requests, taken-over schedulers, {worker, fence} of each held worker, how many
# active requests no scheduler has taken yet (waiting in Redis for one with room), how many other
# live schedulers hold a worker, the fewest workers another live scheduler holds (-1: none lives)}.
SHARD_SCRIPT = f"""
local run_id = {keys.REDIS_RUN_ID_LUA}
""" + """local me, ttl, join, room = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', tonumber(ARGV[4])
local sweep = room > 0
local schedulers, lease_prefix, heartbeat_prefix, results_prefix, owners = ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local active, workers, worker_heartbeat_prefix, worker_lease_prefix, changes = ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14]
local fence_prefix, rooms = ARGV[15], ARGV[16]
-- A restarted Redis (another run_id) may have lost the last writes: nothing is written until the
-- scheduler has joined it anew (a worker lease renewed here with the new run_id would let the
-- workers' writes of plans made before the restart land after the lost ones: a gap in a stream).
if ARGV[18] ~= '' and ARGV[18] ~= run_id then return {'RESTARTED', run_id} end
local my_lease = lease_prefix .. me
if join then
  if not redis.call('SET', my_lease, me, 'NX', 'PX', ttl) then return {'LOST', run_id} end
  redis.call('SADD', schedulers, me)
elseif redis.call('GET', my_lease) ~= me then
  return {'LOST', run_id}
else
  redis.call('PEXPIRE', my_lease, ttl)
end
redis.call('HSET', rooms, me, ARGV[17])
local value = me .. ' ' .. run_id
local lost, held = {}, {}
for i = 19, #ARGV do
  local key = worker_lease_prefix .. ARGV[i]
  if redis.call('GET', key) == value then
    redis.call('PEXPIRE', key, ttl)
    held[ARGV[i]] = true
  else
    lost[#lost + 1] = ARGV[i]
  end
end
local live, dead, gone = {}, {}, {}
for _, id in ipairs(redis.call('SMEMBERS', schedulers)) do
  if id == me or redis.call('GET', lease_prefix .. id) == id then
    live[id] = 0
  else
    dead[#dead + 1] = id
    gone[id] = true
    redis.call('SET', fence_prefix .. id, 'taken', 'PX', 86400000)
    redis.call('DEL', lease_prefix .. id)
    redis.call('SREM', schedulers, id)
    redis.call('DEL', results_prefix .. id, heartbeat_prefix .. id)
    redis.call('HDEL', rooms, id)
  end
end
local free = {}
for _, worker in ipairs(redis.call('SMEMBERS', workers)) do
  local key = worker_lease_prefix .. worker
  local lease = redis.call('GET', key)
  local owner = lease and string.match(lease, '^(%S+) ')
  if lease and owner and live[owner] and lease == owner .. ' ' .. run_id then
    live[owner] = live[owner] + 1
  elseif redis.call('EXISTS', worker_heartbeat_prefix .. worker) == 1 then
    if lease then redis.call('DEL', key) end
    free[#free + 1] = worker
  end
end
table.sort(free)
local fewest = nil
for id, count in pairs(live) do
  if id ~= me and (fewest == nil or count < fewest) then fewest = count end
end
local taken = {}
for _, worker in ipairs(free) do
  if fewest ~= nil and live[me] > fewest then break end
  redis.call('SET', worker_lease_prefix .. worker, value, 'PX', ttl)
  redis.call('HINCRBY', changes, worker, 1)
  live[me] = live[me] + 1
  held[worker] = true
  taken[#taken + 1] = worker
end
local others_holding = 0
for id, count in pairs(live) do
  if id ~= me and count > 0 then others_holding = others_holding + 1 end
end
-- A dead scheduler's requests go to this one if it holds a worker (or nobody else does); else they
-- are left unowned, for a scheduler with a worker and room to take.
local inherit = live[me] > 0 or others_holding == 0
local claimed, swept = {}, 0
if #dead > 0 or sweep then
  for _, id in ipairs(redis.call('SMEMBERS', active)) do
    local owner = redis.call('HGET', owners, id)
    if owner and gone[owner] and inherit then
      redis.call('HSET', owners, id, me)
      claimed[#claimed + 1] = id
    elseif owner and gone[owner] then
      redis.call('HDEL', owners, id)
    elseif swept < room and not (owner and live[owner]) then
      redis.call('HSET', owners, id, me)
      claimed[#claimed + 1] = id
      swept = swept + 1
    end
  end
end
if join then
  local entries = redis.call('HGETALL', owners)
  for i = 1, #entries, 2 do
    if redis.call('SISMEMBER', active, entries[i]) == 0 then redis.call('HDEL', owners, entries[i]) end
  end
end
local fences = {}
for worker in pairs(held) do
  fences[#fences + 1] = worker
  fences[#fences + 1] = redis.call('HGET', changes, worker) or '0'
end
local unclaimed = redis.call('SCARD', active) - redis.call('HLEN', owners)
return {'OK', run_id, lost, taken, claimed, dead, fences, unclaimed, others_holding, fewest or -1}
"""

# New requests: each scheduler reads every one and offers to take those it has read while it has room
# (ARGV: 1 this scheduler's id, 2 its lease key, 3 the owners hash, 4 key_turns, 5 turn_clock, 6 the
# prefix anchors' key prefix, 7 scheduler_rooms, 8 the schedulers' lease key prefix, 9 its room, 10 the
# placement threshold, 11 "1": prefix-aware, 12.. per request, oldest first: its id, client key, prompt
# tokens, its anchors in hex, shallowest first). It takes them
# - key by key in turn, as one scheduler's admission does (SchedulerPolicy._fair_order), across
#   schedulers: the key that a scheduler of the model took a request of longest ago first;
# - except a request whose deepest anchor (shared/prefix_anchors.py) another live scheduler with room
#   wrote, covering at least the threshold of its prompt: that one's worker holds its prefix;
# - and each of the others to whichever live scheduler has the most room then (as each one's room was at
#   its last poll or take, less what this take leaves it), this one on a tie: a burst is spread over
#   the schedulers as their room allows, not all taken by the one that reads it first (whose single
#   worker would run it while the others' idle). What it leaves, it forgets: the other takes it from
#   its own reading; one that does not (gone, or its room taken meanwhile) leaves it unowned in Redis,
#   where the next sweep of one with room takes it.
# Reply: {'OK', ids it owns now, ids to forget (another's, or left to another)}, or {'LOST'}.
CLAIM_SCRIPT = """
local me = ARGV[1]
if redis.call('GET', ARGV[2]) ~= me then return {'LOST'} end
local owners, turns, turn, anchor_prefix, rooms, lease_prefix = ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local room, threshold, affinity = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11] == '1'
local depths = {""" + ", ".join(str(depth * prefix_anchors.CHUNK_TOKENS) for depth in prefix_anchors.DEPTHS) + """}
local taken, dropped, queues, order = {}, {}, {}, {}
for i = 12, #ARGV, 4 do
  local owner = redis.call('HGET', owners, ARGV[i])
  if owner == me then
    taken[#taken + 1] = ARGV[i]
  elseif owner then
    dropped[#dropped + 1] = ARGV[i]
  else
    local key = ARGV[i + 1]
    if not queues[key] then
      queues[key] = {}
      order[#order + 1] = {tonumber(redis.call('HGET', turns, key) or '-1'), #order, key}
    end
    table.insert(queues[key], i)
  end
end
table.sort(order, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
-- The other live schedulers with room, each with its room as it last wrote it (counted down below
-- by what this take leaves it), and which of them had room at the start.
local others, roomy, listed = {}, {}, redis.call('HGETALL', rooms)
for i = 1, #listed, 2 do
  local id, others_room = listed[i], tonumber(listed[i + 1]) or 0
  if id ~= me and others_room > 0 and redis.call('GET', lease_prefix .. id) == id then
    others[id], roomy[id] = others_room, true
  end
end
-- The live scheduler (this one included) with room whose worker holds the request's prefix, or nil.
local function prefix_holder(i)
  local anchors, tokens = ARGV[i + 3], tonumber(ARGV[i + 2])
  for depth = #anchors / 16, 1, -1 do
    local holder = redis.call('GET', anchor_prefix .. string.sub(anchors, 16 * depth - 15, 16 * depth))
    if holder then
      if depths[depth] < threshold * tokens then return nil end
      if holder == me or roomy[holder] then return holder end
      return nil
    end
  end
  return nil
end
local function roomier()
  local best, most = nil, room
  for id, others_room in pairs(others) do
    if others_room > most or (others_room == most and best ~= nil and id < best) then best, most = id, others_room end
  end
  return best
end
local heads, more = {}, true
while room > 0 and more do
  more = false
  for _, entry in ipairs(order) do
    local key = entry[3]
    local queue, head = queues[key], heads[key] or 1
    while room > 0 and head <= #queue do
      local i = queue[head]
      head = head + 1
      local holder = affinity and prefix_holder(i)
      local other = holder or roomier()
      if other and other ~= me then
        if others[other] then others[other] = others[other] - 1 end
        dropped[#dropped + 1] = ARGV[i]
      else
        redis.call('HSET', owners, ARGV[i], me)
        redis.call('HSET', turns, key, redis.call('INCR', turn))
        taken[#taken + 1] = ARGV[i]
        room = room - 1
        break
      end
    end
    heads[key] = head
    if head <= #queue then more = true end
  end
end
redis.call('HSET', rooms, me, room)
return {'OK', taken, dropped}
"""

# Cancelled requests nobody owns (they waited in Redis): ARGV 1 this scheduler's id, 2 its lease key,
# 3 the owners hash, 4.. request ids. Reply: those it owns now, or {'LOST'}.
TAKE_SCRIPT = """
if redis.call('GET', ARGV[2]) ~= ARGV[1] then return {'LOST'} end
local mine = {}
for i = 4, #ARGV do
  if redis.call('HSETNX', ARGV[3], ARGV[i], ARGV[1]) == 1 or redis.call('HGET', ARGV[3], ARGV[i]) == ARGV[1] then
    mine[#mine + 1] = ARGV[i]
  end
end
return mine
"""

# ARGV: 1 the prefix anchors' key prefix, 2 this scheduler's id, 3 their time to live (ms), 4.. anchors in hex.
PUBLISH_SCRIPT = """
for i = 4, #ARGV do redis.call('SET', ARGV[1] .. ARGV[i], ARGV[2], 'PX', ARGV[3]) end
return 1
"""


# ARGV: 1 a worker's lease key, 2 this scheduler's value there: deleted only if it still holds it.
RELEASE_SCRIPT = """
if redis.call('GET', ARGV[1]) == ARGV[2] then redis.call('DEL', ARGV[1]) end
return 1
"""

# At start: can this Redis run the leases' scripts (EVAL, SET NX PX, DEL)? An ACL that denies them, or
# a server with EVAL renamed away, would make every poll fail: said once, at start.
PROBE_SCRIPT = """
redis.call('SET', ARGV[1], 'probe', 'NX', 'PX', 1000)
redis.call('DEL', ARGV[1])
return 1
"""
PASSING_REFUSALS = ("READONLY", "LOADING", "MASTERDOWN", "OOM", "BUSY", "NOREPLICAS")


async def lease_problem(redis, model_keys: keys.ModelKeys) -> str | None:
    """Why this Redis cannot hold several schedulers' leases, or None (a Redis that does not answer
    yet, or refuses for a while, is not a problem here: the scheduler retries)."""
    from redis.exceptions import ResponseError

    try:
        await bounded(redis.eval(PROBE_SCRIPT, 0, model_keys.scheduler_lease("probe")), REDIS_SLACK_SECONDS)
    except ResponseError as error:
        if str(error).startswith(PASSING_REFUSALS):
            return None
        return f"Redis refused the leases' script (EVAL of SET and DEL): {error}"
    except Exception:  # not answering (yet): the scheduler's own loop waits it out
        return None
    return None


class ShardPoll(NamedTuple):
    run_id: str
    lost_workers: list[str]
    taken_workers: list[str]
    claimed_requests: list[str]
    taken_over: list[str]  # schedulers this poll took over
    fences: dict[str, int]  # each held worker's fencing token (how many times its lease changed owner)
    unclaimed: int  # active requests no scheduler has taken yet
    others_holding: int  # other live schedulers that hold a worker
    fewest_other: int  # the fewest workers another live scheduler holds (-1: no other lives)


class ShardMembership:
    """One scheduler's leases (see the module's docstring)."""

    def __init__(self, link: RedisLink, scheduler_id: str, lease_ms: int) -> None:
        self.link, self.scheduler_id, self.lease_ms = link, scheduler_id, lease_ms
        self.model_keys = link.keys
        self.lease_key = self.model_keys.scheduler_lease(scheduler_id)
        self.joined = False
        self.fences: dict[str, int] = {}
        self.unclaimed = 0  # at the last poll: active requests no scheduler has taken yet (they wait)
        self._next_sweep = 0.0

    def _key_names(self) -> tuple[str, ...]:
        model_keys = self.model_keys
        return (model_keys.schedulers, model_keys.scheduler_lease(""), model_keys.scheduler_heartbeat_of(""),
                model_keys.results_of(""), model_keys.request_owners, model_keys.active_requests,
                model_keys.workers, keys.worker_heartbeat(""), keys.worker_lease(""), model_keys.lease_changes,
                model_keys.scheduler_fence(""), model_keys.scheduler_rooms)

    async def poll(self, held_workers: list[str], room: int = 0, nothing_pending: bool = True) -> ShardPoll:
        """Renew, take over, take free workers, and, with room (room: how many more requests this
        scheduler takes now), the active requests no live scheduler owns: at a join, when some were
        seen at the last poll, and every SWEEP_SECONDS. Raises LeaseLost, or RedisRestarted (another
        Redis server than the one it joined: then nothing was written).
        nothing_pending False: new requests it read wait for its room; they go first, key by key in turn
        (claim), while the sweep takes any (a request it never read: from before its join, left by a
        scheduler taken over), so it waits until they are taken."""
        now = time.monotonic()
        sweep = nothing_pending and (not self.joined or self.unclaimed > 0 or now >= self._next_sweep)
        reply = await bounded(self.link.redis.eval(
            SHARD_SCRIPT, 0, self.scheduler_id, self.lease_ms, "0" if self.joined else "1", room if sweep else 0,
            *self._key_names(), room, self.link.run_id, *held_workers), REDIS_SLACK_SECONDS)
        status = text_of(reply[0])
        if status == "RESTARTED":
            raise RedisRestarted(self.link.run_id, text_of(reply[1]))
        if status != "OK":
            raise LeaseLost(f"scheduler {self.scheduler_id}: its lease is gone")
        self.joined = True
        if sweep:
            self._next_sweep = now + SWEEP_SECONDS
        fences = reply[6]
        self.fences = {text_of(fences[i]): int(fences[i + 1]) for i in range(0, len(fences), 2)}
        self.unclaimed = max(0, int(reply[7]))
        poll = ShardPoll(text_of(reply[1]), [text_of(w) for w in reply[2]], [text_of(w) for w in reply[3]],
                         [text_of(r) for r in reply[4]], [text_of(s) for s in reply[5]], self.fences, self.unclaimed,
                         int(reply[8]), int(reply[9]))
        for scheduler_id in poll.taken_over:
            log.warning("scheduler_taken_over scheduler_id=%s by=%s requests=%d", scheduler_id, self.scheduler_id,
                        len(poll.claimed_requests))
        for worker_id in poll.taken_workers:
            log.info("worker_leased worker_id=%s scheduler_id=%s fence=%d", worker_id, self.scheduler_id,
                     self.fences.get(worker_id, 0))
        for worker_id in poll.lost_workers:
            log.warning("worker_lease_lost worker_id=%s scheduler_id=%s", worker_id, self.scheduler_id)
        return poll

    async def claim(self, requests: list[NewRequestEntry], room: int, threshold: float,
                    prefix_aware: bool) -> tuple[list[str], list[str]]:
        """Of the new requests read (oldest first), those this scheduler takes now, at most `room`:
        key by key in turn, leaving to another scheduler with room one whose prefix its worker holds,
        and each other one to a scheduler with more room (CLAIM_SCRIPT). Returns (ids it owns now, ids
        to forget). Raises LeaseLost."""
        model_keys = self.model_keys
        arguments = [part for request in requests
                     for part in (request.request_id, request.client_key, request.prompt_tokens, request.anchors)]
        reply = await bounded(self.link.redis.eval(
            CLAIM_SCRIPT, 0, self.scheduler_id, self.lease_key, model_keys.request_owners, model_keys.key_turns,
            model_keys.turn_clock, model_keys.prefix_anchor(""), model_keys.scheduler_rooms,
            model_keys.scheduler_lease(""), room, repr(threshold), "1" if prefix_aware else "0", *arguments),
            REDIS_SLACK_SECONDS)
        if text_of(reply[0]) != "OK":
            raise LeaseLost(f"scheduler {self.scheduler_id}: its lease is gone")
        return [text_of(request_id) for request_id in reply[1]], [text_of(request_id) for request_id in reply[2]]

    async def take(self, request_ids: list[str]) -> list[str]:
        """Requests it takes whatever its room (cancelled ones nobody took: it ends them). Raises LeaseLost."""
        reply = await bounded(self.link.redis.eval(
            TAKE_SCRIPT, 0, self.scheduler_id, self.lease_key, self.model_keys.request_owners, *request_ids),
            REDIS_SLACK_SECONDS)
        if reply and text_of(reply[0]) == "LOST":
            raise LeaseLost(f"scheduler {self.scheduler_id}: its lease is gone")
        return [text_of(request_id) for request_id in reply]

    def queue_anchors(self, token_lists: list) -> None:
        """Name this scheduler as the holder of these token sequences' prefixes (requests it loaded
        or ended), with the round trip's writes."""
        found = {anchor.hex() for tokens in token_lists for anchor in prefix_anchors.anchors(tokens)}
        if found:
            self.link.queue("eval", PUBLISH_SCRIPT, 0, self.model_keys.prefix_anchor(""), self.scheduler_id,
                            PREFIX_ANCHOR_SECONDS * 1000, *sorted(found))

    async def release_worker(self, worker_id: str, run_id: str) -> None:
        """Give a worker's lease up (a handover to a scheduler that holds fewer): free for the next
        poll of the one that holds the fewest."""
        await bounded(self.link.redis.eval(RELEASE_SCRIPT, 0, keys.worker_lease(worker_id),
                                           f"{self.scheduler_id} {run_id}"), REDIS_SLACK_SECONDS)

    def queue_release(self) -> None:
        """A scheduler that stops: its lease goes at once, so the others take over at their next
        poll rather than after its time to live."""
        self.link.queue("delete", self.lease_key)
