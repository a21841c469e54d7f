"""Where a system's time goes, against the engine alone (experiment 2).

From the scheduler's per-iteration records (ITERATIONS_STREAM: when each plan left and when
its result was taken, and the worker's seconds in the engine), each worker's busy window splits into
  engine     the step itself,
  transport  plan in flight outside the engine: Redis round trips (XADD, XREAD wake-ups),
             msgpack + pydantic (de)serialization of plan and result, the worker's thread hop,
  scheduler  between a result and the next plan: taking the tokens, detokenizing, writing the
             token events, planning the next batch.
Microbenchmarks of the same operations, at the run's mean batch size, put numbers on the parts.
"""

import statistics
import time
from collections import defaultdict

import redis

from shared import keys
from shared.messages import BatchPlan, IterationRecord, NewRequest, SamplingParams, StepItem
from services.bench.by_request_id import PlanCodec
from services.worker.plan_reader import PlanReader
from shared.plans import read_result
from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.wire import WireError, decode, encode_token_event


def read_iterations(redis_url: str, started_at: float, finished_at: float) -> list[dict]:
    """Iterations whose plan left within [started_at, finished_at] (unix seconds), with their step time
    (the system must keep that many iteration records: ITERSERVE_ITERATION_RECORDS)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        records = client.xrange(keys.ITERATIONS_STREAM, min=f"{int(started_at * 1000)}-0", max="+")
    finally:
        client.close()
    rows = []
    for _, fields in records:
        try:
            record = decode(IterationRecord, fields[b"m"])
        except (WireError, KeyError):
            continue
        if not started_at <= record.started_at <= finished_at:
            continue
        rows.append({"worker_id": record.worker_id, "plan_id": record.plan_id, "started_at": record.started_at,
                     "finished_at": record.finished_at, "batch_size": len(record.request_ids),
                     "prefill_tokens": record.prefill_tokens, "decode_tokens": record.decode_tokens,
                     "step_s": record.step_seconds})
    return rows


def timeline(rows: list[dict]) -> dict:
    """Each worker's busy window split into engine, transport and scheduler time (summed over workers)."""
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["step_s"] is not None:
            by_worker[row["worker_id"]].append(row)
    totals = {"iterations": 0, "window_s": 0.0, "engine_s": 0.0, "transport_s": 0.0, "scheduler_s": 0.0,
              "batch_items": 0, "decode_tokens": 0, "prefill_tokens": 0, "workers": len(by_worker)}
    for worker_rows in by_worker.values():
        worker_rows.sort(key=lambda row: row["started_at"])
        totals["window_s"] += worker_rows[-1]["finished_at"] - worker_rows[0]["started_at"]
        for row, following in zip(worker_rows, worker_rows[1:] + [None]):
            in_flight = row["finished_at"] - row["started_at"]
            totals["iterations"] += 1
            totals["engine_s"] += row["step_s"]
            totals["transport_s"] += max(0.0, in_flight - row["step_s"])
            if following is not None:
                totals["scheduler_s"] += max(0.0, following["started_at"] - row["finished_at"])
            totals["batch_items"] += row["batch_size"]
            totals["decode_tokens"] += row["decode_tokens"]
            totals["prefill_tokens"] += row["prefill_tokens"]
    iterations = max(totals["iterations"], 1)
    totals["mean_batch_size"] = totals["batch_items"] / iterations
    for part in ("engine", "transport", "scheduler"):
        totals[f"{part}_ms_per_iteration"] = 1000 * totals[f"{part}_s"] / iterations
    return totals


def _median_seconds(action, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def microbenchmarks(tokenizer: Tokenizer, batch_size: int, redis_url: str | None, repeats: int = 200) -> dict:
    """Per-iteration costs of the pieces around the engine, at a decode batch of `batch_size`."""
    batch_size = max(1, batch_size)
    sampling = SamplingParams(max_tokens=128, ignore_eos=True)
    request_ids = [f"cmpl-{index:032x}" for index in range(batch_size)]
    first = BatchPlan(scheduler_epoch="e" * 32, plan_id=1, worker_id="worker-bench-1",
                      new_requests=tuple(NewRequest(request_id=request_id, sampling=sampling) for request_id in request_ids),
                      items=tuple(StepItem(request_id=request_id, token_ids=(1234,) * 8, start_position=0, sample=True,
                                           output_index=0) for request_id in request_ids))
    plan = BatchPlan(scheduler_epoch="e" * 32, plan_id=2, worker_id="worker-bench-1",  # every request decoding
                     items=tuple(StepItem(request_id=request_id, token_ids=(), feeds_sampled=True, start_position=300,
                                          sample=True, output_index=40) for request_id in request_ids))
    codec, reader = PlanCodec(), PlanReader()
    reader.decode(codec.encode(first), lambda request_id: 0, "worker-bench-1")
    plan_bytes = codec.encode(plan)
    decoded = reader.decode(plan_bytes, lambda request_id: 300, "worker-bench-1")
    tokens = {request_id: 1234 for request_id in request_ids}

    def result_bytes() -> bytes:
        return reader.encode_result(decoded, tokens, {}, [], 2048, 1000, 0.1)

    def result_round() -> None:
        codec.expect_answer(2, plan.items)  # as if just sent
        codec.decode_result(read_result(result_bytes())[1])

    wire_s = (_median_seconds(lambda: codec.encode(plan), repeats)
              + _median_seconds(lambda: reader.decode(plan_bytes, lambda request_id: 300, "worker-bench-1"), repeats)
              + _median_seconds(result_round, repeats))
    token_events_s = batch_size * _median_seconds(lambda: encode_token_event(40, 1234, " the"), repeats)
    corpus_ids = tokenizer.encode("The harbor town woke slowly on winter mornings. Gulls circled overhead, loud and patient.")
    detokenizer = IncrementalDetokenizer(tokenizer)
    position = iter(range(10**9))
    detokenize_s = batch_size * _median_seconds(lambda: detokenizer.push(corpus_ids[next(position) % len(corpus_ids)]),
                                                repeats * 10)
    measured = {"batch_size": batch_size, "plan_bytes": len(plan_bytes), "result_bytes": len(result_bytes()),
                "serialization_ms": 1000 * wire_s, "token_events_ms": 1000 * token_events_s,
                "detokenization_ms": 1000 * detokenize_s}
    if redis_url:
        client = redis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            client.ping()
            measured["redis_ping_ms"] = 1000 * _median_seconds(client.ping, repeats)
        except redis.exceptions.RedisError:
            pass
        finally:
            client.close()
    return measured
