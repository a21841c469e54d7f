"""Prefix caching through the whole system: real processes, Redis, the model, HTTP.

A conversation's next turn finds its history cached (usage says how much, /metrics counts it) and
answers what the engine alone answers; a request whose prefix is cached on a worker that dies is
rebuilt on the other one, token-exact."""

import concurrent.futures
import json
import re
import time
import urllib.request

import openai
import pytest

from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m-instruct"
BLOCK = 16  # the default kv_block_size
SYSTEM_PROMPT = ("You are a careful assistant for a school library. You answer questions about geography, history "
                 "and science in two or three plain sentences, and you give one concrete example every time.")


def greedy_alone(engine, tokenizer, prompt_ids: list[int], max_tokens: int, stop: bool = True) -> str:
    from tests.engine_helpers import generate_alone

    stop_ids = tokenizer.stop_token_ids if stop else frozenset()
    output = generate_alone(engine, "oracle", prompt_ids, max_tokens, stop_ids=stop_ids)
    return tokenizer.decode([token for token in output if token not in stop_ids])


def status(cluster: Cluster) -> dict:
    return cluster.get_json("/status")[1]


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def admissions(cluster: Cluster, request_id: str) -> list[dict]:
    """The scheduler's admitted lines for a request: worker, output tokens so far, tokens found cached."""
    found = []
    for _, line in cluster.log_events("scheduler", f"admitted request_id={request_id} "):
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        found.append({"worker_id": fields["worker_id"], "output_tokens": int(fields["output_tokens"]),
                      "cached_tokens": int(fields["cached_tokens"])})
    return found


def test_a_conversations_turns_and_a_cached_prefix_on_a_worker_that_dies(engine_alone, tokenizer):
    with Cluster(workers=2) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", timeout=120, max_retries=0)

        # A conversation: turn 2 sends turn 1's messages, its answer and a new question.
        history = [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": "What is the capital of France?"}]
        first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert first.choices[0].message.content == greedy_alone(engine_alone, tokenizer,
                                                                tokenizer.encode_chat(history), 16)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And what is the capital of Italy?"}]
        second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
        turn_one_blocks = len(tokenizer.encode_chat(history[:2])) // BLOCK
        assert second.usage.prompt_tokens_details.cached_tokens >= turn_one_blocks * BLOCK > 0
        assert second.choices[0].message.content == greedy_alone(engine_alone, tokenizer,
                                                                 tokenizer.encode_chat(history), 16)
        metrics = cluster.get_text("/metrics")
        hits = float(re.search(r'iterserve_prefix_cache_hits_tokens\{model="[^"]+"\} (\S+)', metrics).group(1))
        assert hits >= second.usage.prompt_tokens_details.cached_tokens

        # A prefix cached on one worker; a request sharing it starts there, and that worker dies.
        prefix = SYSTEM_PROMPT + " Today's topic is the water cycle, from the sea to the clouds and back."
        warm = client.completions.create(model=MODEL, prompt=prefix + " First question: what is rain?", max_tokens=2,
                                         temperature=0)
        assert warm.usage.completion_tokens == 2
        # The worker that ran it (the other may hold as many blocks: the conversation's, which share
        # only the system prompt).
        warm_worker = admissions(cluster, warm.id)[0]["worker_id"]
        holder = wait_for(lambda: next((w for w in status(cluster)["workers"] if w["id"] == warm_worker
                                        and w["kv_blocks_cached"] >= len(tokenizer.encode_prompt(prefix)) // BLOCK),
                                       None), "a heartbeat showing the prefix cached")
        prompt = prefix + " Second question: why do clouds float?"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}

        def send() -> dict:
            request = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(send)
            wait_for(lambda: any(w["id"] == holder["id"] and w["running"] > 0 for w in status(cluster)["workers"]),
                     "the request running where its prefix is cached")
            time.sleep(1.0)  # some of its tokens decoded there
            cluster.kill(cluster.name_of_worker(holder["id"]))
            result = answer.result(timeout=120)
        request_id = result["id"]
        placed = admissions(cluster, request_id)
        assert placed[0]["worker_id"] == holder["id"] and placed[0]["cached_tokens"] > 0, placed
        assert len(placed) == 2 and placed[1]["worker_id"] != holder["id"] and placed[1]["output_tokens"] > 0, \
            f"not rebuilt elsewhere mid-run: {placed}"
        expected = greedy_alone(engine_alone, tokenizer, tokenizer.encode_prompt(prompt), 48, stop=False)
        assert result["choices"][0]["text"] == expected
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == placed[0]["cached_tokens"]


PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4}
PENALTY_PREFIX = ("The village library kept three shelves of atlases, two of old maps and one of travel diaries, "
                  "and every winter the librarian read them aloud to whoever came in from the cold. ")


def test_penalised_greedy_outputs_are_the_same_cold_warm_preempted_moved_and_without_prefix_caching(
        engine_alone, tokenizer):
    """Greedy completions with all three penalties give the tokens the engine gives them alone on an
    empty cache: the first time (cold), again with their prompt from the cache (warm), preempted and
    rebuilt from cached blocks of their prompt and output, rebuilt on another worker holding their
    prefix after theirs is SIGKILLed mid-stream, and on a system with --no-prefix-caching. (The
    worker's penalty history once started at the first token fed: the cached part was missing.)"""
    from shared.messages import SamplingParams
    from tests.engine_helpers import generate_alone

    prompts = [PENALTY_PREFIX + ending for ending in ("Tell me about the maps.", "Which diary was the favourite?",
                                                      "Who came in from the cold?", "What did the atlases show?")]

    def oracle(prompt: str, max_tokens: int, penalties: dict = PENALTIES) -> str:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **penalties)
        return tokenizer.decode(generate_alone(engine_alone, "oracle", tokenizer.encode_prompt(prompt), max_tokens,
                                               sampling))

    expected = {prompt: oracle(prompt, 40) for prompt in prompts}
    assert expected[prompts[0]] != oracle(prompts[0], 40, {}), "the penalties change nothing: the test proves nothing"

    def complete(cluster: Cluster, prompt: str, max_tokens: int = 40) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                **PENALTIES}
        request = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=180) as response:
            return json.loads(response.read())

    with Cluster(workers=2, kv_blocks=64, placement_slack=0) as cluster:  # (slack 0: two at once go one to each)
        for run in ("cold", "warm"):  # (cold: the second prompt finds the first's shared blocks cached)
            for prompt in prompts[:2]:
                answer = complete(cluster, prompt)
                assert answer["choices"][0]["text"] == expected[prompt], (run, prompt)
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (cached == 0) if (run, prompt) == ("cold", prompts[0]) else (cached >= 2 * BLOCK), (run, cached)
        # Moved: both workers hold the prefix (two at once went one to each); the one running the request
        # is killed mid-stream, and the other rebuilds it after the prefix it holds.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda prompt: complete(cluster, prompt, 2), prompts[1:3]))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            admitted_before = len(cluster.log_events("scheduler", "admitted request_id="))
            pending = pool.submit(complete, cluster, prompts[2], 100)
            line = wait_for(lambda: cluster.log_events("scheduler", "admitted request_id=")[admitted_before:],
                            "the request admitted")[0][1]
            holder = dict(re.findall(r"(\w+)=(\S+)", line))["worker_id"]
            time.sleep(1.0)  # some of its tokens decoded there
            cluster.kill(cluster.name_of_worker(holder))
            answer = pending.result(timeout=180)
        assert answer["choices"][0]["text"] == oracle(prompts[2], 100)
        placed = admissions(cluster, answer["id"])
        assert len(placed) == 2 and placed[1]["worker_id"] != holder and placed[1]["output_tokens"] > 0 \
            and placed[1]["cached_tokens"] > 0, f"not rebuilt on the other worker from its cache: {placed}"
    # Preempted: one worker of 16 blocks (256 tokens), four requests of about 95 tokens sharing a prefix.
    with Cluster(workers=1, kv_blocks=16) as cluster:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda prompt: complete(cluster, prompt), prompts))
        assert [answer["choices"][0]["text"] for answer in answers] == [expected[prompt] for prompt in prompts]
        preempted = {dict(re.findall(r"(\w+)=(\S+)", line))["request_id"]
                     for _, line in cluster.log_events("scheduler", "preempted request_id=")}
        rebuilt = [placed for answer in answers if answer["id"] in preempted
                   for placed in admissions(cluster, answer["id"])[1:] if placed["output_tokens"] > 0]
        assert any(placed["cached_tokens"] > 0 for placed in rebuilt), \
            f"no request was preempted mid-output and rebuilt after cached blocks: {preempted}, {rebuilt}"
    with Cluster(workers=1, kv_blocks=64, prefix_caching=False) as cluster:
        for prompt in prompts[:3]:
            answer = complete(cluster, prompt)
            assert answer["choices"][0]["text"] == expected[prompt]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
