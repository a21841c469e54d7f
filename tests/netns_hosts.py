"""Hosts of their own on this machine: one network namespace each, a veth pair into a bridge, an
address from 198.18.0.0/15 (the range reserved for benchmarking networks: never a private or public
one), traffic only among them and this process (the bridge's address). A host's link can be cut
and restored (its bridge-side end down and up), as a pulled cable or a partition would.

    with Hosts(["redis", "worker-1"]) as hosts:
        hosts.run("redis", ["redis-server", ...])          # a process inside the host
        hosts.address("redis")                             # 198.18.X.Y
        hosts.cut("worker-1"); hosts.restore("worker-1")

Needs root (ip netns). Every namespace, link and process it made is removed on exit, whatever happened.
"""

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import IO

from services.launcher import die_with_parent

SUBNET = "198.18.{}.{}"
STOP_TIMEOUT_SECONDS = 20


def netns_available() -> str:
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"isprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return ""


def ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True, timeout=10)


class Hosts:
    def __init__(self, names: list[str], directory: Path, subnet: int = 0) -> None:
        self.names, self.directory, self.subnet = list(names), directory, subnet
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"isbr{tag}"
        self.namespaces = {name: f"is{tag}-{index}" for index, name in enumerate(self.names)}
        self.host_ends = {name: f"ish{tag}-{index}" for index, name in enumerate(self.names)}
        self.processes: list[tuple[str, subprocess.Popen, IO[bytes], Path]] = []
        self.made: list[str] = []  # namespaces made, for the cleanup

    def address(self, name: str) -> str:
        return SUBNET.format(self.subnet, 10 + self.names.index(name))

    @property
    def gateway_address(self) -> str:
        """This process's address on the bridge (the test's own "host")."""
        return SUBNET.format(self.subnet, 1)

    def __enter__(self) -> "Hosts":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index, name in enumerate(self.names):
                namespace, host_end, inner = self.namespaces[name], self.host_ends[name], f"eth{index}"
                ip("netns", "add", namespace)
                self.made.append(namespace)
                ip("link", "add", host_end, "type", "veth", "peer", "name", inner, "netns", namespace)
                ip("link", "set", host_end, "master", self.bridge)
                ip("link", "set", host_end, "up")
                ip("-n", namespace, "addr", "add", f"{self.address(name)}/24", "dev", inner)
                ip("-n", namespace, "link", "set", inner, "up")
                ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def run(self, name: str, command: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        """A process inside host `name`, in its own session (killed whole at the end), logging to a file."""
        log_path = self.directory / f"{log_name}.log"
        log_file = open(log_path, "ab")
        process = subprocess.Popen(["ip", "netns", "exec", self.namespaces[name], *command], env=env,
                                   stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, preexec_fn=die_with_parent)
        self.processes.append((log_name, process, log_file, log_path))
        return process

    def log(self, log_name: str) -> str:
        return "".join(path.read_text(errors="replace") for name, _, _, path in self.processes
                       if name == log_name and path.exists())

    def report(self, log_names: list[str]) -> str:
        """Each named process: running or its exit status, and the end of its log (for a failure)."""
        lines = []
        for name, process, _, _ in self.processes:
            if name in log_names:
                state = "running" if process.poll() is None else f"exited {process.returncode}"
                lines.append(f"--- {name} ({state})\n{self.log(name)[-4000:]}")
        return "\n".join(lines)

    def cut(self, name: str) -> None:
        ip("link", "set", self.host_ends[name], "down")

    def restore(self, name: str) -> None:
        ip("link", "set", self.host_ends[name], "up")

    def close(self) -> None:
        for _, process, _, _ in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
        for _, process, log_file, _ in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_TIMEOUT_SECONDS)
            log_file.close()
        for name in self.names:  # (deleting one end of a veth pair deletes both)
            subprocess.run(["ip", "link", "del", self.host_ends[name]], capture_output=True, timeout=10)
        for namespace in self.made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)
