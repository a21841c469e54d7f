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
import torch

from services.worker import attention, paged_attention
from tests.engine_helpers import static_decode_steps_agree_with_the_per_request_path
from tests.paged_kernel_check import gathered_attention
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


def test_the_engines_choice_of_attention_follows_the_kernels_self_check(monkeypatch, caplog):
    """The decision, not the kernel: DecodeGraphs asks paged_attention.usable, which runs the kernel
    against plain attention first; a kernel that agrees is taken (here a stand-in with the kernel's
    contract, plain torch, so no Triton is needed), one that answers wrong or fails to run is logged
    and the steps gather instead, still exact. Off CUDA (no interpreter) it is never tried. That the
    engine runs the real kernel at every fixed-shape step is test_in_place_paged_decode_kernel_in_
    tritons_interpreter's (it counts the kernel's calls)."""
    cpu = torch.device("cpu")
    shape = (torch.float32, 4, 2, 16, 4)  # tests/engine_helpers.TINY_CONFIG's heads, block size 4
    assert not paged_attention.usable(cpu, *shape)  # the CPU without Triton's interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for module in (paged_attention, attention):
        monkeypatch.setattr(module, "paged_decode", gathered_attention)
    assert paged_attention.usable(cpu, *shape)
    assert static_decode_steps_agree_with_the_per_request_path(steps=12).in_place

    def off_by_a_little(*args):
        return gathered_attention(*args) * 1.01

    def not_compiling(*args):
        raise RuntimeError("PassManager::run failed")

    for broken, event in ((off_by_a_little, "paged_decode_kernel_self_check_failed"),
                          (not_compiling, "paged_decode_kernel_unavailable")):
        caplog.clear()
        for module in (paged_attention, attention):
            monkeypatch.setattr(module, "paged_decode", broken)
        with caplog.at_level("WARNING", logger="iterserve.worker"):
            assert not paged_attention.usable(cpu, *shape)
            assert not static_decode_steps_agree_with_the_per_request_path(steps=12).in_place
        assert event in caplog.text
