"""`iterserve up` as the user runs it, in a subprocess, for end-to-end tests."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import urllib.error
import urllib.request

import psutil

from tests.redis_server import free_port

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_SECONDS = 180
STOP_TIMEOUT_SECONDS = 40


class System:
    def __init__(self, *args: str, workers: int = 2, kv_blocks: int = 256, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.data_dir = tempfile.mkdtemp(prefix="iterserve-up-")
        self.log_path = Path(self.data_dir) / "up.log"
        self.command = [sys.executable, "-m", "services.cli", "up", "--port", str(self.port), "--workers", str(workers),
                        "--kv-blocks", str(kv_blocks), *args]
        self.env = dict(os.environ) | {"ITERSERVE_DATA_DIR": self.data_dir, "PYTHONUNBUFFERED": "1"} | (env or {})
        self.env.pop("REDIS_URL", None)
        self.process: subprocess.Popen | None = None
        self._log_file = None

    def __enter__(self) -> "System":
        self._log_file = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.wait_healthy(START_TIMEOUT_SECONDS)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"iterserve up exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout}s:\n{self.log()[-4000:]}")
            time.sleep(0.25)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> list[psutil.Process]:
        """SIGTERM `up`, as a user's Ctrl-C would; returns the processes it left alive (killed)."""
        if self.process is None:
            return []
        children = self.descendants()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(children, timeout=5)
        leftovers = [process for process in alive if process.is_running()]
        try:  # whatever happened, the test leaves nothing behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for process in leftovers:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=10)
        self._log_file.close()
        self.process = None
        return leftovers
