"""Worker groups through the whole system (services/worker/group.py).

SmolLM2-135M has 9 attention heads and 3 KV heads, so it splits 3 ways (one KV head per rank);
`--tensor-parallel 2` is refused at start with the reason; its 30 layers split into 2 stages.
A group answers what the single-process engine answers, also while some of its requests are
cancelled; the death of one of its ranks is the death of its worker, and the requests it ran
finish on another worker, token-exact. Tensor parallel 2, and tensor x pipeline (2 x 2), run on a
tiny Llama checkpoint with 4 heads, against transformers, through cancellations and a rank dying."""

import asyncio
import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch

from tests.checkpoints import save_checkpoint, transformers_model
from tests.cluster import Cluster
from tests.requirements import import_or_skip
from tests.test_chaos import Output, Spec, iteration_records, session, stream_request, until, until_kv_all_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
MODEL = "smollm2-135m-instruct"
PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colours are",
           "Q: Why do cats purr?\nA:", "Here is a short poem about winter mornings:\n"]


def expected_text(engine, tokenizer, prompt: str, max_tokens: int) -> str:
    from tests.engine_helpers import generate_alone

    return tokenizer.decode(generate_alone(engine, "oracle", tokenizer.encode_prompt(prompt), max_tokens))


def post(base_url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=240) as response:
        return json.loads(response.read())


def complete(base_url: str, prompt: str, max_tokens: int, model: str = MODEL) -> dict:
    return post(base_url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})


def ranks_of(worker: psutil.Process) -> list[psutil.Process]:
    """The group's other ranks: the worker's spawned children (not multiprocessing's resource tracker)."""
    return [child for child in worker.children() if "spawn_main" in " ".join(child.cmdline())]


def status(cluster: Cluster) -> dict:
    return cluster.get_json("/status")[1]


def start_group_alone(cluster: Cluster, ranks: int, **env: str):
    """Redis, the scheduler, one worker group and the gateway; returns the group's service and its
    /status entry, once its other ranks are up."""
    cluster.redis.start()
    cluster.start("scheduler")
    group = cluster.start_worker(**env)
    cluster.start("gateway")
    cluster.wait_ready(1)
    assert len(ranks_of(psutil.Process(group.process.pid))) == ranks - 1
    [worker] = status(cluster)["workers"]
    return group, worker


def test_a_tensor_parallel_group_answers_as_one_engine_and_its_rank_dying_moves_its_requests(engine_alone,
                                                                                             tokenizer):
    with contextlib.closing(Cluster(workers=0)) as cluster:  # the group first, alone
        group, worker = start_group_alone(cluster, 3, ITERSERVE_TENSOR_PARALLEL="3")
        assert worker["device"] == "cpu x3 (tensor parallel 3)" and worker["kv_blocks_total"] == 256

        # The group alone serves a batch of requests: what the single-process engine answers.
        expected = {prompt: expected_text(engine_alone, tokenizer, prompt, 40) for prompt in PROMPTS}
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda prompt: complete(cluster.base_url, prompt, 40), PROMPTS))
        assert [answer["choices"][0]["text"] for answer in answers] == [expected[prompt] for prompt in PROMPTS]

        expected = {prompt: expected_text(engine_alone, tokenizer, prompt, 60) for prompt in PROMPTS}
        kill_a_rank_while_it_runs(cluster, group, PROMPTS, 60, expected)


def test_a_split_that_does_not_fall_on_whole_heads_is_refused_at_start():
    completed = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--tensor-parallel", "2",
                                "--redis-url", "redis://127.0.0.1:1"], capture_output=True, text=True, timeout=120,
                               stdin=subprocess.DEVNULL)
    assert completed.returncode != 0
    assert "tensor parallel size 2 does not divide 9 attention heads, 3 KV heads" in completed.stderr


def kill_a_rank_while_it_runs(cluster: Cluster, group, prompts: list[str], max_tokens: int, expected: dict | None,
                              model: str = MODEL, rank: int = -1) -> list[str]:
    """Requests running on the group, one of the group's ranks is SIGKILLed (the last, or with
    rank=0 the group's worker itself): the group is gone, and its requests, waiting meanwhile,
    finish on a single-process worker started then, token-exact (against `expected`, or, when None,
    against the same requests run on that worker alone afterwards)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        submitted_at = time.time()
        futures = [pool.submit(complete, cluster.base_url, prompt, max_tokens, model) for prompt in prompts]
        deadline = time.monotonic() + 60
        while not any(w["running"] == len(prompts) for w in status(cluster)["workers"]):
            assert time.monotonic() < deadline, "the group never ran the requests"
            time.sleep(0.05)
        # ... and decode: requests killed before their first token are rebuilt with no output to keep.
        while not any(record.worker_id == group.worker_id and record.decode_tokens > 0
                      and record.started_at > submitted_at for record in iteration_records(cluster)):
            assert time.monotonic() < deadline, "the group never decoded"
            time.sleep(0.05)
        others = ranks_of(psutil.Process(group.process.pid))
        if rank == 0:  # the others die with it (PR_SET_PDEATHSIG)
            group.process.kill()
            assert group.process.wait(timeout=30) == -9
            gone, alive = psutil.wait_procs(others, timeout=30)
            assert not alive, f"ranks outlived the group's worker: {alive}"
        else:
            others[rank].kill()
            assert group.process.wait(timeout=30) == 3, "the group's worker did not stop with its rank"
            assert "event=group_rank_died" in cluster.log(group.name)
        single = cluster.start_worker()
        answers = [future.result(timeout=240) for future in futures]
    moved = [line for _, line in cluster.log_events("scheduler", "admitted request_id=")
             if f"worker_id={single.worker_id}" in line and "output_tokens=0" not in line]
    assert moved, "no request was rebuilt on the other worker after the rank died"
    if expected is None:  # the single-process worker alone now: each request on it, one at a time
        expected = {prompt: complete(cluster.base_url, prompt, max_tokens, model)["choices"][0]["text"]
                    for prompt in prompts}
    assert [answer["choices"][0]["text"] for answer in answers] == [expected[prompt] for prompt in prompts]
    return [expected[prompt] for prompt in prompts]


async def cancel_half(cluster: Cluster, prompts: list[str], max_tokens: int, model: str = MODEL) -> dict[str, Output]:
    """Every prompt streamed; every other one cancelled by DELETE once it has a few tokens."""
    outputs = {prompt: Output() for prompt in prompts}
    async with session() as http:
        clients = [asyncio.create_task(stream_request(http, cluster, Spec(f"r{index}", prompt, max_tokens, seed=index,
                                                                          ignore_eos=True, model=model),
                                                      outputs[prompt]))
                   for index, prompt in enumerate(prompts)]
        for prompt in prompts[::2]:
            await until(lambda: len(outputs[prompt].pieces) >= 3, "a request's first tokens", 120)
            async with http.delete(f"{cluster.base_url}/v1/requests/{outputs[prompt].request_id}") as response:
                assert response.status == 200
        await asyncio.wait_for(asyncio.gather(*clients), 240)
        await until_kv_all_free(cluster, timeout=30)
    return outputs


def check_stages_overlapped(cluster: Cluster) -> None:
    """Two stages ran two plans at once (Orca's figure 8): the group's plans, each timed by the
    worker from its first stage's start to its tokens' return, add up to more than the time they
    spanned (one after the other, they could not), and plans in flight together shared no request."""
    records = [record for record in iteration_records(cluster) if record.request_ids]
    busy = sum(record.step_seconds for record in records)
    spanned = max(record.finished_at for record in records) - min(record.started_at for record in records)
    assert busy > 1.2 * spanned, (busy, spanned)
    plans = sorted(records, key=lambda record: record.plan_id)
    for earlier, later in zip(plans, plans[1:]):
        if later.started_at < earlier.finished_at:
            assert not set(earlier.request_ids) & set(later.request_ids), (earlier, later)


def test_a_pipeline_parallel_group_answers_as_one_engine_through_cancellations_and_a_rank_dying(engine_alone,
                                                                                                tokenizer):
    prompts = PROMPTS + ["The capital of France is", "A recipe for pancakes:\n1."]
    with contextlib.closing(Cluster(workers=0)) as cluster:
        group, worker = start_group_alone(cluster, 2, ITERSERVE_PIPELINE_PARALLEL="2")
        assert worker["device"] == "cpu x2 (pipeline parallel 2)" and worker["kv_blocks_total"] == 256

        # Half the requests cancelled mid-run: the others answer exactly, every KV block comes back.
        outputs = asyncio.run(cancel_half(cluster, prompts, 48))
        for index, prompt in enumerate(prompts):
            if index % 2:
                assert outputs[prompt].finish_reason == "length"
                assert outputs[prompt].text == expected_text(engine_alone, tokenizer, prompt, 48)
            else:
                assert outputs[prompt].finish_reason == "cancelled" and len(outputs[prompt].pieces) < 48
        check_stages_overlapped(cluster)

        expected = {prompt: expected_text(engine_alone, tokenizer, prompt, 50) for prompt in PROMPTS}
        kill_a_rank_while_it_runs(cluster, group, PROMPTS, 50, expected)


def test_a_pipeline_parallel_group_goes_on_exactly_under_a_new_scheduler(engine_alone, tokenizer):
    """The scheduler SIGKILLed while the group runs two plans at once, a new one started: its new
    epoch makes the group drop everything (plans still in its stages included) and rebuild every
    request from its tokens; each answers what the single-process engine answers."""
    with contextlib.closing(Cluster(workers=0)) as cluster:
        start_group_alone(cluster, 2, ITERSERVE_PIPELINE_PARALLEL="2")
        outputs = {prompt: Output() for prompt in PROMPTS}

        async def run() -> None:
            async with session() as http:
                clients = [asyncio.create_task(stream_request(http, cluster, Spec(f"r{index}", prompt, 40, seed=index,
                                                                                  ignore_eos=True), outputs[prompt]))
                           for index, prompt in enumerate(PROMPTS)]
                await until(lambda: all(len(output.pieces) >= 6 for output in outputs.values()), "tokens", 120)
                cluster.kill("scheduler")
                await asyncio.sleep(0.5)
                cluster.start("scheduler")
                await asyncio.wait_for(asyncio.gather(*clients), 240)
                await until_kv_all_free(cluster, timeout=30)

        asyncio.run(run())
        assert cluster.log_events("worker-1", "event=new_scheduler_epoch"), "the group never saw the new scheduler"
    for prompt in PROMPTS:
        assert outputs[prompt].finish_reason == "length"
        assert outputs[prompt].text == expected_text(engine_alone, tokenizer, prompt, 40)


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_a_tensor_parallel_group_answers_as_transformers_through_cancellations_and_a_rank_dying(tmp_path, tensor,
                                                                                                pipeline):
    """Two ranks, or four (two stages of two), on a tiny Llama with 4 heads and 2 layers (one per
    stage): chats as transformers answers them; then half of a batch cancelled, and a rank killed
    mid-run, the other requests answering as one process does."""
    import_or_skip("transformers")
    from shared.tokenizer import Tokenizer

    model = transformers_model("llama")
    directory = save_checkpoint(model, tmp_path / "tiny-llama")
    tokenizer = Tokenizer.load(str(directory))
    conversations = [[{"role": "user", "content": text}] for text in ("Hello there", "Count: 1 2 3", "xyz")]
    with contextlib.closing(Cluster(workers=0, model=str(directory), served_model_name="tiny")) as cluster:
        group, worker = start_group_alone(cluster, tensor * pipeline, ITERSERVE_TENSOR_PARALLEL=str(tensor),
                                          ITERSERVE_PIPELINE_PARALLEL=str(pipeline))
        assert worker["device"] == ("cpu x2 (tensor parallel 2)" if pipeline == 1 else
                                    "cpu x4 (tensor parallel 2 x pipeline parallel 2)")

        def ask(messages: list[dict]) -> list[int]:
            answer = post(cluster.base_url, "/v1/chat/completions", {
                "model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "logprobs": True})
            return [bytes(entry["bytes"]) for entry in answer["choices"][0]["logprobs"]["content"]]

        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            answers = list(pool.map(ask, conversations))

        prompts = ["abc", "Hello, world", "1 2 3 4", "the quick brown fox", "zzz", "Once upon a time"]
        outputs = asyncio.run(cancel_half(cluster, prompts, 200, model="tiny"))
        assert all(outputs[prompt].finish_reason == "cancelled" for prompt in prompts[::2])
        kept = prompts[1::2]
        alone = kill_a_rank_while_it_runs(cluster, group, kept, 200, None, model="tiny",
                                          rank=0 if pipeline == 1 else -1)  # the worker itself, or its last rank
        assert [outputs[prompt].text for prompt in kept] == alone  # the run with cancellations, too
    for messages, answer in zip(conversations, answers, strict=True):
        prompt = tokenizer.encode_chat(messages)
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert answer == [tokenizer.token_bytes(token_id) for token_id in ids]
