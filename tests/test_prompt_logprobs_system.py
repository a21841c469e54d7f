"""The prompt's log-probabilities through the whole system (vLLM's prompt_logprobs; the completions'
echo with logprobs), against transformers on the same weights: every prompt token's log-probability,
rank and most likely tokens, over a prompt prefilled in several chunks, again when its blocks are in
the prefix cache (they are computed, not adopted), on chat, with n > 1, and echoed (whole and
streamed, the prompt's tokens first in the logprobs lists)."""

import functools
import json
import re
import urllib.request

import pytest
import torch

from tests.cluster import Cluster
from tests.test_engine import transformers_model_for_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m-instruct"
PROMPT = ("The village library kept three shelves of atlases, two of old maps and one of travel diaries. "
          "Every winter the librarian read them aloud to whoever came in from the cold")
TOLERANCE = 2e-3  # float32 log-probabilities, other matmul shapes than transformers'


def post(cluster: Cluster, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{cluster.base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def post_stream(cluster: Cluster, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(f"{cluster.base_url}{path}", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


@functools.cache
def transformers_model():
    return transformers_model_for_gguf()


def oracle(prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at every prompt position ([P, V]: row p gives token p + 1's)."""
    model = transformers_model()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=1)


def assert_matches_oracle(prompt_logprobs: list, prompt_ids: list[int], expected: torch.Tensor, top: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position in range(1, len(prompt_ids)):
        entries = {int(token_id): value for token_id, value in prompt_logprobs[position].items()}
        row, token_id = expected[position - 1], prompt_ids[position]
        assert abs(entries[token_id]["logprob"] - float(row[token_id])) < TOLERANCE, position
        # (a rank counts tokens above it: one within the tolerance of it may land either side)
        assert abs(entries[token_id]["rank"] - (int((row > row[token_id]).sum()) + 1)) <= \
            int(((row - row[token_id]).abs() < TOLERANCE).sum()), position
        if top:  # the `top` most likely, ranked 1.., each as likely as transformers' token of that rank
            values = row.topk(top).values.tolist()
            ranked = sorted((entry["rank"], token) for token, entry in entries.items() if entry["rank"] <= top)
            assert [rank for rank, _ in ranked] == list(range(1, top + 1)), position
            for (rank, token), value in zip(ranked, values):
                assert abs(entries[token]["logprob"] - value) < TOLERANCE, (position, rank)
                assert abs(float(row[token]) - value) < TOLERANCE, (position, rank)

def test_prompt_logprobs_equal_transformers_chunked_cached_chat_choices_and_echoed(tokenizer):
    prompt_ids = tokenizer.encode_prompt(PROMPT)
    expected = oracle(prompt_ids)
    # Chunks of 16 tokens: the prompt's positions come from several steps (and the last of each
    # chunk waits for the next chunk's first token).
    with Cluster(workers=1, max_batch_tokens=16) as cluster:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 3}
        first = post(cluster, "/v1/completions", body)
        assert_matches_oracle(first["choices"][0]["prompt_logprobs"], prompt_ids, expected, top=3)
        # Again: its prompt's blocks are cached, but the positions are computed, not adopted
        again = post(cluster, "/v1/completions", body)
        admitted = [dict(re.findall(r"(\w+)=(\S+)", line)) for _, line in
                    cluster.log_events("scheduler", "admitted request_id=")]
        assert [int(fields["cached_tokens"]) for fields in admitted if fields["request_id"] == again["id"]] == [0]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert_matches_oracle(again["choices"][0]["prompt_logprobs"], prompt_ids, expected, top=3)
        # A plain request with the same prompt adopts the cached blocks (the feature costs it nothing)
        plain = post(cluster, "/v1/completions", {**body, "prompt_logprobs": None})
        assert "prompt_logprobs" not in plain["choices"][0] and plain["choices"][0]["text"] == first["choices"][0]["text"]
        admitted = [dict(re.findall(r"(\w+)=(\S+)", line)) for _, line in
                    cluster.log_events("scheduler", "admitted request_id=")]
        assert [int(fields["cached_tokens"]) > 0 for fields in admitted if fields["request_id"] == plain["id"]] == [True]

        # n = 2: each choice shows the prompt's (choice 0 computes them)
        both = post(cluster, "/v1/completions", {**body, "n": 2, "temperature": 1.0, "seed": 3})
        for choice in both["choices"]:
            assert_matches_oracle(choice["prompt_logprobs"], prompt_ids, expected, top=3)

        # Chat: the answer's prompt_logprobs, over the chat template's tokens
        messages = [{"role": "user", "content": "Name three rivers of Europe."}]
        chat_ids = tokenizer.encode_chat(messages)
        chat = post(cluster, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3,
                                                       "prompt_logprobs": 0})
        assert_matches_oracle(chat["prompt_logprobs"], chat_ids, oracle(chat_ids), top=0)

        # Echo with logprobs: the prompt's tokens first (the first one's null), then the output's
        echo_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2}
        echoed = post(cluster, "/v1/completions", echo_body)["choices"][0]
        logprobs = echoed["logprobs"]
        assert echoed["text"].startswith(PROMPT + first["choices"][0]["text"])  # (4 of its 5 tokens)
        assert len(logprobs["tokens"]) == len(prompt_ids) + 5
        assert logprobs["tokens"][: len(prompt_ids)] == [tokenizer.token_text(token) for token in prompt_ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position in range(1, len(prompt_ids)):
            assert abs(logprobs["token_logprobs"][position] - float(expected[position - 1][prompt_ids[position]])) \
                < TOLERANCE
            assert len(logprobs["top_logprobs"][position]) <= 2
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[len(prompt_ids)] == len(PROMPT)
        # Streamed: the echo's chunk carries the prompt's logprobs; the chunks join to the whole answer
        chunks = post_stream(cluster, "/v1/completions", echo_body)
        assert chunks[0]["choices"][0]["text"] == PROMPT
        assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][: len(prompt_ids)]
        streamed_tokens = [token for chunk in chunks if chunk["choices"] and chunk["choices"][0]["logprobs"]
                           for token in chunk["choices"][0]["logprobs"]["tokens"]]
        assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == echoed["text"]
        assert streamed_tokens == logprobs["tokens"]
