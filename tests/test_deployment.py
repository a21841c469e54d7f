"""The deployment files users run: compose file valid, Dockerfile and README in step."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def compose_run(*files: str, password: str | None = "a-test-password") -> subprocess.CompletedProcess:
    """`docker-compose config` of the files, with ITERSERVE_REDIS_PASSWORD set to `password` (None: unset)."""
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed: `./dev test` installs it (apt-get install docker-compose)")
    env = {name: value for name, value in os.environ.items() if name != "ITERSERVE_REDIS_PASSWORD"}
    if password is not None:
        env["ITERSERVE_REDIS_PASSWORD"] = password
    arguments = [part for name in files for part in ("-f", name)]
    return subprocess.run(["docker-compose", *arguments, "config"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


def compose_config(*files: str) -> dict:
    """The compose files as docker-compose resolves them (anchors and merges applied), parsed."""
    import yaml

    result = compose_run(*files)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_refuses_to_start_without_a_redis_password_from_the_environment():
    """No default password ships: Redis, and every service's URL, take it from the environment."""
    for files in (("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")):
        refused = compose_run(*files, password=None)
        assert refused.returncode != 0 and "set ITERSERVE_REDIS_PASSWORD" in refused.stderr, refused.stderr
    config = compose_config("docker-compose.yml")
    redis = config["services"]["redis"]
    assert redis["command"][redis["command"].index("--requirepass") + 1] == "a-test-password"
    for name in ("gateway", "scheduler", "worker"):
        assert config["services"][name]["environment"]["REDIS_URL"].startswith("redis://:a-test-password@"), name
    assert "change-me" not in (REPO / "docker-compose.yml").read_text()


def test_the_gpu_compose_file_reserves_a_gpu_for_the_worker_only():
    services = compose_config("docker-compose.yml", "docker-compose.gpu.yml")["services"]
    worker = services["worker"]
    assert worker["environment"]["ITERSERVE_DEVICE"] == "cuda"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert [name for name, service in services.items() if "deploy" in service] == ["worker"]


def test_the_sentinel_compose_file_runs_a_replica_and_three_sentinels_and_every_service_through_them():
    refused = compose_run("docker-compose.yml", "docker-compose.sentinel.yml", password=None)
    assert refused.returncode != 0 and "set ITERSERVE_REDIS_PASSWORD" in refused.stderr, refused.stderr
    services = compose_config("docker-compose.yml", "docker-compose.sentinel.yml")["services"]
    sentinels = [f"sentinel-{index}" for index in (1, 2, 3)]
    assert set(services) == {"redis", "redis-replica", "gateway", "scheduler", "worker", *sentinels}
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:][:2] == ["redis", "6379"]
    assert replica[replica.index("--masterauth") + 1] == "a-test-password"
    for name in sentinels:
        service = services[name]
        assert "--sentinel" in service["command"][0] and "sentinel monitor iterserve redis 6379 2" in service["command"][0]
        assert service["environment"]["SENTINEL_NAME"] == name and service.get("restart") == "unless-stopped"
    for name in ("gateway", "scheduler", "worker"):
        environment = services[name]["environment"]
        assert environment["REDIS_URL"] == ("redis+sentinel://:a-test-password@sentinel-1:26379,sentinel-2:26379,"
                                            "sentinel-3:26379/iterserve/0"), name
        assert environment["ITERSERVE_REDIS_WAIT_REPLICAS"] == "1"
    from shared.redis_connection import sentinel_target
    assert sentinel_target(services["worker"]["environment"]["REDIS_URL"]).primary == "iterserve"


def test_compose_runs_every_service_with_restart_policies_and_persistent_redis():
    """Read from the resolved file, service by service (a policy written once must hold for each)."""
    config = compose_config("docker-compose.yml")
    services = config["services"]
    assert set(services) == {"redis", "gateway", "scheduler", "worker"}
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", f"{name} is not restarted"
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes" and "--requirepass" in command
    assert any(volume.split(":")[:2] == ["redis-data", "/data"] for volume in redis["volumes"]), redis["volumes"]
    assert "redis-data" in config["volumes"] and "redis-cli" in " ".join(redis["healthcheck"]["test"])
    for name in ("gateway", "scheduler", "worker"):
        service = services[name]
        assert service["command"][0] == name and "redis" in service["depends_on"], name
        assert service["environment"]["REDIS_URL"].endswith("@redis:6379/0"), name
    assert [(port["published"], port["target"]) for port in services["gateway"]["ports"]] == [(8000, 8000)]
    assert "ports" not in services["worker"] and "ports" not in services["scheduler"]


def test_readme_opens_with_exactly_the_two_setup_commands_that_dev_runs():
    """The README's first two commands are the two `./dev` knows (its usage says which), and each
    runs: `./dev up --help` reaches `iterserve up`, `./dev test --collect-only` reaches pytest."""
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^\./dev (\w+)", readme, flags=re.MULTILINE)
    assert commands[:2] == ["up", "test"]
    usage = subprocess.run(["./dev"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and re.findall(r"\./dev (\w+)", usage.stderr) == ["up", "test"], usage.stderr
    up = subprocess.run(["./dev", "up", "--help"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0 and "usage: iterserve up" in up.stdout, up.stdout[-2000:] + up.stderr[-2000:]
    test = subprocess.run(["./dev", "test", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_deployment.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert test.returncode == 0 and "test_readme_opens_with_exactly_the_two_setup_commands_that_dev_runs" in test.stdout
    ci = (REPO / ".ci" / "run").read_text()
    assert "./dev test" in ci


def test_ci_runs_the_readme_test_command_with_ci_set(tmp_path):
    """.ci/run sets CI=true itself (tests/requirements.py: a missing dependency then fails rather than
    skips) and fails when no test ran: run against a stand-in `./dev` that reports what it was given."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    for status in (0, 5):
        (tmp_path / "dev").write_text(f"#!/usr/bin/env bash\necho \"CI=$CI args=$*\"\nexit {status}\n")
        (tmp_path / "dev").chmod(0o755)
        run = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin"})
        assert run.stdout.startswith("CI=true args=test "), run.stdout
        assert run.returncode == (0 if status == 0 else 1), (status, run.returncode, run.stderr)


def test_up_puts_worker_i_on_gpu_i_when_there_are_several(monkeypatch):
    """`iterserve up --workers N` on a machine with several GPUs: each worker sees one GPU (round-robin),
    a worker group one per rank; with one GPU or none, or a device named by --device, nothing is
    assigned."""
    from services.launcher import visible_gpus, worker_gpu_env
    from shared.config import Settings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,3")
    gpus = visible_gpus()
    assert gpus == ["0", "1", "3"]
    assert [worker_gpu_env(Settings(), index, gpus) for index in range(4)] == [
        {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "0"}]
    assert worker_gpu_env(Settings(device="cuda"), 1, gpus) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert worker_gpu_env(Settings(device="cpu"), 1, gpus) == {}
    assert worker_gpu_env(Settings(device="cuda:2"), 1, gpus) == {}
    assert worker_gpu_env(Settings(), 1, ["0"]) == {}
    # A worker group of N ranks: the next N GPUs, rank r on its r-th.
    group = Settings(tensor_parallel=2)
    assert [worker_gpu_env(group, index, ["0", "1", "2", "3"]) for index in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_scheduler_cpus_read_as_taskset_writes_them_and_a_bad_list_is_refused():
    from pydantic import ValidationError

    from shared.config import Settings, cpu_list, threads_per_worker

    assert cpu_list("") == frozenset()
    assert cpu_list("3") == {3}
    assert cpu_list("0,2") == {0, 2}
    assert cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    for bad in ("x", "3-1", "0-", "-1", "1.5", "0;1", "0-100000000"):
        with pytest.raises(ValidationError, match="not a CPU list"):
            Settings(scheduler_cpus=bad)
    assert Settings(scheduler_cpus="2-3").scheduler_cpus == "2-3"
    # The workers share the CPUs left to them, not the machine's
    assert threads_per_worker(2, cores=6) == 3 and threads_per_worker(4, cores=2) == 1


def parsed_settings(argv: list[str], monkeypatch=None):
    """The Settings `iterserve <argv>` would run with (its parser, not a copy of it)."""
    import argparse

    from services.cli import add_service_options, settings_from

    parser = argparse.ArgumentParser()
    add_service_options(parser)
    return settings_from(parser.parse_args(argv))


def test_a_vllm_serve_command_line_and_a_config_file_give_the_same_settings(tmp_path, monkeypatch):
    """vLLM's names for the options iterserve has are taken as its own (an operator's `vllm serve` line
    works unchanged); a YAML config file (--config) gives the same, under the command line and over
    the environment; an option it does not know is refused, naming it."""
    for name in ("ITERSERVE_MAX_BATCH_SIZE", "ITERSERVE_PREFIX_CACHING", "ITERSERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    vllm = parsed_settings(["-tp", "2", "--pipeline-parallel-size", "1", "--max-num-seqs", "32",
                            "--max-num-batched-tokens", "1024", "--block-size", "32", "--max-model-len", "4096",
                            "--no-enable-prefix-caching", "--enforce-eager", "--api-key", "k1", "--api-key", "k2",
                            "--api-keys", "k0"])
    assert (vllm.tensor_parallel, vllm.pipeline_parallel, vllm.max_batch_size, vllm.max_batch_tokens,
            vllm.kv_block_size, vllm.max_model_len, vllm.prefix_caching, vllm.enforce_eager) == (
        2, 1, 32, 1024, 32, 4096, False, True)
    assert vllm.api_keys.split(",") == ["k0", "k1", "k2"]
    assert parsed_settings(["--enable-prefix-caching"]).prefix_caching is True
    # `vllm serve MODEL ...` as written, with vllm replaced: the model first (the real command's parser)
    from services.cli import main as cli_main

    served = {}
    monkeypatch.setattr("services.launcher.run_up", lambda settings: served.setdefault("settings", settings) and 0)
    monkeypatch.setattr("services.cli.require_model", lambda *args: None)
    with pytest.raises(SystemExit):
        cli_main(["serve", "/models/Llama-3.2-1B-Instruct", "-tp", "2", "--max-num-seqs", "8"])
    assert served["settings"].model == "/models/Llama-3.2-1B-Instruct" and served["settings"].tensor_parallel == 2
    assert served["settings"].max_batch_size == 8
    assert parsed_settings(["--gpu-memory-utilization", "0.9"]).gpu_memory_utilization == 0.9
    config = tmp_path / "serve.yaml"
    config.write_text("tensor-parallel-size: 2\n--max-num-seqs: 32\nmax_num_batched_tokens: 1024\nblock-size: 32\n"
                      "max-model-len: 4096\nno-prefix-caching: true\nenforce-eager: true\napi-key: [k1, 12345]\n"
                      "api-keys: k0\n")
    from_file = parsed_settings(["--config", str(config)])
    assert (from_file.tensor_parallel, from_file.max_batch_size, from_file.max_batch_tokens, from_file.kv_block_size,
            from_file.max_model_len, from_file.prefix_caching, from_file.enforce_eager) == (2, 32, 1024, 32, 4096, False,
                                                                                            True)
    assert from_file.api_keys.split(",") == ["k0", "k1", "12345"], "api-key adds to api-keys in a file too"
    # Keys on the command line replace the file's (a key can be taken back without editing the file)
    assert parsed_settings(["--config", str(config), "--api-key", "k9"]).api_keys == "k9"
    # The command line over the file, the file over the environment
    monkeypatch.setenv("ITERSERVE_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("ITERSERVE_MAX_BATCH_TOKENS", "64")
    assert parsed_settings(["--config", str(config), "--max-num-seqs", "16"]).max_batch_size == 16
    assert parsed_settings(["--config", str(config)]).max_batch_tokens == 1024
    assert parsed_settings([]).max_batch_tokens == 64
    config.write_text("max-num-seqs: 4\nkv-transfer-config: {}\n")
    with pytest.raises(ValueError, match="unknown option 'kv-transfer-config'"):
        parsed_settings(["--config", str(config)])
    # vLLM's speculative-config, as a mapping in the file or JSON on the command line
    config.write_text("speculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    assert json.loads(parsed_settings(["--config", str(config)]).speculative_config) == {
        "method": "ngram", "num_speculative_tokens": 3}
    assert parsed_settings(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'
                            ]).speculative_config == '{"method": "ngram", "num_speculative_tokens": 2}'
    # A template given inline as vLLM takes it, longer than a file name may be (a real one is)
    from shared.tokenizer import read_chat_template

    inline = "{% for message in messages %}" + "<|turn|>" * 60 + "{{ message['content'] }}{% endfor %}"
    assert read_chat_template(inline) == inline
    # Through the real command: a bad file or value stops it with exit 2 and the reason
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("kv-transfer-config: {}\n")
    for argv, said in ((["worker", "--config", str(unknown)], "unknown option 'kv-transfer-config'"),
                       (["worker", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
                        "unknown method 'eagle'"),
                       (["worker", "--max-num-seqs", "0"], "max_batch_size"),
                       (["worker", "--max-model-len", "100000"], "--max-model-len 100000 exceeds the context length"),
                       (["worker", "--chat-template", "/no/such/template"], "not a file, nor a template"),
                       (["worker", "--chat-template", "x" * 300], "File name too long"),
                       (["worker", "--tokenizer", "/no/such/model"], "--tokenizer /no/such/model"),
                       (["up", "--gpu-memory-utilization", "0.5", "-tp", "3"], "use kv_memory_fraction with a group")):
        run = subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=REPO, capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        assert run.returncode == 2 and said in run.stderr, (argv, run.returncode, run.stderr[-1500:])


def test_max_model_len_and_gpu_memory_utilization_size_what_a_worker_serves(monkeypatch):
    """--max-model-len cuts the served context (the engine refuses a longer item, its KV rows hold no
    more); --gpu-memory-utilization (vLLM's meaning) sizes the KV pool from that share of the device's
    whole memory less the worker's own weights and activations; a share that leaves no room for a
    block, or more than the device has free, is refused."""
    import torch

    from services.worker import engine as engine_module
    from services.worker.engine import Engine, KVPoolTooSmall
    from shared.config import Settings
    from shared.model_file import serving_config
    from tests.engine_helpers import TINY_CONFIG

    assert serving_config(TINY_CONFIG, 100).context_length == 100
    assert serving_config(TINY_CONFIG, 0) is TINY_CONFIG and serving_config(TINY_CONFIG, 10_000) is TINY_CONFIG
    gib = 1 << 30
    monkeypatch.setattr(engine_module, "memory_bytes", lambda device: (6 * gib, 10 * gib))  # 4 GiB in use elsewhere
    block = 2 * TINY_CONFIG.n_layers * TINY_CONFIG.n_kv_heads * TINY_CONFIG.head_dim * 16 * 4
    settings = Settings(gpu_memory_utilization=0.5, kv_block_size=16)
    own = engine_module.own_bytes(TINY_CONFIG, settings, torch.float32)
    assert 0 < own < gib
    # Half the device, less this worker's own weights and activations: not what other processes hold.
    assert Engine.kv_blocks_in(TINY_CONFIG, settings, torch.device("cpu"), torch.float32) == (5 * gib - own) // block
    with pytest.raises(KVPoolTooSmall, match="more than cpu has free"):  # 7 GiB wanted, 6 free
        Engine.kv_blocks_in(TINY_CONFIG, Settings(gpu_memory_utilization=0.7), torch.device("cpu"), torch.float32)
    # A draft model (speculative_config draft_model): its weights are the worker's own, and its KV
    # sits at every slot of the pool, so a block costs the target's and the draft's bytes.
    from shared.model_file import load_metadata

    smollm2 = load_metadata().config
    drafting = Settings(gpu_memory_utilization=0.5, kv_block_size=16, speculative_config=json.dumps(
        {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 2}))
    with_draft = engine_module.own_bytes(TINY_CONFIG, drafting, torch.float32)
    assert with_draft - own == engine_module.shaped_weight_bytes(smollm2, torch.float32)
    draft_block = 2 * smollm2.n_layers * smollm2.n_kv_heads * smollm2.head_dim * 16 * 4
    assert (Engine.kv_blocks_in(TINY_CONFIG, drafting, torch.device("cpu"), torch.float32)
            == (5 * gib - with_draft) // (block + draft_block))
    monkeypatch.setattr(engine_module, "own_bytes", lambda *args: 4 * gib + 1)
    with pytest.raises(KVPoolTooSmall, match="no room for a KV block"):
        Engine.kv_blocks_in(TINY_CONFIG, Settings(gpu_memory_utilization=0.4), torch.device("cpu"), torch.float32)
