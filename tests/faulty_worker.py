"""A worker whose engine breaks after some steps: a test-only stand-in for a device that stops
computing (a CUDA device-side assert, a poisoned context). Nothing in services/ knows about it.

    ITERSERVE_TEST_BREAK_AFTER_STEPS=12 python -m tests.faulty_worker worker

runs `iterserve worker` with the model's forward pass (or, with --executor emulated, the emulated
step) raising from its 13th call on.
"""

import os
import sys

from services.cli import main
from services.worker.emulated import EmulatedEngine
from services.worker.model import Llama

INJECTED = "CUDA error: device-side assert triggered (injected by tests/faulty_worker.py)"


def break_after(steps: int) -> None:
    for owner, name in ((Llama, "forward"), (EmulatedEngine, "step")):  # whichever the worker runs
        _break(owner, name, steps)


def _break(owner: type, name: str, steps: int) -> None:
    method = getattr(owner, name)
    calls = 0

    def breaking(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > steps:
            raise RuntimeError(INJECTED)
        return method(self, *args, **kwargs)

    setattr(owner, name, breaking)


if __name__ == "__main__":
    break_after(int(os.environ["ITERSERVE_TEST_BREAK_AFTER_STEPS"]))
    main(sys.argv[1:])
