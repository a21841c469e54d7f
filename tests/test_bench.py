"""The load generator: arrivals, workloads, metrics, the streaming client, and one real run."""

import asyncio
import json
import math
import statistics
import subprocess
import sys

import numpy as np
import pytest
from aiohttp import web

from services.bench.arrivals import arrival_offsets
from services.bench.cli import duration_seconds, rate
from services.bench.client import RequestResult
from services.bench.experiments import headline_ratio, throughput_at_latency, throughput_ratios
from services.bench.metrics import distribution, meets, percentile, summarize
from services.bench.runner import BenchConfig, cancel_plan, run_benchmark
from services.bench.workloads import (
    BenchRequest,
    PromptSource,
    WorkloadConfig,
    build_conversations,
    build_requests,
    draw_lengths,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer():
    from shared.tokenizer import Tokenizer

    return Tokenizer.load()


# Arrivals


def test_same_seed_gives_the_same_arrivals_and_another_seed_does_not():
    assert arrival_offsets(50, 2.0, seed=7) == arrival_offsets(50, 2.0, seed=7)
    assert arrival_offsets(50, 2.0, seed=7) != arrival_offsets(50, 2.0, seed=8)


def test_poisson_arrivals_have_the_asked_mean_rate_and_exponential_gaps():
    offsets = arrival_offsets(20001, 4.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and all(gap >= 0 for gap in gaps)
    assert 20000 / offsets[-1] == pytest.approx(4.0, rel=0.03), "mean rate differs from the asked 4 req/s"
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05), "Poisson gaps have a CV of 1"


def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread():
    bursty = np.diff(arrival_offsets(20001, 4.0, burstiness=0.25, seed=2))
    even = np.diff(arrival_offsets(20001, 4.0, burstiness=4.0, seed=2))
    for gaps in (bursty, even):
        assert 1 / np.mean(gaps) == pytest.approx(4.0, rel=0.05)
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.1), "CV of gamma(k) gaps is 1/sqrt(k)"
    assert np.std(even) / np.mean(even) == pytest.approx(0.5, rel=0.1)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 1.0) == []
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(5, 1.0, burstiness=0)


# Workloads


def test_orca_lengths_are_uniform_over_the_paper_ranges_and_repeatable():
    inputs, outputs = draw_lengths(WorkloadConfig("orca"), 20000, seed=3)
    assert (min(inputs), max(inputs)) == (32, 512) and (min(outputs), max(outputs)) == (1, 128)
    assert statistics.mean(inputs) == pytest.approx(272, rel=0.02)
    assert statistics.mean(outputs) == pytest.approx(64.5, rel=0.02)
    assert draw_lengths(WorkloadConfig("orca"), 100, seed=3) == draw_lengths(WorkloadConfig("orca"), 100, seed=3)


def test_orca_ranges_can_be_scaled_down():
    inputs, outputs = draw_lengths(WorkloadConfig("orca", input_range=(32, 128), output_range=(1, 32)), 5000, seed=0)
    assert (min(inputs), max(inputs), min(outputs), max(outputs)) == (32, 128, 1, 32)


def test_chat_lengths_are_long_tailed_and_clipped():
    config = WorkloadConfig("chat")
    inputs, outputs = draw_lengths(config, 20000, seed=4)
    for values, (low, high), median in ((inputs, config.inputs, 128), (outputs, config.outputs, 64)):
        assert low <= min(values) and max(values) <= high
        assert statistics.median(values) == pytest.approx(median, rel=0.05)
        assert statistics.mean(values) > 1.3 * statistics.median(values), "a long tail lifts the mean"
        assert percentile(values, 99) > 5 * statistics.median(values)


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError):
        WorkloadConfig("nope")
    with pytest.raises(ValueError):
        WorkloadConfig("orca", input_range=(10, 5))


def test_completion_prompts_are_real_text_of_exactly_the_drawn_length(tokenizer):
    source = PromptSource(tokenizer)
    requests = build_requests(WorkloadConfig("orca"), 20, seed=5, source=source)
    inputs, outputs = draw_lengths(WorkloadConfig("orca"), 20, seed=5)
    assert [len(request.prompt) for request in requests] == inputs
    assert [request.max_tokens for request in requests] == outputs
    assert len({request.prompt for request in requests}) == 20, "prompts start at different places"
    assert " the " in tokenizer.decode(requests[0].prompt)
    body = requests[0].body("m", 0.0)
    assert body["ignore_eos"] is True and body["max_tokens"] == outputs[0] and body["stream"] is True
    assert [r.prompt for r in build_requests(WorkloadConfig("orca"), 20, seed=5, source=source)] == \
           [r.prompt for r in requests]


def test_chat_prompts_are_text_that_encodes_back_to_the_wanted_length(tokenizer):
    source = PromptSource(tokenizer)
    requests = build_requests(WorkloadConfig("chat"), 30, seed=6, source=source)
    exact = 0
    for request in requests:
        content = request.messages[0]["content"]
        wanted = request.prompt_tokens - source.chat_overhead
        exact += len(tokenizer.encode(content)) == wanted
        templated = len(tokenizer.encode_chat(list(request.messages)))
        assert abs(templated - request.prompt_tokens) <= 3, (templated, request.prompt_tokens)
    assert exact >= 27, f"only {exact}/30 chat prompts round-trip to their length"


def test_system_prompt_requests_share_one_system_message_and_differ_after_it(tokenizer):
    source = PromptSource(tokenizer)
    config = WorkloadConfig(name="system-prompt", system_prompt_tokens=64, input_range=(8, 16))
    requests = build_requests(config, 5, seed=2, source=source)
    systems = {request.messages[0]["content"] for request in requests}
    assert len(systems) == 1 and len(tokenizer.encode(systems.pop())) == 64
    assert len({request.messages[1]["content"] for request in requests}) == 5
    assert all(8 <= len(tokenizer.encode(request.messages[1]["content"])) <= 16 for request in requests)


def test_multiturn_conversations_are_repeatable_and_each_turn_carries_the_history(tokenizer):
    source = PromptSource(tokenizer)
    config = WorkloadConfig(name="multiturn", turns=3, think_time=0.5, input_range=(8, 16), output_range=(4, 8))
    conversations = build_conversations(config, 4, seed=5, source=source)
    assert conversations == build_conversations(config, 4, seed=5, source=source)
    first = conversations[0]
    assert len(first.user_messages) == 3 and len(first.think_seconds) == 2
    assert all(4 <= tokens <= 8 for tokens in first.max_tokens)
    history = ({"role": "user", "content": first.user_messages[0]}, {"role": "assistant", "content": "An answer."})
    request = first.request(1, history, source.chat_overhead, 3)
    assert request.messages == history + ({"role": "user", "content": first.user_messages[1]},)
    assert (request.conversation, request.turn, request.index) == (0, 1, 1)
    with pytest.raises(ValueError):
        build_requests(config, 4, seed=5, source=source)


def test_cancel_plan_picks_the_fraction_half_way_and_repeatably():
    requests = [BenchRequest(index, "completions", 32, max_tokens, 0, prompt=(1,))
                for index, max_tokens in enumerate([1, 10, 20, 30, 40, 50, 60, 70, 80, 90])]
    plan = cancel_plan(requests, 0.3, seed=1)
    assert len(plan) == 3 and 0 not in plan, "a one-token request cannot be cancelled half-way"
    assert all(after == requests[index].max_tokens // 2 for index, after in plan.items())
    assert plan == cancel_plan(requests, 0.3, seed=1)
    assert cancel_plan(requests, 0.0, seed=1) == {}


# Metrics


def test_percentile_matches_numpy():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))
    assert distribution([1.0, 3.0], scale=1000)["mean"] == 2000.0


def finished(index, sent, first, chunk_times, end, tokens, reason="length", **extra) -> RequestResult:
    return RequestResult(index, prompt_tokens=100, max_tokens=tokens, sent_at=sent, first_token_at=first,
                         chunk_times=chunk_times, finished_at=end, output_tokens=tokens, finish_reason=reason, **extra)


def test_summary_of_synthetic_requests():
    results = [
        finished(0, 0.0, 0.5, [0.5, 0.6, 0.7, 0.8, 0.9], 0.9, 5),  # TTFT 0.5, TPOT 0.1, e2e 0.9
        finished(1, 1.0, 1.2, [1.2, 1.5, 1.8], 1.8, 3),  # TTFT 0.2, TPOT 0.3, e2e 0.8
        finished(2, 2.0, 2.1, [2.1, 2.2], 2.2, 4, cancelled=True),  # cancelled: no latency, no throughput
        finished(3, 2.0, None, [], 4.0, 0, reason=None, error="HTTP 503"),
    ]
    summary = summarize(results, ttft_slo=0.3, tpot_slo=0.2)
    assert (summary["completed"], summary["cancelled"], summary["failed"]) == (2, 1, 1)
    assert summary["errors"] == ["HTTP 503"]
    assert summary["duration_s"] == pytest.approx(4.0)
    assert summary["request_throughput"] == pytest.approx(2 / 4.0)
    assert summary["output_token_throughput"] == pytest.approx(8 / 4.0)
    assert summary["delivered_token_throughput"] == pytest.approx(12 / 4.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(350)
    assert summary["tpot_ms"]["p50"] == pytest.approx(200)
    assert summary["e2e_s"]["mean"] == pytest.approx(0.85)
    assert summary["itl_ms"]["max"] == pytest.approx(300)
    assert summary["itl_ms"]["mean"] == pytest.approx((4 * 100 + 2 * 300) / 6)
    # Orca's normalized latency: e2e / output tokens = 0.9/5 and 0.8/3 s per token
    assert summary["normalized_latency_ms_per_token"]["mean"] == pytest.approx((180 + 266.667) / 2, rel=1e-4)
    # Goodput: request 0 misses TTFT (0.5 > 0.3), request 1 misses TPOT (0.3 > 0.2): none good
    assert summary["goodput"] == 0.0
    assert summarize(results, ttft_slo=0.6)["goodput"] == pytest.approx(2 / 4.0)
    assert summarize(results)["goodput"] is None


def test_one_token_requests_have_no_tpot_and_meet_a_tpot_target():
    single = finished(0, 0.0, 0.4, [0.4], 0.4, 1)
    assert single.tpot is None and single.itls == []
    assert meets(single, ttft_slo=None, tpot_slo=0.001)
    assert not meets(single, ttft_slo=0.1, tpot_slo=None)


def test_throughput_at_equal_latency_interpolates_each_policy_frontier():
    iteration = [{"normalized_latency_p50_ms": latency, "request_throughput": throughput}
                 for latency, throughput in ((50, 1.0), (60, 2.0), (100, 3.0))]
    request = [{"rate": offered, "normalized_latency_p50_ms": latency, "request_throughput": throughput}
               for offered, latency, throughput in ((0.5, 200, 0.5), (2.0, 400, 1.0))]
    assert throughput_at_latency(iteration, 80) == (pytest.approx(2.5), False)
    assert throughput_at_latency(iteration, 40) == (None, False)
    assert throughput_at_latency(iteration, 300) == (3.0, True), "beyond the last point: a lower bound"
    rows = throughput_ratios(iteration, request)
    assert [row["ratio"] for row in rows] == [pytest.approx(6.0), pytest.approx(3.0)]
    assert all(row["lower_bound"] for row in rows)
    assert headline_ratio(rows)["rate"] == 2.0, "the headline is at the request policy's most loaded point"


def test_cli_units():
    assert duration_seconds("500") == 0.5 and duration_seconds("500ms") == 0.5 and duration_seconds("2s") == 2.0
    assert rate("inf") == math.inf and rate("2.5") == 2.5


# The client and runner against a fake gateway that streams like the real one


CANCELLED = web.AppKey("cancelled", list)


def fake_gateway(tokens_per_request: int = 6, gap: float = 0.01) -> web.Application:
    cancelled: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        request_id = f"cmpl-{len(body['prompt'])}-{body['seed']}"
        count = min(tokens_per_request, body["max_tokens"])
        try:
            for index in range(count):
                await asyncio.sleep(gap)
                finish = "length" if index == count - 1 else None
                chunk = {"id": request_id, "choices": [{"index": 0, "text": f" t{index}", "finish_reason": finish}],
                         "usage": None}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await response.write(b": keep-alive\n\n")
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": count, "total_tokens": 0}
            await response.write(b"data: " + json.dumps({"id": request_id, "choices": [], "usage": usage}).encode()
                                 + b"\n\n" + b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            cancelled.append(request_id)
            raise
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app[CANCELLED] = cancelled
    return app


async def test_runner_streams_times_and_cancels_against_a_fake_gateway():
    from aiohttp.test_utils import TestServer

    app = fake_gateway()
    async with TestServer(app, host="127.0.0.1") as server:
        requests = [BenchRequest(index, "completions", 8 + index, 6, index, prompt=tuple(range(1, 9 + index)))
                    for index in range(6)]
        config = BenchConfig(url=str(server.make_url("")), num_requests=6, rate=50.0, seed=1, cancel_fraction=0.34,
                             warmup=0, progress=False, ttft_slo=1.0)
        report = await run_benchmark(config, requests)
        await asyncio.sleep(0.1)
    summary = report["summary"]
    assert (summary["completed"], summary["cancelled"], summary["failed"]) == (4, 2, 0), summary["errors"]
    records = report["requests"]
    for record in records:
        if record["cancelled"]:
            assert record["output_tokens"] == 3 and len(record["chunk_times"]) == 3, "cancelled half-way"
        else:
            assert record["output_tokens"] == 6 and record["finish_reason"] == "length"
            assert record["prompt_tokens"] == 8 + record["index"], "prompt tokens come from usage"
            assert record["first_token_at"] > record["sent_at"] and record["finished_at"] >= record["chunk_times"][-1]
    assert len(app[CANCELLED]) == 2, "closing the stream is seen by the server"
    assert summary["ttft_ms"]["p50"] > 5 and summary["itl_ms"]["p50"] >= 5
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert report["config"]["rate"] == 50.0 and "6 requests" in report["description"]


# The real thing


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_command_against_the_whole_system(tmp_path):
    from tests.system import System

    output = tmp_path / "run.json"
    with System(workers=1, kv_blocks=128) as system:
        command = [sys.executable, "-m", "services.cli", "bench", "--url", system.base_url, "--workload", "orca",
                   "--rate", "4", "--num-requests", "6", "--seed", "3", "--input-range", "32", "64",
                   "--output-range", "2", "8", "--ttft-slo", "30s", "--tpot-slo", "5s", "--cancel-fraction", "0.2",
                   "--output", str(output), "--no-progress"]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(output.read_text())
    summary = report["summary"]
    assert summary["requests"] == 6 and summary["failed"] == 0, summary["errors"]
    assert summary["cancelled"] == 1 and summary["completed"] == 5
    assert summary["request_throughput"] > 0 and summary["output_token_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_s", "normalized_latency_ms_per_token"):
        assert set(summary[key]) >= {"mean", "p50", "p99"} and summary[key]["p50"] > 0, key
    assert summary["goodput"] is not None and 0 <= summary["slo_attainment"] <= 1
    for record in report["requests"]:
        if not record["cancelled"]:
            assert record["output_tokens"] == record["max_tokens"], "ignore_eos forces the output length"
            assert 32 <= record["prompt_tokens"] <= 64
    assert report["server"]["policy"] == "iteration" and report["server"]["workers"] == 1
    assert "| normalized latency (ms/token) |" in completed.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_multiturn_bench_against_the_whole_system_finds_each_history_cached(tmp_path):
    """Two conversations of three turns: every later turn sends the answers back and finds the
    turns before it in the prefix cache (usage.prompt_tokens_details.cached_tokens)."""
    from tests.system import System

    output = tmp_path / "multiturn.json"
    with System(workers=1, kv_blocks=256) as system:
        command = [sys.executable, "-m", "services.cli", "bench", "--url", system.base_url, "--workload", "multiturn",
                   "--num-requests", "2", "--turns", "3", "--think-time", "0.1", "--concurrency", "2",
                   "--input-range", "24", "40", "--output-range", "8", "16", "--output", str(output), "--no-progress"]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(output.read_text())
    summary = report["summary"]
    assert (summary["requests"], summary["completed"]) == (6, 6), summary["errors"]
    records = sorted(report["requests"], key=lambda record: (record["conversation"], record["turn"]))
    for conversation in (0, 1):
        turns = [record for record in records if record["conversation"] == conversation]
        # (a first turn may find the chat template's default system message cached: others sent it)
        assert [record["turn"] for record in turns] == [0, 1, 2] and turns[0]["cached_tokens"] < turns[1]["cached_tokens"]
        for earlier, later in zip(turns, turns[1:]):
            # The history grows by the answer and a new message; what was computed before is cached.
            assert later["prompt_tokens"] > earlier["prompt_tokens"] + earlier["output_tokens"]
            assert later["cached_tokens"] >= (earlier["prompt_tokens"] // 16 - 1) * 16 > 0
    assert summary["prefix_cache"]["hit_rate"] > 0.3 and summary["ttft_ms_later_turns"]["p50"] > 0
    assert "prefix cache hit rate" in completed.stdout and "turns 2+" in completed.stdout


# Experiment 2's timeline, and the experiments' report, on synthetic data


def test_timeline_splits_a_worker_window_into_engine_transport_and_scheduler():
    from services.bench.overhead import timeline

    rows = [  # plan left at started_at, result taken at finished_at, step_s in the engine
        {"worker_id": "w", "plan_id": 1, "started_at": 10.0, "finished_at": 10.5, "step_s": 0.4, "batch_size": 2,
         "prefill_tokens": 100, "decode_tokens": 0},
        {"worker_id": "w", "plan_id": 2, "started_at": 10.6, "finished_at": 11.0, "step_s": 0.3, "batch_size": 2,
         "prefill_tokens": 0, "decode_tokens": 2},
        {"worker_id": "w", "plan_id": 3, "started_at": 11.0, "finished_at": 11.2, "step_s": None, "batch_size": 1,
         "prefill_tokens": 0, "decode_tokens": 1},  # its result was trimmed from Redis: left out
    ]
    split = timeline(rows)
    assert split["iterations"] == 2 and split["workers"] == 1
    assert split["window_s"] == pytest.approx(1.0)
    assert split["engine_s"] == pytest.approx(0.7)
    assert split["transport_s"] == pytest.approx(0.2)
    assert split["scheduler_s"] == pytest.approx(0.1)
    assert split["mean_batch_size"] == 2


def synthetic_report(spread: float, cancelled: int = 0, e2e: float = 0.6) -> dict:
    """Six requests sent `spread` seconds apart, each 5 tokens in `e2e` seconds."""
    results = [finished(index, index * spread, index * spread + 0.2, [index * spread + 0.2 + k * 0.1 for k in range(5)],
                        index * spread + e2e, 5, cancelled=index < cancelled) for index in range(6)]
    return {"summary": summarize(results, 2.0, 0.25), "system": "--policy iteration --workers 1", "cpu_seconds": {
        "worker": 3.0, "scheduler": 0.2, "bench client": 0.1}}


def test_experiments_report_renders_every_section(tmp_path):
    from services.bench.experiments import rate_point, render

    saturation = synthetic_report(0.0)
    results = {
        "sizes": {"name": "quick", "workload": "orca: ...", "note": "toy"}, "seed": 0, "command": "x",
        "machine": {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3.11"},
        "capacity_requests_per_s": 2.0, "elapsed_s": 60,
        "orca_vs_request": {
            "iteration": [rate_point(synthetic_report(1.0), 1.0), rate_point(synthetic_report(0.5), 2.0)],
            "request": [rate_point(synthetic_report(1.0, e2e=0.8), 1.0), rate_point(synthetic_report(0.9, e2e=1.0), 2.0)],
            "request-stream": [rate_point(synthetic_report(1.0, e2e=0.7), 1.0)]},
        "overhead": {
            "system_run": saturation,
            "timeline": {"iterations": 10, "window_s": 0.6, "engine_s": 0.5, "transport_s": 0.05, "scheduler_s": 0.05,
                         "workers": 1, "mean_batch_size": 4.0, "engine_ms_per_iteration": 50.0},
            "microbenchmarks": {"batch_size": 4, "plan_bytes": 500, "result_bytes": 300, "serialization_ms": 0.1,
                                "detokenization_ms": 0.01, "token_events_ms": 0.02, "redis_ping_ms": 0.05},
            "engine_alone": {"output_token_throughput_engine": 60.0, "output_token_throughput_replay": 58.0,
                             "iterations": 9, "mean_batch_size": 4.4, "mean_step_ms": 45.0, "step_s": 0.4,
                             "output_tokens": 30, "scheduling_ms_per_iteration": 0.5}},
        "cancellation": {"rate": 1.6, "runs": {"0.0": synthetic_report(0.6),
                                               "0.3": synthetic_report(0.6, cancelled=2)}},
        "scaling": {"rate": 1.6, "one_worker": {"saturation": saturation, "at_rate": synthetic_report(0.6)},
                    "two_workers": {"saturation": synthetic_report(0.0),
                                    "at_rate": synthetic_report(0.6)}},
    }
    text = render(results, tmp_path)
    for heading in ("## 1. Orca", "## 2. Serving overhead", "## 3. Horizontal scaling", "## 4. Cancellation"):
        assert heading in text
    assert "System / engine alone" in text and "| worker | 3.0 |" in text
    assert results["orca_headline"]["request"]["rate"] == 2.0
    assert results["orca_headline"]["request-stream"]["rate"] == 1.0
    assert "Against `request-stream`" in text and "| request-stream | 1 |" in text


# The control-plane experiment (emulated workers)


def _snapshot(at: float, busy: list[float], iterations: int, cpu: float, phases: dict[str, float],
              round_trips: int = 0, plans: int = 0) -> dict:
    return {"workers": [{"id": f"w{index}", "heartbeat_at": at, "busy_seconds": seconds, "executor": "emulated",
                         "hardware": "h100-llama3-8b"} for index, seconds in enumerate(busy)],
            "scheduler": {"heartbeat_at": at, "iterations": iterations, "cpu_seconds": cpu,
                          "phase_cpu_seconds": phases, "round_trips": round_trips,
                          "plans": plans}}


def test_control_plane_figures_from_two_status_snapshots():
    from services.bench.control_plane import PHASES, largest_busy_fleet, markdown, measure
    from shared.messages import IterationRecord

    zero = dict.fromkeys(PHASES, 0.0)
    before = _snapshot(100.0, [5.0, 7.0], iterations=1000, cpu=2.0, phases=zero, round_trips=900, plans=600)
    # 10 s later: worker 0 was in steps 9.6 s, worker 1 8.0 s; 2000 worker-iterations, 3 s of scheduler CPU,
    # 1500 round trips, 800 plans (--scheduler-steps: 2.5 worker-iterations a plan)
    after = _snapshot(110.0, [14.6, 15.0], iterations=3000, cpu=5.0, phases=zero | {"plan": 1.0, "fanout": 0.5},
                      round_trips=2400, plans=1400)
    records = [IterationRecord(iteration=index, worker_id="w0", plan_id=index, request_ids=("a",) * batch, joined=(),
                               finished=(), prefill_tokens=0, decode_tokens=batch, started_at=0, finished_at=0,
                               step_seconds=step)
               for index, (batch, step) in enumerate([(64, 0.006), (32, 0.004)])]
    figures = measure(before, after, records)
    assert figures["busy_min"] == pytest.approx(0.80) and figures["busy_mean"] == pytest.approx(0.88)
    assert figures["plans_per_s"] == pytest.approx(200.0)
    assert figures["scheduler_cpu_share"] == pytest.approx(0.3)
    assert figures["scheduler_cpu_us_per_iteration"] == pytest.approx(1500.0)
    assert figures["phase_cpu_us_per_iteration"]["plan"] == pytest.approx(500.0)
    assert figures["phase_cpu_us_per_iteration"]["fanout"] == pytest.approx(250.0)
    # 2 workers x 10 s of wall time, 17.6 s in steps: 2.4 s between steps over 2000 iterations
    assert figures["gap_ms_per_iteration"] == pytest.approx(1.2)
    assert figures["mean_batch"] == 48 and figures["mean_decode_step_ms"] == pytest.approx(5.0)
    assert figures["round_trips_per_iteration"] == pytest.approx(0.75)
    assert figures["iterations_per_plan"] == pytest.approx(2.5)
    rows = [{"profile": "p", "workers": workers, "busy_min": busy}
            for workers, busy in [(1, 0.99), (2, 0.96), (4, 0.9), (8, 0.97)]]
    assert largest_busy_fleet(rows, "p") == 8 and largest_busy_fleet(rows, "other") == 0
    report = {"quick": False, "machine": {"cores": 2}, "date": "d", "largest_busy_fleet": {"h100-llama3-8b": 0},
              "sizes": {"requests_per_worker": 96, "prompt_tokens": 32, "output_tokens": 256, "max_batch_size": 64,
                        "pipeline_depth": 2, "seconds": 10, "warmup_seconds": 5},
              "pool": [{"profile": "h100-llama3-8b", "workers": 2, **figures,
                        "cpu_us_per_iteration_by_component": {"worker": 321.4, "redis": 123.0, "scheduler": 1500.0}}]}
    text = markdown(report)
    assert "EMULATED" in text and "| h100-llama3-8b | 5.00 | 2 | 48.0 | 0.80 | 0.88 | 200 | 30% | 1500 | 500 |" in text
    assert "| 0.75 | 2.50 | 1.20 | 321 | 123 |" in text  # round trips, iterations a plan, the gap, others' CPU
    assert "2 plans in flight per worker" in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_control_plane_case_keeps_an_emulated_worker_fed_and_measures_it():
    """One real `iterserve up` with an emulated worker, fed through the pool: the worker is busy,
    its batch fills up, and the scheduler's time per iteration is measured."""
    from services.bench.control_plane import QUICK, pool_case

    sizes = QUICK.__class__(**{**QUICK.__dict__, "seconds": 3.0, "warmup_seconds": 3.0})
    row = asyncio.run(pool_case("h100-llama3-8b", 1, sizes, seed=0))
    assert row["executor"] == "emulated" and row["profile"] == "h100-llama3-8b" and row["workers_measured"] == 1
    assert row["iterations"] > 50 and 0.1 < row["busy_min"] <= 1.0
    assert row["mean_batch"] > 32, "96 active requests per worker: its batch of 64 fills up"
    assert 4.0 < row["mean_decode_step_ms"] < 9.0, "h100-llama3-8b decode steps take 6-7 ms"
    assert row["scheduler_cpu_us_per_iteration"] > 0
    by_component = row["cpu_us_per_iteration_by_component"]
    assert by_component["worker"] > 0 and by_component["redis"] > 0
    assert by_component["scheduler"] == pytest.approx(row["scheduler_cpu_us_per_iteration"], rel=0.3)
    assert sum(row["phase_cpu_us_per_iteration"].values()) <= row["scheduler_cpu_us_per_iteration"] * 1.05
    assert row["phase_cpu_us_per_iteration"]["timers"] > 0, "the liveness polls (every 0.25 s) and heartbeats"


# `iterserve bench serve`: vLLM's bench flags, datasets and summary


def sharegpt_file(path, tokenizer, entries: int = 8):
    """A ShareGPT-format file from the corpus: `entries` good conversations (human turn, gpt answer,
    sometimes more turns), and the kinds vLLM skips (one turn, a 2-token prompt, a prompt over 1024
    tokens, no conversations, a turn without text)."""
    source = PromptSource(tokenizer)
    good = []
    for index in range(entries):
        turns = [{"from": "human", "value": source.text_of_length(97 * index, 20 + 7 * index)},
                 {"from": "gpt", "value": source.text_of_length(97 * index + 500, 10 + 3 * index)}]
        if index % 3 == 0:
            turns.append({"from": "human", "value": "and then?"})
        good.append({"id": f"good-{index}", "conversations": turns})
    skipped = [{"id": "one-turn", "conversations": [{"from": "human", "value": "a lone question with no answer"}]},
               {"id": "short-prompt", "conversations": [{"from": "human", "value": "Hi"},
                                                        {"from": "gpt", "value": source.text_of_length(0, 30)}]},
               {"id": "long-prompt", "conversations": [{"from": "human", "value": source.text_of_length(0, 1100)},
                                                       {"from": "gpt", "value": source.text_of_length(9, 30)}]},
               {"id": "no-conversations", "text": "nothing here"},
               {"id": "no-text", "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]
    data = good[:3] + skipped + good[3:]
    path.write_text(json.dumps(data))
    return data


def test_sharegpt_prompts_are_the_ones_vllm_picks_in_its_order(tokenizer, tmp_path):
    import random

    from services.bench.serve import sharegpt_requests

    data = sharegpt_file(tmp_path / "sharegpt.json", tokenizer)
    # vLLM's ShareGPTDataset, as its code does it: two turns or more, random.seed + random.shuffle,
    # then the pairs whose lengths pass is_valid_sequence, in that order.
    entries = [entry for entry in data if len(entry.get("conversations", [])) >= 2]
    random.seed(5)
    random.shuffle(entries)
    usable = [entry for entry in entries if entry["id"].startswith("good")]
    requests = sharegpt_requests(str(tmp_path / "sharegpt.json"), 6, tokenizer, seed=5)
    assert [request.prompt_text for request in requests] == [entry["conversations"][0]["value"] for entry in usable[:6]]
    for request, entry in zip(requests, usable, strict=False):
        assert request.prompt_tokens == len(tokenizer.encode_prompt(entry["conversations"][0]["value"]))
        assert request.max_tokens == len(tokenizer.encode_prompt(entry["conversations"][1]["value"]))
        body = request.body("m", None)
        assert body["prompt"] == entry["conversations"][0]["value"] and "ignore_eos" not in body
        assert "temperature" not in body, "no --temperature: the server's default, as vLLM's bench"
    assert [r.prompt_text for r in sharegpt_requests(str(tmp_path / "sharegpt.json"), 6, tokenizer, seed=6)] != \
           [r.prompt_text for r in requests], "another seed, another order"
    # More prompts than usable pairs: drawn again (vLLM's oversampling), or not with --no-oversample.
    many = sharegpt_requests(str(tmp_path / "sharegpt.json"), 20, tokenizer, seed=5)
    random.seed(5)
    again = random.choices(usable, k=12)  # vLLM's maybe_oversample_requests
    assert [r.prompt_text for r in many] == [e["conversations"][0]["value"] for e in usable + again]
    assert [r.index for r in many] == list(range(20))
    assert len(sharegpt_requests(str(tmp_path / "sharegpt.json"), 20, tokenizer, seed=5, oversample=False)) == 8
    # --sharegpt-output-len sets every output length (and then a short answer is no reason to skip).
    fixed = sharegpt_requests(str(tmp_path / "sharegpt.json"), 8, tokenizer, seed=5, output_len=3, ignore_eos=True)
    assert {r.max_tokens for r in fixed} == {3} and fixed[0].body("m", 0.0)["ignore_eos"] is True
    chat = sharegpt_requests(str(tmp_path / "sharegpt.json"), 2, tokenizer, seed=5, endpoint="chat")
    assert chat[0].body("m", 0.0)["messages"] == [{"role": "user", "content": requests[0].prompt_text}]
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        (tmp_path / "bad.json").write_text('{"conversations": []}')
        sharegpt_requests(str(tmp_path / "bad.json"), 2, tokenizer)
    with pytest.raises(ValueError, match="no usable conversation"):
        (tmp_path / "none.json").write_text(json.dumps(data[3:8]))
        sharegpt_requests(str(tmp_path / "none.json"), 2, tokenizer)


def test_random_prompts_have_the_asked_lengths_and_share_the_prefix(tokenizer):
    from services.bench.serve import random_requests

    exact = random_requests(5, tokenizer, seed=1, input_len=40, output_len=7)
    assert [len(r.prompt) for r in exact] == [40] * 5 and [r.max_tokens for r in exact] == [7] * 5
    assert len({r.prompt for r in exact}) == 5 and all(r.ignore_eos for r in exact)
    assert not {t for r in exact for t in r.prompt} & tokenizer.special_token_ids
    spread = random_requests(200, tokenizer, seed=1, input_len=40, output_len=10, range_ratio=0.5, prefix_len=6)
    assert {len(r.prompt) - 6 for r in spread} <= set(range(20, 61)) and len({len(r.prompt) for r in spread}) > 10
    assert {r.max_tokens for r in spread} <= set(range(5, 16)) and len({r.prompt[:6] for r in spread}) == 1
    assert [r.prompt for r in random_requests(5, tokenizer, seed=1, input_len=40, output_len=7)] == \
           [r.prompt for r in exact]


def serve_args(*argv: str):
    from services.bench.serve import checked_args

    return checked_args(["--dataset-name", "random", *argv])


def test_serve_summary_is_vllms_block_line_for_line():
    from services.bench.serve import serve_metrics, summary_lines

    results = [  # sent, first chunk, chunk times, finished, tokens (prompt, output)
        RequestResult(0, 10, 3, sent_at=0.0, first_token_at=0.1, chunk_times=[0.1, 0.3, 0.6], finished_at=0.6,
                      output_tokens=3, finish_reason="length"),
        RequestResult(1, 20, 2, sent_at=0.2, first_token_at=0.5, chunk_times=[0.5, 1.2], finished_at=1.2,
                      output_tokens=2, finish_reason="stop"),
        RequestResult(2, 30, 1, sent_at=1.5, first_token_at=1.6, chunk_times=[1.6], finished_at=1.6,
                      output_tokens=1, finish_reason="length"),
        RequestResult(3, 40, 5, sent_at=1.5, finished_at=1.7, error="HTTP 400: bad"),
    ]
    args = serve_args("--max-concurrency", "2", "--request-rate", "4", "--goodput", "ttft:200",
                      "--percentile-metrics", "ttft,tpot,itl,e2el,client_queue_time", "--metric-percentiles", "50,99.9")
    figures = serve_metrics(results, [0.0, 0.0, 0.25, 0.0], 2.0, args.metrics, args.percentiles, args.slos)
    lines = summary_lines(figures, args)
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert lines[1:9] == [
        "Successful requests:                     3         ",
        "Failed requests:                         1         ",
        "Maximum request concurrency:             2         ",
        "Request rate configured (RPS):           4.00      ",
        "Benchmark duration (s):                  2.00      ",
        "Total input tokens:                      60        ",
        "Total generated tokens:                  6         ",
        "Request throughput (req/s):              1.50      "]
    assert lines[9:14] == [
        "Request goodput (req/s):                 1.00      ",  # TTFT 100, 300, 100 ms against 200
        "Output token throughput (tok/s):         3.00      ",
        "Peak output token throughput (tok/s):    4.00      ",  # chunks at 0.1 0.3 0.5 0.6 in second 0
        "Peak concurrent requests:                2.00      ",
        "Total token throughput (tok/s):          33.00     "]
    assert lines[14:18] == ["---------------Time to First Token----------------",
                            "Mean TTFT (ms):                          166.67    ",
                            "Median TTFT (ms):                        100.00    ",
                            "P50 TTFT (ms):                           100.00    "]
    assert lines[18] == "P99.9 TTFT (ms):                         299.60    "
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "Mean TPOT (ms):                          475.00    " in lines  # 250 and 700 ms
    assert "Median ITL (ms):                         300.00    " in lines  # gaps 200, 300, 700 ms
    assert "Mean E2EL (ms):                          566.67    " in lines
    assert "Mean Client Queue Time (ms):             83.33     " in lines
    assert not any("E2EL incl. Client Queue" in line for line in lines), "only the metrics asked for"
    defaults = serve_args()
    plain = summary_lines(serve_metrics(results, [0.0] * 4, 2.0, defaults.metrics, defaults.percentiles, {}), defaults)
    assert not any(line.startswith(("Maximum request", "Request rate", "Request goodput", "Mean E2EL"))
                   for line in plain)
    assert figures["p50_ttft_ms"] == pytest.approx(100.0) and figures["failed"] == 1 and figures["completed"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "sonnet"], "invalid choice: 'sonnet'"),
    (["--dataset-name", "random", "--dataset-path", "x.json"], "takes no --dataset-path"),
    (["--percentile-metrics", "ttft,latency"], "unknown latency"),
    (["--goodput", "itl:5"], "KEY one of ttft, tpot, e2el"),
    (["--max-concurrency", "0"], "must be > 0"),
    (["--random-range-ratio", "1"], "[0, 1)"),
    (["--backend", "openai-chat"], "needs --endpoint /v1/chat/completions"),
])
def test_serve_refuses_what_vllm_refuses_and_what_it_does_not_do(argv, message):
    completed = subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", *argv], capture_output=True,
                               text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert completed.returncode == 2 and message in completed.stderr, completed.stderr


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_bench_serve_against_the_whole_system(tmp_path, tokenizer):
    """vLLM's bench command line, a generated ShareGPT file and the random dataset through a real
    system: its summary lines and saved JSON agree with what the server answered."""
    from tests.system import System

    data = sharegpt_file(tmp_path / "sharegpt.json", tokenizer)
    with System(workers=1, kv_blocks=128) as system:
        def serve(*argv: str) -> subprocess.CompletedProcess:
            completed = subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", "--base-url",
                                        system.base_url, "--disable-tqdm", *argv], capture_output=True, text=True,
                                       timeout=300, stdin=subprocess.DEVNULL)
            assert completed.returncode == 0, completed.stderr[-3000:]
            return completed

        sharegpt = serve("--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"),
                         "--num-prompts", "6", "--seed", "2", "--request-rate", "20", "--max-concurrency", "3",
                         "--sharegpt-output-len", "5", "--ignore-eos", "--temperature", "0",
                         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                         "--goodput", "ttft:600000", "--save-result", "--result-dir", str(tmp_path / "results"),
                         "--save-detailed")
        random_run = serve("--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "4",
                           "--num-prompts", "4", "--save-result", "--result-dir", str(tmp_path / "results"),
                           "--result-filename", "random.json")
        chat = serve("--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
                     "--dataset-path", str(tmp_path / "sharegpt.json"), "--num-prompts", "2", "--temperature", "0")
    lines = sharegpt.stdout.splitlines()
    assert lines[0].startswith("iterserve bench serve (executor: engine): 6 sharegpt prompts")
    values = {line[:40].strip(): line[41:].strip() for line in lines if len(line) > 41 and line[:40].endswith(" ")}
    assert values["Successful requests:"] == "6" and values["Failed requests:"] == "0"
    assert values["Maximum request concurrency:"] == "3" and values["Request rate configured (RPS):"] == "20.00"
    assert values["Total generated tokens:"] == "30", "--ignore-eos with --sharegpt-output-len 5"
    saved = json.loads(next((tmp_path / "results").glob("openai-20.0qps-concurrency3-*.json")).read_text())
    assert next(iter(saved)) == "executor" and saved["executor"] == "engine"
    assert saved["model_id"] == "smollm2-135m-instruct" and saved["num_prompts"] == 6 and saved["completed"] == 6
    assert values["Total input tokens:"] == str(saved["total_input_tokens"])
    from services.bench.serve import sharegpt_requests

    sent = sharegpt_requests(str(tmp_path / "sharegpt.json"), 6, tokenizer, seed=2)
    assert saved["total_input_tokens"] == sum(request.prompt_tokens for request in sent), \
        "the server counts the prompts as the dataset did"
    assert 0 < saved["max_concurrent_requests"] <= 3 and saved["request_goodput"] == pytest.approx(
        saved["request_throughput"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert saved[f"mean_{metric}_ms"] > 0 and f"p99_{metric}_ms" in saved and f"p50_{metric}_ms" in saved
        assert values[f"Mean {metric.upper()} (ms):"] == f"{saved[f'mean_{metric}_ms']:.2f}"
    assert len(saved["latencies"]) == 6 and len(saved["generated_texts"]) == 6
    randomly = json.loads((tmp_path / "results" / "random.json").read_text())
    assert (randomly["completed"], randomly["total_input_tokens"], randomly["total_output_tokens"]) == (4, 128, 16)
    assert "input_lens" not in randomly and randomly["request_rate"] == "inf"
    assert "Maximum request concurrency" not in random_run.stdout and "P99 ITL (ms):" in random_run.stdout
    assert "Successful requests:                     2" in chat.stdout
