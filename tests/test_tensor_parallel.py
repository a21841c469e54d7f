"""Tensor parallelism's arithmetic (services/worker/tensor_parallel.py): ranks on torch.distributed
(gloo on the CPU) each run an Engine over their shard and produce the single-process engine's
tokens and logits.

Tolerance: the split changes only the order of additions (each rank's partial products, summed by
the all-reduce), so float32 logits agree to about 1e-6 on the tiny model; 1e-4 is asserted, tokens
exactly."""

import multiprocessing
import traceback
from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from services.worker.tensor_parallel import (
    communication_bytes_per_token,
    kv_heads_of,
    local_config,
    shard_weights,
)
from tests.engine_helpers import TINY_CONFIG, generate_alone, tiny_engine, tiny_random_weights

pytestmark = pytest.mark.timeout(180)
PROMPTS = [[5, 9, 13, 2, 77, 31, 8], list(range(40, 63)), [200]]
STEPS = 6
COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank that never arrives fails the others, never hangs them


def _rank_main(rank: int, world: int, init_file: str, config, answers) -> None:
    """One rank: its shard as an Engine, every prompt generated alone; rank 0 reports."""
    import torch.distributed as dist

    from services.worker.engine import Engine
    from services.worker.tensor_parallel import TensorParallelLlama
    from shared.config import Settings

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        device = torch.device("cpu")
        model = TensorParallelLlama(config, tiny_random_weights(config), device, torch.float32)
        settings = Settings(kv_blocks=64, kv_block_size=4)
        engine = Engine(model, Engine.kv_cache_for(model.config, settings, device, torch.float32))
        results = []
        for index, prompt in enumerate(PROMPTS):
            logits: list[torch.Tensor] = []
            tokens = generate_alone(engine, f"r{index}", prompt, STEPS, logits=logits)
            results.append((tokens, [row.numpy() for row in logits]))
        if rank == 0:
            answers.put(("ok", results))
        dist.destroy_process_group()
    except BaseException:
        answers.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run_ranks(world: int, config, tmp_path) -> list:
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    init_file = str(tmp_path / f"init-{world}")
    ranks = [context.Process(target=_rank_main, args=(rank, world, init_file, config, answers))
             for rank in range(world)]
    for process in ranks:
        process.start()
    try:
        status, payload = answers.get(timeout=150)
    finally:
        for process in ranks:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    assert status == "ok", payload
    return payload


@pytest.mark.parametrize(("world", "config"), [
    (2, TINY_CONFIG),  # 4 query heads, 2 KV heads: one KV head per rank
    (4, TINY_CONFIG),  # 2 KV heads for 4 ranks: each keeps the one its query head reads (replicated)
    (2, replace(TINY_CONFIG, qkv_bias=True, architecture="qwen2")),  # Qwen2's Q/K/V biases split with their rows
    (2, replace(TINY_CONFIG, qk_norm=True, architecture="qwen3")),  # Qwen3's per-head norms, whole on each rank
], ids=["tp2", "tp4-replicated-kv", "tp2-qkv-bias", "tp2-qk-norm"])
def test_tensor_parallel_ranks_produce_the_single_process_engines_tokens_and_logits(world, config, tmp_path):
    if config.qkv_bias:
        weights = tiny_random_weights(config)
        assert any(name.endswith("attn_q.bias") for name in weights), "the tiny model has no biases to split"
    single = tiny_engine(kv_blocks=64, kv_block_size=4, config=config)
    results = run_ranks(world, config, tmp_path)
    for prompt, (tokens, logits) in zip(PROMPTS, results, strict=True):
        expected_logits: list[torch.Tensor] = []
        expected = generate_alone(single, "alone", prompt, STEPS, logits=expected_logits)
        assert tokens == expected
        for got, want in zip(logits, expected_logits, strict=True):
            torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=1e-4)


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
