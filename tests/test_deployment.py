"""The deployment files users run: compose file valid, Dockerfile and README in step."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def compose_config(*files: str) -> dict:
    """The compose files as docker-compose resolves them (anchors and merges applied), parsed."""
    import yaml

    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed: `./dev test` installs it (apt-get install docker-compose)")
    arguments = [part for name in files for part in ("-f", name)]
    result = subprocess.run(["docker-compose", *arguments, "config"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_the_gpu_compose_file_reserves_a_gpu_for_the_worker_only():
    services = compose_config("docker-compose.yml", "docker-compose.gpu.yml")["services"]
    worker = services["worker"]
    assert worker["environment"]["ITERSERVE_DEVICE"] == "cuda"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert [name for name, service in services.items() if "deploy" in service] == ["worker"]


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
