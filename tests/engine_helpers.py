"""Drive an Engine the way the scheduler does: prefill, then one decode step per token; and a
tiny seeded random model for fast engine tests."""

import random

import torch

from services.worker.attention import AttentionMode
from services.worker.decode_graphs import DecodeGraphs
from services.bench.logits import LogitsEngine
from services.worker.engine import Engine
from services.worker.model import Llama
from shared.config import Settings
from shared.messages import SamplingParams, StepItem
from shared.model_file import ModelConfig

GREEDY = SamplingParams(max_tokens=64)


def prefill_item(request_id: str, token_ids, start: int = 0, output_index: int = 0, sample: bool = True) -> StepItem:
    return StepItem(request_id=request_id, token_ids=tuple(token_ids), start_position=start, sample=sample,
                    output_index=output_index)


def decode_item(request_id: str, token_id: int, position: int, output_index: int) -> StepItem:
    return StepItem(request_id=request_id, token_ids=(token_id,), start_position=position, sample=True,
                    output_index=output_index)


def generate_alone(engine: Engine, request_id: str, prompt: list[int], count: int,
                   sampling: SamplingParams = GREEDY, stop_ids: frozenset[int] = frozenset(),
                   logits: list[torch.Tensor] | None = None) -> list[int]:
    """The request run with nothing else in its batch; each step's logits appended to `logits` if given
    (and the engine has them: a pipeline stage before the last has only the tokens)."""
    engine.add_request(request_id, sampling)
    want_logits = logits is not None

    def step(item: StepItem) -> int:
        result = engine.step([item], return_logits=want_logits)
        if want_logits and engine.samples:
            logits.append(result.logits[request_id])
        return result.tokens[request_id]

    output = [step(prefill_item(request_id, prompt))]
    while len(output) < count and output[-1] not in stop_ids:
        output.append(step(decode_item(request_id, output[-1], len(prompt) + len(output) - 1, len(output))))
    engine.free(request_id)
    return output


def cached_hashes(kv_cache) -> dict[bytes, int]:
    """Every block registered in an executor's prefix cache (services/worker/kv_cache.py) and the rows
    holding it (0: idle): what the tests compare with the scheduler's copy."""
    return {block_hash: int(kv_cache._references[block]) for block_hash, block in kv_cache._block_of_hash.items()}


def smollm2_engine_alone() -> LogitsEngine:
    """The packaged model in this process, on one thread: the system tests' oracle."""
    torch.set_num_threads(1)
    return LogitsEngine.from_settings(Settings(kv_blocks=64, device="cpu"))


TINY_CONFIG = ModelConfig(
    n_layers=2, hidden_size=64, ffn_size=128, n_heads=4, n_kv_heads=2, head_dim=16,
    rope_theta=10000.0, rms_norm_eps=1e-5, vocab_size=256, context_length=512,
)


def tiny_random_weights(config: ModelConfig = TINY_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in the GGUF's names: a fast model for unit tests."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    weights = {
        "token_embd.weight": randn(config.vocab_size, config.hidden_size),
        "output_norm.weight": 1 + randn(config.hidden_size) * 0.1,
    }
    for i in range(config.n_layers):
        weights |= {
            f"blk.{i}.attn_norm.weight": 1 + randn(config.hidden_size) * 0.1,
            f"blk.{i}.attn_q.weight": randn(q_rows, config.hidden_size),
            f"blk.{i}.attn_k.weight": randn(kv_rows, config.hidden_size),
            f"blk.{i}.attn_v.weight": randn(kv_rows, config.hidden_size),
            f"blk.{i}.attn_output.weight": randn(config.hidden_size, q_rows),
            f"blk.{i}.ffn_norm.weight": 1 + randn(config.hidden_size) * 0.1,
            f"blk.{i}.ffn_gate.weight": randn(config.ffn_size, config.hidden_size),
            f"blk.{i}.ffn_up.weight": randn(config.ffn_size, config.hidden_size),
            f"blk.{i}.ffn_down.weight": randn(config.hidden_size, config.ffn_size),
        }
        if config.qkv_bias:  # Qwen2
            weights |= {f"blk.{i}.attn_q.bias": randn(q_rows), f"blk.{i}.attn_k.bias": randn(kv_rows),
                        f"blk.{i}.attn_v.bias": randn(kv_rows)}
        if config.qk_norm:  # Qwen3
            weights |= {f"blk.{i}.attn_q_norm.weight": 1 + randn(config.head_dim) * 0.1,
                        f"blk.{i}.attn_k_norm.weight": 1 + randn(config.head_dim) * 0.1}
    return weights


def tiny_engine(kv_blocks: int = 64, kv_block_size: int = 4, attention: AttentionMode = "batched", seed: int = 0,
                config: ModelConfig = TINY_CONFIG, decode_workspace_tokens: int = 65536, static_decode: bool = False,
                compile: bool = False, max_batch_size: int = 64) -> LogitsEngine:
    """An engine over a seeded random tiny model, on the CPU in float32."""
    device = torch.device("cpu")
    model = Llama(config, tiny_random_weights(config, seed), device, torch.float32, compile=compile)
    settings = Settings(kv_blocks=kv_blocks, kv_block_size=kv_block_size, max_batch_size=max_batch_size)
    kv_cache = Engine.kv_cache_for(config, settings, device, torch.float32, scratch_block=static_decode)
    return LogitsEngine(model, kv_cache, attention, decode_workspace_tokens, max_batch_size,
                        static_decode=static_decode)


def static_decode_steps_agree_with_the_per_request_path(steps: int = 40) -> DecodeGraphs:
    """Decode-only steps in fixed shapes (what CUDA graphs replay): batches padded to the next
    bucket, contexts cut to a bucket, padding rows writing to the scratch block. Every real row's
    logits equal the per-request path's, over batch sizes and contexts that cross buckets, and no
    padding row touches a request's KV. Returns the engine's DecodeGraphs (which attention ran)."""
    reference = tiny_engine(kv_blocks=512, kv_block_size=4, attention="per_request")
    static = tiny_engine(kv_blocks=512, kv_block_size=4, decode_workspace_tokens=0, static_decode=True)
    rng = random.Random(11)
    tokens: dict[str, list[int]] = {}
    for index in range(13):
        prompt = [rng.randrange(256) for _ in range(rng.choice((3, 30, 70)))]
        for engine in (reference, static):
            engine.add_request(f"r{index}", GREEDY)
        first = reference.step([prefill_item(f"r{index}", prompt)]).tokens[f"r{index}"]
        static.step([prefill_item(f"r{index}", prompt)])
        tokens[f"r{index}"] = prompt + [first]
    shapes = set()
    for step_index in range(steps):
        chosen = rng.sample(sorted(tokens), rng.choice((1, 3, 5, 9, 13)))  # 1, 3 -> 4, 5 -> 8, 9 -> 12, 13 -> 16
        items = [decode_item(request_id, tokens[request_id][-1], len(tokens[request_id]) - 1, 1)
                 for request_id in chosen]
        expected = reference.step(items, return_logits=True)
        actual = static.step(items, return_logits=True)
        assert not expected.errors and not actual.errors
        for request_id in chosen:
            torch.testing.assert_close(actual.logits[request_id], expected.logits[request_id], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"step {step_index}, {request_id}: {m}")
            tokens[request_id].append(expected.tokens[request_id])
        shapes.add((len(chosen), max(len(tokens[request_id]) for request_id in chosen) > 64))
    assert {size for size, _ in shapes} >= {1, 3, 5, 9, 13} and {long for _, long in shapes} == {False, True}, shapes
    graphs = static.graphs
    assert graphs is not None and graphs.steps == steps, "every decode-only step ran in fixed shapes"
    return graphs
