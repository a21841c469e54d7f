"""Commands sent to Redis in one write on a connection kept for the purpose, their replies read
back in order: the hot paths' way (the scheduler's round trip, a worker's result and its plan
reads), with none of redis-py's machinery around each call.

redis-py connects (TLS, a password, the database) and hiredis encodes the commands and parses the
replies; the rest is here. The commands go out as one write on the connection's stream, and the
replies are parsed by a hiredis reader of the exchange's own as the bytes come, in the event
loop's callback (_Replies, put in front of redis-py's protocol): the caller's task wakes once, when
its last reply is whole. (Through redis-py's StreamReader each read woke it: twice a round trip of
the scheduler's, whose writes are answered at once and whose XREAD blocks; 25-40 µs of CPU more a
round trip, `benchmarks/scheduler_cpu.py --round-trips`.) redis-py's pipeline cost about 110 µs of CPU a round trip at batch 64, and
its per-command send and read (a health check before each send, a time limit and a parser call per
reply) about 20 µs more than this: 105-109 against 86-88 (`benchmarks/scheduler_cpu.py
--round-trips 2000`). This reads a private attribute of redis-py's asyncio connection, its
stream writer (`_writer`: every redis-py since the asyncio client's start, TCP, TLS and Unix socket
alike), and replaces its transport's protocol (asyncio's `set_protocol`); a redis-py without it
fails the first exchange with a clear error, and tests/test_redis_exchange.py.

An error reply comes back in its command's place, as redis-py's exception for it (OutOfMemoryError,
ExecAbortError, ...); a lost connection raises ConnectionError. An exchange broken off (an error,
a cancel, the caller's time limit) closes the connection, so no reply of it is ever read as the
next one's; the next exchange connects again. No health check before a send (redis-py's reconnects
silently after 10 s idle): a dead connection shows as an error on the exchange that finds it. No
time limit here: callers bound the call.
"""

import asyncio
from typing import Any

import hiredis
from redis._parsers import BaseParser
from redis.exceptions import ConnectionError, InvalidResponse

_MORE = object()  # the parser's "not a whole reply yet" (False is a reply in RESP3)


def encoded(commands: list[tuple]) -> bytes:
    """Commands in Redis's protocol, one after another (hiredis: C, not redis-py's Python packer)."""
    return b"".join([hiredis.pack_command(command) for command in commands])


def stream_entries(reply: Any) -> list[tuple[Any, dict]]:
    """XRANGE's reply (or one stream's of XREAD) as an Exchange gives it, as redis-py's xrange gives
    it: [(entry id, {field: value})]."""
    return [(entry_id, dict(zip(fields[::2], fields[1::2])) if fields else {}) for entry_id, fields in reply or ()]


def xread_entries(reply: Any) -> list[tuple[Any, list[tuple[Any, dict]]]]:
    """XREAD's reply as an Exchange gives it (a map in RESP3, pairs in RESP2, None when nothing came),
    as redis-py's xread gives it: [(stream, [(entry id, {field: value})])]."""
    streams = reply.items() if isinstance(reply, dict) else reply or ()
    return [(stream, stream_entries(entries)) for stream, entries in streams]


class _Replies(asyncio.Protocol):
    """Stands in front of redis-py's own protocol on the exchange's connection: the bytes that come
    are parsed here, in the event loop's callback, and the caller is woken once, when the last
    reply it awaits is whole. (A round trip's writes are answered at once, its blocking XREAD a
    step later: through redis-py's StreamReader each of those reads woke the caller's task.) The
    connection's other events go on to redis-py's protocol, so its writer's drain and close work
    as before."""

    def __init__(self, inner: asyncio.Protocol) -> None:
        self.inner = inner
        self.parser = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error,
                                     notEnoughData=_MORE)
        self.replies: list = []
        self.count = 0
        self.waiter: asyncio.Future | None = None
        self.ended = False  # Redis closed its end: nothing more will come

    def expect(self, count: int, waiter: asyncio.Future) -> None:
        self.replies, self.count, self.waiter = [], count, waiter
        self._parse()

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        if self.waiter is not None:
            self._parse()

    def _parse(self) -> None:
        gets, replies = self.parser.gets, self.replies
        reply = gets()
        while reply is not _MORE:
            replies.append(reply)
            if len(replies) == self.count:
                waiter, self.waiter = self.waiter, None
                if not waiter.done():  # (not given up on meanwhile)
                    waiter.set_result(replies)
                return
            reply = gets()

    def _lost(self) -> None:
        self.ended = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionError("Redis closed the connection"))

    def eof_received(self) -> bool:
        self._lost()
        self.inner.eof_received()
        return False  # (the transport closes: a connection Redis ended is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Exchange:
    def __init__(self, client: Any) -> None:
        self.client = client  # a redis.asyncio client: its pool gives the connection, once
        self._connection: Any = None
        self._writer: asyncio.StreamWriter | None = None  # the connection's writer when _replies was put in
        self._replies: _Replies | None = None
        self._sending = False

    @property
    def connected_as(self) -> Any:
        """The connection's identity (its stream writer; None before the first send): it changes
        when the exchange connects again, which loses what lived on the old connection (a WATCH)."""
        return self._writer if self._connection is not None and self._connection.is_connected else None

    async def send(self, commands: list[tuple]) -> list:
        """Every command's reply, in order (an error reply as its exception, not raised). One call at
        a time: a second one meanwhile would read the first one's replies."""
        if self._sending:
            raise RuntimeError("an Exchange takes one call at a time")
        self._sending = True
        try:
            return await self._send(commands)
        except BaseException:
            # Broken off: replies of it may still come. The connection goes, with them (redis-py's
            # own read does the same).
            if self._connection is not None:
                await self._connection.disconnect(nowait=True)
            raise
        finally:
            self._sending = False

    async def close(self) -> None:
        """Give the connection back to the client's pool, closed (no reply is left on it to be read)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.disconnect()
            await self.client.connection_pool.release(connection)

    async def _send(self, commands: list[tuple]) -> list:
        if not commands:
            return []  # (no reply to wait for: the wait below would never end)
        connection = self._connection
        if connection is None:
            connection = self._connection = await self.client.connection_pool.get_connection()
        if not connection.is_connected:
            await connection.connect()
        writer = getattr(connection, "_writer", None)
        if writer is not self._writer:  # connected anew: its replies are read here, by a parser of their own
            transport = getattr(writer, "transport", None)
            if not isinstance(writer, asyncio.StreamWriter) or not hasattr(transport, "set_protocol"):
                raise RuntimeError("this redis-py's asyncio Connection has no _writer stream: "
                                   "shared/redis_exchange.py needs it (pin redis-py to a version that has)")
            self._replies = _Replies(transport.get_protocol())
            transport.set_protocol(self._replies)
            self._writer = writer
        if self._replies.ended or writer.transport.is_closing():
            raise ConnectionError("Redis closed the connection")
        waiter = asyncio.get_running_loop().create_future()
        self._replies.expect(len(commands), waiter)
        writer.write(encoded(commands))
        if writer.transport.get_write_buffer_size():  # (the socket did not take it all at once)
            await writer.drain()
        return await waiter
