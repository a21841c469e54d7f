"""Compact plans and results (shared/plans.py): a random sequence of plans round-trips exactly
through the scheduler's PlanCodec and the worker's PlanReader, results come back under the request
ids the plan they answer named, and a plan naming a handle the worker does not hold gets the typed
`unknown_request` error for that item only."""

import random

import msgpack

from shared.messages import BatchPlan, NewRequest, SamplingParams, StepItem
from services.bench.by_request_id import PlanCodec
from services.worker.plan_reader import PlanReader
from shared.plans import PLAN_FORMAT, read_result


def _random_plans(rng: random.Random, count: int):
    """Plans as a scheduler would send them to one worker: requests join with
    their data once, then prefill chunks and pipelined decodes, leave through free_request_ids; epochs
    change and free_all comes now and then."""
    held: dict[str, int] = {}  # request id -> KV length the worker will have
    epoch, next_id = "epoch-1", 0
    for plan_id in range(count):
        free_all, new_epoch = rng.random() < 0.03, rng.random() < 0.03
        if new_epoch:
            epoch = f"epoch-{plan_id}"
        if free_all or new_epoch:
            held.clear()
        freed = tuple(rng.sample(sorted(held), k=min(len(held), rng.randint(0, 3))))
        for request_id in freed:
            del held[request_id]
        new = []
        for _ in range(rng.randint(0, 4)):
            request_id = f"cmpl-{next_id:06d}"
            next_id += 1
            first_output_index = rng.randint(0, 300)
            writes = rng.random() < 0.5  # the worker writes its token entries (the fields travel only then)
            cached = rng.choice([0, 0, 1, 3])  # blocks from the prefix cache, and (penalties) their tokens
            new.append(NewRequest(request_id=request_id, cached_blocks=tuple(rng.randbytes(16) for _ in range(cached)),
                                  cached_token_ids=tuple(rng.randrange(2**31) for _ in range(cached * 16))
                                  if rng.random() < 0.5 else (), sampling=SamplingParams(
                temperature=rng.choice([0.0, 0.7]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**63),
                max_tokens=rng.randint(1, 500), stop=tuple(rng.sample(["\n", "END", "ü"], k=rng.randint(0, 2)))),
                entries_below=first_output_index + rng.randint(1, 500) if writes else 0,
                first_output_index=first_output_index if writes else 0,
                text_context=tuple(rng.randrange(2**31) for _ in range(rng.randint(0, 4))) if writes else ()))
            held[request_id] = 0
        items = []
        for request_id in sorted(held):
            if rng.random() < 0.2:
                continue  # not in this step
            length = held[request_id]
            if length and rng.random() < 0.7:  # a pipelined decode: feeds the token it sampled last
                items.append(StepItem(request_id=request_id, token_ids=(), feeds_sampled=True,
                                      start_position=length, sample=True, output_index=rng.randint(1, 10**6)))
                held[request_id] = length + 1
            else:
                tokens = tuple(rng.randrange(2**31) for _ in range(rng.randint(1, 40)))
                start = 0 if rng.random() < 0.1 else length  # a rebuild starts over
                items.append(StepItem(request_id=request_id, token_ids=tokens, start_position=start,
                                      sample=rng.random() < 0.5, output_index=rng.randint(0, 10**6)))
                held[request_id] = start + len(tokens)
        yield BatchPlan(scheduler_epoch=epoch, plan_id=plan_id, worker_id="w1", new_requests=tuple(new),
                        items=tuple(items), free_request_ids=freed, free_all=free_all)


def test_a_random_plan_sequence_round_trips_exactly_and_results_name_what_the_plan_named():
    rng = random.Random(7)
    codec, reader = PlanCodec(), PlanReader()
    kv_length: dict[str, int] = {}
    plans = 0
    for plan in _random_plans(rng, 400):
        if plan.free_all or plan.scheduler_epoch != reader.epoch:
            kv_length.clear()
        data = codec.encode(plan)
        decoded = reader.decode(data, lambda request_id: kv_length[request_id], "w1")
        assert decoded.unknown == []
        assert decoded.plan.new_requests == plan.new_requests
        assert decoded.plan.free_request_ids == plan.free_request_ids
        # Decodes travel first (handle + output index only); the rest keep their order.
        assert sorted(decoded.plan.items, key=lambda item: item.request_id) == \
            sorted(plan.items, key=lambda item: item.request_id)
        assert (decoded.plan.scheduler_epoch, decoded.plan.plan_id, decoded.plan.free_all) == \
            (plan.scheduler_epoch, plan.plan_id, plan.free_all)
        for item in plan.items:
            kv_length[item.request_id] = item.start_position + max(1, len(item.token_ids))
        for request_id in plan.free_request_ids:
            kv_length.pop(request_id, None)

        sampled = {item.request_id: rng.randrange(2**31) for item in plan.items if item.sample}
        logprobs = {request_id: (-0.5, ((token, -0.5), (1, -2.0))) for request_id, token in sampled.items()
                    if rng.random() < 0.3}
        errors = [(item.request_id, "kv_cache_full", "no room") for item in plan.items
                  if not item.sample and rng.random() < 0.1]
        writes_entries = rng.random() < 0.7
        unwritten = {request_id for request_id in sampled if rng.random() < 0.2} if writes_entries else None
        digest = rng.randrange(2**64)
        payload = reader.encode_result(decoded, sampled, logprobs, errors, 100, 42, 0.004, unwritten=unwritten,
                                       cache_digest=digest)
        worker_id, raw = read_result(payload)
        result = codec.decode_result(raw)
        assert result.cache_digest == digest
        assert (result.entries_written, result.unwritten) == (writes_entries, frozenset(unwritten or ()))
        assert worker_id == "w1" and (result.plan_id, result.kv_blocks_free, result.step_seconds) == \
            (plan.plan_id, 42, 0.004)
        assert {token.request_id: token.token_id for token in result.tokens} == sampled
        output_index = {item.request_id: item.output_index for item in plan.items}
        assert all(token.output_index == output_index[token.request_id] for token in result.tokens)
        assert {token.request_id: (token.logprob, token.top_logprobs) for token in result.tokens
                if token.logprob is not None} == logprobs
        assert sorted((error.request_id, error.code) for error in result.errors) == \
            sorted((request_id, code) for request_id, code, _ in errors)
        plans += 1
    assert plans == 400


def test_an_answer_read_after_its_handles_were_reused_names_the_requests_its_plan_named():
    codec, reader = PlanCodec(), PlanReader()
    sampling = SamplingParams()
    first = BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w1",
                      new_requests=(NewRequest(request_id="cmpl-a", sampling=sampling),),
                      items=(StepItem(request_id="cmpl-a", token_ids=(5, 6), start_position=0, sample=True,
                                      output_index=0),))
    decoded_first = reader.decode(codec.encode(first), lambda request_id: 0, "w1")
    # Before the answer comes, the next plan frees cmpl-a and gives its handle to cmpl-b.
    second = BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w1", free_request_ids=("cmpl-a",),
                       new_requests=(NewRequest(request_id="cmpl-b", sampling=sampling),),
                       items=(StepItem(request_id="cmpl-b", token_ids=(7,), start_position=0, sample=True,
                                       output_index=0),))
    decoded_second = reader.decode(codec.encode(second), lambda request_id: 0, "w1")
    assert decoded_first.item_handles == decoded_second.item_handles  # the handle was reused
    answer_first = codec.decode_result(read_result(reader.encode_result(decoded_first, {"cmpl-a": 11}, {}, [],
                                                                        9, 9, 0.0))[1])
    answer_second = codec.decode_result(read_result(reader.encode_result(decoded_second, {"cmpl-b": 12}, {}, [],
                                                                         9, 9, 0.0))[1])
    assert [(t.request_id, t.token_id) for t in answer_first.tokens] == [("cmpl-a", 11)]
    assert [(t.request_id, t.token_id) for t in answer_second.tokens] == [("cmpl-b", 12)]
    # An answer to a plan of an older epoch names nothing.
    codec.encode(BatchPlan(scheduler_epoch="f", plan_id=3, worker_id="w1"))
    stale = codec.decode_result(read_result(reader.encode_result(decoded_second, {"cmpl-b": 12}, {}, [],
                                                                 9, 9, 0.0))[1])
    assert stale.tokens == () and stale.errors == ()


def test_a_delta_for_a_request_the_worker_does_not_hold_is_a_typed_error_for_that_item_only():
    codec = PlanCodec()
    sampling = SamplingParams(seed=3)
    joined = BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w1",
                       new_requests=(NewRequest(request_id="cmpl-a", sampling=sampling),
                                     NewRequest(request_id="cmpl-b", sampling=sampling)),
                       items=(StepItem(request_id="cmpl-a", token_ids=(1, 2), start_position=0, sample=True,
                                       output_index=0),
                              StepItem(request_id="cmpl-b", token_ids=(3,), start_position=0, sample=True,
                                       output_index=0)))
    codec.encode(joined)  # the worker never reads it (say, it restarted its state)
    fresh = PlanReader()
    fresh.epoch = "e"
    delta = BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w1",
                      new_requests=(NewRequest(request_id="cmpl-c", sampling=sampling),),
                      items=(StepItem(request_id="cmpl-a", token_ids=(), feeds_sampled=True, start_position=2,
                                      sample=True, output_index=1),
                             StepItem(request_id="cmpl-b", token_ids=(9,), start_position=1, sample=True,
                                      output_index=1),
                             StepItem(request_id="cmpl-c", token_ids=(4, 5), start_position=0, sample=True,
                                      output_index=0)))
    decoded = fresh.decode(codec.encode(delta), lambda request_id: 0, "w1")
    assert [item.request_id for item in decoded.plan.items] == ["cmpl-c"]
    assert len(decoded.unknown) == 2
    result = codec.decode_result(read_result(fresh.encode_result(decoded, {"cmpl-c": 8}, {}, [], 9, 9, 0.0))[1])
    assert [(t.request_id, t.token_id) for t in result.tokens] == [("cmpl-c", 8)]
    assert sorted((error.request_id, error.code) for error in result.errors) == \
        [("cmpl-a", "unknown_request"), ("cmpl-b", "unknown_request")]


def test_plans_of_64_decoding_requests_and_their_results_fit_in_one_and_a_half_kilobytes():
    codec, reader = PlanCodec(), PlanReader()
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=256)
    ids = [f"cmpl-{index:032x}" for index in range(64)]
    joined = BatchPlan(scheduler_epoch="e", plan_id=0, worker_id="w1",
                       new_requests=tuple(NewRequest(request_id=i, sampling=sampling) for i in ids))
    reader.decode(codec.encode(joined), lambda request_id: 0, "w1")
    plan = BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w1", items=tuple(
        StepItem(request_id=i, token_ids=(), feeds_sampled=True, start_position=100, sample=True,
                 output_index=50) for i in ids))
    plan_bytes = codec.encode(plan)
    decoded = reader.decode(plan_bytes, lambda request_id: 100, "w1")
    result_bytes = reader.encode_result(decoded, {i: 100_000 + n for n, i in enumerate(ids)}, {}, [], 10_000, 5000,
                                        0.006)
    assert len(decoded.plan.items) == 64
    assert len(plan_bytes) + len(result_bytes) <= 1536, (len(plan_bytes), len(result_bytes))
    assert msgpack.unpackb(plan_bytes)["f"] == PLAN_FORMAT


def test_a_plan_read_twice_is_run_once_and_changes_nothing_the_second_time():
    """A pipeline the scheduler's Redis client resent after a failed connection writes its plans
    twice (P1, P2, P1, P2): the copies change no handle (P2 gave P1's freed handle to another
    request) and are not run."""
    codec, reader = PlanCodec(), PlanReader()
    sampling = SamplingParams()
    first = codec.encode(BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w1",
                                   new_requests=(NewRequest(request_id="cmpl-a", sampling=sampling),),
                                   items=(StepItem(request_id="cmpl-a", token_ids=(5,), start_position=0,
                                                   sample=True, output_index=0),)))
    second = codec.encode(BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w1", free_request_ids=("cmpl-a",),
                                    new_requests=(NewRequest(request_id="cmpl-b", sampling=sampling),),
                                    items=(StepItem(request_id="cmpl-b", token_ids=(7,), start_position=0,
                                                    sample=True, output_index=0),)))
    assert reader.decode(first, lambda request_id: 0, "w1") is not None
    decoded = reader.decode(second, lambda request_id: 0, "w1")
    assert reader.decode(first, lambda request_id: 0, "w1") is None
    assert reader.decode(second, lambda request_id: 0, "w1") is None
    third = codec.encode(BatchPlan(scheduler_epoch="e", plan_id=3, worker_id="w1",
                                   items=(StepItem(request_id="cmpl-b", token_ids=(), feeds_sampled=True,
                                                   start_position=1, sample=True, output_index=1),)))
    again = reader.decode(third, lambda request_id: 1, "w1")
    assert [item.request_id for item in again.plan.items] == ["cmpl-b"] and not again.unknown
    assert again.item_handles == decoded.item_handles
    # A new scheduler's plans start again from its own ids.
    fresh = codec.encode(BatchPlan(scheduler_epoch="f", plan_id=1, worker_id="w1"))
    assert reader.decode(fresh, lambda request_id: 0, "w1") is not None


def test_a_plan_of_several_steps_round_trips_and_its_steps_follow_as_fed_decodes():
    """Settings.scheduler_steps on the wire: the steps and each item's (where some run fewer) come
    back as sent; the reader's next_step gives each later step's items (fed decodes, output index and
    plan id one more, the KV length the worker has then) until every item has run its steps; a plan
    id within a plan's steps is one run already; a plan of steps with an item that samples nothing
    is refused."""
    import pytest

    from shared.plans import ColumnPlan, encode_plan
    from shared.wire import WireError

    codec, reader = PlanCodec(), PlanReader()
    sampling = SamplingParams(seed=1)
    joined = BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w1",
                       new_requests=tuple(NewRequest(request_id=f"cmpl-{name}", sampling=sampling) for name in "abc"))
    reader.decode(codec.encode(joined), lambda request_id: 0, "w1")
    plan = BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w1", items=(
        StepItem("cmpl-a", (), 10, True, 4, True), StepItem("cmpl-b", (7,), 20, True, 9),
        StepItem("cmpl-c", (), 30, True, 2, True)))
    kv = {"cmpl-a": 10, "cmpl-b": 20, "cmpl-c": 30}
    decoded = reader.decode(codec.encode(plan, steps=3, item_steps=[3, 1, 2]), kv.__getitem__, "w1")
    assert (decoded.steps, decoded.answer_with_next) == (3, False)
    assert decoded.plan.items == tuple(plan.items[index] for index in (0, 2, 1))  # wire order: fed decodes first
    assert decoded.item_steps == [3, 2, 1]
    seen = []
    while decoded is not None:
        seen.append((decoded.plan.plan_id, [(item.request_id, item.start_position, item.output_index,
                                             item.feeds_sampled) for item in decoded.plan.items],
                     decoded.answer_with_next))
        for item in decoded.plan.items:  # the step ran: one token more in each one's KV
            kv[item.request_id] += len(item.token_ids) or 1
        decoded = reader.next_step(decoded, kv.__getitem__)
    assert seen[1:] == [(3, [("cmpl-a", 11, 5, True), ("cmpl-c", 31, 3, True)], False),
                        (4, [("cmpl-a", 12, 6, True)], False)]
    # Plan ids 3 and 4 were the plan's steps: a plan sent with one of them is a copy
    assert reader.decode(codec.encode(BatchPlan(scheduler_epoch="e", plan_id=4, worker_id="w1")),
                         kv.__getitem__, "w1") is None
    refused = ColumnPlan(scheduler_epoch="e", plan_id=9, worker_id="w1", handles=[0], starts=[0], counts=[2],
                         samples=[False], outputs=[0], tokens=[1, 2], item_ids=("cmpl-a",), steps=2)
    with pytest.raises(WireError, match="samples no token"):
        reader.decode(encode_plan(refused), kv.__getitem__, "w1")


def test_the_answer_to_a_plan_of_steps_reads_as_each_step_answered_alone():
    """StepAnswers packs a plan's steps as one result (each item's tokens one after another); read
    back step by step (split_steps, PlanCodec.decode_results) it gives exactly what each step's
    answer alone would: tokens, output indexes, log-probabilities, errors (an item in error at its
    second step keeps its first token), unwritten entries, step times, under plan ids one more
    each step."""
    from services.worker.plan_reader import StepAnswers
    from shared.plans import read_result_columns, split_steps

    def answered_plan():
        codec, reader = PlanCodec(), PlanReader()
        sampling = SamplingParams(seed=1)
        joined = BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w1", new_requests=tuple(
            NewRequest(request_id=f"cmpl-{name}", sampling=sampling) for name in "abcd"))
        reader.decode(codec.encode(joined), lambda request_id: 0, "w1")
        codec.decode_results(read_result(reader.encode_result(reader.decode(codec.encode(BatchPlan(
            scheduler_epoch="e", plan_id=2, worker_id="w1")), lambda request_id: 0, "w1"), {}, {}, [], 9, 9, 0.0))[1])
        plan = BatchPlan(scheduler_epoch="e", plan_id=3, worker_id="w1", items=tuple(
            StepItem(f"cmpl-{name}", (), 10, True, 4, True) for name in "abcd"))
        kv = dict.fromkeys([f"cmpl-{name}" for name in "abcd"], 10)
        return codec, reader, reader.decode(codec.encode(plan, steps=3, item_steps=[3, 3, 2, 3]), kv.__getitem__,
                                            "w1"), kv

    # Each step's outcome: tokens, logprobs, errors, unwritten (b has an error at its second step;
    # d none at its first: an error)
    outcomes = [
        ({"cmpl-a": 100, "cmpl-b": 200, "cmpl-c": 300}, {"cmpl-a": (-0.5, ((100, -0.5), (7, -2.0)))}, [
            ("cmpl-d", "kv_cache_full", "no room")], {"cmpl-c"}),
        ({"cmpl-a": 101, "cmpl-c": 301}, {"cmpl-c": (-1.5, ())}, [("cmpl-b", "bad_item", "broken")], set()),
        ({"cmpl-a": 102, "cmpl-b": 202}, {}, [("cmpl-b", "bad_item", "again")], {"cmpl-a"}),
    ]
    codec, reader, decoded, kv = answered_plan()
    answers, alone, seconds = StepAnswers(reader), [], [0.25, 0.5, 0.125]
    codec_alone, reader_alone, decoded_alone, _ = answered_plan()
    for (tokens, logprobs, errors, unwritten), step_seconds in zip(outcomes, seconds):
        answers.add(decoded, tokens, logprobs, errors, step_seconds, unwritten)
        for item in decoded.plan.items:
            kv[item.request_id] += 1
        alone.append((decoded_alone, tokens, logprobs, errors, step_seconds, unwritten))
        decoded = reader.next_step(decoded, kv.__getitem__)
        decoded_alone = reader_alone.next_step(decoded_alone, kv.__getitem__)
    assert decoded is None
    payload = answers.packed(100, 42, 7)
    columns = read_result_columns(read_result(payload)[1])
    assert (columns.steps, columns.counts, columns.steps_seconds, columns.step_seconds) == (3, [3, 1, 2], seconds, 0.875)
    assert columns.token_ids == [100, 101, 102, 200, 300, 301]
    assert [step.plan_id for step in split_steps(columns)] == [3, 4, 5]
    results = codec.decode_results(read_result(payload)[1])
    # Each step answered alone (the b token of step 3 comes after its error: no step reads it)
    expected = []
    for step, (step_decoded, tokens, logprobs, errors, step_seconds, unwritten) in enumerate(alone):
        if step == 2:
            tokens = {"cmpl-a": 102}
            errors = []
        expected += codec_alone.decode_results(read_result(reader_alone.encode_result(
            step_decoded, tokens, logprobs, errors, 100, 42, step_seconds, 7, unwritten))[1])
    assert results == expected
    assert [token.request_id for token in results[0].tokens] == ["cmpl-a", "cmpl-b", "cmpl-c"]
    assert [(error.request_id, error.code) for result in results for error in result.errors] == [
        ("cmpl-d", "kv_cache_full"), ("cmpl-b", "bad_item")]
    assert (results[0].unwritten, results[2].unwritten) == ({"cmpl-c"}, {"cmpl-a"})
    assert results[0].tokens[0].top_logprobs == ((100, -0.5), (7, -2.0)) and results[1].tokens[1].logprob == -1.5


def test_proposed_tokens_travel_with_their_items_and_the_answer_carries_every_token_kept():
    """Speculative decoding on the wire: a plan's `d` column names each item's proposals (the worker
    reads them as StepItem.draft_tokens); a bad one is refused whole; the answer to one step gives a
    speculating item all its kept tokens, with the entries it left unwritten by position."""
    from shared.plans import ColumnPlan, encode_plan, pack_result, read_plan, read_result_columns
    from shared.wire import WireError
    import pytest

    sampling = SamplingParams(max_tokens=50)
    plan = ColumnPlan(scheduler_epoch="e", plan_id=7, worker_id="w",
                      new_requests=(NewRequest(request_id="cmpl-a", sampling=sampling),
                                    NewRequest(request_id="cmpl-b", sampling=sampling)),
                      new_handles=(0, 1), handles=[0, 1], starts=[20, 31], counts=[4, 1], samples=[True, True],
                      outputs=[3, 9], tokens=[11, 12, 13, 14, 21], item_ids=("cmpl-a", "cmpl-b"), drafts=[3, 0])
    reader = PlanReader()
    decoded = reader.decode(encode_plan(plan), lambda request_id: 0, "w")
    assert [(item.token_ids, item.draft_tokens) for item in decoded.plan.items] == [((11, 12, 13, 14), 3), ((21,), 0)]
    assert decoded.plan.items == plan.items
    for drafts in ([4, 0], [3], [1, 1]):  # as many as the item's tokens; one count short; on an item of one token
        raw = msgpack.unpackb(encode_plan(plan))
        raw["d"] = bytes(drafts)
        with pytest.raises(WireError, match="proposed tokens"):
            read_plan(msgpack.packb(raw), "w")
    # The answer: item a kept 2 of its 3 proposals (3 tokens), b its one token; a's last entry unwritten
    answer = pack_result("e", 7, "w", [0, 1], [3, 9], [[5, 6, 7], [8]], [], [0.01], [], [(0, 2)], 10, 5)
    _, raw = read_result(answer)
    result = read_result_columns(raw)
    assert (result.counts, result.token_ids, result.output_indexes, result.unwritten_tokens, result.steps) == (
        [3, 1], [5, 6, 7, 8], [3, 9], [2], 1)
    # Answers of one token each say no counts, as before
    _, raw = read_result(pack_result("e", 7, "w", [0, 1], [3, 9], [[5], [8]], [], [0.01], [], [(1, 0)], 10, 5))
    result = read_result_columns(raw)
    assert (result.counts, result.unwritten) == ([], [1])
