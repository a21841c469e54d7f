"""The batched sampler (services/worker/sampler.py): batch invariance, seeded randomness, the
distribution of draws, masks and penalties against plain per-row references, logprobs, greedy."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from services.worker.sampler import (PenaltyHistory, SamplingRows, apply_penalties, argmax, sample, topk,
                                     uniforms)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Chi-square critical values at a false-failure probability of 1e-6, for 1 .. 11 degrees of freedom.
CHI2_CRITICAL = [23.9, 27.6, 30.7, 33.4, 35.9, 38.3, 40.5, 42.7, 44.8, 46.9, 48.9]


def params(**fields) -> SimpleNamespace:
    """A SamplingParams-like object; fields it lacks read as off."""
    return SimpleNamespace(**fields)


def tokens_of(logits: torch.Tensor, row_params: list, indices: list[int] | None = None,
              history: PenaltyHistory | None = None) -> list[int]:
    indices = indices if indices is not None else [0] * len(row_params)
    rows = SamplingRows.from_params(row_params, indices, device=logits.device)
    return sample(logits, rows, history).token_ids.tolist()


def draws(logits_row: torch.Tensor, fields: dict, count: int, first_seed: int = 0) -> torch.Tensor:
    """Token counts of `count` draws of one row, each with its own seed."""
    batch = logits_row.unsqueeze(0).expand(count, -1).contiguous()
    tokens = tokens_of(batch, [params(seed=first_seed + i, **fields) for i in range(count)])
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel())


def reference(logits_row: torch.Tensor, fields: dict) -> tuple[list[bool], list[float], bool]:
    """A plain per-row reference of the truncation: (kept, renormalized probabilities,
    ambiguous: some decision within rounding of its threshold)."""
    x = [float(v) / fields.get("temperature", 1.0) for v in logits_row.double()]
    size = len(x)
    kept = [True] * size
    ambiguous = False
    min_p, top_k, top_p = fields.get("min_p", 0.0), fields.get("top_k", 0), fields.get("top_p", 1.0)
    if min_p > 0:
        floor = max(x) + math.log(min_p)
        kept = [v >= floor for v in x]
        ambiguous |= any(abs(v - floor) < 1e-4 for v in x)
    if 0 < top_k < size:
        kth = sorted(x, reverse=True)[top_k - 1]
        kept = [keep and v >= kth for keep, v in zip(kept, x)]
    weights = [math.exp(v - max(x)) if keep else 0.0 for keep, v in zip(kept, x)]
    probabilities = [w / sum(weights) for w in weights]
    if top_p < 1:
        above = [sum(q for q in probabilities if q > p) for p in probabilities]
        ambiguous |= any(keep and abs(a - top_p) < 1e-5 for keep, a in zip(kept, above))
        kept = [keep and a < top_p for keep, a in zip(kept, above)]
        weights = [w if keep else 0.0 for keep, w in zip(kept, weights)]
        probabilities = [w / sum(weights) for w in weights]
    return kept, probabilities, ambiguous


# Randomness


def test_uniforms_are_a_function_of_seed_index_and_stream_only():
    seeds = torch.tensor([0, 1, 2, 2**32, 2**32 + 1, 2**62 + 12345, 2**63 - 1, 7, 7, 7])
    indices = torch.tensor([0, 0, 0, 0, 0, 3, 2**31 - 1, 0, 1, 2])
    together = uniforms(seeds, indices)
    alone = torch.cat([uniforms(seeds[i : i + 1], indices[i : i + 1]) for i in range(len(seeds))])
    order = torch.randperm(len(seeds), generator=torch.Generator().manual_seed(1))
    assert torch.equal(together, alone)
    assert torch.equal(uniforms(seeds[order], indices[order]), together[order])
    assert ((together > 0) & (together < 1)).all()
    assert len(set(together.tolist())) == len(seeds)  # seeds differing in either half, indices
    assert not torch.equal(uniforms(seeds, indices, stream=1), together)
    # Several streams at once (a draw and top_p's rejection rounds) are the streams alone.
    streams = uniforms(seeds, indices, stream=torch.arange(3))
    assert torch.equal(streams, torch.stack([uniforms(seeds, indices, stream=s) for s in range(3)], dim=1))
    # Pinned values: a change of the hash changes every request's tokens across versions.
    assert uniforms(torch.tensor([0, 42]), torch.tensor([0, 5])).tolist() == [0.12659533527000388, 0.7553739374167935]


def test_uniforms_are_uniform_and_independent_of_neighbours():
    seeds = torch.arange(20000) * 7919
    values = uniforms(seeds, torch.zeros_like(seeds))
    counts = torch.histc(values, bins=10, min=0, max=1)
    expected = len(values) / 10
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRITICAL[8]
    # Consecutive output indices of one seed: no visible correlation.
    stream = uniforms(torch.full((20000,), 123), torch.arange(20000))
    assert abs(torch.corrcoef(torch.stack([stream[:-1], stream[1:]]))[0, 1].item()) < 0.04


def test_different_seeds_and_indices_draw_differently():
    logits = torch.zeros(1000)  # uniform over 1000 tokens
    by_seed = draws(logits, {"temperature": 1.0}, 2000)
    assert (by_seed > 0).sum() > 800  # ~865 distinct tokens expected from 2000 draws
    batch = logits.unsqueeze(0).expand(2000, -1).contiguous()
    by_index = tokens_of(batch, [params(temperature=1.0, seed=5)] * 2000, list(range(2000)))
    assert len(set(by_index)) > 800
    same = tokens_of(batch[:2], [params(temperature=1.0, seed=5)] * 2, [3, 3])
    assert same[0] == same[1]


# Batch invariance


ROW_KINDS = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.3, "top_p": 0.5},
    {"temperature": 0.8, "top_k": 5},
    {"temperature": 1.0, "top_k": 40, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.0, "min_p": 0.02, "top_p": 0.7},
    {"temperature": 1.1, "top_k": 20, "top_p": 0.95, "min_p": 0.01},
    {"temperature": 0.0, "repetition_penalty": 1.5, "presence_penalty": 1.0},
    {"temperature": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 0.9, "top_p": 0.9},
    {"temperature": 1.0, "logprobs": 3},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_size", [1000, 49152, 50257])
def test_seeded_rows_sample_the_same_alone_and_in_any_batch(device, vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    count = 24
    # Flat-ish rows (nuclei of many tokens, so top_p rows go through rejection rounds).
    logits = (torch.randn(count, vocab_size, generator=generator) * 1.5).to(device)
    kinds = [ROW_KINDS[i % len(ROW_KINDS)] for i in range(count)]
    row_params = [params(seed=1000 + i * 17, **kind) for i, kind in enumerate(kinds)]
    indices = [i * 3 for i in range(count)]
    prompts = [[(i * 31 + j * 7) % vocab_size for j in range(20)] for i in range(count)]
    outputs = [[(i * 13 + j * 5) % vocab_size for j in range(i % 6)] for i in range(count)]

    def batch(members: list[int]) -> list[int]:
        history = PenaltyHistory.from_lists([prompts[i] for i in members], [outputs[i] for i in members], device)
        return tokens_of(logits[members], [row_params[i] for i in members], [indices[i] for i in members], history)

    alone = [batch([i])[0] for i in range(count)]
    shuffle = random.Random(vocab_size)
    for size in (2, 5, 13, count):
        for _ in range(3):
            members = shuffle.sample(range(count), size)
            assert batch(members) == [alone[i] for i in members]


def test_top_k_ties_at_the_cut_sample_the_same_whatever_the_batch():
    # Logits on a coarse grid: the k-th value is tied across the cut in most rows, so the
    # candidate set has to widen; how far must not change the draw.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 6, (40, 4096), generator=generator).float()
    row_params = [params(temperature=1.0, top_k=1 + i, top_p=0.9, seed=i) for i in range(40)]
    alone = [tokens_of(logits[i : i + 1], [row_params[i]])[0] for i in range(40)]
    assert tokens_of(logits, row_params) == alone
    assert tokens_of(logits.flip(0), row_params[::-1]) == alone[::-1]


# The distribution of draws


DISTRIBUTIONS = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 2.0, "top_p": 0.5},
    {"temperature": 1.0, "top_k": 4},
    {"temperature": 1.0, "min_p": 0.15},
    {"temperature": 1.0, "top_k": 9, "top_p": 0.85, "min_p": 0.05},
    {"temperature": 0.8, "top_p": 0.9, "min_p": 0.1},
]


@pytest.mark.parametrize("fields", DISTRIBUTIONS, ids=lambda fields: ",".join(f"{k}={v}" for k, v in fields.items()))
def test_draws_follow_the_renormalized_kept_distribution(fields):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.6, 0.5, 0.0, -0.3, -0.8, -1.0, -2.0, -3.0])
    kept, expected, ambiguous = reference(logits, fields)
    assert not ambiguous
    draws_count = 20000
    counts = draws(logits, fields, draws_count).double()
    assert all(counts[i] == 0 for i in range(len(kept)) if not kept[i])  # masked tokens never appear
    expected = torch.tensor(expected, dtype=torch.float64) * draws_count
    inside = torch.tensor(kept)
    statistic = float(((counts[inside] - expected[inside]) ** 2 / expected[inside]).sum())
    freedom = int(inside.sum()) - 1
    if freedom:
        assert statistic < CHI2_CRITICAL[freedom - 1], (statistic, counts.tolist(), expected.tolist())


# Masks and penalties against per-row references


def mask_cases() -> list[tuple[torch.Tensor, dict]]:
    generator = torch.Generator().manual_seed(11)
    choose = random.Random(11)
    cases = []
    for case in range(36):
        if case % 3 == 2:  # a coarse grid: ties at the top_k cut and in top_p's tie runs
            logits = torch.randint(-4, 5, (12,), generator=generator).float() / 4
        else:
            logits = torch.rand(12, generator=generator) * 2 - 1
        fields = {"temperature": choose.choice([0.5, 1.0, 2.0]), "top_k": choose.choice([0, 0, 1, 3, 6, 11, 12, 30]),
                  "top_p": choose.choice([1.0, 1.0, 0.2, 0.5, 0.75, 0.9]), "min_p": choose.choice([0.0, 0.0, 0.3, 0.6])}
        cases.append((logits, fields))
    return cases


def test_kept_sets_equal_a_per_row_reference():
    """Every kept token is drawn (each has probability > 0.4%: 3000 draws miss one with
    probability < 1e-5) and no other is."""
    checked = 0
    for number, (logits, fields) in enumerate(mask_cases()):
        kept, probabilities, ambiguous = reference(logits, fields)
        if ambiguous:
            continue
        assert min(p for p, keep in zip(probabilities, kept) if keep) > 0.004
        seen = draws(logits, fields, 3000, first_seed=number * 3000) > 0
        assert seen.tolist() == kept, (fields, logits.tolist())
        checked += 1
    assert checked >= 30


def test_ties_at_a_cut_are_kept_together():
    """min_p = 1 keeps the top tie run, top_k keeps every token tied with the k-th, top_p keeps
    a tie run as a whole (100 tokens tied at the top, some a hair below)."""
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.999, 0.0] * 50)  # 300 tokens: the blocked paths too
    top = [i for i in range(300) if logits[i] == 2.0]
    for fields in ({"temperature": 0.7, "min_p": 1.0}, {"temperature": 0.7, "min_p": 1.0, "top_k": 3},
                   {"temperature": 1.0, "top_k": 3}, {"temperature": 1.0, "top_p": 0.01},
                   {"temperature": 1.0, "top_k": 90, "top_p": 0.01}):
        seen = draws(logits, fields, 3000) > 0
        assert seen.nonzero().squeeze(1).tolist() == top, fields


def test_kept_sets_on_a_large_vocabulary_equal_the_reference():
    """The blocked paths (topk, inverse CDF) on 4096 tokens, 16 of them plausible."""
    generator = torch.Generator().manual_seed(5)
    cases = [{"temperature": 1.0, "top_k": 5}, {"temperature": 1.0, "top_p": 0.7}, {"temperature": 0.7, "min_p": 0.2},
             {"temperature": 1.0, "top_k": 12, "top_p": 0.9}]
    for number, fields in enumerate(cases):
        logits = torch.full((4096,), -40.0)
        logits[torch.randperm(4096, generator=generator)[:16]] = torch.rand(16, generator=generator) * 2
        kept, probabilities, ambiguous = reference(logits, fields)
        assert not ambiguous and min(p for p, keep in zip(probabilities, kept) if keep) > 0.01
        seen = draws(logits, fields, 1500, first_seed=number * 1500) > 0
        assert seen.tolist() == kept


def reference_penalties(logits: torch.Tensor, row_fields: list[dict], prompts: list, outputs: list) -> torch.Tensor:
    result = logits.clone().float()
    for row, fields in enumerate(row_fields):
        x = result[row]
        counts = torch.zeros_like(x)
        for token in outputs[row]:
            counts[token] += 1
        seen = counts > 0
        for token in prompts[row]:
            seen[token] = True
        r = fields.get("repetition_penalty", 1.0)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - fields.get("frequency_penalty", 0.0) * counts
        x = x - fields.get("presence_penalty", 0.0) * (counts > 0).float()
        result[row] = x
    return result


def test_penalties_equal_a_per_row_reference():
    generator = torch.Generator().manual_seed(2)
    vocab_size = 300
    row_fields = [
        {},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.7},
        {"frequency_penalty": 0.5},
        {"presence_penalty": -1.0},
        {"presence_penalty": 1.5, "frequency_penalty": -0.25, "repetition_penalty": 1.1},
        {"repetition_penalty": 2.0},  # nothing seen
        {"frequency_penalty": 2.0, "presence_penalty": 0.5},  # token 0 in the output: padding reads column 0
        {"repetition_penalty": 1.2, "frequency_penalty": 1.0},  # only a prompt
    ]
    prompts = [[1, 2, 3], [5, 6, 5, 299], [7, 8], [9], [10, 11], [12, 12, 13], [], [14], [0, 20, 21]]
    outputs = [[4], [6, 7, 7, 8], [8, 9], [9, 9, 9, 15], [11, 16, 16], [12, 17, 17, 17], [], [0, 0, 18], []]
    logits = torch.randn(len(row_fields), vocab_size, generator=generator) * 3
    logits[:, :40] = logits[:, :40].abs() * torch.tensor([1.0, -1.0]).repeat(20)  # both signs among seen ids
    history = PenaltyHistory.from_lists(prompts, outputs)
    rows = SamplingRows.from_params([params(temperature=1.0, **fields) for fields in row_fields], [0] * len(row_fields))
    expected = reference_penalties(logits, row_fields, prompts, outputs)
    original = logits.clone()
    assert torch.equal(apply_penalties(logits, rows, history), expected)
    assert torch.equal(logits, original)
    for members in ([1, 3, 5], [7], [0, 6, 8]):  # subsets: the other rows untouched
        part = SamplingRows.from_params([params(temperature=1.0, **row_fields[i]) for i in members], [0] * len(members))
        part_history = PenaltyHistory.from_lists([prompts[i] for i in members], [outputs[i] for i in members])
        assert torch.equal(apply_penalties(logits[members], part, part_history), expected[members])


def test_greedy_rows_take_the_argmax_of_their_penalized_logits():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 500, generator=generator)
    top = logits.argmax(1).tolist()
    row_fields = [{"temperature": 0.0}, {"temperature": 0.0, "repetition_penalty": 100.0}, {"temperature": 0.0}]
    history = PenaltyHistory.from_lists([[], [top[1]], []], [[], [], []])
    logits[:, top[1]] = logits[1, top[1]].abs() + 5  # the penalized token leads every row
    tokens = tokens_of(logits, [params(**fields) for fields in row_fields], history=history)
    assert tokens[0] == top[1] and tokens[2] == top[1]  # other rows' penalties do not touch them
    assert tokens[1] == int(reference_penalties(logits, row_fields, [[], [top[1]], []], [[], [], []])[1].argmax())
    assert tokens[1] != top[1]


# Logprobs


def test_logprobs_are_log_softmax_of_the_raw_logits():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 4096, generator=generator) * 2
    row_fields = [{"temperature": 0.0, "logprobs": 2}, {"temperature": 1.0}, {"temperature": 0.5, "logprobs": 5,
                  "repetition_penalty": 1.5, "top_k": 10}, {"temperature": 1.0, "top_p": 0.9, "logprobs": 1},
                  {"temperature": 2.0, "logprobs": 20, "min_p": 0.1}]
    history = PenaltyHistory.from_lists([[], [], list(range(100)), [], []], [[], [], [], [], []])
    rows = SamplingRows.from_params([params(seed=i, **fields) for i, fields in enumerate(row_fields)], [0] * 5)
    output = sample(logits, rows, history)
    expected = torch.log_softmax(logits, dim=1)
    asked = [0, 2, 3, 4]
    chosen = expected.gather(1, output.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.equal(output.logprob[asked], chosen[asked])
    assert output.logprob[1].isnan()
    assert output.top_ids.shape == (5, 20)
    assert torch.equal(output.top_logprobs[asked], expected[asked].sort(1, descending=True).values[:, :20])
    assert torch.equal(expected[asked].gather(1, output.top_ids[asked]), output.top_logprobs[asked])
    assert (output.top_ids[1] == -1).all()
    every = sample(logits, rows, history, num_logprobs=3)
    assert torch.equal(every.logprob, chosen)
    assert torch.equal(every.top_logprobs, expected.sort(1, descending=True).values[:, :3])
    assert sample(logits, SamplingRows.from_params([params()] * 5, [0] * 5)).logprob is None


# Greedy and other edges


@pytest.mark.parametrize("vocab_size", [12, 1000, 49152])
def test_temperature_zero_is_argmax(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(16, vocab_size, generator=generator)
    logits[3, 5] = logits[3, vocab_size - 1] = logits[3].max() + 1  # tie: the first one
    logits[4] = 0.0
    assert tokens_of(logits, [params()] * 16) == logits.argmax(1).tolist()
    assert tokens_of(logits.bfloat16(), [params()] * 16) == logits.bfloat16().argmax(1).tolist()
    assert torch.equal(argmax(logits), logits.argmax(1))


def test_low_precision_logits_sample_as_their_float32_values():
    generator = torch.Generator().manual_seed(10)
    logits = (torch.randn(len(ROW_KINDS), 4096, generator=generator) * 2).bfloat16()
    row_params = [params(seed=i, **kind) for i, kind in enumerate(ROW_KINDS)]
    history = PenaltyHistory.from_lists([[1, 2, 3]] * len(ROW_KINDS), [[4, 5]] * len(ROW_KINDS))
    assert tokens_of(logits, row_params, history=history) == tokens_of(logits.float(), row_params, history=history)


def test_blocked_topk_returns_the_largest_values():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randint(0, 50, (8, 16384), generator=generator).float()  # many ties
    for k in (1, 7, 64):
        values, ids = topk(logits, k)
        assert torch.equal(values, logits.topk(k, dim=1).values)
        assert torch.equal(logits.gather(1, ids), values)
        assert all(len(set(row)) == k for row in ids.tolist())


def test_logits_are_left_unchanged_and_top_k_past_the_vocabulary_is_off():
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=generator)
    original = logits.clone()
    row_fields = [{"temperature": 1.0, "min_p": 0.1}, {"temperature": 0.5, "top_k": 3}, {"temperature": 1.0},
                  {"temperature": 1.0, "top_p": 0.5}, {"temperature": 0.0, "presence_penalty": 1.0},
                  {"temperature": 1.0, "top_k": 0}]
    history = PenaltyHistory.from_lists([[]] * 6, [[1, 2]] * 6)
    tokens_of(logits, [params(seed=i, **fields) for i, fields in enumerate(row_fields)], history=history)
    assert torch.equal(logits, original)
    off = tokens_of(logits, [params(temperature=1.0, top_p=0.8, seed=i) for i in range(6)])
    beyond = tokens_of(logits, [params(temperature=1.0, top_p=0.8, top_k=300 + i, seed=i) for i in range(6)])
    assert off == beyond


def test_logprobs_zero_is_the_chosen_tokens_only_and_minus_one_none():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    rows = SamplingRows.from_params([params(logprobs=0), params(), params(logprobs=2)], [0, 0, 0])
    output = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=1)
    assert torch.equal(output.logprob[[0, 2]], expected[[0, 2]].gather(1, output.token_ids[[0, 2]].unsqueeze(1)).squeeze(1))
    assert torch.isnan(output.logprob[1]), "a row that did not ask has no logprob"
    assert output.top_ids.shape == (3, 2) and (output.top_ids[1] == -1).all()
    only_chosen = sample(logits[:1], SamplingRows.from_params([params(logprobs=0)], [0]))
    assert only_chosen.top_ids.shape == (1, 0) and only_chosen.logprob.shape == (1,)


def test_rows_build_from_sampling_params():
    from shared.messages import SamplingParams

    request = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=99)
    rows = SamplingRows.from_params([request, SamplingParams()], [4, 0], vocab_size=100)
    assert rows.host["top_p"][0] == 0.9 and rows.host["min_p"].tolist() == [0.0, 0.0] and rows.max_logprobs == -1
    assert not rows.all_greedy and rows.any_top_k and rows.max_top_k == 20 and not rows.any_penalty
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, rows).token_ids[1] == logits[1].argmax()


def test_bad_parameters_are_refused():
    for fields in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 2.0},
                   {"repetition_penalty": 0.0}, {"seed": 2**63}, {"presence_penalty": math.nan}):
        with pytest.raises(ValueError):
            SamplingRows.from_params([params(**fields)], [0])
    with pytest.raises(ValueError):
        SamplingRows.from_params([params()], [2**31])
    rows = SamplingRows.from_params([params(temperature=1.0, presence_penalty=1.0)], [0])
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 10), rows)  # penalties without a history
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), rows)


def test_every_valid_request_samples_a_token_whatever_its_parameters():
    """Extreme but valid parameters (top_p 5e-324, temperature 1e-300, min_p 1, penalties at the
    edges, top_k past the vocabulary) over logits from tiny to huge: a token is drawn, never an
    exception (an exception in a step would make the worker leave as broken)."""
    from hypothesis import given, settings, strategies as st

    from shared.messages import SamplingParams

    extreme = dict(
        temperature=st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 0.01, 1.0, 2.0, 100.0]),
        top_p=st.sampled_from([5e-324, 1e-9, 0.5, 0.999999, 1.0]),
        top_k=st.sampled_from([0, 1, 2, 999, 1000, 1001, 2**31 - 1]),
        min_p=st.sampled_from([0.0, 1e-12, 0.5, 1.0]),
        presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]), frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
        repetition_penalty=st.sampled_from([1e-9, 0.5, 1.0, 10.0]), logprobs=st.sampled_from([-1, 0, 20]),
        seed=st.integers(0, 2**63 - 1))

    @given(rows=st.lists(st.builds(SamplingParams, max_tokens=st.just(4), **extreme), min_size=1, max_size=4),
           scale=st.sampled_from([1e-3, 1.0, 30.0, 3000.0]), data=st.randoms(use_true_random=False))
    @settings(max_examples=60, deadline=None, database=None)
    def check(rows, scale, data):
        vocab = 1000
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(data.randrange(1000))) * scale
        history = PenaltyHistory.from_lists([[data.randrange(vocab) for _ in range(5)] for _ in rows],
                                            [[data.randrange(vocab) for _ in range(3)] for _ in rows])
        output = sample(logits, SamplingRows.from_params(rows, [data.randrange(50) for _ in rows]), history)
        assert output.token_ids.shape == (len(rows),)
        assert ((output.token_ids >= 0) & (output.token_ids < vocab)).all()

    check()
