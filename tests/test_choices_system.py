"""n > 1 through the whole system with the official openai client: each choice is the same request
with n = 1 and the seed seed + i (the engine's tokens alone), the prompt is prefilled once (choices
1.. find its blocks cached), streamed chunks carry each choice's index, usage counts every choice,
a constrained request's choices all validate, and a client that leaves cancels every choice."""

import json
import re
import urllib.request

import jsonschema
import openai
import pytest

from shared.messages import SamplingParams
from tests.cluster import Cluster
from tests.engine_helpers import generate_alone
from tests.test_prefix_cache_system import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m-instruct"
PROMPT = ("The village library kept three shelves of atlases, two of old maps and one of travel diaries. "
          "Every winter the librarian read them aloud to whoever came in from the cold, and the children "
          "listened by the stove. One winter evening the librarian opened the oldest diary and read")


def test_n_choices_are_the_seeded_requests_alone_prefilled_once_streamed_and_cancelled(engine_alone, tokenizer):
    with Cluster(workers=2) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
        answer = client.completions.create(model=MODEL, prompt=PROMPT, n=4, seed=11, temperature=0.9, max_tokens=16,
                                           extra_body={"ignore_eos": True})
        assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
        assert answer.usage.completion_tokens == 64
        prompt_ids = tokenizer.encode_prompt(PROMPT)
        for index, choice in enumerate(answer.choices):
            alone = generate_alone(engine_alone, "oracle", prompt_ids, 16,
                                   SamplingParams(max_tokens=16, temperature=0.9, seed=11 + index, ignore_eos=True))
            assert choice.text == tokenizer.decode(alone), index
        assert len({choice.text for choice in answer.choices}) > 1, "the choices drew from one stream"
        # Prefilled once: the other choices found the prompt's full blocks cached
        placed = {}
        for _, line in cluster.log_events("scheduler", "admitted request_id="):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            placed[fields["request_id"]] = int(fields["cached_tokens"])
        full = (len(prompt_ids) - 1) // 16 * 16  # (its last token is computed: it samples from it)
        assert all(placed[f"{answer.id}.{index}"] >= full > 0 for index in (1, 2, 3)), placed

        # Chat, streamed: each choice's chunks carry its index and join to the whole answer
        messages = [{"role": "user", "content": "Name a colour."}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=5, max_tokens=12)
        joined = {0: "", 1: "", 2: ""}
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=5, max_tokens=12,
                                                    stream=True):
            for choice in chunk.choices:
                joined[choice.index] += choice.delta.content or ""
        assert joined == {choice.index: choice.message.content for choice in whole.choices}

        # Constrained: every choice validates
        schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
                  "required": ["colour"], "additionalProperties": False}
        constrained = client.chat.completions.create(
            model=MODEL, messages=messages, n=3, seed=2, max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}})
        for choice in constrained.choices:
            jsonschema.validate(json.loads(choice.message.content), schema)

        # A client that leaves cancels every choice
        body = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(f"{cluster.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            request_id = response.headers["X-Request-Id"]
            seen: set[int] = set()
            while len(seen) < 3:  # every choice under way
                line = response.readline()
                if line.startswith(b"data: {"):
                    seen.update(choice["index"] for choice in json.loads(line[6:])["choices"])
        for choice_id in (request_id, f"{request_id}.1", f"{request_id}.2"):
            wait_for(lambda: cluster.get_json(f"/v1/requests/{choice_id}")[1].get("status") == "cancelled",
                     f"{choice_id} cancelled")
