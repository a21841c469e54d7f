"""Tensor-parallel worker groups through the whole system (services/worker/group.py).

SmolLM2-135M has 9 attention heads and 3 KV heads, so it splits 3 ways (one KV head per rank);
`--tensor-parallel 2` is refused at start with the reason. A group answers what the
single-process engine answers; the death of one of its ranks is the death of its worker, and the
requests it ran finish on another worker, token-exact."""

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
MODEL = "smollm2-135m-instruct"
PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colours are",
           "Q: Why do cats purr?\nA:", "Here is a short poem about winter mornings:\n"]


def expected_text(engine, tokenizer, prompt: str, max_tokens: int) -> str:
    from tests.engine_helpers import generate_alone

    return tokenizer.decode(generate_alone(engine, "oracle", tokenizer.encode_prompt(prompt), max_tokens))


def complete(base_url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=240) as response:
        return json.loads(response.read())


def ranks_of(worker: psutil.Process) -> list[psutil.Process]:
    """The group's other ranks: the worker's spawned children (not multiprocessing's resource tracker)."""
    return [child for child in worker.children() if "spawn_main" in " ".join(child.cmdline())]


def status(cluster: Cluster) -> dict:
    return cluster.get_json("/status")[1]


def test_a_tensor_parallel_group_answers_as_one_engine_and_its_rank_dying_moves_its_requests(engine_alone,
                                                                                             tokenizer):
    with contextlib.closing(Cluster(workers=0)) as cluster:  # the group first, alone
        cluster.redis.start()
        cluster.start("scheduler")
        group = cluster.start_worker(ITERSERVE_TENSOR_PARALLEL="3")
        cluster.start("gateway")
        cluster.wait_ready(1)
        [worker] = status(cluster)["workers"]
        assert worker["device"] == "cpu x3 (tensor parallel)" and worker["kv_blocks_total"] == 256
        assert len(ranks_of(psutil.Process(group.process.pid))) == 2

        # The group alone serves a batch of requests: what the single-process engine answers.
        expected = {prompt: expected_text(engine_alone, tokenizer, prompt, 40) for prompt in PROMPTS}
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda prompt: complete(cluster.base_url, prompt, 40), PROMPTS))
        assert [answer["choices"][0]["text"] for answer in answers] == [expected[prompt] for prompt in PROMPTS]

        # Requests running on the group, a single-process worker joins, one of the group's ranks dies:
        # the group's worker exits and its requests finish on the other worker, token-exact.
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(complete, cluster.base_url, prompt, 60) for prompt in PROMPTS]
            deadline = time.monotonic() + 60
            while not any(w["running"] == len(PROMPTS) for w in status(cluster)["workers"]):
                assert time.monotonic() < deadline, "the group never ran the requests"
                time.sleep(0.1)
            single = cluster.start_worker()
            cluster.wait_ready(2)
            ranks_of(psutil.Process(group.process.pid))[0].kill()
            answers = [future.result(timeout=240) for future in futures]
        expected = {prompt: expected_text(engine_alone, tokenizer, prompt, 60) for prompt in PROMPTS}
        assert [answer["choices"][0]["text"] for answer in answers] == [expected[prompt] for prompt in PROMPTS]
        assert group.process.wait(timeout=30) == 3, "the group's worker did not stop with its rank"
        assert "event=group_rank_died" in cluster.log(group.name)
        moved = [line for _, line in cluster.log_events("scheduler", "admitted request_id=")
                 if f"worker_id={single.worker_id}" in line and "output_tokens=0" not in line]
        assert moved, "no request was rebuilt on the other worker after the rank died"


def test_a_split_that_does_not_fall_on_whole_heads_is_refused_at_start():
    completed = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--tensor-parallel", "2",
                                "--redis-url", "redis://127.0.0.1:1"], capture_output=True, text=True, timeout=120,
                               stdin=subprocess.DEVNULL)
    assert completed.returncode != 0
    assert "tensor parallel size 2 does not divide 9 attention heads, 3 KV heads" in completed.stderr
