"""Speculative decoding through the whole system (`iterserve up --speculative-config`, real processes,
Redis and the packaged model): greedy outputs equal the engine alone decoding one token a step, for a
request that copies its prompt (most proposals kept) and one that does not, alone and four at once,
streamed (the worker writes the token entries of the tokens it keeps) and not; /metrics counts the
proposals under vLLM's names; a bad config is refused at start with a clear message. The same with
a draft model (method draft_model): the target as its own draft, and a tiny random one."""

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


@pytest.fixture(scope="module")
def expected(engine_alone, tokenizer) -> list[tuple[str, str]]:
    """Each conversation's greedy text and finish reason, from the engine alone decoding one token a step."""
    from tests.engine_helpers import generate_alone

    answers = []
    for messages in MESSAGES:
        output = generate_alone(engine_alone, "oracle", tokenizer.encode_chat(messages), MAX_TOKENS,
                                stop_ids=tokenizer.stop_token_ids)
        answers.append((tokenizer.decode(output), "stop" if output[-1] in tokenizer.stop_token_ids else "length"))
    return answers


def served_alone_streamed_and_batched(system: System, expected: list[tuple[str, str]]) -> tuple[float, ...]:
    """Check the system's greedy answers (the first conversation alone, plain and streamed, then all
    four at once, plain and streamed) against `expected`; its (drafts, proposed, kept) counts after
    the first two, and the per-request histogram's (requests, sum of their shares kept) then."""
    bodies = [{"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
              for messages in MESSAGES]
    assert post(system.url, bodies[0]) == expected[0]  # alone
    assert post(system.url, bodies[0], stream=True) == expected[0]
    with urllib.request.urlopen(f"{system.url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    counts = tuple(metric(metrics, f"vllm:spec_decode_num_{name}_total")
                   for name in ("drafts", "draft_tokens", "accepted_tokens")) + tuple(
        metric(metrics, f"iterserve:spec_decode_request_acceptance_rate_{part}") for part in ("count", "sum"))
    for stream in (False, True):  # four at once
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda body: post(system.url, body, stream), bodies))
        assert answers == expected
    return counts


def test_speculating_system_gives_the_engine_alones_greedy_outputs_alone_and_batched(expected):
    with System("--speculative-config", CONFIG, workers=1) as system:
        drafts, proposed, kept, requests, shares = served_alone_streamed_and_batched(system, expected)
    assert drafts > 0 and 0 < kept <= proposed
    assert requests == 2 and 0 < shares <= 2  # (the two requests alone, each its share kept)
    assert kept >= MAX_TOKENS // 2, f"copying its prompt, only {kept} of {proposed} proposals were kept"


def test_a_draft_model_gives_the_engine_alones_greedy_outputs_alone_and_batched(expected, tmp_path):
    """method draft_model: the target as its own draft has (nearly) every greedy proposal kept,
    and a tiny random draft of the same vocabulary almost none; the tokens are the same either way."""
    from tests.checkpoints import draft_checkpoint

    own = json.dumps({"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3,
                      "disable_by_batch_size": 4})  # (speculating four at once too)
    with System("--speculative-config", own, workers=1) as system:
        drafts, proposed, kept, requests, shares = served_alone_streamed_and_batched(system, expected)
    assert drafts > 0 and kept >= 0.9 * proposed, (kept, proposed)
    assert requests == 2 and shares >= 1.8, (requests, shares)
    assert kept >= MAX_TOKENS, f"its own draft: only {kept} of {proposed} proposals were kept"
    random_draft = json.dumps({"model": str(draft_checkpoint(tmp_path / "draft")), "num_speculative_tokens": 3,
                               "disable_by_batch_size": 4})
    with System("--speculative-config", random_draft, workers=1) as system:
        drafts, proposed, kept, requests, shares = served_alone_streamed_and_batched(system, expected)
    assert drafts > 0 and kept <= 0.2 * proposed, (kept, proposed)
    assert requests == 2 and shares <= 0.4, (requests, shares)


def test_a_draft_model_that_cannot_propose_for_the_target_is_refused_at_start(tmp_path):
    """Another tokenizer; fewer embedding rows than the target samples; fewer positions than served."""
    from tests.checkpoints import draft_checkpoint, save_checkpoint, transformers_model

    cases = [(save_checkpoint(transformers_model("llama"), tmp_path / "byte-tokenizer"),
              "has another tokenizer than smollm2-135m-instruct"),
             (draft_checkpoint(tmp_path / "narrow", vocab_size=49000),
              "embeds 49000 token ids, fewer than the 49152 smollm2-135m-instruct may sample"),
             (draft_checkpoint(tmp_path / "short", max_position_embeddings=1024),
              "holds 1024 positions, fewer than the 8192 served")]
    for draft, message in cases:
        config = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
        finished = subprocess.run([sys.executable, "-m", "services.cli", "up", "--speculative-config", config],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)
        assert finished.returncode != 0
        assert message in finished.stderr, finished.stderr[-2000:]


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'"),
    ('{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}', "the draft model tiny: model file"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "method draft_model needs a model"),
    ('{"method": "ngram", "num_speculative_tokens": 40}', "num_speculative_tokens"),
    ('{"method": "ngram"', "not JSON"),
])
def test_a_bad_speculative_config_is_refused_at_start(config, message):
    finished = subprocess.run([sys.executable, "-m", "services.cli", "up", "--speculative-config", config],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    assert message in finished.stderr, finished.stderr[-2000:]
