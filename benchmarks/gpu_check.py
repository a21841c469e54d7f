"""The engine on a GPU: correctness against the CPU, CUDA graphs against eager, and decode speed
beside the HBM roofline (issue: the hot path at accelerator speed).

Runs where only torch and numpy are installed (the lent device machine has no pydantic, redis or
gguf): random weights of a model's shape, the engine driven directly. Every check prints one line
PASS/FAIL; the benchmark prints a markdown table; all of it is written as JSON to --out (default
$OUT/gpu_check.json when $OUT is set, else benchmarks/results/gpu_check.json).

    python3 benchmarks/gpu_check.py                  # on the device machine: about 3-5 minutes
    .venv/bin/python benchmarks/gpu_check.py --cpu   # the same checks on this CPU, small sizes

Checks, and what each proves (SmolLM2-135M's shape, random weights, 4 prompts, 24 greedy steps):
1. (CUDA) float32 on CUDA against float32 on the CPU (TF32 off): the same greedy tokens, logits
   within 1e-3 absolute. Proves the engine computes the same function on the GPU (other kernels,
   the same math, float32 rounding apart).
2. bfloat16 (on CUDA; with --cpu, on the CPU) against float32 on the CPU, teacher-forced (both fed
   the float32 run's tokens, so the logits stay comparable where bfloat16 picks another token): the
   largest logit difference within BF16_MARGIN x the largest that transformers itself shows between
   its own bfloat16 and float32 forward passes of the same weights and tokens (measured live where
   transformers is installed, else TRANSFORMERS_BF16_OF_RMS, measured here), the same top-1 tokens
   as often as transformers' bfloat16 gets them less 5 points. Proves bfloat16 costs the engine no
   more precision than it costs the reference implementation: a wrong op (a missing scale, a
   dtype lost) shows as errors of the order of the logits themselves.
3. Decode steps replayed from CUDA graphs against the same padded, fixed-shape steps run eagerly
   (the engine's static decode with capture off): bit-exact, logits and tokens (tolerance 0), over
   batch sizes that need padding (3 -> 4, 13 -> 16) and contexts that cross a bucket. Proves the
   capture and replay change nothing (a replay runs the captured kernels on the same inputs); it
   runs in the serving dtype (bfloat16 on CUDA). On the CPU nothing is captured, so this compares
   the static step with itself: the run only shows the check works.
4. Fixed-shape decode steps (padded, the context cut to a bucket; on CUDA replayed graphs whose
   attention is the in-place paged kernel, services/worker/paged_attention.py) against the plain
   eager path at the batch's own size, in float32: logits within 1e-3. Proves the padding, the
   bucketing and the kernel compute the same attention (different kernels and shapes, the same math;
   in bfloat16 the shapes alone move logits by rounding, so this one is float32). The check that
   graphs were captured fails on CUDA when the engine did not take the kernel (its self-check
   failed: the log says why).
Benchmark: decode tok/s at batch 1, 16 and 64 (context ~256), eager, with CUDA graphs, and (on
CUDA) with CUDA graphs over --compile's fused kernels, for SmolLM2-135M's and Llama-3.2-1B's shapes
in bfloat16, beside the roofline: (weight bytes + KV bytes read per step) / memory bandwidth; on
CUDA also the GPU's busy time and kernel count of one step (torch profiler), which says how much
of a step is the host's. On CUDA it also writes an emulated-executor profile
calibrated from the Llama-3.2-1B steps (measured-<gpu>-llama3.2-1b.json beside the report: copy it
into profiles/ to emulate that GPU as measured).
"""

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.logits import LogitsEngine  # noqa: E402  (the engine, which also hands back logits)
from services.worker.engine import Engine  # noqa: E402  (torch and numpy only)
from services.worker.hardware import profile_from_measurement  # noqa: E402  (the standard library only)
from services.worker.kv_cache import PagedKVCache  # noqa: E402
from services.worker.model import Llama  # noqa: E402
from shared.model_file import ModelConfig  # noqa: E402

SMOLLM2 = ModelConfig(n_layers=30, hidden_size=576, ffn_size=1536, n_heads=9, n_kv_heads=3, head_dim=64,
                      rope_theta=100000.0, rms_norm_eps=1e-5, vocab_size=49152, context_length=8192)
LLAMA_1B = ModelConfig(n_layers=16, hidden_size=2048, ffn_size=8192, n_heads=32, n_kv_heads=8, head_dim=64,
                       rope_theta=500000.0, rms_norm_eps=1e-5, vocab_size=128256, context_length=8192)
# Published HBM bandwidth (bytes/s) by device name; a measured copy is used when the name is unknown.
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
PEAK_BF16_TFLOPS = {"H200": 989, "H100": 989, "A100": 312}  # dense, datasheets (for a written profile)
BLOCK_SIZE = 16
# transformers' own bfloat16 against float32 on these random weights and tokens (check 2), as a share
# of the float32 logits' RMS: 2.21 of RMS 24.3, top-1 agreement 100% (`.venv/bin/python
# benchmarks/gpu_check.py --cpu`, transformers 5.x, Intel Xeon 2-core host, 2026-12-06). Used where
# transformers is not installed (the device machine); measured again where it is.
TRANSFORMERS_BF16_OF_RMS = 0.0908
BF16_MARGIN = 1.5  # the engine's bfloat16 error may be this many times transformers' (other kernels on CUDA)


@dataclass(frozen=True)
class Item:  # what a plan's StepItem carries (the engine reads these attributes)
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    sample: bool
    output_index: int
    feeds_sampled: bool = False
    draft_tokens: int = 0


@dataclass(frozen=True)
class Greedy:  # a SamplingParams at its defaults: temperature 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    logprobs: int = -1
    prompt_logprobs: int = -1
    has_penalty: bool = False
    needs_history: bool = False
    logit_bias: tuple = ()
    structured: None = None


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Weights in the GGUF's names, made on the device (a 1B model made on the host takes long)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * scale).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1 + randn(size, scale=0.1)).to(dtype)

    hidden, q_rows, kv_rows = config.hidden_size, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    weights = {"token_embd.weight": randn(config.vocab_size, hidden, scale=1.0), "output_norm.weight": norm(hidden)}
    for i in range(config.n_layers):
        weights |= {
            f"blk.{i}.attn_norm.weight": norm(hidden), f"blk.{i}.ffn_norm.weight": norm(hidden),
            f"blk.{i}.attn_q.weight": randn(q_rows, hidden), f"blk.{i}.attn_k.weight": randn(kv_rows, hidden),
            f"blk.{i}.attn_v.weight": randn(kv_rows, hidden), f"blk.{i}.attn_output.weight": randn(hidden, q_rows),
            f"blk.{i}.ffn_gate.weight": randn(config.ffn_size, hidden),
            f"blk.{i}.ffn_up.weight": randn(config.ffn_size, hidden),
            f"blk.{i}.ffn_down.weight": randn(hidden, config.ffn_size),
        }
    return weights


def make_engine(config: ModelConfig, device: torch.device, dtype: torch.dtype, weights: dict, kv_blocks: int,
                graphs: bool = False, max_batch: int = 64, compile: bool = False, in_place: bool = True) -> Engine:
    """in_place=False: fixed-shape decode steps gather the rows' blocks (as off CUDA) even where the
    in-place paged kernel runs, to measure one against the other."""
    model = Llama(config, weights, device, dtype, compile=compile)
    kv_cache = PagedKVCache(config.n_layers, config.n_kv_heads, config.head_dim, kv_blocks, BLOCK_SIZE, device, dtype,
                            max_rows=max_batch, max_blocks_per_row=-(-config.context_length // BLOCK_SIZE),
                            scratch_block=graphs)
    workspace = 65536 if device.type == "cpu" else 0
    engine = LogitsEngine(model, kv_cache, "batched", workspace, max_batch, static_decode=graphs)
    if engine.graphs is not None:
        engine.graphs.in_place = engine.graphs.in_place and in_place
    return engine


def attention_of(engine: Engine) -> str:
    if engine.graphs is None:
        return "-"
    return "in place" if engine.graphs.in_place else "gather"


def prompts(count: int, length: int, vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = np.random.default_rng(seed)
    return [generator.integers(0, vocab_size, size=length).tolist() for _ in range(count)]


def run_greedy(engine: Engine, prompt_ids: list[list[int]], steps: int, forced: dict | None = None) -> tuple[dict, dict]:
    """Prefill every prompt in one step, then `steps` decode steps of the whole batch: tokens and
    logits ([steps + 1, V] float32 on the host) per request. With `forced` (request id -> tokens),
    each request feeds those tokens instead of its own (teacher forcing: logits stay comparable even
    where a lower precision picks another token)."""
    engine.reset()
    ids = [f"r{index}" for index in range(len(prompt_ids))]
    for request_id in ids:
        engine.add_request(request_id, Greedy())
    outcome = engine.step([Item(request_id, tuple(prompt), 0, True, 0) for request_id, prompt in zip(ids, prompt_ids)],
                          return_logits=True)
    tokens = {request_id: [outcome.tokens[request_id]] for request_id in ids}
    logits = {request_id: [outcome.logits[request_id]] for request_id in ids}
    for step in range(1, steps + 1):
        fed = {request_id: (forced or tokens)[request_id][step - 1] for request_id in ids}
        items = [Item(request_id, (fed[request_id],), len(prompt) + step - 1, True, step)
                 for request_id, prompt in zip(ids, prompt_ids)]
        outcome = engine.step(items, return_logits=True)
        for request_id in ids:
            tokens[request_id].append(outcome.tokens[request_id])
            logits[request_id].append(outcome.logits[request_id])
    engine.reset()
    return tokens, {request_id: torch.stack(rows) for request_id, rows in logits.items()}


def compare(name: str, reference: tuple[dict, dict], other: tuple[dict, dict], atol: float | None = None,
            min_agreement: float = 1.0, of_rms: float | None = None) -> dict:
    """atol: the largest logit difference allowed (0: bit-exact); of_rms: the same as a share of the
    reference logits' RMS (for bfloat16, whose error grows with the logits' size)."""
    tokens_a, logits_a = reference
    tokens_b, logits_b = other
    worst = max(float((logits_a[key] - logits_b[key]).abs().max()) for key in logits_a)
    mean = float(torch.cat([(logits_a[key] - logits_b[key]).abs().flatten() for key in logits_a]).mean())
    rms = float(torch.cat([logits_a[key].flatten() for key in logits_a]).pow(2).mean().sqrt())
    tolerance = atol if atol is not None else of_rms * rms
    same = sum(a == b for key in tokens_a for a, b in zip(tokens_a[key], tokens_b[key]))
    total = sum(len(tokens_a[key]) for key in tokens_a)
    agreement = same / total
    passed = worst <= tolerance and agreement >= min_agreement
    bound = ("0 (bit-exact)" if tolerance == 0 else f"{tolerance:.3g}") + (
        f" = {of_rms:.3g} x RMS {rms:.1f}" if atol is None else "")
    print(f"{'PASS' if passed else 'FAIL'} {name}: max |logit difference| {worst:.2e} (tolerance {bound}; mean "
          f"{mean:.2e}), top-1 agreement {agreement:.1%} (at least {min_agreement:.0%})", flush=True)
    return {"check": name, "passed": passed, "max_abs_logit_difference": worst, "mean_abs_logit_difference": mean,
            "reference_logit_rms": rms, "tolerance": tolerance, "token_agreement": agreement}


def transformers_bf16_bound(config: ModelConfig, weights: dict, prompt_ids: list[list[int]], tokens: dict,
                            steps: int) -> dict | None:
    """transformers' own bfloat16 against float32, teacher-forced on the same weights and tokens as
    check 2 (LlamaForCausalLM on the CPU): the largest logit difference as a share of the float32
    logits' RMS, and the top-1 agreement. None where transformers is not installed."""
    try:
        import transformers

        from services.worker.weights import gguf_name
    except ImportError:
        return None
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.context_length, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict({name: weights[gguf_name(name)] for name in model.state_dict()
                           if gguf_name(name) in weights}, strict=False)  # (lm_head: the tied embedding)
    fed = torch.tensor([prompt + tokens[f"r{index}"][:steps] for index, prompt in enumerate(prompt_ids)])
    first = len(prompt_ids[0]) - 1  # (the prompts are of one length) the logits the engine sampled from
    with torch.inference_mode():
        full = model(fed).logits[:, first:].float()
        half = model.to(torch.bfloat16)(fed).logits[:, first:].float()
    rms = float(full.pow(2).mean().sqrt())
    return {"max_of_rms": float((full - half).abs().max()) / rms, "reference_logit_rms": rms,
            "token_agreement": float((full.argmax(-1) == half.argmax(-1)).float().mean()),
            "transformers": transformers.__version__}


def checks(device: torch.device, quick: bool) -> list[dict]:
    results = []
    config = SMOLLM2
    cpu = torch.device("cpu")
    steps = 8 if quick else 24
    prompt_ids = prompts(4, 40 if quick else 100, config.vocab_size)
    cpu_weights = random_weights(config, cpu, torch.float32)
    reference_engine = make_engine(config, cpu, torch.float32, cpu_weights, kv_blocks=256)
    reference = run_greedy(reference_engine, prompt_ids, steps)
    del reference_engine
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        weights = {name: tensor.to(device) for name, tensor in cpu_weights.items()}
        fp32 = make_engine(config, device, torch.float32, weights, kv_blocks=256)
        results.append(compare("1. float32 CUDA vs CPU (greedy tokens, logits)", reference,
                               run_greedy(fp32, prompt_ids, steps), atol=1e-3))
        del fp32
    else:
        weights = cpu_weights
    # 2. bfloat16 against float32, within what bfloat16 costs transformers on the same weights and tokens
    bound = transformers_bf16_bound(config, cpu_weights, prompt_ids, reference[0], steps)
    own_of_rms = bound["max_of_rms"] if bound else TRANSFORMERS_BF16_OF_RMS
    own_agreement = bound["token_agreement"] if bound else 1.0
    print(f"transformers' own bfloat16 vs float32 here: max |logit difference| {own_of_rms:.4f} x RMS, top-1 agreement "
          f"{own_agreement:.1%}" + ("" if bound else " (the constant measured with transformers installed)"), flush=True)
    bf16 = make_engine(config, device, torch.bfloat16, weights, kv_blocks=256)
    where = "CUDA" if device.type == "cuda" else "CPU"
    results.append(compare(f"2. bfloat16 {where} vs float32 CPU (teacher-forced logits)", reference,
                           run_greedy(bf16, prompt_ids, steps, forced=reference[0]),
                           of_rms=BF16_MARGIN * own_of_rms, min_agreement=own_agreement - 0.05)
                   | {"transformers_bf16_vs_float32": bound or {"max_of_rms": TRANSFORMERS_BF16_OF_RMS,
                                                               "measured": "constant"}})
    del bf16
    # 3. replays against the same padded steps run eagerly: bit-exact, in the serving dtype
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        weights = {name: tensor.to(device, dtype) for name, tensor in cpu_weights.items()}
    static = make_engine(config, device, dtype, weights, kv_blocks=512, graphs=True, max_batch=32)
    static.graphs.capture = False  # (the same fixed-shape steps, run eagerly)
    graphed = make_engine(config, device, dtype, weights, kv_blocks=512, graphs=True, max_batch=32)
    what = "CUDA graph replay" if device.type == "cuda" else "static decode (no capture on the CPU)"
    for size in (3, 13):  # padded to buckets 4 and 16; 60 + 24 steps crosses the 64-token context bucket
        batch_prompts = prompts(size, 60, config.vocab_size, seed=size)
        results.append(compare(f"3. {what} ({attention_of(graphed)}) vs the same padded steps run eagerly, "
                               f"{str(dtype).removeprefix('torch.')}, batch {size}",
                               run_greedy(static, batch_prompts, steps), run_greedy(graphed, batch_prompts, steps),
                               atol=0.0))
    # On CUDA the replays must have used the in-place kernel (it passed the engine's self-check)
    on_cuda_in_place = graphed.graphs.captured > 0 and graphed.graphs.in_place
    results.append({"check": "graphs captured", "passed": on_cuda_in_place or device.type != "cuda",
                    "captured": graphed.graphs.captured, "decode_steps_in_fixed_shapes": graphed.graphs.steps,
                    "attention": attention_of(graphed)})
    print(f"{'PASS' if results[-1]['passed'] else 'FAIL'} graphs: {graphed.graphs.captured} captured, "
          f"{graphed.graphs.steps} decode steps in fixed shapes, attention {attention_of(graphed)}", flush=True)
    del static, graphed
    # 4. fixed-shape steps (padded; on CUDA the in-place kernel) against the plain eager path, float32
    weights = {name: tensor.to(device) for name, tensor in cpu_weights.items()}
    eager = make_engine(config, device, torch.float32, weights, kv_blocks=512, max_batch=32)
    graphed = make_engine(config, device, torch.float32, weights, kv_blocks=512, graphs=True, max_batch=32)
    for size in (3, 13):
        batch_prompts = prompts(size, 60, config.vocab_size, seed=size)
        results.append(compare(f"4. float32 {what} ({attention_of(graphed)}) vs the eager path, batch {size}",
                               run_greedy(eager, batch_prompts, steps), run_greedy(graphed, batch_prompts, steps),
                               atol=1e-3))
    return results


def bandwidth(device: torch.device) -> tuple[float, str]:
    if device.type != "cuda":
        return 0.0, "none (CPU)"
    name = torch.cuda.get_device_name(device)
    for key, value in BANDWIDTH.items():
        if key in name:
            return value, f"{name}: published {value / 1e12:.2f} TB/s"
    data = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy = torch.empty_like(data)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        copy.copy_(data)
    torch.cuda.synchronize()
    measured = 2 * 10 * data.numel() / (time.perf_counter() - started)
    return measured, f"{name}: measured copy {measured / 1e12:.2f} TB/s"


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes a decode step reads: every projection, the LM head (the embedding, tied) and the norms."""
    element = torch.finfo(dtype).bits // 8
    hidden, q, kv = config.hidden_size, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.ffn_size + 2 * hidden
    return element * (config.n_layers * per_layer + config.vocab_size * hidden + hidden)


def decode_seconds(engine: Engine, batch: int, context: int, steps: int) -> tuple[float, dict]:
    """Seconds per decode step of `batch` requests at about `context` tokens; on CUDA also one more
    step under the torch profiler: the GPU's busy time (its kernels' durations) and kernel count."""
    engine.reset()
    prompt_ids = prompts(batch, context, engine.config.vocab_size, seed=batch)
    last = {}
    for index, prompt in enumerate(prompt_ids):
        engine.add_request(str(index), Greedy())
    outcome = engine.step([Item(str(index), tuple(prompt), 0, True, 0) for index, prompt in enumerate(prompt_ids)])
    last = outcome.tokens
    for warm in range(1, 4):  # captures happen here, uncounted
        outcome = engine.step([Item(key, (last[key],), context + warm - 1, True, warm) for key in last])
        last = outcome.tokens
    synchronize(engine)
    started = time.perf_counter()
    for step in range(4, 4 + steps):
        outcome = engine.step([Item(key, (last[key],), context + step - 1, True, step) for key in last])
        last = outcome.tokens
    synchronize(engine)
    elapsed = time.perf_counter() - started
    device_figures = {}
    if engine.model.device.type == "cuda":
        step = 4 + steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profile:
            engine.step([Item(key, (last[key],), context + step - 1, True, step) for key in last])
            synchronize(engine)
        kernels = [event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        device_figures = {"gpu_busy_ms": sum(event.time_range.elapsed_us() for event in kernels) / 1000,
                          "kernels": len(kernels)}
    engine.reset()
    return elapsed / steps, device_figures


def synchronize(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()


def benchmark(device: torch.device, quick: bool) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    speed, source = bandwidth(device)
    shapes = [("SmolLM2-135M", SMOLLM2)] + ([] if quick else [("Llama-3.2-1B", LLAMA_1B)])
    batches = (1, 4) if quick else (1, 16, 64)
    context, steps = (64, 4) if quick else (256, 32)
    # (CUDA graphs, --compile, in-place attention): graphs replay the compiled kernels too (compiled
    # during the warm-up); graphs without the in-place kernel gather each row's blocks per layer
    setups = (((False, False, True), (True, False, False), (True, False, True), (True, True, True))
              if device.type == "cuda" else ((False, False, True),))
    for name, config in shapes:
        weights = random_weights(config, device, dtype)
        kv_blocks = (max(batches) * (context + steps + 8)) // BLOCK_SIZE + max(batches) + 8
        for graphs, compile, in_place in setups:
            engine = None
            try:
                engine = make_engine(config, device, dtype, weights, kv_blocks=kv_blocks, graphs=graphs,
                                     max_batch=max(batches), compile=compile, in_place=in_place)
                attention = attention_of(engine)
                for batch in batches:
                    started = time.perf_counter()
                    seconds, device_figures = decode_seconds(engine, batch, context, steps)
                    kv_read = batch * context * 2 * config.n_layers * config.n_kv_heads * config.head_dim * (
                        torch.finfo(dtype).bits // 8)
                    roofline = batch * speed / (weight_bytes(config, dtype) + kv_read) if speed else None
                    row = {"model": name, "dtype": str(dtype).removeprefix("torch."), "cuda_graphs": graphs,
                           "compile": compile, "attention": attention, "batch": batch, "context": context,
                           "step_ms": 1000 * seconds,
                           "tok_per_s": batch / seconds, "roofline_tok_per_s": roofline, **device_figures,
                           "seconds_to_measure": round(time.perf_counter() - started, 1)}
                    rows.append(row)
                    print(f"{name} graphs={graphs} compile={compile} attention={attention} batch={batch}: "
                          f"{1000 * seconds:.2f} ms/step, "
                          f"{batch / seconds:.0f} tok/s"
                          + (f" (roofline {roofline:.0f}, {batch / seconds / roofline:.0%})" if roofline else "")
                          + (f", GPU busy {device_figures['gpu_busy_ms']:.2f} ms in {device_figures['kernels']} "
                             f"kernels" if device_figures else ""), flush=True)
            except Exception as error:  # a setup that fails on this device is reported, the rest still run
                print(f"FAIL {name} graphs={graphs} compile={compile} in_place={in_place}: {type(error).__name__}: "
                      f"{error}", flush=True)
                rows.append({"model": name, "cuda_graphs": graphs, "compile": compile, "in_place": in_place,
                             "error": f"{type(error).__name__}: {error}"})
            del engine
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nBandwidth: {source}\n")
    print("| model | CUDA graphs | compile | attention | batch | ms/step | tok/s | roofline tok/s | of roofline | "
          "GPU busy ms | kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            continue
        roofline = row["roofline_tok_per_s"]
        of_roofline = f"{row['tok_per_s'] / roofline:.0%}" if roofline else "-"
        roofline_text = f"{roofline:.0f}" if roofline else "-"
        busy = f"{row['gpu_busy_ms']:.2f}" if "gpu_busy_ms" in row else "-"
        print(f"| {row['model']} {row['dtype']} | {'yes' if row['cuda_graphs'] else 'no'} | "
              f"{'yes' if row['compile'] else 'no'} | {row.get('attention', '-')} | {row['batch']} | "
              f"{row['step_ms']:.2f} | {row['tok_per_s']:.0f} | "
              f"{roofline_text} | {of_roofline} | {busy} | {row.get('kernels', '-')} |")
    return rows


def measured_profile(rows: list[dict], device: torch.device, speed: float, source: str, out_dir: Path) -> Path | None:
    """An emulated-executor profile (profiles/*.json format) calibrated from the Llama-3.2-1B decode
    steps just measured: `--hardware <this file>` then emulates this GPU as measured."""
    if device.type != "cuda" or not speed:
        return None
    mine = [row for row in rows if row["model"] == "Llama-3.2-1B" and "error" not in row and not row["compile"]]
    graphed = [row for row in mine if row["cuda_graphs"] and row.get("attention") != "gather"] or mine
    if not graphed:
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((value for key, value in PEAK_BF16_TFLOPS.items() if key in name), None)
    if peak is None:
        print(f"no published peak for {name}: no profile written", flush=True)
        return None
    config = LLAMA_1B
    model = {"n_layers": config.n_layers, "hidden_size": config.hidden_size, "ffn_size": config.ffn_size,
             "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "head_dim": config.head_dim,
             "vocab_size": config.vocab_size, "context_length": config.context_length, "dtype_bytes": 2,
             "tied_embeddings": True, "gated_ffn": True}
    memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    slug = "".join(character if character.isalnum() else "-" for character in name.lower()).strip("-")
    profile = profile_from_measurement(
        f"measured-{slug}-llama3.2-1b", model,
        {"name": name, "memory_bandwidth_gb_s": speed / 1e9, "peak_tflops": peak, "memory_gb": round(memory_gb, 1),
         "source": source}, graphed[0]["context"], {row["batch"]: row["step_ms"] / 1000 for row in graphed})
    profile["description"] = f"Llama-3.2-1B's shape (random weights) in bfloat16 on {name}, as measured"
    path = out_dir / f"{profile['name']}.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"profile written: {path} (memory efficiency {profile['efficiency']['memory']:.0%}, launch "
          f"{profile['efficiency']['launch_ms']:.2f} ms)", flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (small sizes) even if CUDA is there")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    quick = device.type == "cpu"
    if quick:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    started = time.time()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'CPU'}"
          f"{' (quick sizes: no GPU)' if quick else ''}", flush=True)
    report = {"executor": "engine", "device": str(device), "torch": torch.__version__, "checks": checks(device, quick),
              "benchmark": benchmark(device, quick), "seconds": round(time.time() - started, 1)}
    out = args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else
                       Path(__file__).resolve().parent / "results" / f"gpu_check{'_cpu' if quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    speed, source = bandwidth(device)
    profile = measured_profile(report["benchmark"], device, speed, source, out.parent)
    report["profile_written"] = str(profile) if profile else None
    out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [check["check"] for check in report["checks"] if not check["passed"]]
    print(f"\n{len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed "
          f"in {report['seconds']} s; written to {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
