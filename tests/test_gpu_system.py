"""benchmarks/gpu_system.py, prepared for a lent GPU, stays runnable: with --device cpu it writes a
random model of SmolLM2-135M's shape, serves it through the whole system and through the engine
alone, and reports both side by side."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def test_the_random_model_has_the_real_shape_and_every_id_decodes(tmp_path):
    import gpu_system

    from shared.model_file import load_metadata
    from shared.tokenizer import Tokenizer

    directory = gpu_system.write_checkpoint(tmp_path / "model", "smollm2-135m")
    config = load_metadata(str(directory)).config
    assert (config.hidden_size, config.n_layers, config.n_kv_heads, config.vocab_size) == (576, 30, 3, 49152)
    tokenizer = Tokenizer.load(str(directory))
    assert tokenizer.encode("harbor") == list(b"harbor")  # bytes in, as the load generator's prompts
    assert gpu_system.END_OF_TEXT_ID in tokenizer.stop_token_ids
    assert tokenizer.decode([300, 49151]) == "w300w49151"  # what the random model samples has text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_system_run_serves_and_replays_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/gpu_system.py", "--device", "cpu", "--concurrency", "1,2",
                          "--requests-per-client", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=800, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_system_cpu.json").read_text())
    levels = report["shapes"]["smollm2-135m"]["levels"]
    for concurrency in ("1", "2"):
        served, alone = levels[concurrency]["served"], levels[concurrency]["engine_alone"]
        assert served["completed"] == served["requests"] == 4 and not served["errors"], served
        assert alone["unfinished"] == 0 and alone["requests"] == 4 and alone["device"] == "cpu"
        assert 0 < served["busy_fraction"] <= 1.0 and served["scheduler_cpu_ms_per_iteration"] > 0
        assert served["output_tok_s"] > 0 and alone["output_token_throughput_replay"] > 0
    assert 0.5 < levels["1"]["served"]["mean_batch_size"] <= 1.0  # (a plan that only frees blocks has none)
    last = re.search(r"served / engine alone at concurrency 2: (\d+\.\d+)$", run.stdout.strip())
    assert last and 0.1 < float(last.group(1)) < 10, run.stdout[-1000:]
    assert "| 2 |" in (tmp_path / "gpu_system_cpu.md").read_text()
    # The emulated executor's prediction of the same runs, from a profile fitted to the served steps
    profile = report["shapes"]["smollm2-135m"]["profile"]
    from services.worker.hardware import load_profile

    fitted = load_profile(str(tmp_path / profile["path"]))  # (it loads: `--hardware <it>` emulates this host)
    assert 0 < fitted.memory_efficiency <= 1 and "1" in profile["step_ms"]
    for step in profile["step_ms"].values():
        assert step["measured"] > 0 and step["emulated"] > 0
    for concurrency in ("1", "2"):
        emulated = levels[concurrency]["emulated"]
        assert emulated["completed"] == emulated["requests"] == 4 and emulated["output_tok_s"] > 0
    assert "EMULATED tok/s (prediction)" in (tmp_path / "gpu_system_cpu.md").read_text()
