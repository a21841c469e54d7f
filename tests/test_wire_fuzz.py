"""Bad msgpack where the scheduler rebuilds its pool at start (active set, request records, token
streams): it skips or fails what is malformed and serves the rest. The live scheduler's and
worker's streams are fuzzed on the whole system in tests/test_admission_system.py."""

import msgpack
import pytest
from hypothesis import strategies as st

from shared import keys
from shared.messages import IterationRecord, IterationRow, RequestRecord, SamplingParams
from shared.wire import WireError, decode, encode, encode_row
from tests.fuzzing import MSGPACK_VALUES, bad_payloads, drawn
from tests.test_scheduler_service import (  # noqa: F401 (settings is a fixture)
    FakeWorker,
    running_scheduler,
    settings as scheduler_settings,
    submit,
    wait_finished,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


def test_an_iteration_row_encodes_as_its_record_does():
    """encode_row of an IterationRow (what the scheduler writes every worker-iteration, unvalidated)
    is the bytes of the IterationRecord of the same fields, and reads back as it; the row's fields
    are the record's, in its order."""
    assert IterationRow._fields == tuple(IterationRecord.model_fields)
    record = IterationRecord(iteration=3, worker_id="w1", plan_id=9, request_ids=("cmpl-a", "cmpl-b"),
                             joined=("cmpl-b",), finished=(), cancelled=("cmpl-c",), prefill_tokens=12,
                             decode_tokens=1, started_at=1.5, finished_at=2.5, step_seconds=0.25)
    row = IterationRow(**record.__dict__)
    assert encode_row(row) == encode(record)
    assert decode(IterationRecord, encode_row(row)) == record


def test_bad_payloads_never_decode_into_a_message_that_breaks_an_invariant():
    valid = RequestRecord(request_id="cmpl-x", prompt_token_ids=(1, 2), sampling=SamplingParams(),
                          arrival_time=1.0).model_dump()  # fmt: skip
    decoded = rejected = 0
    for payload in drawn(bad_payloads(valid), 400):
        try:
            record = decode(RequestRecord, payload)
        except WireError:
            rejected += 1
            continue
        decoded += 1
        assert record.arrival_time == record.arrival_time, "no NaN gets through"
        assert all(isinstance(token, int) for token in record.prompt_token_ids)
    assert rejected > decoded, (rejected, decoded)
    with pytest.raises(WireError):
        decode(RequestRecord, msgpack.packb({**valid, "arrival_time": float("nan")}))


async def test_a_scheduler_starting_on_a_pool_full_of_garbage_serves_the_real_requests(
    redis_client, scheduler_settings  # noqa: F811
):
    real = {"cmpl-real": (1, 2, 3), "cmpl-real-2": (4, 5)}
    valid = RequestRecord(request_id="cmpl-x", prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=3),
                          arrival_time=1.0).model_dump()  # fmt: skip
    bad = drawn(st.tuples(bad_payloads(valid), st.binary(max_size=24) | st.text(max_size=24), MSGPACK_VALUES), 150)
    garbage_ids = []
    pipe = redis_client.pipeline(transaction=False)
    for position, (record, member, event) in enumerate(bad):
        request_id = f"cmpl-garbage-{position}"
        garbage_ids.append(request_id)
        pipe.hset(keys.request_key(request_id), "record", record)
        pipe.sadd(keys.ACTIVE_REQUESTS_SET, request_id, member or b"\xff")  # and a member that is no id
        pipe.xadd(keys.token_stream(request_id), {"m": msgpack.packb(event, use_bin_type=True)})
    mismatched = RequestRecord(request_id="cmpl-someone-else", prompt_token_ids=(1,), sampling=SamplingParams(),
                               arrival_time=1.0)  # fmt: skip
    pipe.hset(keys.request_key("cmpl-mismatched"), "record", encode(mismatched))
    pipe.sadd(keys.ACTIVE_REQUESTS_SET, "cmpl-mismatched")
    await pipe.execute()
    await submit(redis_client, "cmpl-real", real["cmpl-real"], max_tokens=4)  # waiting when the scheduler starts

    async with FakeWorker(scheduler_settings.redis_url, "w1", real), running_scheduler(scheduler_settings):
        await submit(redis_client, "cmpl-real-2", real["cmpl-real-2"], max_tokens=3)
        for request_id, count in (("cmpl-real", 4), ("cmpl-real-2", 3)):
            events = await wait_finished(redis_client, request_id)
            assert [event.finish_reason for event in events] == [None] * (count - 1) + ["length"], request_id
        mismatched_events = await wait_finished(redis_client, "cmpl-mismatched")
        assert mismatched_events[-1].finish_reason == "error"

        async def no_garbage_left() -> bool:
            return await redis_client.smembers(keys.ACTIVE_REQUESTS_SET) == set()

        await wait_until(no_garbage_left, what="every malformed member and record to leave the active set")
    for request_id in garbage_ids:  # each one ended (failed, or finished if its record was valid enough)
        status = await redis_client.hget(keys.request_key(request_id), "status")
        assert status in (b"finished", b"failed", b"cancelled"), (request_id, status)
