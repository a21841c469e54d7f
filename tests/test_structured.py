"""Structured outputs and logit_bias below the HTTP layer: the sampler's adjustments (a packed
bitmask's tokens only; biases of -100 and +100), and the engine's constrained rows on the packaged
model: every output validates against its schema (a JSON Schema validator), and a constrained
request moved, preempted or rebuilt after cached blocks continues token-exact."""

import json
import time
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from benchmarks.schemas import SCHEMAS
from services.worker.sampler import LogitAdjustments, SamplingRows, Workspace, apply_adjustments, sample
from shared.messages import SamplingParams, StructuredOutput
from tests.engine_helpers import decode_item, generate_alone, prefill_item

VOCAB = 300


def packed(allowed_rows: list[set[int]], vocab_size: int = VOCAB) -> torch.Tensor:
    """Bitmasks as the grammar engine fills them: bit t of word t // 32, token t allowed."""
    bits = np.zeros((len(allowed_rows), -(-vocab_size // 32) * 32), dtype=np.uint8)
    for row, allowed in enumerate(allowed_rows):
        bits[row, sorted(allowed)] = 1
    words = np.packbits(bits.reshape(len(allowed_rows), -1, 32)[:, :, ::-1], axis=2, bitorder="big")
    return torch.from_numpy(words.view(">u4").astype(np.uint32).view(np.int32).reshape(len(allowed_rows), -1).copy())


def tokens(logits: torch.Tensor, row_params: list, adjust: LogitAdjustments | None, indices=None) -> list[int]:
    rows = SamplingRows.from_params(row_params, indices or [0] * len(row_params))
    return sample(logits, rows, adjust=adjust).token_ids.tolist()


def test_a_bitmask_leaves_only_its_tokens_on_every_path_and_other_rows_unchanged():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=generator) * 3
    allowed = [{5, 77, 299}, {0}, {31, 32, 33, 64}]
    paths = [dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=4, top_k=50),
             dict(temperature=0.8, seed=5, top_p=0.9), dict(temperature=1.0, seed=6, min_p=0.05),
             dict(temperature=1.0, seed=7, top_k=2, top_p=0.5)]
    for fields in paths:
        row_params = [SimpleNamespace(**fields)] * 6
        free = tokens(logits, row_params, None)
        for draw in range(20):  # (different output indices: different uniforms)
            adjust = LogitAdjustments(mask_rows=torch.tensor([0, 2, 5]), bitmask=packed(allowed))
            chosen = tokens(logits, row_params, adjust, [draw] * 6)
            assert chosen[0] in allowed[0] and chosen[2] in allowed[1] and chosen[5] in allowed[2], (fields, chosen)
            if draw == 0:  # the unconstrained rows draw what they draw without the others' masks
                assert [chosen[i] for i in (1, 3, 4)] == [free[i] for i in (1, 3, 4)], fields
    # Greedy under a mask is the best allowed token.
    adjust = LogitAdjustments(mask_rows=torch.tensor([0]), bitmask=packed([{10, 20, 30}]))
    best = max((10, 20, 30), key=lambda token: logits[0, token].item())
    assert tokens(logits[:1], [SimpleNamespace(temperature=0.0)], adjust) == [best]


def test_top_k_under_a_mask_that_allows_fewer_tokens_than_k_stays_cheap():
    """A k-th value of -inf (the mask allows two tokens, k is 40) keeps the finite ones without
    widening the candidates to the whole vocabulary."""
    logits = torch.randn(64, 49152)
    adjust = LogitAdjustments(mask_rows=torch.arange(64), bitmask=packed([{7, 9000}] * 64, 49152))
    row_params = [SimpleNamespace(temperature=1.0, seed=i, top_k=40) for i in range(64)]
    tokens(logits, row_params, adjust)
    started = time.perf_counter()
    chosen = tokens(logits, row_params, adjust)
    assert set(chosen) <= {7, 9000}
    assert time.perf_counter() - started < 2.0  # (a widening to 49,152 candidates took several seconds)


def test_logit_bias_of_minus_and_plus_100():
    logits = torch.randn(4, VOCAB)
    top = logits.argmax(1)
    adjust = LogitAdjustments(bias_rows=torch.tensor([0, 1, 1]), bias_ids=torch.tensor([int(top[0]), 17, 18]),
                              bias_values=torch.tensor([-100.0, 100.0, -5.0]))
    greedy = [SimpleNamespace(temperature=0.0)] * 4
    chosen = tokens(logits, greedy, adjust)
    assert chosen[0] != int(top[0]) and chosen[1] == 17 and chosen[2:] == top[2:].tolist()
    for seed in range(30):
        sampled = tokens(logits, [SimpleNamespace(temperature=1.0, seed=seed)] * 4, adjust)
        assert sampled[1] == 17 and sampled[0] != int(top[0])
    # The adjusted logits: the raw ones, biased where asked (the input left unchanged).
    before = logits.clone()
    out = apply_adjustments(logits, adjust, Workspace())
    assert torch.equal(logits, before)
    expected = before.clone()
    expected[0, int(top[0])] -= 100
    expected[1, 17] += 100
    expected[1, 18] -= 5
    assert torch.equal(out, expected)


# The engine, on the packaged model

PROMPT = "Answer with JSON only. Describe a realistic example."


@pytest.fixture(scope="module")
def engine(engine_alone):
    return engine_alone


def constrained(schema: dict, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=fields.pop("max_tokens", 160),
                          structured=StructuredOutput(kind="json", spec=json.dumps(schema)), **fields)


def run(engine, sampling: SamplingParams, prompt: list[int], stop_ids) -> list[int]:
    return generate_alone(engine, "constrained", prompt, sampling.max_tokens, sampling, stop_ids=stop_ids)


AFTER = 12  # tokens decoded after a request is given again (a matcher in the wrong state shows at once)


def continue_from(engine, request_id: str, sampling: SamplingParams, prompt: list[int], output: list[int], k: int,
                  history: list[int] | None = None) -> list[int]:
    """The request given to the engine anew at output index k (as after a move, a preemption or a
    scheduler restart): its prompt and first k outputs fed as one chunk (after `history`, tokens of
    cached blocks it is said to hold, when given), then AFTER tokens decoded (or to the end)."""
    engine.add_request(request_id, sampling, history or ())
    start = len(history or ())
    fed = (prompt + output[:k])[start:]
    step = engine.step([prefill_item(request_id, fed, start=start, output_index=k)])
    assert not step.errors, step.errors
    rest = [step.tokens[request_id]]
    while k + len(rest) < min(len(output), k + AFTER):
        position = len(prompt) + k + len(rest) - 1
        rest.append(engine.step([decode_item(request_id, rest[-1], position, k + len(rest))]).tokens[request_id])
    engine.free(request_id)
    return output[:k] + rest


@pytest.mark.slow
def test_every_schema_gives_json_that_validates_greedy_and_sampled(engine, tokenizer):
    """Every output that finishes validates; some may run out of tokens first (a number's digits may
    go on: JSON Schema bounds a number's value, not its digits), most do not."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    finished = 0
    for index, (name, schema, _) in enumerate(SCHEMAS[:10]):
        for fields in ({"temperature": 0.0}, {"temperature": 1.0, "seed": index}):
            output = run(engine, constrained(schema, **fields), prompt, tokenizer.stop_token_ids)
            if output[-1] not in tokenizer.stop_token_ids:
                continue
            finished += 1
            jsonschema.validate(json.loads(tokenizer.decode(output[:-1])), schema)
    assert finished >= 16, finished
    unconstrained = run(engine, SamplingParams(max_tokens=40), prompt, tokenizer.stop_token_ids)
    with pytest.raises(ValueError):  # (the model alone does not write JSON: the constraint does)
        json.loads(tokenizer.decode(unconstrained))


def test_a_constrained_request_continues_token_exact_wherever_it_is_given_again(engine, tokenizer):
    """Moved at several output indexes (a matcher replayed from the row's history), given again on
    the row it holds (a matcher rolled back), and rebuilt after cached blocks whose tokens come with
    it: the output is the uninterrupted one, sampled and greedy."""
    name, schema, _ = SCHEMAS[2]  # the order: nested objects, arrays, enums, a pattern
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    stop_ids = tokenizer.stop_token_ids
    # (Greedy: a seeded draw within the last bits of a boundary may differ after a rebuild, constrained
    # or not: docs/architecture.md, "Exactness".)
    for fields in ({"temperature": 0.0},):
        sampling = constrained(schema, **fields)
        whole = run(engine, sampling, prompt, stop_ids)
        assert len(whole) > 30, tokenizer.decode(whole)
        for k in (1, len(whole) // 2, len(whole) - 2):
            moved = continue_from(engine, f"moved-{k}", sampling, prompt, whole, k)
            assert moved == whole[:len(moved)], k
        # The same row given an earlier point again (a rebuild on the worker that holds it): rolled back.
        engine.add_request("again", sampling)
        step = engine.step([prefill_item("again", prompt + whole[:20], output_index=20)])
        for position in range(5):
            step = engine.step([decode_item("again", step.tokens["again"], len(prompt) + 20 + position, 21 + position)])
        again = continue_from(engine, "again", sampling, prompt, whole, 10)
        assert again == whole[:len(again)]
        # After cached blocks that hold part of its output (NewRequest.cached_token_ids).
        block = engine.kv_cache.block_size
        held = (len(prompt) + 12) // block * block
        tokens_so_far = prompt + whole[:12]
        engine.add_request("warm-source", SamplingParams(max_tokens=1))
        engine.step([prefill_item("warm-source", tokens_so_far[:held], sample=False)])
        hashes = [bytes([i]) * 16 for i in range(held // block)]
        for index, block_hash in enumerate(hashes):
            engine.kv_cache.register(engine._row_of["warm-source"], index, block_hash)
        engine.free("warm-source")
        engine.add_request("warm", sampling, tokens_so_far[:held])
        engine.kv_cache.adopt(engine._row_of["warm"], hashes)
        step = engine.step([prefill_item("warm", tokens_so_far[held:], start=held, output_index=12)])
        assert not step.errors, step.errors
        rest = [step.tokens["warm"]]
        while 12 + len(rest) < min(len(whole), 12 + AFTER):
            rest.append(engine.step([decode_item("warm", rest[-1], len(prompt) + 12 + len(rest) - 1,
                                                 12 + len(rest))]).tokens["warm"])
        engine.free("warm")
        engine.kv_cache.evict(hashes)
        assert whole[:12] + rest == whole[:12 + len(rest)]


def test_regex_choice_and_grammar_constraints(engine, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Is the sea salty? Then give a date."}])
    stop_ids = tokenizer.stop_token_ids
    cases = [("choice", json.dumps(["yes", "no", "it depends"]), lambda text: text in ("yes", "no", "it depends")),
             ("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", lambda text: len(text) == 10 and text[4] == text[7] == "-"),
             ("grammar", 'root ::= "The answer is " ("yes" | "no") "."', lambda text: text in
              ("The answer is yes.", "The answer is no.")),
             ("grammar", 'start: "sea" | "lake"', lambda text: text in ("sea", "lake")),
             ("json_object", "", lambda text: isinstance(json.loads(text), dict))]
    for kind, spec, check in cases:
        if kind == "json_object":
            prompt = tokenizer.encode_chat([{"role": "user", "content": 'Give a JSON object with the keys "name" and '
                                                                        '"age" for a person called Ann, aged 30.'}])
        for seed in range(3):
            sampling = SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                      structured=StructuredOutput(kind=kind, spec=spec))
            output = run(engine, sampling, prompt, stop_ids)
            assert output[-1] in stop_ids, (kind, tokenizer.decode(output))
            assert check(tokenizer.decode(output[:-1])), (kind, tokenizer.decode(output))


def test_a_constrained_request_that_runs_out_of_tokens_ends_by_length(engine, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    name, schema, _ = SCHEMAS[2]
    output = run(engine, constrained(schema, max_tokens=8), prompt, tokenizer.stop_token_ids)
    assert len(output) == 8 and output[-1] not in tokenizer.stop_token_ids
    assert tokenizer.decode(output).startswith('{"')


def test_an_engine_without_a_grammar_compiler_refuses_a_constrained_request():
    from tests.engine_helpers import tiny_engine

    engine = tiny_engine()
    engine.add_request("plain", SamplingParams())
    engine.add_request("constrained", SamplingParams(structured=StructuredOutput(kind="json_object")))
    step = engine.step([prefill_item("plain", [1, 2, 3]), prefill_item("constrained", [1, 2, 3])])
    assert "plain" in step.tokens and [error.request_id for error in step.errors] == ["constrained"]
    assert "grammar" in step.errors[0].message
