"""The in-place paged decode kernel (CUDA graphs' attention), checked without a GPU.

The CPU build of torch brings no Triton, so this installs Triton's wheel (no dependencies) into a
cache directory once, and runs tests/paged_kernel_check.py in a subprocess with Triton on its path
and TRITON_INTERPRET=1, where the kernel executes on CPU tensors. On a GPU benchmarks/gpu_check.py
checks the compiled kernel inside graph replays against eager steps.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.requirements import skip_unless_ci

ROOT = Path(__file__).resolve().parents[1]
TRITON = "triton==3.6.0"  # the release CUDA builds of torch 2.11-2.13 bring
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "iterserve-triton" / TRITON.split("==")[1]


def triton_path() -> Path:
    """A directory holding Triton (installed there on first use: a 190 MB wheel from the registry)."""
    if (CACHE / "triton" / "__init__.py").exists():
        return CACHE
    staging = CACHE.with_name(CACHE.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(staging),
                        TRITON], check=True, timeout=600, capture_output=True, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        shutil.rmtree(staging, ignore_errors=True)
        skip_unless_ci(f"cannot install {TRITON} into {staging}: {getattr(error, 'stderr', '') or error}")
    staging.rename(CACHE)
    return CACHE


@pytest.mark.slow  # about 40 s in the interpreter (plus the wheel's download, once)
def test_in_place_paged_decode_kernel_in_tritons_interpreter():
    """The kernel equals SDPA over gathered blocks (float32 to rounding, bfloat16 to one step of
    its output), reads nothing outside a row's context, and the engine's fixed-shape decode steps
    through it equal the per-request path (tests/paged_kernel_check.py says what each check does)."""
    path = triton_path()
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(path), os.environ.get("PYTHONPATH")))))
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "paged_kernel_check.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=540)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.rstrip().endswith("ok")
