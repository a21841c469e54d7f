"""The project's own CPU kernels for projections over a GGUF's packed weights (cpu_kernels.cpp), and
which kernel `--quantization gguf` uses on this host.

torch's int4 kernel (aten::_weight_int4pack_mm_for_cpu) is fast where torch runs AVX-512 kernels and
slow on AVX2 (a SmolLM2-135M decode step of one row in bfloat16: 10.5 ms on Zen 5, 35.3 ms on a Zen
3 AMD EPYC, against 27.8 there with these kernels in float32): there the weights are multiplied by
cpu_kernels.cpp, built once per torch version and source (about 12 s; with torch's own C++ extension
builder, into ~/.cache/iterserve/kernels) and loaded as torch ops. ITERSERVE_PACKED_KERNEL chooses:
"auto" (the default: these kernels where torch's CPU capability is AVX2, else torch's), "native"
(these wherever they build: to measure a host class), "int4" (torch's). Where they cannot be built
(no compiler, no AVX2/FMA/F16C) torch's kernel serves, and the worker says why at start. Where the
CPU has AVX-512 they run a 512-bit form (vector_bits): on the Intel class a one-row step 15.1 ms
against 16.9 in the AVX2 form, and 12.7 with torch's int4 kernel in bfloat16, which `auto` keeps
there."""

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
CHOICE = "ITERSERVE_PACKED_KERNEL"
CHOICES = ("auto", "native", "int4")
NEEDED_FLAGS = ("avx2", "fma", "f16c")
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c",
                 "-ffp-contract=off",  # (each sum as written: the same bits for a row in every block size)
                 "-fopenmp"]  # (at::parallel_for's threads: torch's own libgomp, loaded by its soname)


def chosen_kernel() -> str:
    """"native" or "int4": the kernel this process's packed projections use."""
    choice = os.environ.get(CHOICE, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{CHOICE}={choice!r}: one of {', '.join(CHOICES)}")
    if choice == "int4" or (choice == "auto" and torch.backends.cpu.get_cpu_capability() != "AVX2"):
        return "int4"
    return "native" if loaded() else "int4"


def packed_dtype() -> torch.dtype:
    """The compute dtype `--dtype auto` gives packed weights: the chosen kernel's fast path (float32
    for the project's, bfloat16 for torch's int4 kernel)."""
    return torch.float32 if chosen_kernel() == "native" else torch.bfloat16


@functools.cache
def cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none): the host class's vendor, family and flags."""
    try:
        with open("/proc/cpuinfo") as text:
            return text.read()
    except OSError:
        return ""


def _cpu_flags() -> set[str]:
    return set(cpuinfo().split())


def build_directory() -> Path:
    """Where this source, for this torch and these flags, is built (one directory each)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                            + " ".join(COMPILE_FLAGS).encode()).hexdigest()[:16]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "iterserve" / "kernels" / digest


@functools.cache
def loaded() -> bool:
    """Whether the kernels are loaded as torch.ops.iterserve_cpu (built first where not yet)."""
    missing = [flag for flag in NEEDED_FLAGS if flag not in _cpu_flags()]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        log.warning("event=packed_kernel_unavailable reason=cpu machine=%s missing=%s (torch's int4 kernel serves)",
                    platform.machine(), ",".join(missing))
        return False
    directory = build_directory()
    digest = directory.name
    for attempt in (1, 2):
        try:
            _build_and_load(directory, f"iterserve_cpu_{digest}")
            break
        except Exception as error:  # (no compiler or ninja, a read-only home: torch's kernel serves)
            if attempt == 1 and directory.is_dir():  # (a build cut off by a kill may leave a broken library)
                log.warning("event=packed_kernel_rebuild error=%r", error)
                shutil.rmtree(directory, ignore_errors=True)
                continue
            log.warning("event=packed_kernel_unavailable reason=build error=%r (torch's int4 kernel serves)", error)
            return False
    log.info("event=packed_kernel_loaded directory=%s", directory)
    return True


def _build_and_load(directory: Path, name: str) -> None:
    """Built where not yet, by one process at a time (workers starting together build it once)."""
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as guard:
        # torch's builder has a lock of its own, a file a killed builder leaves behind for every later
        # one to wait on forever; this one the kernel releases with its holder, and whoever holds it
        # may remove torch's: no live builder holds that without holding this.
        fcntl.flock(guard, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        load(name=name, sources=[str(SOURCE)], extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(directory), is_python_module=False, verbose=False)


def vector_bits(requested: int = 0) -> int:
    """The width of the kernels' vectors in this process: 512 where the CPU has AVX-512 (F, BW), else
    256 (AVX2); `requested` 256 holds them to the AVX2 form (to measure it; a row's bits differ between
    the forms, so one process keeps one)."""
    return torch.ops.iterserve_cpu.vector_bits(requested)


def nibble_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
              zero_point: int) -> torch.Tensor:
    """x [T, K] float32 @ W.T, W [N, K] of 4-bit q [N, K / 2] (byte j of a group of 32: q[j] low,
    q[j + 16] high), w = scale (q - zero_point) + offset per group (float16 [N, K / 32] each;
    offsets None: 0)."""
    return torch.ops.iterserve_cpu.nibble_mm(x, q, scales, offsets, zero_point)


def byte_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 @ W.T, W [N, K] of signed bytes q [N, K], w = scale q per group of 32."""
    return torch.ops.iterserve_cpu.byte_mm(x, q, scales)
