"""What a lent GPU machine lacks, built here, and the one command that runs there (issue: the whole
system on a GPU).

The device machine has Python with torch (and numpy, aiohttp, tokenizers...: its image's list is in
the device tool's KINDS.md) and no network; what travels with a device run is the working tree plus
at most 64 MiB carried. So:

    .venv/bin/python benchmarks/device_kit.py build                     # here: .device_kit/ (git-ignored)
    run(command="python3 benchmarks/device_kit.py run --kit .device_kit", carry=[".device_kit"])  # there

`build` downloads, for the device's Python (3.12 by default, as seen there), the wheels of every
package the services import, at the versions this checkout's .venv tested (torch excepted: the
device's own is used; numpy too unless --with-numpy: the device image has numpy 2), and copies this
host's redis-server with the libraries it links beyond glibc (a wrapper sets LD_LIBRARY_PATH).

`run` makes a fresh environment beside the interpreter's own torch (a venv whose .pth file appends
the interpreter's site-packages: packages there satisfy requirements, the kit supplies the rest,
nothing of the device's is changed), installs the kit offline into it, puts the kit's redis-server
on PATH and runs benchmarks/gpu_system.py (and, with --gpu-check, benchmarks/gpu_check.py) in it,
each under its own timeout, writing into --out ($OUT there). It prints what each phase took.

A dry run here (tests/test_device_kit.py): a kit built for this host's Python, and `run --device cpu`
from an interpreter that has torch and numpy only, offline.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_KIT = REPO / ".device_kit"
DEVICE_PYTHON = "3.12"  # the device image's python3 (3.12.3, /opt/torch/.venv), as sessions saw it
# What the services import (pyproject's dependencies but torch), plus psutil (benchmarks' /proc reads).
PACKAGES = ("gguf", "tokenizers", "safetensors", "jinja2", "redis", "hiredis", "msgpack", "aiohttp", "pydantic",
            "prometheus-client", "uvloop", "pyyaml", "llguidance", "jsonschema", "psutil")
# Wheels for a glibc up to this host's (2.36; the device image's python 3.12.3 is Ubuntu 24.04's, glibc 2.39).
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)))
GLIBC_LIBRARIES = ("linux-vdso", "libc.so", "libm.so", "ld-linux", "libpthread.so", "libdl.so", "librt.so")
KIT_LIMIT_BYTES = 60 * 2**20  # a device run carries at most 64 MiB, the working tree included
INSTALL_TIMEOUT_S = 180


def log(message: str) -> None:
    print(f"device_kit: {message}", file=sys.stderr, flush=True)


def pip_environment() -> dict[str, str]:
    """pip on its own: no configuration file's indexes, find-links or constraints."""
    return dict(os.environ) | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


# Build (here)

def tested_versions(packages: tuple[str, ...]) -> list[str]:
    """name==version of each package as this interpreter has it (the versions the tests ran)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in packages:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    return pins


def build(kit: Path, python_version: str, with_numpy: bool) -> dict:
    if kit.exists():
        shutil.rmtree(kit)
    wheels = kit / "wheels"
    wheels.mkdir(parents=True)
    packages = PACKAGES + (("numpy",) if with_numpy else ())
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(wheels),
               "--python-version", python_version, "--implementation", "cp",
               *(f"--platform={platform}" for platform in PLATFORMS),
               *tested_versions(packages)]
    subprocess.run(command, check=True, timeout=600)  # (pip's own configuration: this host's package indexes)
    if not with_numpy:  # (numpy comes in as gguf's dependency: the device's own is used)
        for wheel in wheels.glob("numpy-*.whl"):
            wheel.unlink()
    redis_files = copy_redis_server(kit / "redis")
    manifest = {"python_version": python_version, "packages": list(packages), "with_numpy": with_numpy,
                "wheels": sorted(wheel.name for wheel in wheels.glob("*.whl")), "redis": redis_files,
                "built_on": os.uname().nodename, "built_unix": time.time()}
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(path.stat().st_size for path in kit.rglob("*") if path.is_file())
    manifest["bytes"] = size
    if size > KIT_LIMIT_BYTES:
        raise SystemExit(f"device_kit: the kit is {size / 2**20:.1f} MiB, over the {KIT_LIMIT_BYTES / 2**20:.0f} MiB "
                         "a device run can carry beside the working tree")
    log(f"built {kit}: {len(manifest['wheels'])} wheels for Python {python_version}, redis-server, "
        f"{size / 2**20:.1f} MiB")
    return manifest


def copy_redis_server(directory: Path) -> list[str]:
    """This host's redis-server, the libraries it links beyond glibc, and a wrapper that finds them."""
    found = shutil.which("redis-server")
    if found is None:
        raise SystemExit("device_kit: no redis-server here to copy (apt-get install redis-server)")
    binary = Path(found).resolve()  # (Debian's is a link to the multi-call redis-check-rdb: named by argv[0])
    (directory / "bin").mkdir(parents=True)
    (directory / "lib").mkdir()
    shutil.copy2(binary, directory / "bin" / "redis-server")
    copied = ["bin/redis-server"]
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True, timeout=30).stdout
    for line in linked.splitlines():
        parts = line.split("=>")
        if len(parts) != 2 or any(parts[0].strip().startswith(name) for name in GLIBC_LIBRARIES):
            continue
        library = parts[1].split("(")[0].strip()
        if library:
            shutil.copy2(Path(library).resolve(), directory / "lib" / Path(library).name)
            copied.append(f"lib/{Path(library).name}")
    wrapper = directory / "redis-server"
    wrapper.write_text('#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\n'
                       'LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/redis-server" "$@"\n')
    wrapper.chmod(0o755)
    return copied


# Run (there)

def base_site_packages() -> str:
    """Where this interpreter's torch lives (the device's own, never replaced)."""
    import torch

    return str(Path(torch.__file__).parent.parent)  # (not resolved: the folder it was imported from)


def make_environment(kit: Path, target: Path) -> Path:
    """A fresh venv beside this interpreter's torch, the kit installed into it offline; its python."""
    manifest = json.loads((kit / "manifest.json").read_text())
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != running:
        raise SystemExit(f"device_kit: the kit is for Python {manifest['python_version']}, this is {running}: "
                         f"build it with --python-version {running}")
    if target.exists():
        shutil.rmtree(target)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=60)
    python = target / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    (site / "device-base.pth").write_text(base_site_packages() + "\n")  # appended after the venv's own
    # (pip from this interpreter, installing into the venv: it sees the base's packages as installed)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                    "--find-links", str(kit / "wheels"), *manifest["packages"]],
                   check=True, env=pip_environment(), timeout=INSTALL_TIMEOUT_S)
    return python


def phase(name: str, command: list[str], env: dict[str, str], timeout: float) -> int:
    started = time.monotonic()
    log(f"{name}: {' '.join(command)}")
    try:
        code = subprocess.run(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = 124
    log(f"{name}: exit {code} after {time.monotonic() - started:.0f} s")
    return code


def run(kit: Path, out: Path, device: str, gpu_check: bool, gpu_system_args: list[str], environment: Path) -> int:
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    python = make_environment(kit, environment)
    log(f"environment ready in {time.monotonic() - started:.0f} s: {environment}")
    env = dict(os.environ) | {"PATH": f"{kit.resolve() / 'redis'}{os.pathsep}{os.environ.get('PATH', '')}",
                              "PYTHONPATH": str(REPO), "OUT": str(out)}
    log(f"redis-server: {shutil.which('redis-server', path=env['PATH'])}")
    codes = {}
    if gpu_check:
        codes["gpu_check"] = phase("gpu_check", [str(python), "benchmarks/gpu_check.py", "--out",
                                                 str(out / "gpu_check.json")] + ([] if device == "cuda" else ["--cpu"]),
                                   env, 300)
    codes["gpu_system"] = phase("gpu_system", [str(python), "benchmarks/gpu_system.py", "--device", device, "--out",
                                               str(out), *gpu_system_args], env, 330)
    log(f"done in {time.monotonic() - started:.0f} s: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    return max(codes.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    building = verbs.add_parser("build", help="here: wheels and redis-server for the device")
    building.add_argument("--kit", type=Path, default=DEFAULT_KIT)
    building.add_argument("--python-version", default=DEVICE_PYTHON)
    building.add_argument("--with-numpy", action="store_true", help="also numpy (the device image has it)")
    running = verbs.add_parser("run", help="there: install the kit into a fresh environment, run the benchmarks")
    running.add_argument("--kit", type=Path, default=DEFAULT_KIT)
    running.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "results"))
    running.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    running.add_argument("--gpu-check", action="store_true", help="benchmarks/gpu_check.py first (3-5 minutes)")
    running.add_argument("--environment", type=Path, default=Path("/tmp/iterserve-device-env"))
    running.add_argument("gpu_system_args", nargs="*", help="more benchmarks/gpu_system.py options (after --)")
    args = parser.parse_args(argv)
    if args.verb == "build":
        build(args.kit, args.python_version, args.with_numpy)
        return 0
    return run(args.kit, args.out, args.device, args.gpu_check, args.gpu_system_args, args.environment)


if __name__ == "__main__":
    sys.exit(main())
