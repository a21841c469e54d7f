"""The deployment files users run: compose file valid, Dockerfile and README in step."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_docker_compose_file_is_valid_for_debian_docker_compose():
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed: `./dev test` installs it (apt-get install docker-compose)")
    result = subprocess.run(["docker-compose", "-f", "docker-compose.yml", "config", "-q"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


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
