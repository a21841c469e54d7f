"""The whole system on one device, against the engine alone on the same requests (issue: the whole
system on a GPU). What it answers: how much of the device's time the control plane (gateway,
Redis, scheduler) leaves unused, on the hardware the workers are meant for.

    .venv/bin/python benchmarks/gpu_system.py --device cpu       # here: SmolLM2-135M's shape, small sizes
    python3 benchmarks/gpu_system.py --device cuda               # on a GPU machine: both shapes

For each model shape (random weights of the real shape, written as a Hugging Face directory with
a byte-level tokenizer padded to the model's vocabulary: no weights are downloaded, no GGUF is
needed), it
1. starts the system the way `iterserve up` does (its own Redis, gateway, scheduler, 1 worker on
   the device) and drives it with the load generator at each concurrency (closed loop, forced
   output lengths, greedy), reading served output tok/s, TTFT and TPOT from the client, and from
   the iteration records and /proc: the worker's busy fraction (engine step time over the window
   it was busy) and the scheduler's CPU per worker-iteration;
2. runs the engine alone on the same requests (services/bench/engine_replay.py: the scheduler's
   own policy forms the batches, at most `concurrency` rows, back to back in one process);
3. fits the emulated executor's hardware profile to the decode steps the worker reported (their
   step time by batch size: memory efficiency and launch time, services/worker/hardware.py
   profile_from_measurement, over the device's bandwidth and matmul rate measured here), writes it,
   and runs the same load through the system again with `--executor emulated --hardware <it>`: the
   emulation's prediction beside the measurement, and its step time against the measured one at
   each batch size;
4. prints one row per concurrency, served / engine-alone as the ratio.
Every phase runs under its own timeout and the report (JSON and markdown in --out) is written
after each one, so a run cut short keeps what it measured. The last line printed is the served /
engine-alone ratio at the highest concurrency of the last shape.

On the CPU the worker's step time is the device time; on CUDA the engine synchronizes at the end
of a step (it reads the sampled tokens), so the busy fraction bounds the GPU's from above by the
host work inside a step (gpu_check.py measures that part with the profiler).
"""

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.overhead import read_iterations, timeline  # noqa: E402
from services.bench.runner import BenchConfig, finite, machine_info, run_benchmark  # noqa: E402
from services.bench.server import REPO, ServerProcess  # noqa: E402
from services.bench.workloads import PromptSource, WorkloadConfig, build_requests  # noqa: E402
from services.worker.hardware import parse_profile, profile_from_measurement  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.checkpoints import BYTE_VOCABULARY, write_byte_tokenizer  # noqa: E402

END_OF_TEXT_ID = BYTE_VOCABULARY - 1  # (tests/checkpoints.py's byte tokenizer: 256 bytes, then end of text)
ITERATION_RECORDS_KEPT = 200_000

# The real models' shapes (their config.json), random weights.
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
CONTEXT = 4096


@dataclass(frozen=True)
class Sizes:
    """One device class's run: which shapes, concurrencies and requests."""
    shapes: tuple[str, ...]
    concurrencies: tuple[int, ...]
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    requests_per_client: int  # requests at concurrency c: c x this (at least MIN_REQUESTS)
    kv_blocks: int
    phase_timeout_s: float


MIN_REQUESTS = 4
SIZES = {
    "cuda": Sizes(("smollm2-135m", "llama3.2-1b"), (1, 16, 64), (64, 256), (64, 128), 2, 8192, 150.0),
    "cpu": Sizes(("smollm2-135m",), (1, 16, 64), (32, 64), (16, 32), 2, 2048, 300.0),
}


def log(message: str) -> None:
    print(f"gpu_system: {message}", file=sys.stderr, flush=True)


# The model directory

def write_checkpoint(directory: Path, shape: str, seed: int = 0) -> Path:
    """Random bfloat16 weights of the shape, as a Hugging Face Llama directory (safetensors and torch
    only: the device machine has no transformers)."""
    import torch
    from safetensors.torch import save_file

    fields = SHAPES[shape]
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": CONTEXT, "bos_token_id": END_OF_TEXT_ID, "eos_token_id": END_OF_TEXT_ID,
              "torch_dtype": "bfloat16", **fields}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    hidden, inner = fields["hidden_size"], fields["intermediate_size"]
    head_dim = hidden // fields["num_attention_heads"]
    kv = fields["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, columns: int) -> torch.Tensor:
        return (torch.randn(rows, columns, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": matrix(fields["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(fields["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {prefix + "self_attn.q_proj.weight": matrix(hidden, hidden),
                    prefix + "self_attn.k_proj.weight": matrix(kv, hidden),
                    prefix + "self_attn.v_proj.weight": matrix(kv, hidden),
                    prefix + "self_attn.o_proj.weight": matrix(hidden, hidden),
                    prefix + "mlp.gate_proj.weight": matrix(inner, hidden),
                    prefix + "mlp.up_proj.weight": matrix(inner, hidden),
                    prefix + "mlp.down_proj.weight": matrix(hidden, inner),
                    prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_byte_tokenizer(directory, fields["vocab_size"])  # (tests/checkpoints.py: text for every id)
    return directory


# The runs

class Run:
    def __init__(self, device: str, sizes: Sizes, out_dir: Path, seed: int, dtype: str) -> None:
        self.device, self.sizes, self.out_dir, self.seed, self.dtype = device, sizes, out_dir, seed, dtype
        self.workload = WorkloadConfig("orca", input_range=sizes.input_range, output_range=sizes.output_range)
        self.results: dict = {"device": device, "dtype": dtype, "sizes": asdict(sizes), "machine": machine_info(),
                              "seed": seed, "started_unix": time.time(), "shapes": {}}
        self.results["machine"]["accelerator"] = accelerator(device)

    def requests(self, concurrency: int) -> int:
        return max(MIN_REQUESTS, concurrency * self.sizes.requests_per_client)

    def shape(self, shape: str, model_dir: Path) -> None:
        entry = self.results["shapes"].setdefault(shape, {"levels": {}})
        name = f"random-{shape}"
        options = ("--model", str(model_dir), "--served-model-name", name, "--device", self.device,
                   "--dtype", self.dtype, "--max-model-len", str(CONTEXT))
        source = PromptSource(Tokenizer.load(str(model_dir)))  # (the load generator's prompts, in its tokens)
        log(f"{shape}: starting iterserve up {' '.join(options)}")
        with ServerProcess(workers=1, kv_blocks=self.sizes.kv_blocks, extra_args=options,
                           env={"ITERSERVE_ITERATION_RECORDS": str(ITERATION_RECORDS_KEPT)}) as server:
            self.warm_up(server, name, source)
            for concurrency in self.sizes.concurrencies:
                entry["levels"].setdefault(str(concurrency), {})["served"] = self.served(server, name, source,
                                                                                         concurrency)
                self.write()
        for concurrency in self.sizes.concurrencies:
            entry["levels"][str(concurrency)]["engine_alone"] = self.engine_alone(model_dir, concurrency)
            self.write()
        self.emulated(shape, model_dir, entry)

    def emulated(self, shape: str, model_dir: Path, entry: dict) -> None:
        """The emulated executor's prediction of the same runs, from a profile fitted to the decode
        steps measured in them (written beside the results; `--hardware <it>` emulates this device)."""
        steps: dict[int, list[float]] = {}
        for level in entry["levels"].values():
            for batch, seconds in (level.get("served") or {}).get("decode_steps", {}).items():
                steps.setdefault(int(batch), []).extend(seconds)
        measured = {batch: sorted(times)[len(times) // 2] for batch, times in steps.items() if len(times) >= 3}
        if not measured:
            log(f"{shape}: no decode steps to fit a profile to")
            return
        fields = SHAPES[shape]
        head_dim = fields["hidden_size"] // fields["num_attention_heads"]
        model = {"n_layers": fields["num_hidden_layers"], "hidden_size": fields["hidden_size"],
                 "ffn_size": fields["intermediate_size"], "n_heads": fields["num_attention_heads"],
                 "n_kv_heads": fields["num_key_value_heads"], "head_dim": head_dim, "vocab_size": fields["vocab_size"],
                 "context_length": CONTEXT, "dtype_bytes": 4 if self.dtype == "float32" else 2,
                 "tied_embeddings": fields["tie_word_embeddings"], "gated_ffn": True}
        device = device_figures(self.device, self.dtype)
        # (the decode steps' mean context: the prompt and half the output, on average)
        context = int(sum(self.sizes.input_range) / 2 + sum(self.sizes.output_range) / 4)
        profile = profile_from_measurement(f"measured-{self.device}-{shape}-{self.dtype}", model, device, context,
                                           measured, compute_efficiency=1.0 if self.device == "cpu" else 0.6)
        profile["efficiency"]["calibration"] = profile["efficiency"]["calibration"].replace(
            "benchmarks/gpu_check.py", "benchmarks/gpu_system.py (the served runs' decode steps)")
        profile["description"] = f"{shape}'s shape (random weights) in {self.dtype} on {device['name']}, as served"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"gpu_system_profile_{self.device}_{shape}.json"
        path.write_text(json.dumps(profile, indent=2) + "\n")
        fitted = parse_profile(profile)
        entry["profile"] = {"path": path.name, "memory_efficiency": profile["efficiency"]["memory"],
                            "launch_ms": profile["efficiency"]["launch_ms"], "context": context, "device": device,
                            "step_ms": {str(batch): {"measured": 1000 * seconds, "samples": len(steps[batch]),
                                                     "emulated": 1000 * fitted.decode_step_seconds(batch, context)}
                                        for batch, seconds in sorted(measured.items())}}
        log(f"{shape}: profile fitted (memory efficiency {profile['efficiency']['memory']:.2f}, launch "
            f"{profile['efficiency']['launch_ms']:.2f} ms): {path}")
        self.write()
        name = f"random-{shape}"
        options = ("--model", str(model_dir), "--served-model-name", name, "--executor", "emulated",
                   "--hardware", str(path), "--max-model-len", str(CONTEXT))
        source = PromptSource(Tokenizer.load(str(model_dir)))
        with ServerProcess(workers=1, kv_blocks=self.sizes.kv_blocks, extra_args=options,
                           env={"ITERSERVE_ITERATION_RECORDS": str(ITERATION_RECORDS_KEPT)}) as server:
            self.warm_up(server, name, source)
            for concurrency in self.sizes.concurrencies:
                entry["levels"][str(concurrency)]["emulated"] = self.served(server, name, source, concurrency)
                self.write()

    def warm_up(self, server: ServerProcess, name: str, source: PromptSource) -> None:
        tiny = WorkloadConfig("orca", input_range=(16, 32), output_range=(4, 8))
        config = BenchConfig(url=server.url, workload=tiny, num_requests=2, seed=self.seed + 1, model=name,
                             progress=False)
        asyncio.run(asyncio.wait_for(run_benchmark(config, build_requests(tiny, 2, self.seed + 1, source)),
                                     self.sizes.phase_timeout_s))
        server.wait_idle(timeout=60)

    def served(self, server: ServerProcess, name: str, source: PromptSource, concurrency: int) -> dict:
        config = BenchConfig(url=server.url, workload=self.workload, num_requests=self.requests(concurrency),
                             concurrency=concurrency, seed=self.seed, model=name, progress=False,
                             max_duration=self.sizes.phase_timeout_s, label=f"concurrency {concurrency}")
        cpu_before = server.cpu_seconds()
        requests = build_requests(self.workload, config.num_requests, self.seed, source)
        report = asyncio.run(asyncio.wait_for(run_benchmark(config, requests), self.sizes.phase_timeout_s + 30))
        cpu_after = server.cpu_seconds()
        rows = read_iterations(server.redis_url, report["started_at_unix"], report["finished_at_unix"])
        split = timeline(rows)
        summary = report["summary"]
        decode_steps: dict[str, list[float]] = {}  # batch size -> step seconds of its decode-only iterations
        for row in rows:
            if row["batch_size"] and not row["prefill_tokens"] and row["step_s"]:  # (not a plan that only frees)
                decode_steps.setdefault(str(row["batch_size"]), []).append(row["step_s"])
        iterations = max(split["iterations"], 1)
        scheduler_cpu = cpu_after.get("scheduler", 0.0) - cpu_before.get("scheduler", 0.0)
        level = {
            "requests": summary["requests"], "completed": summary["completed"], "errors": summary["errors"],
            "output_tok_s": summary["output_token_throughput"],
            "ttft_ms_p50": summary["ttft_ms"]["p50"], "tpot_ms_p50": summary["tpot_ms"]["p50"],
            "iterations": split["iterations"], "mean_batch_size": split["mean_batch_size"],
            "busy_fraction": split["engine_s"] / split["window_s"] if split["window_s"] else None,
            "engine_ms_per_iteration": split["engine_ms_per_iteration"],
            "scheduler_cpu_ms_per_iteration": 1000 * scheduler_cpu / iterations,
            "cpu_seconds": {part: cpu_after.get(part, 0.0) - cpu_before.get(part, 0.0) for part in cpu_after},
            "decode_steps": decode_steps,
        }
        log(f"served at concurrency {concurrency}: {level['completed']}/{level['requests']} done, "
            f"{level['output_tok_s']:.1f} tok/s, busy {figure(level['busy_fraction'], 2)}, scheduler "
            f"{level['scheduler_cpu_ms_per_iteration']:.2f} ms CPU per worker-iteration")
        if not server.wait_idle(timeout=120):
            log("the system did not drain within 120 s")
        return level

    def engine_alone(self, model_dir: Path, concurrency: int) -> dict:
        spec = {"workload": asdict(self.workload), "num_requests": self.requests(concurrency), "seed": self.seed,
                "kv_blocks": self.sizes.kv_blocks, "policy": "iteration", "max_batch_size": concurrency}
        env = dict(os.environ) | {"ITERSERVE_MODEL": str(model_dir), "ITERSERVE_DEVICE": self.device,
                                  "ITERSERVE_DTYPE": self.dtype, "ITERSERVE_MAX_MODEL_LEN": str(CONTEXT)}
        with tempfile.TemporaryDirectory(prefix="iterserve-gpu-system-") as folder:
            output = Path(folder) / "replay.json"
            command = [sys.executable, "-m", "services.bench.engine_replay", "--spec", json.dumps(spec),
                       "--output", str(output)]
            completed = subprocess.run(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                       text=True, timeout=self.sizes.phase_timeout_s)
            if completed.returncode != 0:
                raise RuntimeError(f"engine replay failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
            replay = json.loads(output.read_text())
        log(f"engine alone at concurrency {concurrency}: {replay['output_token_throughput_replay']:.1f} tok/s "
            f"({replay['device']}, {replay['dtype']})")
        return replay

    # Output

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = time.time() - self.results["started_unix"]
        (self.out_dir / f"gpu_system_{self.device}.json").write_text(
            json.dumps(finite(self.results), indent=1, default=str, allow_nan=False) + "\n")
        (self.out_dir / f"gpu_system_{self.device}.md").write_text(render(self.results))


def device_figures(device: str, dtype: str) -> dict:
    """The device as a profile names it: its copy bandwidth and dense matmul rate in the dtype, both
    measured here (on CUDA the peak rate is the datasheet's where gpu_check knows it), its memory."""
    import torch

    cuda = device == "cuda"
    target = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    data = torch.empty(1 << (30 if cuda else 28), dtype=torch.uint8, device=target)
    copy = torch.empty_like(data)
    copy.copy_(data)
    sync()
    started = time.perf_counter()
    for _ in range(5):
        copy.copy_(data)
    sync()
    bandwidth = 2 * 5 * data.numel() / (time.perf_counter() - started)
    del data, copy
    element = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    size, repeats = (4096, 20) if cuda else (1024, 4)
    left, right = (torch.randn(size, size, device=target).to(element) for _ in range(2))
    left @ right
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        left @ right
    sync()
    rate = 2 * size**3 * repeats / (time.perf_counter() - started)
    name = accelerator(device) or machine_info()["cpu"]
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    return {"name": name, "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2), "peak_tflops": round(rate / 1e12, 4),
            "memory_gb": round(memory / 1e9, 1),
            "source": f"measured by benchmarks/gpu_system.py: a 256 MiB+ copy, a {size}^3 matmul in {dtype}"}


def accelerator(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def figure(value, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def ratio(level: dict) -> float | None:
    served, alone = level.get("served"), level.get("engine_alone")
    if not served or not alone or not alone.get("output_token_throughput_replay"):
        return None
    return served["output_tok_s"] / alone["output_token_throughput_replay"]


def render(results: dict) -> str:
    machine = results["machine"]
    lines = [f"# The whole system on {results['device']} against the engine alone", "",
             f"{machine.get('accelerator') or machine['cpu']} ({machine['cores']} cores), {results['dtype']}, "
             f"seed {results['seed']}; random weights of each model's shape; closed loop at each concurrency, "
             f"{results['sizes']['requests_per_client']} requests per client (at least {MIN_REQUESTS}), input "
             f"{results['sizes']['input_range']} output {results['sizes']['output_range']} tokens, greedy, forced "
             f"lengths. Command: `benchmarks/gpu_system.py --device {results['device']}`.", ""]
    for shape, entry in results["shapes"].items():
        lines += [f"## {shape}", "",
                  "| concurrency | served tok/s | engine alone tok/s | served / alone | worker busy | "
                  "scheduler CPU ms / worker-iteration | mean batch | TTFT p50 ms | TPOT p50 ms | "
                  "EMULATED tok/s (prediction) | emulated / served | emulated busy |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for concurrency, level in entry.get("levels", {}).items():
            served, alone = level.get("served") or {}, level.get("engine_alone") or {}
            emulated = level.get("emulated") or {}
            predicted = (emulated["output_tok_s"] / served["output_tok_s"]
                         if emulated.get("output_tok_s") and served.get("output_tok_s") else None)
            lines.append(f"| {concurrency} | {figure(served.get('output_tok_s'))} | "
                         f"{figure(alone.get('output_token_throughput_replay'))} | {figure(ratio(level), 2)} | "
                         f"{figure(served.get('busy_fraction'), 2)} | "
                         f"{figure(served.get('scheduler_cpu_ms_per_iteration'), 2)} | "
                         f"{figure(served.get('mean_batch_size'))} | {figure(served.get('ttft_ms_p50'))} | "
                         f"{figure(served.get('tpot_ms_p50'))} | {figure(emulated.get('output_tok_s'))} | "
                         f"{figure(predicted, 2)} | {figure(emulated.get('busy_fraction'), 2)} |")
        profile = entry.get("profile")
        if profile:
            device = profile["device"]
            lines += ["", f"The emulated executor's profile, fitted to the served decode steps "
                          f"(`{profile['path']}`): memory efficiency {profile['memory_efficiency']:.2f} of "
                          f"{device['memory_bandwidth_gb_s']} GB/s, launch {profile['launch_ms']:.2f} ms, "
                          f"{device['peak_tflops']} TFLOPS; at context {profile['context']}:", "",
                      "| batch | measured step ms (median) | decode steps | emulated step ms | emulated / measured |",
                      "|---|---|---|---|---|"]
            for batch, step in profile["step_ms"].items():
                lines.append(f"| {batch} | {step['measured']:.2f} | {step['samples']} | {step['emulated']:.2f} | "
                             f"{step['emulated'] / step['measured']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default: the device's)")
    parser.add_argument("--concurrency", help="comma-separated concurrencies (default 1,16,64)")
    parser.add_argument("--requests-per-client", type=int)
    parser.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--out", type=Path, help="default: $OUT when set, else benchmarks/results")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = SIZES[args.device]
    if args.shapes:
        unknown = [shape for shape in args.shapes.split(",") if shape not in SHAPES]
        if unknown:
            parser.error(f"unknown shape {unknown[0]!r}: choose from {', '.join(SHAPES)}")
        sizes = Sizes(**(asdict(sizes) | {"shapes": tuple(args.shapes.split(","))}))
    if args.concurrency:
        sizes = Sizes(**(asdict(sizes) | {"concurrencies": tuple(int(c) for c in args.concurrency.split(","))}))
    if args.requests_per_client:
        sizes = Sizes(**(asdict(sizes) | {"requests_per_client": args.requests_per_client}))
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    run = Run(args.device, sizes, out_dir, args.seed, dtype)
    with tempfile.TemporaryDirectory(prefix="iterserve-random-models-") as models:
        for shape in sizes.shapes:
            log(f"{shape}: writing random weights")
            model_dir = write_checkpoint(Path(models) / shape, shape, seed=args.seed)
            try:
                run.shape(shape, model_dir)
            except Exception as error:  # noqa: BLE001  (a phase that failed: said, and the next shape runs)
                run.results["shapes"].setdefault(shape, {})["error"] = f"{type(error).__name__}: {error}"[-3000:]
                log(f"{shape}: {type(error).__name__}: {error}")
            run.write()
    print(render(run.results))
    last = run.results["shapes"][sizes.shapes[-1]].get("levels", {}).get(str(sizes.concurrencies[-1]), {})
    print(f"served / engine alone at concurrency {sizes.concurrencies[-1]}: {figure(ratio(last), 3)}")
    return 0 if all("error" not in entry for entry in run.results["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
