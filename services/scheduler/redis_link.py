"""The scheduler's one link to Redis: the queue of writes each turn produces, and the round trip
that sends them and reads the three input streams (new requests, cancels, results) at once.

Writes leave the queue only once Redis has run them. They go as one MULTI/EXEC: Redis refuses a
transaction whole, before any of it runs, when it refuses a write up front (out of memory, a
read-only replica, failing persistence: EXECABORT), so a refused round trip is sent again whole,
with backoff, and no write is skipped or reordered (a token stream never has a gap). A write that
fails inside the transaction fails for its key (a key of the wrong type): the link hands it to
`on_write_failed`. Every token entry of a round trip goes in one EVAL (TOKENS_SCRIPT): one
command instead of one per token, which is most of what a round trip used to cost. The entries
wait in columns (TokenColumns: stream keys, entry ids, payloads), not as a Write each: a token
entry is the one write made for every request at every step, and the columns go to Redis as one
msgpack array of three lists, with no object or tuple built per token.

The round trip is the scheduler's busiest Redis call. Its own commands' arguments (MULTI/EXEC,
the token EVAL, a plan's or a record's XADD, the heartbeat's SET, the XREAD) are built here as
redis-py builds them, the rare others by redis-py's command methods, and they go out as one
Exchange (shared/redis_exchange.py: one write on a connection the link keeps, the replies read
back in order, without redis-py's pipeline machinery).

The input streams are trimmed to what this scheduler has read (nobody else reads them; a
restarted scheduler rebuilds from the active set, not from them).
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import msgpack
from redis.exceptions import ExecAbortError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from shared import keys
from shared.redis_exchange import Exchange, xread_entries

log = logging.getLogger("iterserve.scheduler")
T = TypeVar("T")

READ_COUNT = 512  # entries per stream per XREAD
REDIS_SLACK_SECONDS = 10.0  # a Redis call may take this much longer than its own block time
SHARED_STREAM_SECONDS = 120  # several schedulers: the shared input streams keep this much (all read them)
TRIM_EVERY_ENTRIES = 256  # trim the input streams after this many entries read (or on the heartbeat)

# XADD, server side, for each entry of msgpack columns [keys, ids, payloads]; an entry written before
# (a round trip sent again) is skipped; the reply lists (position, error) of the entries that failed
# otherwise. EVAL with the script's text, not EVALSHA: a restarted Redis has no script cache, and an
# EVALSHA inside the round trip's MULTI would fail. (Standalone Redis: the keys are not declared.)
TOKENS_SCRIPT = """
local columns = cmsgpack.unpack(ARGV[1])
local stream_keys, entry_ids, payloads = columns[1], columns[2], columns[3]
local failed = {}
for i = 1, #stream_keys do
  local reply = redis.pcall('XADD', stream_keys[i], entry_ids[i], 'm', payloads[i])
  if type(reply) == 'table' and reply.err and not string.find(reply.err, 'equal or smaller', 1, true) then
    failed[#failed + 1] = i - 1
    failed[#failed + 1] = reply.err
  end
end
return failed
"""
TOKEN_ENTRY = "token"  # a Write's command for a token stream entry: args (stream key, entry id, payload)
REFUSED_WRITES = (ExecAbortError, OutOfMemoryError, ReadOnlyError)
REFUSAL_PREFIXES = ("OOM", "READONLY", "MISCONF", "NOREPLICAS", "MASTERDOWN", "EXECABORT")


class RedisWritesRefused(RedisError):
    """Redis refused the round trip's writes before running any (out of memory, a read-only
    replica, failing persistence): nothing was written, everything is sent again after a backoff."""


class RedisRestarted(Exception):
    """Redis is another server than the one the pool was loaded from (a new run_id): it may have
    lost its last writes, acknowledged or not (docs/operations.md, "fsync policy")."""

    def __init__(self, was: str, run_id: str) -> None:
        super().__init__(f"Redis restarted: run_id {run_id}, was {was}")
        self.was, self.run_id = was, run_id


class SchedulerStateError(Exception):
    """A write to a key the scheduler owns failed inside Redis (e.g. a key of the wrong type): the
    scheduler's memory and Redis disagree, so the process stops and the restart path rebuilds."""


class Write(NamedTuple):
    """One Redis command of the next round trip (a tuple: a few are made for every token)."""

    command: str
    args: tuple
    kwargs: dict
    request_id: str | None = None  # the request whose keys it writes (None: a shared key)


TOKENS_MARK = Write("token entries", (), {})  # in writes: where the round trip's token entries (one EVAL) go


class TokenColumns:
    """Token entries waiting for a round trip, as columns (one append to each per entry)."""

    __slots__ = ("request_ids", "stream_keys", "entry_ids", "payloads")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.stream_keys: list[str] = []
        self.entry_ids: list[str] = []
        self.payloads: list[bytes] = []

    def __len__(self) -> int:
        return len(self.entry_ids)

    def packed(self, count: int) -> bytes:
        """The first `count` entries as TOKENS_SCRIPT's argument. (use_bin_type=False: Redis's Lua
        cmsgpack reads only the raw string type.)"""
        return msgpack.packb([self.stream_keys[:count], self.entry_ids[:count], self.payloads[:count]],
                             use_bin_type=False)

    def write(self, position: int) -> "Write":
        """Entry `position` as a Write (for on_write_failed)."""
        return Write(TOKEN_ENTRY, (self.stream_keys[position], self.entry_ids[position], self.payloads[position]), {},
                     self.request_ids[position])

    def drop(self, count: int) -> None:
        """The first `count` entries are written."""
        for column in (self.request_ids, self.stream_keys, self.entry_ids, self.payloads):
            del column[:count]


def refused_up_front(error: Exception) -> bool:
    """Redis refused a command before running it, for a reason that passes (memory, replication,
    persistence): retrying later is right."""
    return isinstance(error, REFUSED_WRITES) or str(error).startswith(REFUSAL_PREFIXES)


async def bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """Await with a time limit. (asyncio.wait_for before 3.12 can swallow a cancellation that
    arrives as the awaited call completes, which would make the scheduler task unkillable.)"""
    async with asyncio.timeout(seconds):
        return await awaitable


def text_of(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


class LeaseLost(Exception):
    """One of several schedulers (services/scheduler/shards.py) no longer holds its lease (it
    stalled, or was cut off, past its time to live; or it was taken over): what it held is, or will
    be, taken over, so it drops everything and joins again under a new id. Raised before anything
    it would write runs (the transaction WATCHes its fence) or anything it read is used."""


class RedisLink:
    def __init__(self, redis: Any, on_write_failed: Callable[[Write, Exception], None],
                 model_keys: keys.ModelKeys = keys.SINGLE_MODEL, scheduler_id: str = "") -> None:
        """scheduler_id: one of several schedulers of the model (Settings.schedulers > 1): it reads
        its own result stream, its writes run only while no other took it over (each transaction
        WATCHes its fence, read after the WATCH), and the shared input streams are
        trimmed by age, not to what it has read (the others read them too)."""
        self.redis = redis
        self.on_write_failed = on_write_failed
        self.keys = model_keys  # the pool of the model this scheduler serves
        self.scheduler_id = scheduler_id
        self.results = model_keys.results_of(scheduler_id) if scheduler_id else model_keys.results
        self.fence_key = model_keys.scheduler_fence(scheduler_id) if scheduler_id else ""
        self._armed_on: Any = None  # the exchange's connection (writer) whose WATCH of fence_key holds
        self.input_streams = (model_keys.new_requests, model_keys.cancels, self.results)
        self.writes: list[Write] = []  # commands for the next round trip
        self.tokens = TokenColumns()  # its token entries (one EVAL, where the first TOKENS_MARK stands)
        self._tokens_marked = False  # writes holds a mark after the last round trip's snapshot
        self.read_ids = {stream: "0-0" for stream in self.input_streams}  # where each input stream was read up to
        self._trimmed_ids = dict(self.read_ids)
        self._read_since_trim = 0
        self.exchange = Exchange(redis)  # the round trip's own connection
        self.run_id = ""  # the Redis server's the pool was loaded from (PoolLoader.load_state)
        self._builder = redis.pipeline(transaction=False)  # builds the rare commands' arguments, never sends

    def queue(self, command: str, *args: Any, **kwargs: Any) -> None:
        self.writes.append(Write(command, args, kwargs))

    def queue_token(self, request_id: str, stream_key: str, entry_id: str, payload: bytes) -> None:
        """A token stream entry for the next round trip (written before every write queued after it)."""
        if not self._tokens_marked:
            self.writes.append(TOKENS_MARK)
            self._tokens_marked = True
        tokens = self.tokens
        tokens.request_ids.append(request_id)
        tokens.stream_keys.append(stream_key)
        tokens.entry_ids.append(entry_id)
        tokens.payloads.append(payload)

    def extend(self, writes: list[Write]) -> None:
        """Writes made earlier (held), in order: their token entries go to the columns."""
        for write in writes:
            if write.command == TOKEN_ENTRY:
                self.queue_token(write.request_id, *write.args)
            else:
                self.writes.append(write)

    def queue_first(self, write: Write) -> None:
        self.writes.insert(0, write)

    def note_read(self, stream: str, entry_id: bytes | str) -> None:
        self.read_ids[stream] = text_of(entry_id)
        self._read_since_trim += 1

    @property
    def trim_due(self) -> bool:
        return self._read_since_trim >= TRIM_EVERY_ENTRIES

    def queue_trims(self) -> None:
        """Trim each input stream up to what this scheduler has read: nobody else reads them. (One of
        several: its result stream so; the shared ones to SHARED_STREAM_SECONDS of age.)"""
        if self.scheduler_id:
            oldest = f"{int((time.time() - SHARED_STREAM_SECONDS) * 1000)}-0"
            for stream in self.input_streams[:2]:
                self.queue("xtrim", stream, minid=oldest, approximate=True)
        for stream, read_up_to in self.read_ids.items():
            if self.scheduler_id and stream != self.results:
                continue
            if read_up_to != self._trimmed_ids[stream]:  # keeps that last entry: a restart starts after it
                self.queue("xtrim", stream, minid=read_up_to, approximate=False)
                self._trimmed_ids[stream] = read_up_to
        self._read_since_trim = 0

    def arguments(self, write: Write) -> tuple:
        """A write's command arguments as redis-py builds them: the round trip's own commands (a
        plan's or a record's XADD, the heartbeat's SET) directly, the rare others by redis-py's
        pipeline (it only builds them: never sent)."""
        command, args, kwargs = write.command, write.args, write.kwargs
        if command == "xadd" and len(args) == 2 and kwargs.keys() <= {"maxlen", "approximate"}:
            maxlen = kwargs.get("maxlen")
            limit = () if maxlen is None else (b"MAXLEN", b"~", str(maxlen)) if kwargs.get("approximate", True) \
                else (b"MAXLEN", str(maxlen))
            return ("XADD", args[0], *limit, "*", *[part for field in args[1].items() for part in field])
        if command == "set" and len(args) == 2 and kwargs.keys() == {"px"}:
            return ("SET", *args, "PX", kwargs["px"])
        getattr(self._builder, command)(*args, **kwargs)
        return self._builder.command_stack.pop()[0]

    def commands(self, block_ms: int | None, read: bool = True) -> tuple[list[Write], list, list[tuple]]:
        """The next round trip: the writes it sends, its commands (a Write, or the count of token
        entries that one EVAL writes, at the first mark) and every command's arguments, MULTI to
        EXEC, then XREAD. (A mark after the first, left by a round trip that failed, adds nothing.)"""
        writes = list(self.writes)
        token_count = len(self.tokens)
        self._tokens_marked = False  # a token queued from now on is the next round trip's: it marks anew
        commands: list[Write | int] = []
        marked = False
        for write in writes:
            if write is not TOKENS_MARK:
                commands.append(write)
            elif not marked:
                marked = True
                if token_count:
                    commands.append(token_count)
        arguments: list[tuple] = []
        if commands:
            arguments.append(("MULTI",))
            for command in commands:
                if isinstance(command, int):
                    arguments.append(("EVAL", TOKENS_SCRIPT, 0, self.tokens.packed(command)))
                else:
                    arguments.append(self.arguments(command))
            arguments.append(("EXEC",))
        if read:
            streams = self.read_ids
            block = () if block_ms is None else (b"BLOCK", str(block_ms))
            arguments.append(("XREAD", *block, b"COUNT", str(READ_COUNT), b"STREAMS", *streams, *streams.values()))
        if self.fence_key:  # the next transaction runs only if no takeover writes the fence from here on
            arguments += [("WATCH", self.fence_key), ("GET", self.fence_key)]
        return writes, commands, arguments

    async def arm(self) -> None:
        """WATCH the fence on the exchange's connection and read it: from here on a takeover (it
        writes the fence) aborts the next transaction, and none had happened when the WATCH began.
        Needed on every new connection (a WATCH lives on its connection), before its first write."""
        replies = await bounded(self.exchange.send([("WATCH", self.fence_key), ("GET", self.fence_key)]),
                                REDIS_SLACK_SECONDS)
        self._check_fence(replies[-1])

    def _check_fence(self, value: Any) -> None:
        if value is not None:
            self._armed_on = None
            raise LeaseLost(f"scheduler {self.scheduler_id}: taken over ({text_of(value)})")
        self._armed_on = self.exchange.connected_as

    async def round_trip(self, block_ms: int | None, read: bool = True) -> list:
        """Every queued write as one MULTI/EXEC (the token entries in one EVAL where the first of
        them stood: every write queued after a request's last token, its end and its expiries,
        still runs after it), then one XREAD of the input streams, all in one write to Redis."""
        if self.fence_key and (self._armed_on is None or self._armed_on is not self.exchange.connected_as):
            await self.arm()
        writes, commands, arguments = self.commands(block_ms, read)
        wait_seconds = (block_ms or 0) / 1000 + REDIS_SLACK_SECONDS
        try:
            replies = await bounded(self.exchange.send(arguments), wait_seconds)
        except BaseException:
            self._armed_on = None
            raise
        if self.fence_key:
            *replies, _, fence = replies
            self._check_fence(fence)  # (before anything read is used: a fenced scheduler acts on nothing)
        if commands:
            outcomes = replies[len(commands) + 1]
            if outcomes is None and self.fence_key:  # EXEC aborted by the WATCH: nothing ran
                self._armed_on = None
                raise LeaseLost(f"scheduler {self.scheduler_id}: taken over (its transaction did not run)")
            if isinstance(outcomes, Exception):
                first = next((reply for reply in replies[: len(commands) + 1] if isinstance(reply, Exception)),
                             outcomes)
                if not refused_up_front(first):
                    raise first  # a command Redis cannot parse: a bug
                raise RedisWritesRefused(f"{len(writes)} writes refused: {first}")
            del self.writes[: len(writes)]
            for command, outcome in zip(commands, outcomes, strict=True):
                if isinstance(command, int):
                    if isinstance(outcome, Exception):  # the script itself failed: no entry is known written
                        raise SchedulerStateError(f"writing {command} token entries failed: {outcome}")
                    failed = [(self.tokens.write(position), message)
                              for position, message in zip(outcome[::2], outcome[1::2])]
                    self.tokens.drop(command)
                    for write, message in failed:
                        self.on_write_failed(write, ResponseError(text_of(message)))
                elif isinstance(outcome, Exception):
                    self.on_write_failed(command, outcome)
        if not read:
            return []
        entries = replies[-1]
        if isinstance(entries, Exception):
            raise entries
        return xread_entries(entries)
