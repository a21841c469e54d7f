"""Every service as its own OS process over a private Redis, each one killable and restartable:
the harness of the chaos suite (tests/test_chaos.py).

    with Cluster(workers=2) as cluster:       # redis-server (append-only), scheduler, workers, gateway
        cluster.kill("worker-1")               # SIGKILL its process group
        cluster.start_worker()                 # worker-3
        cluster.restart_redis()

Each service runs `python -m services.cli <kind>` in its own session (so a kill takes its whole
process group) with PR_SET_PDEATHSIG (so none outlives the test process), logs to a file, and is
killed and reaped when the cluster closes, whatever happened in the test.
"""

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from services.launcher import die_with_parent
from shared.redis_connection import sync_client
from tests.redis_server import RedisGroupProcess, RedisProcess, free_port

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_SECONDS = 180  # a cold start converts the GGUF; a warm one takes a few seconds
STOP_TIMEOUT_SECONDS = 20
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass(eq=False)
class Service:
    name: str  # scheduler, gateway, worker-1 ...
    kind: str  # scheduler, gateway, worker
    process: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]
    worker_id: str = ""
    started_at: float = field(default_factory=time.time)

    def running(self) -> bool:
        return self.process.poll() is None


class Cluster:
    def __init__(self, *, workers: int = 2, kv_blocks: int = 256, max_batch_size: int = 64, threads: int = 1,
                 redis_args: tuple[str, ...] = (), redis_replicas: int = 0, schedulers: int = 1,
                 **settings: object) -> None:
        """redis_replicas > 0: a Redis that fails over (tests/redis_server.py RedisGroupProcess), every
        service through its Sentinels, the gateway accepting once a replica holds a request.
        schedulers > 1: that many schedulers (scheduler-1, scheduler-2 ...), each leasing a shard."""
        self.workers_at_start = workers
        self.scheduler_names = ["scheduler"] if schedulers == 1 else [f"scheduler-{i + 1}" for i in range(schedulers)]
        self.directory = Path(tempfile.mkdtemp(prefix="iterserve-chaos-"))
        if redis_replicas:
            self.redis = RedisGroupProcess(str(self.directory / "redis"), redis_replicas)
            settings = {"redis_wait_replicas": 1} | settings
        else:
            self.redis = RedisProcess(data_dir=str(self.directory / "redis"), extra_args=redis_args)
        os.makedirs(self.redis.data_dir, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Admission control is not under test here: room for a storm of concurrent clients.
        options = {"port": self.port, "kv_blocks": kv_blocks, "max_batch_size": max_batch_size, "threads": threads,
                   "device": "cpu", "max_streams_per_key": 1024, "schedulers": schedulers, **settings}
        self.env = dict(os.environ) | {"REDIS_URL": self.redis.url, "PYTHONUNBUFFERED": "1",
                                       "ITERSERVE_LOG_LEVEL": "INFO", "ITERSERVE_LOG_REQUESTS": "1"}
        self.env |= {f"ITERSERVE_{name.upper()}": str(value) for name, value in options.items()}
        self.services: dict[str, Service] = {}  # every service started, by name (the latest of a name)
        self.history: list[Service] = []  # every process started, killed ones included
        self._workers_started = 0

    # Lifetime

    def __enter__(self) -> "Cluster":
        try:
            self.redis.start()
            for name in self.scheduler_names:
                self.start("scheduler", name)
            for _ in range(self.workers_at_start):
                self.start_worker()
            self.start("gateway")
            self.wait_ready(self.workers_at_start)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process group and reap it, stop Redis, remove the temp directory."""
        for service in self.history:
            self._kill_group(service, signal.SIGKILL)
        for service in self.history:
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.process.wait(timeout=STOP_TIMEOUT_SECONDS)
            service.log_file.close()
        self.redis.stop(kill=True)
        if os.environ.get("ITERSERVE_TEST_KEEP_LOGS"):  # (a directory: each cluster's logs copied there)
            keep = Path(os.environ["ITERSERVE_TEST_KEEP_LOGS"]) / self.directory.name
            shutil.copytree(self.directory, keep, ignore=shutil.ignore_patterns("redis*"), dirs_exist_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)

    # Services

    def start(self, kind: str, name: str | None = None, module: str = "services.cli", **env: str) -> Service:
        """module: what `python -m` runs (tests.faulty_worker injects an engine fault)."""
        name = name or kind
        log_path = self.directory / f"{name}-{len(self.history)}.log"
        log_file = open(log_path, "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", module, kind], cwd=REPO, env=self.env | env, stdout=log_file,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )
        service = Service(name, kind, process, log_path, log_file, worker_id=env.get("ITERSERVE_WORKER_ID", ""))
        self.services[name] = service
        self.history.append(service)
        return service

    def start_worker(self, module: str = "services.cli", **env: str) -> Service:
        self._workers_started += 1
        name = f"worker-{self._workers_started}"
        return self.start("worker", name, module, ITERSERVE_WORKER_ID=f"chaos-w{self._workers_started}", **env)

    def kill(self, name: str, signal_number: int = signal.SIGKILL) -> float:
        """Send a signal to a service's process group; SIGKILL also reaps it. Returns when it was sent."""
        service = self.services[name]
        sent_at = time.time()
        self._kill_group(service, signal_number)
        if signal_number == signal.SIGKILL:
            service.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        return sent_at

    def name_of_worker(self, worker_id: str) -> str:
        return next(service.name for service in self.services.values() if service.worker_id == worker_id)

    def wait_exit(self, name: str, timeout: float) -> int:
        return self.services[name].process.wait(timeout=timeout)

    @staticmethod
    def _kill_group(service: Service, signal_number: int) -> None:
        if service.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(service.process.pid, signal_number)

    def restart_redis(self, kill: bool = True, down_seconds: float = 0.0) -> tuple[float, float]:
        """Stop Redis (SIGKILL by default: nothing flushed on the way out) and, after down_seconds,
        start it again on the same port and append-only file. Returns (stopped_at, answering_again_at)."""
        stopped_at = time.time()
        self.redis.stop(kill=kill)
        time.sleep(down_seconds)
        self.redis.start()
        return stopped_at, time.time()

    def restart_redis_losing_writes_after(self, second: int) -> tuple[float, float]:
        """SIGKILL Redis, cut its append-only file back to the end of unix second `second` (the
        writes of later seconds are lost, acknowledged or not) and start it again on that file.
        Needs redis_args=("--aof-timestamp-enabled", "yes"). Returns (stopped_at, answering_again_at)."""
        binary = shutil.which("redis-check-aof")
        if binary is None:
            raise RuntimeError("redis-check-aof is not installed (apt-get install redis-tools)")
        stopped_at = time.time()
        self.redis.stop(kill=True)
        manifest = Path(self.redis.data_dir) / "appendonlydir" / "appendonly.aof.manifest"
        subprocess.run([binary, "--truncate-to-timestamp", str(second), str(manifest)],
                       check=True, capture_output=True, timeout=30)
        self.redis.start()
        return stopped_at, time.time()

    # Looking at it

    def get_json(self, path: str, timeout: float = 5.0) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def get_text(self, path: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(f"{self.base_url}{path}", timeout=timeout) as response:
            return response.read().decode()

    def wait_ready(self, workers: int, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Until /health is 200 and /status lists `workers` live workers, none draining, and a
        running scheduler has seen them too (it polls heartbeats: requests sent before it does would
        all go to the workers it already knows)."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            for service in self.services.values():
                if not service.running() and service.name in ("gateway", *self.scheduler_names):
                    raise RuntimeError(f"{service.name} exited with {service.process.returncode}:\n"
                                       f"{self.log(service.name)[-3000:]}")
            try:
                health, _ = self.get_json("/health")
                _, status = self.get_json("/status")
                live = [worker for worker in status["workers"] if not worker["draining"]]
                scheduling = any(name in self.services and self.services[name].running()
                                 for name in self.scheduler_names)
                unseen = [worker["id"] for worker in live if scheduling and worker["id"] not in
                          ((status["models"][worker["model"]]["scheduler"] or {}).get("kv_blocks") or {})]
                last = (health, len(live), unseen)
                if health == 200 and len(live) == workers and not unseen:
                    return
            except (urllib.error.URLError, OSError, ValueError) as error:
                last = error
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {name}\n{self.log(name)[-1500:]}" for name in self.services)
                raise TimeoutError(f"cluster not ready after {timeout}s (last: {last}):\n{logs}")
            time.sleep(0.2)

    def redis_client(self) -> redis.Redis:
        return sync_client(self.redis.url, 10)

    def _named(self, service: Service, name: str) -> bool:
        """"scheduler" names every scheduler of the cluster (scheduler-1, scheduler-2 ... with several)."""
        return service.name == name or (name == "scheduler" and service.name in self.scheduler_names)

    def log(self, name: str) -> str:
        """Every log of the services of that name (a restarted one has several), oldest first."""
        return "".join(service.log_path.read_text(errors="replace") for service in self.history
                       if self._named(service, name) and service.log_path.exists())

    def logs(self, name: str) -> list[str]:
        """Each process's log, apart: one for each scheduler ("scheduler") and each restart."""
        return [service.log_path.read_text(errors="replace") for service in self.history
                if self._named(service, name) and service.log_path.exists()]

    def log_events(self, name: str, event: str) -> list[tuple[float, str]]:
        """(unix time, line) of each log line of that service (every scheduler's, for "scheduler")
        containing `event`, in time order."""
        found = []
        for line in self.log(name).splitlines():
            match = LOG_TIME.match(line)
            if match and event in line:
                when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append((when, line))
        return sorted(found, key=lambda event_found: event_found[0])
