"""A private Redis for tests: a container when a Docker engine answers, else a redis-server child."""

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

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
