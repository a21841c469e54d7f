"""benchmarks/device_kit.py's dry run: a kit built here for this host's Python, then `run` from an
interpreter that holds torch and numpy and nothing else of ours (as the device's does), offline:
the fresh environment gets the rest from the kit's wheels, the system its Redis from the kit, and
benchmarks/gpu_system.py runs through it on the CPU."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What the device's interpreter stands for here: torch, numpy and what torch itself imports.
BASE_PACKAGES = ("torch", "functorch", "torchgen", "numpy", "numpy.libs", "sympy", "mpmath", "networkx", "filelock",
                 "fsspec", "typing_extensions.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def device_like_interpreter(directory: Path) -> Path:
    """A venv whose only packages (through a .pth file) are links to this one's torch and numpy."""
    site = Path(sysconfig.get_paths()["purelib"])
    base = directory / "base-site"
    base.mkdir(parents=True)
    for entry in site.iterdir():
        if entry.name in BASE_PACKAGES or any(entry.name.startswith(name.split(".")[0] + "-") and
                                              entry.name.endswith(".dist-info") for name in BASE_PACKAGES):
            (base / entry.name).symlink_to(entry)
    venv = directory / "device-python"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(venv_site) / "device-torch.pth").write_text(str(base) + "\n")
    return python


def test_the_kit_installs_offline_beside_a_bare_torch_and_the_system_runs(tmp_path):
    kit = tmp_path / "kit"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run([sys.executable, "benchmarks/device_kit.py", "build", "--kit", str(kit),
                            "--python-version", version], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads((kit / "manifest.json").read_text())
    assert not any(wheel.startswith(("torch-", "numpy-")) for wheel in manifest["wheels"]), manifest["wheels"]
    size = sum(path.stat().st_size for path in kit.rglob("*") if path.is_file())
    assert size < 60 * 2**20, f"the kit is {size / 2**20:.1f} MiB: it would not travel with a device run"

    python = device_like_interpreter(tmp_path)
    bare = subprocess.run([str(python), "-c", "import torch, numpy\ntry:\n import redis\nexcept ImportError:\n print('bare')"],
                          capture_output=True, text=True, timeout=120)
    assert bare.stdout.strip() == "bare", bare.stderr[-2000:]

    out = tmp_path / "out"
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PIP_", "VIRTUAL_ENV"))}
    command = [str(python), "benchmarks/device_kit.py", "run", "--kit", str(kit), "--device", "cpu", "--out", str(out),
               "--environment", str(tmp_path / "env"), "--", "--concurrency", "1,2", "--requests-per-client", "1"]
    if shutil.which("unshare") and shutil.which("ip") and os.geteuid() == 0:  # offline: a network namespace of
        command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "offline", *command]  # its own
    ran = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    assert f"redis-server: {kit / 'redis' / 'redis-server'}" in ran.stderr, ran.stderr[-2000:]
    report = json.loads((out / "gpu_system_cpu.json").read_text())
    level = report["shapes"]["smollm2-135m"]["levels"]["2"]
    assert level["served"]["completed"] == 4 and level["engine_alone"]["unfinished"] == 0
    shutil.rmtree(tmp_path / "env", ignore_errors=True)
