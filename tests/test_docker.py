"""`docker compose` for real: the project's image built from the Dockerfile, the compose deployment
(Redis with append-only file and password, gateway, scheduler, two workers) brought up on a Docker
engine of the test's own, used with the `openai` client, scaled to 3 workers and back to 1 with
requests in flight, its Redis container restarted mid-run, and brought down leaving nothing.

Host networking (tests/docker-compose.host.yml, docker-compose.yml's services on loopback): see
tests/docker_env.py for why, and for the images built locally (no registry here). The timings
it prints (`figures:`, with -s) go into docs/deployment.md.
"""

import concurrent.futures
import contextlib
import json
import os
import socket
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest
import yaml

from tests.docker_env import (
    PYTHON_IMAGE,
    REDIS_IMAGE,
    DockerEngine,
    ensure_base_images,
    ensure_packages,
    run,
    torch_index,
)

pytestmark = [pytest.mark.slow, pytest.mark.docker]
REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "tests" / "docker-compose.host.yml"
SENTINEL_FILE = REPO / "tests" / "docker-compose.sentinel.host.yml"  # (over COMPOSE_FILE)
IMAGE = "iterserve:test"
MODEL = "smollm2-135m-instruct"
PROMPTS = [f"Write about the sea, take {index}:" for index in range(6)]
MAX_TOKENS = 40


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Deployment:
    """One compose project on the test's engine."""

    def __init__(self, engine: DockerEngine, *files: Path) -> None:
        self.engine = engine
        self.files = [COMPOSE_FILE, *files]
        self.project = f"iterserve-test-{uuid.uuid4().hex[:8]}"
        self.gateway_port, self.redis_port = free_port(), free_port()
        self.password = uuid.uuid4().hex
        self.env = dict(engine.env, ITERSERVE_IMAGE=IMAGE, ITERSERVE_REDIS_IMAGE=REDIS_IMAGE,
                        ITERSERVE_REDIS_PORT=str(self.redis_port), ITERSERVE_GATEWAY_PORT=str(self.gateway_port),
                        ITERSERVE_REDIS_PASSWORD=self.password, ITERSERVE_WORKER_THREADS="1")
        if SENTINEL_FILE in files:
            self.sentinel_ports = [free_port() for _ in range(3)]
            self.env |= {"ITERSERVE_REDIS_REPLICA_PORT": str(free_port())}
            self.env |= {f"ITERSERVE_SENTINEL_PORT_{index + 1}": str(port)
                         for index, port in enumerate(self.sentinel_ports)}
        self.url = f"http://127.0.0.1:{self.gateway_port}"

    def compose(self, *arguments: str, timeout: float = 300) -> str:
        files = [part for file in self.files for part in ("-f", str(file))]
        completed = run("docker-compose", "-p", self.project, *files, *arguments, env=self.env, timeout=timeout)
        return completed.stdout.decode(errors="replace")

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/status", timeout=10) as response:
            return json.load(response)

    def wait_workers(self, count: int, timeout: float = 180) -> float:
        """Seconds until /health is 200 and exactly `count` workers are live."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    healthy = response.status == 200
                if healthy and len(self.status()["workers"]) == count:
                    return time.monotonic() - started
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"{count} workers never came up:\n{self.compose('logs', '--tail=40')}")

    def leftovers(self) -> dict[str, str]:
        label = f"label=com.docker.compose.project={self.project}"
        found = {kind: self.engine.docker(kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter",
                                          label).stdout.decode().strip()
                 for kind in ("container", "volume", "network")}
        return {kind: ids for kind, ids in found.items() if ids}


@pytest.fixture(scope="module")
def engine():
    """The test's Docker engine, with the images built."""
    ensure_packages()
    figures = {}
    with DockerEngine() as engine:
        figures |= {f"{name}_image_build_s": round(seconds, 1) for name, seconds in ensure_base_images(engine).items()}
        with torch_index() as index:
            figures["project_image_build_s"] = round(engine.build(IMAGE, REPO, BASE_IMAGE=PYTHON_IMAGE,
                                                                  TORCH_INDEX=index), 1)
        size = engine.docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.decode().strip()
        figures["project_image_mb"] = int(size) // 2**20
        engine.figures = figures
        yield engine
        print(f"figures: docker {figures}")


@contextlib.contextmanager
def deployed(engine: DockerEngine, workers: int, *files: Path):
    deployment = Deployment(engine, *files)
    try:
        started = time.monotonic()
        deployment.compose("up", "-d", "--scale", f"worker={workers}")
        deployment.figures = engine.figures
        deployment.figures["up_seconds" if not files else "sentinel_up_seconds"] = round(time.monotonic() - started, 1)
        healthy = round(deployment.wait_workers(workers), 1)
        deployment.figures[f"healthy_with_{workers}_workers_s" if not files else "sentinel_healthy_s"] = healthy
        yield deployment
    finally:
        deployment.compose("down", "-v", "--remove-orphans", "--timeout", "15")
        left = deployment.leftovers()
        assert not left, f"compose down left {left}"


@pytest.fixture(scope="module")
def deployment(engine):
    with deployed(engine, 2) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def baseline(client):
    """Each prompt's greedy completion and finish reason, one at a time, before any fault."""
    answers = {}
    for prompt in PROMPTS:
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0]
        answers[prompt] = (choice.text, choice.finish_reason)
    return answers


def stream_text(client, prompt: str) -> tuple[str, str]:
    text, reason = [], None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True):
        text.append(chunk.choices[0].text or "")
        reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def test_the_compose_files_define_the_same_deployment():
    """The test's host-network file runs what docker-compose.yml runs."""
    shipped = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    tested = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    assert set(shipped) == set(tested)
    for name in ("scheduler", "worker"):
        assert shipped[name]["command"] == tested[name]["command"]
    assert tested["gateway"]["command"][0] == shipped["gateway"]["command"][0] == "gateway"
    assert shipped["redis"]["command"][:6] == tested["redis"]["command"][:6]  # append-only, fsync, password
    for name in shipped:
        assert shipped[name].get("restart") == "unless-stopped" or name != "redis" and tested[name].get("restart")


def test_the_openai_client_chats_completes_streams_and_cancels(deployment, client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8,
                                          temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
    streamed, reason = stream_text(client, "The capital of France is")
    assert reason in ("length", "stop") and streamed.startswith(completion.choices[0].text)
    with client.completions.with_streaming_response.create(model=MODEL, prompt="Count to a thousand:",
                                                           max_tokens=300, temperature=0, stream=True) as response:
        request_id = response.headers["X-Request-Id"]
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        cancel = urllib.request.Request(f"{deployment.url}/v1/requests/{request_id}", method="DELETE")
        with urllib.request.urlopen(cancel, timeout=30) as answer:
            assert json.load(answer)["cancelled"] is True


def test_scaling_workers_to_3_and_back_to_1_with_requests_in_flight_loses_nothing(deployment, client, baseline):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {prompt: pool.submit(stream_text, client, prompt) for prompt in PROMPTS}
        time.sleep(1.0)
        started = time.monotonic()
        deployment.compose("up", "-d", "--no-recreate", "--scale", "worker=3")
        deployment.wait_workers(3)
        deployment.figures["scale_to_3_registered_s"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        deployment.compose("up", "-d", "--no-recreate", "--scale", "worker=1", timeout=300)
        deployment.figures["scale_to_1_s"] = round(time.monotonic() - started, 1)
        answers = {prompt: future.result(timeout=300) for prompt, future in futures.items()}
    for prompt, (text, reason) in answers.items():
        assert (text, reason) == baseline[prompt], prompt
    deployment.wait_workers(1)


def test_a_redis_container_restart_mid_run_loses_no_request(deployment, client, baseline):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {prompt: pool.submit(stream_text, client, prompt) for prompt in PROMPTS}
        time.sleep(1.0)
        started = time.monotonic()
        deployment.compose("restart", "redis", timeout=120)
        deployment.figures["redis_restart_s"] = round(time.monotonic() - started, 1)
        answers = {prompt: future.result(timeout=300) for prompt, future in futures.items()}
    for prompt, (text, reason) in answers.items():
        assert (text, reason) == baseline[prompt], prompt
    deployment.wait_workers(1)


def test_the_sentinel_compose_files_define_the_same_redis_group():
    """The test's host-network Sentinel file runs what docker-compose.sentinel.yml runs."""
    shipped = yaml.safe_load((REPO / "docker-compose.sentinel.yml").read_text())["services"]
    tested = yaml.safe_load(SENTINEL_FILE.read_text())["services"]
    assert set(shipped) == set(tested)
    for name in ("redis", "redis-replica"):  # append-only, fsync, password, the primary's password
        assert tested[name]["command"][:6] == shipped[name]["command"][:6], name
        assert "--masterauth" in tested[name]["command"] and "--replica-announce-ip" in tested[name]["command"]
    assert "--replicaof" in tested["redis-replica"]["command"]
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        for setting in ("down-after-milliseconds iterserve 1000", "failover-timeout iterserve 10000",
                        "parallel-syncs iterserve 1", "auth-pass iterserve", " 2\\n", "--sentinel"):
            assert setting in shipped[name]["command"][0] and setting in tested[name]["command"][0], (name, setting)
    for name in ("gateway", "scheduler", "worker"):
        assert tested[name]["environment"]["REDIS_URL"].startswith("redis+sentinel://")
        assert tested[name]["environment"]["ITERSERVE_REDIS_WAIT_REPLICAS"] == "1"


def test_the_sentinel_deployment_serves_through_the_sentinels_and_a_killed_primary_loses_no_request(engine):
    """docker-compose.sentinel.yml's Redis group in containers: the primary container SIGKILLed with
    streams in flight; the Sentinels promote the replica, every service follows, and every stream
    completes with the output it has without a fault."""
    import redis as redis_client

    with deployed(engine, 1, SENTINEL_FILE) as deployment:
        client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", timeout=300, max_retries=0)
        expected = {prompt: (choice.text, choice.finish_reason) for prompt in PROMPTS[:3]
                    for choice in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                            temperature=0).choices}
        sentinel = redis_client.Redis(host="127.0.0.1", port=deployment.sentinel_ports[0], socket_timeout=5)
        try:
            def primary_port() -> int:
                return int(sentinel.execute_command("SENTINEL", "get-master-addr-by-name", "iterserve")[1])
            assert primary_port() == deployment.redis_port
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                futures = {prompt: pool.submit(stream_text, client, prompt) for prompt in PROMPTS[:3]}
                time.sleep(1.0)
                killed = time.monotonic()
                deployment.compose("kill", "-s", "SIGKILL", "redis", timeout=60)
                deadline = time.monotonic() + 60
                while primary_port() == deployment.redis_port:
                    assert time.monotonic() < deadline, deployment.compose("logs", "--tail=30")
                    time.sleep(0.2)
                deployment.figures["sentinel_promoted_after_kill_s"] = round(time.monotonic() - killed, 1)
                answers = {prompt: future.result(timeout=300) for prompt, future in futures.items()}
                deployment.figures["sentinel_streams_done_after_kill_s"] = round(time.monotonic() - killed, 1)
        finally:
            sentinel.close()
        assert answers == expected
        # after the failover, a new request is served by the promoted replica
        after = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert (after.choices[0].text, after.choices[0].finish_reason) == expected[PROMPTS[0]]
