"""The emulated executor (services/worker/emulated.py) and its hardware profiles: the roofline on
hand-computed cases, exact seeded outputs, the same KV block accounting as the real engine on the
same plans, clear errors for bad profiles, and the whole system running on emulated workers."""

import concurrent.futures
import json
import random
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from services.bench.by_request_id import apply_result
from services.scheduler.policy import SchedulerPolicy
from services.worker.emulated import FIRST_TOKEN, EmulatedEngine, context_digest, emulated_token, emulated_tokens
from services.worker.hardware import ProfileError, known_profiles, load_profile, parse_profile
from shared.messages import BatchPlan, NewRequest, PlanResult, RequestRecord, SampledToken, SamplingParams, StepItem
from tests.engine_helpers import TINY_CONFIG, tiny_engine

TOY = {  # round numbers, to compute by hand
    "name": "toy",
    "model": {"n_layers": 2, "hidden_size": 4, "ffn_size": 8, "n_heads": 2, "n_kv_heads": 1, "head_dim": 2,
              "vocab_size": 10, "context_length": 100, "dtype_bytes": 2, "tied_embeddings": True},
    "device": {"memory_bandwidth_gb_s": 1e-6, "peak_tflops": 1e-9, "memory_gb": 1e-5},  # 1000 B/s, 1000 FLOP/s
    "efficiency": {"memory": 0.5, "compute": 0.25, "launch_ms": 1.0},
}


def test_the_roofline_on_hand_computed_steps():
    profile = parse_profile(TOY)
    # Per layer: q 4x4 + k, v 2 x 4x2 + o 4x4 + gate, up, down 3 x 4x8 = 16 + 16 + 16 + 96 = 144 parameters.
    assert profile.model.layer_parameters == 144
    # Read per step: 2 bytes x (2 layers x 144 + LM head 10x4 + norms (2 x 2 + 1) x 4) = 2 x 348 = 696.
    assert profile.model.weight_bytes == 696
    assert profile.model.kv_bytes_per_token == 16  # K and V x 2 layers x 1 head x 2 dims x 2 bytes
    # A decode item at position 10: bytes 696 + (11 attended + 1 written) x 16 = 888 -> 888 / 500 = 1.776 s;
    # FLOPs 2 x 2 x 144 + LM head 2 x 10 x 4 + attention 4 x 2 x 2 x 2 x 11 pairs = 576 + 80 + 352 = 1008
    # -> 1008 / 250 = 4.032 s: compute-bound; + 1 ms launch.
    assert profile.step_seconds([(10, 1, True)]) == pytest.approx(4.033)
    # A 4-token prefill chunk from 0, not sampled: bytes 696 + (4 + 4) x 16 = 824 -> 1.648 s; FLOPs
    # 4 x 576 + attention 32 x (0 + 4 x 5 / 2) = 2304 + 320 = 2624 -> 10.496 s.
    assert profile.step_seconds([(0, 4, False)]) == pytest.approx(10.497)
    # Both in one step: bytes 696 + (11 + 1 + 4 + 4) x 16 = 1016 -> 2.032 s; FLOPs 5 x 576 + 80 + 32 x 21
    # = 2880 + 80 + 672 = 3632 -> 14.528 s.
    assert profile.step_seconds([(10, 1, True), (0, 4, False)]) == pytest.approx(14.529)
    memory_bound = parse_profile({**TOY, "device": {**TOY["device"], "peak_tflops": 1.0}})
    assert memory_bound.step_seconds([(10, 1, True)]) == pytest.approx(1.777)


def test_h100_llama3_8b_decodes_one_request_in_about_6_to_7_ms():
    profile = load_profile("h100-llama3-8b")
    assert 6e-3 <= profile.decode_step_seconds(1, 512) <= 7e-3
    # Batching is almost free when memory-bound: 64 requests cost well under 2x one request's step.
    assert profile.decode_step_seconds(64, 512) < 2 * profile.decode_step_seconds(1, 512)
    steps = {name: load_profile(name).decode_step_seconds(1, 512) for name in known_profiles()}
    assert 2e-3 < steps["h100-llama3.2-3b"] < 4e-3 and 8e-3 < steps["a100-llama3-8b"] < 12e-3, steps
    assert steps["a100-qwen2.5-32b"] > 25e-3, steps


def test_gpu_memory_utilization_sizes_an_emulated_pool_from_the_profiles_device():
    """vLLM's --gpu-memory-utilization on the profile's device: that share of its memory less the
    weights, in KV blocks; a share the weights fill is refused."""
    from services.worker.emulated import EmulatedEngine
    from shared.config import Settings

    profile = load_profile("a100-llama3-8b")
    per_block = profile.model.kv_bytes_per_token * 16
    expected = int((profile.memory_bytes * 0.9 - profile.model.resident_bytes) // per_block)
    assert profile.kv_blocks_in_share(16, 0.9) == expected > profile.kv_blocks_in_share(16, 0.5) > 0
    engine = EmulatedEngine.from_settings(Settings(executor="emulated", hardware="a100-llama3-8b",
                                                   gpu_memory_utilization=0.9, kv_block_size=16))
    assert engine.kv_cache.blocks_total == expected
    with pytest.raises(ProfileError, match="no room for a KV block"):
        profile.kv_blocks_in_share(16, profile.model.resident_bytes / profile.memory_bytes / 2)


def test_unknown_and_malformed_profiles_are_clear_errors_that_list_the_known_ones(tmp_path):
    with pytest.raises(ProfileError, match="unknown hardware profile 'h900-nope'.*h100-llama3-8b"):
        load_profile("h900-nope")
    with pytest.raises(ProfileError, match="needed"):
        load_profile("")
    broken = tmp_path / "broken.json"
    for content in ("{not json", json.dumps({**TOY, "model": {**TOY["model"], "n_layers": -2}}),
                    json.dumps({**TOY, "efficiency": {**TOY["efficiency"], "memory": 1.5}}),
                    json.dumps({"name": "x"})):
        broken.write_text(content)
        with pytest.raises(ProfileError, match="malformed hardware profile .*known profiles: a100"):
            load_profile(str(broken))


def test_a_worker_with_a_bad_profile_stops_at_start_naming_the_known_ones(redis_url):
    environment = {"REDIS_URL": redis_url, "ITERSERVE_EXECUTOR": "emulated", "ITERSERVE_HARDWARE": "h900-nope",
                   "PATH": "/usr/bin:/bin"}
    process = subprocess.run([sys.executable, "-m", "services.cli", "worker"], env=environment, capture_output=True,
                             text=True, timeout=120)
    assert process.returncode != 0
    assert "unknown hardware profile 'h900-nope'" in process.stderr and "h100-llama3-8b" in process.stderr
    assert "Traceback" not in process.stderr


def emulated(kv_blocks: int = 64, block_size: int = 4, vocab_size: int = 256) -> EmulatedEngine:
    return EmulatedEngine(load_profile("h100-llama3-8b"), kv_blocks, block_size, 64, vocab_size, 512,
                          sleep=lambda seconds: None)


def test_emulated_tokens_depend_on_seed_index_and_context_only_whatever_the_batch():
    engine = emulated()
    seeds = [11, 12, 13, 14, 15]
    for index, seed in enumerate(seeds):
        engine.add_request(f"r{index}", SamplingParams(seed=seed, max_tokens=100))
    alone = engine.step([StepItem(request_id="r0", token_ids=(1, 2, 3), start_position=0, sample=True,
                                  output_index=0)])
    together = engine.step([StepItem(request_id=f"r{index}", token_ids=(1, 2), start_position=0, sample=True,
                                     output_index=0) for index in range(1, 5)])
    assert alone.tokens["r0"] == emulated_token(11, 0, 256, context_digest([1, 2, 3])) == \
        emulated_tokens(11, [1, 2, 3], 1, 256)[0]
    assert [together.tokens[f"r{index}"] for index in range(1, 5)] == [emulated_tokens(seed, [1, 2], 1, 256)[0]
                                                                       for seed in seeds[1:]]
    assert len({emulated_token(seed, index, 256) for seed in range(20) for index in range(20)}) > 170  # of 239
    assert all(FIRST_TOKEN <= emulated_token(seed, 3, 256, digest) < 256 for seed in range(300)
               for digest in (0, 2**64 - 1))
    # The context is the tokens and their places: one changed, moved or missing changes the digest.
    digests = {context_digest(tokens) for tokens in ([1, 2, 3], [1, 2, 4], [2, 1, 3], [1, 2], [1, 2, 3, 0])}
    assert len(digests) == 5


def test_a_kv_fault_changes_emulated_tokens_as_it_would_a_models():
    """The emulated executor's tokens come from what its KV blocks hold: a prompt prefilled in two
    chunks or a block adopted from the prefix cache (holding the same tokens) gives the tokens of
    emulated_tokens; a cached block adopted that holds other tokens, or a block overwritten under a
    request, gives others."""
    prompt = list(range(30, 42))  # 3 blocks of 4
    expected = emulated_tokens(5, prompt, 3, 256)

    def run(engine, request_id: str, start: int, output_index: int = 0) -> int:
        return engine.step([StepItem(request_id, tuple(prompt[start:]), start, True, output_index)]).tokens[request_id]

    engine = emulated()
    engine.add_request("a", SamplingParams(seed=5, max_tokens=3))
    engine.step([StepItem("a", tuple(prompt[:5]), 0, False, 0)])
    assert run(engine, "a", 5) == expected[0]
    decoded = engine.step([StepItem("a", (expected[0],), len(prompt), True, 1)]).tokens["a"]
    assert decoded == expected[1]
    engine.take_plan(BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w", register_blocks=(
        ("a", 0, b"0" * 16), ("a", 1, b"1" * 16)), free_request_ids=("a",)))
    engine.take_plan(BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w", new_requests=(
        NewRequest(request_id="b", sampling=SamplingParams(seed=5, max_tokens=3), cached_blocks=(b"0" * 16, b"1" * 16)),
    )))
    assert run(engine, "b", 8) == expected[0]  # the same tokens in the cached blocks: the same output
    # Another prompt's blocks under this prompt's names (what a wrong hash would do): another output.
    other = emulated()
    other.add_request("c", SamplingParams(seed=5, max_tokens=3))
    other.step([StepItem("c", tuple(range(60, 72)), 0, True, 0)])
    other.take_plan(BatchPlan(scheduler_epoch="e", plan_id=1, worker_id="w", register_blocks=(
        ("c", 0, b"0" * 16), ("c", 1, b"1" * 16)), free_request_ids=("c",)))
    other.take_plan(BatchPlan(scheduler_epoch="e", plan_id=2, worker_id="w", new_requests=(
        NewRequest(request_id="d", sampling=SamplingParams(seed=5, max_tokens=3), cached_blocks=(b"0" * 16, b"1" * 16)),
    )))
    assert run(other, "d", 8) != expected[0]
    # A block of a running request overwritten (a lost block): its next token changes.
    lost = emulated()
    lost.add_request("e", SamplingParams(seed=5, max_tokens=3))
    assert run(lost, "e", 0) == expected[0]
    lost.kv_cache.block_sums[lost.kv_cache.block_table(lost.row("e"))[1]] += 1
    assert lost.step([StepItem("e", (expected[0],), len(prompt), True, 1)]).tokens["e"] != expected[1]


def test_emulated_steps_take_the_profiles_time():
    slept = []
    engine = EmulatedEngine(load_profile("h100-llama3-8b"), 64, 16, 64, 256, 512, sleep=slept.append)
    engine.add_request("a", SamplingParams(seed=1, max_tokens=9))
    engine.step([StepItem(request_id="a", token_ids=tuple(range(20, 120)), start_position=0, sample=True,
                                    output_index=0)])
    expected = load_profile("h100-llama3-8b").step_seconds([(0, 100, True)])
    assert slept and expected - 0.002 < slept[0] <= expected  # the host time spent already counts


def test_kv_accounting_matches_the_real_engine_replaying_the_same_plans():
    """One plan log (from the real scheduler policy, with preemptions under a small pool), run by
    the real engine and by the emulated one: after every plan the same refusals, the same free
    blocks and the same KV length for every request."""
    real = tiny_engine(kv_blocks=24, kv_block_size=4)
    fake = emulated(kv_blocks=24, block_size=4, vocab_size=TINY_CONFIG.vocab_size)
    policy = SchedulerPolicy("replay", context_length=TINY_CONFIG.context_length, stop_token_ids=(), pipeline_depth=1,
                             max_batch_size=8, max_batch_tokens=24)
    policy.worker_up("w", kv_blocks_total=24, kv_block_size=4)
    rng = random.Random(3)
    for index in range(10):
        prompt = tuple(rng.randrange(TINY_CONFIG.vocab_size) for _ in range(rng.randint(2, 20)))
        policy.add_request(RequestRecord(request_id=f"r{index}", prompt_token_ids=prompt, arrival_time=index,
                                         sampling=SamplingParams(seed=index, max_tokens=rng.randint(3, 12))))
    plans = 0
    while (plan := policy.next_plan("w")) is not None:
        plans += 1
        outcomes = []
        for engine in (real, fake):
            engine.take_plan(plan)
            outcomes.append(engine.step(plan.items))
        got, emulated_outcome = outcomes
        assert [(e.request_id, e.code) for e in got.errors] == [(e.request_id, e.code) for e in emulated_outcome.errors]
        assert real.kv_cache.blocks_free == fake.kv_cache.blocks_free, f"plan {plan.plan_id}"
        for item in plan.items:
            assert real.kv_length(item.request_id) == fake.kv_length(item.request_id), item.request_id
        apply_result(policy, PlanResult(
            scheduler_epoch="replay", plan_id=plan.plan_id, worker_id="w", kv_blocks_total=24,
            kv_blocks_free=real.kv_cache.blocks_free, step_seconds=0.0, errors=tuple(
                _item_error(error) for error in got.errors),
            tokens=tuple(SampledToken(request_id=request_id, token_id=token, output_index=_index(plan, request_id))
                         for request_id, token in got.tokens.items())))
        policy.take_finished_without_token()
        policy.take_iteration_records()
    assert plans > 20 and real.kv_cache.blocks_free == fake.kv_cache.blocks_free


def _index(plan, request_id: str) -> int:
    return next(item.output_index for item in plan.items if item.request_id == request_id)


def _item_error(error):
    from shared.messages import ItemError

    return ItemError(request_id=error.request_id, code=error.code, message=error.message)


@pytest.mark.slow
def test_the_whole_system_on_emulated_workers_says_so_and_gives_exact_seeded_outputs():
    from tests.system import System, assert_emulated_completion

    with System("--executor", "emulated", "--hardware", "h100-llama3-8b", workers=2) as system:
        assert_emulated_completion(system.url)
        deadline = time.monotonic() + 10
        while True:  # /status shows each worker's last heartbeat (every 0.5 s)
            with urllib.request.urlopen(f"{system.url}/status", timeout=10) as response:
                workers = json.loads(response.read())["workers"]
            if sum(w["busy_seconds"] for w in workers) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [(w["executor"], w["hardware"], w["device"]) for w in workers] == [
            ("emulated", "h100-llama3-8b", "emulated:h100-llama3-8b")] * 2
        assert sum(w["busy_seconds"] for w in workers) > 0, "no heartbeat counted the step's time"
        worker_lines = [line for line in system.log().splitlines() if line.startswith("worker-")]
        assert worker_lines and all("EMULATED[h100-llama3-8b]" in line for line in worker_lines
                                    if " INFO " in line or " WARNING " in line)
        # Each service's start-up heap is out of the collector's reach (shared/startup_heap.py)
        frozen = re.findall(r"event=startup_heap_frozen service=(\w+) objects=(\d+)", system.log())
        assert sorted(service for service, _ in frozen) == ["gateway", "scheduler", "worker", "worker"]
        assert all(int(objects) > 10_000 for _, objects in frozen)
        # Every place a result can be read says EMULATED: the answers' header, /health, every worker
        # metric's executor label, the scheduler's and the gateway's start lines, a bench report's first line.
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2}).encode()
        for stream in (False, True):
            request = urllib.request.Request(f"{system.url}/v1/completions", headers={"Content-Type": "application/json"},
                                             data=body[:-1] + (b', "stream": true}' if stream else b"}"))
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.headers["x-iterserve-executor"] == "emulated", (stream, dict(response.headers))
                response.read()
        with urllib.request.urlopen(f"{system.url}/health", timeout=10) as response:
            health = json.loads(response.read())
        assert health["executor"] == "emulated" and "EMULATED" in health["note"], health
        assert health["models"]["smollm2-135m-instruct"]["executors"] == ["emulated"], health
        with urllib.request.urlopen(f"{system.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        worker_samples = [line for line in metrics.splitlines() if line.startswith("iterserve_worker_")]
        assert len(worker_samples) >= 6 and all('executor="emulated"' in line for line in worker_samples), \
            worker_samples
        log = system.log()
        assert re.search(r"scheduler\s*\| .*scheduler_started .*executor=EMULATED:h100-llama3-8b", log)
        assert re.search(r"gateway\s*\| .*gateway listening on .*executor=EMULATED:h100-llama3-8b", log)
        bench = subprocess.run([sys.executable, "-m", "services.cli", "bench", "--url", system.url,
                                "--num-requests", "2", "--output-range", "2", "2", "--input-range", "8", "16",
                                "--no-progress", "--output", "/dev/null"],
                               capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert bench.stdout.splitlines()[0].startswith("### iterserve bench (EMULATED workers: no model ran)"), \
            bench.stdout[:300]


def test_plans_as_long_as_the_plan_time_allows_on_workers_of_fast_steps():
    """`--scheduler-steps 16 --scheduler-plan-ms 12` on a worker of about 3.4 ms steps (EMULATED
    h100-llama3.2-3b, a little faster at these short contexts): its plans of decodes run 3 or 4
    steps (fewer when its steps run slower than the profile, on a busy host), not 16 nor 1, and
    every seeded output is still exact."""
    from shared.tokenizer import Tokenizer
    from tests.system import System

    seeds, length = (5, 6, 7), 48
    with System("--executor", "emulated", "--hardware", "h100-llama3.2-3b", "--scheduler-steps", "16",
                "--scheduler-plan-ms", "12", workers=1) as system:
        def complete(seed: int) -> str:
            body = json.dumps({"model": "smollm2-135m-instruct", "prompt": f"Count to {seed}", "max_tokens": length,
                               "seed": seed, "temperature": 0.8, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{system.url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
            texts = list(pool.map(complete, seeds))
        deadline = time.monotonic() + 10
        while True:  # /status shows the scheduler's heartbeat (every 0.5 s): its counts after the last plan
            with urllib.request.urlopen(f"{system.url}/status", timeout=10) as response:
                scheduler = json.loads(response.read())["scheduler"]
            if scheduler["iterations"] >= length or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    tokenizer = Tokenizer.load()
    assert texts == [tokenizer.decode(emulated_tokens(seed, tokenizer.encode_prompt(f"Count to {seed}"), length,
                                                      tokenizer.vocab_size)) for seed in seeds]
    # (the plans of prompts run one step each, and the first plan runs one before a step is measured)
    steps_a_plan = scheduler["iterations"] / scheduler["plans"]
    assert 1.4 < steps_a_plan <= 4, scheduler


def test_a_profile_written_from_measured_steps_reproduces_them_and_loads(tmp_path):
    """benchmarks/gpu_check.py writes a profile from decode steps measured on a lent GPU: fed the
    steps a known profile gives, the fit recovers its memory efficiency and launch cost."""
    from services.worker.hardware import PROFILES, profile_from_measurement

    known = json.loads((PROFILES / "h100-llama3-8b.json").read_text())
    original = load_profile("h100-llama3-8b")
    measured = {batch: original.decode_step_seconds(batch, 256) for batch in (1, 16, 64)}
    written = profile_from_measurement("measured-h100-llama3-8b", known["model"], known["device"], 256, measured)
    assert written["efficiency"]["memory"] == pytest.approx(0.77, abs=1e-3)
    assert written["efficiency"]["launch_ms"] == pytest.approx(0.3, abs=1e-3)
    assert "measured by benchmarks/gpu_check.py" in written["efficiency"]["calibration"]
    profile = load_profile_from(written, tmp_path)
    for batch, seconds in measured.items():
        assert profile.decode_step_seconds(batch, 256) == pytest.approx(seconds, rel=1e-3)
    # One point only: no launch to fit, the whole step is bandwidth.
    single = profile_from_measurement("one", known["model"], known["device"], 256, {1: measured[1]})
    assert single["efficiency"]["launch_ms"] == 0.0
    assert load_profile_from(single, tmp_path).decode_step_seconds(1, 256) == pytest.approx(measured[1], rel=1e-3)


def load_profile_from(data: dict, folder):
    path = folder / f"{data['name']}.json"
    path.write_text(json.dumps(data))
    return load_profile(str(path))


def test_the_gpu_check_writes_a_profile_the_emulated_executor_loads(tmp_path, monkeypatch):
    """The CUDA-only end of benchmarks/gpu_check.py, run here with the device's answers stubbed
    (no GPU on this machine): from its Llama-3.2-1B rows it writes a profile that loads and
    reproduces the measured steps."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=141e9))
    config = gpu_check.LLAMA_1B
    truth = parse_profile({  # what the GPU "measures": this shape at 70% of 4.8 TB/s, 0.2 ms a step
        "model": {"n_layers": config.n_layers, "hidden_size": config.hidden_size, "ffn_size": config.ffn_size,
                  "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "head_dim": config.head_dim,
                  "vocab_size": config.vocab_size, "context_length": config.context_length, "dtype_bytes": 2,
                  "tied_embeddings": True},
        "device": {"memory_bandwidth_gb_s": 4800, "peak_tflops": 989, "memory_gb": 141},
        "efficiency": {"memory": 0.7, "compute": 0.6, "launch_ms": 0.2}})
    steps = {batch: truth.decode_step_seconds(batch, 256) for batch in (1, 16, 64)}
    rows = [{"model": "Llama-3.2-1B", "cuda_graphs": True, "compile": False, "batch": batch, "context": 256,
             "step_ms": 1000 * seconds} for batch, seconds in steps.items()]
    rows += [{"model": "SmolLM2-135M", "cuda_graphs": True, "compile": False, "batch": 1, "context": 256,
              "step_ms": 0.2}]
    # The compiled setup's rows (and a setup that failed) are not the profile's: it is the default engine's.
    rows += [{"model": "Llama-3.2-1B", "cuda_graphs": True, "compile": True, "batch": batch, "context": 256,
              "step_ms": 500 * seconds} for batch, seconds in steps.items()]
    rows += [{"model": "Llama-3.2-1B", "cuda_graphs": False, "compile": True, "error": "RuntimeError: no"}]
    written = gpu_check.measured_profile(rows, torch.device("cuda"), 4.8e12, "published", tmp_path)
    assert written == tmp_path / "measured-nvidia-h200-llama3.2-1b.json"
    profile = load_profile(str(written))
    assert profile.device_name == "NVIDIA H200" and profile.peak_flops == 989e12
    assert profile.memory_efficiency == pytest.approx(0.7, abs=1e-3)
    assert profile.launch_seconds == pytest.approx(0.0002, abs=1e-6)
    for batch, seconds in steps.items():
        assert profile.decode_step_seconds(batch, 256) == pytest.approx(seconds, rel=1e-3)
    assert gpu_check.measured_profile(rows, torch.device("cpu"), 0.0, "none", tmp_path) is None


@pytest.mark.timeout(60)
async def test_a_worker_runs_the_plans_read_ahead_back_to_back_and_answers_them_in_order(redis_client, redis_url):
    """Plans queued faster than steps run: the worker's step thread goes from one to the next
    without a hop back to the event loop, and the results still go out one at a time, in plan
    order, each with the tokens of its own step."""
    import asyncio

    from services.worker.service import Worker
    from shared import keys
    from shared.config import Settings
    from shared.messages import BatchPlan, NewRequest
    from services.bench.by_request_id import PlanCodec, read_result

    settings = Settings(redis_url=redis_url, executor="emulated", hardware="h100-llama3-8b", kv_blocks=64,
                        drain_seconds=0.5)  # (it still holds r1 at the end)
    # Steps that take no time: results come faster than Redis takes them, so publishes would overlap.
    engine = EmulatedEngine(load_profile("h100-llama3-8b"), 64, 16, 8, 49152, 2048, sleep=lambda seconds: None)
    worker = Worker(settings, engine, "w-ahead")
    hops = []
    run_ready = worker._run_ready
    worker._run_ready = lambda *args: (hops.append(len(worker._ready)), run_ready(*args))[1]
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    codec, stream, prompt, seed, steps = PlanCodec(), keys.plan_stream("w-ahead"), (5, 6, 7), 11, 16
    plans = [BatchPlan(scheduler_epoch="e1", plan_id=1, worker_id="w-ahead", new_requests=(
        NewRequest(request_id="r1", sampling=SamplingParams(max_tokens=steps, seed=seed)),),
        items=(StepItem("r1", prompt, 0, True, 0),))]
    plans += [BatchPlan(scheduler_epoch="e1", plan_id=index + 1, worker_id="w-ahead",
                        items=(StepItem("r1", (), len(prompt) + index - 1, True, index, True),))
              for index in range(1, steps)]
    try:
        await asyncio.sleep(0.3)  # the worker is reading its plan stream
        async with redis_client.pipeline(transaction=False) as pipe:
            for plan in plans:
                pipe.xadd(stream, {"m": codec.encode(plan)})
            await pipe.execute()
        answers, last = [], "-"
        async with asyncio.timeout(20):
            while len(answers) < steps:
                for entry_id, fields in await redis_client.xrange(worker.keys.results, min=last):
                    if entry_id != last:
                        answers.append(codec.decode_result(read_result(fields[b"m"])[1]))
                        last = entry_id
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
    assert [answer.plan_id for answer in answers] == list(range(1, steps + 1))
    assert [[(token.request_id, token.output_index, token.token_id) for token in answer.tokens]
            for answer in answers] == [[("r1", index, token)]
                                       for index, token in enumerate(emulated_tokens(seed, prompt, steps,
                                                                                     engine.vocab_size))]
    assert len(hops) < steps / 2, f"the step thread went back to the loop after most plans: {hops}"


def emulated_worker(redis_url: str, worker_id: str):
    """A Worker over an emulated engine whose steps take no time, and the plan ids of each result
    write it makes (its _publish watched)."""
    from services.worker.service import Worker
    from shared.config import Settings

    settings = Settings(redis_url=redis_url, executor="emulated", hardware="h100-llama3-8b", kv_blocks=64,
                        drain_seconds=0.5)
    engine = EmulatedEngine(load_profile("h100-llama3-8b"), 64, 16, 8, 49152, 2048, sleep=lambda seconds: None)
    worker = Worker(settings, engine, worker_id)
    published: list[list[int]] = []
    publish = worker._publish
    worker._publish = lambda answers, *args, **kwargs: (published.append([a.plan.plan_id for a in answers]),
                                                        publish(answers, *args, **kwargs))[1]
    return worker, engine, published


@pytest.mark.timeout(60)
async def test_plans_sent_together_are_answered_in_one_write_and_no_answer_waits_for_a_plan_not_there(
        redis_client, redis_url):
    """Settings.answer_every: a plan that says "answer with the next" has its result held while the
    next plan is there to run, and written with that one's (the results in plan order, with their
    token entries first); one whose next plan has not come is answered at once, alone."""
    import asyncio

    from shared import keys
    from shared.messages import BatchPlan, NewRequest
    from services.bench.by_request_id import PlanCodec, read_result

    worker, engine, published = emulated_worker(redis_url, "w-together")
    request_id = "0" * 31 + "1"
    run_id = (await redis_client.info("server"))["run_id"]
    await redis_client.set(worker.keys.incarnation, f"e1 {run_id}")  # the pool loaded under e1: entries land
    await redis_client.hset(keys.request_key(request_id), "status", "running")
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    codec, stream, prompt, seed, steps = PlanCodec(), keys.plan_stream("w-together"), (5, 6, 7), 11, 9
    plans = [BatchPlan(scheduler_epoch="e1", plan_id=1, worker_id="w-together", new_requests=(
        NewRequest(request_id=request_id, sampling=SamplingParams(max_tokens=steps, seed=seed), entries_below=steps,
                   text_context=prompt),), items=(StepItem(request_id, prompt, 0, True, 0),))]
    plans += [BatchPlan(scheduler_epoch="e1", plan_id=index + 1, worker_id="w-together",
                        items=(StepItem(request_id, (), len(prompt) + index - 1, True, index, True),))
              for index in range(1, steps)]

    answers = []

    async def answers_until(count: int) -> None:
        async with asyncio.timeout(20):
            while len(answers) < count:
                results = await redis_client.xrange(worker.keys.results)
                answers.extend(codec.decode_result(read_result(fields[b"m"])[1]) for _, fields in results[len(answers):])
                await asyncio.sleep(0.05)

    try:
        await asyncio.sleep(0.3)  # the worker is reading its plan stream
        async with redis_client.pipeline(transaction=True) as pipe:  # (read in one XREAD: all there to run)
            for plan in plans[:8]:
                pipe.xadd(stream, {"m": codec.encode(plan, answer_with_next=plan.plan_id % 2 == 1)})
            await pipe.execute()
        await answers_until(8)
        # The last plan of a group whose next plan is not there (the scheduler sent one): at once
        await redis_client.xadd(stream, {"m": codec.encode(plans[8], answer_with_next=True)})
        await answers_until(9)
        entries = await redis_client.xrange(keys.token_stream(request_id))
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
        await redis_client.delete(keys.request_key(request_id), keys.token_stream(request_id))
    assert published == [[1, 2], [3, 4], [5, 6], [7, 8], [9]]
    assert [answer.plan_id for answer in answers] == list(range(1, steps + 1))
    assert [[(token.output_index, token.token_id) for token in answer.tokens] for answer in answers] == \
        [[(index, token)] for index, token in enumerate(emulated_tokens(seed, prompt, steps, engine.vocab_size))]
    # every token's entry but the last (the scheduler's: it ends the request), in order
    assert [entry_id for entry_id, _ in entries] == [f"0-{index + 1}".encode() for index in range(steps - 1)]


@pytest.mark.timeout(60)
async def test_a_plan_of_several_steps_runs_them_all_and_answers_them_in_one_result(redis_client, redis_url):
    """Settings.scheduler_steps: a plan of decodes that says it runs N steps is run N times over,
    each step feeding the token the step before sampled (output index and plan id one more each
    step), all the steps answered by one result, written after their token entries; an item that
    runs fewer steps (its request's max_tokens) stops there."""
    import asyncio

    from shared import keys
    from shared.messages import BatchPlan, NewRequest
    from services.bench.by_request_id import PlanCodec, read_result

    worker, engine, published = emulated_worker(redis_url, "w-steps")
    long_id, short_id = "0" * 31 + "1", "0" * 31 + "2"
    run_id = (await redis_client.info("server"))["run_id"]
    await redis_client.set(worker.keys.incarnation, f"e1 {run_id}")  # the pool loaded under e1: entries land
    for request_id in (long_id, short_id):
        await redis_client.hset(keys.request_key(request_id), "status", "running")
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    codec, stream, prompt = PlanCodec(), keys.plan_stream("w-steps"), (5, 6, 7)
    first = BatchPlan(scheduler_epoch="e1", plan_id=1, worker_id="w-steps", new_requests=tuple(
        NewRequest(request_id=request_id, sampling=SamplingParams(max_tokens=20, seed=seed), entries_below=20,
                   text_context=prompt) for request_id, seed in ((long_id, 11), (short_id, 12))),
        items=(StepItem(long_id, prompt, 0, True, 0), StepItem(short_id, prompt, 0, True, 0)))
    # Then 5 steps more of both fed decodes, the second request's only 2 of them
    second = BatchPlan(scheduler_epoch="e1", plan_id=2, worker_id="w-steps", items=(
        StepItem(long_id, (), len(prompt), True, 1, True), StepItem(short_id, (), len(prompt), True, 1, True)))
    answers = []
    try:
        await asyncio.sleep(0.3)  # the worker is reading its plan stream
        await redis_client.xadd(stream, {"m": codec.encode(first)})
        await redis_client.xadd(stream, {"m": codec.encode(second, steps=5, item_steps=[5, 2])})
        async with asyncio.timeout(20):
            while len(results := await redis_client.xrange(worker.keys.results)) < 2:
                await asyncio.sleep(0.05)
            for _, fields in results:
                answers.extend(codec.decode_results(read_result(fields[b"m"])[1]))
        entries = {request_id: await redis_client.xrange(keys.token_stream(request_id))
                   for request_id in (long_id, short_id)}
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
        for request_id in (long_id, short_id):
            await redis_client.delete(keys.request_key(request_id), keys.token_stream(request_id))
    assert published[-1] == [2] and len(results) == 2  # the plan's 5 steps, one result
    assert [answer.plan_id for answer in answers] == [1, 2, 3, 4, 5, 6]
    tokens = [{token.request_id: (token.output_index, token.token_id) for token in answer.tokens}
              for answer in answers]
    assert [sorted(step) for step in tokens] == [sorted([long_id, short_id])] * 3 + [[long_id]] * 3
    for request_id, seed, count in ((long_id, 11, 6), (short_id, 12, 3)):
        assert [step[request_id] for step in tokens if request_id in step] == \
            list(enumerate(emulated_tokens(seed, prompt, count, engine.vocab_size)))
        assert [entry_id for entry_id, _ in entries[request_id]] == [f"0-{index + 1}".encode()
                                                                      for index in range(count)]
    assert all(not answer.errors for answer in answers)
