"""shared/redis_exchange.py against a private Redis: replies in order, an error reply in its place
as redis-py's exception, and no reply of an exchange broken off ever read as another's."""

import asyncio

import pytest
from redis.exceptions import ConnectionError, ExecAbortError, ResponseError

from shared.redis_connection import connect
from shared.redis_exchange import Exchange, xread_entries
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["asyncio", "uvloop"])
def run_on_loop(request):
    """Each test on asyncio's own loop and on uvloop's, the scheduler's and the workers' (uvloop is
    a dependency of the project: never skipped)."""
    if request.param == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


@pytest.fixture(scope="module")
def redis_url():
    server = RedisProcess().start()
    try:
        yield server.url
    finally:
        server.close()


def test_replies_come_back_in_order_with_errors_in_their_place(redis_url, run_on_loop):
    run_on_loop(_replies_come_back_in_order_with_errors_in_their_place(redis_url))


async def _replies_come_back_in_order_with_errors_in_their_place(redis_url):
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


def test_an_exchange_broken_off_leaves_no_reply_for_the_next_one(redis_url, run_on_loop):
    run_on_loop(_an_exchange_broken_off_leaves_no_reply_for_the_next_one(redis_url))


async def _an_exchange_broken_off_leaves_no_reply_for_the_next_one(redis_url):
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


def test_replies_split_across_reads_and_a_connection_redis_closed(redis_url, run_on_loop):
    run_on_loop(_replies_split_across_reads_and_a_connection_redis_closed(redis_url))


async def _replies_split_across_reads_and_a_connection_redis_closed(redis_url):
    """The exchange parses what each read of the socket brings: replies larger than one read and
    many in one read alike; a connection Redis closed raises on the exchange that finds it, and the
    next exchange connects again."""
    client = connect(redis_url)
    exchange = Exchange(client)
    try:
        large = bytes(range(256)) * 1200  # 300 KB: several reads of the socket
        await client.set("exchange:large", large)
        echoes = [("ECHO", f"e{index}") for index in range(300)]
        replies = await exchange.send([("GET", "exchange:large"), *echoes, ("GET", "exchange:large")])
        assert replies[0] == replies[-1] == large
        assert replies[1:-1] == [f"e{index}".encode() for index in range(300)]
        [connection_id] = await exchange.send([("CLIENT", "ID")])
        assert await client.client_kill_filter(_id=connection_id) == 1
        with pytest.raises((ConnectionError, OSError)):
            await exchange.send([("ECHO", "lost")])
        [new_id] = await exchange.send([("CLIENT", "ID")])
        assert new_id != connection_id
        assert await exchange.send([("ECHO", "again"), ("GET", "exchange:large")]) == [b"again", large]
    finally:
        await client.delete("exchange:large")
        await client.aclose()


def test_replies_that_come_apart_are_all_awaited(redis_url, run_on_loop):
    run_on_loop(_replies_that_come_apart_are_all_awaited(redis_url))


async def _replies_that_come_apart_are_all_awaited(redis_url):
    """The scheduler's round trip: its writes are answered at once, its XREAD only when an entry
    comes; the exchange returns once, with both, in order."""
    client = connect(redis_url)
    exchange = Exchange(client)
    try:
        await client.delete("exchange:stream", "exchange:written")

        async def add_later():
            await asyncio.sleep(0.2)
            await client.xadd("exchange:stream", {"m": b"came"})

        adding = asyncio.create_task(add_later())
        replies = await exchange.send([("MULTI",), ("SET", "exchange:written", "1"), ("EXEC",),
                                       ("XREAD", "BLOCK", 5000, "STREAMS", "exchange:stream", "$")])
        await adding
        assert replies[:2] == [b"OK", b"QUEUED"] and replies[2] == [b"OK"]
        [(stream, [(_, fields)])] = xread_entries(replies[3])
        assert stream == b"exchange:stream" and fields == {b"m": b"came"}
        assert await exchange.send([("GET", "exchange:written")]) == [b"1"]
    finally:
        await client.delete("exchange:stream", "exchange:written")
        await client.aclose()


def test_the_scheduler_round_trip_builds_the_arguments_redis_py_builds_and_redis_runs_them(redis_url, run_on_loop):
    run_on_loop(_the_scheduler_round_trip_builds_the_arguments_redis_py_builds_and_redis_runs_them(redis_url))


async def _the_scheduler_round_trip_builds_the_arguments_redis_py_builds_and_redis_runs_them(redis_url):
    """RedisLink.commands builds its own commands' arguments (MULTI/EXEC, the token EVAL, XADD,
    SET, XREAD) without redis-py: the same tuples as redis-py's pipeline gives, the rare others
    still by redis-py, in order; and a real Redis runs them."""
    from services.scheduler.redis_link import READ_COUNT, TOKENS_SCRIPT, RedisLink

    client = connect(redis_url)
    written = ("plans:w1", "tokens:r1", "iterations", "plain", "request:r1", "active", "heartbeat")
    try:
        link = RedisLink(client, on_write_failed=lambda write, error: None)
        link.queue("xadd", "plans:w1", {"m": b"plan"}, maxlen=1000, approximate=True)
        link.queue_token("r1", "tokens:r1", "0-1", b"entry")
        link.queue("xadd", "iterations", {"m": b"record"}, maxlen=5, approximate=False)
        link.queue("xadd", "plain", {"a": b"1", "b": "2"})
        link.queue("hset", "request:r1", mapping={"status": "finished"})
        link.queue("expire", "request:r1", 60)
        link.queue("srem", "active", "r1")
        link.queue("xtrim", "plain", minid="0-1", approximate=False)
        link.queue("set", "heartbeat", b"info", px=3000)
        for block_ms in (50, None):
            _, commands, arguments = link.commands(block_ms)
            reference = client.pipeline(transaction=False)
            reference.execute_command("MULTI")
            for command in commands:
                if isinstance(command, int):
                    reference.eval(TOKENS_SCRIPT, 0, link.tokens.packed(command))
                else:
                    getattr(reference, command.command)(*command.args, **command.kwargs)
            reference.execute_command("EXEC")
            reference.xread(dict(link.read_ids), count=READ_COUNT, block=block_ms)
            assert arguments == [command_arguments for command_arguments, _ in reference.command_stack]
        assert [arguments[0] for arguments in arguments] == ["MULTI", "XADD", "EVAL", "XADD", "XADD", "HSET",
                                                            "EXPIRE", "SREM", "XTRIM", "SET", "EXEC", "XREAD"]
        replies = await link.round_trip(block_ms=None)
        assert replies == []  # nothing in the input streams; every write ran
        assert await client.xlen("plans:w1") == 1 and await client.get("heartbeat") == b"info"
        assert [entry_id for entry_id, _ in await client.xrange("tokens:r1")] == [b"0-1"]
        assert await client.xlen("iterations") == 1 and await client.xlen("plain") == 1
    finally:
        await client.delete(*written)
        await client.aclose()
