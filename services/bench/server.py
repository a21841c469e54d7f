"""`iterserve up` as a user runs it, in a child process, for the experiments.

Each system gets a free port and a private data directory (so its Redis is private too). The
child runs in its own session: stop() sends SIGTERM as Ctrl-C would, then SIGKILLs the whole
process group if anything is left, and always reaps.
"""

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
from pathlib import Path

from services.launcher import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 240
STOP_TIMEOUT_SECONDS = 40
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _get_json(url: str, timeout: float = 3.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


class ServerProcess:
    def __init__(self, *, policy: str = "iteration", workers: int = 1, kv_blocks: int = 2048,
                 threads: int | None = None, extra_args: tuple[str, ...] = (), log_path: Path | None = None,
                 env: dict[str, str] | None = None, checkout: Path = REPO) -> None:
        """checkout: the source tree to run (another checkout: an earlier version side by side)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy, self.workers, self.kv_blocks, self.threads = policy, workers, kv_blocks, threads
        self.checkout = checkout
        self.data_dir = tempfile.mkdtemp(prefix="iterserve-bench-")
        self.log_path = log_path or Path(self.data_dir) / "up.log"
        self.command = [sys.executable, "-m", "services.cli", "up", "--port", str(self.port), "--workers", str(workers),
                        "--policy", policy, "--kv-blocks", str(kv_blocks), *extra_args]
        if threads:
            self.command += ["--threads", str(threads)]
        self.env = dict(os.environ) | {"ITERSERVE_DATA_DIR": self.data_dir, "PYTHONUNBUFFERED": "1"}
        for variable in ("REDIS_URL", "ITERSERVE_PORT", "ITERSERVE_WORKERS", "ITERSERVE_POLICY", "ITERSERVE_THREADS"):
            self.env.pop(variable, None)
        self.env |= env or {}
        self.process: subprocess.Popen | None = None
        self._log_file = None

    def describe(self) -> str:
        threads = self.threads or max(1, (os.cpu_count() or 1) // self.workers)
        return f"--policy {self.policy} --workers {self.workers} ({threads} threads each) --kv-blocks {self.kv_blocks}"

    def __enter__(self) -> "ServerProcess":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        if self.process is not None:
            raise RuntimeError("this system is already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command, cwd=self.checkout, env=self.env, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"iterserve up exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            status, body = _get_json(f"{self.url}/health", timeout=2)
            if status == 200 and body.get("workers", 0) >= self.workers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"iterserve up not healthy after {timeout:.0f}s:\n{self.log()[-3000:]}")
            time.sleep(0.25)

    def wait_idle(self, timeout: float = 120.0) -> bool:
        """Until the scheduler holds no request (a run's cancelled leftovers drain); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = _get_json(f"{self.url}/health", timeout=2)
            if status == 200 and body.get("waiting") == 0 and body.get("running") == 0:
                return True
            time.sleep(0.25)
        return False

    @property
    def redis_url(self) -> str:
        """The private Redis `up` started (it logs its URL when everything is up)."""
        match = re.search(r"event=up redis=(\S+)", self.log())
        if match is None:
            raise RuntimeError("iterserve up did not log its Redis URL")
        return match.group(1)

    def components(self) -> dict[int, str]:
        """pid -> redis | scheduler | worker | gateway | keep-awake, for `up`'s children (Linux /proc)."""
        found: dict[int, str] = {}
        if self.process is None:
            return found
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                if parent != self.process.pid:
                    continue
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            name = next((part for part in ("scheduler", "worker", "gateway") if f"services.cli {part}" in command),
                        "redis" if "redis-server" in command else
                        "keep-awake" if "services.cli keep-awake" in command else "other")
            found[int(entry.name)] = name
        return found

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by each kind of component, workers summed."""
        totals: dict[str, float] = {}
        for pid, name in self.components().items():
            try:
                seconds = process_cpu_seconds(pid)
            except (OSError, ValueError, IndexError):
                continue
            totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def stop(self) -> None:
        if self.process is None:
            return
        self.terminate()
        self.kill_group_and_reap()

    def terminate(self) -> None:
        """SIGTERM `up`, as a user's Ctrl-C would, and wait (bounded) for it to exit."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                pass

    def kill_group_and_reap(self) -> None:
        try:  # whatever is left of the group goes
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=10)
        self.process = None
        if self._log_file is not None:
            self._log_file.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
