"""shared/redis_exchange.py against a private Redis: replies in order, an error reply in its place
as redis-py's exception, and no reply of an exchange broken off ever read as another's."""

import asyncio

import pytest
from redis.exceptions import ExecAbortError, ResponseError

from shared.redis_connection import connect
from shared.redis_exchange import Exchange
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def redis_url():
    server = RedisProcess().start()
    try:
        yield server.url
    finally:
        server.close()


async def test_replies_come_back_in_order_with_errors_in_their_place(redis_url):
    client = connect(redis_url)
    exchange = Exchange(client)
    try:
        await client.delete("exchange:list", "exchange:string")
        replies = await exchange.send([("SET", "exchange:string", "text"), ("RPUSH", "exchange:list", "a", "b"),
                                       ("LPUSH", "exchange:string", "x"), ("LRANGE", "exchange:list", 0, -1)])
        assert replies[0] in (True, b"OK", "OK")
        assert replies[1] == 2
        assert isinstance(replies[2], ResponseError) and "WRONGTYPE" in str(replies[2])
        assert replies[3] == [b"a", b"b"]
        # A transaction Redis refuses up front: the queued command's error, then EXECABORT, each in place.
        replies = await exchange.send([("MULTI",), ("RPUSH", "exchange:list", "c"), ("NOSUCHCOMMAND",), ("EXEC",),
                                       ("LLEN", "exchange:list")])
        assert isinstance(replies[2], ResponseError)
        assert isinstance(replies[3], ExecAbortError)
        assert replies[4] == 2  # nothing of the transaction ran
    finally:
        await client.delete("exchange:list", "exchange:string")
        await client.aclose()


async def test_an_exchange_broken_off_leaves_no_reply_for_the_next_one(redis_url):
    client = connect(redis_url)
    exchange = Exchange(client)
    try:
        await client.delete("exchange:stream")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):  # as the scheduler's bounded round trip gives up
                await exchange.send([("XREAD", "BLOCK", 3000, "STREAMS", "exchange:stream", "$")])
        await client.xadd("exchange:stream", {"m": b"late"})  # what the abandoned XREAD would have read
        await asyncio.sleep(0.1)
        assert await exchange.send([("GET", "exchange:missing"), ("ECHO", "fresh")]) == [None, b"fresh"]
        first, second = await asyncio.gather(exchange.send([("ECHO", "one")]), exchange.send([("ECHO", "two")]),
                                             return_exceptions=True)
        assert first == [b"one"]
        assert isinstance(second, RuntimeError) and "one call at a time" in str(second)
        assert await exchange.send([("ECHO", "after")]) == [b"after"]
    finally:
        await client.delete("exchange:stream")
        await client.aclose()
