"""Two models in one deployment: `iterserve up --model A --model B`, a scheduler and two workers
per model, one gateway. Each request is answered by the model it names, exactly as that model
alone answers it; a killed worker's requests finish on the other worker of the same model."""

import concurrent.futures
import json
import os
import signal
import time
import urllib.request

import msgpack
import openai
import pytest
import redis
import torch

from shared.keys import ModelKeys
from shared.messages import IterationRecord
from shared.tokenizer import Tokenizer
from tests.checkpoints import save_checkpoint, transformers_model
from tests.engine_helpers import generate_alone, smollm2_engine_alone
from tests.requirements import import_or_skip
from tests.system import System

pytestmark = pytest.mark.slow
SMOLLM2, QWEN = "smollm2", "tiny-qwen2"
LONG_OUTPUT = 180  # tiny-qwen2 tokens: long enough to be mid-way when its worker is killed


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import_or_skip("transformers")
    model = transformers_model("qwen2")
    directory = save_checkpoint(model, tmp_path_factory.mktemp("tiny-qwen2"))
    return model, directory, Tokenizer.load(str(directory))


@pytest.fixture(scope="module")
def system(qwen):
    _, directory, _ = qwen
    with System("--model", "smollm2-135m-instruct", "--model", str(directory), "--served-model-name", SMOLLM2,
                "--served-model-name", QWEN, workers=2, kv_blocks=128) as running:
        deadline = time.monotonic() + 120  # healthy is one worker per model: wait for all four
        while len(get_status(running)["workers"]) < 4:
            assert time.monotonic() < deadline, "four workers never came up"
            time.sleep(0.25)
        yield running


@pytest.fixture(scope="module")
def client(system):
    return openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", timeout=180, max_retries=0)


@pytest.fixture(scope="module")
def smollm2_alone():
    return smollm2_engine_alone(), Tokenizer.load()


def qwen_greedy_bytes(qwen, messages, max_tokens: int, stop: bool = True) -> list[bytes]:
    model, _, tokenizer = qwen
    prompt = tokenizer.encode_chat(messages)
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=sorted(tokenizer.stop_token_ids) if stop else None)[0, len(prompt):].tolist()
    if stop and ids[-1] in tokenizer.stop_token_ids:
        ids = ids[:-1]
    return [tokenizer.token_bytes(token_id) for token_id in ids]


def ask_qwen(client, messages, max_tokens: int, **extra) -> list[bytes]:
    response = client.chat.completions.create(model=QWEN, messages=messages, max_tokens=max_tokens, temperature=0,
                                              logprobs=True, **extra)
    return [bytes(entry.bytes) for entry in response.choices[0].logprobs.content]


def get_status(system) -> dict:
    with urllib.request.urlopen(f"{system.base_url}/status", timeout=10) as response:
        return json.load(response)


def iteration_requests(system, model: str) -> set[str]:
    """Every request id one model's scheduler put in a batch (its iteration records)."""
    client = redis.Redis.from_url(system.redis_url)
    try:
        entries = client.xrange(ModelKeys(model).iterations)
    finally:
        client.close()
    return {request_id for _, fields in entries
            for request_id in IterationRecord.model_validate(msgpack.unpackb(fields[b"m"])).request_ids}


def test_the_gateway_lists_both_models_and_each_worker_announces_its_own(client, system):
    listed = {entry.id: entry.model_extra["max_model_len"] for entry in client.models.list().data}
    assert listed == {SMOLLM2: 8192, QWEN: 256}
    status = get_status(system)
    by_model = {}
    for worker in status["workers"]:
        by_model.setdefault(worker["model"], []).append(worker)
    assert sorted(by_model) == [SMOLLM2, QWEN] and all(len(workers) == 2 for workers in by_model.values())
    for workers in by_model.values():  # the same weights within a model, different across
        assert len({worker["weights_sha256"] for worker in workers}) == 1
        assert all(worker["kv_bytes_per_token"] > 0 for worker in workers)
    assert by_model[QWEN][0]["weights_sha256"] != by_model[SMOLLM2][0]["weights_sha256"]
    assert sorted(status["models"]) == [SMOLLM2, QWEN]
    with pytest.raises(openai.NotFoundError, match="smollm2"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_concurrent_requests_for_both_models_are_each_answered_by_their_own_model_as_alone(
        client, system, qwen, smollm2_alone):
    engine, tokenizer = smollm2_alone
    conversations = [[{"role": "user", "content": text}] for text in
                     ("Name three colours.", "What is 2 + 2?", "Écris une phrase sur la mer.")]

    def ask_smollm2(messages) -> tuple[str, str]:
        response = client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=16, temperature=0)
        return response.choices[0].message.content, response.id

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        smollm2_answers = list(pool.map(ask_smollm2, conversations))
        qwen_answers = list(pool.map(lambda messages: ask_qwen(client, messages, 24), conversations))
    for messages, (text, _) in zip(conversations, smollm2_answers, strict=True):
        expected = generate_alone(engine, "alone", tokenizer.encode_chat(messages), 16,
                                  stop_ids=tokenizer.stop_token_ids)
        assert text == tokenizer.decode(expected)
    for messages, answer in zip(conversations, qwen_answers, strict=True):
        assert answer == qwen_greedy_bytes(qwen, messages, 24)
    smollm2_ids = {request_id for _, request_id in smollm2_answers}
    assert smollm2_ids <= iteration_requests(system, SMOLLM2)
    assert not smollm2_ids & iteration_requests(system, QWEN)


def test_a_killed_worker_requests_finish_on_the_other_worker_of_the_same_model_token_exact(client, system, qwen):
    def workers_of(model: str) -> list[dict]:
        return [worker for worker in get_status(system)["workers"] if worker["model"] == model]

    # The victim is the worker of the first batch the scheduler records for these requests: watched
    # in its iteration records, not in /status, whose counts are a heartbeat's (every 0.5 s) and six
    # tiny-qwen2 requests of 180 tokens take under a second on a quiet machine.
    records = redis.Redis.from_url(system.redis_url)
    iterations = ModelKeys(QWEN).iterations
    try:
        before = records.xrevrange(iterations, count=1)
        since = before[0][0] if before else b"0-0"
        pids = {worker["id"]: worker["pid"] for worker in workers_of(QWEN)}
        conversations = [[{"role": "user", "content": f"Tell me a long story number {index}."}] for index in range(6)]
        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            futures = [pool.submit(ask_qwen, client, messages, LONG_OUTPUT, extra_body={"ignore_eos": True})
                       for messages in conversations]
            victim, cursor, deadline = None, since, time.monotonic() + 60
            while victim is None and time.monotonic() < deadline:
                for _, entries in records.xread({iterations: cursor}, count=16, block=250) or ():
                    for entry_id, fields in entries:
                        cursor = entry_id
                        record = IterationRecord.model_validate(msgpack.unpackb(fields[b"m"]))
                        victim = victim or (record.worker_id if record.request_ids else None)
                if victim is None and all(future.done() for future in futures):
                    pytest.fail(f"the requests ended with no batch recorded: {[f.exception() for f in futures]}")
            assert victim is not None, "no tiny-qwen2 worker ever ran a request"
            smollm2_before = {worker["id"] for worker in workers_of(SMOLLM2)}
            os.kill(pids[victim], signal.SIGKILL)
            answers = [future.result(timeout=180) for future in futures]
        batches_by_worker = {}  # this test's batches: only its requests ran on tiny-qwen2 meanwhile
        for _, fields in records.xrange(iterations, min=f"({since.decode()}"):
            record = IterationRecord.model_validate(msgpack.unpackb(fields[b"m"]))
            if record.request_ids:
                batches_by_worker.setdefault(record.worker_id, set()).update(record.request_ids)
    finally:
        records.close()
    for messages, answer in zip(conversations, answers, strict=True):
        assert answer == qwen_greedy_bytes(qwen, messages, LONG_OUTPUT, stop=False)
    # The kill came mid-way: requests the victim ran were finished by another worker.
    assert victim in batches_by_worker and len(batches_by_worker) > 1, batches_by_worker.keys()
    moved = set.union(*(ids for worker, ids in batches_by_worker.items() if worker != victim))
    assert batches_by_worker[victim] & moved
    assert {worker["id"] for worker in workers_of(SMOLLM2)} == smollm2_before  # the other model untouched
    qwen_records = iteration_requests(system, QWEN)
    assert not qwen_records & iteration_requests(system, SMOLLM2)
