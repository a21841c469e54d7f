"""A Docker engine of the test's own, and the images the compose deployment needs, on a machine
with no image registry (tests/test_docker.py).

- Engine: Debian's `docker.io` (installed here when missing), started as `dockerd` with its own
  data root (kept under the cache directory, so the base images are built once per machine), no
  default bridge and no iptables: every container uses the host's network and talks on loopback.
- Base images: Debian bookworm from `debootstrap` then `docker import`; on it a Python base (Debian's
  python3 in a venv) and a Redis image (Debian's redis-server). The machine's extra CA certificates
  go into the Python base, so pip inside builds reaches PyPI through this machine's egress proxy.
- torch: the host's CPU wheel is served as a PEP 503 index on 127.0.0.1 (the Dockerfile's
  TORCH_INDEX), so the image does not download the CUDA build's gigabytes.
"""

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.requirements import skip_unless_ci

CACHE = Path(os.environ.get("ITERSERVE_DOCKER_CACHE", Path.home() / ".cache" / "iterserve-docker"))
DEBIAN_IMAGE = "local/debian:bookworm"
PYTHON_IMAGE = "local/python:3.11-bookworm"
REDIS_IMAGE = "local/redis:bookworm"
PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
WHEELS = Path("/opt/wheels")  # where this machine keeps its CPU torch wheel (pip's find-links)


def run(*command: str, timeout: float = 600, env: dict | None = None, check: bool = True,
        input: bytes | None = None) -> subprocess.CompletedProcess:
    completed = subprocess.run(command, capture_output=True, timeout=timeout, env=env, input=input)
    if check and completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}):\n"
                           f"{completed.stdout.decode(errors='replace')[-3000:]}\n"
                           f"{completed.stderr.decode(errors='replace')[-3000:]}")
    return completed


def ensure_packages() -> None:
    """Debian's docker.io, docker-compose and debootstrap; skip (fail under CI) where they cannot be had."""
    missing = [package for binary, package in PACKAGES.items() if shutil.which(binary) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        skip_unless_ci(f"needs {', '.join(missing)} (apt-get install as root)")
    run("apt-get", "update", "-qq", timeout=600)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, timeout=900,
        env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


class DockerEngine:
    """dockerd with its own data root, exec root and socket; `env` points clients at it."""

    def __init__(self) -> None:
        self.data_root = CACHE / "data"
        self.run_dir = Path(tempfile.mkdtemp(prefix="iterserve-dockerd-"))
        self.socket = self.run_dir / "docker.sock"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.socket}", COMPOSE_INTERACTIVE_NO_CLI="1",
                        DOCKER_BUILDKIT="0")
        self.process: subprocess.Popen | None = None
        self.log_path = self.run_dir / "dockerd.log"

    def __enter__(self) -> "DockerEngine":
        if os.geteuid() != 0:
            skip_unless_ci("dockerd needs root")
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false", f"--data-root={self.data_root}",
             f"--exec-root={self.run_dir / 'exec'}", f"--pidfile={self.run_dir / 'dockerd.pid'}",
             f"--host=unix://{self.socket}"],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while run("docker", "info", env=self.env, check=False, timeout=30).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        netns = self.run_dir / "exec" / "netns" / "default"
        if netns.exists():
            subprocess.run(["umount", str(netns)], capture_output=True, timeout=30)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def docker(self, *arguments: str, timeout: float = 600, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess:
        return run("docker", *arguments, env=self.env, timeout=timeout, check=check, input=input)

    def has_image(self, name: str) -> bool:
        return self.docker("image", "inspect", name, check=False, timeout=60).returncode == 0

    def build(self, tag: str, context: Path, dockerfile: str = "Dockerfile", timeout: float = 1800,
              **build_args: str) -> float:
        """docker build on the host's network; returns the seconds it took."""
        arguments = [part for name, value in build_args.items() for part in ("--build-arg", f"{name}={value}")]
        started = time.monotonic()
        self.docker("build", "--network", "host", "-t", tag, "-f", str(context / dockerfile), *arguments,
                    str(context), timeout=timeout)
        return time.monotonic() - started


def ensure_base_images(engine: DockerEngine) -> dict[str, float]:
    """Debian, Python and Redis images, built once per data root; the seconds each build took."""
    took: dict[str, float] = {}
    if not engine.has_image(DEBIAN_IMAGE):
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="iterserve-debootstrap-") as root:
            run("debootstrap", "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian", timeout=1200)
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            imported = subprocess.run(["docker", "import", "-", DEBIAN_IMAGE], stdin=tar.stdout, capture_output=True,
                                      env=engine.env, timeout=600)
            tar.wait(timeout=600)
            if imported.returncode != 0:
                raise RuntimeError(f"docker import failed: {imported.stderr.decode(errors='replace')}")
        took["debian"] = time.monotonic() - started
    if not engine.has_image(PYTHON_IMAGE) or not engine.has_image(REDIS_IMAGE):
        with tempfile.TemporaryDirectory(prefix="iterserve-bases-") as directory:
            context = Path(directory)
            certificates = context / "ca"
            certificates.mkdir()
            for certificate in EXTRA_CA_DIR.glob("*.crt") if EXTRA_CA_DIR.is_dir() else ():
                shutil.copy(certificate, certificates / certificate.name)
            (context / "Dockerfile.python").write_text(f"""FROM {DEBIAN_IMAGE}
COPY ca/ /usr/local/share/ca-certificates/
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
        python3 python3-venv ca-certificates libgomp1 && update-ca-certificates && rm -rf /var/lib/apt/lists/* \\
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_CERT=/etc/ssl/certs/ca-certificates.crt
""")
            (context / "Dockerfile.redis").write_text(f"""FROM {DEBIAN_IMAGE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
        redis-server && rm -rf /var/lib/apt/lists/*
CMD ["redis-server"]
""")
            took["python"] = engine.build(PYTHON_IMAGE, context, "Dockerfile.python")
            took["redis"] = engine.build(REDIS_IMAGE, context, "Dockerfile.redis")
    return took


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def torch_index():
    """The host's CPU torch wheel, and what it depends on, as a PEP 503 index on 127.0.0.1: its URL."""
    wheels = sorted(WHEELS.glob("torch-*+cpu-*.whl"))
    if not wheels:
        skip_unless_ci(f"no CPU torch wheel in {WHEELS}")
    with tempfile.TemporaryDirectory(prefix="iterserve-torch-index-") as directory:
        root = Path(directory)
        downloads = root / "downloads"
        # torch's own dependencies (small) from PyPI, for the image's Python (3.11, manylinux x86_64).
        run("pip", "download", "--quiet", "--dest", str(downloads), "--only-binary=:all:", "--python-version", "3.11",
            "--platform", "manylinux_2_28_x86_64", str(wheels[-1]), timeout=900)
        for wheel in downloads.glob("*.whl"):
            project = wheel.name.split("-")[0].lower().replace("_", "-")
            (root / project).mkdir(exist_ok=True)
            shutil.copy(wheel, root / project / wheel.name)
        for project in [path for path in root.iterdir() if path.is_dir() and path.name != "downloads"]:
            links = "".join(f'<a href="{wheel.name}">{wheel.name}</a>\n' for wheel in project.glob("*.whl"))
            (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                 functools.partial(_QuietHandler, directory=str(root)))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            server.server_close()
