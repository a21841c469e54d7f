"""Every Redis key and stream name used by iterserve, in one place.

All keys live under one prefix so several deployments can share a Redis; a model's pool has
its own group of keys (ModelKeys) when one deployment serves several models.
"""

import re
from dataclasses import dataclass
from functools import cached_property

PREFIX = "iterserve"
# What a request id may look like (the gateway's are cmpl-<32 hex> and chatcmpl-<32 hex>): an id
# read from Redis that does not match is malformed input, skipped.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")



@dataclass(frozen=True)
class ModelKeys:
    """The keys of one model's pool: its request streams, its active set, its workers and its
    scheduler. A deployment of one model uses the unnamed group (the names below); several models
    in one deployment each have their own group, so a model's scheduler only ever sees requests
    for it and workers holding it. Request and token keys are shared (request ids are unique)."""

    group: str = ""

    def _key(self, name: str) -> str:
        return f"{PREFIX}:{name}" if not self.group else f"{PREFIX}:model:{self.group}:{name}"

    @cached_property  # read on every scheduler turn: formatted once
    def new_requests(self) -> str:
        """Stream of new request ids (gateway -> scheduler). Entries: {"id": request_id}."""
        return self._key("requests:new")

    @cached_property
    def cancels(self) -> str:
        """Stream of cancellations (gateway -> scheduler). Entries: {"id": request_id}."""
        return self._key("requests:cancel")

    @cached_property
    def active_requests(self) -> str:
        """Set of request ids accepted and not yet finished: the scheduler rebuilds its pool from it."""
        return self._key("requests:active")

    @cached_property
    def results(self) -> str:
        """Stream of plan results (workers -> scheduler)."""
        return self._key("results")

    @cached_property
    def iterations(self) -> str:
        """Stream of the scheduler's per-iteration records (the last Settings.iteration_records),
        for tests and observability."""
        return self._key("iterations")

    @cached_property
    def workers(self) -> str:
        """Set of worker ids that have registered; each one's liveness is its heartbeat key."""
        return self._key("workers")

    @cached_property
    def scheduler_heartbeat(self) -> str:
        """Scheduler liveness key (value: msgpack SchedulerInfo, expires unless renewed)."""
        return self._key("scheduler:heartbeat")

    @cached_property
    def counters(self) -> str:
        """Hash of the scheduler's counters that outlive it (prefix-cache queries and hits, in tokens):
        it adds what it counted since its last heartbeat, at every heartbeat (HINCRBY)."""
        return self._key("scheduler:counters")

    @cached_property
    def incarnation(self) -> str:
        """The scheduler epoch and the Redis server (its run_id, new at every start) that the pool
        was last loaded on, "EPOCH RUN_ID": a worker's token entries are written only while both
        are its plan's (services/worker/token_writer.py), so none lands after a Redis restart that
        may have lost writes, until a scheduler has loaded the pool from what Redis kept."""
        return self._key("scheduler:incarnation")

    # Several schedulers per model (Settings.schedulers > 1: services/scheduler/shards.py)

    @cached_property
    def schedulers(self) -> str:
        """Set of the ids of the model's schedulers (each one's epoch) that joined and were not yet
        taken over: each is alive while its lease (scheduler_lease) holds its own id."""
        return self._key("schedulers")

    def scheduler_lease(self, scheduler_id: str) -> str:
        """A scheduler's lease on itself: its id, with a time to live it renews at every poll."""
        return self._key(f"scheduler:lease:{scheduler_id}")

    def scheduler_fence(self, scheduler_id: str) -> str:
        """Set ("taken") once another scheduler took a scheduler's workers and requests over: the
        write that aborts its next transaction (it WATCHes this key, which nothing else writes)."""
        return self._key(f"scheduler:fence:{scheduler_id}")

    def scheduler_heartbeat_of(self, scheduler_id: str) -> str:
        """One of several schedulers' heartbeat (SchedulerInfo), as scheduler_heartbeat is the one's."""
        return self._key(f"scheduler:heartbeat:{scheduler_id}")

    def results_of(self, scheduler_id: str) -> str:
        """One of several schedulers' result stream: its workers answer its plans there."""
        return self._key(f"results:{scheduler_id}")

    @cached_property
    def request_owners(self) -> str:
        """Hash request id -> the id of the scheduler that took it (HSETNX: one takes each)."""
        return self._key("requests:owner")

    @cached_property
    def lease_changes(self) -> str:
        """Hash worker id -> how many times its lease changed owner: its fencing token, which only grows."""
        return self._key("lease:changes")

    @cached_property
    def scheduler_rooms(self) -> str:
        """Hash scheduler id -> how many more requests it takes now (written at each poll and claim):
        a request whose prefix another's worker holds is left to that one only while it has room."""
        return self._key("scheduler:rooms")

    @cached_property
    def key_turns(self) -> str:
        """Hash client key -> the turn (turn_clock's count) at which a scheduler last took a request of
        that key: the schedulers take waiting requests key by key, the one served longest ago first."""
        return self._key("keys:turns")

    @cached_property
    def turn_clock(self) -> str:
        """Counter: requests taken by the model's schedulers (the clock of key_turns)."""
        return self._key("keys:clock")

    def prefix_anchor(self, anchor: str) -> str:
        """A prefix anchor (shared/prefix_anchors.py) -> the id of the scheduler that last loaded or
        ended a request holding it, for a while (PREFIX_ANCHOR_SECONDS): where its KV probably is."""
        return self._key(f"prefix:{anchor}")


# The epochs of one of several schedulers start so (its id): a worker answers their plans in the
# scheduler's own result stream, checked against its worker_lease, not ModelKeys.incarnation.
SHARDED_EPOCH_PREFIX = "s-"


def worker_lease(worker_id: str) -> str:
    """The lease of the scheduler that plans for a worker (Settings.schedulers > 1): "EPOCH RUN_ID",
    the form of ModelKeys.incarnation, so the worker's token entries and results are written only
    while its plan's scheduler holds it (services/worker/token_writer.py)."""
    return f"{PREFIX}:lease:{worker_id}"


# Lua: this Redis server's run_id, new at every start of redis-server (the scripts that set and
# compare ModelKeys.incarnation, and the scheduler's liveness poll, read it so).
REDIS_RUN_ID_LUA = "string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')"

SINGLE_MODEL = ModelKeys()
# The unnamed group's keys under their historical names (tests, benchmarks, docs).
NEW_REQUESTS_STREAM = SINGLE_MODEL.new_requests
CANCEL_STREAM = SINGLE_MODEL.cancels
ACTIVE_REQUESTS_SET = SINGLE_MODEL.active_requests
RESULTS_STREAM = SINGLE_MODEL.results
ITERATIONS_STREAM = SINGLE_MODEL.iterations
WORKERS_SET = SINGLE_MODEL.workers
SCHEDULER_HEARTBEAT = SINGLE_MODEL.scheduler_heartbeat
INCARNATION = SINGLE_MODEL.incarnation


def request_key(request_id: str) -> str:
    """Hash holding one request: its RequestRecord and its status (and CANCEL_FLAG once cancelled)."""
    return f"{PREFIX}:request:{request_id}"


# Field of request_key(id) set by the gateway with the cancel: a scheduler that loads the request
# later (it had not read its new-request entry yet, or it restarted) sees the cancel there, so
# the cancel stream itself can be trimmed as soon as it is read.
CANCEL_FLAG = "cancel"


# Fields of request_key(id) holding its prompt's log-probabilities (PromptLogprobsChunk), one per step
# that computed some, named by the first prompt position they cover (the worker writes them).
PROMPT_LOGPROBS_FIELD = "prompt_logprobs:"


def prompt_logprobs_field(first_position: int) -> str:
    return f"{PROMPT_LOGPROBS_FIELD}{first_position}"


def token_stream(request_id: str) -> str:
    """Stream of one request's output (scheduler -> gateway), one entry per token."""
    return f"{PREFIX}:tokens:{request_id}"


def plan_stream(worker_id: str) -> str:
    """Stream of batch plans addressed to one worker (scheduler -> worker)."""
    return f"{PREFIX}:plans:{worker_id}"


def worker_heartbeat(worker_id: str) -> str:
    """One worker's liveness key (value: msgpack WorkerInfo, expires unless renewed)."""
    return f"{PREFIX}:worker:{worker_id}"


def valid_request_id(value: bytes | str | None) -> str | None:
    """The request id held in a Redis value, or None when it is not one (any bytes may be there)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str) and REQUEST_ID_PATTERN.fullmatch(value):
        return value
    return None
