"""Commands sent to Redis in one write on a connection kept for the purpose, their replies read
back in order: the hot paths' way (the scheduler's round trip, a worker's result), without
redis-py's pipeline machinery around each call (response callbacks, retries, a connection taken
from the pool and given back, a time limit per reply). That machinery cost about 110 µs of CPU a
call at batch 64, measured: `benchmarks/scheduler_cpu.py --round-trips 2000`.

redis-py still connects (TLS, a password, the database), checks the connection's health and
parses the replies; hiredis encodes the commands. An error reply comes back in its command's place,
as redis-py's exception for it (OutOfMemoryError, ExecAbortError, ...); a lost connection raises.
An exchange broken off (an error, a cancel, the caller's time limit) leaves no reply to be read as
the next one's: redis-py drops a connection whose send or read is interrupted, and the next send
reconnects (tests/test_redis_exchange.py). No time limit here: callers bound the call.
"""

import math
from typing import Any

import hiredis
from redis.exceptions import ResponseError


def encoded(commands: list[tuple]) -> bytes:
    """Commands in Redis's protocol, one after another (hiredis: C, not redis-py's Python packer)."""
    return b"".join([hiredis.pack_command(command) for command in commands])


def xread_entries(reply: Any) -> list[tuple[Any, list[tuple[Any, dict]]]]:
    """XREAD's reply as an Exchange gives it (a map in RESP3, pairs in RESP2, None when nothing came),
    as redis-py's xread gives it: [(stream, [(entry id, {field: value})])]."""
    streams = reply.items() if isinstance(reply, dict) else reply or ()
    return [(stream, [(entry_id, dict(zip(fields[::2], fields[1::2])) if fields else {})
                      for entry_id, fields in stream_entries])
            for stream, stream_entries in streams]


class Exchange:
    def __init__(self, client: Any) -> None:
        self.client = client  # a redis.asyncio client: its pool gives the connection, once
        self._connection: Any = None
        self._sending = False

    async def send(self, commands: list[tuple]) -> list:
        """Every command's reply, in order (an error reply as its exception, not raised). One call at
        a time: a second one meanwhile would read the first one's replies."""
        if self._sending:
            raise RuntimeError("an Exchange takes one call at a time")
        self._sending = True
        try:
            return await self._send(commands)
        finally:
            self._sending = False

    async def close(self) -> None:
        """Give the connection back to the client's pool, closed (no reply is left on it to be read)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.disconnect()
            await self.client.connection_pool.release(connection)

    async def _send(self, commands: list[tuple]) -> list:
        if self._connection is None:
            self._connection = await self.client.connection_pool.get_connection()
        connection = self._connection
        await connection.send_packed_command(encoded(commands))
        replies = []
        for _ in commands:
            try:
                replies.append(await connection.read_response(timeout=math.inf))
            except ResponseError as error:
                replies.append(error)
        return replies
