"""The deployment files users run: compose file valid, Dockerfile and README in step."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]],
                         ids=["cpu", "gpu"])
def test_docker_compose_file_is_valid_for_debian_docker_compose(files):
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed: `./dev test` installs it (apt-get install docker-compose)")
    arguments = [part for name in files for part in ("-f", name)]
    result = subprocess.run(["docker-compose", *arguments, "config"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    if "docker-compose.gpu.yml" in files:  # the worker, and only it, reserves a GPU
        worker, others = result.stdout.split("\n  worker:\n", 1)[1], result.stdout.split("\n  worker:\n", 1)[0]
        assert "capabilities:\n            - gpu" in worker and "ITERSERVE_DEVICE: cuda" in worker
        assert "capabilities" not in others


def test_compose_runs_every_service_with_restart_policies_and_persistent_redis():
    compose = (REPO / "docker-compose.yml").read_text()
    for service in ("redis:", "gateway:", "scheduler:", "worker:"):
        assert f"\n  {service}" in compose
    assert "--appendonly" in compose and "healthcheck:" in compose and "restart: unless-stopped" in compose
    assert '"8000:8000"' in compose


def test_readme_opens_with_exactly_the_two_setup_commands_that_exist():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^\./dev (\w+)", readme, flags=re.MULTILINE)
    assert commands[:2] == ["up", "test"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "./dev test" in ci


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
