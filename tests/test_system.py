"""The whole system as users run it: `iterserve up`, real processes, real Redis, real model."""

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import msgpack
import openai
import psutil
import pytest
import redis

from shared import keys
from shared.messages import IterationRecord, SamplingParams
from tests.system import System, assert_emulated_completion

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def system():
    with System(workers=2) as running:
        yield running


@pytest.fixture(scope="module")
def client(system):
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def engine_greedy_text(engine, tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    from tests.engine_helpers import generate_alone

    output = generate_alone(engine, "oracle", prompt_ids, max_tokens, stop_ids=tokenizer.stop_token_ids)
    finish_reason = "stop" if output[-1] in tokenizer.stop_token_ids else "length"
    return tokenizer.decode(output), finish_reason


def test_chat_completion_greedy_text_equals_the_engine_alone(client, engine_alone, tokenizer):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    expected, reason = engine_greedy_text(engine_alone, tokenizer, tokenizer.encode_chat(messages), 30)
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == reason
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    assert response.id.startswith("chatcmpl-")


def test_streamed_chat_completion_equals_the_engine_alone(client, engine_alone, tokenizer):
    messages = [{"role": "user", "content": "Écris une phrase sur la mer. 🌊"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=25, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish_reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    expected, reason = engine_greedy_text(engine_alone, tokenizer, tokenizer.encode_chat(messages), 25)
    assert "".join(pieces) == expected
    assert "\ufffd" not in "".join(pieces)
    assert finish_reasons == [reason]
    assert usage is not None and usage.completion_tokens > 0


def test_completion_greedy_text_equals_the_engine_alone_streamed_or_not(client, engine_alone, tokenizer):
    prompt = "Once upon a time, in a small village by the sea,"
    expected, reason = engine_greedy_text(engine_alone, tokenizer, tokenizer.encode(prompt), 20)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert response.choices[0].text == expected and response.choices[0].finish_reason == reason
    streamed = "".join(chunk.choices[0].text for chunk in
                       client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True)
                       if chunk.choices)
    assert streamed == expected


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(client, engine_alone, tokenizer):
    """The real scheduler finds the stop strings in the detokenized text (services/scheduler/output.py):
    the answer is the greedy text up to the earliest one, finish_reason "stop", streamed or not."""
    prompt = "Once upon a time, in a small village by the sea,"
    full, _ = engine_greedy_text(engine_alone, tokenizer, tokenizer.encode(prompt), 30)
    words = full.split()
    stop = [words[len(words) // 2], "\u2603 never"]  # a word in the middle, and one that never appears
    cut = full[: full.find(stop[0])]
    assert 0 < len(cut) < len(full.rstrip()), (full, stop)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunks and chunk.choices) == cut
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason] \
        == ["stop"]


def test_seeded_sampling_depends_on_the_seed_only_and_temperature_zero_is_greedy(client, engine_alone, tokenizer):
    """A seed picks the output: the same seed gives the same text alone and inside a batch of
    other requests, different seeds give different texts (so temperature and seed are not
    ignored), and temperature 0 is greedy whatever the seed."""
    prompt = "My favourite food is"

    def sample(seed: int, temperature: float = 0.9) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature,
                                          top_p=0.95, seed=seed).choices[0].text

    alone = sample(42)
    assert sample(42) == alone
    others = [f"Tell me about the number {index}." for index in range(7)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        in_batch = pool.submit(sample, 42)
        noise = [pool.submit(client.completions.create, model=MODEL, prompt=other, max_tokens=24, temperature=1.0,
                             seed=index) for index, other in enumerate(others)]
        assert in_batch.result() == alone, "the same seed gave another output inside a batch"
        for future in noise:
            future.result()
    by_seed = {seed: sample(seed) for seed in (1, 2, 3, 4)} | {42: alone}
    assert len(set(by_seed.values())) == len(by_seed), f"different seeds gave the same output: {by_seed}"
    greedy, _ = engine_greedy_text(engine_alone, tokenizer, tokenizer.encode(prompt), 16)
    assert sample(1, temperature=0) == sample(2, temperature=0) == greedy
    assert greedy not in by_seed.values(), "sampling at temperature 0.9 gave the greedy text for every seed"


def test_logprobs_through_the_system_are_log_softmax_of_the_engines_logits(client, engine_alone, tokenizer):
    """Both endpoints' logprobs, against the oracle: the same engine alone, its raw logits' log_softmax."""
    import torch

    from tests.engine_helpers import decode_item, prefill_item

    prompt = "The three primary colours are"
    ids = tokenizer.encode(prompt)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    engine_alone.add_request("lp", SamplingParams(max_tokens=6))
    try:
        step = engine_alone.step([prefill_item("lp", ids)], return_logits=True)
        for index in range(6):
            expected = torch.log_softmax(step.logits["lp"], dim=0)
            token = step.tokens["lp"]
            assert logprobs.tokens[index] == tokenizer.token_text(token)
            assert abs(logprobs.token_logprobs[index] - float(expected[token])) < 1e-3
            top = expected.topk(3)
            assert list(logprobs.top_logprobs[index]) == [tokenizer.token_text(t) for t in top.indices.tolist()]
            assert all(abs(value - float(lp)) < 1e-3 for value, lp in zip(logprobs.top_logprobs[index].values(), top.values))
            step = engine_alone.step([decode_item("lp", token, len(ids) + index, index + 1)], return_logits=True)
    finally:
        engine_alone.free("lp")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 for entry in content), "greedy takes the top one"


def test_concurrent_requests_all_complete_with_their_own_greedy_answer(client, engine_alone, tokenizer):
    prompts = [f"Count from {start} to {start + 5}:" for start in range(1, 9)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(
            model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text, prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer == engine_greedy_text(engine_alone, tokenizer, tokenizer.encode(prompt), 12)[0], prompt


def post(system: System, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"{system.base_url}{path}", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "top_p": 2}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 17}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hello " * 9000}).encode(), 400),
    ("/v1/completions", json.dumps({"model": "gpt-17", "prompt": "x"}).encode(), 404),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    ("/v1/completions", b"x" * (2 << 20), 413),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_INPUTS,
                         ids=["malformed-json", "wrong-type", "temperature", "max-tokens", "top-p", "n", "too-long",
                              "unknown-model", "messages-type", "role", "body-too-large"])
def test_bad_input_gets_its_status_and_an_openai_error_then_a_good_request_succeeds(system, client, path, body, status):
    got_status, error_body = post(system, path, body)
    assert got_status == status, error_body
    assert set(error_body["error"]) >= {"message", "type", "param", "code"}
    assert error_body["error"]["message"]
    good = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert good.choices[0].finish_reason in ("stop", "length")


def test_unknown_request_id_cancel_is_404_and_health_status_metrics_answer(system):
    request = urllib.request.Request(f"{system.base_url}/v1/requests/cmpl-nope", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=10)
    assert raised.value.code == 404 and "error" in json.loads(raised.value.read())
    with urllib.request.urlopen(f"{system.base_url}/status", timeout=10) as response:
        status = json.loads(response.read())
    assert len(status["workers"]) == 2
    assert all(w["kv_blocks_total"] == 256 and w["device"] == "cpu" and w["pid"] for w in status["workers"])
    with urllib.request.urlopen(f"{system.base_url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert "time_to_first_token" in metrics


# Iteration-level scheduling, seen in the scheduler's per-iteration record


def iteration_records(redis_url: str) -> list[IterationRecord]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [IterationRecord.model_validate(msgpack.unpackb(fields[b"m"]))
                for _, fields in client.xrange(keys.ITERATIONS_STREAM)]
    finally:
        client.close()


def run_one_long_and_many_short(system: System) -> tuple[str, list[str], list[str]]:
    client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", timeout=300, max_retries=0)

    def complete(max_tokens: int) -> str:
        return client.completions.create(model=MODEL, prompt="Tell me about the sea.", max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True}).id

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        long_request = pool.submit(complete, 64)
        time.sleep(0.5)
        first_wave = [pool.submit(complete, 3) for _ in range(3)]
        first_ids = [future.result(timeout=300) for future in first_wave]
        second_wave = [pool.submit(complete, 3) for _ in range(2)]
        second_ids = [future.result(timeout=300) for future in second_wave]
        return long_request.result(timeout=300), first_ids, second_ids


def test_iteration_level_short_requests_finish_and_new_ones_join_while_the_long_one_runs(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    with System("--redis-url", redis_url, "--policy", "iteration", workers=1) as system:
        long_id, first_ids, second_ids = run_one_long_and_many_short(system)
        records = iteration_records(redis_url)
    with_long = [record for record in records if long_id in record.request_ids]
    long_finished_at = max(record.iteration for record in with_long)
    for request_id in first_ids + second_ids:
        joined = [r.iteration for r in records if request_id in r.joined]
        finished = [r.iteration for r in records if request_id in r.finished]
        assert joined and finished, f"{request_id} not in the iteration record"
        assert finished[0] < long_finished_at, f"{request_id} did not finish while the long request ran"
    assert any(set(second_ids) & set(r.joined) for r in with_long), "no new request joined the running batch"


def test_request_level_policy_makes_new_requests_wait_for_the_whole_batch(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    with System("--redis-url", redis_url, "--policy", "request", workers=1) as system:
        long_id, first_ids, second_ids = run_one_long_and_many_short(system)
        records = iteration_records(redis_url)
    with_long = [record for record in records if long_id in record.request_ids]
    long_finished_at = max(record.iteration for record in with_long)
    for request_id in first_ids + second_ids:
        joined = min(r.iteration for r in records if request_id in r.joined)
        assert joined > long_finished_at, f"{request_id} joined before the long request's batch finished"
    assert all(set(r.joined) <= set(with_long[0].request_ids) for r in with_long)


@pytest.mark.parametrize("options", [("--answer-every", "2", "--pipeline-depth", "4"), ("--scheduler-steps", "4")],
                         ids=["answered-in-pairs", "four-steps-a-plan"])
def test_plans_answered_together_give_every_request_what_the_engine_alone_gives(engine_alone, tokenizer, options):
    """`--answer-every 2`: the worker answers plans two at a time (docs/protocol.md); `--scheduler-steps
    4`: a plan of decodes runs up to 4 steps on the worker, each answered, all in one write. Requests of
    different lengths, joining and leaving a batch whose plans go out and come back in groups, still
    get exactly what each gets alone, streamed or not."""
    prompts = ["The capital of France is", "Write a haiku about autumn leaves:", "1, 2, 3, 4,"]
    lengths = [7, 19, 12]
    with System(*options, workers=1) as system:
        client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", timeout=120, max_retries=0)

        def complete(prompt: str, max_tokens: int) -> str:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
            answers = [pool.submit(complete, prompt, length) for prompt, length in zip(prompts, lengths)]
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model=MODEL, prompt=prompts[0], max_tokens=9, temperature=0, stream=True) if chunk.choices)
            texts = [answer.result(timeout=300) for answer in answers]
        with urllib.request.urlopen(f"{system.base_url}/status", timeout=10) as response:
            status = json.loads(response.read())
    for prompt, length, text in zip(prompts, lengths, texts):
        assert text == engine_greedy_text(engine_alone, tokenizer, tokenizer.encode(prompt), length)[0], prompt
    assert streamed == engine_greedy_text(engine_alone, tokenizer, tokenizer.encode(prompts[0]), 9)[0]
    scheduler = status["scheduler"]
    assert scheduler["iterations"] > 0
    if "--scheduler-steps" in options:  # plans of decodes ran several steps each
        assert scheduler["iterations"] > 1.5 * scheduler["plans"], scheduler  # (24 in 9 plans here)
    else:  # a plan a step (the last plans' answers may be after the heartbeat /status shows)
        assert 0 < scheduler["iterations"] <= scheduler["plans"], scheduler


def test_sigterm_stops_the_whole_system_and_leaves_no_process_behind():
    system = System(workers=2).__enter__()
    children = system.descendants()
    names = " ".join(" ".join(child.cmdline()) for child in children)
    assert "redis-server" in names and names.count("services.cli worker") == 2
    leftovers = system.stop()
    assert leftovers == [], f"left running: {[p.pid for p in leftovers]}"
    assert not [child for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]


def test_scheduler_cpus_put_the_scheduler_alone_on_its_cpu_kept_awake_and_everything_else_on_the_others():
    """`iterserve up --scheduler-cpus C`: the scheduler runs on C alone, an idle-priority process keeps
    C from idling (services/keep_awake.py), the workers, gateway and Redis run on the other CPUs;
    /status says where the scheduler runs, requests are served, and stopping leaves nothing behind."""
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"this test needs two CPUs to split, this process may use {cpus}"
    scheduler_cpu, others = cpus[-1], set(cpus[:-1])
    for refused, reason in ((f"{cpus[-1] + 1000}", f"CPU {cpus[-1] + 1000} is not among this process's CPUs"),
                            (",".join(map(str, cpus)), "leaves no CPU for the workers")):
        up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--scheduler-cpus", refused],
                            capture_output=True, text=True, timeout=60)
        assert up.returncode == 2 and reason in up.stderr + up.stdout, (up.returncode, up.stderr[-2000:])
    system = System("--executor", "emulated", "--hardware", "h100-llama3-8b", "--scheduler-cpus", str(scheduler_cpu),
                    workers=2).__enter__()
    try:
        placed: dict[str, list] = {}
        for pid, kind in system.components().items():  # (up's children, by kind)
            # (every thread of it: torch's and Redis's threads start after the affinity was set)
            placed.setdefault(kind, []).extend(
                (set(os.sched_getaffinity(thread.id)), os.sched_getscheduler(thread.id))
                for thread in psutil.Process(pid).threads())
        assert set(placed) == {"scheduler", "worker", "gateway", "redis", "keep-awake"}, set(placed)
        assert all(cpus == {scheduler_cpu} for cpus, _ in placed["scheduler"]), placed["scheduler"]
        assert placed["keep-awake"] == [({scheduler_cpu}, os.SCHED_IDLE)], placed["keep-awake"]
        for kind in ("worker", "gateway", "redis"):
            assert all(cpus == others for cpus, _ in placed[kind]), (kind, placed[kind])
        assert_emulated_completion(system.url)
        with urllib.request.urlopen(f"{system.url}/status", timeout=10) as response:
            assert json.loads(response.read())["scheduler"]["cpus"] == [scheduler_cpu]
    finally:
        leftovers = system.stop()
    assert leftovers == [], f"left running: {[process.cmdline() for process in leftovers]}"


def test_a_setting_that_can_never_work_stops_up_with_its_message_while_a_crash_is_restarted(tmp_path):
    """A worker whose settings can never work (--tensor-parallel 2 for SmolLM2's 9 heads and 3 KV
    heads) exits with the configuration-error code (shared/exits.py), and `up` stops at once with
    exit 2 and the worker's message rather than restart it every 2 s forever; a worker that is
    SIGKILLed (a crash that may pass) is still started again, and the system serves on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from shared.exits import CONFIGURATION_ERROR

    from services.launcher import free_port

    env = dict(os.environ) | {"ITERSERVE_DATA_DIR": str(tmp_path), "ITERSERVE_PORT": str(free_port())}
    started = time.monotonic()
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--tensor-parallel", "2", "--workers", "1"],
                        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert up.returncode == 2, (up.returncode, up.stderr[-3000:])
    assert up.stderr.rstrip().endswith("iterserve worker: tensor parallel size 2 does not divide 9 attention heads, "
                                       "3 KV heads"), up.stderr[-3000:]
    assert f"code={CONFIGURATION_ERROR}" not in up.stderr and "restart_in" not in up.stderr, "it was restarted"
    assert time.monotonic() - started < 60
    left = [process for process in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(process.info["cmdline"] or ())]
    assert left == [], f"left running: {[process.info['cmdline'] for process in left]}"

    with System("--executor", "emulated", "--hardware", "h100-llama3-8b", workers=1) as system:
        [worker] = [pid for pid, kind in system.components().items() if kind == "worker"]
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not [pid for pid, kind in system.components().items() if kind == "worker" and pid != worker]:
            assert system.process.poll() is None, "up stopped after a worker crash"
            assert time.monotonic() < deadline, "the killed worker was not started again"
            time.sleep(0.2)
        system.wait_healthy(60)
        assert_emulated_completion(system.url)
        assert "event=exited process=worker-1 code=-9 restart_in=2s" in system.log()
