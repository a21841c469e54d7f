"""Speculative decoding as the scheduler plans it (services/scheduler/speculation.py), end to end in
one process: the real policy plans, the plans and results go through the wire's bytes
(shared/plans.py), the worker's side reads them (PlanReader, StepAnswers) and a real engine (a tiny
seeded random model) runs them. Every request's tokens equal those of the same requests planned
without speculation, greedy and seeded, alone and in batches, with the plan pipeline (depth 2) and
without, across KV block boundaries and a preemption for KV room; proposals are made, some kept and
some refused, and past disable_by_batch_size none is made."""

import random
from collections import deque

import pytest

from services.scheduler.policy import SchedulerPolicy
from services.worker.plan_reader import PlanReader, StepAnswers
from shared.messages import RequestRecord, SamplingParams
from shared.plans import encode_plan, read_result, read_result_columns
from shared.speculative import SpeculativeConfig
from tests.engine_helpers import tiny_engine

QUOTING = [5, 17, 23, 99, 5, 17, 23, 99, 5, 17, 41, 8, 5, 17, 23]  # something to look up
COUNT = 40
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [QUOTING] + [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 30))] for _ in range(count - 1)]


def run(requests: list[tuple[list[int], SamplingParams]], speculative: SpeculativeConfig | None, depth: int = 2,
        kv_blocks: int = 128, engine=None, stop_token_ids=(), scheduler_steps: int = 1,
        ) -> tuple[dict[str, list[int]], SchedulerPolicy, list]:
    """Every request's output tokens (by request id), the policy, and the plans sent (on a tiny
    random model's engine, or on `engine`, reset first)."""
    if engine is None:
        engine = tiny_engine(kv_blocks=kv_blocks, kv_block_size=4)
    engine.reset()
    kv = engine.kv_cache
    policy = SchedulerPolicy("epoch", context_length=512, stop_token_ids=stop_token_ids, pipeline_depth=depth,
                             prefix_caching=True, speculative=speculative, scheduler_steps=scheduler_steps)
    policy.worker_up("w", kv.blocks_total, kv.block_size, kv_identity="engine:test")
    for number, (prompt, sampling) in enumerate(requests):
        policy.add_request(RequestRecord(request_id=f"{number:032x}", prompt_token_ids=tuple(prompt),
                                         sampling=sampling, arrival_time=float(number)))
    reader, outputs, plans, in_flight = PlanReader(), {}, [], deque()
    finished = set()
    for _ in range(5000):
        while (plan := policy.next_plan("w")) is not None:
            plans.append(plan)
            in_flight.append(encode_plan(plan))
        if not in_flight:
            break
        decoded = reader.decode(in_flight.popleft(), engine.kv_length, "w")
        if decoded.plan.free_all:
            engine.reset()
        engine.take_plan(decoded.plan)
        answers = StepAnswers(reader)
        while decoded is not None:  # (a plan of several steps: each, as the worker runs them)
            outcome = engine.step(decoded.plan.items)
            assert not outcome.errors and not decoded.unknown, (outcome.errors, decoded.unknown)
            answers.add(decoded, outcome.tokens, {}, [], 0.01, None, outcome.speculated)
            decoded = reader.next_step(decoded, engine.kv_length)
        kv = engine.kv_cache
        _, raw = read_result(answers.packed(kv.blocks_total, kv.blocks_free, kv.blocks_cached, kv.cache_digest))
        for result in policy.answers_to_apply(read_result_columns(raw)):
            for token in policy.on_result(result):
                output = outputs.setdefault(token.request_id, [])
                assert token.output_index == len(output), "a token out of order"
                output.append(token.token_id)
                if token.finish_reason is not None:
                    finished.add(token.request_id)
    assert len(finished) == len(requests) and not policy.running_count and not policy.waiting_count
    return outputs, policy, plans


def proposals(plans: list) -> list[int]:
    return [draft for plan in plans for draft in plan.drafts if draft]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_planned_speculation_gives_the_tokens_of_decoding_one_a_step(sampling, depth):
    requests = [(prompt, SamplingParams(max_tokens=COUNT, ignore_eos=True,
                                        **({"temperature": 0.9, "seed": 11 + number} if sampling == "seeded" else {})))
                for number, prompt in enumerate(prompts(3))]
    for batch in ([requests[0]], requests):  # alone, and three at once (each speculating)
        plain, _, plain_plans = run(batch, None, depth)
        assert not proposals(plain_plans)
        speculated, policy, plans = run(batch, NGRAM, depth)
        assert speculated == plain
        assert all(len(tokens) == COUNT for tokens in plain.values())
        # proposals were made and verified (the random model quotes nothing: most are refused)
        assert policy.spec_drafts > 0 and policy.spec_draft_tokens == sum(proposals(plans))
        assert policy.spec_accepted_tokens < policy.spec_draft_tokens


@pytest.mark.parametrize("depth", [1, 2])
def test_the_packaged_model_copying_a_passage_keeps_most_proposals_and_gives_the_same_tokens(engine_alone, tokenizer,
                                                                                            depth):
    passage = ("The harbor town woke slowly on winter mornings. Before the sun cleared the hills, the fishing boats "
               "were already back at the pier, their decks crowded with crates of silver mackerel.")
    prompt = tokenizer.encode_chat([{"role": "user", "content": f"Copy this text exactly:\n\n{passage}"}])
    requests = [(prompt, SamplingParams(max_tokens=COUNT))]
    stops = tokenizer.stop_token_ids
    plain, _, _ = run(requests, None, depth, engine=engine_alone, stop_token_ids=stops)
    speculated, policy, plans = run(requests, NGRAM, depth, engine=engine_alone, stop_token_ids=stops)
    assert speculated == plain
    tokens = len(plain["00" * 16])
    assert policy.spec_accepted_tokens >= tokens // 2, (policy.spec_accepted_tokens, tokens)
    assert sum(bool(plan.item_ids) for plan in plans) < tokens * 2 // 3  # steps of several tokens
    records = policy.take_iteration_records()  # (the live page's): each iteration's proposals and kept
    assert sum(record.proposed_tokens for record in records) == policy.spec_draft_tokens
    assert sum(record.accepted_tokens for record in records) == policy.spec_accepted_tokens


def test_speculation_beside_plans_of_several_steps_gives_the_same_tokens():
    """--scheduler-steps 4: plans of decodes run 4 steps; a plan with proposals runs one; requests
    that back off run in plans of several steps, and the tokens are the same."""
    requests = [(prompt, SamplingParams(max_tokens=COUNT, ignore_eos=True, temperature=0.9, seed=number))
                for number, prompt in enumerate(prompts(3, seed=7))]
    plain, _, plain_plans = run(requests, None, scheduler_steps=4)
    speculated, policy, plans = run(requests, NGRAM, scheduler_steps=4)
    assert speculated == plain
    assert policy.spec_drafts > 0 and any(plan.steps > 1 for plan in plans)
    assert all(plan.steps == 1 for plan in plans if plan.drafts)


def test_no_request_speculates_past_disable_by_batch_size_and_outputs_stay_the_same():
    requests = [(prompt, SamplingParams(max_tokens=24, ignore_eos=True)) for prompt in prompts(6, seed=3)]
    plain, _, _ = run(requests, None)
    config = NGRAM.model_copy(update={"disable_by_batch_size": 2})
    speculated, _, plans = run(requests, config)
    assert speculated == plain
    for plan in plans:  # (a plan's items are the worker's running requests, all admitted at once here)
        if plan.drafts:
            assert len(plan.item_ids) <= 2


def test_a_request_with_penalties_logprobs_or_stop_strings_does_not_speculate_and_the_rest_do():
    base = SamplingParams(max_tokens=30, ignore_eos=True)
    requests = [(QUOTING, base.model_copy(update=change)) for change in
                ({"frequency_penalty": 0.5}, {"logprobs": 1}, {"stop": ("zz",)}, {})]
    speculated, policy, plans = run(requests, NGRAM)
    plain, _, _ = run(requests, None)
    assert speculated == plain
    drafting = {plan.item_ids[len(plan.decode_handles) + index] for plan in plans
                for index, draft in enumerate(plan.drafts) if draft}
    assert drafting == {f"{3:032x}"}


def test_verification_with_too_few_kv_blocks_preempts_nothing_and_outputs_stay_the_same():
    # 24 blocks of 4 tokens: three requests of 15 + 30 tokens cannot all fit; preemptions happen
    # for decodes, never for proposals
    requests = [(prompt, SamplingParams(max_tokens=30, ignore_eos=True)) for prompt in prompts(3, seed=5)]
    plain, _, _ = run(requests, None, kv_blocks=24)
    speculated, policy, _ = run(requests, NGRAM, kv_blocks=24)
    assert speculated == plain
    assert policy.spec_drafts > 0
