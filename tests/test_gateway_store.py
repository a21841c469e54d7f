"""The gateway's follower of a request (services/gateway/store.py, Store.follow_tokens) against a
private Redis, the scheduler's side played by hand: a request whose keys a restarted Redis lost
is submitted again by the gateway that accepted it, and its reader gets each output token once."""

import asyncio
import time

import pytest

from services.gateway import store as store_module
from services.gateway.store import MAX_RESUBMITS, Store
from shared import keys
from shared.messages import RequestRecord, SamplingParams
from shared.redis_connection import connect
from shared.wire import encode_token_event

pytestmark = pytest.mark.timeout(60)

REQUEST_ID = "cmpl-" + "ab" * 16
POOL = keys.ModelKeys("store-test")  # a pool of its own in the session's Redis (tests/conftest.py)


@pytest.fixture
def quick_status_checks(monkeypatch):
    """Idle waits of 0.1 s (not 1 s): a status look after the first, then every 5th."""
    monkeypatch.setattr(store_module, "BLOCK_MS", 100)


async def write_tokens(redis, indexes: range, final_at: int | None = None) -> None:
    """Token entries as the scheduler and workers write them: entry id 0-(index + 1)."""
    for index in indexes:
        reason = "length" if index == final_at else None
        await redis.xadd(keys.token_stream(REQUEST_ID), {"m": encode_token_event(index, 100 + index, f"t{index} ",
                                                                                 reason, 3, index + 1)},
                         id=f"0-{index + 1}")


async def lose_everything(redis) -> None:
    """What a Redis that lost the writes since the request was accepted holds of it: nothing."""
    await redis.delete(keys.request_key(REQUEST_ID), keys.token_stream(REQUEST_ID))
    await redis.srem(POOL.active_requests, REQUEST_ID)
    await redis.delete(POOL.new_requests)


async def test_a_request_redis_lost_is_submitted_again_and_read_on_from_where_it_was(redis_url, quick_status_checks):
    redis = connect(redis_url)
    store = Store(redis)
    record = RequestRecord(request_id=REQUEST_ID, prompt_token_ids=(1, 2, 3), sampling=SamplingParams(seed=7),
                           arrival_time=time.time())
    submissions = []

    async def resubmit() -> None:
        submissions.append(time.monotonic())
        await store.submit(record, model_keys=POOL)

    try:
        await store.submit(record, model_keys=POOL)
        await write_tokens(redis, range(3))
        seen = []

        async def follow() -> None:
            async for event in store.follow_tokens(REQUEST_ID, resubmit=resubmit):
                if event is not None:
                    seen.append(event)
                    if event.finish_reason is not None:
                        return

        follower = asyncio.create_task(follow())
        async with asyncio.timeout(10):
            while len(seen) < 3:
                await asyncio.sleep(0.02)
            await lose_everything(redis)
            while not submissions:
                await asyncio.sleep(0.02)
        # Submitted again as it was: its record, in the active set, announced to the scheduler.
        assert await redis.hget(keys.request_key(REQUEST_ID), "status") == b"waiting"
        assert await redis.sismember(POOL.active_requests, REQUEST_ID)
        assert [fields[b"id"] for _, fields in await redis.xrange(POOL.new_requests)] == [REQUEST_ID.encode()]
        # The request runs again from its start: the reader gets what follows what it had, once.
        await write_tokens(redis, range(6), final_at=5)
        async with asyncio.timeout(10):
            await follower
        assert [event.index for event in seen] == [0, 1, 2, 3, 4, 5]
        assert seen[-1].finish_reason == "length" and len(submissions) == 1
    finally:
        await redis.delete(keys.request_key(REQUEST_ID), keys.token_stream(REQUEST_ID), POOL.active_requests,
                           POOL.new_requests)
        await redis.aclose()


@pytest.mark.parametrize("resubmits", [False, True], ids=["an-observer", "lost-every-time"])
async def test_a_request_gone_for_good_ends_in_error(redis_url, quick_status_checks, resubmits):
    """A reader that cannot submit it (a re-attached one), or one whose request is lost again
    after MAX_RESUBMITS submissions, gets a final error event, not a wait forever."""
    redis = connect(redis_url)
    store = Store(redis)
    submissions = []

    async def resubmit() -> None:
        submissions.append(time.monotonic())  # submitted, and lost again at once

    try:
        async with asyncio.timeout(20):
            events = [event async for event in store.follow_tokens(REQUEST_ID, resubmit=resubmit if resubmits
                                                                    else None) if event is not None]
        assert [(event.token_id, event.finish_reason) for event in events] == [(-1, "error")]
        assert len(submissions) == (MAX_RESUBMITS if resubmits else 0)
    finally:
        await redis.aclose()


async def test_with_several_schedulers_a_new_request_entry_says_its_key_length_and_prefix(redis_url):
    """What the schedulers choose by (services/scheduler/shards.py, CLAIM_SCRIPT); one scheduler reads
    the id alone."""
    from services.scheduler.shards import NewRequestEntry
    from shared import prefix_anchors

    redis = connect(redis_url)
    prompt = tuple(range(500, 700))
    pools = {True: keys.ModelKeys("store-test-sharded"), False: keys.ModelKeys("store-test-one")}
    try:
        for sharded, pool in pools.items():
            record = RequestRecord(request_id=f"cmpl-{int(sharded)}{'cd' * 15}c", prompt_token_ids=prompt,
                                   sampling=SamplingParams(), arrival_time=time.time(), client_key="key-1")
            await Store(redis, sharded=sharded).submit(record, model_keys=pool)
            [(_, fields)] = await redis.xrange(pool.new_requests)
            if sharded:
                assert NewRequestEntry.of_entry(record.request_id, fields) == NewRequestEntry(
                    record.request_id, "key-1", 200, "".join(anchor.hex() for anchor in prefix_anchors.anchors(prompt)))
            else:
                assert fields == {b"id": record.request_id.encode()}
    finally:
        for pool in pools.values():
            await redis.delete(pool.new_requests, pool.active_requests)
        await redis.delete(*(keys.request_key(f"cmpl-{index}{'cd' * 15}c") for index in (0, 1)))
        await redis.aclose()
