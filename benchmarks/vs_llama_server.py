"""iterserve beside llama.cpp's llama-server on the same machine, prompts and load (issue: the hot path).

Both servers run the same SmolLM2-135M GGUF (llama-server with its Q4_1 kernels, iterserve with
its weights dequantized to float32, its default on a CPU, and to bfloat16, `--dtype bfloat16`:
on a CPU with AVX512-BF16 its matmuls run about twice as fast; or kept packed, `--dtypes gguf-bfloat16`
for `--quantization gguf --dtype bfloat16`). The load is
../shared/peers/load.py (closed loop, ~48-token prompts made unique per request so no prompt cache
helps, 64 output tokens forced with ignore_eos, streaming), at concurrency 1, 4, 16 and 64, greedy
and sampled (temperature 1.0, top_p 0.95); the servers take turns at each mode so a slow spell of
this shared machine hits them all.

    ../shared/peers/build-llama-server.sh                     # once, about 10 minutes
    .venv/bin/python benchmarks/vs_llama_server.py            # about 20 minutes
    .venv/bin/python benchmarks/vs_llama_server.py --no-llama-server --levels 16 --dtypes float32
                                                              # iterserve's sampled / greedy alone

Writes benchmarks/results/vs_llama_server.{md,json}.
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.runner import machine_info  # noqa: E402
from services.bench.server import ServerProcess  # noqa: E402
from services.launcher import die_with_parent, free_port  # noqa: E402
from shared.model_file import locate_gguf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO.parent / "shared" / "peers"
RESULTS = REPO / "benchmarks" / "results"
LEVELS = "1,4,16,64"
MODES = {"greedy": [], "sampled": ["--temperature", "1.0", "--top-p", "0.95"]}


class LlamaServer:
    def __init__(self, binary: Path, threads: int, slots: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(binary), "-m", str(locate_gguf()), "-a", "smollm2", "--host", "127.0.0.1",
                        "--port", str(self.port), "-c", str(256 * slots), "--parallel", str(slots), "--cont-batching",
                        "-t", str(threads), "-tb", str(threads)]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.log.close()
        os.unlink(self.log.name)


def load(script: Path, url: str, model: str, mode: str, seed_offset: int, out: Path, levels: str) -> list[dict]:
    command = [sys.executable, str(script), "--url", url, "--model", model, "--levels", levels, "--mult", "2",
               "--max-tokens", "64", "--force", "ignore_eos", "--seed-offset", str(seed_offset),
               "--json-out", str(out), *MODES[mode]]
    subprocess.run(command, check=True, timeout=3600, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def server_arguments(variant: str) -> tuple[str, ...]:
    """iterserve's arguments for a --dtypes entry: DTYPE, or gguf-DTYPE (served quantized)."""
    if variant.startswith("gguf-"):
        return ("--quantization", "gguf", "--dtype", variant.removeprefix("gguf-"))
    return ("--dtype", variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path,
                        default=Path.home() / ".cache/iterserve-peers/llama-server/build/bin/llama-server")
    parser.add_argument("--load-script", type=Path, default=PEERS / "load.py")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="vs_llama_server", help="the results files' name")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="iterserve's --dtype, one server each; gguf-DTYPE: with --quantization gguf (its "
                             "Q4_1/Q8_0 tensors kept packed)")
    parser.add_argument("--levels", default=LEVELS, help="concurrency levels, comma-separated")
    parser.add_argument("--no-llama-server", action="store_true",
                        help="iterserve alone: its sampled / greedy ratios, printed, no results written")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    levels_run = [int(level) for level in args.levels.split(",")]
    if not args.no_llama_server and not args.llama_server.exists():
        sys.exit(f"no llama-server at {args.llama_server}: build it with {PEERS / 'build-llama-server.sh'}")
    started = time.time()
    results: dict[str, list[dict]] = {}  # "server mode" -> load.py's row per concurrency level
    scratch = Path(tempfile.mkdtemp(prefix="vs-llama-"))
    with contextlib.ExitStack() as stack:  # every server up at once; each takes its turn alone
        servers = [(f"iterserve-{dtype}", stack.enter_context(
            ServerProcess(workers=1, threads=args.threads, extra_args=server_arguments(dtype))).url,
            "smollm2-135m-instruct")
            for dtype in dtypes]
        if not args.no_llama_server:
            llama = stack.enter_context(LlamaServer(args.llama_server, args.threads, 64))
            servers.append(("llama-server", llama.url, "smollm2"))
        for offset, mode in enumerate(MODES):  # the servers take turns; fresh prompts every run
            for name, url, model in servers:
                print(f"{name} {mode} ...", flush=True)
                results[f"{name} {mode}"] = load(args.load_script, url, model, mode, 1000 * (offset + 1) + len(results),
                                                 scratch / f"{name}-{mode}.json", args.levels)
    shown = " / ".join(map(str, levels_run))
    by_level = {key: {level["concurrency"]: level for level in report} for key, report in results.items()}

    def sampled_over_greedy(dtype: str) -> str:
        greedy, sampled = by_level[f"iterserve-{dtype} greedy"], by_level[f"iterserve-{dtype} sampled"]
        return f"iterserve {dtype} sampled / greedy at {shown}: " + " / ".join(
            f"{sampled[c]['tok_s'] / greedy[c]['tok_s']:.2f}x" for c in levels_run)

    if args.no_llama_server:
        for key, levels in by_level.items():
            print(f"{key} output tok/s at {shown}: " + " / ".join(f"{levels[c]['tok_s']:.1f}" for c in levels_run))
        print("\n".join(map(sampled_over_greedy, dtypes)))
        return
    lines = ["# iterserve against llama.cpp's llama-server on the same cores (executor: engine, SmolLM2-135M)", "",
             f"Measured on {machine_info()['cpu']}, {os.cpu_count()} cores, {args.threads} threads per "
             f"server, load average at the end {os.getloadavg()[0]:.2f}; "
             f"`.venv/bin/python benchmarks/vs_llama_server.py {shlex.join(sys.argv[1:])}` ({time.time() - started:.0f} s).",
             "llama-server: Q4_1 GGUF, `--parallel 64 --cont-batching`; iterserve: `iterserve up --dtype D` (1 worker; "
             "gguf-D: `--quantization gguf --dtype D`, the Q4_1/Q8_0 tensors kept packed).",
             "", f"| server | mode | output tok/s at concurrency {shown} | mean TTFT at 16 (s) |", "|---|---|---|---|"]
    for key, levels in by_level.items():
        tps = " / ".join(f"{levels[c]['tok_s']:.1f}" for c in levels_run)
        ttft = levels[16]["ttft_mean_s"] if 16 in levels else math.nan
        lines.append(f"| {key.split()[0]} | {key.split()[1]} | {tps} | {ttft:.2f} |")
    lines += ["", f"| iterserve | mode | iterserve / llama-server at {shown} |", "|---|---|---|"]
    for dtype in dtypes:
        for mode in MODES:
            ours, theirs = by_level[f"iterserve-{dtype} {mode}"], by_level[f"llama-server {mode}"]
            lines.append(f"| {dtype} | {mode} | " + " / ".join(
                f"{ours[c]['tok_s'] / theirs[c]['tok_s']:.2f}x" for c in levels_run) + " |")
    lines += ["", *map(sampled_over_greedy, dtypes)]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps({"executor": "engine", **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
