"""A private Redis for tests: a container when a Docker engine answers, else a redis-server child."""

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from services.launcher import free_port  # re-exported: the tests take it from here


def wait_for_ping(url: str, timeout: float = 10.0) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.ping():
                return
        except redis.exceptions.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            client.close()


class RedisProcess:
    """redis-server on a free 127.0.0.1 port with append-only persistence in a temp dir (extra_args:
    more of redis-server's options)."""

    def __init__(self, port: int | None = None, data_dir: str | None = None, password: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self._owns_data_dir = data_dir is None  # a temp dir of its own: close() removes it
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="iterserve-redis-")
        self.password = password  # --requirepass: the URL carries it
        self.extra_args = extra_args
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> "RedisProcess":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec", "--dir", self.data_dir, *self.extra_args,
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_ping(self.url)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def close(self) -> None:
        """Stop for good: the server, and the data directory if it made its own (stop() alone keeps
        it, for a restart on the same data)."""
        self.stop()
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class RedisGroupProcess:
    """A Redis that fails over (services/redis_group.py, as `iterserve up --redis-replicas N` runs it):
    a primary, its replicas and three Sentinels on free 127.0.0.1 ports; `url` goes through the
    Sentinels. A member killed is started again by restart_stopped (the Sentinels make a primary
    that comes back a replica of the new one), as the launcher does."""

    def __init__(self, data_dir: str, replicas: int = 1) -> None:
        from services.redis_group import SENTINELS, RedisGroup

        self.data_dir = data_dir
        self.group = RedisGroup(Path(data_dir), free_port(), tuple(free_port() for _ in range(replicas)),
                                tuple(free_port() for _ in range(SENTINELS)))
        self.url = self.group.url
        self.processes: dict[str, subprocess.Popen] = {}
        self._commands: dict[str, list[str]] = {}
        self._ports: dict[str, int] = {}
        self._stopped_at: dict[str, float] = {}  # a member killed by kill_primary: when (monotonic)

    def start(self) -> "RedisGroupProcess":
        from services.launcher import wait_for_group

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        group = self.group
        ports = [group.primary_port, *group.replica_ports, *group.sentinel_ports]
        for (name, command), port in zip(group.commands(binary), ports):
            self._commands[name], self._ports[name] = command, port
            self._start(name)
        wait_for_group(group)
        return self

    def _start(self, name: str) -> None:
        self.processes[name] = subprocess.Popen(self._commands[name], stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)

    def primary_port(self) -> int:
        """The port of the server the Sentinels name primary now."""
        from services.redis_group import PRIMARY_NAME

        for port in self.group.sentinel_ports:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)
            try:
                address = client.sentinel_get_master_addr_by_name(PRIMARY_NAME)
                if address:
                    return int(address[1])
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
        raise RuntimeError("no Sentinel names a primary")

    def kill_primary(self) -> str:
        """SIGKILL the primary (its host lost); the name of the member killed."""
        port = self.primary_port()
        name = next(name for name, member_port in self._ports.items() if member_port == port)
        self.processes[name].kill()
        self.processes[name].wait(timeout=10)
        self._stopped_at[name] = time.monotonic()
        return name

    def restart_stopped(self, timeout: float = 30.0) -> None:
        """Start every member that stopped again: a server as a replica of the primary the Sentinels
        agree on, once they do (a lost primary once they promoted a replica), as the launcher does."""
        from services.redis_group import promotable_once_synced, restart_under

        deadline = time.monotonic() + timeout
        unsynced = []
        for name, process in self.processes.items():
            if process.poll() is None:
                continue
            if name in self.group.servers():
                stopped_at = self._stopped_at.get(name, 0.0)
                while (primary := restart_under(self.group, name, time.monotonic() - stopped_at)) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the Sentinels do not agree on a primary")
                    time.sleep(0.1)
                self._commands[name] = self.group.server_command(self._commands[name][0], name, primary,
                                                                 promotable=False)
                if primary != self.group.servers()[name]:
                    unsynced.append(name)
            self._start(name)
        for name in unsynced:  # (promotable once in sync, as the launcher makes them)
            while not promotable_once_synced(self.group, name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not sync with the primary")
                time.sleep(0.1)

    def stop(self, kill: bool = False) -> None:
        for process in reversed(list(self.processes.values())):  # (the Sentinels first: no failover now)
            if process.poll() is None:
                process.kill() if kill else process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """Yields a Redis URL; the server is gone afterwards."""
    try:
        try:
            from testcontainers.community.redis import RedisContainer
        except ImportError:
            from testcontainers.redis import RedisContainer

        container = RedisContainer("redis:7-alpine")
        container.start()
    except Exception:  # no Docker engine here: testcontainers raises within milliseconds
        server = RedisProcess().start()
        try:
            yield server.url
        finally:
            server.close()
        return
    try:
        host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
        yield f"redis://{host}:{port}/0"
    finally:
        container.stop()
