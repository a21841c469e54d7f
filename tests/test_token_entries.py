"""Token entries from the workers (services/worker/token_writer.py) and the scheduler's share of
them (services/scheduler/output.py): the token streams they write together are the ones the
scheduler writes alone, entry for entry, text included, through pipelined plans, a worker's plans
abandoned after it ran them (it wrote their entries, the scheduler never reads their results),
requests resumed with output, stop tokens, max_tokens, a full context, ignore_eos and a character
split across tokens at a request's end. Without Redis here: Redis's part (an entry id not above the
stream's last is refused) is done by `Streams`; tests/test_scheduler_service.py runs it for real.
"""

import collections
import random

import msgpack
import pytest
import redis.asyncio
from redis.exceptions import OutOfMemoryError

from services.bench.by_request_id import apply_result
from services.scheduler.held_results import ResultHolding
from services.scheduler.output import RequestOutputs
from services.scheduler.policy import SchedulerPolicy
from services.scheduler.redis_link import RedisLink
from services.worker.token_writer import TokenWriter
from shared.messages import PlanResult, RequestRecord, SampledToken, SamplingParams
from shared.tokenizer import IncrementalDetokenizer, piece_after
from shared.wire import decode_token_event

CONTEXT_LENGTH = 96
TEXT = "Füße, naïve café; 東京タワー and 😀🎉 emoji. The quick brown fox jumps over the lazy dog again and again."


def byte_token(tokenizer, data: bytes) -> int:
    return next(token_id for token_id in range(tokenizer.vocab_size) if tokenizer.token_bytes(token_id) == data)


def model_outputs(tokenizer) -> dict[str, tuple[list[int], dict, list[int]]]:
    """request -> (prompt, sampling, the tokens the "model" samples at output index 0, 1, ...)."""
    text = tokenizer.encode(TEXT)
    stop = sorted(tokenizer.stop_token_ids)[0]
    lead, continuation = byte_token(tokenizer, b"\xe6"), byte_token(tokenizer, b"\x9d")
    # "東" split as bytes with four stop tokens (ignored) between its first byte and the rest
    split = [*text[:6], lead, stop, stop, stop, stop, continuation, byte_token(tokenizer, b"\xb1"), *text[6:]]
    ends_mid_character = text[:8] + [lead]  # its last token ends inside a character: flushed as U+FFFD
    return {
        "a-length": ([1, 2, 3], {"max_tokens": 30}, text),
        "b-stop-token": ([4, 5], {"max_tokens": 60}, text[:11] + [stop] + text),
        "c-ignore-eos": ([6], {"max_tokens": len(split) - 2, "ignore_eos": True}, split),
        "d-context": (list(range(10, 80)), {"max_tokens": 60}, text),  # ends by the context: 26 outputs
        "e-mid-character": ([7, 8, 9], {"max_tokens": len(ends_mid_character)}, ends_mid_character),
        "f-resumed": ([11, 12], {"max_tokens": 40}, text),  # starts with 9 outputs (a restarted scheduler)
        "g-stop-strings": ([13], {"max_tokens": 40, "stop": ("lazy",)}, text),  # the scheduler writes all
        "h-logprobs": ([14], {"max_tokens": 20, "logprobs": 2}, text),  # the scheduler writes all
    }


class Streams:
    """Token streams as Redis keeps them: an entry whose id is not above the stream's last is refused."""

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[tuple[int, int], bytes]]] = collections.defaultdict(list)
        self.by_writer = collections.Counter()

    def xadd(self, stream_key: str, entry_id: str, payload: bytes, writer: str) -> None:
        key = tuple(int(part) for part in entry_id.split("-"))
        stream = self.entries[stream_key]
        if stream and key <= stream[-1][0]:
            return
        stream.append((key, payload))
        self.by_writer[writer] += 1

    def read(self) -> dict[str, list[tuple[tuple[int, int], tuple]]]:
        return {stream_key: [(entry_id, tuple(decode_token_event(payload).model_dump().values()))
                             for entry_id, payload in entries] for stream_key, entries in self.entries.items()}


def run(tokenizer, workers_write: bool, abandon_at: int | None = None, out_of_step: float = 0.0) -> Streams:
    """Every request to its end through one worker with two plans in flight; abandon_at: after that
    many plans, the worker's plans in flight are given up (it runs them anyway); out_of_step: the
    chance that the worker finds a token out of step with its text (it writes none of that request's
    entries from then on, and says so: the scheduler writes them)."""
    rng = random.Random(3)
    script = model_outputs(tokenizer)
    policy = SchedulerPolicy("epoch", context_length=CONTEXT_LENGTH, stop_token_ids=tokenizer.stop_token_ids,
                             pipeline_depth=2, max_batch_tokens=48,
                             text_context=tokenizer.text_context if workers_write else None)
    link = RedisLink(redis.asyncio.Redis(), on_write_failed=lambda write, error: None)  # never connects
    outputs = RequestOutputs(tokenizer, policy, link, ResultHolding(False), 3600)
    writer, streams = TokenWriter(tokenizer), Streams()
    policy.worker_up("w0", kv_blocks_total=1000, kv_block_size=16)
    for number, (name, (prompt, sampling, tokens)) in enumerate(script.items()):
        record = RequestRecord(request_id=f"{number:032x}", prompt_token_ids=tuple(prompt), arrival_time=number,
                               sampling=SamplingParams(seed=number, **sampling))
        resumed = tokens[:9] if name == "f-resumed" else []
        if resumed:  # its first entries, as the scheduler before wrote them
            detokenizer = IncrementalDetokenizer(tokenizer, prompt)
            for index, token_id in enumerate(resumed):
                outputs.token_event(record.request_id, index, token_id, detokenizer.push(token_id))
        policy.add_request(record, resumed)
        outputs.start(record, resumed, len(detokenizer.text) if resumed else 0)
    tokens_of = {f"{number:032x}": tokens for number, (_, _, tokens) in enumerate(script.values())}

    def scheduler_writes() -> None:
        columns = link.tokens
        for position in range(len(columns)):
            streams.xadd(columns.stream_keys[position], columns.entry_ids[position], columns.payloads[position],
                         "scheduler")
        columns.drop(len(columns))
        link.writes.clear()

    def worker_runs(plan) -> PlanResult:
        sampled = {item.request_id: (tokens_of[item.request_id] + [17] * 99)[item.output_index]
                   for item in plan.items if item.sample}  # (past a request's end: what the model would say)
        writes, unwritten = writer.after_step(plan, sampled)
        for write in [write for write in writes if rng.random() < out_of_step]:
            writes.remove(write)
            write[0].ended = True  # (as after_step does for a token out of step)
            unwritten[next(request_id for request_id, row in writer._rows.items() if row is write[0])] = 0
        if writes:
            for stream_key, entry_id, payload, _, _ in zip(*msgpack.unpackb(writer.entries(writes), raw=True)[:5],
                                                        strict=True):
                streams.xadd(stream_key.decode(), entry_id.decode(), payload, "worker")
        return PlanResult(scheduler_epoch=plan.scheduler_epoch, plan_id=plan.plan_id, worker_id="w0",
                          tokens=tuple(SampledToken(request_id, token_id, next(
                              item.output_index for item in plan.items if item.request_id == request_id))
                              for request_id, token_id in sampled.items()),
                          kv_blocks_total=1000, kv_blocks_free=500, step_seconds=0.001,
                          entries_written=unwritten is not None, unwritten=frozenset(unwritten or ()))

    in_flight: collections.deque = collections.deque()
    plans = 0
    scheduler_writes()
    while policy.running_count or policy.waiting_count or in_flight:
        for _ in range(policy.max_depth):
            if "w0" in policy.idle_workers() and (plan := policy.next_plan("w0")) is not None:
                in_flight.append(plan)
                plans += 1
        outputs.publish_finished_without_token()
        if plans == abandon_at:
            for plan in in_flight:
                worker_runs(plan)  # run, its entries written, its result never read
            in_flight.clear()
            policy.reset_worker("w0")
            continue
        result = worker_runs(in_flight.popleft())
        outcomes = apply_result(policy, result)
        outputs.publish_tokens(outcomes, "w0")
        outputs.publish_finished_without_token()
        policy.take_iteration_records()
        scheduler_writes()
        assert plans < 500, "the requests do not end"
    scheduler_writes()
    return streams


@pytest.mark.parametrize(("abandon_at", "out_of_step"), [(None, 0.0), (7, 0.0), (12, 0.0), (None, 0.05)])
def test_workers_and_the_scheduler_write_the_streams_the_scheduler_writes_alone(tokenizer, abandon_at, out_of_step):
    alone = run(tokenizer, workers_write=False, abandon_at=abandon_at)
    together = run(tokenizer, workers_write=True, abandon_at=abandon_at, out_of_step=out_of_step)
    assert together.read() == alone.read()
    assert alone.by_writer["worker"] == 0
    if out_of_step:
        assert 10 < together.by_writer["worker"] < 2 * together.by_writer["scheduler"]
        return
    # Most entries are the worker's: all but the last of each of the six requests it writes for
    # (the resumed request's first nine were the scheduler's before)
    assert together.by_writer["worker"] > 2 * together.by_writer["scheduler"]
    streams = together.read()
    assert len(streams) == len(model_outputs(tokenizer))
    ends = {stream_key: entries[-1][1] for stream_key, entries in streams.items()}
    assert sorted(event[3] for event in ends.values()) == ["length"] * 6 + ["stop"] * 2
    texts = {stream_key: "".join(event[2] for _, event in entries) for stream_key, entries in streams.items()}
    assert any(text.endswith("\ufffd") for text in texts.values()), "a request ends inside a character"
    assert any("東" in text and "\ufffd" not in text and text.count("京") == 1 for text in texts.values())


def test_a_piece_from_the_tokens_alone_is_the_incremental_detokenizers(tokenizer):
    """piece_after(text_context(...)) against a detokenizer pushed every token, at every position of
    random sequences of multi-byte characters' single bytes, whole tokens and special tokens."""
    rng = random.Random(5)
    whole = tokenizer.encode(TEXT)
    single_bytes = [byte_token(tokenizer, bytes([value])) for value in (0xe6, 0x9d, 0xb1, 0xf0, 0x9f, 0x98, 0x80,
                                                                           0xc3, 0xbc, 0x41)]
    specials = sorted(tokenizer.special_token_ids)[:3]
    for _ in range(200):
        prompt = [rng.choice(whole + single_bytes) for _ in range(rng.randint(1, 6))]
        outputs = [rng.choice(whole + single_bytes * 3 + specials * 2) for _ in range(40)]
        detokenizer = IncrementalDetokenizer(tokenizer)  # pushed every token, the prompt's silently
        for token_id in prompt:
            detokenizer.push(token_id)
        for index, token_id in enumerate(outputs):
            context = tokenizer.text_context(prompt, outputs[:index])
            assert len(context) <= 4
            piece = detokenizer.push(token_id)
            assert piece_after(tokenizer, context, token_id, last=False) == piece, (prompt, outputs[: index + 1])
        context = tokenizer.text_context(prompt, outputs[:-1])
        assert piece_after(tokenizer, context, outputs[-1], last=True) == piece + detokenizer.flush()


def _plan(epoch: str, plan_id: int, new=(), items=(), free=()):
    from shared.messages import BatchPlan
    return BatchPlan(scheduler_epoch=epoch, plan_id=plan_id, worker_id="w0", new_requests=tuple(new),
                     items=tuple(items), free_request_ids=tuple(free))


async def test_the_write_script_writes_entries_then_the_result_and_nothing_for_a_request_gone(redis_client,
                                                                                              tokenizer):
    """A worker's write (WRITE_SCRIPT, one EVAL): its entries, then its result; none for a request
    whose hash is gone (no key is made; a stream that is there takes it, keeping its expiry); a stream
    gone from a request that ended is made again with the hash's time to live; an entry written
    before is skipped; an entry that fails for its key is left out and its request named with the
    result; Redis refusing writes stops the script before the result (the worker sends it all
    again); and nothing at all, but the reply STALE, unless the pool was loaded under the plan's
    epoch on this Redis server (a restarted one may have lost the entries before these)."""
    from services.worker.token_writer import STALE, WRITE_SCRIPT
    from shared import keys
    from shared.messages import NewRequest, StepItem

    text = tokenizer.encode("Hello there, general Kenobi, you are a bold one")
    names = {name: f"{number:032x}" for number, name in enumerate(["running", "gone", "ended", "broken"])}
    new = [NewRequest(request_id=request_id, sampling=SamplingParams(max_tokens=100), entries_below=100,
                      text_context=tuple(text[:2])) for request_id in names.values()]
    writer = TokenWriter(tokenizer)

    async def publish(plan_id: int, index: int) -> list:
        items = [StepItem(request_id, (), 10 + index, True, index, index > 0) for request_id in names.values()]
        writes, unwritten = writer.after_step(_plan("e", plan_id, new if plan_id == 1 else (), items),
                                              {request_id: text[2 + index] for request_id in names.values()})
        assert not unwritten and len(writes) == len(names)
        return await write(writer.entries(writes), plan_id)

    async def write(entries: bytes, plan_id: int) -> list:
        try:
            return [await redis_client.eval(WRITE_SCRIPT, 2, keys.RESULTS_STREAM, keys.INCARNATION, entries,
                                            f"result {plan_id}", 1000, "e")]
        except Exception as error:
            return [error]

    run_id = (await redis_client.info("server"))["run_id"]
    await redis_client.set(keys.INCARNATION, f"e {run_id}")
    await redis_client.hset(keys.request_key(names["running"]), "status", "running")
    await redis_client.hset(keys.request_key(names["ended"]), "status", "finished")
    await redis_client.expire(keys.request_key(names["ended"]), 50)
    await redis_client.hset(keys.request_key(names["broken"]), "status", "running")
    await redis_client.xadd(keys.token_stream(names["running"]), {"m": b"written before"}, id="0-2")
    reply = await publish(1, 0)
    assert not isinstance(reply[0], Exception)
    assert [entry_id for entry_id, _ in await redis_client.xrange(keys.token_stream(names["running"]))] == [b"0-2"]
    assert not await redis_client.exists(keys.token_stream(names["gone"])), "no key for a request gone"
    ended = await redis_client.xrange(keys.token_stream(names["ended"]))
    assert [entry_id for entry_id, _ in ended] == [b"0-1"]
    assert decode_token_event(ended[0][1][b"m"]).text == tokenizer.decode(text[:3])[len(tokenizer.decode(text[:2])):]
    assert 0 < await redis_client.pttl(keys.token_stream(names["ended"])) <= 50_000
    assert [fields[b"m"] for _, fields in await redis_client.xrange(keys.RESULTS_STREAM)] == [b"result 1"]

    await redis_client.set(keys.token_stream(names["broken"]), "not a stream")
    await redis_client.delete(keys.request_key(names["ended"]))  # its stream is there, with its expiry
    reply = await publish(2, 1)
    assert not isinstance(reply[0], Exception)
    results = [fields for _, fields in await redis_client.xrange(keys.RESULTS_STREAM)]
    assert [fields[b"m"] for fields in results] == [b"result 1", b"result 2"]
    assert msgpack.unpackb(results[1][b"f"], raw=False) == [names["broken"]] and b"f" not in results[0]
    assert [entry_id for entry_id, _ in await redis_client.xrange(keys.token_stream(names["running"]))] == \
        [b"0-2"], "index 1's entry: written before (0-2 is its id)"
    assert len(await redis_client.xrange(keys.token_stream(names["ended"]))) == 2
    assert 0 < await redis_client.pttl(keys.token_stream(names["ended"])) <= 50_000, "a stream there keeps its expiry"

    await redis_client.config_set("maxmemory", 1)
    try:
        reply = await publish(3, 2)
    finally:
        await redis_client.config_set("maxmemory", 0)
    assert isinstance(reply[0], OutOfMemoryError), reply
    assert len(await redis_client.xrange(keys.RESULTS_STREAM)) == 2, "no result while Redis refuses writes"
    assert len(await redis_client.xrange(keys.token_stream(names["ended"]))) == 2

    items = [StepItem(request_id, (), 13, True, 3, True) for request_id in names.values()]
    writes, _ = writer.after_step(_plan("e", 4, (), items), {request_id: text[5] for request_id in names.values()})
    entries = writer.entries(writes)
    for incarnation in (f"a-newer-epoch {run_id}", f"e {'0' * 40}", None):  # a new scheduler, a new Redis
        if incarnation is None:
            await redis_client.delete(keys.INCARNATION)
        else:
            await redis_client.set(keys.INCARNATION, incarnation)
        assert await write(entries, 4) == [STALE], incarnation
        assert len(await redis_client.xrange(keys.RESULTS_STREAM)) == 2, incarnation
        assert len(await redis_client.xrange(keys.token_stream(names["ended"]))) == 2, incarnation
    await redis_client.set(keys.INCARNATION, f"e {run_id}")
    assert await write(entries, 4) != [STALE]
    assert len(await redis_client.xrange(keys.RESULTS_STREAM)) == 3
    assert len(await redis_client.xrange(keys.token_stream(names["ended"]))) == 3

    # Plans answered together (Settings.answer_every): every entry first, then the results in plan
    # order, the failed entries' requests named with the last
    items = [StepItem(request_id, (), 14, True, 4, True) for request_id in names.values()]
    writes, _ = writer.after_step(_plan("e", 5, (), items), {request_id: text[6] for request_id in names.values()})
    await redis_client.eval(WRITE_SCRIPT, 2, keys.RESULTS_STREAM, keys.INCARNATION, writer.entries(writes),
                            "result 5", 1000, "e", "result 6", "result 7")
    results = [fields for _, fields in await redis_client.xrange(keys.RESULTS_STREAM)][3:]
    assert [fields[b"m"] for fields in results] == [b"result 5", b"result 6", b"result 7"]
    assert msgpack.unpackb(results[2][b"f"], raw=False) == [names["broken"]]
    assert not any(b"f" in fields for fields in results[:2])
    assert len(await redis_client.xrange(keys.token_stream(names["ended"]))) == 4


async def test_the_write_script_sets_prompt_logprobs_fields_only_in_hashes_that_are_there(redis_client, tokenizer):
    """A step's prompt log-probabilities go into their requests' hashes with its result (before the
    entries it writes), into no hash that is gone (no key is made), and nothing under a stale epoch."""
    from services.worker.token_writer import STALE, WRITE_SCRIPT
    from shared import keys
    from shared.messages import PromptLogprobsChunk
    from shared.wire import decode

    here, gone = f"{1:032x}", f"{2:032x}"
    chunk = PromptLogprobsChunk(first_position=1, entries=((5, -1.5, 3, ((7, -0.2), (9, -1.0))), (6, -0.1, 1, ())))
    writer = TokenWriter(tokenizer)
    run_id = (await redis_client.info("server"))["run_id"]
    await redis_client.set(keys.INCARNATION, f"e {run_id}")
    await redis_client.hset(keys.request_key(here), "status", "running")

    async def write(epoch: str):
        writer.note_prompt_logprobs({here: chunk, gone: chunk})
        assert writer.has_fields
        reply = await redis_client.eval(WRITE_SCRIPT, 2, keys.RESULTS_STREAM, keys.INCARNATION, writer.entries([]),
                                        "result", 1000, epoch)
        assert not writer.has_fields  # (taken with these entries)
        return reply

    assert await write("an-older-epoch") == STALE
    assert not await redis_client.hexists(keys.request_key(here), keys.prompt_logprobs_field(1))
    assert await write("e") != STALE
    assert decode(PromptLogprobsChunk, await redis_client.hget(keys.request_key(here),
                                                               keys.prompt_logprobs_field(1))) == chunk
    assert not await redis_client.exists(keys.request_key(gone))
    assert [fields[b"m"] for _, fields in await redis_client.xrange(keys.RESULTS_STREAM)] == [b"result"]
