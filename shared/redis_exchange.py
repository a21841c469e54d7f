"""Commands sent to Redis in one write on a connection kept for the purpose, their replies read
back in order: the hot paths' way (the scheduler's round trip, a worker's result and its plan
reads), with none of redis-py's machinery around each call.

redis-py connects (TLS, a password, the database) and hiredis encodes the commands and parses the
replies; the rest is here. The commands go out as one write on the connection's stream, and the
replies are read from it into a hiredis reader of the exchange's own, all those that came in one
read parsed at once. redis-py's pipeline cost about 110 µs of CPU a round trip at batch 64, and
its per-command send and read (a health check before each send, a time limit and a parser call per
reply) about 20 µs more than this: 105-109 against 86-88 (`benchmarks/scheduler_cpu.py
--round-trips 2000`). This reads two private attributes of redis-py's asyncio connection, its
stream reader and writer (`_reader`, `_writer`: every redis-py since the asyncio client's start,
TCP, TLS and Unix socket alike); a redis-py without them fails the first exchange with a clear
error, and tests/test_redis_exchange.py.

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

READ_SIZE = 65536
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


class Exchange:
    def __init__(self, client: Any) -> None:
        self.client = client  # a redis.asyncio client: its pool gives the connection, once
        self._connection: Any = None
        self._stream: asyncio.StreamReader | None = None  # the connection's stream the parser reads
        self._parser: Any = None
        self._sending = False

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
            return []  # (no reply to wait for: the read below would wait for one)
        connection = self._connection
        if connection is None:
            connection = self._connection = await self.client.connection_pool.get_connection()
        if not connection.is_connected:
            await connection.connect()
        stream, writer = getattr(connection, "_reader", None), getattr(connection, "_writer", None)
        if stream is not self._stream:  # connected anew: nothing of the old stream is left to parse
            if not isinstance(stream, asyncio.StreamReader) or not isinstance(writer, asyncio.StreamWriter):
                raise RuntimeError("this redis-py's asyncio Connection has no _reader/_writer streams: "
                                   "shared/redis_exchange.py needs them (pin redis-py to a version that has)")
            self._stream = stream
            self._parser = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error,
                                          notEnoughData=_MORE)
        writer.write(encoded(commands))
        if writer.transport.get_write_buffer_size():  # (the socket did not take it all at once)
            await writer.drain()
        parser, replies, count = self._parser, [], len(commands)
        while True:
            reply = parser.gets()
            while reply is not _MORE:
                replies.append(reply)
                if len(replies) == count:
                    return replies
                reply = parser.gets()
            data = await stream.read(READ_SIZE)
            if not data:
                raise ConnectionError("Redis closed the connection")
            parser.feed(data)
