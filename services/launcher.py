"""`iterserve up`: the whole system on one machine, each service its own OS process.

Starts a private redis-server (append-only, data kept under the data directory) unless a
Redis URL is given, then the scheduler, the workers and the gateway; prefixes their logs;
on Ctrl-C or SIGTERM stops them all and reaps them. A child that dies is reported and, like
compose's restart policy, started again after a short back-off, unless it said its settings can
never work (shared/exits.py): then everything stops and `up` exits 2 with its message. With
--scheduler-cpus the
schedulers run on those CPUs alone, kept from idling (services/keep_awake.py), and every other
process on the others.
"""

import collections
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from shared.config import Settings, cpu_list, cpu_text, threads_per_worker
from shared.exits import CONFIGURATION_ERROR
from shared.served_models import served_models
from services.redis_group import PRIMARY_NAME, SENTINELS, RedisGroup, promotable_once_synced, restart_under
from shared.redis_connection import credentials_error, redacted

log = logging.getLogger("iterserve.up")

STOP_GRACE_SECONDS = 15.0
RESTART_BACKOFF_SECONDS = 2.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Children get SIGTERM if `iterserve up` itself is killed (Linux), so none is left behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Child:
    def __init__(self, name: str, command: list[str], env: dict[str, str], cpus: frozenset[int] | None = None):
        """cpus: the CPUs it runs on (None: wherever the launcher may), set before it starts (so every
        thread it makes runs there too)."""
        self.name, self.command, self.env, self.cpus = name, command, env, cpus
        self.process: subprocess.Popen | None = None
        self.exited_at = 0.0
        self.last_lines: collections.deque[str] = collections.deque(maxlen=20)  # what it said last

    def _prepare(self) -> None:
        """In the child, before it runs its command."""
        die_with_parent()
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=self._prepare,
        )
        self._relaying = threading.Thread(target=self._relay, args=(self.process,), daemon=True)
        self._relaying.start()
        log.info("event=started process=%s pid=%d", self.name, self.process.pid)

    def _relay(self, process: subprocess.Popen) -> None:
        prefix = f"{self.name:<10}| ".encode()
        for line in iter(process.stdout.readline, b""):
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.flush()
            self.last_lines.append(line.decode(errors="replace").rstrip())

    def said(self, start: str) -> str:
        """Its last line of output starting with `start` (once its process has ended: the relay reads
        to the end of its output first)."""
        self._relaying.join(timeout=5)
        return next((line for line in reversed(self.last_lines) if line.startswith(start)), "")

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, number: int) -> None:
        if self.running():
            self.process.send_signal(number)

    def wait(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("event=kill process=%s pid=%d reason=did_not_stop", self.name, self.process.pid)
            self.process.kill()
            self.process.wait(timeout=10)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a private Redis, a gateway, a test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_split(settings: Settings) -> tuple[frozenset[int], frozenset[int]] | None:
    """(the scheduler's CPUs, everyone else's) for --scheduler-cpus, None without it; ValueError saying
    why when the CPUs are not this process's to give, or leave none for the others."""
    scheduler_cpus = cpu_list(settings.scheduler_cpus)
    if not scheduler_cpus:
        return None
    available = frozenset(os.sched_getaffinity(0))
    if not scheduler_cpus <= available:
        raise ValueError(f"--scheduler-cpus {settings.scheduler_cpus}: CPU {cpu_text(scheduler_cpus - available)} "
                         f"is not among this process's CPUs ({cpu_text(available)})")
    if scheduler_cpus == available:
        raise ValueError(f"--scheduler-cpus {settings.scheduler_cpus} leaves no CPU for the workers, the gateway "
                         f"and Redis (this process's CPUs: {cpu_text(available)})")
    return scheduler_cpus, available - scheduler_cpus


def redis_child(data_dir: Path, cpus: frozenset[int] | None = None) -> tuple[Child, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("iterserve up: redis-server is not installed; install it (apt-get install redis-server) "
                         "or pass --redis-url")
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
               "--appendfsync", "everysec", "--dir", str(data_dir)]
    return Child("redis", command, dict(os.environ), cpus), f"redis://127.0.0.1:{port}/0"


def redis_group_children(data_dir: Path, replicas: int, cpus: frozenset[int] | None = None
                         ) -> tuple[RedisGroup, list[Child]]:
    """A primary, `replicas` replicas and three Sentinels (services/redis_group.py), not started."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("iterserve up: redis-server is not installed; install it (apt-get install redis-server "
                         "redis-sentinel) or pass --redis-url")
    group = RedisGroup(data_dir, free_port(), tuple(free_port() for _ in range(replicas)),
                       tuple(free_port() for _ in range(SENTINELS)))
    return group, [Child(name, command, dict(os.environ), cpus) for name, command in group.commands(binary)]


def wait_for_group(group: RedisGroup, timeout: float = 20.0) -> None:
    """Until the primary answers, every replica is in sync with it and every Sentinel names it and
    knows every replica and every other Sentinel (a Sentinel learns of replicas from the primary's
    INFO every 10 s, of the others every 2 s: before that it could not promote a replica)."""
    deadline = time.monotonic() + timeout
    wait_for_redis(group.server_url(group.primary_port), timeout)
    primary = redis.Redis.from_url(group.server_url(group.primary_port), socket_connect_timeout=0.5)
    sentinels = [redis.Redis(host=group.host, port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
                 for port in group.sentinel_ports]
    try:
        while True:
            try:
                synced = sum(1 for name, value in primary.info("replication").items()
                             if name.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")
                named = [sentinel.sentinel_get_master_addr_by_name(PRIMARY_NAME) for sentinel in sentinels]
                known = [sentinel.sentinel_master(PRIMARY_NAME) for sentinel in sentinels]
                if (synced >= len(group.replica_ports)
                        and all(address and int(address[1]) == group.primary_port for address in named)
                        and all(int(state["num-slaves"]) >= len(group.replica_ports)
                                and int(state["num-other-sentinels"]) >= len(sentinels) - 1 for state in known)):
                    return
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError, redis.exceptions.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"iterserve up: the Redis replicas and Sentinels were not ready in {timeout:.0f} s")
            time.sleep(0.1)
    finally:
        primary.close()
        for sentinel in sentinels:
            sentinel.close()


def wait_for_redis(url: str, timeout: float = 15.0) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


def visible_gpus() -> list[str]:
    """The GPUs workers may use, without importing torch: CUDA_VISIBLE_DEVICES when set, else what
    nvidia-smi lists (none on a machine without NVIDIA's driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [device.strip() for device in visible.split(",") if device.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def scheduler_shares(cpus: frozenset[int] | None, schedulers: int) -> list[frozenset[int] | None]:
    """Each of a model's schedulers' CPUs: its own from --scheduler-cpus, dealt in turn (Settings
    checks there are enough), or none pinned."""
    if not cpus:
        return [None] * schedulers
    ordered = sorted(cpus)
    return [frozenset(ordered[index::schedulers]) for index in range(schedulers)]


def worker_gpu_env(settings: Settings, worker_index: int, gpus: list[str]) -> dict[str, str]:
    """Worker i on GPU i (round-robin when there are more workers than GPUs): each sees one device,
    as cuda:0; a worker group of N ranks sees the next N GPUs, rank r on its r-th. Nothing changes
    with one GPU or none, or when --device names a device itself."""
    if settings.device not in ("auto", "cuda") or len(gpus) < 2:
        return {}
    size = settings.group_size
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[(worker_index * size + rank) % len(gpus)] for rank in range(size))}


def data_directory() -> Path:
    return Path(os.environ.get("ITERSERVE_DATA_DIR", Path.home() / ".local" / "share" / "iterserve"))


def run_up(settings: Settings) -> int:
    if settings.executor == "emulated":  # a bad profile is said once, here, not by every worker restart
        from services.worker.hardware import ProfileError, load_profile

        try:
            profile = load_profile(settings.hardware)
        except ProfileError as error:
            log.error("event=bad_hardware_profile error=%s", error)
            return 2
        log.warning("event=emulated_executor hardware=%s note=EMULATED workers: no model runs, steps take the "
                    "time the profile gives (a benchmarking instrument)", profile.name)
    if settings.redis_replicas and settings.redis_url:
        log.error("event=bad_redis_replicas error=--redis-replicas is for up's own Redis: with --redis-url, give "
                  "your Sentinels' URL (redis+sentinel://host:port,.../primary-name)")
        return 2
    try:
        split = cpu_split(settings)
    except ValueError as error:
        log.error("event=bad_scheduler_cpus error=%s", error)
        return 2
    scheduler_cpus, other_cpus = split or (None, None)
    stop_requested = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stop_requested.set())

    redis_processes: list[Child] = []  # its own Redis, if it runs one (the last to stop)
    group: RedisGroup | None = None
    if not settings.redis_url and settings.redis_replicas:
        group, redis_processes = redis_group_children(data_directory() / "redis-group", settings.redis_replicas,
                                                      other_cpus)
        for child in redis_processes:
            child.start()
        wait_for_group(group)
        # Acceptance waits for a replica: a promotion loses no accepted request
        settings = settings.model_copy(update={"redis_url": group.url,
                                               "redis_wait_replicas": settings.redis_wait_replicas or 1})
        log.info("event=redis_group primary=%d replicas=%s sentinels=%s", group.primary_port,
                 ",".join(map(str, group.replica_ports)), ",".join(map(str, group.sentinel_ports)))
    elif not settings.redis_url:
        redis_process, url = redis_child(data_directory() / "redis", other_cpus)
        redis_process.start()
        redis_processes = [redis_process]
        wait_for_redis(url)
        settings = settings.model_copy(update={"redis_url": url})
    elif problem := credentials_error(settings.redis_url):
        log.error("event=redis_refused %s", problem)
        return 2
    models = served_models(settings)
    threads = settings.threads or threads_per_worker(settings.workers * len(models) * settings.group_size,
                                                     len(other_cpus) if other_cpus else None)
    env = dict(os.environ) | settings.to_env() | {"PYTHONUNBUFFERED": "1"}
    service = [sys.executable, "-m", "services.cli"]
    # (services/keep_awake.py: why; first, so they stop last)
    children = [Child(f"awake-{cpu}", service + ["keep-awake"], env, frozenset([cpu]))
                for cpu in sorted(scheduler_cpus or ())]
    gpus = visible_gpus() if settings.executor == "engine" else []
    worker_count = 0
    for served in models:  # a scheduler and --workers workers per model, in the model's pool of keys
        suffix = f"-{served.name}" if len(models) > 1 else ""
        model_env = env | {"ITERSERVE_MODEL": served.path, "ITERSERVE_SERVED_MODEL_NAME": served.name,
                           "ITERSERVE_MODEL_GROUP": served.keys.group}
        for index, cpus in enumerate(scheduler_shares(scheduler_cpus, settings.schedulers)):
            name = f"scheduler{suffix}" if settings.schedulers == 1 else f"scheduler{suffix}-{index + 1}"
            children.append(Child(name, service + ["scheduler"], model_env, cpus))
        for index in range(settings.workers):
            # No fixed worker id: a restarted worker is a new worker (its predecessor's KV is gone).
            worker_env = model_env | {"ITERSERVE_THREADS": str(threads), "ITERSERVE_WORKER_ID": ""}
            worker_env |= worker_gpu_env(settings, worker_count, gpus)
            worker_count += 1
            children.append(Child(f"worker{suffix}-{index + 1}", service + ["worker"], worker_env, other_cpus))
    children.append(Child("gateway", service + ["gateway"], env, other_cpus))
    for child in children:
        child.start()
    log.info("event=up redis=%s gateway=http://%s:%d models=%s workers_per_model=%d threads_per_worker=%d gpus=%s",
             redacted(settings.redis_url), settings.host, settings.port, ",".join(model.name for model in models),
             settings.workers, threads, ",".join(gpus) if len(gpus) > 1 else "one or none: not assigned")
    if split:
        log.info("event=scheduler_cpus scheduler=%s others=%s note=each scheduler CPU kept from idling by an "
                 "idle-priority process", cpu_text(scheduler_cpus), cpu_text(other_cpus))

    refused = ""  # a child's message that its settings can never work
    # (a member of a Redis group is started again too: a primary that comes back, the Sentinels make
    # a replica of the new one; a lone Redis is not: its restart is the operator's, docs/operations.md)
    restarted = children + (redis_processes if settings.redis_replicas else [])
    unsynced: set[str] = set()  # Redis servers started again as replicas, not yet promotable
    while not refused and not stop_requested.wait(0.2):
        for name in [name for name in unsynced if promotable_once_synced(group, name)]:
            unsynced.discard(name)
        for child in restarted:
            if child.process is not None and not child.running():
                if child.process.returncode == CONFIGURATION_ERROR:
                    refused = child.said("iterserve") or f"{child.name} refused its settings"
                    log.error("event=configuration_error process=%s error=%s: stopping (restarting it cannot help)",
                              child.name, refused)
                    break
                log.warning("event=exited process=%s code=%s restart_in=%.0fs", child.name,
                            child.process.returncode, RESTART_BACKOFF_SECONDS)
                child.process, child.exited_at = None, time.monotonic()
            elif child.process is None and time.monotonic() - child.exited_at > RESTART_BACKOFF_SECONDS:
                if child in redis_processes and child.name in group.servers():
                    primary = restart_under(group, child.name, time.monotonic() - child.exited_at)
                    if primary is None:
                        continue  # started once the Sentinels agree on its primary (a promotion, if it was it)
                    child.command = group.server_command(child.command[0], child.name, primary, promotable=False)
                    if primary != group.servers()[child.name]:
                        unsynced.add(child.name)
                child.start()

    log.info("event=stopping")
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in reversed(children):  # gateway first: no new requests while the rest stops
        child.signal(signal.SIGTERM)
    for child in children:
        child.wait(deadline)
    for redis_process in reversed(redis_processes):  # (Sentinels first: no promotion while the primary stops)
        redis_process.signal(signal.SIGTERM)
    for redis_process in redis_processes:
        redis_process.wait(time.monotonic() + STOP_GRACE_SECONDS)
    log.info("event=stopped")
    if refused:
        sys.stderr.write(refused + "\n")
        return 2
    return 0
