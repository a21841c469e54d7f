"""Tensor and pipeline parallelism's arithmetic (services/worker/parallel.py): ranks on
torch.distributed (gloo on the CPU) each run an Engine over their share and produce the
single-process engine's tokens and logits.

Tolerance: a tensor split changes only the order of additions (each rank's partial products,
summed by the all-reduce), so float32 logits agree to about 1e-6 on the tiny model; a pipeline
split changes nothing (the same layers in the same order, hidden states sent whole). 1e-4 is
asserted, tokens exactly."""

import multiprocessing
import traceback
from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from services.worker.parallel import (
    Layout,
    check_split,
    communication_bytes_per_token,
    head_cost_in_layers,
    kv_bytes_per_token,
    kv_heads_of,
    local_config,
    rank_config,
    rank_weights,
    shard_weights,
    stage_layers,
)
from tests.engine_helpers import TINY_CONFIG, generate_alone, tiny_engine, tiny_random_weights

pytestmark = pytest.mark.timeout(180)
PROMPTS = [[5, 9, 13, 2, 77, 31, 8], list(range(40, 63)), [200]]
STEPS = 6
COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank that never arrives fails the others, never hangs them


def _rank_main(rank: int, layout: Layout, init_file: str, config, answers) -> None:
    """One rank: its share as an Engine, every prompt generated alone; every rank reports."""
    import torch.distributed as dist

    from services.bench.logits import LogitsEngine
    from services.worker.engine import Engine
    from services.worker.parallel import ParallelLlama, make_tensor_groups, stage_layers
    from shared.config import Settings

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=layout.world,
                                timeout=COLLECTIVE_TIMEOUT)
        make_tensor_groups(layout)
        device = torch.device("cpu")
        model = ParallelLlama(config, tiny_random_weights(config), device, torch.float32, layout)
        assert model.config.n_layers == len(stage_layers(config, layout, layout.stage(rank)))
        settings = Settings(kv_blocks=64, kv_block_size=4)
        engine = LogitsEngine(model, Engine.kv_cache_for(model.config, settings, device, torch.float32))
        results = []
        for index, prompt in enumerate(PROMPTS):
            logits: list[torch.Tensor] = []
            tokens = generate_alone(engine, f"r{index}", prompt, STEPS, logits=logits)
            results.append((tokens, [row.numpy() for row in logits]))
        answers.put(("ok", rank, (results, sampled_with_logprobs(engine))))
        dist.destroy_process_group()
    except BaseException:
        answers.put(("error", rank, f"rank {rank}: {traceback.format_exc()}"))


def sampled_with_logprobs(engine) -> list[tuple[int, float, tuple]]:
    """Two seeded requests sampled in one batch, asking for 3 and 0 top log-probabilities: each
    step's (token, log-probability, top) per request."""
    from shared.messages import SamplingParams, StepItem

    asks = {"s0": SamplingParams(temperature=0.9, seed=11, logprobs=3), "s1": SamplingParams(temperature=1.3, seed=5,
                                                                                            logprobs=0)}
    for request_id, sampling in asks.items():
        engine.add_request(request_id, sampling)
    prompt = PROMPTS[1]
    items = [StepItem(request_id=request_id, token_ids=tuple(prompt), start_position=0, sample=True,
                      output_index=0) for request_id in asks]
    seen = []
    for index in range(4):
        outcome = engine.step(items)
        seen.append(sorted((request_id, token, outcome.logprobs[request_id].logprob,
                            outcome.logprobs[request_id].top) for request_id, token in outcome.tokens.items()))
        items = [StepItem(request_id=request_id, token_ids=(token,), start_position=len(prompt) + index,
                          sample=True, output_index=index + 1) for request_id, token in outcome.tokens.items()]
    for request_id in asks:
        engine.free(request_id)
    return seen


def run_ranks(layout: Layout, config, tmp_path) -> dict[int, list]:
    """Every rank's tokens and logits, by rank."""
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    init_file = str(tmp_path / f"init-{layout.tensor}x{layout.pipeline}")
    ranks = [context.Process(target=_rank_main, args=(rank, layout, init_file, config, answers))
             for rank in range(layout.world)]
    for process in ranks:
        process.start()
    reports = {}
    try:
        for _ in range(layout.world):
            status, rank, payload = answers.get(timeout=150)
            assert status == "ok", payload
            reports[rank] = payload
    finally:
        for process in ranks:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    return reports


FIVE_LAYERS = replace(TINY_CONFIG, n_layers=5)


@pytest.mark.parametrize(("layout", "config"), [
    (Layout(tensor=2), TINY_CONFIG),  # 4 query heads, 2 KV heads: one KV head per rank
    (Layout(tensor=4), TINY_CONFIG),  # 2 KV heads for 4 ranks: each keeps the one its query head reads (replicated)
    (Layout(tensor=2), replace(TINY_CONFIG, qkv_bias=True, architecture="qwen2")),  # Q/K/V biases split with their rows
    (Layout(tensor=2), replace(TINY_CONFIG, qk_norm=True, architecture="qwen3")),  # Qwen3's per-head norms, whole
    (Layout(pipeline=2), TINY_CONFIG),  # one layer per stage
    (Layout(pipeline=3), FIVE_LAYERS),  # 2, 2 and 1 layers
    (Layout(tensor=2, pipeline=2), TINY_CONFIG),  # four ranks: two stages of two
], ids=["tp2", "tp4-replicated-kv", "tp2-qkv-bias", "tp2-qk-norm", "pp2", "pp3-uneven", "tp2xpp2"])
def test_parallel_ranks_produce_the_single_process_engines_tokens_and_logits(layout, config, tmp_path):
    if config.qkv_bias:
        weights = tiny_random_weights(config)
        assert any(name.endswith("attn_q.bias") for name in weights), "the tiny model has no biases to split"
    single = tiny_engine(kv_blocks=64, kv_block_size=4, config=config)
    reports = run_ranks(layout, config, tmp_path)
    expected = []
    for prompt in PROMPTS:
        expected_logits: list[torch.Tensor] = []
        expected.append((generate_alone(single, "alone", prompt, STEPS, logits=expected_logits), expected_logits))
    want_sampled = sampled_with_logprobs(single)
    assert len({entry[1] for step in want_sampled for entry in step}) > 2  # sampled, not constant
    for rank in range(layout.world):  # every rank has the same tokens; the last stage's, the same logits
        samples = layout.stage(rank) == layout.pipeline - 1
        greedy, sampled = reports[rank]
        for got, want in zip(sampled, want_sampled, strict=True):  # tokens exactly, log-probabilities within 1e-4
            assert [(request_id, token, [top for top, _ in tops]) for request_id, token, _, tops in got] == \
                [(request_id, token, [top for top, _ in tops]) for request_id, token, _, tops in want], f"rank {rank}"
            values = [value for _, _, logprob, tops in got for value in (logprob, *(value for _, value in tops))]
            assert values == pytest.approx([value for _, _, logprob, tops in want
                                            for value in (logprob, *(value for _, value in tops))], abs=1e-4), \
                f"rank {rank}"
        for (tokens, logits), (want_tokens, want_logits) in zip(greedy, expected, strict=True):
            assert tokens == want_tokens, f"rank {rank}"
            assert len(logits) == (len(want_logits) if samples else 0), f"rank {rank}"
            for got, want in zip(logits, want_logits, strict=True if samples else False):
                torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=1e-4)


def test_stages_hold_contiguous_runs_of_layers_renumbered_from_zero():
    layout = Layout(tensor=2, pipeline=3)
    assert [list(layout.layers(5, stage)) for stage in range(3)] == [[0, 1], [2, 3], [4]]
    # Balanced for decoding: the last stage's LM head counts as layers (SmolLM2's shape: 8 of 30).
    smollm2 = replace(TINY_CONFIG, hidden_size=576, ffn_size=1536, n_heads=9, n_kv_heads=3, head_dim=64,
                      vocab_size=49152, n_layers=30)
    assert head_cost_in_layers(smollm2) == pytest.approx(8.0, abs=0.05)
    assert [stage_layers(smollm2, Layout(pipeline=2), stage) for stage in range(2)] == [range(0, 19), range(19, 30)]
    assert [len(stage_layers(smollm2, Layout(pipeline=3), stage)) for stage in range(3)] == [13, 12, 5]
    assert Layout(pipeline=4).layers(4, 3, head_layers=9.0) == range(3, 4)  # every stage keeps a layer
    assert [layout.stage(rank) for rank in range(6)] == [0, 0, 1, 1, 2, 2] and layout.stage_ranks(1) == [2, 3]
    weights = tiny_random_weights(FIVE_LAYERS)
    last = rank_weights(weights, FIVE_LAYERS, layout, 5)  # stage 2, tensor rank 1: layer 4 as blk.0
    assert {name.split(".")[1] for name in last if name.startswith("blk.")} == {"0"}
    torch.testing.assert_close(last["blk.0.ffn_gate.weight"], weights["blk.4.ffn_gate.weight"][64:])
    assert rank_config(FIVE_LAYERS, layout, 5).n_layers == 1 and rank_config(FIVE_LAYERS, layout, 0).n_heads == 2
    # One token's KV over the group: every layer's KV heads once (one per tensor rank here).
    assert kv_bytes_per_token(FIVE_LAYERS, layout, 4) == 2 * 5 * 2 * 16 * 4
    with pytest.raises(ValueError, match="pipeline parallel size 6 exceeds the model's 5 layers"):
        check_split(FIVE_LAYERS, Layout(pipeline=6))


def test_shards_cover_each_weight_once_and_kv_heads_follow_their_query_heads():
    config = TINY_CONFIG  # 4 query heads, 2 KV heads, head dim 16
    weights = tiny_random_weights(config)
    shards = [shard_weights(weights, config, rank, 2) for rank in range(2)]
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.attn_k.weight"):
        torch.testing.assert_close(torch.cat([shard[name] for shard in shards]), weights[name])
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        torch.testing.assert_close(torch.cat([shard[name] for shard in shards], dim=1), weights[name])
    torch.testing.assert_close(torch.cat([shard["output.weight"] for shard in shards]), weights["token_embd.weight"])
    assert [list(kv_heads_of(config, rank, 4)) for rank in range(4)] == [[0], [0], [1], [1]]
    assert local_config(config, 4).n_kv_heads == 1 and local_config(config, 2).n_heads == 2
    with pytest.raises(ValueError, match="does not divide"):
        local_config(config, 3)
    # Per token, a ring all-reduce sends 2 (world - 1) / world of H values, twice per layer.
    sent = communication_bytes_per_token(replace(config, hidden_size=2048, n_layers=16), 2, 2)
    assert sent["all_reduce_per_layer"] == 2 * 2048 * 2 and sent["all_reduce_per_step"] == 16 * 2 * 2048 * 2
    # Across stages: one hidden state per boundary; each sampled token back (id, logprob, 20 top pairs).
    staged = communication_bytes_per_token(replace(config, hidden_size=2048, n_layers=16), 1, 2, pipeline=2)
    assert staged["stage_boundary"] == 2048 * 2 and staged["sampled_tokens"] == 42 * 8
