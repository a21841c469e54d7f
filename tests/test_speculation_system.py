"""Speculative decoding through the whole system (`iterserve up --speculative-config`, real processes,
Redis and the packaged model): greedy outputs equal the engine alone decoding one token a step, for a
request that copies its prompt (most proposals kept) and one that does not, alone and four at once,
streamed (the worker writes the token entries of the tokens it keeps) and not; /metrics counts the
proposals under vLLM's names; a bad config is refused at start with a clear message."""

import concurrent.futures
import json
import re
import subprocess
import sys
import urllib.request

import pytest

from tests.system import REPO, System

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
MODEL = "smollm2-135m-instruct"
CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
PASSAGE = ("The harbor town woke slowly on winter mornings. Before the sun cleared the hills, the fishing boats "
           "were already back at the pier, their decks crowded with crates of silver mackerel.")
MESSAGES = [[{"role": "user", "content": f"Copy this text exactly:\n\n{PASSAGE}"}],
            [{"role": "user", "content": "Name three colours of the rainbow."}],
            [{"role": "user", "content": "Rewrite in the past tense: The cat sits on the mat and watches the birds."}],
            [{"role": "user", "content": "Write a haiku about snow."}]]
MAX_TOKENS = 48


def post(url: str, body: dict, stream: bool = False) -> tuple[str, str]:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps({**body, "stream": stream}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        if not stream:
            choice = json.loads(response.read())["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]
        pieces, reason = [], None
        for line in response:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
                    reason = choice.get("finish_reason") or reason
        return "".join(pieces), reason


def metric(text: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


def test_speculating_system_gives_the_engine_alones_greedy_outputs_alone_and_batched(engine_alone, tokenizer):
    from tests.engine_helpers import generate_alone

    expected = []
    for messages in MESSAGES:
        output = generate_alone(engine_alone, "oracle", tokenizer.encode_chat(messages), MAX_TOKENS,
                                stop_ids=tokenizer.stop_token_ids)
        expected.append((tokenizer.decode(output), "stop" if output[-1] in tokenizer.stop_token_ids else "length"))
    with System("--speculative-config", CONFIG, workers=1) as system:
        bodies = [{"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
                  for messages in MESSAGES]
        assert post(system.url, bodies[0]) == expected[0]  # alone
        assert post(system.url, bodies[0], stream=True) == expected[0]
        with urllib.request.urlopen(f"{system.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        drafts = metric(metrics, "vllm:spec_decode_num_drafts_total")
        proposed = metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
        kept = metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < kept <= proposed
        assert kept >= MAX_TOKENS // 2, f"copying its prompt, only {kept} of {proposed} proposals were kept"
        for stream in (False, True):  # four at once
            with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
                answers = list(pool.map(lambda body: post(system.url, body, stream), bodies))
            assert answers == expected


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'"),
    ('{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}', "draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": 40}', "num_speculative_tokens"),
    ('{"method": "ngram"', "not JSON"),
])
def test_a_bad_speculative_config_is_refused_at_start(config, message):
    finished = subprocess.run([sys.executable, "-m", "services.cli", "up", "--speculative-config", config],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    assert message in finished.stderr, finished.stderr[-2000:]
